#!/usr/bin/env python3
"""How far dense decoding agrees with itself: the floor under every teacher-forced agreement score.

The long suite's answer agreement (`sfi-gguf eval --suite long --task agreement`) scores a policy by
how often its argmax equals dense's along dense's own greedy answer; dense scores 100% by definition.
Here the reference is the suite's (dense, flash attention on, the library's default) and the other
decoder is dense too, with flash attention off: the same model and cells through another attention
kernel. Where it parts from the reference, the two best tokens are so close that rounding decides,
and no sparse memory can be asked to do better than that.

    python3 benchmarks/agreement_noise_floor.py --long-case 8192:0 -t 2
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
    ap.add_argument("--long-case", required=True, metavar="CONTEXT:INDEX",
                    help="the long suite's answer-agreement case: document INDEX of CONTEXT tokens")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    context, index = (int(x) for x in args.long_case.split(":"))
    dense = SFIConfig(policy="dense")
    reference_llm = SFILlama(args.model, n_ctx=context, n_threads=args.threads, flash_attn=True, sfi=dense)
    case, tokens = long_tasks.case_and_prompt(reference_llm, answer_agreement.TASK, context, index)
    t0 = time.perf_counter()
    ref = answer_agreement.dense_answer(reference_llm, tokens, case.max_tokens)
    n = ref.n_steps
    reference_llm.close()
    t1 = time.perf_counter()
    other = SFILlama(args.model, n_ctx=context, n_threads=args.threads, flash_attn=False, sfi=dense)
    res = agreement_with(other, tokens, ref, dense)
    row = {"model": other.model_path.name, "case_id": case.case_id, "context": context, "prompt_tokens": len(tokens),
           "reference": "dense, flash attention on", "decoder": "dense, flash attention off", "steps": n,
           "top1": round(res.top1_rate, 4), "mean_kl": round(res.mean_kl, 5),
           "first_divergence": answer_agreement.first_divergence(res.top1),
           "top1_bits": "".join("1" if x else "0" for x in res.top1),
           "seconds": {"reference": round(t1 - t0, 1), "decoder": round(time.perf_counter() - t1, 1)},
           "commit": git_commit()}
    other.close()
    print(f"{case.case_id}: dense without flash attention agrees with dense with it at top-1 {row['top1']:.3f}, "
          f"mean KL {row['mean_kl']:.5f}, first divergence at step {row['first_divergence']} of {n}")
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"agreement-noise-floor-{case.case_id}.json"
    out.write_text(json.dumps(row, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
