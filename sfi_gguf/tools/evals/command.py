"""`sfi-gguf eval`: the quality evaluation from the command line."""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path


def build_parser() -> argparse.ArgumentParser:
    from .runner import ALL_POLICIES, SUITES, TASKS

    p = argparse.ArgumentParser(
        prog="sfi-gguf eval",
        description="Runs needle retrieval, variable tracking, long-generation agreement and chain-of-thought "
                    "cases (the long suite: multi-fact retrieval, chains, long-context reasoning and answer "
                    "agreement) with every policy at the same budget. Each case is prefilled once and its KV cache "
                    "reused by all policies. Results are written after every case; running again with the "
                    "same --out resumes.")
    p.add_argument("--suite", choices=list(SUITES), default="default",
                   help="; ".join(f"{n}: {s.description}" for n, s in SUITES.items()).replace("%", "%%"))
    p.add_argument("--quick", action="store_const", const="quick", dest="suite", help="same as --suite quick")
    p.add_argument("--model", action="append", help="only this model of the suite (repeatable)")
    p.add_argument("--task", action="append", choices=list(TASKS), help="only this task (repeatable)")
    p.add_argument("--policy", nargs="+", choices=list(ALL_POLICIES), default=None,
                   help="policies to run (default: the suite's); paper: the punctuation trigger without its "
                        "confidence rule; fixed16: a slow step every 16; redecode: the default trigger with "
                        "SFIConfig.redecode_tail; delay4, delay16: the default trigger, each selection used 4 or "
                        "16 steps after its slow step (SFIConfig.selection_delay); async16, async64: the asynchronous refresh "
                        "(SFIConfig.async_refresh) loaded 16 or 64 steps after its trigger; recent512: a recent window of "
                        "512 at the same budget (k_head 256 lower); interval32: a refresh at the latest every 32 "
                        "steps (refresh_interval); redecode_interval32, redecode_recent512: redecode with interval32 or recent512; "
                        "k3072, k4096, redecode_k4096: a selection of 3072 or 4096 cells per head whatever the budget's; "
                        "grid4, grid8: slow steps only on every 4th or 8th step (SFIConfig.refresh_grid)")
    p.add_argument("--context", nargs="+", type=int, default=None, help="only these context lengths of the suite")
    p.add_argument("--cases", type=int, default=None,
                   help="at most this many cases per task and length (the first ones: a later run adds the rest)")
    p.add_argument("--k-head", nargs="+", type=int, default=None,
                   help="only the suite's budgets with these k_head values (the long suite: 2048 and 12.5%% of the context)")
    p.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
    p.add_argument("--out", default=None, help="results JSON (default: benchmarks/results/eval-SUITE.json)")
    p.add_argument("--fresh", action="store_true", help="ignore records already in --out instead of resuming")
    p.add_argument("--no-case-cache", dest="case_cache", action="store_false",
                   help="do not keep the long tasks' cases: by default each case's prefilled prompt (llama.cpp's "
                        "sequence state, ~12 KB per token for the default 0.5B model: ~200 MB a 16K case) and dense's "
                        "reference answer are kept under ~/.cache/sfi-gguf/eval-cases (SFI_GGUF_CACHE moves it), so a "
                        "later run that adds policies to cases already done costs only the new policies' decodes; "
                        "delete the folder to free the space")
    p.add_argument("--report", default=None,
                   help="also write STEM.md (table), STEM-accuracy.png and STEM-timeline.png")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`sfi-gguf eval ARGS`."""
    from .report import markdown_table, write_report
    from .runner import REPO, run_suite

    args = build_parser().parse_args(argv)
    out = Path(args.out) if args.out else REPO / "benchmarks" / "results" / f"eval-{args.suite}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    data = run_suite(args.suite, out, models=args.model, tasks=args.task, policies=args.policy,
                     contexts=args.context, max_cases=args.cases, k_heads=args.k_head, n_threads=args.threads,
                     resume=not args.fresh, case_cache=args.case_cache)
    print(markdown_table(data["rows"]))
    print(f"results: {out}", file=sys.stderr)
    if args.report:
        for path in write_report(data, args.report):
            print(f"wrote {path}", file=sys.stderr)
    return 0
