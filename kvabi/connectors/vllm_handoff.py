"""KV-cache hand-offs between vLLM and kvabi's engine, each through ABI containers.

vLLM runs in its own interpreter (`.venv-vllm`, scripts/setup_vllm.sh) through
kvabi/connectors/vllm_kv_worker.py; everything else runs here. For one prompt and dtype:

- kvabi -> vLLM: kvabi's engine prefills the prompt; its blocks become a container; the worker
  converts them into vLLM's cached blocks and vLLM continues from them.
- vLLM -> kvabi: the worker's container (vLLM's `vllm-cpu-*` layout, 128-token blocks) is
  re-blocked into kvabi's layout and written as one-block entries of a disk tier; kvabi's
  engine starts on that folder, finds the prompt there and continues.

- A hybrid model (Gemma 3: sliding-window and full layers) hands over the prompt's prefix of
  whole blocks, each sliding layer its window's tail, read and written through the table of
  each layer's KV cache group on vLLM's side; kvabi's engine imports vLLM's into its pool.

    python -m kvabi.connectors.vllm_handoff [--dtype bf16|fp32] [--model gemma3-270m] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvabi.abi.convert import convert
from kvabi.abi.descriptor import Descriptor
from kvabi.abi.presets import preset_descriptor
from kvabi.cache.block_api import KVPayload
from kvabi.cache.block_codec import BlockCodec
from kvabi.cache.block_hasher import BlockHasher, BlockKey
from kvabi.cache.disk_tier import DiskTier
from kvabi.cache.tier_config import TierConfig
from kvabi.engine.engine import KV_LAYOUTS, model_spec
from kvabi.engine.llm import LLM
from kvabi.engine.sampling_params import SamplingParams
from kvabi.models.registry import LoadedModel
from kvabi.wire import read_container, write_container

ROOT = Path(__file__).resolve().parents[2]
VLLM_PYTHON = ROOT / ".venv-vllm" / "bin" / "python"
WORKER = ROOT / "kvabi" / "connectors" / "vllm_kv_worker.py"
CONNECTOR_WORKER = ROOT / "kvabi" / "connectors" / "vllm_connector_worker.py"
VLLM_DTYPES = {"bf16": "bfloat16", "fp32": "float32"}
BLOCK_SIZE = 16  # kvabi's engine
VLLM_BLOCK_SIZE = 128  # vLLM's on CPU
DISK_BYTES = 2**30


def counting_prompt(tokenizer: Any, count: int = 100) -> list[int]:
    """A prompt whose continuation is certain ("..., 99, 100," -> " 101, 102"): greedy tokens
    then do not hinge on near-ties, so any KV damage shows as a different token."""
    return tokenizer.encode(", ".join(str(i) for i in range(1, count + 1)) + ",")


def windowed_counting_prompt(tokenizer: Any, window: int, count: int = 200) -> list[int]:
    """A counting prompt of n tokens, n = 1 (mod 128) and n > window + 128: the prefix both
    engines cache and hand over is then its n - 1 tokens, a whole number of either engine's
    blocks, and a sliding layer's window at that prefix starts in the blocks its window at n
    still holds (vLLM frees the ones before while it runs), so every needed block is there."""
    while (len(ids := counting_prompt(tokenizer, count)) % VLLM_BLOCK_SIZE != 1
           or len(ids) <= window + VLLM_BLOCK_SIZE):  # fmt: skip
        count += 1
    return ids


@dataclass(frozen=True)
class Handoff:
    """One dtype's model, fingerprint and prompt, and where the containers go."""

    loaded: LoadedModel
    fingerprint: str
    prompt_ids: list[int]
    out_dir: Path
    max_tokens: int = 16

    @property
    def is_hybrid(self) -> bool:
        """Sliding-window layers (Gemma 3): containers carry what each layer's window needs."""
        return any(layer.window for layer in self.descriptor().model.layers)

    @property
    def handed_tokens(self) -> int:
        """How much of the prompt a hand-off carries: all of it; a hybrid model's, the prefix a
        receiver reuses (whole blocks of both engines), since a sliding layer's KV is the
        window of the length it was taken at."""
        if not self.is_hybrid:
            return len(self.prompt_ids)
        return (len(self.prompt_ids) - 1) // VLLM_BLOCK_SIZE * VLLM_BLOCK_SIZE

    def descriptor(self) -> Descriptor:
        """The cache descriptor of kvabi's engine for this model (without starting one)."""
        dtype = "bf16" if self.loaded.model.dtype == torch.bfloat16 else "f32"
        model = model_spec(self.loaded, self.fingerprint)
        return preset_descriptor(KV_LAYOUTS["nhd"], model, block_size=BLOCK_SIZE, dtype=dtype)

    def engine(self, **config: object) -> LLM:
        return LLM.from_loaded(self.loaded, self.fingerprint, block_size=BLOCK_SIZE, **config)

    def greedy(self, llm: LLM) -> list[int]:
        params = SamplingParams(max_tokens=self.max_tokens, temperature=0, ignore_eos=True)
        return list(llm.generate([self.prompt_ids], params)[0].outputs[0].token_ids)


