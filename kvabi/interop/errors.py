"""Typed errors of the engine adapters. All are KvabiError (and ValueError)."""

from __future__ import annotations

from kvabi.abi.errors import KvabiError


class InteropError(KvabiError, ValueError):
    """An engine's cache or state that cannot be mapped to or from kvabi; base of the below."""


class StateMagicError(InteropError):
    """A llama.cpp state buffer whose magic word is not the one its form starts with."""


class StateTruncatedError(InteropError):
    """A llama.cpp state buffer that ends before its grammar does."""


class StateFormatError(InteropError):
    """Well-formed bytes the adapter cannot use: trailing bytes, several seqs, position gaps."""


class UnsupportedTypeError(InteropError):
    """A ggml type (or K/V type pair) no kvabi preset describes."""


class ModelMismatchError(InteropError):
    """State or cache geometry (layer count, row size, heads) that disagrees with the model."""


class OffloadNamespaceError(InteropError):
    """A vLLM offload folder whose config.json does not hash to its name, or that is not the
    namespace (model, dtype, block sizes, layers, format) the caller expects."""


class OffloadSizeError(InteropError):
    """A vLLM offload file whose size is not the one its namespace and model give."""


class OffloadMissingError(InteropError):
    """A vLLM offload file (or folder) that is not there."""
