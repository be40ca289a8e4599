"""The long document that the long-answer tasks share: one haystack per (context, seed, index) with
the sentences every task plants in it, and each task's question at its end.

The long-answer tasks (`multifact`, `chain`, `reasoning`, `agreement`; their cases come from
`long_tasks`) ask different questions about the same document, so a suite prefills each document once
and every task and policy reuses the cached prompt (the questions differ only after the document).
Each task module gives a `plant(rng)`
returning a `Plant` (its sentences with their depths, its question and what a right answer holds);
the document holds the plants of all of them, whichever task is run, so a case is the same whether
one task or all are selected. Sentences planted by other tasks act as distractors.

The document is cut so that the prompt and the longest answer fit in `context` tokens.
"""
from __future__ import annotations

import functools
import random
from dataclasses import dataclass, field

from .common import Case, haystack, insert_at_depths

#: the tasks that plant sentences, in planting order (changing it changes every document)
PLANTING_TASKS = ("multifact", "chain", "reasoning", "agreement")
#: tokens kept free after the document: chat template, the longest question, the longest answer
RESERVE = 512


@dataclass(frozen=True)
class Plant:
    """What one task puts into a shared document and asks about it."""

    facts: list[tuple[float, str]]      # (depth as a share of the document, sentence)
    question: str
    answer_prefix: str = ""
    expected: tuple[str, ...] = ()
    max_tokens: int = 64
    stop: tuple[str, ...] = ()
    meta: dict = field(default_factory=dict)


def plants(planters: tuple, context: int, seed: int, index: int) -> dict[str, Plant]:
    """Every task's plant for document `index`, each from its own seeded generator; `planters`: the task
    modules (their `TASK` and `plant(rng)`), in PLANTING_TASKS order."""
    assert tuple(m.TASK for m in planters) == PLANTING_TASKS, "the planting order makes the documents"
    return {m.TASK: m.plant(random.Random(f"longdoc/{m.TASK}/{context}/{seed}/{index}")) for m in planters}


@functools.lru_cache(maxsize=8)
def document(llm, planters: tuple, context: int, seed: int, index: int) -> tuple[str, dict[str, Plant], dict[str, list[float]]]:
    """The document text, the plants in it and the realised depths of each task's sentences."""
    by_task = plants(planters, context, seed, index)
    facts = [(depth, sentence, task) for task, plant in by_task.items() for depth, sentence in plant.facts]
    facts.sort(key=lambda f: f[0])
    planted_tokens = sum(len(llm.tokenize(s, add_special=False)) + 1 for _, s, _ in facts)
    sentences = haystack(llm, context - RESERVE - planted_tokens, seed=seed + 2000)
    text, realised = insert_at_depths(sentences, [(d, s) for d, s, _ in facts])
    depths: dict[str, list[float]] = {}
    for (_, _, task), depth in zip(facts, realised):
        depths.setdefault(task, []).append(round(depth, 3))
    return text, by_task, depths


def cases(llm, planters: tuple, task: str, context: int, n_cases: int, seed: int = 0,
          max_tokens: int | None = None) -> list[Case]:
    """`task`'s question on the first `n_cases` shared documents of `context` tokens (answers cut to
    `max_tokens` if given: quick runs)."""
    out = []
    for i in range(n_cases):
        text, by_task, depths = document(llm, planters, context, seed, i)
        plant = by_task[task]
        out.append(Case(task=task, case_id=f"{context}-{seed}-{i}", context=context, document=text,
                        question=plant.question, answer_prefix=plant.answer_prefix, expected=plant.expected,
                        max_tokens=min(plant.max_tokens, max_tokens or plant.max_tokens), stop=plant.stop,
                        meta={**plant.meta, "depths": depths.get(task, []), "document": f"{context}-{seed}-{i}"}))
    return out

