"""The container: the file and wire format of one sequence's KV cache (docs/ABI.md, section 5)."""

from kvabi.wire.container import (
    Container,
    ContainerMeta,
    LayerSection,
    iter_layers,
    read_container,
)
from kvabi.wire.container_format import container_size
from kvabi.wire.container_writer import ContainerWriter, container_bytes, write_container
from kvabi.wire.errors import (
    BadMagicError,
    ChecksumError,
    ContainerError,
    FormatError,
    SectionPlaneError,
    TruncatedError,
    VersionError,
)

__all__ = [
    "BadMagicError",
    "ChecksumError",
    "Container",
    "ContainerError",
    "ContainerMeta",
    "ContainerWriter",
    "FormatError",
    "SectionPlaneError",
    "LayerSection",
    "TruncatedError",
    "VersionError",
    "container_bytes",
    "container_size",
    "iter_layers",
    "read_container",
    "write_container",
]
