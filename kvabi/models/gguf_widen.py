"""A bundled GGUF re-encoded at another weight precision, for peers that read GGUF (llama.cpp).

kvabi dequantises a quantised GGUF's tensors and computes in bf16 or float32; llama.cpp on the
same file computes on the quantised weights. To compare the two at the same precision,
`widen_gguf` writes a copy whose quantised tensors are dequantised (each by its own type, as
kvabi's loader does) and stored as BF16 or F32: the same values kvabi holds in that dtype (BF16
by round-to-nearest-even, as torch rounds). Tensors already stored unquantised (norms in F32)
are copied as they are, and so is every metadata field (tokenizer, chat template, sizes).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter
from gguf.quants import dequantize, quantize

WIDE_TYPES = {"bf16": GGMLQuantizationType.BF16, "fp32": GGMLQuantizationType.F32}
_KEPT = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)
_HEADER_FIELDS = ("GGUF.version", "GGUF.tensor_count", "GGUF.kv_count")  # the writer's own


def widen_gguf(src: str | Path, dst: str | Path, dtype: str) -> Path:
    """Write `src` to `dst` with its quantised tensors as `dtype` ("bf16" or "fp32")."""
    if dtype not in WIDE_TYPES:
        raise ValueError(f"dtype {dtype!r}: one of {sorted(WIDE_TYPES)}")
    wide, dst = WIDE_TYPES[dtype], Path(dst)
    reader = GGUFReader(str(src), "r")
    arch = reader.fields["general.architecture"].contents()
    part = dst.with_name(f".{dst.name}.{os.getpid()}.part")
    writer = GGUFWriter(str(part), arch=arch, endianess=reader.endianess)
    for field in reader.fields.values():
        if field.name in _HEADER_FIELDS or field.name == "general.architecture":
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, field.contents(), vtype, sub_type=sub)
    for tensor in reader.tensors:
        if tensor.tensor_type in _KEPT:
            data, qtype = np.asarray(tensor.data), tensor.tensor_type
        else:
            data, qtype = quantize(dequantize(tensor.data, tensor.tensor_type), wide), wide
        writer.add_tensor(tensor.name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(part, dst)  # whole or not at all: a reader never sees half a file
    return dst