def kvabi_export(h: Handoff, path: Path) -> list[int]:
    """kvabi's engine runs the prompt; its full prompt blocks go to a container. Returns the
    engine's own greedy tokens."""
    llm = h.engine()
    tokens = h.greedy(llm)
    ids = h.prompt_ids[: h.handed_tokens]
    blocks = llm.engine.cache.export(ids, None)  # every pooled full block (a window's, sliding)
    write_container(path, blocks.cache, blocks.token_ids, blocks.block_hashes)
    return tokens


def to_disk_tier(container: Path, desc: Descriptor, folder: Path) -> int:
    """Re-block a container into `desc` (an engine's layout) and write its full blocks as
    disk-tier entries (one-block containers keyed by block hash). Returns how many."""
    src = read_container(container, expect=desc.model)
    ids = list(src.token_ids)
    hashes = BlockHasher(desc.model.compat_digest(), BLOCK_SIZE).hashes(ids)  # no cache_salt
    blocks = convert(src.cache, desc, num_tokens=len(hashes) * BLOCK_SIZE)
    tier = DiskTier(folder, DISK_BYTES, desc.model.compat_digest())
    codec = BlockCodec(desc)
    for i, block_hash in enumerate(hashes):
        key = BlockKey(block_hash, tuple(ids[i * BLOCK_SIZE : (i + 1) * BLOCK_SIZE]))
        tier.put(block_hash, codec.encode(blocks, i, key))
    return len(hashes)


def kvabi_from_vllm(h: Handoff, container: Path) -> dict[str, Any]:
    """kvabi's engine continues the prompt from vLLM's KV, found in a disk tier (a hybrid
    model's: imported into its pool, as a decode instance imports a prefill's)."""
    if h.is_hybrid:
        return _import_into_pool(h, container)
    folder = h.out_dir / "disk-tier"
    num_blocks = to_disk_tier(container, h.descriptor(), folder)
    llm = h.engine(tiers=TierConfig(disk_dir=str(folder), disk_bytes=DISK_BYTES))
    tokens = h.greedy(llm)
    stats = llm.engine.cache_stats()
    llm.engine.close()
    return {
        "tokens": tokens,
        "blocks_written": num_blocks,
        "disk_hit_tokens": stats.get("tier_disk_hit_tokens", 0),
    }


def _import_into_pool(h: Handoff, container: Path) -> dict[str, Any]:
    src = read_container(container, expect=h.descriptor().model)
    llm = h.engine()
    blocks = convert(  # 128-token blocks -> the engine's 16; sliding layers' zeros stay zeros
        src.cache, llm.engine.info.descriptor, num_tokens=len(src.token_ids)
    )
    payload = KVPayload(0, tuple(src.token_ids), tuple(src.block_hashes), blocks)
    imported = llm.engine.cache.import_blocks(h.prompt_ids, None, payload)
    tokens = h.greedy(llm)
    llm.engine.close()
    return {
        "tokens": tokens,
        "blocks_written": imported.num_placed_blocks,
        "imported_tokens": imported.num_cached_tokens,
    }


def run_worker(h: Handoff, dtype: str, import_path: Path | None, timeout_s: int = 900) -> dict:
    """One vLLM process: its own run, its KV exported, `import_path`'s KV imported."""
    job = {
        "model_dir": str(h.out_dir / "hf"),
        "dtype": VLLM_DTYPES[dtype],
        "model": h.descriptor().to_json(),
        "prompt_ids": h.prompt_ids,
        "max_tokens": h.max_tokens,
        "export_path": str(h.out_dir / f"vllm-{dtype}.kvabi"),
        "export_tokens": h.handed_tokens,
        "import_path": str(import_path) if import_path else None,
    }
    return _spawn(WORKER, job, h.out_dir / f"vllm-{dtype}", timeout_s)


