"""Sentence boundaries from token text, for any GGUF vocabulary.

SFI fires its slow steps on the first token of a new sentence. The authors' code matches a
hard-coded list of Qwen3 token ids; we decode what every token *says* instead, so byte-level BPE,
SentencePiece and any other vocabulary work unchanged.

Two pieces, two jobs:
- `PieceTable` classifies every token piece of a vocabulary once (vectorised: ~260K pieces in a
  fraction of a second), so that decoding pays one list lookup per token.
- `BoundaryDetector` is fed the decoded tokens one at a time and says which token opens a sentence.

A sentence ends at `.` `?` `!` `…` (and runs of them, optionally followed by closing quotes or
brackets, optionally followed by whitespace in the same token) or at `。` `？` `！` `｡`. The next
sentence starts at the first following token that is neither whitespace nor punctuation. Because
that token is needed anyway, the detector can look at it before confirming the boundary, which
removes false boundaries the token stream makes visible:
- an ASCII ender directly followed by a digit or letter, with no space: "3.14", "config.py",
  "v1.2", "a?.b", "Loading...done";
- `.` closing a known abbreviation ("e.g.", "i.e.", "Mr.", "Dr.", "etc.", initials like "J.");
- an ASCII ender followed by a word in lowercase ("e.g. this", "well... maybe", "x ? y : z").
CJK enders end a sentence wherever they stand (no spaces in CJK text). A boundary in the middle
of one token that goes on with text (". The" as one piece) is not seen; neither of the default
vocabularies has such a token.
"""
from __future__ import annotations

import re
from collections import deque
from collections.abc import Iterable, Sequence
from enum import IntEnum

import numpy as np

#: Characters that end a sentence. The ASCII ones (and the ellipsis) need whitespace after them.
ASCII_ENDERS = ".?!…"
CJK_ENDERS = "。？！｡"
#: Closing quotes and brackets that may follow an ender and still belong to the ending sentence.
CLOSERS = "\"')]}*”’»」』）】》〉"
_WHITESPACE_BYTES = b" \t\n\r\x0b\x0c"
_WHITESPACE = _WHITESPACE_BYTES.decode()
_OPENERS = "([{\"'“‘«「『（【《〈*"

#: Words that a "." follows without ending a sentence (compared in lowercase, without the dot).
#: Single letters (initials like "J. K. Rowling", list markers like "a.") count as well.
DEFAULT_ABBREVIATIONS = frozenset({
    "e.g", "i.e", "etc", "cf", "vs", "viz", "al", "approx", "fig", "eq", "ref", "sec", "vol",
    "mr", "mrs", "ms", "dr", "prof", "st", "jr", "sr", "gen", "sen", "rep", "gov", "lt", "col", "sgt",
})


class Ending(IntEnum):
    """How a piece ends, as far as sentences are concerned."""

    NONE = 0
    PERIOD = 1  # one ".": abbreviations, decimals and identifiers are checked
    ASCII = 2  # "?", "!", "...", "…" (and mixtures): need a space/newline after them
    CJK = 3  # "。" "？" "！" "｡": end a sentence wherever they stand


class Start(IntEnum):
    """What the first character of a piece is (before any stripping)."""

    EMPTY = 0
    SPACE = 1
    DIGIT = 2
    LETTER = 3  # letters of any script and "_"
    ENDER = 4
    CLOSER = 5
    OTHER = 6  # other punctuation, symbols, incomplete UTF-8


# Bit layout of a piece's flags: one int per token, read by the detector with a list lookup.
_EMPTY = 1  # no text at all (control tokens)
_BLANK = 2  # whitespace only
_STARTS_SPACE = 4  # first byte is whitespace
_PUNCT_ONLY = 8  # only enders, closers and whitespace (neither starts a sentence nor cancels one)
_LOWER_START = 16  # first non-whitespace character is a lowercase letter
_ENDS_SPACE = 32  # last byte is whitespace
_ENDING_SHIFT = 6  # Ending in bits 6-7

