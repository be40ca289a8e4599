#!/usr/bin/env python3
"""Cut a kernel trace (benchmarks/cupti_trace.c) into decode steps and say where each step's GPU time goes.

A decode step ends with the device-to-host copy of its logits (n_vocab floats), so the kernels between two such
copies are one step. For the last --tail steps it prints the time from the previous step's logits to the step's first
kernel (host work: the step's graph, its inputs), the step's span (first kernel start to the logits copy's end), its
kernels' summed time (more than the span where kernels overlap), how many ran inside a CUDA graph, and the last kernel's end to the copy's end; for each kind of step (grouped by kernel count) the
kernels summed by name, the costliest first.

    python benchmarks/cupti_steps.py trace.csv --n-vocab 151936 --tail 40 --json steps.json
"""
from __future__ import annotations

import argparse
import csv
import json
import re
from collections import defaultdict


def short_name(name: str) -> str:
    """A kernel's name without its template arguments and parameters (void k<...>(...) -> k)."""
    name = re.sub(r"^void ", "", name)
    depth, out = 0, []
    for ch in name:
        if ch in "<(":
            depth += 1
        elif ch in ">)":
            depth -= 1
        elif depth == 0:
            out.append(ch)
    return "".join(out).strip() or name[:60]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace")
    ap.add_argument("--n-vocab", type=int, default=151936)
    ap.add_argument("--tail", type=int, default=40)
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    kernels, ends = [], []
    with open(args.trace) as f:
        for row in csv.DictReader(f):
            start, end = int(row["start_ns"]), int(row["end_ns"])
            if row["kind"] == "K":
                kernels.append((start, end, short_name(row["name"]), row["graph"] != "0"))
            elif row["name"] == f"kind2_{args.n_vocab*4}":  # device to host, the logits
                ends.append(end)
    kernels.sort()
    ends.sort()

    steps, k = [], 0
    prev_end = 0
    for e in ends:
        ks = []
        while k < len(kernels) and kernels[k][0] < e:
            if kernels[k][0] >= prev_end:
                ks.append(kernels[k])
            k += 1
        if ks:
            steps.append((ks, e, prev_end))
        prev_end = e
    steps = steps[-args.tail:]

    out = {"steps": [], "kinds": {}}
    by_kind = defaultdict(list)
    print(f"{'step':>4} {'kernels':>7} {'in graph':>8} {'before ms':>9} {'span ms':>8} {'busy ms':>8} {'after ms':>8}")
    for i, (ks, e, prev) in enumerate(steps):
        before = (ks[0][0] - prev)/1e6 if prev else float("nan")
        span = (e - ks[0][0])/1e6
        busy = sum(k[1] - k[0] for k in ks)/1e6
        after = (e - max(k[1] for k in ks))/1e6
        in_graph = sum(k[3] for k in ks)
        print(f"{i:>4} {len(ks):>7} {in_graph:>8} {before:>9.3f} {span:>8.3f} {busy:>8.3f} {after:>8.3f}")
        out["steps"].append({"kernels": len(ks), "in_cuda_graph": in_graph, "before_ms": before, "span_ms": span, "busy_ms": busy, "after_ms": after})
        by_kind[len(ks)].append(ks)

    for n, group in sorted(by_kind.items(), key=lambda kv: -kv[0]):
        sums = defaultdict(float)
        counts = defaultdict(int)
        for ks in group:
            for a, b, name, _ in ks:
                sums[name] += (b - a)/1e6/len(group)
                counts[name] += 1
        total = sum(sums.values())
        print(f"\n== steps of {n} kernels (x{len(group)}): {total:.3f} ms of kernels per step")
        rows = sorted(sums.items(), key=lambda kv: -kv[1])
        for name, ms in rows[:args.top]:
            print(f"  {ms:8.3f} ms  {counts[name]//len(group):5d}x  {name}")
        out["kinds"][str(n)] = {"n_steps": len(group), "kernel_ms": total,
                                "by_kernel": [{"name": nm, "ms": ms, "n": counts[nm]//len(group)} for nm, ms in rows]}

    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
