"""`SFIConfig`: every knob of Slow-Fast Inference in one validated object, the public entry.

Defaults follow the paper (arXiv 2603.12038) and the authors' reference code (github.com/LV-NUS/SFI). The
object is pure data: the budgets of the sparse memory, how the steps are computed, and the trigger policy and
the Selector by name with their parameters (`policy_params`, `selector_params`: the dataclass each of them owns,
in `policy.py` and `selector.py`), so a new strategy is a class registered in `policy.py` or `selector.py` with
its `Params`, and is valid here at once. A context resolves it once into an immutable `plan.SFIPlan` (the budget,
the policy and Selector classes with their parameters, the execution options and the native parameters), which
is what the stepper reads.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .params import is_int
from .plan import K_HEAD_GRANULE, K_HEAD_LONG_CONTEXT, budget_of, options_of  # noqa: F401 (the k_head rule's constants)
from .policy import POLICIES, MemoryMode, PolicyParams  # registries: a new policy or selector class is valid here at once
from .selector import SELECTORS, SelectorParams


@dataclass(frozen=True)
class SFIConfig:
    """Budgets, execution options, trigger policy and Selector (with their parameters) of one SFI run.

    Sparse memory of a fast step, per layer and KV head: `n_sink` first cells + `k_head` cells chosen
    by the Selector + the last `n_recent` cells (plus every token decoded since the last refresh).
    A field None takes a default that depends on the context or on where the model runs, filled in when
    a context resolves the config (`SFILlama.effective_config` shows them).
    """

    # -- sparse memory budget ------------------------------------------------------------------
    n_sink: int = 4
    """First cells of the context, always attended (attention sinks)."""
    k_head: int | None = None
    """Selected cells per layer and KV head. None: a quarter of the context, at most 2048, see `resolve_k_head`."""
    n_recent: int = 256
    """Last cells of the context at a refresh, always attended."""
    min_context: int | None = None
    """Contexts shorter than this decode densely. None: n_sink + k_head + n_recent (nothing to gain); on the
    CPU with the default k_head 2048 (`plan.CPU_MIN_CONTEXT`); with layers on a GPU 24576, or 32768 per
    sequence in a batch (`plan.GPU_MIN_CONTEXT`, `plan.GPU_BATCHED_MIN_CONTEXT`), where a dense step is cheap
    until the context is long."""
    n_candidates: int | None = None
    """Cells per layer a slow step hands to the Selector, chosen on the device by head-summed evidence
    (top-k in the graph), so that a long context's export is not copied and scored whole. None: 4 x
    k_head once the context is more than twice that, else every cell; 0: always every cell."""

    device_selector: bool | None = None
    """Run the Selector inside the slow step's graph, on the device, when the slow step exports
    candidates (`n_candidates`): only the selection leaves the device, and the host runs no numpy
    scoring. The same stages as the numpy reference, except that the evidence is pooled over cells
    before the candidates are picked (the host pools over the candidates' ranks) and the position
    prior uses true positions; soft-NMS has no device version (the host runs it). The selection is
    loaded at once (`selection_delay` has nothing to overlap). None: on when the model's layers are on
    a GPU (where the numpy Selector would cost about as much as the slow step itself)."""

    refresh_layer_groups: int = 1
    """With the device Selector, a refresh renews the selection of one group of layers in turn (layer i
    in group i % refresh_layer_groups) and keeps the other layers' cells, so that a slow step scores
    1/refresh_layer_groups of the layers: the reference's `refresh_layer_groups` (2 in its throughput
    runs). The first refresh of a generation renews every layer. 1: every refresh renews every layer.
    A speed option: slow steps get cheaper, but the layers a refresh keeps hold a staler selection,
    which lowers agreement with dense decoding, so it is off by default."""

    selection_delay: int = 0
    """Fast steps between a slow step and the loading of its new selection (0: the Selector runs
    before the next step). Meanwhile the Selector runs in a background thread and fast steps keep
    the previous selection (with a recent window that includes the slow step's token); the selection
    is loaded exactly this many steps later (waiting for it if need be), so outputs do not depend on
    thread timing. A speed option for offloaded layers (the host cores idle while the GPU decodes),
    but the fast steps in between read a stale memory, which lowers agreement with dense decoding, so
    it is off by default."""

    async_refresh: bool | None = None
    """With the KV cache in host memory (`kv_on_host`), a refresh runs off the decoding thread: the trigger's
    step is a fast one that also keeps its token's queries, and the CPU computes that token's evidence over
    the host cache and runs the Selector in a worker thread while the GPU decodes fast steps with the loaded
    selection; the new selection is loaded once ready (at most 64 steps later, `plan.ASYNC_MAX_DELAY`, waiting
    for it then), or exactly `selection_delay` steps later when that is set (outputs then do not depend on thread
    timing). A trigger that comes while a refresh is computed is skipped. The GPU never runs a dense step over
    the host cache after the bootstrap, at the price of a stale memory for the steps in between (measured:
    BENCHMARKS.md, "The speed options' quality price"). Needs a cache in host memory. None: on with `kv_on_host`
    (unless `redecode_tail`), where a synchronous refresh reads the whole host cache on the CPU (0.5 s at 32K on
    16 cores: BENCHMARKS.md, "Contexts larger than the GPU"), else off."""

    redecode_tail: bool = False
    """A slow step decodes again, densely, the tokens that fast steps wrote since the last refresh, in one
    ubatch with its own token, so that their keys and values are dense ones (a fast step's KV comes from
    attention over the sparse memory, and later steps, slow ones included, keep reading it); only its own
    token's row is exported, so the selection is the one it would be without the option. A slow step of
    up to a tail's tokens in place of one. In a batch, such a slow step decodes apart from the other
    sequences' tokens."""

    refresh_grid: int | None = None
    """Slow steps fall only on steps whose number is a multiple of this: a trigger between two such steps waits
    for the next one (up to refresh_grid - 1 fast steps on the selection it would have replaced). In a batch the
    step number is the batch's, so the refreshes of sequences that started at different times (a server's
    requests) fall on the same steps and decode together: a step whose sequences are all fast costs what a fast
    step costs, and one slow sequence in a step of fast ones costs nearly what several do (BENCHMARKS.md, "Batched
    SFI on the GPU"); a sequence alone in its batch does not wait. None: `plan.BATCHED_REFRESH_GRID` (8) for batched
    decoding on a GPU, else 1 (a trigger's own step). Its quality price (single sequences with every trigger on the
    grid, as a batch's): BENCHMARKS.md, "The speed options' quality price"."""

    n_prefill_queries: int = 16
    """Last prompt positions used as query rows by the bootstrap slow step after prefill."""

    # -- how the native graphs compute the steps (the same results; None: the library's default) --
    fused_ops: bool | None = None
    """SFI's fused ggml ops (gathers, evidence, top-k, the device Selector's stages) where the backend has
    them; False: their composite ggml definition on every backend, what a backend without the ops runs.
    None: True, unless the environment sets LLAMA_SFI_FUSED=0 (which alone also decides for the sampling ops of a
    sampled pick in the graph: a sampler does not know the context's config)."""
    fa_evidence: bool | None = None
    """A slow step's attention (with flash attention) as one op that also gives the evidence and key
    norms; its logits equal flash attention's up to rounding. False: flash attention and the evidence op.
    None: on where the keys are in device memory (or in host memory for layers on a device), unless the
    environment sets LLAMA_SFI_FA_EVIDENCE=1 (everywhere) or =0 (nowhere)."""
    keep_graphs: bool | None = None
    """Fast steps decode with a scheduler and graphs of their own, so that neither a fast nor a slow step's
    graph is built again at every switch between them. None: True, unless the
    environment sets LLAMA_SFI_KEEP_GRAPHS=0."""

    # -- trigger policy and Selector -----------------------------------------------------------
    policy: str = "punctuation"
    """When a step is slow, a name in `policy.POLICIES`: "punctuation" (sentence boundaries + T_max,
    the method), "fixed" (every `fixed_period` steps), "static" (bootstrap selection only),
    "sink_recent" (no selection, StreamingLLM-like) or "dense" (full KV every step)."""
    policy_params: PolicyParams | None = None
    """The policy's parameters, an instance of `POLICIES[policy].Params` (a dict of its fields is
    accepted). None: its defaults."""
    selector: str = "sfi"
    """Which cells a fast step reads, a name in `selector.SELECTORS`: "sfi" (power-mean evidence +
    priors + soft-NMS + cross-head exclusivity) or "topk_mass" (the baseline)."""
    selector_params: SelectorParams | None = None
    """The selector's parameters, an instance of `SELECTORS[selector].Params` (a dict of its fields is
    accepted). None: its defaults."""

    def __init__(self, **kwargs: Any) -> None:
        """Keywords: the fields above, and the parameters of the named policy and selector by name
        (`SFIConfig(policy="fixed", fixed_period=16)`), which update `policy_params` / `selector_params`.

        A parameter of another registered policy or selector is checked and has no effect (the policy
        named does not read it); a parameter None (`pool_window=None`) means its default. Any other
        name raises ValueError.
        """
        own = {f.name: f for f in dataclasses.fields(self)}
        flat = {name: kwargs.pop(name) for name in list(kwargs) if name not in own}
        for name, f in own.items():
            object.__setattr__(self, name, kwargs.get(name, f.default))
        policy_cls = POLICIES.get(self.policy) if isinstance(self.policy, str) else None
        selector_cls = SELECTORS.get(self.selector) if isinstance(self.selector, str) else None
        if policy_cls is None or selector_cls is None:
            self.validate()  # names the unknown policy or selector
        for_policy, for_selector = _route(flat, policy_cls.Params, selector_cls.Params)
        object.__setattr__(self, "policy_params", _params(self.policy_params, policy_cls.Params, for_policy,
                                                          "policy_params"))
        object.__setattr__(self, "selector_params", _params(self.selector_params, selector_cls.Params,
                                                            for_selector, "selector_params"))
        self.validate()

    # -- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first parameter that makes no sense."""
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"SFIConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("n_sink", "n_recent", "selection_delay"):
            value = getattr(self, name)
            need(is_int(value) and value >= 0, name, "must be an integer >= 0")
        need(self.refresh_grid is None or (is_int(self.refresh_grid) and self.refresh_grid >= 1), "refresh_grid",
             "must be None (8 in batches on a GPU, else 1) or an integer >= 1")
        for name in ("n_prefill_queries", "refresh_layer_groups"):
            value = getattr(self, name)
            need(is_int(value) and value >= 1, name, "must be an integer >= 1")
        need(self.k_head is None or (is_int(self.k_head) and self.k_head >= 1), "k_head",
             "must be None (scaled to the context) or an integer >= 1")
        need(self.min_context is None or (is_int(self.min_context) and self.min_context >= 0), "min_context",
             "must be None (n_sink + k_head + n_recent) or an integer >= 0")
        need(self.n_candidates is None or (is_int(self.n_candidates) and self.n_candidates >= 0), "n_candidates",
             "must be None (4 x k_head at long context) or an integer >= 0 (0: every cell)")
        for name in ("device_selector", "fused_ops", "fa_evidence", "keep_graphs"):
            need(getattr(self, name) is None or type(getattr(self, name)) is bool, name, "must be None, True or False")
        need(type(self.redecode_tail) is bool, "redecode_tail", "must be True or False")
        need(self.async_refresh is None or type(self.async_refresh) is bool, "async_refresh",
             "must be None (on with kv_on_host), True or False")
        need(not (self.async_refresh is True and self.redecode_tail), "async_refresh",
             "cannot be combined with redecode_tail (an asynchronous refresh decodes no slow step)")
        need(isinstance(self.policy, str) and self.policy in POLICIES, "policy", f"unknown policy; known: {', '.join(POLICIES)}")
        need(isinstance(self.selector, str) and self.selector in SELECTORS, "selector", f"unknown selector; known: {', '.join(SELECTORS)}")
        need(type(self.policy_params) is POLICIES[self.policy].Params, "policy_params",
             f"must be a {POLICIES[self.policy].Params.__name__} (the parameters of policy {self.policy!r})")
        need(type(self.selector_params) is SELECTORS[self.selector].Params, "selector_params",
             f"must be a {SELECTORS[self.selector].Params.__name__} (the parameters of selector {self.selector!r})")
        self.policy_params.validate()
        self.selector_params.validate()

    # -- derived quantities --------------------------------------------------------------------
    def resolve_n_candidates(self, n_context: int) -> int:
        """Device-side candidates per layer for a slow step at `n_context` cells (0: every cell)."""
        return options_of(self).n_candidates_at(budget_of(self), n_context)

    def resolve_k_head(self, n_context: int) -> int:
        """Selected cells per KV head for a context of `n_context` cells.

        An explicit `k_head` wins. Otherwise: a quarter of the context, rounded down to a multiple of
        64, at least 64 and at most 2048 (`plan.scaled_k_head`).
        """
        return budget_of(self).k_head_at(n_context)

    def resolve_min_context(self, n_context: int) -> int:
        """Context length below which decoding stays dense, for a context of `n_context` cells (the defaults
        of where the model runs not filled in: `SFILlama.effective_config`)."""
        return options_of(self).min_context_at(budget_of(self), n_context)

    @property
    def dense(self) -> bool:
        """Whether the policy decodes with the whole KV cache at every step (no SFI at all)."""
        return POLICIES[self.policy].memory is MemoryMode.DENSE

    def stays_dense(self, n_context: int) -> bool:
        """True when a context of `n_context` cells is too short for a sparse memory to pay off."""
        return self.dense or n_context < self.resolve_min_context(n_context)

    def replace(self, **changes: Any) -> SFIConfig:
        """A copy with some fields or parameters changed (validated), e.g. from command-line options.

        A new policy (selector) without new `policy_params` (`selector_params`) starts from its defaults.
        """
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        if changes.get("policy", self.policy) != self.policy:
            fields["policy_params"] = None
        if changes.get("selector", self.selector) != self.selector:
            fields["selector_params"] = None
        return SFIConfig(**{**fields, **changes})

    def overrides(self) -> dict[str, Any]:
        """The fields and parameters (by name, as `SFIConfig` takes them) that differ from their
        defaults: {} for `SFIConfig()`."""
        default = SFIConfig()
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("policy_params", "selector_params") and getattr(self, f.name) != getattr(default, f.name)}
        return {**out, **self.policy_params.overrides(), **self.selector_params.overrides()}


