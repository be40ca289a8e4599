#!/usr/bin/env python3
"""Micro-benchmark of one decode step: dense vs FAST (compact view) vs SLOW (dense + export).

All in one process and one context: the context is filled to --ctx tokens, then each kind of step is
timed for --steps steps (the decoded tokens are removed again after each series, so every series runs
at the same context length):
  * dense step at --ctx;
  * slow step at --ctx (dense + attention-mass / evidence / key-norm export, copied to the host);
  * the first FAST step after a selection (it gathers the selection: the "refresh") and the
    following FAST steps, with a selection of --budget cells per (layer, KV head);
  * a dense step at a context of --budget tokens (what a FAST step should cost at most);
  * with --cycle M: refresh cycles as SFI decoding runs them (a slow step with the device Selector,
    its selection loaded, M fast steps), each part timed: what a refresh costs beyond M+1 fast steps,
    graph rebuilds included (--cycle-candidates: the candidate counts to try).
A step is llama_decode of one token plus reading its logits (which waits for the device).

    python benchmarks/native_step_bench.py                         # random Qwen3-4B shape, CPU
    python benchmarks/native_step_bench.py --ngl 99 --ctx 32768    # CUDA
    python benchmarks/native_step_bench.py --model qwen3-0.6b --ctx 8192 --steps 8
--model takes a GGUF path or a name of sfi_gguf.tools.random_model.SHAPES.
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sfi_gguf.core.library import llama_cpp  # noqa: E402  (loads the patched library)
from sfi_gguf.core.context import LlamaContext  # noqa: E402
from sfi_gguf.core.bindings import SFINative, STATUS_LAST_FAST  # noqa: E402
from sfi_gguf.tools.random_model import SHAPES, random_model  # noqa: E402
from sfi_gguf.core.selector import CandidateRange, SFISelector  # noqa: E402


def summarize(times: list[float]) -> dict:
    ms = [t * 1e3 for t in times]
    return {"n": len(ms), "median_ms": statistics.median(ms), "mean_ms": statistics.fmean(ms),
            "min_ms": min(ms), "max_ms": max(ms)}


class Bench:
    """One context (sfi_gguf's LlamaContext) filled with random tokens; times single-token steps."""

    def __init__(self, args):
        path = Path(args.model) if Path(args.model).suffix == ".gguf" else random_model(args.model)
        self.path = path
        n_steps = max(args.steps + 2 * args.warmup, (args.cycles + 1) * (args.cycle + 1))  # a series, or the cycles
        self.lc = LlamaContext(path, n_ctx=args.ctx + n_steps + 64, n_gpu_layers=args.ngl,
                               n_threads=args.threads or None, n_batch=args.batch, flash_attn=not args.no_flash_attn, verbose=False,
                               type_kv=args.kv_type)
        self.ctx = self.lc.ctx
        self.n_vocab = self.lc.n_vocab
        self.rng = np.random.default_rng(0)

    @property
    def n_past(self) -> int:
        return len(self.lc.tokens)

    def step(self) -> float:
        tok = int(self.rng.integers(10, min(self.n_vocab, 30000)))
        t0 = time.perf_counter()
        self.lc.decode_one(tok)
        llama_cpp.llama_get_logits_ith(self.ctx, -1)  # waits for the device
        return time.perf_counter() - t0

    def truncate(self, n: int) -> None:
        self.lc.truncate(n)

    def fill(self, n: int, batch: int) -> float:
        t0 = time.perf_counter()
        while self.n_past < n:
            k = min(batch, n - self.n_past)
            self.lc.decode([int(t) for t in self.rng.integers(10, min(self.n_vocab, 30000), k)])
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


def cycle_series(b: Bench, sfi: SFINative, args, n_cand: int, fast_ms: float, groups: int = 1,
                 load: str = "native") -> dict:
    """Refresh cycles as SFIStepper runs them: a slow step whose graph runs the Selector, its selection
    loaded with the sink and recent cells shared, then args.cycle fast steps. The refresh's cost is the
    cycle's time less args.cycle + 1 steady fast steps (fast_ms). groups > 1: after the warm-up cycle,
    each slow step refreshes one group of layers in turn."""
    n_sink, n_recent = 4, min(256, args.budget // 4)
    k_head = args.budget - n_sink - n_recent
    sfi.set_n_candidates(n_cand)
    sfi.set_selector(SFISelector().device_params(k_head, n_sink, n_recent))
    base = b.n_past
    sfi.set_mode(sfi.SLOW)  # slow steps in a row: the same graph each time (a CUDA graph once warm)
    steady_slow = summarize(b.series(args.steps, args.warmup))
    parts: dict[str, list[float]] = {k: [] for k in ("slow", "host", "fast_1", "fast_2", "fast_3", "fast_rest", "cycle")}
    for rep in range(args.cycles + 1):
        sfi.set_refresh_layers(*((groups, rep % groups) if rep else (1, 0)))
        sfi.set_mode(sfi.SLOW)
        t0 = time.perf_counter()
        t_slow = b.step()
        t1 = time.perf_counter()
        if not sfi.selection_size():
            raise SystemExit("the slow step ran no device Selector")
        if load == "native":  # as SFIStepper does: the selection's cells are read natively, after the next launch
            sfi.load_selection()
        else:  # through the host: sink and recent cells from the positions, the selection checked again
            sel = sfi.selection()
            pos = sfi.cell_pos()
            sink, recent = CandidateRange.for_context(b.n_past, n_sink, n_recent).sink_and_recent_cells(pos)
            sfi.set_selection(sel, shared=np.concatenate([sink, recent]))
        sfi.set_mode(sfi.FAST)
        t_host = time.perf_counter() - t1
        fast = [b.step() for _ in range(args.cycle)]
        if not sfi.status() & STATUS_LAST_FAST:
            raise SystemExit("the fast steps fell back to dense")
        t_cycle = time.perf_counter() - t0
        if rep == 0:
            continue  # warm-up: first graphs of each kind
        for k, v in (("slow", t_slow), ("host", t_host), ("fast_1", fast[0]), ("fast_2", fast[1] if len(fast) > 1 else 0.0),
                     ("fast_3", fast[2] if len(fast) > 2 else 0.0),
                     ("fast_rest", sum(fast[3:]) / max(1, len(fast) - 3)), ("cycle", t_cycle)):
            parts[k].append(v)
    b.truncate(base)
    sfi.set_selector(None)
    sfi.set_n_candidates(0)
    sfi.set_refresh_layers(1, 0)
    out = {k: summarize(v) for k, v in parts.items()}
    out["steady_slow"] = steady_slow
    overhead = out["cycle"]["median_ms"] - (args.cycle + 1) * fast_ms
    out["refresh_overhead_ms"] = overhead
    print(f"cycle @ {b.n_past}, {n_cand} candidates, {groups} group(s) of layers, {load} load, slow + {args.cycle} fast: "
          f"{out['cycle']['median_ms']:.1f} ms = "
          f"slow {out['slow']['median_ms']:.1f} + host {out['host']['median_ms']:.1f} + first fast "
          f"{out['fast_1']['median_ms']:.2f} + second {out['fast_2']['median_ms']:.2f} + third "
          f"{out['fast_3']['median_ms']:.2f} + the rest at "
          f"{out['fast_rest']['median_ms']:.2f} each; refresh overhead {overhead:.1f} ms over steady fast steps "
          f"(slow steps in a row: {steady_slow['median_ms']:.1f} ms)", flush=True)
    return out


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
    ap.add_argument("--no-flash-attn", action="store_true", help="plain attention (the faster path on many CPUs)")
    ap.add_argument("--query-rows", type=int, default=1, help="query rows of the slow-step export")
    ap.add_argument("--n-candidates", type=int, nargs="*", default=[],
                    help="also time slow steps that export only this many candidate cells per layer")
    ap.add_argument("--cycle", type=int, default=0, metavar="M",
                    help="also time refresh cycles: a slow step with the device Selector, then M fast steps")
    ap.add_argument("--cycle-candidates", type=int, nargs="*", default=[8192],
                    help="candidate cells per layer of the cycles' slow steps (one series each)")
    ap.add_argument("--cycles", type=int, default=6, help="cycles per series (after one warm-up cycle)")
    ap.add_argument("--cycle-load", nargs="+", default=["native"], choices=["native", "host"],
                    help="how a cycle loads the slow step's selection: llama_sfi_seq_load_selection, or the host's "
                         "set_selection with sink and recent cells (one series each)")
    ap.add_argument("--refresh-layer-groups", type=int, nargs="*", default=[1],
                    help="cycle series whose slow steps refresh one of this many groups of layers in turn")
    ap.add_argument("--json", default="native_step_bench.json", help="output file ('' = none)")
    args = ap.parse_args(argv)
    if args.budget > args.ctx:
        ap.error("--budget must not exceed --ctx")

    b = Bench(args)
    print(f"model {b.path}\ncontext {args.ctx}, budget {args.budget}, ngl {args.ngl}, kv {args.kv_type}", flush=True)
    t_fill = b.fill(args.ctx, args.batch)
    print(f"filled {args.ctx} tokens in {t_fill:.1f} s", flush=True)

    n_tail = max(args.steps + args.warmup, args.cycle) + 8
    sfi = SFINative(b.ctx, n_sel_max=args.budget, n_tail_max=n_tail, n_query_rows=args.query_rows)
    res: dict = {}

    sfi.set_mode(sfi.DENSE)
    res["dense"] = summarize(b.series(args.steps, args.warmup))
    print(f"dense @ {args.ctx}: {res['dense']['median_ms']:.2f} ms", flush=True)

    sfi.set_mode(sfi.SLOW)
    res["slow"] = summarize(b.series(args.steps, args.warmup))
    print(f"slow  @ {args.ctx}: {res['slow']['median_ms']:.2f} ms (with export)", flush=True)
    for n_cand in args.n_candidates:
        sfi.set_n_candidates(n_cand)
        res[f"slow_candidates_{n_cand}"] = summarize(b.series(args.steps, args.warmup))
        print(f"slow  @ {args.ctx}, {n_cand} candidates per layer: "
              f"{res[f'slow_candidates_{n_cand}']['median_ms']:.2f} ms", flush=True)
    sfi.set_n_candidates(0)

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

    for n_cand in (args.cycle_candidates if args.cycle else []):
        for groups in args.refresh_layer_groups:
            for load in args.cycle_load:
                key = f"cycle_{n_cand}" + (f"_groups{groups}" if groups > 1 else "") + ("_host_load" if load == "host" else "")
                res[key] = cycle_series(b, sfi, args, n_cand, res["fast"]["median_ms"], groups, load)

    sfi.set_mode(sfi.DENSE)
    b.truncate(args.budget)
    res["dense_at_budget"] = summarize(b.series(args.steps, args.warmup))
    print(f"dense @ {args.budget}: {res['dense_at_budget']['median_ms']:.2f} ms", flush=True)

    ratio = res["fast"]["median_ms"] / res["dense_at_budget"]["median_ms"]
    speedup = res["dense"]["median_ms"] / res["fast"]["median_ms"]
    print(f"fast / dense@{args.budget} = {ratio:.3f} (target <= 1.10); dense@{args.ctx} / fast = {speedup:.2f}x; "
          f"slow / dense = {res['slow']['median_ms'] / res['dense']['median_ms']:.2f}")

    out = {
        "model": str(b.path), "ctx": args.ctx, "budget": args.budget, "ngl": args.ngl, "kv_type": args.kv_type, "flash_attn": not args.no_flash_attn,
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
    b.lc.close()
    return out


if __name__ == "__main__":
    main()
