"""Trigger policies: which decode steps are slow (dense + attention export + new selection).

Every policy is a small class with one interface, so the decoding loop never asks which one it
has. The loop:
1. builds one with `make_policy(config, pieces)`;
2. when new text starts (a generation, new input), calls `policy.reset(last_prompt_tokens)`; after
   every selection it makes (the bootstrap slow step after prefill if `policy.bootstrap`, any
   re-selection), calls `policy.note_refresh()`;
3. before decoding each generated token, calls `policy.on_token(token)`: True means "decode this
   token with a slow step"; `policy.reason` then says why ("sentence", "interval", "warmup",
   "confidence" or "period"). A policy whose `reads_confidence` is True is first told, by
   `observe_confidence(p)`, the top-1 probability p of the distribution that produced the token
   (`top1_probability` of the last logits): a stale sparse memory shows as a model that stops being sure.
   The loop may skip that softmax over the vocabulary when `wants_confidence()` is False (the next
   `on_token` would not read it); an observation counts for one `on_token` only.

`memory` tells the loop what a fast step attends to: the Selector's cells (SELECTED), only sink
and recent cells (SINK_RECENT, StreamingLLM-like, never slow), or everything (DENSE, no SFI).

A new policy is a new subclass decorated with `@register_policy`, with a `name` and, if it has
parameters, a `Params` dataclass (a `PolicyParams` subclass: each field with its default and a
docstring) that `from_params` reads. `SFIConfig(policy=name)` then holds its defaults in
`SFIConfig.policy_params`, its fields are keywords of `SFIConfig` and flags of the command line.
"""
from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar

import numpy as np

from .boundary import BoundaryDetector, PieceTable
from .params import Params


class MemoryMode(str, Enum):
    """What a fast step attends to."""

    SELECTED = "selected"  # sink + Selector's cells + recent (bootstrap after prefill, refreshes)
    SINK_RECENT = "sink_recent"  # sink + recent only: no selection, no slow step
    DENSE = "dense"  # the whole KV cache: plain decoding


@dataclass(frozen=True)
class PolicyParams(Params):
    """Parameters of a trigger policy; this base has none (the policies without parameters use it)."""

    @property
    def t_max(self) -> int | None:
        """Most steps between two refreshes that the policy forces by counting (T_max), None if it has no
        such bound; the native tail of fast-step tokens is sized for it."""
        return None


class TriggerPolicy(ABC):
    """Decides, token by token, whether the next decode step is slow."""

    name: ClassVar[str]
    memory: ClassVar[MemoryMode] = MemoryMode.SELECTED
    Params: ClassVar[type[PolicyParams]] = PolicyParams
    """The dataclass of the policy's parameters (its defaults are the policy's defaults)."""
    reads_text: ClassVar[bool] = False
    """Whether `from_params` needs the vocabulary's token pieces."""

    def __init__(self) -> None:
        self.steps_since_refresh = 0
        self.reason: str | None = None
        self.counts: Counter[str] = Counter()
        """How often each reason fired (and "dropped": sentence triggers inside the minimum gap)."""
        self.confidence = 1.0
        """Top-1 probability of the last distribution, when `reads_confidence` (see `observe_confidence`)."""

    @property
    def reads_confidence(self) -> bool:
        """Whether the loop must call `observe_confidence` before each `on_token`."""
        return False

    def observe_confidence(self, top1: float) -> None:
        """The distribution that produced the next `on_token`'s token gave its best token probability `top1`."""
        self.confidence = top1

    def wants_confidence(self) -> bool:
        """Whether the next `on_token` would read an observed confidence (if not, the loop skips a softmax
        over the vocabulary: ~0.4 ms a token on a CPU core, a tenth of a 4B model's fast step on a GPU)."""
        return self.reads_confidence

    @property
    def bootstrap(self) -> bool:
        """Whether a bootstrap slow step (last prompt rows as queries) follows the prefill."""
        return self.memory is MemoryMode.SELECTED

    def reset(self, context: Sequence[int] = ()) -> None:
        """New text (a generation starts, new input arrived): forget all state, start counting again.

        `context`: the last tokens already in the KV cache (e.g. the end of the prompt), read by
        text-reading policies so that a sentence ended by the prompt opens with the first generated
        token; they never trigger anything themselves.
        """
        self.steps_since_refresh = 0
        self.reason = None
        self.confidence = 1.0

    def note_refresh(self) -> None:
        """A selection was just made (any cause): restart the step count, keep the sentence state.

        Refreshes asked for by `on_token` are counted already; calling this after them is harmless.
        """
        self.steps_since_refresh = 0

    def on_token(self, token: int) -> bool:
        """`token` is about to be decoded: True if that decode step must be slow."""
        self.steps_since_refresh += 1
        reason = self._trigger(token)
        self.confidence = 1.0  # an observation counts for this token only
        self.reason = reason
        if reason is None:
            return False
        self.counts[reason] += 1
        self.steps_since_refresh = 0
        return True

    @abstractmethod
    def _trigger(self, token: int) -> str | None:
        """Why the step decoding `token` is slow, or None; `steps_since_refresh` counts this step."""

    @classmethod
    def from_params(cls, params: PolicyParams, pieces: PieceTable | Sequence[bytes | str] | None) -> TriggerPolicy:
        """Build from `params` (a `cls.Params`); `pieces` is the vocabulary, for policies that read text."""
        return cls()

    @classmethod
    def summary(cls) -> str:
        """One line for help texts: the first line of the class docstring."""
        return (cls.__doc__ or cls.name).strip().splitlines()[0]


