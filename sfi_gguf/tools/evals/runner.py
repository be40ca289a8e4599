"""Run the evaluation suites: every policy on every case at one budget, resumable JSON results.

Cost model: a case's prompt (the long haystack) is identical for all policies, so it is prefilled
once; each policy's `generate` then reuses the cached prefix (`LlamaContext.prefill` trims the
previous policy's generated tokens and decodes only the prompt's last `n_prefill_queries` tokens again,
as every prefill decodes them, on their own: SFI's bootstrap rows). A case costs one prefill plus a few
short decodes. Cases of one length share their haystack up to the first inserted fact, so even
consecutive cases reuse most of the cache.

Results: one record per (model, task, context, case, policy) and one row per
(model, task, context, policy) aggregated over cases; the JSON file is rewritten after each case,
and a run given the same file skips the records it already holds (resume after an interruption).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...core.progress import Progress
from ...core.config import K_HEAD_GRANULE, SFIConfig
from ..provenance import git_commit
from . import answer_agreement, common, cot, long_tasks, longgen, needle, variables
from .case_cache import CaseCache

POLICIES = ("dense", "punctuation", "fixed", "static", "sink_recent")
#: trigger variants compared with the default one: eval name -> (policy, its parameters)
VARIANTS = {
    "paper": ("punctuation", {"confidence_floor": 0.0}),  # sentence starts + T_max + warm-up, no confidence rule
    "fixed16": ("fixed", {"fixed_period": 16}),
    "redecode": ("punctuation", {"redecode_tail": True}),  # the default trigger, slow steps re-decode the tail
    # the default trigger, each selection committed d steps after its slow step (what an asynchronous refresh costs)
    "delay4": ("punctuation", {"selection_delay": 4}),
    "delay16": ("punctuation", {"selection_delay": 16}),
    # ... and the asynchronous refresh itself (async_refresh: the trigger's step a fast one, its export computed
    # from its queries), loaded 16 or 64 steps later, the triggers in between skipped
    "async16": ("punctuation", {"async_refresh": True, "selection_delay": 16}),
    "async64": ("punctuation", {"async_refresh": True, "selection_delay": 64}),
    # the rest of the gap to dense, one change at a time: a recent window of 512 at the same budget (k_head gives
    # up the 256 cells the window gains), a refresh at the latest every 32 steps, and that with redecode
    "recent512": ("punctuation", {"n_recent": 512}),
    "interval32": ("punctuation", {"refresh_interval": 32}),
    "redecode_interval32": ("punctuation", {"redecode_tail": True, "refresh_interval": 32}),
    "redecode_recent512": ("punctuation", {"redecode_tail": True, "n_recent": 512}),
    # a larger selection (k_head 3072 or 4096, whatever the budget's), alone and with redecode: what more cells win back
    "k3072": ("punctuation", {"k_head": 3072}),
    "k4096": ("punctuation", {"k_head": 4096}),
    "redecode_k4096": ("punctuation", {"redecode_tail": True, "k_head": 4096}),
    # slow steps only on every 4th or 8th step (refresh_grid; a batch's sequences then refresh together): a trigger
    # waits up to 3 or 7 steps, as it does in a batch whose other sequences do not trigger meanwhile
    "grid4": ("punctuation", {"refresh_grid": 4}),
    "grid8": ("punctuation", {"refresh_grid": 8}),
}
#: every name a run may ask for, in table order
ALL_POLICIES = ("dense", "punctuation", "redecode", "recent512", "interval32", "redecode_interval32", "redecode_recent512",
                "k3072", "k4096", "redecode_k4096", "grid4", "grid8",
                "delay4", "delay16", "async16", "async64", "paper", "fixed", "fixed16", "static", "sink_recent")
LONG_TASKS = long_tasks.TASKS  # questions on one shared document (`longdoc`)
TASKS = {m.TASK: m for m in (needle, variables, longgen, cot, *LONG_TASKS)}
TEACHER_FORCED = (longgen.TASK, answer_agreement.TASK)  # scored by agreement with dense, not by an answer
REPO = Path(__file__).resolve().parents[3]


@dataclass(frozen=True)
class TaskPlan:
    """Which cases of one task a suite runs, and the budget they run at."""

    contexts: tuple[int, ...] = (2048,)
    n_cases: tuple[int, ...] | int = 3     # per context (a tuple: one count per context)
    k_share: float = 0.125                 # k_head = this share of the context, a multiple of 64
    n_recent: int = 256
    options: dict = field(default_factory=dict)  # passed to the task's make_cases
    budgets: tuple[int | float, ...] = ()  # several budgets per case: an int is a k_head, a float a share
                                           # of the context; empty: k_share only

    def cases_at(self, i: int) -> int:
        return self.n_cases[i] if isinstance(self.n_cases, tuple) else self.n_cases

    def k_heads(self, context: int) -> list[int]:
        """The k_head of every budget at `context`, each once (two budgets can coincide)."""
        out: list[int] = []
        for budget in self.budgets or (self.k_share,):
            k_head = k_head_for(context, budget) if isinstance(budget, float) else int(budget)
            if k_head not in out:
                out.append(k_head)
        return out


@dataclass(frozen=True)
class Suite:
    models: dict[str, dict[str, TaskPlan]]   # model name -> task -> plan
    description: str = ""
    policies: tuple[str, ...] = POLICIES     # names in ALL_POLICIES


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
    "long": Suite(
        description="answers spanning many refreshes (multi-fact, chain, reasoning, answer agreement) at 8K, 16K "
                    "and 32K on one shared document per case (the 1.5B model too, Gemma 3 270M's answer agreement at "
                    "8K and 16K), k_head 2048 and "
                    "12.5% of the context, the default trigger against the paper's cadence and a fixed period "
                    "of 16; hours on 2 CPU cores (run it in the background: it resumes; --model, --cases and "
                    "--context give a subset first)",
        policies=("dense", "punctuation", "paper", "fixed16", "static", "sink_recent"),
        models={
            "qwen2.5-coder-0.5b-instruct": {
                m.TASK: TaskPlan(contexts=(8192, 16384, 32768), n_cases=6, budgets=(2048, 0.125)) for m in LONG_TASKS},
            "qwen2.5-coder-1.5b-instruct": {
                m.TASK: TaskPlan(contexts=(8192, 16384, 32768), n_cases=6, budgets=(2048, 0.125)) for m in LONG_TASKS},
            # a model with sliding-window layers (SFI covers its global ones): answer agreement
            "gemma3-270m": {"agreement": TaskPlan(contexts=(8192, 16384), n_cases=6, budgets=(2048, 0.125))},
        }),
}


def context_size(plans: dict[str, TaskPlan]) -> int:
    """The n_ctx that holds every case of `plans` (task -> plan): a long task's document leaves room for its
    question and answer within its context (`longdoc.RESERVE`), so 32K cells fit the default model's 32K
    training context; the other tasks' prompts are their context, with room for the answer (and longgen's steps)."""
    n_ctx = max(max(p.contexts) + (0 if TASKS[t] in LONG_TASKS else 256)
                + (p.options.get("n_steps", 0) if t == longgen.TASK else 0) for t, p in plans.items())
    return max(n_ctx, 2048)


def k_head_for(context: int, share: float) -> int:
    return max(K_HEAD_GRANULE, int(context * share) // K_HEAD_GRANULE * K_HEAD_GRANULE)


def _sfi_summary(s) -> dict | None:
    if s is None:
        return None
    return {"k_head": s.k_head, "budget": s.budget, "n_fast": s.n_fast, "n_slow": s.n_slow, "n_dense": s.n_dense,
            "n_bootstrap": s.n_bootstrap, "n_fell_back": s.n_fell_back, "slow_steps": list(s.slow_steps),
            "n_host_refresh": s.n_host_refresh, "n_refresh_skipped": s.n_refresh_skipped,
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


def policy_config(name: str, k_head: int, n_recent: int) -> SFIConfig:
    """The config of a policy or variant (`VARIANTS`) at one budget (n_sink + k_head + n_recent): a variant with
    its own n_recent takes the difference from k_head; one with its own k_head keeps it."""
    policy, params = VARIANTS.get(name, (name, {}))
    params = {"n_recent": n_recent, **params}
    k_head = params.pop("k_head", k_head) - (params["n_recent"] - n_recent)
    if k_head < 1:
        raise ValueError(f"{name}: its recent window of {params['n_recent']} leaves no k_head in this budget")
    return SFIConfig(policy=policy, k_head=k_head, **params)


def _key(r: dict) -> tuple:
    return (r["model"], r["task"], r["context"], r["case_id"], r["policy"], r["k_head"])


def aggregate(records: list[dict]) -> list[dict]:
    """One row per (model, task, context, policy): mean score over the cases."""
    groups: dict[tuple, list[dict]] = {}
    for r in records:
        groups.setdefault((r["model"], r["task"], r["context"], r["k_head"], r["policy"]), []).append(r)
    solved = {(r["model"], r["task"], r["context"], r["case_id"]) for r in records
              if r["policy"] == "dense" and r["score"] == 1.0}
    rows = []
    for (model, task, context, _, policy), rs in sorted(groups.items(), key=lambda kv: (
            kv[0][0], kv[0][1], kv[0][2], -kv[0][3], ALL_POLICIES.index(kv[0][4]))):
        row = {"model": model, "task": task, "context": context, "policy": policy,
               "prompt_tokens": int(np.mean([r["prompt_tokens"] for r in rs])),
               "k_head": rs[0]["k_head"], "n_sink": rs[0]["n_sink"], "n_recent": rs[0]["n_recent"],
               "budget_share": round(float(np.mean([r["budget_share"] for r in rs])), 3),
               "n_cases": len(rs), "score": round(float(np.mean([r["score"] for r in rs])), 4),
               "n_slow": round(float(np.mean([(r.get("sfi") or {}).get("n_slow", 0) for r in rs])), 2),
               "commit": rs[0]["commit"]}
        on_solved = [r["score"] for r in rs if (model, task, context, r["case_id"]) in solved]
        if task not in TEACHER_FORCED:  # the cases dense gets right: is SFI's answer right there too?
            row["n_dense_solved"] = len(on_solved)
            row["score_dense_solved"] = round(float(np.mean(on_solved)), 4) if on_solved else None
        if task in TEACHER_FORCED:
            row["mean_kl"] = round(float(np.mean([r["mean_kl"] for r in rs])), 4)
        if task == answer_agreement.TASK:
            row["first_divergence"] = round(float(np.mean([r["first_divergence"] for r in rs])), 1)
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
              policies=None, contexts=None, max_cases: int | None = None, k_heads=None, n_threads: int | None = None,
              resume: bool = True, case_cache: bool | str | os.PathLike = True, log=sys.stderr) -> dict:
    """Run `suite` (a name in SUITES or a Suite) and return {"records": [...], "rows": [...]}.

    `out`: the JSON file (written after every case; None: not written). With `resume`, records
    already in `out` are kept and their (case, policy, budget) triples are not run again.
    `models`, `tasks`, `contexts`: run only these of the suite; `policies`: these names of
    ALL_POLICIES (default: the suite's); `max_cases`: at most this many cases per task and context
    (the first ones, so a later run with more cases adds to them); `k_heads`: only the budgets of the suite with these
    k_head values. `case_cache`: the long tasks' cases keep their prompt state and dense's answer
    (`sfi_gguf.tools.evals.case_cache`) in its default folder (True), in this folder (a path), or nowhere (False).
    """
    from ...sfi_llama import SFILlama

    name = suite if isinstance(suite, str) else "custom"
    suite = SUITES[suite] if isinstance(suite, str) else suite
    policies = tuple(policies or suite.policies)
    unknown = [p for p in policies if p not in ALL_POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; known: {', '.join(ALL_POLICIES)}")
    path = Path(out) if out else None
    data = load(path) if path and resume else {"records": [], "rows": []}
    data["suite"] = name
    done = {_key(r) for r in data["records"]}
    commit = git_commit(mark_dirty=True)
    for model_name, plans in suite.models.items():
        if models and model_name not in models:
            continue
        plans = {t: p for t, p in plans.items() if not tasks or t in tasks}
        if contexts:
            plans = {t: dataclasses.replace(p, contexts=tuple(c for c in p.contexts if c in contexts))
                     for t, p in plans.items()}
            plans = {t: p for t, p in plans.items() if p.contexts}
        if not plans:
            continue
        n_ctx = context_size(plans)
        llm = SFILlama(model_name, n_ctx=n_ctx, n_threads=n_threads)
        is_chat = common.is_chat_model(llm)
        work = []
        for task, plan in plans.items():
            module = TASKS[task]
            if task == cot.TASK and not is_chat:
                print(f"eval: {model_name} is a base model: skipping {task}", file=log)
                continue
            for i, context in enumerate(plan.contexts):
                n_cases = min(plan.cases_at(i), max_cases) if max_cases else plan.cases_at(i)
                if task == cot.TASK:
                    cases = module.make_cases(llm, n_cases, **plan.options)
                elif module in LONG_TASKS:
                    cases = long_tasks.make_cases(task, llm, context, n_cases, **plan.options)
                else:
                    cases = module.make_cases(llm, context, n_cases, **plan.options)
                work += [(module, plan, case) for case in cases]
        # short contexts first (early results, cheap resumes); the tasks sharing a document one after
        # another, so its prefill serves all of them
        work.sort(key=lambda item: (item[2].context, item[2].meta.get("document", "")))
        cache = None  # the long tasks' cases (the short tasks' prefills are cheap)
        if case_cache is not False and any(module in LONG_TASKS for module, _, _ in work):
            cache = CaseCache(llm, None if case_cache is True else case_cache)
        bar = Progress(len(work), f"eval {model_name}", unit="case", enabled=log is sys.stderr)
        for module, plan, case in work:
            tokens = (module.prompt_tokens if hasattr(module, "prompt_tokens") else common.prompt_tokens)(llm, case)
            context = case.context or len(tokens)
            # label -> (policy, the k_heads it is recorded at): dense runs once, recorded at every budget
            todo: dict[str, tuple[str, list[int]]] = {}
            for k_head in plan.k_heads(context):
                if k_heads and k_head not in k_heads:
                    continue
                for p in policies:
                    if (llm.model_path.name, case.task, case.context, case.case_id, p, k_head) in done:
                        continue
                    label = p if p == "dense" else f"{p}@{k_head}"
                    todo.setdefault(label, (p, []))[1].append(k_head)
            if todo:
                configs = {label: policy_config(p, ks[0], plan.n_recent) for label, (p, ks) in todo.items()}
                t0 = time.perf_counter()
                cached = cache if module in LONG_TASKS else None
                if cached:
                    cached.restore_prompt(llm, tokens)
                if module is answer_agreement:
                    results = module.run_case(llm, case, tokens, configs, cache=cached)
                elif hasattr(module, "run_case"):
                    results = module.run_case(llm, case, tokens, configs)
                else:
                    results = _qa_case(llm, module, case, tokens, configs)
                if cached:
                    cached.store_prompt(llm, tokens)
                for label, res in results.items():
                    res["sfi"] = _sfi_summary(res.get("sfi"))
                    policy, recorded_at = todo[label]
                    for k_head in recorded_at:
                        data["records"].append({
                            "model": llm.model_path.name, "task": case.task, "context": case.context,
                            "case_id": case.case_id, "policy": policy, "prompt_tokens": len(tokens), "k_head": k_head,
                            "n_sink": 4, "n_recent": configs[label].n_recent,
                            "budget_share": round((4 + k_head + plan.n_recent) / len(tokens), 4),
                            "expected": list(case.expected), "meta": case.meta, "commit": commit, **copy.deepcopy(res)})
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
