#!/usr/bin/env python3
"""Micro-benchmark of one decode step: dense vs FAST (compact view) vs SLOW (dense + export).

All in one process and one context: the context is filled to --ctx tokens, then each kind of step is
timed for --steps steps (the decoded tokens are removed again after each series, so every series runs
at the same context length):
  * dense step at --ctx;
  * slow step at --ctx (dense + attention-mass / evidence / key-norm export, copied to the host);
  * the first FAST step after a selection (it gathers the selection: the "refresh") and the
    following FAST steps, with a selection of --budget cells per (layer, KV head);
  * a dense step at a context of --budget tokens (what a FAST step should cost at most).
A step is llama_decode of one token plus reading its logits (which waits for the device).

    python benchmarks/native_step_bench.py                         # random Qwen3-4B shape, CPU
    python benchmarks/native_step_bench.py --ngl 99 --ctx 32768    # CUDA
    python benchmarks/native_step_bench.py --model qwen3-0.6b --ctx 8192 --steps 8
--model takes a GGUF path or a name of sfi_gguf.random_model.SHAPES.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sfi_gguf._native import llama_cpp  # noqa: E402  (loads the patched library)
from sfi_gguf.native import SFINative, STATUS_LAST_FAST  # noqa: E402
from sfi_gguf.random_model import SHAPES, random_model  # noqa: E402


def summarize(times: list[float]) -> dict:
    ms = [t * 1e3 for t in times]
    return {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "min_ms": min(ms), "max_ms": max(ms)}


class Bench:
    def __init__(self, args):
        path = Path(args.model) if Path(args.model).suffix == ".gguf" else random_model(args.model)
        self.path = path
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = args.ngl
        self.model = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        if not self.model:
            raise SystemExit(f"cannot load {path}")
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx = args.ctx + args.steps + 2 * args.warmup + 64
        cp.n_batch = args.batch
        cp.n_ubatch = min(args.batch, 512)
        cp.n_seq_max = 1
        threads = args.threads or os.cpu_count() or 1
        cp.n_threads = threads
        cp.n_threads_batch = threads
        cp.flash_attn_type = llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        cp.type_k = cp.type_v = {"f16": 1, "q8_0": 8}[args.kv_type]
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        if not self.ctx:
            raise SystemExit("cannot create the context")
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(args.batch, 0, 1)
        self.n_past = 0
        self.rng = np.random.default_rng(0)

    def decode(self, tokens) -> None:
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = self.n_past + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = i == len(tokens) - 1
        rc = llama_cpp.llama_decode(self.ctx, b)
        if rc != 0:
            raise SystemExit(f"llama_decode failed: {rc}")
        self.n_past += len(tokens)

    def step(self) -> float:
        tok = int(self.rng.integers(10, min(self.n_vocab, 30000)))
        t0 = time.perf_counter()
        self.decode([tok])
        llama_cpp.llama_get_logits_ith(self.ctx, -1)  # waits for the device
        return time.perf_counter() - t0

    def truncate(self, n: int) -> None:
        llama_cpp.llama_memory_seq_rm(self.mem, 0, n, -1)
        self.n_past = n

    def fill(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        while self.n_past < n:
            k = min(batch, n - self.n_past)
            self.decode(self.rng.integers(10, min(self.n_vocab, 30000), k))
        llama_cpp.llama_synchronize(self.ctx)
        return time.perf_counter() - t0

    def series(self, steps: int, warmup: int) -> list[float]:
        base = self.n_past
        for _ in range(warmup):
            self.step()
        self.truncate(base)
        times = [self.step() for _ in range(steps)]
        self.truncate(base)
        return times


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b", help=f"GGUF path or one of {', '.join(SHAPES)}")
    ap.add_argument("--ctx", type=int, default=32768, help="context length of the dense/slow/fast steps")
    ap.add_argument("--budget", type=int, default=2048, help="cells per (layer, KV head) of a FAST step")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--ngl", type=int, default=0, help="layers to offload (99 = all, CUDA/Metal builds)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--batch", type=int, default=2048, help="prefill batch")
    ap.add_argument("--kv-type", default="f16", choices=["f16", "q8_0"])
    ap.add_argument("--query-rows", type=int, default=1, help="query rows of the slow-step export")
    ap.add_argument("--json", default="native_step_bench.json", help="output file ('' = none)")
    args = ap.parse_args(argv)
    if args.budget > args.ctx:
        ap.error("--budget must not exceed --ctx")

    b = Bench(args)
    print(f"model {b.path}\ncontext {args.ctx}, budget {args.budget}, ngl {args.ngl}, kv {args.kv_type}", flush=True)
    t_fill = b.fill(args.ctx, args.batch)
    print(f"filled {args.ctx} tokens in {t_fill:.1f} s", flush=True)

    n_tail = args.steps + args.warmup + 8
    sfi = SFINative(b.ctx, n_sel_max=args.budget, n_tail_max=n_tail, n_query_rows=args.query_rows)
    res: dict = {}

    sfi.set_mode(sfi.DENSE)
    res["dense"] = summarize(b.series(args.steps, args.warmup))
    print(f"dense @ {args.ctx}: {res['dense']['median_ms']:.2f} ms", flush=True)

    sfi.set_mode(sfi.SLOW)
    res["slow"] = summarize(b.series(args.steps, args.warmup))
    print(f"slow  @ {args.ctx}: {res['slow']['median_ms']:.2f} ms (with export)", flush=True)

    # selection: sink + random middle cells + the most recent cells, sorted, per (layer, head)
    pos = sfi.cell_pos()
    cells = np.flatnonzero(pos >= 0)
    cells = cells[np.argsort(pos[cells])]
    n_sink, n_recent = 4, min(256, args.budget // 4)
    mid = cells[n_sink:len(cells) - n_recent]
    n_mid = args.budget - n_sink - n_recent
    sel = np.empty((sfi.n_layers, sfi.n_head_kv, args.budget), dtype=np.int32)
    for i in range(sfi.n_layers):
        for h in range(sfi.n_head_kv):
            pick = b.rng.choice(mid, n_mid, replace=False)
            sel[i, h] = np.sort(np.r_[cells[:n_sink], pick, cells[len(cells) - n_recent:]])

    sfi.set_mode(sfi.FAST)
    base = b.n_past
    refresh, fast, set_sel = [], [], []
    for rep in range(args.warmup + 3):
        t0 = time.perf_counter()
        sfi.set_selection(sel)
        t1 = time.perf_counter()
        t_first = b.step()
        if not sfi.status() & STATUS_LAST_FAST:
            raise SystemExit("the fast step fell back to dense")
        if rep >= args.warmup:
            set_sel.append(t1 - t0)
            refresh.append(t_first)
        b.truncate(base)  # invalidates the view: the next round gathers again
    sfi.set_selection(sel)
    b.step()  # the refresh
    for _ in range(args.warmup):
        b.step()
    for _ in range(args.steps):
        fast.append(b.step())
        assert sfi.status() & STATUS_LAST_FAST
    b.truncate(base)
    res["set_selection"] = summarize(set_sel)
    res["fast_first_with_refresh"] = summarize(refresh)
    res["fast"] = summarize(fast)
    print(f"fast  @ {args.ctx}, {args.budget} cells: {res['fast']['median_ms']:.2f} ms "
          f"(first step with the gather: {res['fast_first_with_refresh']['median_ms']:.2f} ms, "
          f"set_selection {res['set_selection']['median_ms']:.2f} ms)", flush=True)

    sfi.set_mode(sfi.DENSE)
    b.truncate(args.budget)
    res["dense_at_budget"] = summarize(b.series(args.steps, args.warmup))
    print(f"dense @ {args.budget}: {res['dense_at_budget']['median_ms']:.2f} ms", flush=True)

    ratio = res["fast"]["median_ms"] / res["dense_at_budget"]["median_ms"]
    speedup = res["dense"]["median_ms"] / res["fast"]["median_ms"]
    print(f"fast / dense@{args.budget} = {ratio:.3f} (target <= 1.10); dense@{args.ctx} / fast = {speedup:.2f}x; "
          f"slow / dense = {res['slow']['median_ms'] / res['dense']['median_ms']:.2f}")

    out = {
        "model": str(b.path), "ctx": args.ctx, "budget": args.budget, "ngl": args.ngl, "kv_type": args.kv_type,
        "steps": args.steps, "query_rows": args.query_rows, "fill_s": t_fill,
        "n_layers_sfi": sfi.n_layers, "n_head_kv": sfi.n_head_kv,
        "results": res, "fast_over_dense_at_budget": ratio, "dense_over_fast": speedup,
        "system_info": llama_cpp.llama_print_system_info().decode(errors="replace"),
        "host": platform.node(),
    }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    sfi.free()
    llama_cpp.llama_batch_free(b.batch)
    llama_cpp.llama_free(b.ctx)
    llama_cpp.llama_model_free(b.model)
    return out


if __name__ == "__main__":
    main()
