#!/usr/bin/env python3
"""Teacher-forced agreement of SFI with dense decoding on natural text (quality, not speed).

Prefills a natural-text prompt of --prompt-tokens tokens, takes the dense greedy continuation of
--steps tokens, and forces SFI through it: top-1 agreement and KL(dense || SFI) per step.

    python3 benchmarks/agreement.py --n-ctx 4096 --prompt-tokens 3700 --k-head 512 --steps 256
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf.tools.provenance import git_commit  # noqa: E402
from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.tools.agreement import compare_with_dense  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.tools.texts import natural_text  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-ctx", type=int, default=4096)
    ap.add_argument("--prompt-tokens", type=int, default=3700)
    ap.add_argument("--steps", type=int, default=256)
    ap.add_argument("--k-head", type=int, default=512)
    ap.add_argument("--policy", nargs="+", default=["punctuation"])
    ap.add_argument("--selector", default="sfi")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("--seed", type=int, default=1, help="which natural text")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    llm = SFILlama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, n_gpu_layers=args.n_gpu_layers)
    prompt = llm.tokenize(natural_text(args.prompt_tokens * 6, seed=args.seed))[:args.prompt_tokens]
    commit = git_commit()
    rows = []
    for policy in args.policy:
        llm.sfi_config = SFIConfig(k_head=args.k_head, policy=policy, selector=args.selector)
        t0 = time.perf_counter()
        res = compare_with_dense(llm, prompt, n_steps=args.steps)
        s = res.sfi_stats
        row = {"model": llm.model_path.name, "policy": policy, "selector": args.selector, "context": len(prompt),
               "k_head": args.k_head, "budget_share": round((4 + args.k_head + 256) / len(prompt), 3),
               "steps": args.steps, "top1": round(res.top1_rate, 4), "mean_kl": round(res.mean_kl, 5),
               "slow_steps": s.n_slow if s else 0, "mean_refresh_overlap": round(s.mean_overlap, 3) if s else None,
               "per_100": res.per_window(100), "seconds": round(time.perf_counter() - t0, 1), "commit": commit}
        rows.append(row)
        print(f"{policy:12s} top-1 {row['top1']:.3f}  KL {row['mean_kl']:.4f}  slow steps {row['slow_steps']}  "
              f"overlap {row['mean_refresh_overlap']}", flush=True)
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"agreement-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
