"""Typed errors of the disaggregation layer. All are `KvabiError`."""

from __future__ import annotations

from kvabi.abi.errors import IncompatibleError, KvabiError


class TransferError(KvabiError, RuntimeError):
    """A KV transfer that did not complete: peer gone, refused request, bad payload."""


class AuthError(TransferError):
    """The peer failed the shared-secret challenge (or we did, in its eyes)."""


class PeerIncompatibleError(IncompatibleError):
    """The peers hold different models or hash schemes; refused at connect time."""


class MessageTooLargeError(TransferError):
    """A message announced more bytes (or tokens) than the receiver accepts."""


class PeerClosedError(TransferError):
    """The peer closed (or reset) the connection."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A peer did not send or accept bytes within the transfer timeout."""


class RemoteError(TransferError):
    """The peer reported an error (its `kind` and message are in the text)."""
