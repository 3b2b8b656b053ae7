"""Typed errors of the container reader and writer. All are KvabiError (and ValueError)."""

from __future__ import annotations

from kvabi.abi.errors import KvabiError, MissingPlaneError


class ContainerError(KvabiError, ValueError):
    """A container that cannot be read or written; the base of the errors below."""


class TruncatedError(ContainerError):
    """The input ends before the container does."""


class BadMagicError(ContainerError):
    """A marker (file magic, section or end marker) is not what the format puts there."""


class VersionError(ContainerError):
    """An unknown major version or a flag bit this reader does not know."""


class ChecksumError(ContainerError):
    """A checksum (meta, a layer's section, or the end's summary) does not match the bytes."""


class FormatError(ContainerError):
    """Well-formed bytes that disagree with the format or the descriptor: a layer out of order,
    a payload length, a section count, non-zero padding, trailing bytes."""


class SectionPlaneError(FormatError, MissingPlaneError):
    """A section whose payload lacks a plane its descriptor declares (its bytes end where the
    declared planes before it end): the container is refused, no layer of it is returned."""
