"""Typed errors of the model loaders. All are KvabiError (and ValueError), raised while the
config is read, before any weight is loaded."""

from __future__ import annotations

from kvabi.abi.errors import KvabiError


class CheckpointError(KvabiError, ValueError):
    """A GGUF file, HF folder or config that kvabi cannot load; the base of the errors below."""


class UnknownArchitectureError(CheckpointError):
    """An architecture (GGUF `general.architecture`, HF `model_type`) kvabi has no model for."""


class MissingFieldError(CheckpointError):
    """A field the architecture needs is absent: a GGUF metadata key or tensor, a config.json
    key."""
