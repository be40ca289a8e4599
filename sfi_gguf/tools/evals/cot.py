"""Short chain-of-thought: arithmetic word problems whose answer comes after generated reasoning.

Few-shot: three worked examples as earlier chat turns, then the problem; the answer starts with
"Let's solve it step by step." The problems are templates filled from a seed (so new ones come
with another seed): two steps, small numbers, three different numbers per problem. The 0.5B
instruct model solves 15 of the first 16 densely; it restates the problem, then computes, and
writes "The answer is N." after ~60 generated tokens, so with the eval's recent window of 32 the
problem has left the recent window before the answer. Score: the number after "answer is" (else
the last number) equals the answer.
"""
from __future__ import annotations

import random
import re

from .common import Case

TASK = "cot"

INSTRUCTION = 'Solve the problem step by step in plain sentences (no code), then finish with "The answer is N."'

#: worked examples, given as earlier chat turns (in one user message the model mixed them into the problem)
EXAMPLES = (
    ("A baker makes 4 trays of muffins with 6 muffins on each tray. She sells 9 muffins. "
     "How many muffins are left?",
     "The baker makes 4 trays, and each tray has 6 muffins. So she makes 4 * 6 = 24 muffins. "
     "Then she sells 9 muffins. So 24 - 9 = 15 muffins are left. The answer is 15."),
    ("Tom has 35 marbles. He gives 12 marbles to his sister and then buys 8 more. "
     "How many marbles does Tom have now?",
     "Tom starts with 35 marbles. He gives 12 marbles away, so he has 35 - 12 = 23 marbles. "
     "Then he buys 8 more marbles, so he has 23 + 8 = 31 marbles. The answer is 31."),
    ("A library has 3 shelves with 20 books each and a cart with 7 books. How many books are there in total?",
     "The library has 3 shelves, and each shelf has 20 books. So the shelves hold 3 * 20 = 60 books. "
     "The cart has 7 more books. So there are 60 + 7 = 67 books in total. The answer is 67."),
)

#: starts every answer: without it the 0.5B instruct model often skips the reasoning ("The answer is 7.")
REASONING_PREFIX = "Let's solve it step by step."

#: (problem, answer, ranges of a, b, c): two steps, small numbers, a positive answer; a, b, c appear
#: in this order. Kept where the 0.5B model solves them densely (a "(x + y) * z" pen-price and a
#: seats-taken template were dropped: dense failed both).
TEMPLATES = (
    ("Tom has {a} apples. He buys {b} more apples and then eats {c} of them. How many apples does Tom have now?",
     lambda a, b, c: a + b - c, (12, 40), (5, 19), (2, 9)),
    ("Anna reads {a} pages every day for {b} days, and then {c} more pages on the last evening. "
     "How many pages does she read in total?", lambda a, b, c: a * b + c, (3, 9), (2, 6), (2, 9)),
    ("A baker bakes {a} cakes in the morning and {b} cakes in the afternoon. He sells {c} cakes. "
     "How many cakes are left?", lambda a, b, c: a + b - c, (10, 30), (5, 19), (2, 9)),
    ("Sam saves {a} dollars each week for {b} weeks. Then he spends {c} dollars on a game. "
     "How many dollars does he have left?", lambda a, b, c: a * b - c, (4, 9), (3, 6), (2, 9)),
    ("A bus carries {a} passengers. At the first stop {b} people get off and {c} people get on. "
     "How many passengers are on the bus now?", lambda a, b, c: a - b + c, (20, 40), (2, 9), (2, 9)),
    ("A class has {a} students. Each student brings {b} pencils, and the teacher adds {c} more pencils. "
     "How many pencils are there in total?", lambda a, b, c: a * b + c, (3, 9), (2, 5), (2, 9)),
    ("Lisa has {a} stickers. She gives {b} stickers to each of her {c} friends. "
     "How many stickers does Lisa have left?", lambda a, b, c: a - b * c, (30, 60), (2, 5), (2, 5)),
    ("A farmer has {a} boxes with {b} eggs in each box. He buys {c} more eggs. How many eggs does he have?",
     lambda a, b, c: a * b + c, (3, 9), (4, 9), (2, 9)),
)


def make_cases(llm, n_cases: int, seed: int = 0, max_tokens: int = 256) -> list[Case]:
    """`n_cases` problems (the templates in turn, numbers from the seed); `context` 0: the prompt's own length."""
    cases = []
    for i in range(n_cases):
        rng = random.Random(f"{TASK}/{seed}/{i}")
        template, solve, *ranges = TEMPLATES[i % len(TEMPLATES)]
        while True:  # three different numbers, so a copied number names its source
            a, b, c = (rng.randint(*r) for r in ranges)
            if len({a, b, c}) == 3 and solve(a, b, c) > 0:
                break
        problem = template.format(a=a, b=b, c=c)
        cases.append(Case(
            task=TASK, case_id=f"{seed}-{i}", context=0, document=INSTRUCTION,
            question=problem, answer_prefix=REASONING_PREFIX,
            expected=(str(solve(a, b, c)),), max_tokens=max_tokens, stop=("\nProblem:",),
            meta={"problem": problem}))
    return cases


def messages(case: Case) -> list[dict]:
    """The worked examples as earlier user / assistant turns, then the problem."""
    out = []
    for problem, solution in EXAMPLES:
        out += [{"role": "user", "content": f"{case.document}\n\n{problem}"},
                {"role": "assistant", "content": f"{REASONING_PREFIX} {solution}"}]
    return out + [{"role": "user", "content": f"{case.document}\n\n{case.question}"}]


def prompt_tokens(llm, case: Case) -> list[int]:
    """Chat turns, then the reasoning prefix as the start of the answer (cot runs on chat models only)."""
    return llm.prompt_tokens(messages(case)) + llm.tokenize(case.answer_prefix, add_special=False)


def final_number(text: str) -> str | None:
    said = re.findall(r"answer is\s*\$?(-?\d+)", text)
    numbers = said or re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def score(case: Case, text: str) -> float:
    return float(final_number(text) == case.expected[0])
