"""Steppers: how each decode step attends. `Stepper` is their interface; `SFIStepper` decides which steps are
slow, fast or dense, and the refreshes.

`SFIStepper` plugs into the generation loop (`generate.run_generation`) in place of the dense
stepper. It owns the native compact view (`bindings.SFINative`), the trigger policy and the Selector:

    prefill (dense) -> bootstrap slow step over the last prompt rows -> Selector -> selection
    -> fast steps (compact view: selection + tail) -> slow step when the policy fires -> ...

The stepper reads a resolved `plan.SFIPlan` (budget, execution options, the policy and Selector it was
given). A slow step is an exact dense step that also exports attention mass; the Selector turns the export
into the next selection (with `SFIConfig.device_selector` the slow step runs the Selector in its own
graph and exports only the selection). Policies whose memory needs no evidence (sink+recent, or a static
selection whose tail fills up) refresh cheaply: the same cells, a new recent window, no slow step.
"""
from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from .bindings import DeviceSelection, SFINative
from .context import LlamaContext
from .generate import GenerationStats
from .plan import SFIPlan
from .policy import MemoryMode, TriggerPolicy
from .selector import AttentionExport, CandidateRange, DeviceSelectorParams, Selector

# while an asynchronous refresh's export computes on the CPU (async_refresh), single-token decodes keep this many of
# the context's threads (a fast step's host part, its token's K/V written to the host cache, is small) and the export
# takes the others: OpenMP teams that share cores wait for each other's descheduled threads at every barrier
DECODE_THREADS_DURING_REFRESH = 4


def _cells_and_positions(positions: np.ndarray, n_cells: int, cells: np.ndarray | None) -> dict:
    """AttentionExport's keywords for an export of n_cells columns: the candidates' cells, or none (column i is cell i)."""
    if cells is None:
        return {"positions": positions[:n_cells]}
    return {"positions": positions, "cells": cells}


@runtime_checkable
class Stepper(Protocol):
    """How the decode steps of one sequence attend: the interface the token loop (`generate.run_generation`, the
    batched loop) drives, and the benchmark tools with it.

    `generate.DenseStepper` (every step reads the whole cache) and `SFIStepper` (slow, fast and dense steps)
    implement it. `SFILlama.stepper(config)` gives one for a model's context.
    """

    ctx: LlamaContext  # the sequence it decodes into
    mode: str          # "dense" or "sfi", as GenerationStats.mode reports it

    def prefill(self, tokens: Sequence[int], progress: bool = False) -> int:
        """Bring the cache to exactly `tokens` (its cached prefix reused); the last token's logits are ready to
        sample. Returns how many tokens were decoded."""

    def step(self, token: int) -> None:
        """Decode `token` after the cache's tokens: `plan`, the decode, `finish`, for a loop of one sequence."""

    def plan(self, token: int) -> str:
        """Everything before decoding `token`: the kind of step ("dense", "slow" or "fast"), its mode set."""

    def finish(self, kind: str, seconds: float) -> None:
        """Everything after the decode of a step of `kind` that took `seconds`."""

    def annotate(self, stats: GenerationStats) -> None:
        """Put the stepper's own statistics into a generation's, at its end (SFIStepper: `stats.sfi`)."""


@dataclass
class SFIStats:
    """Per-generation SFI statistics (times in seconds)."""

    policy: str = ""
    selector: str = ""
    k_head: int = 0
    budget: int = 0                 # cells a fast step reads right after a refresh (sink + k_head + recent)
    n_dense: int = 0                # steps decoded densely (context below the SFI threshold, or policy dense)
    n_fast: int = 0
    n_slow: int = 0                 # slow steps during generation (the bootstrap is counted apart)
    n_bootstrap: int = 0
    n_cheap_refresh: int = 0        # new recent window without a slow step
    n_fell_back: int = 0            # fast steps that ran dense because the view was not valid
    n_redecoded: int = 0            # fast steps' tokens decoded again by slow steps (redecode_tail)
    refresh_overlap: list[float] = field(default_factory=list)  # per slow-step refresh
    slow_steps: list[int] = field(default_factory=list)          # generated-token index of each slow step
    reasons: dict[str, int] = field(default_factory=dict)
    t_dense: float = 0.0
    t_fast: float = 0.0
    t_slow: float = 0.0
    t_selector: float = 0.0         # on the decoding thread
    t_selector_background: float = 0.0  # Selector runs overlapped with fast steps (selection_delay > 0)
    n_async: int = 0                # selections computed in the background (selection_delay > 0, async_refresh)
    n_host_refresh: int = 0         # refreshes computed on the CPU over a host cache while fast steps ran (async_refresh)
    t_host_export: float = 0.0      # of t_selector_background, their exports over the host cache (the rest: Selector)
    t_refresh_wait: float = 0.0     # of t_selector, the decoding thread waiting for a background selection
    t_fast_after_load: float = 0.0  # of t_fast, the first fast step after each background selection's load (it
    #                                 gathers the new memory into the view)
    n_refresh_skipped: int = 0      # triggers that came while such a refresh was still computed
    n_held_steps: int = 0           # fast steps decoded while a trigger waited for the refresh grid (refresh_grid)
    n_device_selections: int = 0    # refreshes whose Selector ran in the slow step's graph
    n_group_refresh: int = 0        # of them, refreshes of one group of layers (refresh_layer_groups)

    @property
    def mean_overlap(self) -> float:
        return float(np.mean(self.refresh_overlap)) if self.refresh_overlap else float("nan")


