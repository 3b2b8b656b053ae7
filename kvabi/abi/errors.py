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


class MissingPlaneError(ShapeError):
    """A cache, container or tier entry that lacks a plane its descriptor declares (e.g. a
    V3.2 layer's `indexer`): refused whole, never half-loaded."""

    def __init__(self, layer_id: int, plane: str, detail: str) -> None:
        super().__init__(f"layer {layer_id} lacks its {plane!r} plane: {detail}")
        self.layer_id = layer_id
        self.plane = plane


class HashSchemeError(KvabiError, ValueError):
    """A block-hash scheme asked for what it cannot hash: an unknown scheme name, a token id
    outside [0, 2^32), a parent of the wrong length, extra keys the scheme cannot encode."""
