"""Run the evaluation suites: every policy on every case at one budget, resumable JSON results.

Cost model: a case's prompt (the long haystack) is identical for all policies, so it is prefilled
once; each policy's `generate` then reuses the cached prefix (`LlamaContext.prefill` trims the
previous policy's generated tokens, and `SFIStepper.prefill` re-decodes only the last
`n_prefill_queries` prompt tokens for its bootstrap slow step). A case costs one prefill plus a few
short decodes. Cases of one length share their haystack up to the first inserted fact, so even
consecutive cases reuse most of the cache.

Results: one record per (model, task, context, case, policy) and one row per
(model, task, context, policy) aggregated over cases; the JSON file is rewritten after each case,
and a run given the same file skips the records it already holds (resume after an interruption).
"""
from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..._progress import Progress
from ...config import K_HEAD_GRANULE, SFIConfig
from ..provenance import git_commit
from . import common, cot, longgen, needle, variables

POLICIES = ("dense", "punctuation", "fixed", "static", "sink_recent")
TASKS = {m.TASK: m for m in (needle, variables, longgen, cot)}
REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class TaskPlan:
    """Which cases of one task a suite runs, and the budget they run at."""

    contexts: tuple[int, ...] = (2048,)
    n_cases: tuple[int, ...] | int = 3     # per context (a tuple: one count per context)
    k_share: float = 0.125                 # k_head = this share of the context, a multiple of 64
    n_recent: int = 256
    options: dict = field(default_factory=dict)  # passed to the task's make_cases

    def cases_at(self, i: int) -> int:
        return self.n_cases[i] if isinstance(self.n_cases, tuple) else self.n_cases


@dataclass(frozen=True)
class Suite:
    models: dict[str, dict[str, TaskPlan]]   # model name -> task -> plan
    description: str = ""


SUITES = {
    "quick": Suite(
        description="CI smoke run: tiny contexts, a couple of minutes on 2 CPU cores",
        models={"qwen2.5-coder-0.5b-instruct": {
            "needle": TaskPlan(contexts=(1024,), n_cases=2, k_share=0.125, n_recent=64),
            "variables": TaskPlan(contexts=(1024,), n_cases=1, k_share=0.125, n_recent=64),
            "longgen": TaskPlan(contexts=(768,), n_cases=1, k_share=0.125, n_recent=64, options={"n_steps": 64}),
            "cot": TaskPlan(contexts=(0,), n_cases=1, k_share=0.125, n_recent=32),
        }}),
    "default": Suite(
        description="about 40 minutes on 2 CPU cores: budget 12.5% of the context for the selection",
        models={
            "qwen2.5-coder-0.5b-instruct": {
                "needle": TaskPlan(contexts=(2048, 4096, 8192, 16384), n_cases=(5, 5, 3, 1)),
                "variables": TaskPlan(contexts=(2048, 4096, 8192), n_cases=(6, 4, 2)),
                "longgen": TaskPlan(contexts=(3072,), n_cases=1, options={"n_steps": 1024}),
                "cot": TaskPlan(contexts=(0,), n_cases=16, n_recent=32),
            },
            "gemma3-270m": {
                "needle": TaskPlan(contexts=(2048, 4096, 8192), n_cases=(3, 3, 2)),
                "variables": TaskPlan(contexts=(2048, 4096), n_cases=(4, 2)),
            },
        }),
}


def k_head_for(context: int, share: float) -> int:
    return max(K_HEAD_GRANULE, int(context * share) // K_HEAD_GRANULE * K_HEAD_GRANULE)


def _sfi_summary(s) -> dict | None:
    if s is None:
        return None
    return {"k_head": s.k_head, "budget": s.budget, "n_fast": s.n_fast, "n_slow": s.n_slow, "n_dense": s.n_dense,
            "n_bootstrap": s.n_bootstrap, "n_fell_back": s.n_fell_back, "slow_steps": list(s.slow_steps),
            "refresh_overlap": [round(x, 3) for x in s.refresh_overlap], "reasons": dict(s.reasons)}


def _qa_case(llm, module, case: common.Case, tokens: list[int], configs: dict) -> dict[str, dict]:
    """Greedy answer of every policy to one question; the cache holds the prompt between policies."""
    out = {}
    for policy, config in configs.items():
        llm.sfi_config = config
        t0 = time.perf_counter()
        res = llm.generate(tokens, max_tokens=case.max_tokens, temperature=0, stop=list(case.stop))
        out[policy] = {"score": module.score(case, res.text), "text": res.text[:400],
                       "n_prompt_decoded": res.stats.n_prompt_decoded, "n_generated": res.stats.n_generated,
                       "seconds": round(time.perf_counter() - t0, 2), "sfi": res.stats.sfi}
    return out


def _configs(policies, k_head: int, n_recent: int) -> dict[str, SFIConfig]:
    return {p: SFIConfig(policy=p, k_head=k_head, n_recent=n_recent) for p in policies}


def _key(r: dict) -> tuple:
    return (r["model"], r["task"], r["context"], r["case_id"], r["policy"])


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (model, task, context, policy): mean score over the cases."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["task"], r["context"], r["policy"]), []).append(r)
    solved = {(r["model"], r["task"], r["context"], r["case_id"]) for r in records
              if r["policy"] == "dense" and r["score"] == 1.0}
    rows = []
    for (model, task, context, policy), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                                      POLICIES.index(kv[0][3]))):
        row = {"model": model, "task": task, "context": context, "policy": policy,
               "prompt_tokens": int(np.mean([r["prompt_tokens"] for r in rs])),
               "k_head": rs[0]["k_head"], "n_sink": rs[0]["n_sink"], "n_recent": rs[0]["n_recent"],
               "budget_share": round(float(np.mean([r["budget_share"] for r in rs])), 3),
               "n_cases": len(rs), "score": round(float(np.mean([r["score"] for r in rs])), 4),
               "n_slow": round(float(np.mean([(r.get("sfi") or {}).get("n_slow", 0) for r in rs])), 2),
               "commit": rs[0]["commit"]}
        on_solved = [r["score"] for r in rs if (model, task, context, r["case_id"]) in solved]
        if task != longgen.TASK:  # the cases dense gets right: is SFI's answer right there too?
            row["n_dense_solved"] = len(on_solved)
            row["score_dense_solved"] = round(float(np.mean(on_solved)), 4) if on_solved else None
        if task == longgen.TASK:
            row["mean_kl"] = round(float(np.mean([r["mean_kl"] for r in rs])), 4)
            text = [r["text_top1"] for r in rs if "text_top1" in r]  # argmax == the text's next token
            row["text_top1"] = round(float(np.mean(text)), 4) if text else None
        rows.append(row)
    return rows


