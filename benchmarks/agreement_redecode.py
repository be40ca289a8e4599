#!/usr/bin/env python3
"""SFIConfig.redecode_tail against the defaults on one of the long suite's answer-agreement cases, in one process.

Dense answers once (flash attention on, the library's default); the defaults and the defaults with
`redecode_tail` are teacher-forced through that answer on the same cached prompt, so the two rows differ
only in the option (the suite's records of other commits can differ by near-ties).

    python3 benchmarks/agreement_redecode.py --long-case 8192:1 --k-head 2048 1024 -t 2
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.tools.agreement import agreement_with  # noqa: E402
from sfi_gguf.tools.evals import answer_agreement, long_tasks  # noqa: E402
from sfi_gguf.tools.provenance import git_commit  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--long-case", required=True, metavar="CONTEXT:INDEX")
    ap.add_argument("--k-head", type=int, nargs="+", default=[2048])
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    context, index = (int(x) for x in args.long_case.split(":"))
    llm = SFILlama(args.model, n_ctx=context, n_threads=args.threads)
    case, tokens = long_tasks.case_and_prompt(llm, answer_agreement.TASK, context, index)
    ref = answer_agreement.dense_answer(llm, tokens, case.max_tokens)
    n = ref.n_steps
    rows = []
    for k_head in args.k_head:
        for redecode in (False, True):
            t0 = time.perf_counter()
            res = agreement_with(llm, tokens, ref, SFIConfig(k_head=k_head, redecode_tail=redecode))
            rows.append({"model": llm.model_path.name, "case_id": case.case_id, "context": context, "k_head": k_head,
                         "redecode_tail": redecode, "steps": n, "top1": round(res.top1_rate, 4),
                         "mean_kl": round(res.mean_kl, 5), "first_divergence": answer_agreement.first_divergence(res.top1),
                         "slow_steps": res.sfi_stats.slow_steps, "seconds": round(time.perf_counter() - t0, 1),
                         "commit": git_commit()})
            print(f"{case.case_id} k_head {k_head} redecode_tail {redecode}: top-1 {rows[-1]['top1']:.4f} "
                  f"KL {rows[-1]['mean_kl']:.4f} ({len(rows[-1]['slow_steps'])} slow steps)", flush=True)
    llm.close()
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"agreement-redecode-{case.case_id}.json"
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