_ENDING_RE = re.compile(
    f"([{re.escape(ASCII_ENDERS + CJK_ENDERS)}]+)[{re.escape(CLOSERS)}]*[{re.escape(_WHITESPACE)}]*\\Z")
# UTF-8 of the non-ASCII enders: pieces holding one are analysed in detail
_MULTIBYTE_ENDERS = tuple(c.encode() for c in "…" + CJK_ENDERS)


class PieceTable:
    """Per-vocabulary classification of token pieces, computed once.

    `pieces[i]` is the text of token i as llama.cpp renders it (`token_to_piece`, bytes or str;
    control tokens render as empty). Building is vectorised with numpy over the concatenated bytes:
    only the few thousand pieces that contain an ender, or start with punctuation, get a
    per-piece regular expression.
    """

    def __init__(self, pieces: Sequence[bytes | str]):
        data = list(pieces)
        try:
            self._buffer = b"".join(data)  # fast path: all bytes
        except TypeError:
            data = [p.encode("utf-8") if isinstance(p, str) else bytes(p) for p in data]
            self._buffer = b"".join(data)
        n = len(data)
        lengths = np.fromiter(map(len, data), dtype=np.int64, count=n)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        self._offsets = np.concatenate([[0], ends]).tolist()
        buf = np.frombuffer(self._buffer + b"\0\0\0\0", dtype=np.uint8)  # padded: code points read ahead

        ws_table = np.zeros(256, dtype=bool)
        ws_table[list(_WHITESPACE_BYTES)] = True
        is_ws = ws_table[buf]
        empty = lengths == 0
        # first non-whitespace byte of each piece (padding bytes are non-whitespace, so always found)
        positions = np.arange(len(buf), dtype=np.int64)
        next_non_ws = np.minimum.accumulate(np.where(is_ws, len(buf), positions)[::-1])[::-1]
        first_non_ws = next_non_ws[starts]
        blank = ~empty & (first_non_ws >= ends)
        starts_space = ~empty & is_ws[starts]
        ends_space = ~empty & is_ws[np.maximum(ends - 1, 0)]

        first_class, _ = _classify_code_points(_code_points_at(buf, starts, ends))
        first_class[empty] = Start.EMPTY
        first_class[starts_space] = Start.SPACE
        word_class, word_lower = _classify_code_points(_code_points_at(buf, first_non_ws, ends))
        lower_start = ~blank & ~empty & word_lower

        ending = np.zeros(n, dtype=np.int64)
        punct_only = np.zeros(n, dtype=bool)
        self._period_bodies: dict[int, str] = {}
        detailed = np.flatnonzero(~blank & ~empty & np.isin(word_class, (Start.ENDER, Start.CLOSER)))
        detailed = np.union1d(detailed, _pieces_holding_enders(buf[:len(self._buffer)], ends))
        strip_chars = _WHITESPACE + ASCII_ENDERS + CJK_ENDERS + CLOSERS
        for token in detailed.tolist():
            text = self.piece(token).decode("utf-8", errors="replace")
            word = text.lstrip(_WHITESPACE)
            if not word:
                continue
            # ' "' after a sentence is an opening quote, so it opens the next sentence
            punct_only[token] = not text.strip(strip_chars) and not (word != text and word[0] in CLOSERS)
            match = _ENDING_RE.search(text)
            if match is None:
                continue
            enders = match.group(1)
            if any(c in CJK_ENDERS for c in enders):
                ending[token] = Ending.CJK
            elif enders == ".":
                ending[token] = Ending.PERIOD
                self._period_bodies[token] = text[:match.start()]
            else:
                ending[token] = Ending.ASCII

        flags = (empty * _EMPTY | blank * _BLANK | starts_space * _STARTS_SPACE | punct_only * _PUNCT_ONLY
                 | lower_start * _LOWER_START | ends_space * _ENDS_SPACE | (ending << _ENDING_SHIFT))
        self.flags: list[int] = flags.astype(np.int64).tolist()
        """Per token: the bit flags the detector reads (one list lookup per decoded token)."""
        self.start = first_class.astype(np.uint8)
        """Per token: `Start` class of its first character."""
        self.ending = ending.astype(np.uint8)
        """Per token: `Ending` of its text."""

    def __len__(self) -> int:
        return len(self.flags)

    def piece(self, token: int) -> bytes:
        """The text of `token`, as given."""
        return self._buffer[self._offsets[token]:self._offsets[token + 1]]

    def period_body(self, token: int) -> str:
        """Text of a piece before its final "." (only for pieces whose ending is `Ending.PERIOD`)."""
        return self._period_bodies.get(token, "")

    def is_blank(self, token: int) -> bool:
        return bool(self.flags[token] & _BLANK)

    def is_punctuation_only(self, token: int) -> bool:
        return bool(self.flags[token] & _PUNCT_ONLY)

    def starts_lowercase(self, token: int) -> bool:
        return bool(self.flags[token] & _LOWER_START)


