#!/usr/bin/env python3
"""Time every ggml node of one decode step (dense, SLOW with the device Selector, or FAST), without a profiler.

llama.cpp's cb_eval callback, asked for every node, makes the scheduler compute the graph one node at a time
and synchronize after each (ggml_backend_sched_compute_splits), so the time between two callbacks is one
node's kernel(s) plus a fixed launch + sync + Python cost (printed: the median of the cheapest node kind);
each node's fastest time over --repeats steps of the same graph is kept, since host jitter only adds.
Nodes are summed by op and by name (a name without its layer suffix, e.g. "sfi_cells"); the Selector's own
ops are unnamed, so they show up under their op (CONCAT, POOL_2D, TOP_K, ARGSORT, GET_ROWS, ...).

    python benchmarks/op_profile.py --model qwen3-4b --ngl 99 --ctx 131072          # on the GPU machine
    python benchmarks/op_profile.py --model qwen3-0.6b --ctx 4096 --kinds slow       # CPU, small
    python benchmarks/op_profile.py --model qwen3-4b --ngl 99 --ctx 32768 --batch 16 # a slow group of 16
    python benchmarks/op_profile.py --model qwen3-4b --ngl 99 --ctx 32768 --kinds slow slow_tail --tail 16
--kinds slow_tail is the slow step of `redecode_tail`: the last --tail tokens decoded again with the new one in one
ubatch, the export from the new token's rows alone (single sequence only).
--model takes a GGUF path or a name of sfi_gguf.tools.random_model.SHAPES. With --batch B, B sequences of --ctx
tokens each (one KV stream each) take every step together, one token each, as a batched group does.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from sfi_gguf.core.library import LIB_PATH, llama_cpp  # noqa: E402  (loads the patched library)
from sfi_gguf.core.context import LlamaContext, decode_one_per_sequence  # noqa: E402
from sfi_gguf.core.bindings import SFINative  # noqa: E402
from sfi_gguf.tools.random_model import SHAPES, random_model  # noqa: E402
from sfi_gguf.core.selector import SFISelector  # noqa: E402


class ggml_tensor(ctypes.Structure):
    """Head of struct ggml_tensor (ggml.h): enough to name a node seen by cb_eval."""
    _fields_ = [("type", ctypes.c_int), ("buffer", ctypes.c_void_p), ("ne", ctypes.c_int64 * 4),
                ("nb", ctypes.c_size_t * 4), ("op", ctypes.c_int), ("op_params", ctypes.c_int32 * 16),
                ("flags", ctypes.c_int32), ("src", ctypes.c_void_p * 10), ("view_src", ctypes.c_void_p),
                ("view_offs", ctypes.c_size_t), ("data", ctypes.c_void_p), ("name", ctypes.c_char * 64)]


def _op_desc():
    base = ctypes.CDLL(str(Path(LIB_PATH).parent / "libggml-base.so"))
    base.ggml_op_desc.argtypes = [ctypes.c_void_p]
    base.ggml_op_desc.restype = ctypes.c_char_p
    return base.ggml_op_desc


class NodeTimer:
    """cb_eval that asks for every node while on, and records (op, name, shape, seconds) per node."""

    def __init__(self):
        self.on = False
        self.nodes: list[tuple[str, str, tuple, float]] = []
        self._t = 0.0
        desc = _op_desc()

        def cb(t_ptr, ask, _user):
            if ask:
                return self.on
            now = time.perf_counter()
            t = ctypes.cast(t_ptr, ctypes.POINTER(ggml_tensor)).contents
            self.nodes.append((desc(t_ptr).decode(), t.name.decode(errors="replace"), tuple(t.ne), now - self._t))
            self._t = time.perf_counter()
            return True

        self.fn = llama_cpp.ggml_backend_sched_eval_callback(cb)

    def start(self):
        self.nodes = []
        self.on = True
        self._t = time.perf_counter()

    def stop(self):
        self.on = False
        return self.nodes


def fastest(runs: list[list[tuple]]) -> list[tuple]:
    """Per node, its fastest time over runs of the same graph (host jitter only ever adds time); the
    last run alone when the graphs differ."""
    same = all(len(r) == len(runs[0]) and all(a[0] == b[0] and a[2] == b[2] for a, b in zip(r, runs[0])) for r in runs)
    if not same:
        return runs[-1]
    return [(*runs[0][i][:3], min(r[i][3] for r in runs)) for i in range(len(runs[0]))]


def base_name(name: str) -> str:
    head, _, tail = name.rpartition("-")
    return head if tail.isdigit() and head else name


def summary(nodes, top: int) -> dict:
    by_op, by_name = defaultdict(lambda: [0.0, 0]), defaultdict(lambda: [0.0, 0])
    per_kind = defaultdict(list)
    for op, name, _, s in nodes:
        per_kind[op].append(s)
        for total in (by_op[op], by_name[base_name(name) or "(unnamed)"]):
            total[0] += s
            total[1] += 1
    floor = min(statistics.median(v) for v in per_kind.values())
    order = lambda d: sorted(d.items(), key=lambda kv: -kv[1][0])  # noqa: E731
    return {
        "n_nodes": len(nodes), "total_ms": sum(n[3] for n in nodes) * 1e3, "per_node_floor_ms": floor * 1e3,
        "by_op": [{"op": k, "ms": v[0] * 1e3, "n": v[1]} for k, v in order(by_op)],
        "by_name": [{"name": k, "ms": v[0] * 1e3, "n": v[1]} for k, v in order(by_name)],
        "top_nodes": [{"op": op, "name": name, "ne": list(ne), "ms": s * 1e3}
                      for op, name, ne, s in sorted(nodes, key=lambda n: -n[3])[:top]],
    }


def print_summary(kind: str, s: dict, top: int) -> None:
    print(f"\n== {kind}: {s['n_nodes']} nodes, {s['total_ms']:.1f} ms with one sync per node "
          f"(fixed cost per node ~{s['per_node_floor_ms']:.3f} ms); unprofiled {s['wall_ms']:.2f} ms")
    print("  by op:   " + ", ".join(f"{r['op']} {r['ms']:.2f} ({r['n']})" for r in s["by_op"][:16]))
    print("  by name: " + ", ".join(f"{r['name']} {r['ms']:.2f} ({r['n']})" for r in s["by_name"][:16]))
    for r in s["top_nodes"][:top]:
        print(f"  {r['ms']:8.3f} ms  {r['op']:<14s} {r['name']:<28s} {r['ne']}")


class Sequences:
    """The sequences of one context taking a step together, one token each (one llama_decode)."""

    def __init__(self, lc: LlamaContext):
        self.lc = lc
        self.seqs = [lc.sequence(s) for s in range(lc.n_seq_max)] if lc.n_seq_max > 1 else [lc]
        self.batch = llama_cpp.llama_batch_init(len(self.seqs), 0, 1)

    def fill(self, n: int, rng) -> None:
        for seq in self.seqs:
            while len(seq.tokens) < n:
                k = min(2048, n - len(seq.tokens))
                seq.decode([int(t) for t in rng.integers(10, min(self.lc.n_vocab, 30000), k)])

    def step(self, token: int) -> None:
        steps = [(seq.seq, len(seq.tokens), token) for seq in self.seqs]
        if decode_one_per_sequence(self.lc.ctx, self.batch, steps) != 0:
            raise RuntimeError("llama_decode failed")
        for seq in self.seqs:
            seq.tokens.append(token)
        llama_cpp.llama_get_logits_ith(self.lc.ctx, -1)  # waits for the step

    @property
    def n_past(self) -> int:
        return len(self.seqs[0].tokens)

    def truncate(self, n: int) -> None:
        for seq in self.seqs:
            seq.truncate(n)

    def close(self) -> None:
        llama_cpp.llama_batch_free(self.batch)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen3-4b", help=f"GGUF path or one of {', '.join(SHAPES)}")
    ap.add_argument("--ctx", type=int, default=32768)
    ap.add_argument("--ngl", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-flash-attn", action="store_true")
    ap.add_argument("--k-head", type=int, default=2048)
    ap.add_argument("--n-candidates", type=int, default=8192)
    ap.add_argument("--refresh-layer-groups", type=int, default=1)
    ap.add_argument("--kinds", nargs="+", default=["dense", "slow", "fast"], choices=["dense", "slow", "slow_tail", "fast"])
    ap.add_argument("--tail", type=int, default=16, help="tokens decoded again by a slow_tail step")
    ap.add_argument("--repeats", type=int, default=5,
                    help="profiled steps per kind (each node's fastest time is reported)")
    ap.add_argument("--batch", type=int, default=1, help="sequences taking each step together (one KV stream each)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="", help="write the summaries here")
    args = ap.parse_args(argv)

    path = Path(args.model) if Path(args.model).suffix == ".gguf" else random_model(args.model)
    timer = NodeTimer()
    lc = LlamaContext(path, n_ctx=args.ctx + 64, n_gpu_layers=args.ngl, n_threads=args.threads or None,
                      n_batch=2048, flash_attn=not args.no_flash_attn, verbose=False, cb_eval=timer.fn,
                      n_seq_max=args.batch)
    seqs = Sequences(lc)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    seqs.fill(args.ctx, rng)
    print(f"model {path}, {args.batch} x {args.ctx} tokens filled in {time.perf_counter() - t0:.1f} s", flush=True)

    n_sink, n_recent = 4, 256
    sfi = SFINative(lc.ctx, n_sel_max=n_sink + args.k_head + n_recent, n_tail_max=64)
    out = {"model": str(path), "ctx": args.ctx, "batch": args.batch, "ngl": args.ngl, "k_head": args.k_head,
           "n_candidates": args.n_candidates, "refresh_layer_groups": args.refresh_layer_groups, "kinds": {}}

    def profile(kind, before, rewind=True, tail=0):
        """rewind: back to the same context after each step (dense and slow steps; a fast step would then
        gather its view again, so fast steps run one after the other); tail: the step decodes the context's last
        `tail` tokens again with its own, in one ubatch."""
        base = seqs.n_past
        runs, walls = [], []
        for r in range(2 * args.repeats):
            timed = r % 2 == 0  # every other step unprofiled: its wall time, with the graph run as a whole
            before()
            token = int(rng.integers(10, min(lc.n_vocab, 30000)))
            if timed:
                timer.start()
            t0 = time.perf_counter()
            if tail:
                tokens = list(lc.tokens[base - tail:base]) + [token]
                lc.truncate(base - tail)
                lc.decode(tokens)
                llama_cpp.llama_get_logits_ith(lc.ctx, -1)  # waits for the step
            else:
                seqs.step(token)
            if timed:
                runs.append(timer.stop())
            else:
                walls.append(time.perf_counter() - t0)
            if rewind:
                seqs.truncate(base)  # the same context (and graph) every time
        seqs.truncate(base)
        nodes = fastest(runs)
        out["kinds"][kind] = s = summary(nodes, args.top)
        s["wall_ms"] = statistics.median(walls) * 1e3
        print_summary(kind, s, args.top)

    if "dense" in args.kinds:
        profile("dense", lambda: sfi.set_mode(sfi.DENSE))
    if "slow" in args.kinds or "fast" in args.kinds:
        sfi.set_n_candidates(args.n_candidates)
        sfi.set_selector(SFISelector().device_params(args.k_head, n_sink, n_recent))

        def slow():
            sfi.set_refresh_layers(1, 0)
            sfi.set_mode(sfi.SLOW)
        if "slow" in args.kinds:
            profile("slow", slow)
        if "slow_tail" in args.kinds:
            if args.batch != 1:
                ap.error("--kinds slow_tail profiles a single sequence (--batch 1)")
            sfi.set_n_query_rows(1)  # the export from the new token's rows alone, as redecode_tail's slow step
            profile("slow_tail", slow, tail=args.tail)
            sfi.set_n_query_rows(sfi.params["n_query_rows"])
        if args.refresh_layer_groups > 1 and "slow" in args.kinds:
            # a group refresh needs a selection in the view: load the full one first
            slow()
            seqs.step(5)
            load(sfi, seqs)

            def group_slow():
                sfi.set_refresh_layers(args.refresh_layer_groups, 1)
                sfi.set_mode(sfi.SLOW)
            profile("slow_group", group_slow)
            sfi.set_refresh_layers(1, 0)
        if "fast" in args.kinds:
            slow()
            seqs.step(5)
            load(sfi, seqs)
            seqs.step(6)  # the first fast step after a refresh (a new graph)
            profile("fast", lambda: None, rewind=False)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
        print(f"wrote {args.json}")
    sfi.free()
    seqs.close()
    lc.close()
    return out


def load(sfi: SFINative, seqs: Sequences) -> None:
    """Each sequence's last slow step's device selection into its view (gathered by that step)."""
    for seq in seqs.seqs:
        sfi.load_selection(seq.seq)
    sfi.set_mode(sfi.FAST)


if __name__ == "__main__":
    main()
