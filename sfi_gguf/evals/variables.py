"""Multi-hop variable tracking (RULER "vt"): a chain of assignments scattered through the context.

"VAR AAAAA = 12345." then "VAR BBBBB = VAR AAAAA.", "VAR CCCCC = VAR BBBBB." ... at increasing
depths, plus a distractor chain with another value; the question asks for every variable that holds
the first chain's value. Following the chain means attending to n_hops separate places. Score:
recall of the chain's variable names in the answer (RULER's string-match-all, per case in [0, 1]).
"""
from __future__ import annotations

import random
import re
import string

from .common import PROMPT_OVERHEAD, Case, haystack, insert_at_depths

TASK = "variables"


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken:
            taken.add(name)
            return name


def _chain(rng: random.Random, taken: set[str], value: str, n_hops: int) -> list[tuple[str, str]]:
    names = [_name(rng, taken) for _ in range(n_hops + 1)]
    lines = [(names[0], f"VAR {names[0]} = {value}.")]
    for before, name in zip(names, names[1:]):
        lines.append((name, f"VAR {name} = VAR {before}."))
    return lines


def make_cases(llm, context: int, n_cases: int, seed: int = 0, n_hops: int = 3) -> list[Case]:
    """`n_cases` chains of `n_hops` hops (n_hops + 1 variables) in about `context` prompt tokens."""
    sentences = haystack(llm, context - PROMPT_OVERHEAD, seed=seed + 1000)
    cases = []
    for i in range(n_cases):
        rng = random.Random(f"{TASK}/{context}/{seed}/{i}")
        taken: set[str] = set()
        value, other = (str(rng.randrange(10_000, 100_000)) for _ in range(2))
        chain = _chain(rng, taken, value, n_hops)
        noise = _chain(rng, taken, other, n_hops)
        spots = sorted(rng.uniform(0.05, 0.95) for _ in chain)
        noise_spots = sorted(rng.uniform(0.05, 0.95) for _ in noise)
        facts = [(d, line) for d, (_, line) in zip(spots, chain)] + [(d, line) for d, (_, line) in zip(noise_spots, noise)]
        document, realised = insert_at_depths(sentences, sorted(facts, key=lambda f: f[0]))
        names = tuple(name for name, _ in chain)
        cases.append(Case(
            task=TASK, case_id=f"{context}-{seed}-{i}", context=context, document=document,
            question=f"Find all variables that are assigned the value {value} in the text above, directly or "
                     "through other variables.",
            answer_prefix=f"According to the chain of variable assignments in the text above, {len(names)} "
                          f"variables are assigned the value {value}, they are:",
            expected=names, max_tokens=8 * len(names) + 8, stop=(),  # the list may start on a new line
            meta={"depths": [round(d, 3) for d in spots], "value": value}))
    return cases


def score(case: Case, text: str) -> float:
    """Share of the chain's variables named in the answer (as words: `ABCDE`, "ABCDE," and a list
    on new lines all count)."""
    words = set(re.findall(r"[A-Z]{5}", text))
    return sum(name in words for name in case.expected) / len(case.expected)
