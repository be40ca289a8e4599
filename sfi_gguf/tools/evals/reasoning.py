"""Long-context reasoning: a word problem whose three numbers are stated at three places of the
document, solved with chain of thought (the answer comes after ~100 generated tokens).

The question names the subject but none of the numbers, so the reasoning must fetch each of them
from the context while it writes; a worked example comes first as an earlier chat turn after the
document, and the answer starts with "Let's solve it step by step." as in `cot`.
Score: the number after "answer is" (else the last number) equals the answer.
"""
from __future__ import annotations

import dataclasses
import random

from . import common, longdoc
from .common import Case
from .cot import REASONING_PREFIX, final_number
from .needle import ADJECTIVES, NOUNS

TASK = "reasoning"
MAX_TOKENS = 160

#: (three sentences naming a, b, c in this order, the question, the answer, ranges of a, b, c)
TEMPLATES = (
    (("The {name} warehouse received {a} crates of apples on Monday morning.",
      "On Monday afternoon the {name} warehouse received another {b} crates of apples.",
      "On Monday evening {c} crates of apples were shipped out of the {name} warehouse."),
     "The {name} warehouse was empty before Monday. How many crates of apples are in it at the end of Monday?",
     lambda a, b, c: a + b - c, (12, 40), (5, 19), (2, 9)),
    (("The {name} library bought {a} boxes of new books.",
      "Every box that the {name} library bought holds {b} books.",
      "The {name} library gave {c} of the new books to a school."),
     "How many of the new books does the {name} library still have?",
     lambda a, b, c: a * b - c, (3, 9), (4, 9), (2, 9)),
    (("The {name} bus left the depot with {a} passengers.",
      "At its first stop {b} passengers got off the {name} bus.",
      "At its second stop {c} passengers got on the {name} bus."),
     "How many passengers are on the {name} bus after its second stop?",
     lambda a, b, c: a - b + c, (20, 40), (2, 9), (2, 9)),
    (("The {name} club collects {a} dollars from each member.",
      "The {name} club has {b} members.",
      "The {name} club spent {c} dollars on a party."),
     "How many of the collected dollars does the {name} club have left?",
     lambda a, b, c: a * b - c, (4, 9), (3, 9), (2, 9)),
)

INSTRUCTION = 'Solve the problem step by step in plain sentences (no code), then finish with "The answer is N."'

#: a worked example, its numbers outside the templates' ranges, as a user turn and its answer: given inside the
#: question, it was what the models answered (dense decoding too, 0.5B and 1.5B alike), not the document's problem
EXAMPLE = ("A shop had 45 pens, got 23 more and sold 11. How many pens does the shop have now?",
           f"{REASONING_PREFIX} The shop had 45 pens and got 23 more, so 45 + 23 = 68. It sold 11, so 68 - 11 = 57. "
           "The answer is 57.")


def plant(rng: random.Random) -> longdoc.Plant:
    sentences, question, solve, *ranges = TEMPLATES[rng.randrange(len(TEMPLATES))]
    while True:  # three different numbers, so a copied number names its source
        a, b, c = (rng.randint(*r) for r in ranges)
        if len({a, b, c}) == 3 and solve(a, b, c) > 0:
            break
    name = f"{rng.choice(ADJECTIVES).capitalize()} {rng.choice(NOUNS).capitalize()}"
    # early, middle and late in the document: the reasoning reads three far-apart places
    depths = [rng.uniform(0.1, 0.3), rng.uniform(0.4, 0.6), rng.uniform(0.7, 0.9)]
    return longdoc.Plant(
        facts=[(d, s.format(name=name, a=a, b=b, c=c)) for d, s in zip(depths, sentences)],
        question=f"{question.format(name=name)} Use the facts about it stated in the text above. {INSTRUCTION}",
        answer_prefix=REASONING_PREFIX,
        expected=(str(solve(a, b, c)),), max_tokens=MAX_TOKENS,
        meta={"numbers": [a, b, c], "subject": name})


def messages(case: Case) -> list[dict]:
    """The document with the worked example as the first user turn, its answer, then the problem (the document
    opens the prompt as in every long task, so the cached prefill serves them all)."""
    return [{"role": "user", "content": f"{case.document}\n\n{EXAMPLE[0]} {INSTRUCTION}"},
            {"role": "assistant", "content": EXAMPLE[1]},
            {"role": "user", "content": case.question}]


def prompt_tokens(llm, case: Case) -> list[int]:
    if not common.is_chat_model(llm):  # a base model: the example inline, before the question
        inline = f"{EXAMPLE[0]} {EXAMPLE[1]}\n\nQuestion: {case.question}"
        return common.prompt_tokens(llm, dataclasses.replace(case, question=inline))
    return llm.prompt_tokens(messages(case)) + llm.tokenize(case.answer_prefix, add_special=False)


def score(case: Case, text: str) -> float:
    return float(final_number(text) == case.expected[0])
