"""Where vLLM 0.32's native offload tier (`vllm/v1/kv_offload`, the `fs` secondary tier) keeps
a block, and the block hashes that name its files.

vLLM's `FileMapper` hashes a namespace of fields (model, dtype, tokens per hash, blocks per
file, TP/PP/PCP/DCP, the KV cache groups, the canonical format) with SHA-256 over their
sorted-key compact JSON and names the folder `<root>/<model with / as _>_<12 hex>`; the fields
themselves go to `<that>/config.json`, the blocks to
`<that>_r<rank>/<hhh>/<hh>_g<group>/<block hash hex>.bin`. A file's name is vLLM's prefix-cache
block hash (`sha256`: SHA-256 over a pickled `(parent, token ids, extra keys)` tuple, chained
from `NONE_HASH` = sha256 of the seed `vllm-none-hash`).
"""

from __future__ import annotations

import hashlib
import json
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvabi.interop.errors import OffloadMissingError, OffloadNamespaceError

DIGEST_LEN = 12  # vLLM's _BASE_PATH_HASH_LEN
CONFIG_NAME = "config.json"
NONE_HASH_SEED = "vllm-none-hash"  # vLLM's DEFAULT_NONE_HASH_SEED (PYTHONHASHSEED unset)
CANONICAL_FORMATS = ("v1-nhd", "v1-hnd")


@dataclass(frozen=True)
class OffloadGroup:
    """One KV cache group as the namespace names it: its block size and its layers."""

    tokens_per_block: int
    layer_names: tuple[str, ...]


