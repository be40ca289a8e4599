#!/usr/bin/env python3
"""Plot decode tok/s against context length (dense, SFI, ceiling) from `sfi-gguf bench` JSON files.

Each file is one run (a list of rows, one per depth); rows of several files are merged, later files
winning at equal (model, depth), so a default run and a "SFI at every depth" run can share a plot:

    python3 benchmarks/plot_bench.py benchmarks/results/bench-h200-qwen3-4b-f16-trace-20261130.json \
        benchmarks/results/bench-h200-qwen3-4b-f16-32768-trace-20261130.json --out benchmarks/results/bench-h200-qwen3-4b-f16-trace.png
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", help="bench JSON files (lists of rows)")
    ap.add_argument("--out", required=True, help="PNG to write")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()

    rows: dict[int, dict] = {}
    for f in args.files:
        for r in json.loads(Path(f).read_text()):
            rows[r["depth"]] = r
    depths = sorted(rows)
    r0 = rows[depths[0]]

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    ax.plot(depths, [rows[d]["dense_tok_s"] for d in depths], "o-", label="dense (full KV cache)")
    ax.plot(depths, [rows[d]["sfi_tok_s"] for d in depths], "s-", label=f"SFI (k_head {r0['k_head']}, {r0['policy']})")
    ax.plot(depths, [rows[d]["ceiling_tok_s"] for d in depths], "--", color="gray",
            label=f"ceiling: dense at depth = SFI memory ({r0['budget']})")
    for d in depths:
        ax.annotate(f"{rows[d]['ratio']:.2f}x", (d, rows[d]["sfi_tok_s"]), textcoords="offset points", xytext=(0, 8),
                    ha="center", fontsize=9)
    ax.set_xscale("log", base=2)
    ax.set_xticks(depths, [f"{d // 1024}K" for d in depths])
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode tok/s")
    ax.set_ylim(bottom=0)
    ax.set_title(args.title or f"{r0['hardware']}, {r0['model_shape'] or r0['model']} {r0['weight_type']}, "
                                f"commit {r0['git_commit'][:7]}", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=9)
    fig.tight_layout()
    fig.savefig(args.out, dpi=120)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