def parameter_owners() -> dict[str, list[type]]:
    """Every parameter name of a registered policy or selector, with the `Params` classes that have it."""
    owners: dict[str, list[type]] = {}
    for params in dict.fromkeys(cls.Params for cls in [*POLICIES.values(), *SELECTORS.values()]):
        for name in params.names():
            owners.setdefault(name, []).append(params)
    return owners


def _route(flat: dict[str, Any], policy_params: type, selector_params: type) -> tuple[dict, dict]:
    """Split parameters given by name into the named policy's and the named selector's; check the others."""
    flat = {name: value for name, value in flat.items() if value is not None}  # None: the default
    owners = parameter_owners()
    unknown = sorted(set(flat) - set(owners))
    if unknown:
        known = sorted({f.name for f in dataclasses.fields(SFIConfig)} | set(owners))
        raise ValueError(f"unknown SFIConfig field or parameter {', '.join(map(repr, unknown))} "
                         f"(SFIConfig has no parameter {', '.join(unknown)}); known: {', '.join(known)}")
    for_policy, for_selector = {}, {}
    for name, value in flat.items():
        mine = [cls for cls in (policy_params, selector_params) if name in cls.names()]
        if len(mine) == 2:
            raise ValueError(f"SFIConfig: {name!r} is a parameter of both {policy_params.__name__} and "
                             f"{selector_params.__name__}; pass it in policy_params or selector_params")
        if mine:
            (for_policy if mine[0] is policy_params else for_selector)[name] = value
        else:
            owners[name][0](**{name: value})  # another policy's or selector's: checked, then unused
    return for_policy, for_selector


def _params(given: Any, cls: type, changes: dict[str, Any], field: str) -> Any:
    """`given` (None: the defaults of `cls`; a dict: the fields of a `cls`) with `changes` applied."""
    if given is None:
        return cls(**changes)
    if isinstance(given, dict):
        unknown = sorted(set(given) - set(cls.names()))
        if unknown:
            raise ValueError(f"SFIConfig.{field}: {cls.__name__} has no parameter {', '.join(unknown)}; "
                             f"known: {', '.join(cls.names())}")
        return cls(**{**given, **changes})
    if type(given) is not cls:
        raise ValueError(f"SFIConfig.{field}={given!r}: must be a {cls.__name__}")
    return dataclasses.replace(given, **changes) if changes else given
