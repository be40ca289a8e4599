"""The long-answer tasks' cases: each task's question on the documents they share (`longdoc`), which
hold every task's planted sentences whichever task is run."""
from __future__ import annotations

from . import answer_agreement, chain, common, longdoc, multifact, reasoning
from .common import Case

#: in PLANTING_TASKS order (the order makes the documents)
TASKS = (multifact, chain, reasoning, answer_agreement)


def make_cases(task: str, llm, context: int, n_cases: int, seed: int = 0, max_tokens: int | None = None) -> list[Case]:
    return longdoc.cases(llm, TASKS, task, context, n_cases, seed, max_tokens)


def case_and_prompt(llm, task: str, context: int, index: int) -> tuple[Case, list[int]]:
    """`task`'s case on shared document `index` of `context` tokens and its prompt tokens (for scripts that study
    one case outside the suite)."""
    case = make_cases(task, llm, context, index + 1)[index]
    return case, common.prompt_tokens(llm, case)
