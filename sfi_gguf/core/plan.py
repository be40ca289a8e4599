"""The plan of a context's SFI generations: the method's parts and how the steps run, resolved once.

`SFIConfig` is what a caller asks for. `resolve_plan` turns it, given where the model runs (layers on a GPU or
not), the context's size and whether its sequences decode in a batch, into an immutable `SFIPlan`:

- `Budget`: the sparse memory of a fast step (sink, selected cells per KV head, recent window);
- the trigger policy and the Selector: registered classes with their `Params` (`policy.py`, `selector.py`),
  built fresh for each stepper (they keep state);
- `ExecOptions`: how the steps are computed (dense below a minimum context, the Selector on the device,
  candidates, delayed selections, layer groups, the query rows of the bootstrap, the tail decoded again, the steps
  slow steps fall on);
- `NativeParams`: the `llama_sfi_params` of the context's native state, the native graph switches among them.

The stepper and the native bindings read the plan; no default is looked up again at a step or a refresh.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from .policy import POLICIES, MemoryMode, PolicyParams, TriggerPolicy
from .selector import SELECTORS, CandidateRange, Selector, SelectorParams

# (`config.SFIConfig` imports this module for the budget's rule: the functions below take an SFIConfig untyped)

#: k_head when it is scaled to the context: never above this (the throughput setting of the paper).
K_HEAD_LONG_CONTEXT = 2048
#: ... and a multiple of this (friendly to attention kernels' block sizes), at least one block.
K_HEAD_GRANULE = 64

# With layers on a GPU, SFI starts at this context (unless SFIConfig.min_context says otherwise): below it, on the
# H200, SFI decoded slower than dense, or at best even with it (BENCHMARKS.md, "Where SFI starts on a GPU").
GPU_MIN_CONTEXT = 24576

# On the CPU, with the default budget (k_head a quarter of the context), SFI starts at this context (unless
# SFIConfig.min_context or an explicit k_head says otherwise): below it the default model on 2 threads decoded no
# faster than dense (BENCHMARKS.md, "Speed on the CPU").
CPU_MIN_CONTEXT = 2048

# Batched decoding (n_parallel sequences) with layers on a GPU: SFI starts at this context per sequence (unless
# SFIConfig.min_context says otherwise); with their refreshes staggered, as a server's requests are, batched SFI
# pays from here (BENCHMARKS.md, "Where batched SFI starts on a GPU").
GPU_BATCHED_MIN_CONTEXT = 32768

# Batched decoding with layers on a GPU: slow steps fall on every 8th step of the batch (unless
# SFIConfig.refresh_grid says otherwise), so that sequences whose triggers come at different steps refresh in one
# decode: a step with one slow sequence among fast ones costs a large share of one with many (BENCHMARKS.md,
# "Batched SFI on the GPU"), and a trigger waits at most 7 steps
BATCHED_REFRESH_GRID = 8

# An asynchronous refresh (SFIConfig.async_refresh) is loaded once ready, and at most this many fast steps after its
# trigger (the decoding thread then waits for it): the bound keeps the cells that enter the selection's range
# meanwhile, which the load keeps as recent ones, within the view's capacity
ASYNC_MAX_DELAY = 64


def scaled_k_head(n_context: int) -> int:
    """The default k_head of a context of `n_context` cells: a quarter of it, rounded down to a multiple of 64, at
    least 64 and at most 2048 (so 2048 from 8K cells on; 1024 at 4K; 512 at 2K). A quarter keeps a fast step
    reading well under half of a short context, and 2048 is the paper's throughput budget at long context."""
    quarter = (max(0, int(n_context)) // 4) // K_HEAD_GRANULE * K_HEAD_GRANULE
    return max(K_HEAD_GRANULE, min(K_HEAD_LONG_CONTEXT, quarter))


@dataclass(frozen=True)
class Budget:
    """The sparse memory of a fast step, per layer and KV head: the first `n_sink` cells, `k_head` cells the
    Selector chooses and the last `n_recent` cells (plus the tokens decoded since the last refresh)."""

    n_sink: int = 4
    k_head: int | None = None
    """None: scaled to the context (`scaled_k_head`)."""
    n_recent: int = 256
    recent_spends_k_head: bool = False
    """No selection (sink + recent policies): the selection's budget goes to a longer recent window."""

    def k_head_at(self, n_context: int) -> int:
        """Selected cells per KV head for a context of `n_context` cells."""
        return self.k_head if self.k_head is not None else scaled_k_head(n_context)

    def recent_at(self, n_context: int) -> int:
        """The recent window of a context of `n_context` cells."""
        return self.n_recent + self.k_head_at(n_context) if self.recent_spends_k_head else self.n_recent

    def cells_at(self, n_context: int) -> int:
        """sink + k_head + recent: a context shorter than this has nothing to gain from a sparse memory."""
        return self.n_sink + self.k_head_at(n_context) + self.n_recent

    def candidates_at(self, n_context: int) -> CandidateRange:
        """The positions the Selector chooses from in a context of `n_context` cells."""
        return CandidateRange.for_context(n_context, self.n_sink, self.recent_at(n_context))


@dataclass(frozen=True)
class ExecOptions:
    """How the steps of a plan are computed (the `SFIConfig` fields of the same names say what each does)."""

    min_context: int | None = None
    """None: the budget's cells (sink + k_head + recent)."""
    device_selector: bool = False
    n_candidates: int | None = None
    """None: 4 x k_head once the context is more than twice that, else every cell; 0: every cell."""
    selection_delay: int = 0
    refresh_layer_groups: int = 1
    n_prefill_queries: int = 16
    redecode_tail: bool = False
    async_refresh: bool = False
    refresh_grid: int = 1

    @property
    def max_selection_delay(self) -> int:
        """Fast steps after which a refresh's selection is loaded at the latest (0: before the next step)."""
        if self.async_refresh and not self.selection_delay:
            return ASYNC_MAX_DELAY
        return self.selection_delay

    def min_context_at(self, budget: Budget, n_context: int) -> int:
        """Context length below which decoding stays dense, for a context of `n_context` cells."""
        return self.min_context if self.min_context is not None else budget.cells_at(n_context)

    def n_candidates_at(self, budget: Budget, n_context: int) -> int:
        """Device-side candidates per layer for a slow step at `n_context` cells (0: every cell)."""
        if self.n_candidates is not None:
            return self.n_candidates
        n = 4 * budget.k_head_at(n_context)
        return n if n_context > 2 * n else 0


@dataclass(frozen=True)
class NativeParams:
    """`llama_sfi_params` of a context's native state (`bindings.SFINative`); see native/include/llama-sfi.h."""

    n_sel_max: int
    n_tail_max: int
    n_query_rows: int
    evidence_alpha: float
    export_key_norms: bool = True
    fused_ops: bool = True
    keep_graphs: bool = True
    fa_evidence: int = -1

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


@dataclass(frozen=True)
class SFIPlan:
    """Everything a context's SFI stepper reads, resolved from an `SFIConfig` by `resolve_plan`."""

    budget: Budget
    policy: type[TriggerPolicy]
    policy_params: PolicyParams
    selector: type[Selector]
    selector_params: SelectorParams
    options: ExecOptions
    native: NativeParams | None
    """None for a dense plan (no native state)."""

    @property
    def memory(self) -> MemoryMode:
        return self.policy.memory

    @property
    def dense(self) -> bool:
        return self.policy.memory is MemoryMode.DENSE

    def stays_dense(self, n_context: int) -> bool:
        """True when a context of `n_context` cells decodes densely (no SFI, or too short to pay off)."""
        return self.dense or n_context < self.options.min_context_at(self.budget, n_context)

    def n_candidates_at(self, n_context: int) -> int:
        """Device-side candidates per layer for a slow step at `n_context` cells (0: every cell)."""
        return self.options.n_candidates_at(self.budget, n_context)

    def make_policy(self, pieces) -> TriggerPolicy:
        """A fresh trigger policy (its state is a generation's); `pieces`: the vocabulary, for policies reading text."""
        return self.policy.from_params(self.policy_params, pieces)

    def make_selector(self) -> Selector:
        return self.selector.from_params(self.selector_params)


def budget_of(config) -> Budget:
    """The sparse memory `config` (an `SFIConfig`) asks for."""
    return Budget(n_sink=config.n_sink, k_head=config.k_head, n_recent=config.n_recent,
                  recent_spends_k_head=POLICIES[config.policy].memory is MemoryMode.SINK_RECENT)


def effective_config(config, offloaded: bool, batched: bool = False, kv_on_host: bool = False):
    """`config` (an `SFIConfig`) with the defaults that depend on where the model runs filled in: `offloaded`,
    layers on a GPU (or RPC); `batched`, sequences decoded in a batch; `kv_on_host`, the KV cache in host memory for
    those layers."""
    changes = {}
    if kv_on_host and config.async_refresh is None:
        # a synchronous refresh would read the whole host cache on the CPU at every trigger
        changes["async_refresh"] = not config.redecode_tail
    if offloaded and config.device_selector is None:
        # the numpy Selector would cost about as much as the slow step: it runs in the slow step's graph
        changes["device_selector"] = True
    if config.refresh_grid is None:
        # one slow sequence among fast ones costs a batched step about what several cost: their refreshes meet
        changes["refresh_grid"] = BATCHED_REFRESH_GRID if batched and offloaded else 1
    if config.min_context is None:
        if offloaded:
            # a dense step is cheap until the context is long: below it the slow steps and the Selector cost more
            # than the fast steps save
            changes["min_context"] = GPU_BATCHED_MIN_CONTEXT if batched else GPU_MIN_CONTEXT
        elif config.k_head is None:
            # the CPU with the default budget: dense below CPU_MIN_CONTEXT (above it the budget rule always holds)
            changes["min_context"] = CPU_MIN_CONTEXT
    return replace(config, **changes) if changes else config


def options_of(config) -> ExecOptions:
    """How `config` (an `SFIConfig`) asks the steps to be computed."""
    return ExecOptions(min_context=config.min_context, device_selector=bool(config.device_selector),
                       n_candidates=config.n_candidates, selection_delay=config.selection_delay,
                       refresh_layer_groups=config.refresh_layer_groups, n_prefill_queries=config.n_prefill_queries,
                       redecode_tail=config.redecode_tail, async_refresh=bool(config.async_refresh),
                       refresh_grid=config.refresh_grid or 1)


def resolve_plan(config, n_ctx: int, offloaded: bool = False, batched: bool = False,
                 native_defaults: dict[str, Any] | None = None, kv_on_host: bool = False) -> SFIPlan:
    """The plan of `config`, an `SFIConfig`, for a context of `n_ctx` cells, its defaults filled in by
    `effective_config(config, offloaded, batched, kv_on_host)`. native_defaults: `bindings.default_params()`, the library's
    defaults of the switches that `config` leaves None (the environment's overrides among them)."""
    config = effective_config(config, offloaded, batched, kv_on_host)
    budget = budget_of(config)
    options = options_of(config)
    parts = dict(budget=budget, policy=POLICIES[config.policy], policy_params=config.policy_params,
                 selector=SELECTORS[config.selector], selector_params=config.selector_params, options=options)
    if config.dense:
        return SFIPlan(**parts, native=None)
    defaults = native_defaults or {}

    def switch(value: bool | None, name: str, default):
        return defaults.get(name, default) if value is None else value

    # a selection or a tail never holds more cells than the context: capping at n_ctx keeps the native buffers
    # (allocated for the capacity) bounded, and the values inside int32
    t_max = config.policy_params.t_max  # the tail's capacity: twice the policy's T_max, at least 256 cells
    n_tail_max = min(n_ctx, max(256, 2 * (t_max or 0)))
    # a delayed selection keeps every cell that entered its range since it was chosen as recent
    # (SFIStepper._refresh_from_export): at most the delay, a full tail (a slow step skips the cheap refresh) and
    # the slow step's token beyond n_recent
    delay = options.max_selection_delay
    stretch = delay + n_tail_max + 1 if delay else 0
    fa_evidence = None if config.fa_evidence is None else int(config.fa_evidence)
    native = NativeParams(n_sel_max=min(n_ctx, budget.n_sink + budget.k_head_at(n_ctx) + budget.n_recent + stretch),
                          n_tail_max=n_tail_max, n_query_rows=min(n_ctx, config.n_prefill_queries),
                          evidence_alpha=config.selector_params.evidence_alpha, export_key_norms=True,
                          fused_ops=bool(switch(config.fused_ops, "fused_ops", True)),
                          keep_graphs=bool(switch(config.keep_graphs, "keep_graphs", True)),
                          fa_evidence=int(switch(fa_evidence, "fa_evidence", -1)))
    return SFIPlan(**parts, native=native)
