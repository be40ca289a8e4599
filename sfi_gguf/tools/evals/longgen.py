"""Long-generation agreement: how closely each policy follows dense over 1K+ generated tokens.

A natural-text prompt (raw continuation, no chat template) of `context` tokens, and the
`n_steps` tokens of the same text that follow it as the reference continuation. Dense and every
policy are teacher-forced through that held-out text and compared step by step
(`sfi_gguf.tools.agreement`: top-1 agreement with dense's argmax and KL(dense || policy), per 100 tokens).
Natural text rather than dense's own greedy continuation: the greedy one falls into a repetition
loop after a few hundred tokens, which any recent window reproduces, so every policy scored ~99.8%.
The dense pass is run once per case and shared by all policies.
"""
from __future__ import annotations

import time

import numpy as np

from ..agreement import agreement_with, dense_reference
from ..texts import natural_text
from .common import Case

TASK = "longgen"


def make_cases(llm, context: int, n_cases: int, seed: int = 0, n_steps: int = 1024) -> list[Case]:
    """`n_cases` prose texts of `context` prompt tokens followed by `n_steps` reference tokens."""
    return [Case(task=TASK, case_id=f"{context}-{seed + i}", context=context,
                 document=natural_text((context + n_steps) * 6 + 2000, seed=seed + i + 7), question="",
                 max_tokens=n_steps, meta={"seed": seed + i + 7}) for i in range(n_cases)]


def _tokens(llm, case: Case) -> list[int]:
    tokens = llm.tokenize(case.document)
    if len(tokens) < case.context + case.max_tokens:
        raise ValueError(f"{case.case_id}: text has {len(tokens)} tokens, needs {case.context + case.max_tokens}")
    return tokens


def prompt_tokens(llm, case: Case) -> list[int]:
    return _tokens(llm, case)[:case.context]


def reference_tokens(llm, case: Case) -> list[int]:
    """The held-out continuation: the `max_tokens` tokens of the text right after the prompt."""
    return _tokens(llm, case)[case.context:case.context + case.max_tokens]


def run_case(llm, case: Case, tokens: list[int], configs: dict) -> dict[str, dict]:
    """One record per policy: top-1 agreement with dense as the score, mean KL, per-100-token windows;
    `text_top1`: how often the policy's argmax is the text's next token (dense's own is the ceiling)."""
    t0 = time.perf_counter()
    text = reference_tokens(llm, case)
    ref = dense_reference(llm, tokens, case.max_tokens, forced=text)
    truth = np.asarray(text)
    out = {}
    for policy, config in configs.items():
        t1 = time.perf_counter()
        if policy == "dense":
            out[policy] = {"score": 1.0, "mean_kl": 0.0, "per_100": [], "n_generated": ref.n_steps,
                           "text_top1": round(float((ref.argmax == truth).mean()), 4),
                           "seconds": round(t1 - t0, 2)}
            continue
        res = agreement_with(llm, tokens, ref, config)
        out[policy] = {"score": res.top1_rate, "mean_kl": res.mean_kl, "per_100": res.per_window(100),
                       "top1_bits": "".join("1" if x else "0" for x in res.top1), "n_generated": ref.n_steps,
                       "text_top1": round(float((res.argmax == truth).mean()), 4),
                       "seconds": round(time.perf_counter() - t1, 2), "sfi": res.sfi_stats}
    return out