def format_sfi_stats(s: SFIStats) -> str:
    """One block of text for an SFIStats (`sfi-gguf run`, `chat --stats`)."""
    steps = s.n_fast + s.n_slow + s.n_dense
    if not s.k_head and not s.n_fast:
        return (f"SFI: policy {s.policy}: the context stayed below sink + k_head + recent, "
                f"all {steps} steps dense ({s.t_dense:.2f} s)")
    lines = [f"SFI: policy {s.policy}, selector {s.selector}, k_head {s.k_head}, memory {s.budget} cells/head "
             f"after a refresh",
             f"  steps: {s.n_fast} fast, {s.n_slow} slow (+{s.n_bootstrap} bootstrap), {s.n_dense} dense"
             + (f", {s.n_fell_back} fell back to dense" if s.n_fell_back else "")
             + (f", {s.n_cheap_refresh} recent-window refreshes" if s.n_cheap_refresh else "")
             + (f", {s.n_held_steps} fast while a trigger waited for the refresh grid" if s.n_held_steps else ""),
             f"  slow-step reasons: {s.reasons or '-'}; mean refresh overlap {s.mean_overlap:.2f}",
             f"  time: fast {s.t_fast:.2f} s, slow {s.t_slow:.2f} s, selector {s.t_selector:.2f} s, "
             f"dense {s.t_dense:.2f} s ({steps} steps)"]
    return "\n".join(lines)