@dataclass(frozen=True)
class OffloadNamespace:
    """The fields vLLM's `FileMapper` hashes into a storage folder's name.

    `parallel_agnostic` (the `fs` tier's choice for a TP-agnostic canonical page): TP, PP,
    PCP, DCP are 1 and the rank 0 whatever the writer's topology, so every topology shares one
    folder. `canonical_format` is `v1-nhd` or `v1-hnd`; None is the direct (worker page) form.
    """

    model_name: str
    dtype: str  # vLLM's spelling: bfloat16, float16, float32
    tokens_per_hash: int
    groups: tuple[OffloadGroup, ...]
    blocks_per_file: int = 1
    canonical_format: str | None = "v1-nhd"
    tp_size: int = 1
    pp_size: int = 1
    pcp_size: int = 1
    dcp_size: int = 1
    rank: int = 0
    parallel_agnostic: bool = True
    replicated_layout: bool = False
    inference_engine: str = "vllm"
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.canonical_format not in (*CANONICAL_FORMATS, None):
            raise OffloadNamespaceError(
                f"canonical_format {self.canonical_format!r}: kvabi reads {CANONICAL_FORMATS}"
            )
        if self.tokens_per_hash < 1 or self.blocks_per_file < 1:
            raise OffloadNamespaceError("tokens_per_hash and blocks_per_file must be >= 1")
        for g in self.groups:
            if g.tokens_per_block % self.tokens_per_hash:
                raise OffloadNamespaceError(
                    f"tokens_per_block {g.tokens_per_block} is not a multiple of "
                    f"tokens_per_hash {self.tokens_per_hash}"
                )

    def fields(self) -> dict[str, Any]:
        """The dict vLLM hashes and writes to config.json, as `FileMapper.__init__` builds it."""
        agnostic = self.parallel_agnostic
        out: dict[str, Any] = {
            "model_name": self.model_name,
            "tokens_per_hash": self.tokens_per_hash,
            "blocks_per_file": self.blocks_per_file,
            "tp_size": 1 if agnostic else self.tp_size,
            "pp_size": 1 if agnostic else self.pp_size,
            "pcp_size": 1 if agnostic else self.pcp_size,
            "dcp_size": 1 if agnostic else self.dcp_size,
            "dtype": self.dtype,
            "kv_cache_groups": [
                {"tokens_per_block": g.tokens_per_block, "layer_names": list(g.layer_names)}
                for g in self.groups
            ],
            "inference_engine": self.inference_engine,
        }
        if not agnostic:
            out["parallel_agnostic"] = False
        if self.replicated_layout:
            out["replicated_layout"] = True
        if self.canonical_format is not None:
            out["canonical_format"] = self.canonical_format
        return out | self.extra

    def digest(self) -> str:
        """The 12 hex digits of the folder name."""
        text = json.dumps(self.fields(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:DIGEST_LEN]

    def base_path(self, root: str | Path) -> Path:
        """`<root>/<model name, / as _>_<digest>`: config.json lives in it."""
        return Path(root) / f"{self.model_name.replace('/', '_')}_{self.digest()}"

    def config_path(self, root: str | Path) -> Path:
        return self.base_path(root) / CONFIG_NAME

    def file_path(self, root: str | Path, block_hash: bytes, group_idx: int = 0) -> Path:
        """Where vLLM keeps the file named by `block_hash` (FileMapper.get_file_name)."""
        h = block_hash.hex()
        rank = 0 if self.parallel_agnostic else self.rank
        base = self.base_path(root)
        return base.parent / f"{base.name}_r{rank}" / h[:3] / f"{h[3:5]}_g{group_idx}" / f"{h}.bin"

    @property
    def tokens_per_file(self) -> int:
        """Tokens one file covers (one group's block times blocks per file)."""
        return self.single_group().tokens_per_block * self.blocks_per_file

    def single_group(self) -> OffloadGroup:
        if len(self.groups) != 1:
            raise OffloadNamespaceError(
                f"{len(self.groups)} KV cache groups: kvabi reads single-group namespaces "
                "(full attention in every layer)"
            )
        return self.groups[0]

    @classmethod
    def from_fields(cls, data: dict[str, Any]) -> OffloadNamespace:
        """A namespace from a config.json's fields (unknown fields kept, so the digest holds)."""
        known = {
            "model_name", "tokens_per_hash", "blocks_per_file", "tp_size", "pp_size",
            "pcp_size", "dcp_size", "dtype", "kv_cache_groups", "inference_engine",
            "parallel_agnostic", "replicated_layout", "canonical_format",
        }  # fmt: skip
        try:
            groups = tuple(
                OffloadGroup(int(g["tokens_per_block"]), tuple(g["layer_names"]))
                for g in data["kv_cache_groups"]
            )
            return cls(
                model_name=str(data["model_name"]),
                dtype=str(data["dtype"]),
                tokens_per_hash=int(data["tokens_per_hash"]),
                groups=groups,
                blocks_per_file=int(data["blocks_per_file"]),
                canonical_format=data.get("canonical_format"),
                tp_size=int(data["tp_size"]),
                pp_size=int(data["pp_size"]),
                pcp_size=int(data["pcp_size"]),
                dcp_size=int(data["dcp_size"]),
                parallel_agnostic=bool(data.get("parallel_agnostic", True)),
                replicated_layout=bool(data.get("replicated_layout", False)),
                inference_engine=str(data["inference_engine"]),
                extra={k: v for k, v in data.items() if k not in known},
            )
        except (KeyError, TypeError, ValueError) as e:
            raise OffloadNamespaceError(f"not a vLLM offload config.json: {e!r}") from e


def read_namespace(base: str | Path) -> OffloadNamespace:
    """The namespace of a folder holding config.json, checked: its fields must hash to the
    folder's name (the one consistency vLLM's format lets a reader check)."""
    base = Path(base)
    path = base / CONFIG_NAME
    if not path.is_file():
        raise OffloadMissingError(f"{path}: no vLLM offload config.json")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise OffloadNamespaceError(f"{path}: {e}") from e
    if not isinstance(data, dict):
        raise OffloadNamespaceError(f"{path}: not a JSON object")
    ns = OffloadNamespace.from_fields(data)
    if ns.base_path(base.parent) != base:
        raise OffloadNamespaceError(
            f"{base.name}: config.json hashes to {ns.base_path(base.parent).name}; the folder "
            "was renamed or its config.json edited"
        )
    return ns


def find_namespaces(root: str | Path) -> list[tuple[Path, OffloadNamespace]]:
    """Every namespace folder under an offload root (or `root` itself if it is one)."""
    root = Path(root)
    bases = [root] if (root / CONFIG_NAME).is_file() else sorted(
        p.parent for p in root.glob(f"*/{CONFIG_NAME}")
    )  # fmt: skip
    return [(b, read_namespace(b)) for b in bases]


def vllm_block_hashes(
    token_ids: Sequence[int], tokens_per_hash: int, seed: str = NONE_HASH_SEED
) -> list[bytes]:
    """vLLM's `sha256` prefix-cache block hashes of a prompt's full blocks (no cache salt,
    LoRA or multimodal extra keys). `seed` is vLLM's `PYTHONHASHSEED` if its process had one."""
    parent = _sha256_pickle(seed)
    out = []
    for i in range(len(token_ids) // tokens_per_hash):
        block = tuple(int(t) for t in token_ids[i * tokens_per_hash : (i + 1) * tokens_per_hash])
        parent = _sha256_pickle((parent, block, None))
        out.append(parent)
    return out


def _sha256_pickle(obj: object) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()