_top1_scratch = threading.local()  # a buffer per thread: a fast step reads this once per token, 150K+ logits


def top1_probability(logits: np.ndarray) -> float:
    """Probability of the most likely token under softmax(`logits`)."""
    logits = np.asarray(logits, dtype=np.float32).reshape(-1)
    buf = getattr(_top1_scratch, "buf", None)
    if buf is None or buf.shape != logits.shape:
        buf = _top1_scratch.buf = np.empty_like(logits)
    np.subtract(logits, logits.max(), out=buf)
    np.exp(buf, out=buf)
    return float(1.0 / buf.sum())


POLICIES: dict[str, type[TriggerPolicy]] = {}


def register_policy(cls: type[TriggerPolicy]) -> type[TriggerPolicy]:
    """Class decorator: make a policy selectable by its `name` (config, CLI)."""
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, PolicyParams)):
        raise TypeError(f"{cls.__name__}.Params must be a PolicyParams dataclass")
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    return tuple(POLICIES)


def make_policy(config, pieces: PieceTable | Sequence[bytes | str] | None = None,
                name: str | None = None) -> TriggerPolicy:
    """The policy named `name` (default: `config.policy`) of `config` (an `SFIConfig`), with its
    `policy_params` (another policy than the config's: with its default parameters).

    `pieces`: the vocabulary (a `PieceTable`, or every token's text in id order); only text-reading
    policies need it. Building a `PieceTable` takes a fraction of a second: share one per model.
    """
    name = config.policy if name is None else name
    if name not in POLICIES:
        raise ValueError(f"unknown trigger policy {name!r}; known: {', '.join(POLICIES)}")
    cls = POLICIES[name]
    return cls.from_params(config.policy_params if name == config.policy else cls.Params(), pieces)


# -- the policies -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class PunctuationParams(PolicyParams):
    """Parameters of the "punctuation" policy (`PunctuationTmaxPolicy`)."""

    cooldown: int = 2
    """Steps after a sentence trigger during which sentence enders do not arm a new one."""
    min_gap: int = 16
    """Minimum steps between two refreshes; sentence triggers inside the gap are dropped."""
    refresh_interval: int = 64
    """T_max: a slow step is forced when this many steps passed since the last refresh."""
    sentence_offset: int = 0
    """The sentence trigger fires this many tokens after the first token of the new sentence (0: on
    the first token, the paper). Measured, not adopted: 2-3 helped one text and hurt another
    (BENCHMARKS.md, "Trigger placement")."""
    warmup_refresh: int = 8
    """One extra slow step this many steps after the bootstrap selection (0: none). The prompt's
    last rows choose poorly for the first tokens of a continuation (teacher-forced agreement at 4K
    context, k_head 512: BENCHMARKS.md, "Trigger placement")."""
    confidence_floor: float = 0.5
    """Also a slow step (once `min_gap` steps passed since the last refresh) when the last step's
    top-1 probability fell below this (0: never). A stale selection shows as a model that stops
    being sure (same section)."""

    def validate(self) -> None:
        for name in ("cooldown", "min_gap", "sentence_offset", "warmup_refresh"):
            self.need_int(name, 0)
        self.need_int("refresh_interval", 1)
        self.need_real("confidence_floor", 0, 1)

    @property
    def t_max(self) -> int:
        return self.refresh_interval