def run_connector_worker(
    h: Handoff, dtype: str, prompts: list[dict], tag: str, **options: Any
) -> dict:
    """One vLLM process with kvabi's KV connector over a store in kvabi's engine layout (the
    options: disk_dir, redis_url, and connector=False / prefix_caching=True; see the worker)."""
    job = {
        "model_dir": str(h.out_dir / "hf"),
        "dtype": VLLM_DTYPES[dtype],
        "store": h.descriptor().to_json(),
        "prompts": prompts,
        "max_tokens": h.max_tokens,
        "disk_dir": None,
        "redis_url": None,
    }
    return _spawn(CONNECTOR_WORKER, job | options, h.out_dir / f"connector-{tag}")


def _spawn(worker: Path, job: dict, stem: Path, timeout_s: int = 900) -> dict:
    """Run a worker in vLLM's interpreter (the repo on PYTHONPATH); its JSON result."""
    job_path, out = stem.with_suffix(".job.json"), stem.with_suffix(".json")
    job_path.write_text(json.dumps(job), encoding="utf-8")
    env = os.environ | {"PYTHONPATH": str(ROOT)}
    cmd = [str(VLLM_PYTHON), str(worker), "--job", str(job_path), "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    stem.with_suffix(".log").write_text(proc.stderr, encoding="utf-8")

    if proc.returncode != 0:
        raise RuntimeError(f"{worker.name} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(out.read_text(encoding="utf-8"))


def prepare(out_dir: Path, dtype: str, model: str | None = None) -> Handoff:
    """A bundled model (default SmolLM2) in `dtype`, its GGUF fingerprint, the HF folder vLLM
    loads (the weights as kvabi reads them; vLLM casts them to its dtype; vLLM cannot read a
    Gemma 3 GGUF) and the counting prompt (a hybrid model's: `windowed_counting_prompt`)."""
    from kvabi.interop.model_spec import gguf_fingerprint
    from kvabi.models.hf_export import export_hf_folder
    from kvabi.models.registry import DEFAULT_MODEL, bundled_model_path, load_model

    out_dir.mkdir(parents=True, exist_ok=True)
    loaded = load_model(model, dtype=dtype, progress=False)
    if not (out_dir / "hf" / "config.json").exists():
        export_hf_folder(load_model(model, dtype="fp32", progress=False), out_dir / "hf")
    fingerprint = gguf_fingerprint(bundled_model_path(model or DEFAULT_MODEL))
    window = max(spec.window for spec in loaded.config.kv_layers())
    prompt = (
        windowed_counting_prompt(loaded.tokenizer, window)
        if window
        else counting_prompt(loaded.tokenizer)
    )
    return Handoff(loaded, fingerprint, prompt, out_dir)


def run(out_dir: Path, dtype: str, model: str | None = None) -> dict[str, Any]:
    """Both hand-offs for one dtype; greedy tokens of each engine, own and handed-off."""
    h = prepare(out_dir, dtype, model)
    kvabi_container = out_dir / f"kvabi-{dtype}.kvabi"
    kvabi_own = kvabi_export(h, kvabi_container)
    vllm = run_worker(h, dtype, kvabi_container)
    from_vllm = kvabi_from_vllm(h, out_dir / f"vllm-{dtype}.kvabi")
    return {
        "dtype": dtype,
        "prompt_tokens": len(h.prompt_ids),
        "kvabi_own": kvabi_own,
        "vllm_own": vllm["own"]["tokens"],
        "vllm_from_kvabi": vllm["imported"]["tokens"],
        "vllm_from_kvabi_cached_tokens": vllm["imported"]["num_cached_tokens"],
        "vllm_zeroed_blocks": vllm["zeroed"]["tokens"],
        "kvabi_from_vllm": from_vllm["tokens"],
        "kvabi_from_vllm_disk_hit_tokens": from_vllm.get("disk_hit_tokens"),
        "kvabi_from_vllm_imported_tokens": from_vllm.get("imported_tokens"),
        "vllm_descriptor": vllm["descriptor"],
        "vllm_startup_s": vllm["startup_s"],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=sorted(VLLM_DTYPES), default="bf16")
    parser.add_argument("--out", type=Path, default=Path("out/vllm-handoff"))
    parser.add_argument("--model", help="a bundled model (default SmolLM2; gemma3-270m)")
    args = parser.parse_args(argv)
    if not VLLM_PYTHON.exists():
        print("vLLM is not installed: run scripts/setup_vllm.sh", file=sys.stderr)
        return 1
    result = run(args.out, args.dtype, args.model)
    print(json.dumps(result, indent=2))
    same = result["kvabi_from_vllm"] == result["vllm_own"] == result["vllm_from_kvabi"]
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
