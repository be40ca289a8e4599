"""What every evaluation task shares: the `Case` record, haystacks of natural text cut to a token
length with facts inserted at chosen depths, and turning a case into prompt tokens for chat
(instruct) and base models alike.

Haystacks come from `sfi_gguf.tools.texts` (Python's documentation prose, shippable). The cases of one
context length share one haystack, so consecutive cases share a long cached prefix (everything
before the shallowest inserted fact) and the runner's prefix reuse skips re-prefilling it.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

from ..texts import natural_text

#: tokens left between the haystack and the context length for the question, template and answer
PROMPT_OVERHEAD = 160


@dataclass(frozen=True)
class Case:
    """One evaluation item: a document, a question about it, and what a right answer contains."""

    task: str
    case_id: str                 # unique inside (task, context); seeds make it reproducible
    context: int                 # nominal context length in tokens (the prompt is at most this)
    document: str                # the long text (haystack with inserted facts, or few-shot examples)
    question: str
    answer_prefix: str = ""      # the start of the answer, forced (keeps answers short and scorable)
    expected: tuple[str, ...] = ()
    max_tokens: int = 16
    stop: tuple[str, ...] = ("\n",)
    meta: dict = field(default_factory=dict)


def _sentences(text: str) -> list[str]:
    return re.split(r"(?<=[.!?])\s+", text)


def haystack(llm, n_tokens: int, seed: int = 0) -> list[str]:
    """Sentences of natural prose whose text is about `n_tokens` tokens long (the model's tokenizer)."""
    text = natural_text(int(n_tokens * 5.5) + 2000, seed=seed)
    out: list[str] = []
    total = 0
    for paragraph in text.split("\n\n"):
        for sentence in _sentences(paragraph):
            cost = len(llm.tokenize(sentence, add_special=False)) + 1
            if total + cost > n_tokens:
                return out
            out.append(sentence)
            total += cost
        if out:
            out[-1] += "\n\n"
    return out


def insert_at_depths(sentences: list[str], facts: list[tuple[float, str]]) -> tuple[str, list[float]]:
    """Join `sentences` with each fact inserted as a sentence at its depth (share of the characters).

    Returns the text and the realised depths. Facts at equal depth keep their order.
    """
    lengths = [len(s) + 1 for s in sentences]
    total = max(sum(lengths), 1)
    starts, acc = [], 0
    for n in lengths:
        starts.append(acc)
        acc += n
    slots: dict[int, list[str]] = {}
    realised = []
    for depth, fact in facts:
        index = min(range(len(starts) + 1), key=lambda i: abs((starts[i] if i < len(starts) else total) - depth * total))
        slots.setdefault(index, []).append(fact)
        realised.append((starts[index] if index < len(starts) else total) / total)
    parts: list[str] = []
    for i, sentence in enumerate(sentences + [""]):
        parts.extend(slots.get(i, []))
        if sentence:
            parts.append(sentence)
    text = " ".join(parts).replace("\n\n ", "\n\n")
    return text, realised


def is_chat_model(llm) -> bool:
    return llm.context.chat_template() is not None


def prompt_tokens(llm, case: Case) -> list[int]:
    """The case as tokens: the chat template for instruct models (document and question as the user
    turn, the answer prefix as the start of the assistant turn), plain text for base models."""
    if is_chat_model(llm):
        tokens = llm.prompt_tokens([{"role": "user", "content": f"{case.document}\n\n{case.question}"}])
        if case.answer_prefix:
            tokens += llm.tokenize(case.answer_prefix, add_special=False)
        return tokens
    prefix = f" {case.answer_prefix}" if case.answer_prefix else ""
    return llm.tokenize(f"{case.document}\n\nQuestion: {case.question}\nAnswer:{prefix}")
