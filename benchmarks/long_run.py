#!/usr/bin/env python3
"""Long run: one SFI generation past 8K tokens, with memory and statistics over time.

Why: a leak per token (a growing buffer, a list the stepper keeps, a native allocation per slow
step) or a drift (fast steps getting slower as the context grows, refreshes stopping, fall-backs to
dense) only shows after thousands of steps. This generates `--max-tokens` tokens in one streaming
call (ignore_eos, so the length is fixed) and records, every `--window` tokens: resident memory
(VmRSS), tok/s, and the SFI step counts and step times of that window. Not part of the test suite
(10-15 minutes on the 2-core development machine); run it with nice, and with one thread when the
cores are shared (OpenMP threads spin-wait for each other when one of them is descheduled):

    nice -n 10 python3 benchmarks/long_run.py -t 1            # default model, n_ctx 9216, 8400 tokens

Writes benchmarks/results/long_run-cpu-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sfi_gguf.tools.provenance import git_commit  # noqa: E402
from sfi_gguf import SFILlama  # noqa: E402
from sfi_gguf.core.config import SFIConfig  # noqa: E402
from sfi_gguf.tools.texts import natural_text  # noqa: E402


def rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")



def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--n-ctx", type=int, default=9216)
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--max-tokens", type=int, default=8400)
    ap.add_argument("--window", type=int, default=512)
    ap.add_argument("--warmup", type=int, default=1024, help="tokens after which memory must stay flat")
    ap.add_argument("-t", "--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--plateau", type=int, default=0,
                    help="then N more generations of --window tokens from the same prefix (constant context): "
                         "RSS after each, to tell a per-token leak from buffers that grow with the context")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    rss0 = rss_mb()
    llm = SFILlama(args.model, n_ctx=args.n_ctx, n_threads=args.threads, sfi=SFIConfig())
    prompt = llm.tokenize(natural_text(args.prompt_tokens * 8, seed=args.seed))[:args.prompt_tokens]
    if args.prompt_tokens + args.max_tokens > llm.n_ctx:
        sys.exit(f"prompt + max_tokens = {args.prompt_tokens + args.max_tokens} > n_ctx {llm.n_ctx}")

    # keep a handle on the stepper generate() builds, to read its statistics while it runs
    steppers = []  # only the latest one: keeping them all would itself grow the memory measured here
    make_stepper = llm._stepper

    def keep_stepper(*a, **k):
        steppers[:] = [make_stepper(*a, **k)]
        return steppers[0]

    llm._stepper = keep_stepper

    windows = []
    keys = ("n_dense", "n_fast", "n_slow", "n_bootstrap", "n_cheap_refresh", "n_fell_back",
            "t_dense", "t_fast", "t_slow", "t_selector")
    prev = dict.fromkeys(keys, 0)
    prev_overlaps = 0
    t_start = time.perf_counter()
    t_prev, n_prev = t_start, 0
    cpu_prev = time.process_time()  # CPU time: what a step costs, whatever else the shared machine runs
    ctx = llm.context
    stream = llm.generate(prompt, max_tokens=args.max_tokens, temperature=0.7, seed=args.seed,
                          ignore_eos=True, stream=True)

    def record(n_gen: int, now: float) -> None:
        nonlocal prev, prev_overlaps, t_prev, n_prev, cpu_prev
        s = steppers[-1].stats
        cpu = time.process_time()
        cur = {k: getattr(s, k) for k in keys}
        d = {k: cur[k] - prev[k] for k in keys}
        overlaps = s.refresh_overlap[prev_overlaps:]
        row = dict(generated=n_gen, context=len(ctx.tokens), elapsed_s=round(now - t_start, 2),
                   tok_s=round((n_gen - n_prev) / (now - t_prev), 3), rss_mb=round(rss_mb(), 1),
                   cpu_ms_per_token=round(1000 * (cpu - cpu_prev) / max(1, n_gen - n_prev), 2),
                   **{k: d[k] for k in keys if k.startswith("n_")},
                   fast_ms=round(1000 * d["t_fast"] / d["n_fast"], 3) if d["n_fast"] else None,
                   dense_ms=round(1000 * d["t_dense"] / d["n_dense"], 3) if d["n_dense"] else None,
                   slow_ms=round(1000 * d["t_slow"] / d["n_slow"], 3) if d["n_slow"] else None,
                   mean_overlap=round(sum(overlaps) / len(overlaps), 4) if overlaps else None)
        windows.append(row)
        print(json.dumps(row), flush=True)
        prev, prev_overlaps, t_prev, n_prev, cpu_prev = cur, len(s.refresh_overlap), now, n_gen, cpu

    n_prompt = len(prompt)
    next_mark = args.window
    for _piece in stream:
        n_gen = len(ctx.tokens) - n_prompt + 1  # the last sampled token is not decoded yet
        if n_gen >= next_mark:
            record(n_gen, time.perf_counter())
            next_mark += args.window
    stats = llm.last_stats
    if stats.n_generated > n_prev:
        record(stats.n_generated, time.perf_counter())
    s = stats.sfi

    plateau = []
    if args.plateau:
        prefix = list(ctx.tokens)[: len(ctx.tokens) - args.window]
        for i in range(args.plateau):
            llm.generate(prefix, max_tokens=args.window, temperature=0.7, seed=args.seed + 1 + i, ignore_eos=True)
            plateau.append(dict(context=len(prefix) + args.window, rss_mb=round(rss_mb(), 1),
                                n_fast=llm.last_stats.sfi.n_fast, n_slow=llm.last_stats.sfi.n_slow))
            print(json.dumps(plateau[-1]), flush=True)

    after = [w for w in windows if w["generated"] > args.warmup]
    rss_after = [w["rss_mb"] for w in after]
    fast_ms = [w["fast_ms"] for w in after if w["fast_ms"] is not None]
    summary = dict(
        n_generated=stats.n_generated, n_ctx_end=stats.n_ctx_end, finish_reason=stats.finish_reason,
        decode_tok_s=round(stats.decode_tok_s, 3), prefill_s=round(stats.prefill_s, 2),
        decode_s=round(stats.decode_s, 1),
        rss_before_model_mb=round(rss0, 1),
        rss_after_warmup_mb=rss_after[0] if rss_after else None,
        rss_end_mb=rss_after[-1] if rss_after else None,
        rss_growth_after_warmup_mb=round(rss_after[-1] - rss_after[0], 1) if rss_after else None,
        rss_max_mb=max(w["rss_mb"] for w in windows),
        fast_ms_first=fast_ms[0] if fast_ms else None, fast_ms_last=fast_ms[-1] if fast_ms else None,
        sfi=dict(k_head=s.k_head, budget=s.budget, n_dense=s.n_dense, n_fast=s.n_fast, n_slow=s.n_slow,
                 n_bootstrap=s.n_bootstrap, n_cheap_refresh=s.n_cheap_refresh, n_fell_back=s.n_fell_back,
                 reasons=s.reasons, mean_overlap=round(s.mean_overlap, 4),
                 t_dense=round(s.t_dense, 2), t_fast=round(s.t_fast, 2), t_slow=round(s.t_slow, 2),
                 t_selector=round(s.t_selector, 2)),
    )
    result = dict(benchmark="long_run", date=date.today().isoformat(), commit=git_commit(),
                  hardware=f"{platform.processor() or platform.machine()} CPU", model=llm.model_path.name,
                  n_ctx=llm.n_ctx, threads=args.threads, prompt_tokens=n_prompt, max_tokens=args.max_tokens,
                  temperature=0.7, seed=args.seed, config="SFIConfig() (defaults)", window=args.window,
                  warmup=args.warmup, summary=summary, windows=windows, plateau=plateau)
    print(json.dumps(summary, indent=1))
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / \
        f"long_run-cpu-{date.today().strftime('%Y%m%d')}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {out}")
    llm.close()


if __name__ == "__main__":
    main()
