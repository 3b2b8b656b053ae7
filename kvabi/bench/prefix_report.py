"""`kvabi bench prefix`'s output: the tables, and the PNG of hit rate against pool capacity."""

from __future__ import annotations

from pathlib import Path

from kvabi.abi.table import print_table


def plot(
    capacities: list[int],
    rates: list[float],
    ceiling: float,
    measured: tuple[int, float],
    path: str,
    block_size: int = 16,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.semilogx(capacities, rates, "o-", base=2, label="prefix cache (replayed trace)")
    ax.axhline(ceiling, linestyle="--", color="grey", label="infinite cache (ceiling)")
    ax.plot(*measured, "s", color="tab:orange", label="engine run with the model")
    ax.set(xlabel=f"pool capacity (blocks of {block_size} tokens)", ylabel="hit rate (tokens)")
    ax.set_ylim(0, 1)
    ax.set_title("RAG workload: hit rate against pool capacity")
    ax.legend(loc="lower right")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_figures(f: dict) -> None:
    print(f"kvabi bench prefix: {f['model']} ({f['dtype']}), {f['block_groups']} block group(s)")
    print_table(
        f"TTFT: {f['ttft_prefix_tokens']}-token cached prefix + "
        f"{f['ttft_suffix_tokens']}-token suffix",
        ["figure", "value"],
        [
            ["cached s", f["ttft_cached_s"]],
            ["uncached s", f["ttft_uncached_s"]],
            ["ratio", f["ttft_ratio"]],
        ],
    )
    print_table(
        f"RAG: {f['rag_requests']} requests, {f['rag_pool_blocks']}-block pool "
        f"({f['rag_pool_tokens_per_group']} tokens per block group)",
        ["figure", "value"],
        [
            ["hit rate", f["rag_hit_rate"]],
            ["ceiling (infinite cache)", f["rag_ceiling_hit_rate"]],
            ["hit / ceiling", f["rag_hit_vs_ceiling_ratio"]],
            ["replayed hit rate (no model)", f["rag_replay_hit_rate"]],
            ["prefill tokens saved", int(f["rag_prefill_tokens_saved"])],
            ["wall s cached / uncached", f"{f['rag_cached_s']:.2f} / {f['rag_uncached_s']:.2f}"],
            ["speedup", f["rag_speedup_ratio"]],
        ],
    )
    _print_chat(f)
    _print_resume(f)
    rows = list(zip(f["capacity_blocks"], f["capacity_hit_rates"], strict=True))
    print_table("RAG hit rate against pool capacity (replayed)", ["blocks", "hit rate"], rows)
    print_table(
        f"RAG over DeepSeek-V4-Flash's compressed cache (replayed, blocks of "
        f"{f['v4_block_size']}: hits are whole blocks)",
        ["figure", "value"],
        [
            ["hit rate", f["v4_rag_hit_rate"]],
            ["ceiling, whole blocks", f["v4_rag_ceiling_hit_rate"]],
            ["hit / whole-block ceiling", f["v4_hit_vs_ceiling_ratio"]],
            ["hit / token-granular ceiling", f["v4_vs_token_ceiling_ratio"]],
        ],
    )
    if f["plot"]:
        print(f"\nplot written to {f['plot']}")


def _print_chat(f: dict) -> None:
    rows = [["hit rate, pool only", f["chat_pool_hit_rate"]]]
    rows.append(["hit rate, pool + host tier", f["chat_host_hit_rate"]])
    rows.append(["tokens loaded from host", int(f["chat_host_loaded_tokens"])])
    rows.append(["ceiling (infinite cache)", f["chat_ceiling_hit_rate"]])
    print_table(
        f"Chat: {f['chat_turns']} turns of interleaved sessions, "
        f"{f['chat_pool_blocks']}-block pool",
        ["figure", "value"],
        rows,
    )


def _print_resume(f: dict) -> None:
    print_table(
        f"Resume a {f['resume_tokens']}-token conversation (TTFT)",
        ["from", "seconds", "tokens loaded", "vs re-prefill"],
        [
            ["re-prefill", f["resume_prefill_s"], 0, 1.0],
            [
                "host RAM",
                f["resume_host_s"],
                int(f["resume_host_hit_tokens"]),
                f["resume_host_ratio"],
            ],
            [
                "disk (restart)",
                f["resume_disk_s"],
                int(f["resume_disk_hit_tokens"]),
                f["resume_disk_ratio"],
            ],
        ],
    )
