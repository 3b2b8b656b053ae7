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


class BlobError(InteropError):
    """An LMCache EncodedKV blob that cannot be read; base of the below."""


class BlobHeaderTruncatedError(BlobError):
    """An EncodedKV blob that ends inside its header (fixed 76 bytes or the fields after)."""


class BlobMagicError(BlobError):
    """An EncodedKV blob whose first 8 bytes are not LMCache's magic `LMCKV\\x01\\x00\\x01`."""


class BlobVersionError(BlobError):
    """An EncodedKV header version (or scale scope) this reader does not know."""


class BlobDtypeError(BlobError):
    """An EncodedKV dtype id that is not in LMCache's DTYPE_TO_INT table."""


class BlobPayloadTruncatedError(BlobError):
    """An EncodedKV blob shorter than its header's K + V + scale payload lengths."""


class BlobChecksumError(BlobError):
    """An EncodedKV blob whose payload's CRC32 is not the one its header declares."""


class BlobShapeError(BlobError):
    """A well-formed EncodedKV blob whose payload does not fit its heads and head size."""
