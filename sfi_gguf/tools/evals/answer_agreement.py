"""Answer agreement: dense's own long answer (~256 tokens) to an open question about the document,
with every other policy teacher-forced through it.

Dense answers greedily; each policy then decodes the same tokens (teacher-forced) and is compared
with dense step by step (`sfi_gguf.tools.agreement`): top-1 agreement (the score), mean
KL(dense || policy), and the first step where its argmax differs from dense's. Unlike `longgen`,
the text is the model's own answer over a long context, so each step may need any part of it.
"""
from __future__ import annotations

import random
import time

import numpy as np

from ..agreement import DenseReference, agreement_with, dense_reference
from . import longdoc
from .common import Case

TASK = "agreement"
N_STEPS = 256

QUESTIONS = (
    "Explain in detail, in your own words, what the text above describes, part by part.",
    "Write a detailed summary of the text above, covering each topic it discusses in turn.",
    "Describe the main ideas of the text above and how they relate to each other, with examples from it.",
)


def plant(rng: random.Random) -> longdoc.Plant:
    return longdoc.Plant(facts=[], question=QUESTIONS[rng.randrange(len(QUESTIONS))], max_tokens=N_STEPS)




def first_divergence(top1: np.ndarray) -> int:
    """Index of the first step whose argmax differs from dense's (the length if none does)."""
    misses = np.flatnonzero(~np.asarray(top1, dtype=bool))
    return int(misses[0]) if misses.size else len(top1)


def dense_answer(llm, tokens: list[int], max_tokens: int) -> DenseReference:
    """Dense's greedy answer to the prompt `tokens` (at most `max_tokens`), up to and including its
    end-of-generation token: an answer that ended early is compared up to its end only."""
    ref = dense_reference(llm, tokens, max_tokens)
    n = next((i + 1 for i, token in enumerate(ref.tokens) if llm.context.is_eog(token)), ref.n_steps)
    if n == ref.n_steps:
        return ref
    return DenseReference(tokens=ref.tokens[:n], top=ref.top[:n], logp=ref.logp[:n], argmax=ref.argmax[:n])


def run_case(llm, case: Case, tokens: list[int], configs: dict, cache=None) -> dict[str, dict]:
    """One record per policy; dense's greedy answer is decoded once and shared by all of them. `cache`
    (a `case_cache.CaseCache`): dense's answer and the prompt's state are read from it, or kept in it once decoded."""
    t0 = time.perf_counter()
    ref = cache.reference(tokens, case.max_tokens) if cache else None
    if ref is None:
        ref = dense_answer(llm, tokens, case.max_tokens)
        if cache:
            cache.store_prompt(llm, tokens)
            cache.store_reference(tokens, case.max_tokens, ref)
    n = ref.n_steps
    out = {}
    for label, config in configs.items():
        t1 = time.perf_counter()
        if config.dense:
            out[label] = {"score": 1.0, "mean_kl": 0.0, "first_divergence": n, "n_generated": n,
                          "text": llm.detokenize(ref.tokens)[:400], "seconds": round(t1 - t0, 2)}
            continue
        res = agreement_with(llm, tokens, ref, config)
        out[label] = {"score": res.top1_rate, "mean_kl": res.mean_kl, "first_divergence": first_divergence(res.top1),
                      "top1_bits": "".join("1" if x else "0" for x in res.top1), "n_generated": n,
                      "seconds": round(time.perf_counter() - t1, 2), "sfi": res.sfi_stats}
    return out