class BoundaryDetector:
    """Fed decoded tokens one at a time; says which token is the first of a new sentence.

    States: idle; *pending* (an ASCII ender was seen with nothing after it yet: the next piece
    confirms it with whitespace or cancels it with a digit, letter or other symbol); *armed* (the
    boundary is confirmed; the next piece that is not whitespace or punctuation opens the sentence,
    unless it starts with a lowercase letter after an ASCII ender).
    """

    _IDLE, _PENDING, _ARMED = 0, 1, 2

    def __init__(self, table: PieceTable, abbreviations: Iterable[str] = DEFAULT_ABBREVIATIONS,
                 context_tokens: int = 6):
        self.table = table
        self.abbreviations = frozenset(a.lower().rstrip(".") for a in abbreviations)
        self._flags = table.flags
        self._tail: deque[int] = deque(maxlen=context_tokens)  # recent tokens, for the word before a "."
        self._state = self._IDLE
        self._kind = Ending.NONE

    @classmethod
    def from_pieces(cls, pieces: Sequence[bytes | str], **kwargs) -> BoundaryDetector:
        return cls(PieceTable(pieces), **kwargs)

    def reset(self) -> None:
        """Forget everything (new text)."""
        self._state = self._IDLE
        self._kind = Ending.NONE
        self._tail.clear()

    def cancel(self) -> None:
        """Forget a pending or armed sentence end (the text before it is kept for abbreviations)."""
        self._state = self._IDLE

    @property
    def pending(self) -> bool:
        """True while a sentence end was seen and the next sentence has not started yet."""
        return self._state != self._IDLE

    def feed(self, token: int) -> bool:
        """Take the next decoded token; True if it is the first token of a new sentence."""
        flags = self._flags[token]
        if flags & _EMPTY:
            return False
        opens = False
        state = self._state
        if state == self._PENDING:
            if flags & _STARTS_SPACE:
                state = self._ARMED
            elif not flags & _PUNCT_ONLY:
                state = self._IDLE  # "3.14", "config.py", "!=": text goes on without a space
        if state == self._ARMED and not flags & (_BLANK | _PUNCT_ONLY):
            opens = self._kind == Ending.CJK or not flags & _LOWER_START
            state = self._IDLE
        ending = flags >> _ENDING_SHIFT
        if ending:
            if ending == Ending.PERIOD and self._closes_abbreviation(token):
                state = self._IDLE
            else:
                state = self._ARMED if (ending == Ending.CJK or flags & _ENDS_SPACE) else self._PENDING
                self._kind = Ending(ending)
        elif state == self._PENDING and flags & _ENDS_SPACE:
            state = self._ARMED  # closing quote/bracket then whitespace: '."\n'
        self._state = state
        self._tail.append(token)
        return opens

    def scan(self, tokens: Iterable[int]) -> list[int]:
        """Indices (into `tokens`) of the tokens that open a sentence, continuing the current state."""
        return [i for i, token in enumerate(tokens) if self.feed(token)]

    def _closes_abbreviation(self, token: int) -> bool:
        body = self.table.period_body(token)
        if not any(c in _WHITESPACE for c in body):
            before = b"".join(self.table.piece(t) for t in self._tail)
            body = before.decode("utf-8", errors="replace") + body
        words = body.split()
        if not words or body[-1] in _WHITESPACE:
            return False
        word = words[-1].lstrip(_OPENERS).lower()
        return word in self.abbreviations or (len(word) == 1 and word.isalpha())


