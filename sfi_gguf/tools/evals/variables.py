"""Multi-hop variable tracking: a chain of assignments scattered through the context, resolved hop by hop.

"VAR AAAAA = 12345." then "VAR BBBBB = VAR AAAAA.", "VAR CCCCC = VAR BBBBB." ... at random
depths, plus a distractor chain of the same length with another value. The question asks for the
value of the chain's last variable, and the answer is the chain written out:
"VAR CCCCC = VAR BBBBB = VAR AAAAA = 12345". Each hop means attending to another place in the
context (the assignment of the variable just written).

Why hop by hop: the 0.5B instruct model does not solve RULER's "vt" form densely (list every
variable holding a value: dense found 50% of a 3-hop chain at 2K, 25% at 4K), nor does it write a
whole chain in one go (it stops after the first name, or copies the example), but it looks up one
assignment reliably ("VAR CCCCC =" -> " VAR BBBBB"). So the harness lets the model write one hop at
a time: it generates until "=", ".", or a new line, and if the model wrote a variable it appends
" =" and asks for the next hop, up to n_hops + 2 hops; the model's own answers are chained, so one
wrong hop derails the rest, as in RULER. Every hop is a separate greedy generation on the cached
prompt plus the answer so far (with SFI: a fresh bootstrap from the last 16 query rows, which hold
the variable just written, then fast steps).

The question asks instruct models to "write the chain: VAR CCCCC = VAR ... = number" (without
it the 0.5B model tends to run past the first variable); base models (Gemma 3 270M) copy that hint
literally, so they get the question without it.

Score: 1.0 if the answer ends on the chain's value; else the share of the chain resolved, i.e. the
number of leading hops written correctly (BBBBB, AAAAA) over n_hops + 1 (partial credit).
"""
from __future__ import annotations

import dataclasses
import random
import re
import string
import time

from . import common
from .common import PROMPT_OVERHEAD, Case, haystack, insert_at_depths

TASK = "variables"
STOP = ("=", ".", "\n")
HOP_TOKENS = 8       # max tokens per hop (" VAR ABCDE" is 3-4 tokens, a 5-digit number 2-5)
_ITEM = re.compile(r"\b(?:VAR\s+)?([A-Z]{5})\b|\b(\d{5})\b")


def _name(rng: random.Random, taken: set[str]) -> str:
    while True:
        name = "".join(rng.choice(string.ascii_uppercase) for _ in range(5))
        if name not in taken and name != "VAR":
            taken.add(name)
            return name


def _chain(rng: random.Random, taken: set[str], value: str, n_hops: int) -> list[tuple[str, str]]:
    names = [_name(rng, taken) for _ in range(n_hops + 1)]
    lines = [(names[0], f"VAR {names[0]} = {value}.")]
    for before, name in zip(names, names[1:]):
        lines.append((name, f"VAR {name} = VAR {before}."))
    return lines


@dataclasses.dataclass(frozen=True)
class PlantedChain:
    """A chain of `n_hops` assignments ending on `value` and a distractor chain ending on `other`, each
    assignment at a depth (share of the document; a chain's hops in document order)."""

    names: list[str]   # the chain's variables, the first one assigned the value
    value: str
    other: str
    spots: list[float]  # the chain's depths
    facts: list[tuple[float, str]]  # (depth, sentence) of both chains


def plant_chains(rng: random.Random, n_hops: int) -> PlantedChain:
    taken: set[str] = set()
    value, other = (str(rng.randrange(10_000, 100_000)) for _ in range(2))
    chain = _chain(rng, taken, value, n_hops)
    noise = _chain(rng, taken, other, n_hops)
    spots = sorted(rng.uniform(0.05, 0.95) for _ in chain)
    noise_spots = sorted(rng.uniform(0.05, 0.95) for _ in noise)
    facts = [(d, line) for d, (_, line) in zip(spots, chain)] + [(d, line) for d, (_, line) in zip(noise_spots, noise)]
    return PlantedChain(names=[name for name, _ in chain], value=value, other=other, spots=spots, facts=facts)


