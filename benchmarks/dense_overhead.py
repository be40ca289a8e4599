#!/usr/bin/env python3
"""Per-token overhead of the Python decoding loop: dense decode through SFILlama vs pure C.

Both run the same library and context settings on the same machine: `sfi-decode-bench` (our
llama-bench-style C program, installed with the package) prefills D tokens and times N single-token
decodes; SFILlama prefills D tokens and generates N tokens (sampling with llama.cpp's greedy sampler,
streaming text), in this process. Prints a table and writes JSON to benchmarks/results/.

    python3 benchmarks/dense_overhead.py --depth 2048 --n-decode 64            # CPU, default model
    python3 benchmarks/dense_overhead.py --model X.gguf -ngl 99 --depth 8192     # GPU

--dropin also times llama-cpp-python's token loop (`Llama.generate`, greedy, its own sampler chain) on
`llama_cpp.Llama` and on `sfi_gguf.Llama` (SFI's eval in that loop: with the default SFI settings, which
decode densely below SFI's threshold, and with sfi=False, llama-cpp-python's own eval).
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf.tools.provenance import git_commit  # noqa: E402
from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.core.library import find_lib_dir  # noqa: E402
from sfi_gguf.models import resolve_model_path  # noqa: E402



def hardware(n_gpu_layers: int) -> str:
    if n_gpu_layers:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True).stdout.strip().splitlines()
            if out:
                return out[0]
        except OSError:
            pass
    return f"{platform.processor() or platform.machine()} CPU"


def c_decode(model: Path, depth: int, n_decode: int, n_ctx: int, ngl: int, threads: int | None) -> float:
    binary = find_lib_dir() / "sfi-decode-bench"
    cmd = [str(binary), "-m", str(model), "-d", str(depth), "-n", str(n_decode), "-c", str(n_ctx),
           "-ngl", str(ngl), "-fa", "1", "-b", "512"]
    if threads:
        cmd += ["-t", str(threads)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["decode_tok_s"]


def python_decode(llm: SFILlama, depth: int, n_decode: int) -> float:
    rng = random.Random(1234)
    prompt = [rng.randrange(llm.context.n_vocab) for _ in range(depth)]
    llm.generate(prompt, max_tokens=2, temperature=0, ignore_eos=True)  # prefill + warm-up
    out = llm.generate(prompt, max_tokens=n_decode + 1, temperature=0, ignore_eos=True)
    return out.stats.decode_tok_s


def loop_decode(llm, depth: int, n_decode: int) -> float:
    """tok/s of llama-cpp-python's token loop: `Llama.generate` (eval + its sampler) over n_decode tokens."""
    rng = random.Random(1234)
    prompt = [rng.randrange(llm.n_vocab()) for _ in range(depth)]
    for n in (2, n_decode + 1):  # the first pass prefills and warms up
        llm.reset()
        tokens = llm.generate(prompt, temp=0.0)
        next(tokens)  # prefill and the first token
        t0 = time.perf_counter()
        for _ in range(n - 1):
            next(tokens)
        seconds = time.perf_counter() - t0
        tokens.close()
    return (n_decode) / seconds


def dropin_models(model: Path, n_ctx: int, ngl: int, threads: int | None):
    import llama_cpp
    import sfi_gguf

    kwargs = dict(n_ctx=n_ctx, n_gpu_layers=ngl, n_batch=512, flash_attn=True, verbose=False,
                  n_threads=threads, n_threads_batch=threads)
    return {"llama_cpp.Llama": lambda: llama_cpp.Llama(str(model), **kwargs),
            "sfi_gguf.Llama": lambda: sfi_gguf.Llama(str(model), **kwargs),
            "sfi_gguf.Llama(sfi=False)": lambda: sfi_gguf.Llama(str(model), sfi=False, **kwargs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="GGUF path or known name (default model if omitted)")
    ap.add_argument("--depth", type=int, nargs="+", default=[512, 2048])
    ap.add_argument("--n-decode", type=int, default=64)
    ap.add_argument("-ngl", "--n-gpu-layers", type=int, default=0)
    ap.add_argument("-t", "--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=2, help="alternate C and Python runs this many times; best of")
    ap.add_argument("--dropin", action="store_true", help="also time llama-cpp-python's loop on llama_cpp.Llama "
                                                          "and sfi_gguf.Llama")
    ap.add_argument("--out", default=None, help="JSON output path (default benchmarks/results/dense_overhead-*.json)")
    args = ap.parse_args()

    model = resolve_model_path(args.model)
    rows = []
    for depth in args.depth:
        n_ctx = depth + args.n_decode + 64
        llm = SFILlama(model, n_ctx=n_ctx, n_gpu_layers=args.n_gpu_layers, n_threads=args.threads, n_batch=512,
                       sfi=False)
        c_best, py_best = 0.0, 0.0
        for _ in range(args.repeats):
            c_best = max(c_best, c_decode(model, depth, args.n_decode, n_ctx, args.n_gpu_layers, args.threads))
            py_best = max(py_best, python_decode(llm, depth, args.n_decode))
        llm.close()
        loops = {}
        if args.dropin:
            for name, make in dropin_models(model, n_ctx, args.n_gpu_layers, args.threads).items():
                m = make()
                loops[name] = round(max(loop_decode(m, depth, args.n_decode) for _ in range(args.repeats)), 2)
                m.close()
                print(f"depth {depth:>6}: {name:<28} {loops[name]:8.2f} tok/s   ratio to C "
                      f"{loops[name] / c_best:.3f}", flush=True)
        row = {"hardware": hardware(args.n_gpu_layers), "model": model.name, "depth": depth,
               "n_decode": args.n_decode, "n_gpu_layers": args.n_gpu_layers, "c_tok_s": round(c_best, 2),
               "python_tok_s": round(py_best, 2), "ratio": round(py_best / c_best, 3),
               **({"llama_cpp_python_loop_tok_s": loops,
                   "llama_cpp_python_loop_ratio": {k: round(v / c_best, 3) for k, v in loops.items()}}
                  if loops else {}),
               "commit": git_commit(),
               "time": time.strftime("%Y-%m-%dT%H:%M:%S")}
        rows.append(row)
        print(f"depth {depth:>6}: C {c_best:8.2f} tok/s   SFILlama dense {py_best:8.2f} tok/s   "
              f"ratio {py_best / c_best:.3f}", flush=True)
    out = Path(args.out) if args.out else (REPO / "benchmarks" / "results" /
                                            f"dense_overhead-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
