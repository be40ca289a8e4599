"""Multi-hop in one generation: a chain of variable assignments spread over the document, written
out by the model in one go ("VAR D = VAR C = VAR B = VAR A = 12345"), scored per hop.

The same assignments as `variables` (which lets the model write one hop per generation), with a
distractor chain of another value; here the model writes the whole chain in one generation, so each
hop's lookup is decoded from whatever selection the trigger policy left in place.
"""
from __future__ import annotations

import random

from . import longdoc
from .common import Case
from .variables import items, plant_chains

TASK = "chain"
N_HOPS = 3
TOKENS_PER_HOP = 6      # " VAR ABCDE =" is 4-5 tokens


def plant(rng: random.Random, n_hops: int = N_HOPS) -> longdoc.Plant:
    # the chain in document order (a hop's assignment after the one it names), the distractor anywhere
    planted = plant_chains(rng, n_hops)
    names, value, other = planted.names, planted.value, planted.other
    last = names[-1]
    return longdoc.Plant(
        facts=planted.facts,
        question=(f"What is the value of VAR {last}? Follow the assignments in the text above from variable to "
                  f"variable until you reach a number, and write the whole chain on one line: "
                  f"VAR {last} = VAR ... = number."),
        answer_prefix=f"VAR {last} = VAR",  # names the first hop's kind: unforced, the model gives any number
        expected=tuple(names[-2::-1]) + (value,), max_tokens=TOKENS_PER_HOP * (n_hops + 2), stop=("\n",),
        meta={"names": names, "value": value, "distractor_value": other})




def score(case: Case, text: str) -> float:
    """Per hop: the variables named in order before the first wrong one, plus the value if the
    answer ends on it, over the chain's length (a whole chain written out: 1.0)."""
    got = items(text)
    names, value = case.expected[:-1], case.expected[-1]
    n = 0
    while n < len(names) and n < len(got) and got[n] == names[n]:
        n += 1
    return (n + (bool(got) and got[-1] == value)) / len(case.expected)
