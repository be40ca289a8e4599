"""Needle retrieval (RULER-style "niah"): a key-value fact hidden in a haystack of natural text.

A fact "One of the special magic numbers for <key> is: <7 digits>." is placed at a depth between
10% and 90% of the haystack (several cases per length, evenly spread depths), with distractor
facts for other keys right after it; the question at the end asks for the number of <key>. Exact
match: the 7 digits appear in the answer. Cases are a pure function of (length, index, seed).
"""
from __future__ import annotations

import random

from .common import PROMPT_OVERHEAD, Case, haystack, insert_at_depths

TASK = "needle"
ADJECTIVES = ("amber", "brisk", "cobalt", "dusty", "eager", "frosty", "gentle", "hollow", "ivory", "jolly",
              "keen", "lunar", "mellow", "nimble", "olive", "proud", "quiet", "rusty", "silver", "tidy",
              "umber", "vivid", "woolly", "young", "zesty")
NOUNS = ("anchor", "badger", "canyon", "dolphin", "ember", "falcon", "glacier", "harbor", "island", "jaguar",
         "kettle", "lantern", "meadow", "nectar", "orchid", "pebble", "quarry", "raven", "saddle", "tundra",
         "violet", "walnut", "yarrow", "zephyr", "beacon")


def depths(n_cases: int) -> list[float]:
    """Evenly spread depths from 10% to 90% (one case: 50%)."""
    if n_cases == 1:
        return [0.5]
    return [round(0.1 + 0.8 * i / (n_cases - 1), 3) for i in range(n_cases)]


def fact(key: str, value: str) -> str:
    return f"One of the special magic numbers for {key} is: {value}."


def make_cases(llm, context: int, n_cases: int, seed: int = 0, n_distractors: int = 1) -> list[Case]:
    """`n_cases` needle cases of about `context` prompt tokens, deepest first (prefix reuse)."""
    sentences = haystack(llm, context - PROMPT_OVERHEAD, seed=seed)
    cases = []
    for i, depth in enumerate(depths(n_cases)):
        rng = random.Random(f"{TASK}/{context}/{seed}/{i}")
        keys = []
        while len(keys) < 1 + n_distractors:
            key = f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"
            if key not in keys:
                keys.append(key)
        values = [str(rng.randrange(1_000_000, 10_000_000)) for _ in keys]
        # distractors right after the needle: retrieval must read the key, and the cases of one
        # length still share the haystack before the needle (prefix reuse)
        others = [min(depth + 0.02 * (j + 1), 0.97) for j in range(n_distractors)]
        facts = [(depth, fact(keys[0], values[0]))] + [(d, fact(k, v)) for d, k, v in zip(others, keys[1:], values[1:])]
        document, realised = insert_at_depths(sentences, facts)
        cases.append(Case(
            task=TASK, case_id=f"{context}-{seed}-{i}", context=context, document=document,
            question=f"What is the special magic number for {keys[0]} mentioned in the provided text?",
            answer_prefix=f"The special magic number for {keys[0]} mentioned in the provided text is",
            expected=(values[0],), max_tokens=16,
            meta={"depth": round(realised[0], 3), "key": keys[0], "distractors": dict(zip(keys[1:], values[1:]))}))
    return sorted(cases, key=lambda c: -c.meta["depth"])


def score(case: Case, text: str) -> float:
    """1.0 if the needle's number appears in the answer (RULER's string match), else 0.0."""
    digits = "".join(ch if ch.isdigit() else " " for ch in text).split()
    return float(case.expected[0] in digits)
