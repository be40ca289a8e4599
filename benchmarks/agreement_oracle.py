#!/usr/bin/env python3
"""Upper bound of teacher-forced agreement at a given budget: select with the CURRENT query's attention.

At every step of the dense greedy continuation the token is decoded densely as a slow step (exact
logits + the attention-mass export of its own query), its cell is removed again, and the same token
is decoded as a fast step over a selection built from that export (sink + top cells per layer and
KV head + recent window): no real decoder can select better with the same budget than the true
top-k of the attention it is about to compute ("oracle"). Variants: oracle top-k mass at several
budgets, the SFI Selector on the current export (what refreshing every step would give), and on
the previous step's export (lag 1: the fastest cadence a real slow step can serve). The cache keeps
the dense KV of every token (the step is re-decoded densely), so every variant sees the dense history.
A lag of L uses the selection made L steps earlier: what a refresh every L + 1 steps serves at its last
fast step, without the fast steps' own KV.

    python3 benchmarks/agreement_oracle.py --n-ctx 4096 --prompt-tokens 3700 --steps 256 -t 2
    python3 benchmarks/agreement_oracle.py --n-ctx 16384 --long-case 16384:1 -t 2 --variants sfi_default_k2048_lag0 ...
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf.tools.provenance import git_commit  # noqa: E402
from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.tools.agreement import kl_top_n, log_softmax  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.core.bindings import SFINative  # noqa: E402
from sfi_gguf.core.selector import AttentionExport, CandidateRange, assemble_memory, make_selector  # noqa: E402
from sfi_gguf.tools.texts import natural_text  # noqa: E402

# name -> (selector, k_head, lag in steps, extra selector options)
PAPER = {"nms_strength": 1.0, "pool_window": 0}  # the paper's Selector (soft-NMS on, no pooling)
VARIANTS = {
    "oracle_topk_k512": ("topk_mass", 512, 0, {}),
    "oracle_topk_k1024": ("topk_mass", 1024, 0, {}),
    "oracle_topk_k2048": ("topk_mass", 2048, 0, {}),
    "sfi_selector_k512": ("sfi", 512, 0, PAPER),
    "sfi_selector_pool17_k512": ("sfi", 512, 0, {**PAPER, "pool_window": 17}),
    "sfi_selector_k512_lag1": ("sfi", 512, 1, PAPER),
    "topk_k512_lag1": ("topk_mass", 512, 1, {}),
    "sfi_default_k512_lag1": ("sfi", 512, 1, {}),  # the current defaults (soft-NMS off, pooling 17)
    "oracle_topk_k4096": ("topk_mass", 4096, 0, {}),
}
# the selection at k_head 2048 as it ages (lag 0: fresh; 4, 16: as a cadence of that many steps ends)
FAMILIES = {
    "sfi_default": ("sfi", {}),
    "sfi_no_prior": ("sfi", {"lambda_clip_single": 0.0, "lambda_clip_multi": 0.0}),
    "topk_pool17": ("topk_mass", {"pool_window": 17}),
    "topk": ("topk_mass", {}),
}
for _name, (_selector, _options) in FAMILIES.items():
    for _lag in (0, 1, 4, 16):
        VARIANTS[f"{_name}_k2048_lag{_lag}"] = (_selector, 2048, _lag, _options)


def kl_top(logp: np.ndarray, logq: np.ndarray, top_n: int = 64) -> float:
    """KL(p || q) over p's top_n tokens plus the rest as one bucket (the metric of sfi_gguf.tools.agreement)."""
    top = np.argpartition(logp, -top_n)[-top_n:]
    return kl_top_n(logp[top], logq[top])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=3700)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--n-sink", type=int, default=4)
    ap.add_argument("--n-recent", type=int, default=256)
    ap.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1, help="which natural text (1: the BENCHMARKS agreement text)")
    ap.add_argument("--long-case", default=None, metavar="CONTEXT:INDEX",
                    help="prompt: the long suite's answer-agreement case (document INDEX of CONTEXT tokens) "
                         "instead of natural text; the steps follow dense's greedy answer")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    k_max = max(VARIANTS[v][1] for v in args.variants)
    llm = SFILlama(args.model, n_ctx=args.n_ctx, n_threads=args.threads,
                   sfi=SFIConfig(k_head=k_max, n_sink=args.n_sink, n_recent=args.n_recent, n_prefill_queries=1))
    ctx = llm.context
    if args.long_case:
        from sfi_gguf.tools.evals import answer_agreement, long_tasks
        context, index = (int(x) for x in args.long_case.split(":"))
        _, prompt = long_tasks.case_and_prompt(llm, answer_agreement.TASK, context, index)
    else:
        prompt = llm.tokenize(natural_text(args.prompt_tokens * 6, seed=args.seed))[:args.prompt_tokens]
    llm.stepper()  # creates the native SFI state with room for the largest budget
    native: SFINative = llm._sfi_native
    group = ctx.n_head // native.n_head_kv
    selectors = {v: make_selector(SFIConfig(selector=VARIANTS[v][0], **VARIANTS[v][3])) for v in args.variants}

    native.set_mode(SFINative.DENSE)
    ctx.prefill(prompt)
    top1 = {v: [] for v in args.variants}
    kls = {v: [] for v in args.variants}
    fell_back = {v: 0 for v in args.variants}
    history: dict[str, list] = {v: [] for v in args.variants}  # each variant's selections, newest last
    t0 = time.perf_counter()
    token = int(np.argmax(ctx.last_logits()))
    for step in range(args.steps):
        p = len(ctx.tokens)
        native.set_mode(SFINative.SLOW)
        ctx.decode_one(token)                     # dense, exact, exports its own query's attention
        logp = log_softmax(ctx.last_logits())
        dense_arg = int(np.argmax(logp))
        positions = native.cell_pos()
        mass = native.mass()
        export = AttentionExport(mass=mass, evidence=native.evidence(), key_norms=native.key_norms(),
                                 n_rows=native.n_query_rows() * group, alpha=native.params["evidence_alpha"],
                                 positions=positions[: mass.shape[2]])
        fresh = {}
        for v in args.variants:
            _, k_head, lag, _ = VARIANTS[v]
            candidates = CandidateRange.for_context(p, args.n_sink, args.n_recent)
            key = (VARIANTS[v][0], k_head, tuple(sorted(VARIANTS[v][3].items())))
            if key not in fresh:                  # variants differing only in lag share the step's selection
                fresh[key] = selectors[v].select(export, candidates, k_head)
            history[v] = (history[v] + [fresh[key]])[-(lag + 1):]
            if len(history[v]) <= lag:
                continue                          # a lag of L has nothing to use in the first L steps
            selected = history[v][0]
            ctx.truncate(p)                       # drop the dense cell of this token (invalidates the view)
            sink, recent = CandidateRange.for_context(p, args.n_sink, args.n_recent).sink_and_recent_cells(
                native.cell_pos())
            native.set_selection(assemble_memory(selected, sink, recent))
            native.set_mode(SFINative.FAST)
            ctx.decode_one(token)
            fell_back[v] += native.fell_back_dense  # must stay 0: the fast step really used the selection
            logq = log_softmax(ctx.last_logits())
            top1[v].append(int(np.argmax(logq)) == dense_arg)
            kls[v].append(kl_top(logp, logq))
        ctx.truncate(p)                           # back to the dense history
        native.set_mode(SFINative.DENSE)
        ctx.decode_one(token)
        token = dense_arg
        if ctx.is_eog(token):
            print(f"dense's answer ended after {step + 1} steps", flush=True)
            break
        if (step + 1) % 32 == 0:
            print(f"step {step + 1}: " + "  ".join(f"{v} {np.mean(top1[v]):.3f}" for v in args.variants),
                  f"({time.perf_counter() - t0:.0f} s)", flush=True)

    commit = git_commit()
    rows = []
    for v in args.variants:
        selector, k_head, lag, options = VARIANTS[v]
        rows.append({"model": llm.model_path.name, "variant": v, "selector": selector, "selector_options": options,  # {}: that selector's defaults
                     "k_head": k_head, "lag": lag, "context": len(prompt), "n_sink": args.n_sink,
                     "n_recent": args.n_recent,
                     "budget_share": round((args.n_sink + k_head + args.n_recent) / len(prompt), 3),
                     "steps": len(top1[v]), "top1": round(float(np.mean(top1[v])), 4),
                     "mean_kl": round(float(np.mean(kls[v])), 4), "fell_back_dense": fell_back[v],
                     "commit": commit})
        print(f"{v:28s} top-1 {rows[-1]['top1']:.3f}  KL {rows[-1]['mean_kl']:.4f}")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"agreement-oracle-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
