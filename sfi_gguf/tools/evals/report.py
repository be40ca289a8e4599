"""Present evaluation results: a Markdown table for BENCHMARKS.md and matplotlib plots.

Reads the JSON that `runner.run_suite` writes (rows aggregated per model, task, context and policy;
records per case and policy). matplotlib is only needed for the plots (`pip install matplotlib`).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .runner import ALL_POLICIES, TEACHER_FORCED, VARIANTS


def markdown_table(rows: list[dict]) -> str:
    """One line per (model, task, context, k_head): the score of every policy side by side."""
    policies = [p for p in ALL_POLICIES if any(r["policy"] == p for r in rows)]
    head = ("| model | task | context | k_head | budget share | cases | " + " | ".join(policies) + " |\n"
            "|---|---|---|---|---|---|" + "---|" * len(policies) + "\n")
    groups: dict[tuple, dict[str, dict]] = {}
    for r in rows:
        groups.setdefault((r["model"], r["task"], r["context"], r["k_head"]), {})[r["policy"]] = r
    lines = []
    for (model, task, context, _), by_policy in groups.items():
        any_row = next(iter(by_policy.values()))
        cells = []
        for p in policies:
            r = by_policy.get(p)
            if r is None:
                cells.append("-")
            elif task in TEACHER_FORCED and p != "dense":
                cells.append(f"{100 * r['score']:.1f} / {r['mean_kl']:.3f}"
                             + (f" / {r['first_divergence']:.0f}" if "first_divergence" in r else ""))
            elif task == "cot" and r.get("score_dense_solved") is not None:
                cells.append(f"{100 * r['score']:.1f} ({100 * r['score_dense_solved']:.0f} of {r['n_dense_solved']})")
            else:
                cells.append(f"{100 * r['score']:.1f}")
        shown_context = context or f"~{any_row['prompt_tokens']}"
        lines.append(f"| {model.removesuffix('.gguf')} | {task} | {shown_context} | {any_row['k_head']} | "
                     f"{100 * any_row['budget_share']:.0f}% | {any_row['n_cases']} | " + " | ".join(cells) + " |")
    return head + "\n".join(lines) + "\n"


def cadence_table(records: list[dict]) -> str:
    """How often each sparse policy refreshed: slow steps (bootstrap excluded) per 100 generated tokens,
    per (model, context, k_head), over the tasks whose answers are longer than a few tokens."""
    groups: dict[tuple, dict[str, list[int]]] = {}
    for r in records:
        sfi = r.get("sfi") or {}
        if r["policy"] == "dense" or not r.get("n_generated") or r["n_generated"] < 32:
            continue
        counts = groups.setdefault((r["model"], r["context"], r["k_head"]), {}).setdefault(r["policy"], [0, 0])
        counts[0] += sfi.get("n_slow", 0)
        counts[1] += r["n_generated"]
    policies = [p for p in ALL_POLICIES if any(p in g for g in groups.values())]
    lines = ["| model | context | k_head | " + " | ".join(policies) + " |",
             "|---|---|---|" + "---|" * len(policies)]
    for (model, context, k_head), by_policy in sorted(groups.items()):
        cells = [f"{100 * by_policy[p][0] / by_policy[p][1]:.1f}" if p in by_policy else "-" for p in policies]
        lines.append(f"| {model.removesuffix('.gguf')} | {context} | {k_head} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plot_accuracy(rows: list[dict], path: str | Path) -> Path:
    """Score vs context length, one line per policy, one panel per (model, task) with several lengths."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["model"], r["task"]) for r in rows if r["task"] in ("needle", "variables")})
    fig, axes = plt.subplots(1, max(1, len(panels)), figsize=(4.2 * max(1, len(panels)), 3.6), squeeze=False)
    for ax, (model, task) in zip(axes[0], panels):
        for policy in ALL_POLICIES:
            pts = sorted((r["context"], 100 * r["score"]) for r in rows
                         if r["model"] == model and r["task"] == task and r["policy"] == policy)
            if pts:
                xs, ys = zip(*pts)
                ax.plot(xs, ys, marker="o", label=policy, linestyle="--" if policy == "dense" else "-")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model.removesuffix('.gguf')}\n{task}", fontsize=9)
        ax.set_xlabel("context (tokens)")
        ax.set_ylabel("score (%)")
        ax.set_ylim(-5, 105)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_timeline(record: dict, path: str | Path, window: int = 32) -> Path:
    """One generation's trigger timeline: slow steps over the token stream, coloured by refresh
    overlap, over the rolling top-1 agreement with dense (a long-generation record)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sfi = record.get("sfi") or {}
    bits = np.array([c == "1" for c in record.get("top1_bits", "")], dtype=float)
    fig, ax = plt.subplots(figsize=(10, 3.4))
    if len(bits):
        rolling = np.convolve(bits, np.ones(window) / window, mode="valid")
        ax.plot(np.arange(len(rolling)) + window, 100 * rolling, color="0.3", lw=1,
                label=f"top-1 agreement, last {window} tokens (%)")
    cmap = plt.get_cmap("viridis")
    overlaps = sfi.get("refresh_overlap", [])
    for i, step in enumerate(sfi.get("slow_steps", [])):
        ov = overlaps[i] if i < len(overlaps) else None
        ax.axvline(step, color=cmap(ov) if ov is not None else "red", lw=1.2, alpha=0.8)
    sm = plt.cm.ScalarMappable(cmap=cmap, norm=plt.Normalize(0, 1))
    fig.colorbar(sm, ax=ax, label="refresh overlap (slow step)")
    ax.set_xlabel("generated token")
    ax.set_ylabel("%")
    ax.set_ylim(0, 102)
    reasons = ", ".join(f"{k} {v}" for k, v in (sfi.get("reasons") or {}).items())
    ax.set_title(f"{record['model'].removesuffix('.gguf')}, {record['policy']}, context {record['prompt_tokens']}, "
                 f"k_head {record['k_head']}: {len(sfi.get('slow_steps', []))} slow steps ({reasons})", fontsize=9)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def write_report(data: dict, stem: str | Path) -> list[Path]:
    """`stem`.md (table), `stem`-accuracy.png and, if there is a long generation, `stem`-timeline.png."""
    stem = Path(stem)
    out = [stem.with_suffix(".md")]
    table = markdown_table(data["rows"])
    if any(r["policy"] in VARIANTS for r in data["records"]):
        table += "\nSlow steps per 100 generated tokens (answers of 32 tokens or more):\n\n" + cadence_table(data["records"])
    out[0].write_text(table)
    try:
        out.append(plot_accuracy(data["rows"], f"{stem}-accuracy.png"))
        longgen = [r for r in data["records"] if r["task"] == "longgen" and r["policy"] == "punctuation"]
        if longgen:
            out.append(plot_timeline(longgen[0], f"{stem}-timeline.png"))
    except ImportError:
        pass  # no matplotlib: the table alone
    return out
