"""Trigger policies: which decode steps are slow (dense + attention export + new selection).

Every policy is a small class with one interface, so the decoding loop never asks which one it
has. The loop:
1. builds one with `make_policy(config, pieces)`;
2. when new text starts (a generation, new input), calls `policy.reset(last_prompt_tokens)`; after
   every selection it makes (the bootstrap slow step after prefill if `policy.bootstrap`, any
   re-selection), calls `policy.note_refresh()`;
3. before decoding each generated token, calls `policy.on_token(token)`: True means "decode this
   token with a slow step"; `policy.reason` then says why ("sentence", "interval" or "period").

`memory` tells the loop what a fast step attends to: the Selector's cells (SELECTED), only sink
and recent cells (SINK_RECENT, StreamingLLM-like, never slow), or everything (DENSE, no SFI).
A new policy is a new subclass decorated with `@register_policy`.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Sequence
from enum import Enum
from typing import TYPE_CHECKING, ClassVar

from .boundary import BoundaryDetector, PieceTable

if TYPE_CHECKING:
    from .config import SFIConfig


class MemoryMode(str, Enum):
    """What a fast step attends to."""

    SELECTED = "selected"  # sink + Selector's cells + recent (bootstrap after prefill, refreshes)
    SINK_RECENT = "sink_recent"  # sink + recent only: no selection, no slow step
    DENSE = "dense"  # the whole KV cache: plain decoding


class TriggerPolicy(ABC):
    """Decides, token by token, whether the next decode step is slow."""

    name: ClassVar[str]
    memory: ClassVar[MemoryMode] = MemoryMode.SELECTED

    def __init__(self) -> None:
        self.steps_since_refresh = 0
        self.reason: str | None = None
        self.counts: Counter[str] = Counter()
        """How often each reason fired (and "dropped": sentence triggers inside the minimum gap)."""

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

    def note_refresh(self) -> None:
        """A selection was just made (any cause): restart the step count, keep the sentence state.

        Refreshes asked for by `on_token` are counted already; calling this after them is harmless.
        """
        self.steps_since_refresh = 0

    def on_token(self, token: int) -> bool:
        """`token` is about to be decoded: True if that decode step must be slow."""
        self.steps_since_refresh += 1
        reason = self._trigger(token)
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
    def from_config(cls, config: SFIConfig, pieces: PieceTable | Sequence[bytes | str] | None) -> TriggerPolicy:
        """Build from the config's parameters; `pieces` is the vocabulary, for policies that read text."""
        return cls()

    @classmethod
    def summary(cls) -> str:
        """One line for help texts: the first line of the class docstring."""
        return (cls.__doc__ or cls.name).strip().splitlines()[0]


POLICIES: dict[str, type[TriggerPolicy]] = {}


def register_policy(cls: type[TriggerPolicy]) -> type[TriggerPolicy]:
    """Class decorator: make a policy selectable by its `name` (config, CLI)."""
    POLICIES[cls.name] = cls
    return cls


def policy_names() -> tuple[str, ...]:
    return tuple(POLICIES)


def make_policy(config: SFIConfig, pieces: PieceTable | Sequence[bytes | str] | None = None,
                name: str | None = None) -> TriggerPolicy:
    """The policy named `name` (default: `config.policy`), with the config's parameters.

    `pieces`: the vocabulary (a `PieceTable`, or every token's text in id order); only text-reading
    policies need it. Building a `PieceTable` takes a fraction of a second: share one per model.
    """
    name = config.policy if name is None else name
    if name not in POLICIES:
        raise ValueError(f"unknown trigger policy {name!r}; known: {', '.join(POLICIES)}")
    return POLICIES[name].from_config(config, pieces)


@register_policy
class PunctuationTmaxPolicy(TriggerPolicy):
    """Slow on the first token of each sentence (min gap, cooldown) and at least every T_max steps.

    A sentence ender arms the trigger; the step decoding the first token of the next sentence is
    slow, unless fewer than `min_gap` steps passed since the last refresh (the trigger is then
    dropped). For `cooldown` tokens after a trigger (fired or dropped), sentence enders are ignored,
    so "Yes." or "?!" right after a trigger do not arm another one. Independently, a slow step is
    forced when `refresh_interval` steps passed since the last refresh (reason "interval").
    """

    name = "punctuation"

    def __init__(self, detector: BoundaryDetector, cooldown: int = 2, min_gap: int = 16,
                 refresh_interval: int = 64):
        super().__init__()
        self.detector = detector
        self.cooldown = cooldown
        self.min_gap = min_gap
        self.refresh_interval = refresh_interval
        self._cooldown_left = 0

    @classmethod
    def from_config(cls, config, pieces):
        if pieces is None:
            raise ValueError("the punctuation policy needs the vocabulary's token pieces to find sentence ends")
        table = pieces if isinstance(pieces, PieceTable) else PieceTable(pieces)
        return cls(BoundaryDetector(table), cooldown=config.cooldown, min_gap=config.min_gap,
                   refresh_interval=config.refresh_interval)

    def reset(self, context: Sequence[int] = ()) -> None:
        super().reset(context)
        self.detector.reset()
        self.detector.scan(context)
        self._cooldown_left = 0

    def _trigger(self, token: int) -> str | None:
        opens = self.detector.feed(token)
        if self._cooldown_left:
            self._cooldown_left -= 1
            self.detector.cancel()
            opens = False
        if opens:
            self._cooldown_left = self.cooldown
            if self.steps_since_refresh >= self.min_gap:
                return "sentence"
            self.counts["dropped"] += 1
        if self.steps_since_refresh >= self.refresh_interval:
            return "interval"
        return None


@register_policy
class FixedPeriodPolicy(TriggerPolicy):
    """Slow every `period` steps, whatever the text says (ablation of the sentence trigger)."""

    name = "fixed"

    def __init__(self, period: int = 64):
        super().__init__()
        self.period = period

    @classmethod
    def from_config(cls, config, pieces):
        return cls(period=config.fixed_period)

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