@register_policy
class PunctuationTmaxPolicy(TriggerPolicy):
    """Slow at sentence starts (min gap, cooldown), when the model turns unsure, at least every T_max steps.

    A sentence ender arms the trigger; the step decoding the token `sentence_offset` tokens after the
    first token of the next sentence is slow (0: the first token itself, as in the paper), unless
    fewer than `min_gap` steps passed since the last refresh when the sentence opened (the trigger is
    then dropped). For `cooldown` tokens after a sentence opens (trigger kept or dropped), sentence
    enders are ignored, so "Yes." or "?!" right after it do not arm another one. Independently, a
    slow step is forced when `refresh_interval` steps passed since the last refresh (reason
    "interval"), `warmup` steps after the first selection of a text (the bootstrap) one more
    (reason "warmup"; 0: none) unless another refresh came first, and, at least `min_gap` steps
    after the last refresh, when the previous step's top-1 probability fell below
    `confidence_floor` (reason "confidence"; 0: never).

    Why the warm-up and the confidence rule (BENCHMARKS.md, "Trigger placement"): the prompt's last
    rows, which the bootstrap reads, choose poorly for the first tokens of a continuation; and a
    selection goes stale when the text turns to context it did not keep, which the fast steps show
    as a model that stops being sure (the top-1 probability drops), long before the next sentence
    or T_max.
    """

    name = "punctuation"
    Params = PunctuationParams
    reads_text = True

    def __init__(self, detector: BoundaryDetector, params: PunctuationParams = PunctuationParams()):
        super().__init__()
        self.detector = detector
        self.params = params
        self.cooldown = params.cooldown
        self.min_gap = params.min_gap
        self.refresh_interval = params.refresh_interval
        self.sentence_offset = params.sentence_offset
        self.warmup = params.warmup_refresh
        self.confidence_floor = params.confidence_floor
        self._cooldown_left = 0
        self._due_in: int | None = None  # steps until an accepted sentence trigger fires
        self._warmup_due = False

    @classmethod
    def from_params(cls, params, pieces):
        if pieces is None:
            raise ValueError("the punctuation policy needs the vocabulary's token pieces to find sentence ends")
        table = pieces if isinstance(pieces, PieceTable) else PieceTable(pieces)
        return cls(BoundaryDetector(table), params)

    @property
    def reads_confidence(self) -> bool:
        return self.confidence_floor > 0

    def wants_confidence(self) -> bool:
        # inside the minimum gap a low confidence triggers nothing
        return self.reads_confidence and self.steps_since_refresh + 1 >= self.min_gap

    def reset(self, context: Sequence[int] = ()) -> None:
        super().reset(context)
        self.detector.reset()
        self.detector.scan(context)
        self._cooldown_left = 0
        self._due_in = None
        self._warmup_due = self.warmup > 0

    def _trigger(self, token: int) -> str | None:
        reason = self._sentence_or_interval(token)
        if reason is None and self._warmup_due and self.steps_since_refresh >= self.warmup:
            reason = "warmup"
        if reason is None and self.confidence < self.confidence_floor and self.steps_since_refresh >= self.min_gap:
            reason = "confidence"
        if reason is not None:
            self._due_in = None
            self._warmup_due = False
        return reason

    def _sentence_or_interval(self, token: int) -> str | None:
        opens = self.detector.feed(token)
        if self._cooldown_left:
            self._cooldown_left -= 1
            self.detector.cancel()
            opens = False
        if opens:
            self._cooldown_left = self.cooldown
            if self.steps_since_refresh >= self.min_gap:
                self._due_in = self.sentence_offset
            else:
                self.counts["dropped"] += 1
        if self._due_in is not None:
            if self._due_in == 0:
                return "sentence"
            self._due_in -= 1
        if self.steps_since_refresh >= self.refresh_interval:
            return "interval"
        return None


@dataclass(frozen=True)
class FixedParams(PolicyParams):
    """Parameters of the "fixed" policy (`FixedPeriodPolicy`)."""

    fixed_period: int = 64
    """Steps between two slow steps (the reference ablation uses the refresh interval)."""

    def validate(self) -> None:
        self.need_int("fixed_period", 1)


@register_policy
class FixedPeriodPolicy(TriggerPolicy):
    """Slow every `fixed_period` steps, whatever the text says (ablation of the sentence trigger)."""

    name = "fixed"
    Params = FixedParams

    def __init__(self, params: FixedParams = FixedParams()):
        super().__init__()
        self.params = params
        self.period = params.fixed_period

    @classmethod
    def from_params(cls, params, pieces):
        return cls(params)

    def _trigger(self, token: int) -> str | None:
        return "period" if self.steps_since_refresh >= self.period else None


@register_policy
class StaticPolicy(TriggerPolicy):
    """Bootstrap selection after prefill, never refreshed (static sparse memory)."""

    name = "static"

    def _trigger(self, token: int) -> str | None:
        return None


@register_policy
class SinkRecentPolicy(TriggerPolicy):
    """Sink and recent cells only, no selection and no slow step (StreamingLLM-like)."""

    name = "sink_recent"
    memory = MemoryMode.SINK_RECENT

    def _trigger(self, token: int) -> str | None:
        return None


@register_policy
class DensePolicy(TriggerPolicy):
    """Full KV cache at every step: plain decoding, the reference for quality and speed."""

    name = "dense"
    memory = MemoryMode.DENSE

    def _trigger(self, token: int) -> str | None:
        return None
