"""`kvabi bench compress`'s output: the tables, and a PNG of quality against compression."""

from __future__ import annotations

from pathlib import Path

from kvabi.abi.table import print_table

RATIOS = (2, 4, 8)
METHODS = ("streaming", "snapkv")


def plot(f: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (niah, agree) = plt.subplots(1, 2, figsize=(10, 4))
    xs = [1, *RATIOS]
    for method, marker in zip(METHODS, "os", strict=True):
        niah.plot(
            xs,
            [f["niah_full_accuracy"]] + [f[f"niah_{method}_{r}x_accuracy"] for r in RATIOS],
            marker=marker,
            label=method,
        )
        agree.plot(
            xs,
            [1.0] + [f[f"agree_{method}_{r}x_top1_ratio"] for r in RATIOS],
            marker=marker,
            label=method,
        )
    niah.set(
        xlabel="compression (x)",
        ylabel="needle retrieval accuracy",
        xscale="log",
        ylim=(0, 1.05),
        title=f"Needle in a haystack, {f['niah_haystacks']} haystacks",
    )
    agree.set(
        xlabel="compression (x)",
        ylabel="top-1 agreement with no press",
        xscale="log",
        ylim=(0, 1.05),
        title=f"Teacher-forced, {f['agree_steps']} positions",
    )
    for ax in (niah, agree):
        ax.set_xticks(xs, [f"{x}x" for x in xs])
        ax.minorticks_off()
        ax.legend(loc="lower left")
    fig.suptitle(f"{f['model']} ({f['dtype']}): quality against KV compression")
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_figures(f: dict) -> None:
    print(f"kvabi bench compress: {f['model']} ({f['dtype']})")
    rows = [["no press", "1x", f["niah_full_accuracy"], f["niah_aware_full_accuracy"], 1.0]]
    for method in METHODS:
        for r in RATIOS:
            key = f"{method}_{r}x"
            after, inside = f[f"niah_{key}_accuracy"], f[f"niah_aware_{key}_accuracy"]
            rows.append([method, f"{r}x", after, inside, f[f"agree_{key}_top1_ratio"]])
    print_table(
        f"Quality: needle in {f['niah_haystacks']} haystacks (mean {f['niah_mean_tokens']:.0f} "
        f"tokens), the question after the press / inside the pressed context; top-1 "
        f"agreement over {f['agree_steps']} positions after {f['agree_context_tokens']} "
        "tokens of a held text",
        ["press", "compression", "needle, question after", "needle, question inside",
         "top-1 agreement"],
        rows,
    )  # fmt: skip
    print(f"(no press: top-1 equals the held text's next token at {f['agree_full_vs_text']:.2f})")
    kinds = [k.removeprefix("v4_").removesuffix("_layers") for k in f if k.endswith("_layers")]
    print_table(
        "DeepSeek-V4-Flash's KV (catalog, bf16, blocks of 128) at 1M tokens, from descriptors",
        ["layer type", "layers", "B/token/layer", "GB/layer"],
        [
            [
                k,
                f[f"v4_{k}_layers"],
                f"{f[f'v4_{k}_bytes_per_token_per_layer']:.1f}",
                f[f"v4_{k}_bytes_per_layer_1m"] / 1e9,
            ]
            for k in kinds
        ],
    )
    print_table(
        "KV of one 1M-token request",
        ["cache", "GB", "ratio"],
        [
            ["DeepSeek-V4-Flash, compressed", f["v4_bytes_1m"] / 1e9, 1.0],
            [
                "same model, every token's K=V row",
                f["v4_uncompressed_bytes_1m"] / 1e9,
                1 / f["v4_vs_uncompressed_ratio"],
            ],
            [
                "DeepSeek-V3 MLA (576 values)",
                f["v3_mla_bytes_1m"] / 1e9,
                1 / f["v4_vs_v3_mla_ratio"],
            ],
        ],
    )
    print_table("ran on", ["what", "value"], [[k, v] for k, v in f["ran_on"].items()])
    if f.get("plot"):
        print(f"\nplot written to {f['plot']}")
