"""Sampling in the decode's graph against the host chain: the same seeds, the same tokens?

For each seed, one generation samples in the graph (`sfi_gguf.core.device_picks`: llama.cpp's backend top-k, top-p,
min-p, temperature and dist samplers) and one on the host (logprobs make the host chain pick, over the copied
logits), from the same prompt and an empty cache, decoding densely (the picks are the question here); a third, in the graph again, checks that a seed repeats. Prints
and writes (JSON) how many generations are identical and where the others first differ.

  python3 benchmarks/sampling_agreement.py -t 2 --seeds 20 -n 64             # default model, default sampling
  python3 benchmarks/sampling_agreement.py -t 2 --seeds 20 -n 64 --temperature 1.5 --top-k 0 --min-p 0
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

PROMPT = "Write a short story about a lighthouse keeper who finds a message in a bottle."


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-m", "--model", default=None, help="GGUF or known model (default: the default model)")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("--seeds", type=int, default=20)
    p.add_argument("-n", "--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=40)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--min-p", type=float, default=0.05)
    p.add_argument("--json", default=None, help="default: benchmarks/results/sampling_agreement-<kind>-<...>.json")
    args = p.parse_args(argv)

    from sfi_gguf import SFILlama
    from sfi_gguf.core.device_picks import DevicePicks
    from sfi_gguf.tools.provenance import git_commit

    picked = []
    real = DevicePicks.token
    DevicePicks.token = lambda self, index: picked.append(1) or real(self, index)
    llm = SFILlama(args.model, n_ctx=1024, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads)
    sampling = dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p)
    rows = []
    try:
        prompt = llm.prompt_tokens([{"role": "user", "content": PROMPT}])
        for seed in range(args.seeds):
            def run(host: bool) -> list[int]:
                llm.reset()  # an empty cache: the same prefill, bit for bit
                before = len(picked)
                out = llm.generate(prompt, max_tokens=args.max_tokens, seed=seed, ignore_eos=True, sfi=False,
                                   logprobs=1 if host else None, **sampling).tokens
                assert (len(picked) > before) != host, "the picks were not made where this run asked"
                return out

            device, host, again = run(False), run(True), run(False)
            first = next((i for i, (a, b) in enumerate(zip(device, host)) if a != b), None)
            rows.append(dict(seed=seed, identical=device == host, repeats=device == again, first_difference=first,
                             n_tokens=len(device)))
            print(f"seed {seed}: {'identical' if device == host else f'first difference at token {first}'}"
                  f"{'' if device == again else ', the graph did not repeat itself'}", flush=True)
    finally:
        llm.close()
    n_same = sum(r["identical"] for r in rows)
    n_repeat = sum(r["repeats"] for r in rows)
    print(f"\n{n_same} of {len(rows)} generations of {args.max_tokens} tokens identical to the host chain's; "
          f"{n_repeat} of {len(rows)} repeated in the graph")
    kind = "gpu" if args.n_gpu_layers else "cpu"
    path = Path(args.json) if args.json else ROOT / "benchmarks" / "results" / (
        f"sampling_agreement-{kind}-t{args.temperature}-k{args.top_k}-{time.strftime('%Y%m%d')}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(dict(git_commit=git_commit(12), model=Path(str(llm.model_path)).name,
                                    n_gpu_layers=args.n_gpu_layers, threads=args.threads,
                                    max_tokens=args.max_tokens, sampling=sampling, identical=n_same,
                                    repeated=n_repeat, seeds=rows), indent=1) + "\n")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
