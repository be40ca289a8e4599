"""Short chain-of-thought: arithmetic word problems whose answer comes after generated reasoning.

Few-shot (worked examples, then the problem). The problems are templates filled from a seed, so new
ones can be generated; the numbers are small and the steps few, which the 0.5B instruct model
solves densely. During the reasoning the problem's numbers leave the recent window, so a sparse
memory must keep them. Score: the last number of the reasoning equals the answer.
"""
from __future__ import annotations

import random
import re

from .common import Case

TASK = "cot"

EXAMPLES = """Solve each problem step by step, then finish with "The answer is N."

Problem: A baker makes 4 trays of muffins with 6 muffins on each tray. She sells 9 muffins. How many muffins are left?
Solution: The baker makes 4 trays of 6 muffins, so she makes 4 * 6 = 24 muffins. She sells 9 of them, so 24 - 9 = 15 muffins are left. The answer is 15.

Problem: Tom has 35 marbles. He gives 12 marbles to his sister and then buys 8 more. How many marbles does Tom have now?
Solution: Tom starts with 35 marbles. After giving 12 away he has 35 - 12 = 23 marbles. Then he buys 8 more, so he has 23 + 8 = 31 marbles. The answer is 31.

Problem: A library has 3 shelves with 20 books each and a cart with 7 books. How many books are there in total?
Solution: The shelves hold 3 * 20 = 60 books. Together with the cart there are 60 + 7 = 67 books. The answer is 67.
"""

#: starts the answer: without it the 0.5B instruct model often skips the reasoning ("The answer is 7.")
REASONING_PREFIX = "Let's solve it step by step."

TEMPLATES = (
    ("A farmer has {a} rows of trees with {b} trees in each row. A storm knocks down {c} trees. "
     "How many trees are still standing?", lambda a, b, c: a * b - c),
    ("Anna reads {a} pages every day for {b} days, and then {c} more pages on the last evening. "
     "How many pages does she read in total?", lambda a, b, c: a * b + c),
    ("A box holds {a} pencils. A teacher buys {b} boxes and gives away {c} pencils. "
     "How many pencils does the teacher keep?", lambda a, b, c: a * b - c),
    ("A bus carries {a} passengers. At the first stop {b} people get off and {c} people get on. "
     "How many passengers are on the bus now?", lambda a, b, c: a - b + c),
    ("Sam saves {a} dollars each week for {b} weeks. Then he spends {c} dollars on a game. "
     "How many dollars does he have left?", lambda a, b, c: a * b - c),
    ("A garden has {a} red flowers and {b} yellow flowers. Each flower needs {c} cups of water a week. "
     "How many cups of water do the flowers need each week?", lambda a, b, c: (a + b) * c),
)


def make_cases(llm, n_cases: int, seed: int = 0) -> list[Case]:
    """`n_cases` problems; `context` is the prompt length class (the few-shot prompt is short)."""
    cases = []
    for i in range(n_cases):
        rng = random.Random(f"{TASK}/{seed}/{i}")
        template, solve = TEMPLATES[i % len(TEMPLATES)]
        a, b, c = rng.randint(3, 9), rng.randint(3, 9), rng.randint(2, 9)
        if "get off" in template:
            a, b, c = rng.randint(20, 40), rng.randint(2, 9), rng.randint(2, 9)
        problem = template.format(a=a, b=b, c=c)
        cases.append(Case(
            task=TASK, case_id=f"{seed}-{i}", context=0, document=EXAMPLES,
            question=f"Problem: {problem}\nSolution:", answer_prefix=REASONING_PREFIX,
            expected=(str(solve(a, b, c)),), max_tokens=160, stop=("\nProblem:",),
            meta={"problem": problem}))
    return cases


def final_number(text: str) -> str | None:
    said = re.findall(r"answer is\s*\$?(-?\d+)", text)
    numbers = said or re.findall(r"-?\d+", text)
    return numbers[-1] if numbers else None


def score(case: Case, text: str) -> float:
    return float(final_number(text) == case.expected[0])
