"""`SFIConfig`: every knob of Slow-Fast Inference in one validated object.

Defaults follow SPEC section 2 and the authors' reference code (design/sfi-paper-notes.md). The
object is pure data: the trigger policy and the Selector are built from it by name
(`policy.make_policy`, `selector.make_selector`), so a new strategy is a class registered in
`policy.py` or `selector.py`, with its parameters as fields here.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .policy import POLICIES  # registries: a new policy or selector class is valid here at once
from .selector import SELECTORS

#: k_head when it is scaled to the context: never above this (the throughput setting of the paper).
K_HEAD_LONG_CONTEXT = 2048
#: ... and a multiple of this (friendly to attention kernels' block sizes), at least one block.
K_HEAD_GRANULE = 64

# beta of the position prior: log delta(u) reaches log(theta) at u = p_beta (theta 0.6, p_beta 0.9)
_DEFAULT_POS_BETA = -math.log(0.6) / 0.9


@dataclass(frozen=True)
class SFIConfig:
    """Budgets, trigger policy and Selector parameters of one SFI run.

    Sparse memory of a fast step, per layer and KV head: `n_sink` first cells + `k_head` cells chosen
    by the Selector + the last `n_recent` cells (plus every token decoded since the last refresh).
    """

    # -- sparse memory budget ------------------------------------------------------------------
    n_sink: int = 4
    """First cells of the context, always attended (attention sinks)."""
    k_head: int | None = None
    """Selected cells per layer and KV head. None: scaled to the context, see `resolve_k_head`."""
    n_recent: int = 256
    """Last cells of the context at a refresh, always attended."""
    min_context: int | None = None
    """Contexts shorter than this decode densely. None: n_sink + k_head + n_recent (nothing to gain)."""
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
    a GPU (the numpy Selector then costs about as much as the slow step itself)."""

    refresh_layer_groups: int = 1
    """With the device Selector, a refresh renews the selection of one group of layers in turn (layer i
    in group i % refresh_layer_groups) and keeps the other layers' cells, so that a slow step scores
    1/refresh_layer_groups of the layers: the reference's `refresh_layer_groups` (2 in its throughput
    runs). The first refresh of a generation renews every layer. 1: every refresh renews every layer.
    2 made the H200's 128K slow steps cheaper (2.42x -> 2.60x with the paper's trigger) but the
    kept half is staler: teacher-forced agreement at 4K fell from 0.953 to 0.824 (BENCHMARKS.md), so
    it is off by default."""

    selection_delay: int = 0
    """Fast steps between a slow step and the loading of its new selection (0: the Selector runs
    before the next step). Meanwhile the Selector runs in a background thread and fast steps keep
    the previous selection (with a recent window that includes the slow step's token); the selection
    is loaded exactly this many steps later (waiting for it if need be), so outputs do not depend on
    thread timing. A speed knob for offloaded layers (the host cores idle while the GPU decodes):
    16 took the H200 from 1.87x to 2.14x at 128K, but the stale memory in between costs quality
    (teacher-forced agreement at 4K, k_head 512: 0.953 -> 0.695), so it is off by default."""

    # -- trigger policy ------------------------------------------------------------------------
    policy: str = "punctuation"
    """When a step is slow: "punctuation" (sentence boundaries + T_max, the method), "fixed" (every
    `fixed_period` steps), "static" (bootstrap selection only), "sink_recent" (no selection,
    StreamingLLM-like) or "dense" (full KV every step)."""
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
    """One extra slow step this many steps after the bootstrap selection (0: none): the prompt's
    last rows choose poorly for the first tokens of a continuation (teacher-forced agreement at 4K
    context, k_head 512: BENCHMARKS.md, "Trigger placement")."""
    confidence_floor: float = 0.5
    """A slow step is also forced (once `min_gap` steps passed since the last refresh) when the last
    step's top-1 probability fell below this (0: never): a stale selection shows as a model that
    stops being sure (same section)."""
    fixed_period: int = 64
    """Period of the "fixed" policy (the reference ablation uses the refresh interval)."""
    n_prefill_queries: int = 16
    """Last prompt positions used as query rows by the bootstrap slow step after prefill."""

    # -- Selector ------------------------------------------------------------------------------
    selector: str = "sfi"
    """"sfi" (power-mean evidence + priors + soft-NMS + cross-head exclusivity) or "topk_mass"."""
    alpha: float = 0.5
    """Power of the power-mean over query rows (1 = mean, -> 0 = geometric mean)."""
    gamma: float = 0.5
    """Key-norm prior ||K||^-gamma: small-norm keys are favoured."""
    w_l2: float = 1.0
    """Weight (exponent) of the key-norm prior."""
    w_pos: float = 0.7
    """Weight (exponent) of the position prior."""
    pos_power: float = 1.8
    """p of the position prior log delta(u) = -beta u^p + eta log(1-u)."""
    pos_eta: float = 0.4
    """eta of the position prior."""
    pos_beta: float = _DEFAULT_POS_BETA
    """beta of the position prior, -ln(0.6)/0.9 ~ 0.568."""
    lambda_clip_single: float = 0.35
    """Upper clip of the prior's mixing weight lambda* when there is one query row."""
    lambda_clip_multi: float = 0.25
    """Upper clip of lambda* with several query rows (GQA group and/or bootstrap rows)."""
    pool_window: int | None = None
    """Max-pool the evidence over this many neighbouring cells before scoring (0/1 = off; None: the
    selector's default, 17 for "sfi", off for the "topk_mass" baseline): keeps the
    span around a heavy cell (the value after the key a question names), see `selector.local_pool`.
    Not in the paper; without it a needle's digits are lost (BENCHMARKS.md, "Quality evaluation")."""
    nms_window: int = 32
    """Soft-NMS window over positions (cells within +-window/2 compete)."""
    nms_strength: float = 0.0
    """Soft-NMS suppression strength a (0 = off). The paper uses 1.0; off by default here because
    it drops the neighbours of today's peaks, which the next steps read: teacher-forced agreement
    at 4K context, k_head 512, refresh every 16 steps 0.48 with it, 0.85 without
    (BENCHMARKS.md, "Agreement upper bound")."""
    cross_head_alpha: float = 0.85
    """Strength of the cross-head exclusivity term (only used when a layer has > 2 KV heads)."""
    cross_head_temperature: float = 2.0
    """Temperature of the softmax over heads of the exclusivity term."""

    def __post_init__(self) -> None:
        self.validate()

    # -- checks --------------------------------------------------------------------------------
    def validate(self) -> None:
        """Raise ValueError naming the first parameter that makes no sense."""
        def need(ok: bool, name: str, why: str) -> None:
            if not ok:
                raise ValueError(f"SFIConfig.{name}={getattr(self, name)!r}: {why}")

        for name in ("n_sink", "n_recent", "cooldown", "min_gap", "sentence_offset", "warmup_refresh"):
            value = getattr(self, name)
            need(_is_int(value) and value >= 0, name, "must be an integer >= 0")
        for name in ("refresh_interval", "fixed_period", "n_prefill_queries", "nms_window"):
            value = getattr(self, name)
            need(_is_int(value) and value >= 1, name, "must be an integer >= 1")
        need(self.k_head is None or (_is_int(self.k_head) and self.k_head >= 1), "k_head",
             "must be None (scaled to the context) or an integer >= 1")
        need(self.pool_window is None or (_is_int(self.pool_window) and self.pool_window >= 0), "pool_window",
             "must be None (the selector's default) or an integer >= 0")
        need(self.min_context is None or (_is_int(self.min_context) and self.min_context >= 0), "min_context",
             "must be None (n_sink + k_head + n_recent) or an integer >= 0")
        need(self.n_candidates is None or (_is_int(self.n_candidates) and self.n_candidates >= 0), "n_candidates",
             "must be None (4 x k_head at long context) or an integer >= 0 (0: every cell)")
        need(self.device_selector in (None, True, False), "device_selector", "must be None, True or False")
        need(_is_int(self.refresh_layer_groups) and self.refresh_layer_groups >= 1, "refresh_layer_groups",
             "must be an integer >= 1")
        need(_is_int(self.selection_delay) and self.selection_delay >= 0, "selection_delay",
             "must be an integer >= 0")
        need(self.policy in POLICIES, "policy", f"unknown policy; known: {', '.join(POLICIES)}")
        need(self.selector in SELECTORS, "selector", f"unknown selector; known: {', '.join(SELECTORS)}")
        need(_is_real(self.alpha) and 0 < self.alpha < math.inf, "alpha", "must be a finite number > 0")
        for name in ("w_l2", "w_pos", "nms_strength", "cross_head_alpha"):
            value = getattr(self, name)
            need(_is_real(value) and 0 <= value < math.inf, name, "must be a finite number >= 0")
        for name in ("gamma", "pos_eta", "pos_beta"):
            value = getattr(self, name)
            need(_is_real(value) and math.isfinite(value), name, "must be a finite number")
        need(_is_real(self.pos_power) and 0 < self.pos_power < math.inf, "pos_power", "must be a finite number > 0")
        for name in ("lambda_clip_single", "lambda_clip_multi", "confidence_floor"):
            value = getattr(self, name)
            need(_is_real(value) and 0 <= value <= 1, name, "must be in [0, 1]")
        need(_is_real(self.cross_head_temperature) and 0 < self.cross_head_temperature < math.inf,
             "cross_head_temperature", "must be a finite number > 0")

    # -- derived quantities --------------------------------------------------------------------
    def resolve_n_candidates(self, n_context: int) -> int:
        """Device-side candidates per layer for a slow step at `n_context` cells (0: every cell)."""
        if self.n_candidates is not None:
            return self.n_candidates
        n = 4 * self.resolve_k_head(n_context)
        return n if n_context > 2 * n else 0

    def resolve_k_head(self, n_context: int) -> int:
        """Selected cells per KV head for a context of `n_context` cells.

        An explicit `k_head` wins. Otherwise: a quarter of the context, rounded down to a multiple of
        64, at least 64 and at most 2048 (so 2048 from 8K cells on; 1024 at 4K; 512 at 2K). A quarter
        keeps a fast step reading well under half of a short context, and 2048 is the paper's
        throughput budget at long context.
        """
        if self.k_head is not None:
            return self.k_head
        quarter = (max(0, int(n_context)) // 4) // K_HEAD_GRANULE * K_HEAD_GRANULE
        return max(K_HEAD_GRANULE, min(K_HEAD_LONG_CONTEXT, quarter))

    def resolve_min_context(self, n_context: int) -> int:
        """Context length below which decoding stays dense, for a context of `n_context` cells."""
        if self.min_context is not None:
            return self.min_context
        return self.n_sink + self.resolve_k_head(n_context) + self.n_recent

    def stays_dense(self, n_context: int) -> bool:
        """True when a context of `n_context` cells is too short for a sparse memory to pay off."""
        return self.policy == "dense" or n_context < self.resolve_min_context(n_context)

    def replace(self, **changes: Any) -> SFIConfig:
        """A copy with some fields changed (validated), e.g. from command-line options."""
        unknown = sorted(set(changes) - {f.name for f in dataclasses.fields(self)})
        if unknown:
            raise ValueError(f"SFIConfig has no parameter {', '.join(unknown)}")
        return dataclasses.replace(self, **changes)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isnan(value)
