"""Typed errors of the ABI. Every check that refuses input raises one of these."""


class KvabiError(Exception):
    """Base of every error kvabi raises on bad input."""


class DescriptorError(KvabiError, ValueError):
    """A descriptor that cannot exist: bad geometry, unknown field value, malformed text."""


class IncompatibleError(KvabiError, ValueError):
    """Two descriptors that cannot exchange data (another model, other geometry)."""


class ShapeError(KvabiError, ValueError):
    """A tensor whose shape or dtype disagrees with its descriptor."""


class CodecError(KvabiError, ValueError):
    """Values a codec refuses to encode, because the stored bytes could not be vouched for."""
