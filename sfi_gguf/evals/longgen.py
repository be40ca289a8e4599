"""Long-generation agreement: how closely each policy follows dense over 1K+ generated tokens.

A natural-text prompt (raw continuation, no chat template) is decoded greedily by dense for
`n_steps` tokens; every policy is then forced through that continuation and compared step by step
(`sfi_gguf.agreement`: teacher-forced top-1 agreement and KL(dense || policy), per 100 tokens).
The dense reference is computed once per case and shared by all policies.
"""
from __future__ import annotations

import time

from ..agreement import agreement_with, dense_reference
from ..texts import natural_text
from .common import Case

TASK = "longgen"


def make_cases(llm, context: int, n_cases: int, seed: int = 0, n_steps: int = 1024) -> list[Case]:
    """`n_cases` prompts of exactly `context` tokens of prose, each continued for `n_steps` tokens."""
    return [Case(task=TASK, case_id=f"{context}-{seed + i}", context=context,
                 document=natural_text(context * 6 + 2000, seed=seed + i + 7), question="",
                 max_tokens=n_steps, meta={"seed": seed + i + 7}) for i in range(n_cases)]


def prompt_tokens(llm, case: Case) -> list[int]:
    return llm.tokenize(case.document)[:case.context]


def run_case(llm, case: Case, tokens: list[int], configs: dict) -> dict[str, dict]:
    """One record per policy: top-1 agreement as the score, mean KL, per-100-token windows."""
    t0 = time.perf_counter()
    ref = dense_reference(llm, tokens, case.max_tokens)
    out = {}
    for policy, config in configs.items():
        t1 = time.perf_counter()
        if policy == "dense":
            out[policy] = {"score": 1.0, "mean_kl": 0.0, "per_100": [], "n_generated": ref.n_steps,
                           "seconds": round(t1 - t0, 2)}
            continue
        res = agreement_with(llm, tokens, ref, config)
        out[policy] = {"score": res.top1_rate, "mean_kl": res.mean_kl, "per_100": res.per_window(100),
                       "top1_bits": "".join("1" if x else "0" for x in res.top1), "n_generated": ref.n_steps,
                       "seconds": round(time.perf_counter() - t1, 2), "sfi": res.sfi_stats}
    return out
