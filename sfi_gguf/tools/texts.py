"""Natural English text we can ship: the prose of Python's own documentation topics.

`pydoc_data.topics` is part of CPython's standard library (PSF licence), so every installation has
it. We keep its prose paragraphs (no code blocks, grammar rules or headings) for long-context
prompts, haystacks and teacher-forced continuations.
"""
from __future__ import annotations

import random
import re
from functools import lru_cache


@lru_cache(maxsize=1)
def prose_paragraphs() -> tuple[str, ...]:
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        for block in re.split(r"\n\s*\n", topics[name]):
            lines = block.splitlines()
            if not lines or any(line.startswith((" ", "\t")) for line in lines):
                continue  # code, grammar, indented notes
            text = " ".join(line.strip() for line in lines)
            if len(text) < 200 or set(text) <= set("*=-~ ") or "::=" in text:
                continue
            if sum(c.isalpha() or c.isspace() for c in text) < 0.85 * len(text):
                continue  # mostly symbols
            out.append(text)
    return tuple(out)


def text_source() -> str:
    """Names the paragraphs' source: `pydoc_data.topics` differs between Python releases, and so do the texts
    built from it (a benchmark's text on a machine with another Python is another text)."""
    import hashlib

    from pydoc_data.topics import topics

    return f"pydoc_data.topics sha256 {hashlib.sha256(repr(sorted(topics.items())).encode()).hexdigest()[:16]}"


def natural_text(n_chars: int, seed: int = 0) -> str:
    """About n_chars of prose paragraphs (a seeded shuffle; repeats only past ~300K characters)."""
    paragraphs = list(prose_paragraphs())
    rng = random.Random(seed)
    parts: list[str] = []
    total = 0
    while total < n_chars:
        rng.shuffle(paragraphs)
        for p in paragraphs:
            parts.append(p)
            total += len(p) + 2
            if total >= n_chars:
                break
    return "\n\n".join(parts)
