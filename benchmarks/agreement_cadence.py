#!/usr/bin/env python3
"""Teacher-forced agreement of SFI with dense as a function of the refresh cadence and the Selector.

Where `agreement_oracle.py` bounds what a selection made from the current query can do, this runs
the real stepper (fast steps write their own KV, selections age between refreshes) with the
"fixed" policy at several periods, and the method's own "punctuation" policy, for each Selector.
Top-1 agreement is reported over all steps and over fast steps only (a slow step is dense, hence
exact, so short periods would otherwise look better just for having more exact steps).

    python3 benchmarks/agreement_cadence.py --n-ctx 4096 --prompt-tokens 3700 --steps 256 -t 2
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
from sfi_gguf.tools.agreement import agreement_with, dense_reference  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.core.policy import PunctuationParams  # noqa: E402
from sfi_gguf.tools.texts import natural_text  # noqa: E402

# named Selector settings (SFIConfig fields)
SELECTORS = {
    "sfi": {"selector": "sfi"},  # the current defaults (soft-NMS off, pooling 17)
    "sfi_paper": {"selector": "sfi", "pool_window": 0, "nms_strength": 1.0},  # the paper's Selector
    "sfi_no_nms": {"selector": "sfi", "pool_window": 0, "nms_strength": 0.0},
    "sfi_no_prior": {"selector": "sfi", "pool_window": 0, "nms_strength": 1.0, "lambda_clip_single": 0.0,
                     "lambda_clip_multi": 0.0},
    "sfi_no_nms_pool17": {"selector": "sfi", "pool_window": 17, "nms_strength": 0.0},
    "topk_mass": {"selector": "topk_mass", "pool_window": 0},
    "topk_mass_pool17": {"selector": "topk_mass", "pool_window": 17},
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=3700)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--k-head", type=int, default=512)
    ap.add_argument("--periods", nargs="+", type=int, default=[2, 4, 16, 64])
    ap.add_argument("--punctuation", action="store_true", help="also the punctuation + T_max policy")
    ap.add_argument("--min-gap", type=int, default=PunctuationParams.min_gap, help="of the punctuation policy")
    ap.add_argument("--refresh-interval", type=int, default=PunctuationParams.refresh_interval, help="T_max of the punctuation policy")
    ap.add_argument("--sentence-offset", type=int, default=PunctuationParams.sentence_offset,
                    help="of the punctuation policy: slow this many tokens into a sentence (0: on its first token)")
    ap.add_argument("--warmup-refresh", type=int, default=PunctuationParams.warmup_refresh,
                    help="of the punctuation policy: one extra slow step this many steps after the bootstrap (0: none)")
    ap.add_argument("--selection-delay", type=int, default=0,
                    help="fast steps before a new selection is loaded (the Selector runs in the background)")
    ap.add_argument("--confidence-floor", type=float, default=PunctuationParams.confidence_floor,
                    help="of the punctuation policy: slow when the top-1 probability falls below this (0: never)")
    ap.add_argument("--device-selector", action="store_true",
                    help="run the Selector in the slow step's graph (every cell of the range a candidate)")
    ap.add_argument("--refresh-layer-groups", nargs="+", type=int, default=[1],
                    help="with --device-selector: one row per value (a refresh renews one group of layers in turn)")
    ap.add_argument("--selectors", nargs="+", default=["sfi", "topk_mass"], choices=list(SELECTORS))
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    llm = SFILlama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, sfi=SFIConfig(k_head=args.k_head))
    prompt = llm.tokenize(natural_text(args.prompt_tokens * 6, seed=args.seed))[:args.prompt_tokens]
    ref = dense_reference(llm, prompt, args.steps)
    commit = git_commit()
    policies = [("fixed", p) for p in args.periods] + ([("punctuation", 0)] if args.punctuation else [])
    rows = []
    device = dict(device_selector=True, n_candidates=10**9) if args.device_selector else {}
    variants = [(selector, groups) for selector in args.selectors for groups in args.refresh_layer_groups]
    for selector, groups in variants:
        for policy, period in policies:
            config = SFIConfig(k_head=args.k_head, policy=policy, fixed_period=max(period, 1), min_gap=args.min_gap,
                               refresh_layer_groups=groups, **device,
                               refresh_interval=args.refresh_interval, sentence_offset=args.sentence_offset,
                               warmup_refresh=args.warmup_refresh, confidence_floor=args.confidence_floor,
                               selection_delay=args.selection_delay,
                               **SELECTORS[selector])
            t0 = time.perf_counter()
            res = agreement_with(llm, prompt, ref, config)
            s = res.sfi_stats
            fast = np.ones(res.n_steps, dtype=bool)
            fast[[i for i in s.slow_steps if i < res.n_steps]] = False
            fast[0] = False  # the first distribution comes from the prefill (dense)
            row = {"model": llm.model_path.name, "selector": selector, "selector_options": SELECTORS[selector], "policy": policy,
                   "device_selector": bool(device), "refresh_layer_groups": groups, "seed": args.seed,
                   "period": period or None, "min_gap": args.min_gap, "refresh_interval": args.refresh_interval, "selection_delay": args.selection_delay,
                   "sentence_offset": args.sentence_offset, "warmup_refresh": args.warmup_refresh,
                   "confidence_floor": args.confidence_floor, "context": len(prompt), "k_head": args.k_head,
                   "budget_share": round((4 + args.k_head + 256) / len(prompt), 3), "steps": res.n_steps,
                   "top1": round(res.top1_rate, 4), "top1_fast_steps": round(float(res.top1[fast].mean()), 4),
                   "mean_kl": round(res.mean_kl, 4), "kl_fast_steps": round(float(res.kl[fast].mean()), 4),
                   "slow_steps": s.n_slow, "slow_step_positions": list(s.slow_steps), "slow_step_reasons": dict(s.reasons),
                   "per_32": res.per_window(32), "mean_refresh_overlap": round(s.mean_overlap, 3),
                   "seconds": round(time.perf_counter() - t0, 1), "commit": commit}
            rows.append(row)
            print(f"{selector:16s} groups {groups} {policy:11s} period {period:3d}: top-1 {row['top1']:.3f} "
                  f"(fast steps {row['top1_fast_steps']:.3f})  KL {row['mean_kl']:.3f} "
                  f"(fast {row['kl_fast_steps']:.3f})  slow {s.n_slow}  overlap {row['mean_refresh_overlap']}",
                  flush=True)
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"agreement-cadence-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