def make_cases(llm, context: int, n_cases: int, seed: int = 0, n_hops: int = 2) -> list[Case]:
    """`n_cases` chains of `n_hops` hops (n_hops + 1 variables) in about `context` prompt tokens.

    `expected`: what the answer must name after "VAR <last> =", in order (the n_hops - 1 variables
    in between, the first variable, the value).
    """
    sentences = haystack(llm, context - PROMPT_OVERHEAD, seed=seed + 1000)
    # the format hint helps the instruct model write names; a base model copies it ("VAR ... = number")
    chat = hasattr(llm, "context") and common.is_chat_model(llm)
    cases = []
    for i in range(n_cases):
        planted = plant_chains(random.Random(f"{TASK}/{context}/{seed}/{i}"), n_hops)
        names, value, other, spots = planted.names, planted.value, planted.other, planted.spots
        document, realised = insert_at_depths(sentences, sorted(planted.facts, key=lambda f: f[0]))
        last = names[-1]
        cases.append(Case(
            task=TASK, case_id=f"{context}-{seed}-{i}", context=context, document=document,
            question=f"What is the value of VAR {last}? Follow the assignments in the text above from variable to "
                     "variable until you reach a number" + (f", and write the chain: VAR {last} = VAR ... = number."
                                                            if chat else "."),
            answer_prefix=f"VAR {last} =",
            expected=tuple(names[-2::-1]) + (value,), max_tokens=HOP_TOKENS, stop=STOP,
            meta={"depths": [round(d, 3) for d in spots], "value": value, "distractor_value": other,
                  "names": names}))
    return cases


def items(text: str) -> list[str]:
    """Variable names and 5-digit numbers in `text`, in order ("VAR ABCDE" -> "ABCDE")."""
    return [m.group(1) or m.group(2) for m in _ITEM.finditer(text)]


def score(case: Case, text: str) -> float:
    """1.0 if the answer ends on the chain's value (`text`: what follows "VAR <last> =", e.g.
    " VAR BBBBB = VAR AAAAA = 12345"; the model may also skip the names and write the value); else
    the leading hops written correctly over the chain's length (partial credit for a derailed chain)."""
    got = items(text)
    if got and got[-1] == case.expected[-1]:
        return 1.0
    n = 0
    while n < len(case.expected) and n < len(got) and got[n] == case.expected[n]:
        n += 1
    return n / len(case.expected)


def resolve(llm, case: Case, tokens: list[int]) -> tuple[str, dict]:
    """Let the model write the chain one hop at a time; returns the answer and summed statistics."""
    answer = ""
    n_prompt_decoded = n_generated = 0
    sfi = None
    for hop in range(len(case.expected) + 1):
        hop_tokens = tokens if hop == 0 else common.prompt_tokens(
            llm, dataclasses.replace(case, answer_prefix=case.answer_prefix + answer))
        res = llm.generate(hop_tokens, max_tokens=case.max_tokens, temperature=0, stop=list(case.stop))
        n_prompt_decoded += res.stats.n_prompt_decoded
        n_generated += res.stats.n_generated
        sfi = sfi or res.stats.sfi
        found = items(res.text)
        if not found:  # nothing usable: keep what the model wrote and stop
            answer += res.text
            break
        item = found[0]
        if item.isdigit():
            answer += f" {item}"
            break
        answer += f" VAR {item} ="
    return answer, {"n_prompt_decoded": n_prompt_decoded, "n_generated": n_generated, "sfi": sfi}


def run_case(llm, case: Case, tokens: list[int], configs: dict) -> dict[str, dict]:
    """One record per policy: the chain each policy writes, scored against the true chain."""
    out = {}
    for policy, config in configs.items():
        llm.sfi_config = config
        t0 = time.perf_counter()
        text, stats = resolve(llm, case, tokens)
        out[policy] = {"score": score(case, text), "text": text[:400], **stats,
                       "seconds": round(time.perf_counter() - t0, 2)}
    return out
