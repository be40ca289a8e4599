"""Batched SFI: several sequences decode together, one token each per step (server slots, agent swarms).

One llama_context holds up to n_parallel sequences, one KV stream each (each sequence has
its own compact view, selection and exports). Every active sequence has its own stepper (policy,
Selector, view) and sampler. A step

    plans each sequence's next token (slow, dense or fast: `SFIStepper.plan`),
    decodes every sequence's token in one llama_decode, each in its own mode (fast sequences attend
    to their compact views, slow and dense ones to all their cells, the slow ones export),
    and finishes each sequence (the Selector for the slow ones) and samples its next token.

So the weights are read once per step, whatever the mix. A step with one slow sequence among fast ones costs
nearly what one with several costs, so the steppers count the batch's steps (their `clock`), and with
`SFIConfig.refresh_grid` (8 on a GPU) every sequence's slow steps fall on the same steps. Slow sequences whose
exports differ (device candidate counts, Selectors or groups of layers to refresh: short and long contexts) cannot
share a decode: all but one such group decode apart, before the rest; so does a slow sequence that decodes its
fast steps' tokens again with its own (`SFIConfig.redecode_tail`), in a ubatch of its own. `BatchedDecoder` keeps slots that
requests join and leave between steps; `SFILlama.generate_batch` and `sfi-gguf serve --parallel` use it.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

from .library import llama_cpp
from .context import ContextError, LlamaContext, decode_one_per_sequence
from .generate import Completion, Ending, GenerationStats, picks_in_graph, start_generation
from .bindings import SFINative
from .sampling import Sampler

# the kinds of step; a decode's time counts for the first kind in this order among its sequences'
GROUP_ORDER = ("slow", "dense", "fast")
GROUP_MODE = {"slow": SFINative.SLOW, "dense": SFINative.DENSE, "fast": SFINative.FAST}


@dataclass
class Request:
    """One generation in a slot: what to decode, and where its text goes."""

    tokens: Sequence[int]
    sampler: Sampler
    max_tokens: int
    stop: Sequence[str] = ()
    ignore_eos: bool = False
    config: object = None                            # the SFIConfig of this request (None: the model's)
    cancel: threading.Event | None = None            # set: the request ends at the next step (its client left)
    keep_special: frozenset = frozenset()            # control tokens whose text stays in the output
    stopping_criteria: Callable | None = None        # llama-cpp-python's: True ends the request before the token
    on_piece: Callable[[str], None] | None = None   # called with each text piece as it is decoded
    stats: GenerationStats = field(default_factory=GenerationStats)
    out_tokens: list[int] = field(default_factory=list)
    text: list[str] = field(default_factory=list)
    done: bool = False

    def completion(self) -> Completion:
        return Completion(text="".join(self.text), tokens=self.out_tokens, finish_reason=self.stats.finish_reason,
                          stats=self.stats, logprobs=self.sampler.logprobs if self.sampler.n_logprobs is not None else None)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


class _Slot:
    def __init__(self, ctx: LlamaContext):
        self.ctx = ctx
        self.request: Request | None = None
        self.stepper = None
        self.token = -1           # sampled, not decoded yet
        self.ending: Ending | None = None
        self.t_decode = 0.0
        self.last_used = 0        # when it last took a request (BatchedDecoder's count of requests added)


class BatchedDecoder:
    """Slots of one multi-sequence context; requests join (`add`) and leave (when done) between steps.

    make_stepper(ctx, config) returns the stepper of a slot (dense or SFI) for its sequence and the request's
    config (None: the model's); native() the context's
    `SFINative` once SFI is initialised (None before), whose mode the loop sets per group.
    """

    def __init__(self, base: LlamaContext, make_stepper: Callable, native: Callable[[], SFINative | None]):
        self.base = base
        self.make_stepper = make_stepper
        self.slots = [_Slot(base if s == 0 else base.sequence(s)) for s in range(base.n_seq_max)]
        self._batch = llama_cpp.llama_batch_init(base.n_seq_max, 0, 1)
        self.native = native
        self._n_added = 0  # requests added so far (each slot's last_used is one of these)
        self._n_step = 0   # steps decoded so far: every SFI stepper's clock (SFIConfig.refresh_grid)
        self.reset_timing()

    def reset_timing(self) -> None:
        """Zero the step timings (a benchmark reads them per run)."""
        self.t_steps = 0.0
        self.n_steps = 0
        self.t_decode = {kind: 0.0 for kind in GROUP_ORDER}  # llama_decode time, by the decode's first kind
        self.n_decode = {kind: 0 for kind in GROUP_ORDER}    # sequence-steps per kind
        self.n_llama_decode = 0                              # llama_decode calls
        self.n_mixed = 0                                     # ... that held slow and fast sequences

    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        self.slots[0].ctx.set_device_picks(None)  # (the base context stays)
        for slot in self.slots[1:]:
            slot.ctx.close()

    # -- slots ----------------------------------------------------------------------------------
    @property
    def active(self) -> list[_Slot]:
        return [s for s in self.slots if s.request is not None]

    def free_slot(self, tokens: Sequence[int] = ()) -> _Slot | None:
        """A free slot: the one whose sequence holds the longest prefix of `tokens` (a conversation's next turn goes
        where its earlier turns are cached), else the one used least recently (its cache is the least likely to be
        continued)."""
        free = [s for s in self.slots if s.request is None]
        return max(free, key=lambda s: (_common_prefix(s.ctx.tokens, tokens), -s.last_used), default=None)

    def add(self, request: Request, progress: bool = False) -> None:
        """Prefill the request's prompt in a free slot (alone: prompts differ in length; the longest
        prefix the slot's sequence already holds is reused) and sample its first token."""
        slot = self.free_slot(request.tokens)
        if slot is None:
            raise RuntimeError("no free slot")
        if not self.active:
            self._n_step = 0  # an idle batch's clock starts again: the same requests, the same steps and tokens
        self._n_added += 1
        slot.last_used = self._n_added
        if len(request.tokens) >= slot.ctx.n_ctx:
            raise ValueError(f"the prompt has {len(request.tokens)} tokens, a slot holds {slot.ctx.n_ctx} (n_ctx)")
        stepper = self.make_stepper(slot.ctx, request.config)
        if hasattr(stepper, "clock"):  # its refreshes fall on the batch's steps (a dense stepper has none)
            stepper.clock = self._clock
        slot.request = request
        slot.stepper = stepper
        # (a slot keeps its sampler chain between requests that pick alike: attaching or detaching one makes llama.cpp
        # reserve its graphs again)
        slot.ctx.set_device_picks(picks_in_graph(request.sampler, request.stopping_criteria))
        start_generation(slot.stepper, request.tokens, request.sampler, request.stats, progress)
        slot.ending = Ending(request.stop, request.max_tokens, request.ignore_eos, request.stats, request.out_tokens,
                             request.cancel, request.keep_special, request.stopping_criteria)
        slot.t_decode = 0.0
        if slot.ending.reason is not None:  # max_tokens 0
            request.done = True  # the next step() frees the slot
            return
        self._sample(slot)

    def drop(self, request: Request) -> None:
        """Free the slot of a request that failed (e.g. its prefill): its sequence is made consistent again."""
        for slot in self.slots:
            if slot.request is request:
                slot.request = slot.stepper = None
                slot.ctx.sync()

    def clear(self) -> None:
        """Forget every slot's cache: the next prompts are prefilled from scratch (a slot's own `clear` is its
        sequence's alone)."""
        llama_cpp.llama_memory_clear(self.base.memory, True)
        for slot in self.slots:
            slot.ctx.tokens.clear()

    def reset(self) -> None:
        """Abandon every request (after a failed step); the slots are free and consistent again."""
        for slot in self.slots:
            if slot.request is not None:
                self.drop(slot.request)

    # -- the step -------------------------------------------------------------------------------
    def step(self) -> list[Request]:
        """One token for every active slot; returns the requests that ended."""
        for slot in self.active:
            if not slot.request.done and slot.ending.before_step(slot.ctx) is not None:
                slot.request.done = True  # cancelled, or the context is full
        ended = [self._finish(slot) for slot in self.active if slot.request.done]  # (or ended when added)
        t0 = time.perf_counter()
        self._n_step += 1
        planned = [(slot, slot.stepper.plan(slot.token)) for slot in self.active]
        tails = {slot: tail for slot, kind in planned if (tail := self._take_tail(slot, kind))}
        groups = [[(slot, "slow")] for slot in tails] + self._groups([p for p in planned if p[0] not in tails])
        for group in groups:
            t_group = time.perf_counter()
            self._decode(group, tails.get(group[0][0]))
            seconds = time.perf_counter() - t_group
            kinds = {kind for _, kind in group}
            self.t_decode[next(k for k in GROUP_ORDER if k in kinds)] += seconds
            self.n_mixed += {"slow", "fast"} <= kinds
            for slot, kind in group:  # while the decode's logits are there
                self.n_decode[kind] += 1
                slot.stepper.finish(kind, seconds)
                self._sample(slot)
        for slot in self.active:
            if slot.request.done:
                ended.append(self._finish(slot))
        dt = time.perf_counter() - t0
        for slot in self.active:
            slot.t_decode += dt
        self.t_steps += dt
        self.n_steps += bool(planned)
        return ended

    def _clock(self) -> int:
        """The number of the step being planned; 0 while one sequence decodes alone (0 is on every grid: with no
        other sequence to meet, a trigger does not wait)."""
        return self._n_step if len(self.active) > 1 else 0

    @staticmethod
    def _take_tail(slot: _Slot, kind: str) -> list[int]:
        """The tokens the slot's step decodes again before its own (`SFIStepper.take_tail`; none for a dense stepper)."""
        take = getattr(slot.stepper, "take_tail", None)
        return take(kind) if take is not None else []

    @staticmethod
    def _export_key(slot: _Slot) -> tuple:
        native = slot.stepper.native
        selector = tuple(sorted(native.selector.items())) if isinstance(native.selector, dict) else native.selector
        return native.n_candidates, selector, native.refresh_layers

    @classmethod
    def _groups(cls, planned: list[tuple[_Slot, str]]) -> list[list[tuple[_Slot, str]]]:
        """The (slot, kind) pairs of each llama_decode of a step: one for all, unless slow sequences want
        different exports (each must export what it would alone); then the largest such group of slow
        sequences decodes with the dense and fast ones, the others apart, first."""
        by_export: dict[tuple, list[tuple[_Slot, str]]] = {}
        for slot, kind in planned:
            if kind == "slow":
                by_export.setdefault(cls._export_key(slot), []).append((slot, kind))
        if len(by_export) <= 1:
            return [planned] if planned else []
        main = max(by_export.values(), key=len)
        apart = [group for group in by_export.values() if group is not main]
        rest = [(slot, kind) for slot, kind in planned if kind != "slow" or (slot, kind) in main]
        return apart + [rest]

    def _decode(self, group: list[tuple[_Slot, str]], tail: list[int] | None = None) -> None:
        """One llama_decode of the group's tokens. With `tail` the group is one slow sequence that decodes those
        tokens again before its own, all in one ubatch of its own: one pass over its cache (in a llama_decode with
        the others, llama.cpp would split the sequence's tokens into a ubatch of one token with theirs and one of the
        rest, reading its cache twice)."""
        native = self.native()
        if native is not None and native._initialized:
            for slot, kind in group:
                native.set_mode(GROUP_MODE[kind], seq=slot.ctx.seq)
            slow = next((slot for slot, kind in group if kind == "slow"), None)
            if slow is not None:
                native.set_n_candidates(slow.stepper.native.n_candidates)
                native.set_selector(slow.stepper.native.selector)
                native.set_refresh_layers(*slow.stepper.native.refresh_layers)
        if tail:
            (slot, _), = group
            slot.stepper.decode_with_tail(tail, slot.token)
            self.n_llama_decode += 1
            return
        rc = decode_one_per_sequence(self.base.ctx, self._batch,
                                     [(slot.ctx.seq, len(slot.ctx.tokens), slot.token) for slot, _ in group])
        self.n_llama_decode += 1
        if rc != 0:
            kinds = ", ".join(sorted({kind for _, kind in group}))
            raise ContextError(f"llama_decode failed with code {rc} ({len(group)} sequences, {kinds})")
        for i, (slot, _) in enumerate(group):
            slot.ctx.decoded_in_batch(slot.token, i)

    def _sample(self, slot: _Slot) -> None:
        """Sample the slot's next token and emit its text; mark the request done when it ends."""
        request = slot.request
        slot.token = request.sampler.sample(slot.ctx)
        self._emit(request, slot.ending.accept(slot.ctx, slot.token))
        request.done = slot.ending.reason is not None

    def _emit(self, request: Request, piece: str) -> None:
        if piece:
            request.text.append(piece)
            if request.on_piece is not None:
                request.on_piece(piece)

    def _finish(self, slot: _Slot) -> Request:
        request = slot.request
        self._emit(request, slot.ending.tail())
        request.stats.decode_s = slot.t_decode
        request.stats.n_ctx_end = len(slot.ctx.tokens)
        slot.stepper.annotate(request.stats)
        request.sampler.close()
        slot.request = slot.stepper = None
        return request

    def run(self, requests: Sequence[Request], progress: bool = False) -> list[Request]:
        """Every request to its end, n_parallel at a time, a freed slot taking the next request."""
        queue = list(requests)
        while queue or self.active:
            while queue and self.free_slot() is not None:
                self.add(queue.pop(0), progress=progress)
            if self.active:
                self.step()
        return list(requests)