class SFIStepper:
    """Decodes tokens with Slow-Fast Inference on one context (sequence 0)."""

    mode = "sfi"

    def __init__(self, ctx: LlamaContext, native: SFINative, plan: SFIPlan, policy: TriggerPolicy,
                 selector: Selector):
        """plan: the context's (`SFIEngine.plan`); policy and selector: fresh ones, built by the plan."""
        self.ctx = ctx
        self.native = native
        self.sfi_plan = plan
        self.budget = plan.budget
        self.options = plan.options
        self.policy = policy
        self.selector = selector
        self.stats = SFIStats(policy=policy.name, selector=selector.name)
        self._sparse = False            # a selection is loaded and FAST is the mode
        self._selected: np.ndarray | DeviceSelection | None = None  # last Selector output [L, H, k] (cells)
        self._overlap_pending = False   # the last load's overlap with the one before is still to be read
        self._tail = 0                  # tokens appended by fast steps since the last selection
        self._n_step = 0
        self._n_candidates = None       # what the native side was last told (set_n_candidates)
        self._pending: Future | None = None  # a background Selector run (selection_delay > 0)
        # the range the loaded selection was chosen from: its recent window starts at its stop
        self._memory_range: CandidateRange | None = None
        self._load_at = 0               # ... loaded before decoding this step
        self._executor: ThreadPoolExecutor | None = None
        self._top1: float | None = None   # top-1 probability of the last step's logits (see _note_logits)
        self._reason: str | None = None   # why the planned slow step fires
        self._capturing = False           # the planned fast step keeps its queries for an asynchronous refresh
        self._lent_threads = False        # ... and its refresh computes on threads the context lent
        self._loaded_in_background = False  # a background selection was loaded since the last fast step
        self._held: str | None = None     # the reason of a trigger waiting for the refresh grid's next step
        self._waited = 0                  # ... the steps it has waited
        self.clock: Callable[[], int] = lambda: self._n_step
        """The number of the step being planned, which `refresh_grid` reads: the generation's own steps, or a
        batch's (`BatchedDecoder`), whose sequences then refresh on the same steps."""

    def _wants_sparse(self, n_context: int) -> bool:
        return self.policy.memory is not MemoryMode.DENSE and not self.sfi_plan.stays_dense(n_context)

    # -- the loop's interface ---------------------------------------------------------------------
    def prefill(self, tokens, progress: bool = False) -> int:
        """Dense prefill; then the bootstrap selection (last prompt rows as slow-step queries)."""
        self._drop_pending()
        self._sparse = False
        self._selected = None
        self._held, self._waited = None, 0
        self.native.set_mode(SFINative.DENSE)
        self.policy.reset(context=tokens[-8:])
        n = len(tokens)
        self._top1 = None
        # the prompt's last n_prefill_queries tokens are its final decode, on their own, fresh or served from
        # the cache (LlamaContext.prefill): the same prompt splits the same way on every path, and that decode
        # is the bootstrap slow step, its tokens the query rows of the export
        last_chunk = self.options.n_prefill_queries
        if not self._wants_sparse(n):
            return self.ctx.prefill(tokens, progress=progress, last_chunk=last_chunk)
        if self.policy.memory is MemoryMode.SINK_RECENT:
            decoded = self.ctx.prefill(tokens, progress=progress, last_chunk=last_chunk)
            self._load_memory(self._no_selection())
            self._note_logits()
            return decoded
        self._n_prompt = n
        decoded = self.ctx.prefill(tokens, progress=progress, before_last_chunk=self._begin_bootstrap,
                                   last_chunk=last_chunk)
        self.stats.t_slow += time.perf_counter() - self._t_bootstrap
        self.stats.n_bootstrap += 1
        self._refresh_from_export()
        self._note_logits()
        return decoded

    def step(self, token: int) -> None:
        kind = self.plan(token)
        t0 = time.perf_counter()
        tail = self.take_tail(kind)
        if tail:
            self.decode_with_tail(tail, token)
        else:
            self.ctx.decode_one(token)
        self.finish(kind, time.perf_counter() - t0)

    def take_tail(self, kind: str) -> list[int]:
        """The tokens a step of `kind` decodes again before its own, removed from the cache here: with
        `redecode_tail`, a slow step's are the fast steps' tokens since the last refresh (their cells then hold
        dense KV, which every later step reads); otherwise none."""
        if kind != "slow" or not self.options.redecode_tail or not self._tail:
            return []
        n = len(self.ctx.tokens)
        n_keep = n - min(self._tail, n - 1)
        tail = self.ctx.tokens[n_keep:]
        self.ctx.truncate(n_keep)
        self.stats.n_redecoded += len(tail)
        return tail

    def decode_with_tail(self, tail: list[int], token: int) -> None:
        """The slow step of `redecode_tail`: `tail` and `token` in one ubatch (one pass over the cache), whose
        export is `token`'s row alone, so that the selection is the one it would be without the option."""
        self.native.set_n_query_rows(1)
        try:
            self.ctx.prefill(self.ctx.tokens + tail + [token])
        finally:
            self.native.set_n_query_rows(self.native.params["n_query_rows"])

    def plan(self, token: int) -> str:
        """Everything before decoding `token`: the kind of step ("dense", "slow" or "fast"), mode set.

        Split from `finish` so that a batched loop (`sfi_gguf.core.batched`) can decode the tokens of many
        sequences, grouped by kind, between the two.
        """
        self._n_step += 1
        if self._pending is not None and (self._n_step >= self._load_at or self._loads_when_ready()):
            self._load_pending()
        if self._top1 is not None:  # the distribution `token` came from: still sure?
            self.policy.observe_confidence(self._top1)
        slow = self.policy.on_token(token)
        reason = self.policy.reason if slow else None
        if self._sparse and self.options.refresh_grid > 1 and not self.options.async_refresh:
            slow, reason = self._on_grid(slow, reason)
        n_after = len(self.ctx.tokens) + 1
        if not self._sparse:
            if self._wants_sparse(n_after):  # the context just grew past the threshold
                slow = self.policy.memory is not MemoryMode.SINK_RECENT
                reason = "threshold"  # counted like the policy's reasons: sum(reasons) == n_slow
                if not slow:
                    self._load_memory(self._no_selection())
            else:
                return "dense"
        if self._sparse and not slow and self._tail >= self.native.params["n_tail_max"]:
            self._cheap_refresh()
        if slow and self.options.async_refresh and self._selected is not None:
            # the refresh runs on the host from this fast step's queries (_start_host_refresh)
            if self._pending is not None:
                self.stats.n_refresh_skipped += 1
            else:
                self.native.capture_queries()
                self._capturing = True
                self._reason = reason
            return "fast"
        if slow:
            if self._pending is not None:  # a slow step overwrites the export the Selector reads
                self._load_pending()
            self._set_slow(n_after)
            self._reason = reason
            return "slow"
        return "fast"

    def finish(self, kind: str, seconds: float) -> None:
        """Everything after the decode of a step of `kind` that took `seconds`."""
        if kind == "dense":
            self.stats.t_dense += seconds
            self.stats.n_dense += 1
        elif kind == "slow":
            self.stats.t_slow += seconds
            self.stats.n_slow += 1
            self.stats.slow_steps.append(self._n_step)
            self._loaded_in_background = False  # its own selection replaces the one loaded before it
            self._held = None
            if self._reason:
                self.stats.reasons[self._reason] = self.stats.reasons.get(self._reason, 0) + 1
            self._refresh_from_export(background=bool(self.options.selection_delay) and self._selected is not None)
            # a trigger that waited for the grid: the policy counts the steps to the next one from the trigger
            self.policy.steps_since_refresh, self._waited = self._waited, 0
        else:
            self.stats.t_fast += seconds
            if self._loaded_in_background:
                self._loaded_in_background = False
                self.stats.t_fast_after_load += seconds
            self._tail += 1
            self.stats.n_fast += 1
            if self.native.fell_back_dense:
                # the view was invalidated under us (cache edited): next step re-bootstraps with a slow step
                self.stats.n_fell_back += 1
                self._sparse = False
                self.native.set_mode(SFINative.DENSE)
            elif self._capturing:
                self._start_host_refresh()
            self._capturing = False
        self._note_logits()

    def _note_logits(self) -> None:
        """Read what the policy needs from the step's logits while they are there (a batched loop's next
        llama_decode overwrites them): the top-1 probability, on sparse steps where the policy would read it
        (one softmax over the vocabulary)."""
        self._top1 = self.ctx.greedy_probability() if self._sparse and self.policy.wants_confidence() else None

    def annotate(self, stats) -> None:
        self._drop_pending()
        self._collect_overlap()
        self.stats.budget = (self.budget.n_sink + self.stats.k_head + self.budget.n_recent
                             if self.stats.k_head else 0)
        stats.sfi = self.stats

    # -- internals --------------------------------------------------------------------------------
    def _on_grid(self, slow: bool, reason: str | None) -> tuple[bool, str | None]:
        """(slow, reason) of this step under `refresh_grid`: a trigger waits for the next step whose number
        (`clock`) is a multiple of it, with the reason it came with."""
        if slow and self._held is None:
            self._held = reason
        if self._held is None:
            return False, None
        if self.clock() % self.options.refresh_grid:
            self._waited += 1
            self.stats.n_held_steps += 1
            return False, None
        reason, self._held = self._held, None
        return True, reason

    def _set_slow(self, n_context: int) -> None:
        if isinstance(self._selected, DeviceSelection) and self.options.selection_delay:
            self._selected = np.asarray(self._selected)  # a background refresh after this step loads it again
        n_candidates = self.sfi_plan.n_candidates_at(n_context)
        if n_candidates != self._n_candidates:
            self.native.set_n_candidates(n_candidates)
            self._n_candidates = n_candidates
        device_params = self._device_selector_params(n_context, n_candidates)
        self.native.set_selector(device_params)
        self.native.set_refresh_layers(*self._layers_to_refresh(device_params))
        self.native.set_mode(SFINative.SLOW)

    def _layers_to_refresh(self, device_params: DeviceSelectorParams | None) -> tuple[int, int]:
        """(n_groups, group) of the device Selector: one group of layers in turn once the view holds a
        selection of k_head cells per row for the other layers to keep (`refresh_layer_groups`)."""
        n_groups = min(self.options.refresh_layer_groups, self.native.n_layers)  # no empty group
        if (n_groups <= 1 or device_params is None or not self._sparse or self._selected is None
                or self._selected.shape[-1] != device_params.k_head):
            return 1, 0
        self.stats.n_group_refresh += 1
        return n_groups, self.stats.n_group_refresh % n_groups

    def _device_selector_params(self, n_context: int, n_candidates: int) -> DeviceSelectorParams | None:
        """The Selector to run in this slow step's graph, or None (the host scores the export): on when
        configured, for a selector with a device version, once the range holds the candidates."""
        if not self.options.device_selector or n_candidates <= 0:
            return None
        k_head = self.budget.k_head_at(n_context)
        if k_head > min(n_candidates, len(self.budget.candidates_at(n_context))):
            return None
        return self.selector.device_params(k_head, self.budget.n_sink, self.budget.recent_at(n_context))

    def _begin_bootstrap(self) -> None:
        self._set_slow(self._n_prompt)
        self._t_bootstrap = time.perf_counter()

    def _positions(self) -> np.ndarray:
        return self.native.cell_pos()

    def _refresh_from_export(self, background: bool = False) -> None:
        """Selector on the last slow step's export -> new selection; following steps are fast.

        background: the Selector runs in a worker thread on copies of the export; until its result is
        loaded (`_load_pending`, `selection_delay` steps later), fast steps keep the previous selection
        with its recent window stretched to now, so the slow step's own token joins the memory and no cell
        leaves it. Both loads keep every cell from their selection's candidate range on as recent: a selection
        chosen on an older context never considered the cells that entered its range since.
        """
        t0 = time.perf_counter()
        n_context = len(self.ctx.tokens)
        k_device = self.native.selection_size()  # 0 unless the slow step ran the Selector in its graph
        if k_device:  # nothing to score here: the native side loads it with its sink and recent cells
            self.policy.note_refresh()
            self._use_selection(DeviceSelection(self.native, k_device), load=self.native.load_selection)
            self.stats.n_device_selections += 1
            self.stats.t_selector += time.perf_counter() - t0
            return
        positions = self._positions()
        mass = self.native.mass()
        if mass is None:  # the slow step could not export (should not happen): stay dense until the next one
            self.stats.n_fell_back += 1
            self._sparse = False
            self.native.set_mode(SFINative.DENSE)
            return
        k_head = self.budget.k_head_at(n_context)
        export = AttentionExport(mass=mass, evidence=self.native.evidence(), key_norms=self.native.key_norms(),
                                 n_rows=self.native.n_query_rows() * self._group_size(),
                                 alpha=self.native.params["evidence_alpha"],
                                 **_cells_and_positions(positions, mass.shape[2], self.native.candidates()))
        candidates = self.budget.candidates_at(n_context)
        self.policy.note_refresh()
        if background:
            self._load_memory(self._selected, candidates=self._memory_range)
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sfi-selector")
            self._pending = self._executor.submit(self._timed_select, export, candidates, k_head)
            self._load_at = self._n_step + 1 + self.options.selection_delay
            self.stats.n_async += 1
            self.stats.t_selector += time.perf_counter() - t0
            return
        self._use_selection(self.selector.select(export, candidates, k_head), positions)
        self.stats.t_selector += time.perf_counter() - t0

    def _loads_when_ready(self) -> bool:
        """An asynchronous refresh without a fixed delay is loaded as soon as its worker is done."""
        return self.options.async_refresh and not self.options.selection_delay and self._pending.done()

    def _start_host_refresh(self) -> None:
        """The refresh of `async_refresh`: the export of the token the fast step just decoded, computed on the CPU
        over the host cache from the queries that step kept, and the Selector's choice on it, in a worker thread;
        fast steps keep the loaded selection until `_load_pending` loads the new one."""
        t0 = time.perf_counter()
        n_context = len(self.ctx.tokens)
        job = self.native.host_export(self.sfi_plan.n_candidates_at(n_context))
        if job is None:  # the step did not keep its queries (it ran dense): the next trigger refreshes
            return
        positions = self._positions()
        candidates = self.budget.candidates_at(n_context)
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sfi-selector")
        n_threads = max(1, self.ctx.lend_threads(DECODE_THREADS_DURING_REFRESH))
        self._lent_threads = True
        self._pending = self._executor.submit(self._host_select, job, n_threads, positions, candidates,
                                              self.budget.k_head_at(n_context))
        self._load_at = self._n_step + 1 + self.options.max_selection_delay
        self.policy.note_refresh()
        self.stats.n_async += 1
        self.stats.n_host_refresh += 1
        if self._reason:
            self.stats.reasons[self._reason] = self.stats.reasons.get(self._reason, 0) + 1
        self.stats.t_selector += time.perf_counter() - t0

    def _return_threads(self) -> None:
        if self._lent_threads:
            self._lent_threads = False
            self.ctx.return_threads()

    def _host_select(self, job, n_threads: int, positions: np.ndarray, candidates: CandidateRange, k_head: int):
        """The worker's half of an asynchronous refresh: the export over the host cache, then the Selector."""
        t0 = time.perf_counter()
        try:
            job.compute(n_threads)
            evidence = job.evidence()
            export = AttentionExport(evidence=evidence, key_norms=job.key_norms(), n_rows=self._group_size(),
                                     alpha=self.native.params["evidence_alpha"],
                                     **_cells_and_positions(positions, evidence.shape[2], job.candidates()))
        finally:
            job.close()
        self.stats.t_host_export += time.perf_counter() - t0  # read by the decoding thread after the future's result
        selected = self.selector.select(export, candidates, k_head)
        return selected, candidates, time.perf_counter() - t0

    def _timed_select(self, export: AttentionExport, candidates: CandidateRange, k_head: int):
        """The background half of a refresh: the Selector's choice, the range it chose from (its memory's recent
        window starts at that range's stop) and the seconds it took."""
        t0 = time.perf_counter()
        selected = self.selector.select(export, candidates, k_head)
        return selected, candidates, time.perf_counter() - t0

    def _use_selection(self, selected: np.ndarray, positions: np.ndarray | None = None, load=None,
                       candidates: CandidateRange | None = None) -> None:
        """load: how to load it (default: with the sink and recent cells of `positions`, checked by the native
        side); candidates: the range it was chosen from (default: the context's now)."""
        had_previous = self._selected is not None
        self._selected = selected
        self.stats.k_head = max(self.stats.k_head, selected.shape[-1])
        self._load_memory(selected, positions, candidates=candidates, load=load)
        # support stability, counted by the native side with the selection's rows; read before the next load (the
        # rows of a selection the slow step gathered are written while the next fast step computes)
        self._overlap_pending = had_previous

    def _collect_overlap(self) -> None:
        if self._overlap_pending:
            self._overlap_pending = False
            overlap = self.native.selection_overlap()
            if overlap is not None:
                self.stats.refresh_overlap.append(overlap)

    def _load_pending(self) -> None:
        """Load the background Selector's result (waiting for it) unless the view was dropped since."""
        t0 = time.perf_counter()
        pending, self._pending = self._pending, None
        try:
            selected, candidates, t_background = pending.result()
        finally:
            self._return_threads()
        self.stats.t_refresh_wait += time.perf_counter() - t0
        self.stats.t_selector_background += t_background
        if self._sparse:
            self._use_selection(selected, candidates=candidates)
            self._loaded_in_background = True
            # the memory changes now: gaps and T_max count from here, and the confidence trigger judges
            # the new selection, not the stale one the fast steps used meanwhile
            self.policy.note_refresh()
        self.stats.t_selector += time.perf_counter() - t0

    def _drop_pending(self) -> None:
        """New text or the end of a generation: a selection still being computed is stale."""
        if self._pending is not None:
            pending, self._pending = self._pending, None
            try:
                pending.result()
            finally:
                self._return_threads()

    def _cheap_refresh(self) -> None:
        """Same selected cells, recent window moved to now: no slow step (tail would overflow)."""
        self.stats.n_cheap_refresh += 1
        self._load_memory(self._selected if self._selected is not None else self._no_selection())

    def _load_memory(self, selected: np.ndarray, positions: np.ndarray | None = None,
                     candidates: CandidateRange | None = None, load=None) -> None:
        """The memory of the next fast steps: `selected`, the sink, and every cell from the candidates' stop
        on (the recent window; by default the context's last n_recent)."""
        self._collect_overlap()
        n_context = len(self.ctx.tokens)
        if candidates is None:
            candidates = self.budget.candidates_at(n_context)
        self._memory_range = candidates
        if load is not None:
            load()
        else:
            if positions is None:
                positions = self._positions()
            sink, recent = candidates.sink_and_recent_cells(positions)
            self.native.set_selection(selected, shared=np.concatenate([sink, recent]))
        self.native.set_mode(SFINative.FAST)
        self._sparse = True
        self._tail = 0

    def _no_selection(self) -> np.ndarray:
        """An empty Selector output [L, H, 0]: the memory is then sink + recent only."""
        return np.zeros((self.native.n_layers, self.native.n_head_kv, 0), np.int32)

    def _group_size(self) -> int:
        return self.ctx.n_head // max(1, self.native.n_head_kv)
