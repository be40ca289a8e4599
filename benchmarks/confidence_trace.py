"""Record a trained model's confidence along `sfi-gguf bench`'s forced text, for `bench --confidence-trace`.

The default trigger's low-confidence rule reads the top-1 probability of each step's distribution. The
bench times random-weight models, which are never sure, so there the rule fires every `min_gap` steps: the
policy's worst case. This script decodes the same forced continuations (the bench's text, tokenizer and
depths) with the real default model, densely on the CPU, each after the `--context` tokens of text before
it (the model's own context is 32K; the bench's depths go to 128K), and writes every step's top-1
probability. The bench replays them (`tools.bench.ReplayedConfidence`) and checks that the forced tokens match.

    python3 benchmarks/confidence_trace.py --out benchmarks/data/confidence-trace-qwen2.5-coder-0.5b.json

The text comes from Python's own `pydoc_data.topics`, which changes between Python releases: a trace
replays only on a machine whose Python gives the same text (the bench checks every forced token), or
was recorded with `--pydoc-topics` pointing at that machine's topics.py.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sfi_gguf.tools.bench import DEFAULT_DEPTHS, forced_tokens_digest, text_tokens  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.sfi_llama import SFILlama  # noqa: E402
from sfi_gguf.core.policy import PunctuationParams, top1_probability  # noqa: E402
from sfi_gguf.tools.texts import text_source  # noqa: E402


def use_pydoc_topics(path: Path) -> None:
    """Build the texts from the topics module at `path` instead of this Python's (before any text is made)."""
    import importlib.util

    import pydoc_data

    spec = importlib.util.spec_from_file_location("pydoc_data.topics", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules["pydoc_data.topics"] = pydoc_data.topics = module


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF (default: the default model)")
    ap.add_argument("--depths", type=int, nargs="+", default=[4096, 16384, *DEFAULT_DEPTHS])
    ap.add_argument("-n", "--n-decode", type=int, default=256)
    ap.add_argument("--context", type=int, default=4096, help="tokens of text before each depth the model reads")
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--pydoc-topics", default=None,
                    help="another Python's pydoc_data/topics.py: the bench text of the machine that runs that Python "
                         "(the text is built from it; e.g. the GPU machine's, whose Python differs from this one's)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.pydoc_topics:
        use_pydoc_topics(Path(args.pydoc_topics))

    llm = SFILlama(args.model, n_ctx=args.context + args.n_decode + 64, n_threads=args.threads, flash_attn=False,
                   sfi=SFIConfig(policy="dense"))
    ctx = llm.context
    text = text_tokens(llm, max(args.depths) + args.n_decode)
    trace = {"model": Path(str(llm.model_path)).name, "text_source": text_source(),
             "model_sha256": hashlib.sha256(Path(llm.model_path).read_bytes()).hexdigest(),
             "context": args.context, "n_decode": args.n_decode,
             "command": "python3 benchmarks/confidence_trace.py " + " ".join(sys.argv[1:]), "depths": {}}
    try:
        for depth in sorted(args.depths):
            t0 = time.perf_counter()
            forced = text[depth:depth + args.n_decode]
            ctx.truncate(0)
            dense = llm.stepper(SFIConfig(policy="dense"))
            dense.prefill(text[max(0, depth - args.context):depth])
            top1 = []
            for token in forced:
                top1.append(round(top1_probability(ctx.last_logits()), 5))
                dense.step(int(token))
            trace["depths"][str(depth)] = {"forced_sha256": forced_tokens_digest(forced), "top1": top1}
            low = np.mean(np.array(top1) < PunctuationParams.confidence_floor)
            print(f"depth {depth}: {len(top1)} steps in {time.perf_counter() - t0:.0f} s, mean top-1 "
                  f"{np.mean(top1):.3f}, below {PunctuationParams.confidence_floor}: {low:.0%}", flush=True)
    finally:
        llm.close()
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(trace, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