def load(path: Path) -> dict:
    if path.exists():
        return json.loads(path.read_text())
    return {"records": [], "rows": []}


def save(path: Path, data: dict) -> None:
    data["rows"] = aggregate(data["records"])
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def run_suite(suite: str | Suite = "quick", out: str | os.PathLike | None = None, *, models=None, tasks=None,
              policies=POLICIES, n_threads: int | None = None, resume: bool = True, log=sys.stderr) -> dict:
    """Run `suite` (a name in SUITES or a Suite) and return {"records": [...], "rows": [...]}.

    `out`: the JSON file (written after every case; None: not written). With `resume`, records
    already in `out` are kept and their (case, policy) pairs are not run again.
    `models`, `tasks`: run only these names of the suite.
    """
    from ...llama import SFILlama

    name = suite if isinstance(suite, str) else "custom"
    suite = SUITES[suite] if isinstance(suite, str) else suite
    path = Path(out) if out else None
    data = load(path) if path and resume else {"records": [], "rows": []}
    data["suite"] = name
    done = {_key(r) for r in data["records"]}
    commit = git_commit(mark_dirty=True)
    for model_name, plans in suite.models.items():
        if models and model_name not in models:
            continue
        plans = {t: p for t, p in plans.items() if not tasks or t in tasks}
        if not plans:
            continue
        n_ctx = max(max(p.contexts) + (p.options.get("n_steps", 0) if t == longgen.TASK else 0)
                    for t, p in plans.items()) + 256
        n_ctx = max(n_ctx, 2048)
        llm = SFILlama(model_name, n_ctx=n_ctx, n_threads=n_threads)
        is_chat = common.is_chat_model(llm)
        work = []
        for task, plan in plans.items():
            module = TASKS[task]
            if task == cot.TASK and not is_chat:
                print(f"eval: {model_name} is a base model: skipping {task}", file=log)
                continue
            for i, context in enumerate(plan.contexts):
                if task == cot.TASK:
                    cases = module.make_cases(llm, plan.cases_at(i), **plan.options)
                else:
                    cases = module.make_cases(llm, context, plan.cases_at(i), **plan.options)
                work += [(module, plan, case) for case in cases]
        work.sort(key=lambda item: item[2].context)  # short contexts first: early results, cheap resumes
        bar = Progress(len(work), f"eval {model_name}", unit="case", enabled=log is sys.stderr)
        for module, plan, case in work:
            tokens = (module.prompt_tokens if hasattr(module, "prompt_tokens") else common.prompt_tokens)(llm, case)
            context = case.context or len(tokens)
            todo = [p for p in policies if (llm.model_path.name, case.task, case.context, case.case_id, p) not in done]
            if todo:
                k_head = k_head_for(context, plan.k_share)
                configs = _configs(todo, k_head, plan.n_recent)
                t0 = time.perf_counter()
                run = module.run_case if hasattr(module, "run_case") else (
                    lambda llm_, case_, tokens_, configs_: _qa_case(llm_, module, case_, tokens_, configs_))
                results = run(llm, case, tokens, configs)
                for policy, res in results.items():
                    res["sfi"] = _sfi_summary(res.get("sfi"))
                    data["records"].append({
                        "model": llm.model_path.name, "task": case.task, "context": case.context,
                        "case_id": case.case_id, "policy": policy, "prompt_tokens": len(tokens), "k_head": k_head,
                        "n_sink": 4, "n_recent": plan.n_recent,
                        "budget_share": round((4 + k_head + plan.n_recent) / len(tokens), 4),
                        "expected": list(case.expected), "meta": case.meta, "commit": commit, **res})
                    done.add(_key(data["records"][-1]))
                if path:
                    save(path, data)
                if not bar.interactive:
                    scores = " ".join(f"{p}={r['score']:.2f}" for p, r in results.items())
                    print(f"eval {model_name} {case.task} {case.context} {case.case_id}: {scores} "
                          f"({time.perf_counter() - t0:.0f} s)", file=log, flush=True)
            bar.update(1)
        bar.close()
        llm.close()
    data["rows"] = aggregate(data["records"])
    return data
