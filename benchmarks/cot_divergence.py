#!/usr/bin/env python3
"""Why a policy misses a chain-of-thought case that dense solves: where it diverges, and what fixes it.

For each cot case (seeded, as `sfi-gguf eval` makes them): dense greedy generation; the policy
teacher-forced through dense's tokens, so its first argmax that differs from dense's is the token
where its free-running answer leaves dense's (with the last slow step before it and its reason);
then free-running variants that change one thing each: the refresh cadence (fixed period), the
budget (k_head, recent window) or the Selector (top-k mass), to tell which one the miss needs.

    python3 benchmarks/cot_divergence.py --cases 16 --only-missed -t 1
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.tools.agreement import agreement_with, dense_reference  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.tools.evals import cot  # noqa: E402
from sfi_gguf.tools.evals.runner import k_head_for  # noqa: E402

#: name -> SFIConfig changes against the eval's setting (policy punctuation, k_head 64, recent 32)
VARIANTS = {
    "eval setting": {},
    "fixed 64": {"policy": "fixed"},
    "fixed 16": {"policy": "fixed", "fixed_period": 16},
    "fixed 4": {"policy": "fixed", "fixed_period": 4},
    "T_max 16": {"refresh_interval": 16},
    "warm-up refresh at 4": {"warmup_refresh": 4},
    "k_head 128": {"k_head": 128},
    "recent 96": {"n_recent": 96},
    "top-k mass Selector": {"selector": "topk_mass"},
}


def first_divergence(llm, tokens, dense_tokens, config) -> dict:
    """Teacher-force `config` through dense's answer: the first step whose argmax differs."""
    ref = dense_reference(llm, tokens, len(dense_tokens), forced=dense_tokens)
    res = agreement_with(llm, tokens, ref, config)
    stats = res.sfi_stats
    slow = list(stats.slow_steps) if stats else []
    bad = [i for i in range(res.n_steps) if not res.top1[i]]
    if not bad:
        return {"step": None, "slow_steps": slow}
    i = bad[0]
    before = [s for s in slow if s <= i]
    dense_p = dict(zip(ref.top[i].tolist(), np.exp(ref.logp[i]).tolist()))  # dense's margin at that token
    return {"step": i, "n_steps": res.n_steps, "dense": llm.detokenize([int(ref.argmax[i])]),
            "policy": llm.detokenize([int(res.argmax[i])]), "kl": round(float(res.kl[i]), 3),
            "dense_p": round(dense_p.get(int(ref.argmax[i]), 0.0), 3),
            "dense_p_of_policy_token": round(dense_p.get(int(res.argmax[i]), 0.0), 3),
            "context": llm.detokenize(dense_tokens[max(0, i - 24):i]),
            "slow_step_at_token": i in slow, "last_slow_step": before[-1] if before else None,
            "slow_steps": slow, "top1_rate": round(res.top1_rate, 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=16)
    ap.add_argument("--case", nargs="*", default=None, help="only these case ids (e.g. 0-2 0-10)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--policy", default="punctuation")
    ap.add_argument("--only-missed", action="store_true", help="analyse only cases dense solves and the policy misses")
    ap.add_argument("--variants", nargs="*", default=list(VARIANTS))
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    llm = SFILlama(None, n_ctx=2048, n_threads=args.threads)
    rows = []
    for case in cot.make_cases(llm, args.cases, seed=args.seed):
        if args.case and case.case_id not in args.case:
            continue
        tokens = cot.prompt_tokens(llm, case)
        base = SFIConfig(policy=args.policy, k_head=k_head_for(len(tokens), 0.125), n_recent=32)

        def run(config):
            llm.sfi_config = config
            out = llm.generate(tokens, max_tokens=case.max_tokens, temperature=0, stop=list(case.stop))
            return out, cot.score(case, out.text)

        dense, dense_score = run(SFIConfig(policy="dense"))
        _, score = run(base)
        row = {"case_id": case.case_id, "problem": case.meta["problem"], "expected": case.expected[0],
               "dense_score": dense_score, "score": score, "dense_text": dense.text}
        if dense_score == 1.0 and (score < 1.0 or not args.only_missed):
            row["divergence"] = first_divergence(llm, tokens, dense.tokens, base)
            row["variants"] = {}
            for name in args.variants:
                out, s = run(base.replace(**VARIANTS[name]))
                row["variants"][name] = {"score": s, "answer": cot.final_number(out.text), "text": out.text}
            d = row["divergence"]
            print(f"{case.case_id} expected {case.expected[0]}: diverges at token {d['step']} "
                  f"(dense {d.get('dense')!r}, {args.policy} {d.get('policy')!r}; last slow step "
                  f"{d.get('last_slow_step')}) after ...{d.get('context', '')!r}", flush=True)
            print("   " + ", ".join(f"{n}: {v['score']:.0f} ({v['answer']})" for n, v in row["variants"].items()),
                  flush=True)
        elif not args.only_missed or dense_score == 1.0:
            print(f"{case.case_id}: dense {dense_score:.0f} {args.policy} {score:.0f}", flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
