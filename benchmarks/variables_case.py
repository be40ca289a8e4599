#!/usr/bin/env python3
"""One variable-tracking case of `sfi-gguf eval`, looked at closely: the first hop written by dense and
by SFI variants (budget, Selector, bootstrap rows), and dense's top tokens at each step of it, to tell
a near-tie from a selection that misses the context.

    python3 benchmarks/variables_case.py --model gemma3-270m --context 2048 --case 2048-0-2 -t 1
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.tools.evals import common, variables  # noqa: E402
from sfi_gguf.tools.evals.runner import k_head_for  # noqa: E402
from sfi_gguf.tools.provenance import git_commit  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--case", default="2048-0-2", help="case id as in the results file")
    ap.add_argument("--n-cases", type=int, default=4, help="cases of that context in the suite (ids depend on it)")
    ap.add_argument("-t", "--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="JSON file for the result")
    args = ap.parse_args()

    llm = SFILlama(args.model, n_ctx=args.context + 512, n_threads=args.threads)
    case = next(c for c in variables.make_cases(llm, args.context, args.n_cases) if c.case_id == args.case)
    tokens = common.prompt_tokens(llm, case)
    k_head = k_head_for(args.context, 0.125)
    variants = {"dense": SFIConfig(policy="dense"), f"sfi k_head {k_head}": SFIConfig(k_head=k_head),
                "sfi k_head 512": SFIConfig(k_head=512), "sfi k_head 1024": SFIConfig(k_head=1024),
                "top-k mass Selector": SFIConfig(k_head=k_head, selector="topk_mass"),
                "64 bootstrap rows": SFIConfig(k_head=k_head, n_prefill_queries=64)}
    first_hop = {}
    for name, config in variants.items():
        llm.sfi_config = config
        first_hop[name] = llm.generate(tokens, max_tokens=case.max_tokens, temperature=0, stop=list(case.stop)).text
        print(f"{name:24s} {first_hop[name]!r}")
    llm.sfi_config = SFIConfig(policy="dense")
    res = llm.generate(tokens, max_tokens=4, temperature=0, logprobs=3)
    dense_top = [[(llm.detokenize([t]), round(math.exp(lp), 3)) for t, lp in top] for _, _, top in res.logprobs]
    for step in dense_top:
        print("dense top-3:", step)
    out = {"model": args.model, "case": args.case, "expected": list(case.expected), "prompt_tokens": len(tokens),
           "first_hop": first_hop, "dense_top3": dense_top, "git_commit": git_commit(12)}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
