"""Multi-fact retrieval: several key-number facts spread over the document, asked in one question
and answered in one generation as a list ("key: number" per line), scored per fact.

Each line of the answer needs another place in the context (keys are asked in a shuffled order, not
the document's), so an answer of ~100 tokens meets several refreshes. Score: the share of keys whose
line holds the right number.
"""
from __future__ import annotations

import random
import re

from . import longdoc
from .common import Case
from .needle import ADJECTIVES, NOUNS

TASK = "multifact"
N_FACTS = 6
TOKENS_PER_FACT = 14     # "amber-falcon: 1234567" and a new line: ~12 tokens with the Qwen tokenizer


def fact(key: str, value: str) -> str:
    return f"The secret code of the {key} is {value}."


def plant(rng: random.Random, n_facts: int = N_FACTS) -> longdoc.Plant:
    keys: list[str] = []
    while len(keys) < n_facts:
        key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
        if key not in keys:
            keys.append(key)
    values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
    # one fact per equal slice of the document, at a random place inside it
    depths = [(i + rng.uniform(0.1, 0.9)) / n_facts for i in range(n_facts)]
    asked = keys[:]
    rng.shuffle(asked)
    codes = dict(zip(keys, values))
    return longdoc.Plant(
        facts=[(d, fact(k, v)) for d, k, v in zip(depths, keys, values)],
        question=(f"The text above gives the secret codes of {n_facts} things. List the secret code of each of "
                  f"these, one per line as \"name: code\", in this order: {', '.join(asked)}."),
        answer_prefix=f"{asked[0]}:",
        expected=tuple(codes[k] for k in asked), max_tokens=TOKENS_PER_FACT * n_facts + 8, stop=("\n\n",),
        meta={"keys": asked, "codes": codes})




def answers(case: Case, text: str) -> dict[str, str | None]:
    """The number the answer gives for each asked key (None: no line names the key)."""
    found: dict[str, str | None] = {k: None for k in case.meta["keys"]}
    for line in (case.answer_prefix + text).splitlines():
        for key in found:
            if found[key] is None and key in line:
                numbers = re.findall(r"\d{7}", line.split(key, 1)[1])
                found[key] = numbers[0] if numbers else ""
    return found


def score(case: Case, text: str) -> float:
    """Share of the asked keys whose line names the right code."""
    got = answers(case, text)
    keys = case.meta["keys"]
    return sum(got[k] == case.meta["codes"][k] for k in keys) / len(keys)