# -- vectorised helpers ----------------------------------------------------------------------------
def _code_points_at(buf: np.ndarray, pos: np.ndarray, limit: np.ndarray) -> np.ndarray:
    """Unicode code point of the UTF-8 character at each `pos` (-1 where none or incomplete before `limit`)."""
    pos = np.minimum(pos, len(buf) - 4)
    b0, b1, b2, b3 = (buf[pos + i].astype(np.int64) for i in range(4))
    size = np.select([b0 < 0x80, (b0 & 0xE0) == 0xC0, (b0 & 0xF0) == 0xE0, (b0 & 0xF8) == 0xF0], [1, 2, 3, 4], 0)
    cont = [(b & 0xC0) == 0x80 for b in (b1, b2, b3)]
    valid = (size > 0) & (pos + size <= limit)
    valid &= (size < 2) | cont[0]
    valid &= (size < 3) | cont[1]
    valid &= (size < 4) | cont[2]
    cp = np.select(
        [size == 1, size == 2, size == 3, size == 4],
        [b0, ((b0 & 0x1F) << 6) | (b1 & 0x3F), ((b0 & 0x0F) << 12) | ((b1 & 0x3F) << 6) | (b2 & 0x3F),
         ((b0 & 0x07) << 18) | ((b1 & 0x3F) << 12) | ((b2 & 0x3F) << 6) | (b3 & 0x3F)], -1)
    return np.where(valid, cp, -1)


def _classify_code_points(cps: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`Start` class and is-lowercase of each code point; Python runs once per distinct code point."""
    unique, inverse = np.unique(cps, return_inverse=True)
    classes = np.empty(len(unique), dtype=np.int64)
    lower = np.zeros(len(unique), dtype=bool)
    for i, cp in enumerate(unique.tolist()):
        if cp < 0:
            classes[i] = Start.OTHER
            continue
        c = chr(cp)
        lower[i] = c.islower()  # also the odd non-letter with a case, like "ⓒ"
        if c in _WHITESPACE:
            classes[i] = Start.SPACE
        elif c.isdigit():
            classes[i] = Start.DIGIT
        elif c.isalpha() or c == "_":
            classes[i] = Start.LETTER
        elif c in ASCII_ENDERS or c in CJK_ENDERS:
            classes[i] = Start.ENDER
        elif c in CLOSERS:
            classes[i] = Start.CLOSER
        else:
            classes[i] = Start.OTHER
    inverse = inverse.reshape(cps.shape)
    return classes[inverse], lower[inverse]


def _pieces_holding_enders(buf: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Indices of the pieces whose bytes contain an ender character."""
    hits = [np.flatnonzero((buf == ord(".")) | (buf == ord("?")) | (buf == ord("!")))]
    for seq in _MULTIBYTE_ENDERS:
        mask = buf[:len(buf) - len(seq) + 1] == seq[0]
        for i in range(1, len(seq)):
            mask &= buf[i:len(buf) - len(seq) + 1 + i] == seq[i]
        hits.append(np.flatnonzero(mask))
    positions = np.concatenate(hits)
    return np.unique(np.searchsorted(ends, positions, side="right"))
