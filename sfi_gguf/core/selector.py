"""The Selector: which KV cells each fast step attends to, chosen from a slow step's attention.

A slow step exports, per layer, KV head and cell (`AttentionExport`): the attention mass
sum_r p_r(k), the evidence sum_r p_r(k)^alpha and the key norm ||K_k||, summed over the R query rows
(the GQA group's query heads times the query positions). The Selector scores the *candidate* cells,
those whose position lies in `CandidateRange` = [n_sink, start of the recent window), and keeps
the best k_head per (layer, KV head).

Who adds what: `Selector.select` returns only the selected candidate cells, int32 [L, H, k],
sorted ascending, unique per (layer, head), the same k for every head. Sink and recent cells lie
outside the candidates, so they never appear in it; `assemble_memory` appends them (same for every
head) when the native side wants the whole memory as one list. Tokens decoded after the refresh
are the native side's tail, not the Selector's business.

The SFI Selector is a pipeline of stages, each a function over numpy arrays whose last axis is the
candidates in position order (any leading axes, e.g. [L, H, C]), float32:
1. `power_mean_evidence`   f(k) ~ [(1/R) sum_r p_r(k)^alpha]^(1/alpha)
2. `structural_prior`      r(k) ~ ||K_k||^(-gamma w_l2) * delta(u_k)^w_pos
3. `mix_evidence_and_prior` q = (1 - lambda*) f + lambda* r, lambda* in closed form, clipped
4. `soft_nms`              s'(k) = s(k) - a max(0, max_{|j-k|<=w/2} s(j) - s(k)), s = log q
5. `cross_head_exclusivity` s''_h = s'_h + alpha_x log softmax_h(s'_h / T)   (only with > 2 KV heads)
6. `top_k_per_row`         the k best cells, sorted
`TopKMassSelector` (plain top-k of the mass) is the comparison point.

A new selector is a new `Selector` subclass with a `name` and a `score` method, decorated with
`@register_selector`; its parameters are a `SelectorParams` dataclass (each field with its default
and a docstring), its `Params`, read by `from_params`. `SFIConfig(selector=name)` then holds its
defaults in `SFIConfig.selector_params`; its fields are keywords of `SFIConfig` and command-line flags.
"""
from __future__ import annotations

import dataclasses
import functools
import math
import os
import threading
from abc import ABC, abstractmethod
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np

from .params import Params


_F32 = np.float32
_TINY = np.finfo(np.float32).tiny
_CHUNK_ELEMENTS = 1 << 20  # score this many floats at a time: a chunk's temporaries stay in cache

#: alpha of the evidence sum_r p_r(k)^alpha that a slow step exports: the SFI Selector's power-mean
#: exponent, and the export's for a selector that reads no evidence (the device picks candidates by it).
EVIDENCE_ALPHA = 0.5


# -- inputs ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class DeviceSelectorParams:
    """A Selector run in the slow step's graph: the fields of the C API's `llama_sfi_selector_params`
    (native/include/llama-sfi.h, which says what each does), built by `Selector.device_params`."""

    k_head: int
    n_sink: int
    n_recent: int
    pool_window: int
    key_norm_exponent: float
    w_pos: float
    pos_beta: float
    pos_power: float
    pos_eta: float
    lambda_clip_single: float
    lambda_clip_multi: float
    cross_head_alpha: float
    cross_head_temperature: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True)
class CandidateRange:
    """Positions [start, stop) the Selector chooses from: after the sink, before the recent window."""

    start: int
    stop: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"CandidateRange needs 0 <= start <= stop, got [{self.start}, {self.stop})")

    @classmethod
    def for_context(cls, n_context: int, n_sink: int, n_recent: int) -> CandidateRange:
        """Candidates of a context of `n_context` tokens: not among the first n_sink nor the last n_recent."""
        start = min(n_sink, n_context)
        return cls(start, max(start, n_context - n_recent))

    def __len__(self) -> int:
        return self.stop - self.start

    def sink_and_recent_cells(self, positions: np.ndarray | int) -> tuple[np.ndarray, np.ndarray]:
        """int32 cells holding positions before `start` (sink) and from `stop` on (recent).

        `positions`: position held by each cell (-1: empty), or the number of cells when cell i holds
        position i.
        """
        if np.isscalar(positions):
            n = int(positions)
            return (np.arange(min(self.start, n), dtype=np.int32),
                    np.arange(min(self.stop, n), n, dtype=np.int32))
        positions = np.asarray(positions)
        sink = np.flatnonzero((positions >= 0) & (positions < self.start))
        recent = np.flatnonzero(positions >= self.stop)
        return sink.astype(np.int32), recent.astype(np.int32)


@dataclass(frozen=True)
class AttentionExport:
    """What a slow step hands to the Selector; arrays are [L, H, n_cells] (L layers, H KV heads).

    mass:      sum over the R query rows of the softmax probability p_r(k) of cell k.
    evidence:  sum over the R query rows of p_r(k) ** alpha.
    key_norms: ||K_k|| (L2 norm of the cell's key in that layer and KV head).
    n_rows:    R = query positions x query heads per KV head (bootstrap: 16 x G; decode: G).
    positions: token position held by each cell, [n_cells] (-1: empty cell); None: cell i holds
               position i.
    cells:     [L, C] when the device exported only C candidate cells per layer (long contexts): column
               j of layer l is cell cells[l, j], and `positions` covers the whole cache.
    A selector reads only what it needs (SFI: evidence, key_norms; top-k mass: mass).
    """

    mass: np.ndarray | None = None
    evidence: np.ndarray | None = None
    key_norms: np.ndarray | None = None
    n_rows: int = 1
    alpha: float = EVIDENCE_ALPHA
    positions: np.ndarray | None = None
    cells: np.ndarray | None = None

    def __post_init__(self) -> None:
        shapes = {name: getattr(self, name).shape for name in ("mass", "evidence", "key_norms")
                  if getattr(self, name) is not None}
        if not shapes:
            raise ValueError("AttentionExport needs at least one of mass, evidence, key_norms")
        if len(set(shapes.values())) != 1 or len(next(iter(shapes.values()))) != 3:
            raise ValueError(f"AttentionExport arrays must share one [L, H, n_cells] shape, got {shapes}")
        if self.n_rows < 1:
            raise ValueError(f"AttentionExport.n_rows must be >= 1, got {self.n_rows}")
        if self.cells is not None:
            if np.shape(self.cells) != self.shape[::2] or self.positions is None:
                raise ValueError(f"AttentionExport.cells must be [L, n_cells]={self.shape[::2]} and come with "
                                 f"positions, got {np.shape(self.cells)}")
        elif self.positions is not None and np.shape(self.positions) != (self.shape[2],):
            raise ValueError(f"AttentionExport.positions must be [n_cells={self.shape[2]}], "
                             f"got {np.shape(self.positions)}")

    @property
    def shape(self) -> tuple[int, int, int]:
        for array in (self.evidence, self.mass, self.key_norms):
            if array is not None:
                return array.shape
        raise AssertionError("unreachable")

    def require(self, name: str) -> np.ndarray:
        array = getattr(self, name)
        if array is None:
            raise ValueError(f"this selector needs AttentionExport.{name}")
        return array

    def candidate_cells(self, candidates: CandidateRange) -> slice | np.ndarray:
        """The candidate cells in position order: a slice when cell i holds position i, else indices."""
        n_cells = self.shape[2]
        if self.positions is None:
            return slice(min(candidates.start, n_cells), min(candidates.stop, n_cells))
        positions = np.asarray(self.positions)
        cells = np.flatnonzero((positions >= candidates.start) & (positions < candidates.stop))
        cells = cells[np.argsort(positions[cells], kind="stable")]
        if len(cells) and cells[-1] - cells[0] + 1 == len(cells) and np.all(np.diff(cells) == 1):
            return slice(int(cells[0]), int(cells[-1]) + 1)
        return cells


# -- parameters ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SelectorParams(Params):
    """Parameters of a selector; this base has none."""

    @property
    def evidence_alpha(self) -> float:
        """alpha of the evidence the slow step exports for this selector."""
        return EVIDENCE_ALPHA


@dataclass(frozen=True)
class SFISelectorParams(SelectorParams):
    """Parameters of the "sfi" selector (`SFISelector`); defaults: SPEC section 2 and the authors'
    reference code, but for soft-NMS (off) and evidence pooling (on), measured in BENCHMARKS.md."""

    alpha: float = EVIDENCE_ALPHA
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
    pos_beta: float = -math.log(0.6) / 0.9
    """beta of the position prior: log delta(u) reaches log(0.6) at u = 0.9, beta = -ln(0.6)/0.9 ~ 0.568."""
    lambda_clip_single: float = 0.35
    """Upper clip of the prior's mixing weight lambda* when there is one query row."""
    lambda_clip_multi: float = 0.25
    """Upper clip of lambda* with several query rows (GQA group and/or bootstrap rows)."""
    pool_window: int = 17
    """Max-pool the evidence over this many neighbouring cells before scoring (0/1 = off). Keeps the
    span around a heavy cell (the value after the key a question names), see `local_pool`. Not in
    the paper; without it a needle's digits are lost (BENCHMARKS.md, "Quality evaluation")."""
    nms_window: int = 32
    """Soft-NMS window over positions (cells within +-window/2 compete)."""
    nms_strength: float = 0.0
    """Soft-NMS suppression strength a (0 = off). The paper uses 1.0; off here because it drops the
    neighbours of today's peaks, which the next steps read: teacher-forced agreement at 4K context,
    k_head 512, refresh every 16 steps 0.48 with it, 0.85 without (BENCHMARKS.md, "The Selector's stages")."""
    cross_head_alpha: float = 0.85
    """Strength of the cross-head exclusivity term (only used when a layer has > 2 KV heads)."""
    cross_head_temperature: float = 2.0
    """Temperature of the softmax over heads of the exclusivity term."""

    def validate(self) -> None:
        self.need_real("alpha", 0, above=True)
        for name in ("w_l2", "w_pos", "nms_strength", "cross_head_alpha"):
            self.need_real(name, 0)
        for name in ("gamma", "pos_eta", "pos_beta"):
            self.need_real(name)
        self.need_real("pos_power", 0, above=True)
        for name in ("lambda_clip_single", "lambda_clip_multi"):
            self.need_real(name, 0, 1)
        self.need_real("cross_head_temperature", 0, above=True)
        self.need_int("pool_window", 0)
        self.need_int("nms_window", 1)

    @property
    def evidence_alpha(self) -> float:
        return self.alpha


@dataclass(frozen=True)
class TopKMassParams(SelectorParams):
    """Parameters of the "topk_mass" selector (`TopKMassSelector`)."""

    pool_window: int = 0
    """Max-pool the attention mass over this many neighbouring cells before the top-k (0/1 = off)."""

    def validate(self) -> None:
        self.need_int("pool_window", 0)


_SFI = SFISelectorParams  # the stages' defaults are the SFI Selector's


# -- the stages ---------------------------------------------------------------------------------------
class Workspace:
    """Reusable float32 buffers for one thread of one selector.

    A long-context layer is a few MB per array; allocating fresh ones for every layer and stage
    costs page faults that take as long as the arithmetic. Stages given a workspace write their
    results into its buffers: a result stays valid until the same stage runs again with it.
    """

    def __init__(self) -> None:
        self._flat: dict[str, np.ndarray] = {}

    def get(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
        size = math.prod(shape)
        flat = self._flat.get(name)
        if flat is None or flat.size < size:
            flat = self._flat[name] = np.empty(size, dtype=_F32)
        return flat[:size].reshape(shape)


def _buffer(workspace: Workspace | None, name: str, shape: tuple[int, ...]) -> np.ndarray:
    return np.empty(shape, dtype=_F32) if workspace is None else workspace.get(name, shape)


def power_mean_evidence(evidence_sum: np.ndarray, n_rows: int, alpha: float,
                        workspace: Workspace | None = None) -> np.ndarray:
    """Stage 1: f(k) ~ [(1/R) sum_r p_r(k)^alpha]^(1/alpha), normalised over the last axis.

    `evidence_sum` is E(k) = sum_r p_r(k)^alpha. Computed in log space as
    exp((log E - max log E) / alpha) = (E / max E)^(1/alpha): the constant 1/R cancels in the
    normalisation, the largest term is 1 (no overflow; underflow only where the evidence is
    negligible), and for alpha 0.5 or 1 no transcendental function is needed. A row with no
    evidence at all is uniform.
    """
    e = np.asarray(evidence_sum)
    peak = e.max(axis=-1, keepdims=True).astype(_F32)
    f = np.multiply(e, 1 / np.where(peak > 0, peak, 1), out=_buffer(workspace, "f", e.shape))  # in [0, 1]
    power = 1.0 / alpha
    if power == 2.0:
        np.multiply(f, f, out=f)
    elif power != 1.0:
        with np.errstate(divide="ignore"):
            np.log(f, out=f)
        f *= _F32(power)
        np.exp(f, out=f)
    return _normalise(f)


def position_log_prior(n: int, beta: float, power: float, eta: float) -> np.ndarray:
    """log delta(u) = -beta u^p + eta log(1 - u), u = i / n for the i-th of n candidates (u < 1)."""
    u = np.arange(n, dtype=np.float64) / max(n, 1)
    return -beta * u ** power + eta * np.log1p(-u)


@functools.lru_cache(maxsize=256)  # device candidates: one candidate count per layer
def _position_factor(n: int, beta: float, power: float, eta: float, weight: float) -> np.ndarray:
    """delta(u)^weight over n candidates, float32, computed once per candidate count (read-only)."""
    factor = np.exp(weight * position_log_prior(n, beta, power, eta)).astype(_F32)
    factor.flags.writeable = False
    return factor


def structural_prior(key_norms: np.ndarray, *, gamma: float = _SFI.gamma, w_l2: float = _SFI.w_l2,
                     w_pos: float = _SFI.w_pos, pos_beta: float = _SFI.pos_beta, pos_power: float = _SFI.pos_power,
                     pos_eta: float = _SFI.pos_eta, workspace: Workspace | None = None) -> np.ndarray:
    """Stage 2: r(k) ~ pi(k)^w_l2 delta(u_k)^w_pos, normalised over the last axis; pi = ||K||^-gamma.

    Small-norm keys and early positions are favoured; the prior vanishes towards the recent window.
    The norm factor is taken relative to the best norm of the row (no overflow), like stage 1.
    """
    norms = np.asarray(key_norms)
    n = norms.shape[-1]
    exponent = -gamma * w_l2
    r = np.maximum(norms, _TINY, out=_buffer(workspace, "r", norms.shape))
    best = r.min(axis=-1, keepdims=True) if exponent < 0 else r.max(axis=-1, keepdims=True)
    r *= 1 / best
    if exponent == 0:
        r.fill(1)
    elif exponent == -0.5:
        np.sqrt(r, out=r)
        np.divide(1, r, out=r)
    elif exponent == -1:
        np.divide(1, r, out=r)
    else:
        np.power(r, _F32(exponent), out=r)
    r *= _position_factor(n, pos_beta, pos_power, pos_eta, w_pos)
    return _normalise(r)


def mix_evidence_and_prior(f: np.ndarray, r: np.ndarray, lambda_max: float,
                           workspace: Workspace | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Stage 3: q = (1 - lambda*) f + lambda* r with lambda* = <f, f - r> / ||f - r||^2 in [0, lambda_max].

    lambda* minimises sum_k q(k)^2 (the chi-square proxy of the KL objective): the prior is mixed in
    as far as it flattens an over-peaked evidence. Returns (q, lambda*), lambda* per row.
    """
    d = np.subtract(f, r, out=_buffer(workspace, "q", f.shape))
    num = _rowdot(f, d)
    den = _rowdot(d, d)
    lam = np.clip(np.divide(num, den, out=np.zeros_like(num), where=den > 0), 0.0, lambda_max).astype(_F32)
    d *= -lam[..., None]
    d += f  # f - lambda (f - r)
    return d, lam


def sliding_max(x: np.ndarray, half: int, workspace: Workspace | None = None) -> np.ndarray:
    """max_{|j-k| <= half} x[..., j] for every k, truncated at the ends of the last axis.

    Sparse-table doubling: maxima over windows of 1, 2, 4, ... cells (log2 of the window in
    vectorised passes), then two overlapping windows cover the 2*half+1 cells.
    """
    n = x.shape[-1]
    if half <= 0 or n == 0:
        out = _buffer(workspace, "window_a", x.shape)
        out[...] = x
        return out
    width = 2 * half + 1
    padded = x.shape[:-1] + (n + 2 * half,)
    run = _buffer(workspace, "window_a", padded)
    spare = _buffer(workspace, "window_b", padded)
    run[..., :half] = -np.inf  # nothing beyond the ends
    run[..., half + n:] = -np.inf
    run[..., half:half + n] = x
    span, valid = 1, padded[-1]  # run[..., i] = max of the `span` cells from i, for i < valid
    while span * 2 <= width:
        np.maximum(run[..., :valid - span], run[..., span:valid], out=spare[..., :valid - span])
        run, spare, valid, span = spare, run, valid - span, span * 2
    return np.maximum(run[..., :n], run[..., width - span:width - span + n], out=spare[..., :n])


def local_pool(f: np.ndarray, window: int, workspace: Workspace | None = None) -> np.ndarray:
    """Stage 1b: f(k) <- max_{|j-k| <= w/2} f(j), renormalised (SnapKV-style max pooling).

    Attention of the query rows lands on a few cells (e.g. the key a question names), while what the
    following steps read is next to them (the value after the key). Pooling gives the neighbours of
    a heavy cell its weight, so the selection keeps whole spans around the peaks.
    """
    if window <= 1:
        return f
    pooled = sliding_max(f, window // 2, workspace)
    out = _buffer(workspace, "pooled", f.shape)
    out[...] = pooled
    return _normalise(out)


def soft_nms(s: np.ndarray, window: int, strength: float, workspace: Workspace | None = None) -> np.ndarray:
    """Stage 4: s'(k) = s(k) - a max(0, max_{|j-k| <= w/2} s(j) - s(k)).

    Local peaks keep their score; their neighbours are pushed down by their gap to the peak, so
    the budget spreads over distinct regions instead of piling up around one. The window holds k
    itself, so the gap is never negative (no clamp needed) and peaks keep their score exactly.
    """
    s = np.asarray(s, dtype=_F32)
    gap = sliding_max(s, window // 2, workspace)
    gap -= s
    gap *= _F32(strength)
    return np.subtract(s, gap, out=_buffer(workspace, "nms", s.shape))


def cross_head_exclusivity(s: np.ndarray, alpha: float = _SFI.cross_head_alpha,
                           temperature: float = _SFI.cross_head_temperature, head_axis: int = -2,
                           workspace: Workspace | None = None) -> np.ndarray:
    """Stage 5: s''_h(k) = s'_h(k) + alpha log rho_h(k), rho_h(k) = softmax over heads of s'_h(k) / T.

    A cell that several KV heads of a layer want stays with the heads that want it most, so the
    heads cover more distinct cells. Written as (1 + alpha/T) s' - alpha logsumexp_h(s'/T).
    """
    s = np.asarray(s, dtype=_F32)
    scaled = np.multiply(s, _F32(1 / temperature), out=_buffer(workspace, "heads", s.shape))
    peak = scaled.max(axis=head_axis, keepdims=True)
    scaled -= peak
    np.exp(scaled, out=scaled)
    lse = np.log(scaled.sum(axis=head_axis, keepdims=True))
    lse += peak
    lse *= _F32(alpha)
    out = np.multiply(s, _F32(1 + alpha / temperature), out=scaled)
    out -= lse
    return out


def top_k_per_row(scores: np.ndarray, k: int) -> np.ndarray:
    """Stage 6: indices of the k highest scores along the last axis, sorted ascending (unique)."""
    n = scores.shape[-1]
    if not 0 <= k <= n:
        raise ValueError(f"top-k of {n} scores with k={k}")
    if k == n:
        return np.broadcast_to(np.arange(n), scores.shape).copy()
    if k == 0:
        return np.empty(scores.shape[:-1] + (0,), dtype=np.int64)
    best = np.argpartition(scores, n - k, axis=-1)[..., n - k:]
    best.sort(axis=-1)
    return best


# -- selectors ----------------------------------------------------------------------------------------
class Selector(ABC):
    """Scores candidate cells per (layer, KV head) and keeps the best k_head of each."""

    name: ClassVar[str]
    Params: ClassVar[type[SelectorParams]] = SelectorParams
    """The dataclass of the selector's parameters (its defaults are the selector's defaults)."""

    def __init__(self, n_threads: int | None = None):
        self.n_threads = n_threads if n_threads is not None else min(4, os.cpu_count() or 1)
        """Layers are scored in this many threads (numpy releases the GIL in its loops)."""
        self._local = threading.local()  # one Workspace per thread

    @abstractmethod
    def score(self, export: AttentionExport, layers: slice, cells: slice | np.ndarray,
              workspace: Workspace | None = None) -> np.ndarray:
        """float32 [l, H, C] scores (higher = keep) of `cells` (candidates in position order) in `layers`."""

    @classmethod
    def from_params(cls, params: SelectorParams) -> Selector:
        """Build from `params` (a `cls.Params`)."""
        return cls()

    def device_params(self, k_head: int, n_sink: int, n_recent: int) -> DeviceSelectorParams | None:
        """The same selector run in the slow step's graph, or None when this selector has no device version."""
        return None

    def select(self, export: AttentionExport, candidates: CandidateRange, k_head: int) -> np.ndarray:
        """int32 [L, H, k] selected candidate cells per (layer, KV head), sorted ascending, unique.

        k = min(k_head, number of candidate cells), the same for every head. Sink and recent cells are
        never in it (see `assemble_memory`). When every candidate fits, all are returned unscored.
        """
        if export.cells is not None:
            return self._select_from_device_candidates(export, candidates, k_head)
        n_layers, n_heads, _ = export.shape
        cells = export.candidate_cells(candidates)
        cell_ids = np.arange(cells.start, cells.stop) if isinstance(cells, slice) else cells
        n_candidates = len(cell_ids)
        k = min(int(k_head), n_candidates)
        if k == n_candidates:
            return np.broadcast_to(np.sort(cell_ids).astype(np.int32), (n_layers, n_heads, k)).copy()
        out = np.empty((n_layers, n_heads, k), dtype=np.int32)
        chunk = max(1, _CHUNK_ELEMENTS // max(1, n_heads * n_candidates))

        def run(first: int) -> None:
            layers = slice(first, min(first + chunk, n_layers))
            best = top_k_per_row(self.score(export, layers, cells, self._workspace()), k)
            if isinstance(cells, slice):
                out[layers] = best + cells.start  # positions ascending = cells ascending
            else:
                out[layers] = np.sort(cell_ids[best], axis=-1)

        self._run_all(run, range(0, n_layers, chunk))
        return out

    def _select_from_device_candidates(self, export: AttentionExport, candidates: CandidateRange,
                                       k_head: int) -> np.ndarray:
        """Per layer, score the device's candidate cells that lie in `candidates`, in position order.

        They are scored like a dense export of just those cells: the stages' windows (pooling,
        soft-NMS) and the position prior see candidate ranks, not positions, an approximation that
        only matters where candidates are sparse, i.e. far from the attention peaks.
        """
        n_layers, n_heads, _ = export.shape
        positions = np.asarray(export.positions)
        keeps = []
        for layer in range(n_layers):
            pos = positions[export.cells[layer]]
            keep = np.flatnonzero((pos >= candidates.start) & (pos < candidates.stop))
            keeps.append(keep[np.argsort(pos[keep])])  # positions are unique: no need for a stable sort
        k = min([int(k_head)] + [len(keep) for keep in keeps])
        out = np.empty((n_layers, n_heads, k), dtype=np.int32)

        def run(layer: int) -> None:
            keep = keeps[layer]
            arrays = {name: None if getattr(export, name) is None else np.take(getattr(export, name)[layer:layer + 1], keep, axis=-1)
                      for name in ("mass", "evidence", "key_norms")}
            sub = AttentionExport(**arrays, n_rows=export.n_rows, alpha=export.alpha)
            best = self.select(sub, CandidateRange(0, len(keep)), k)[0]  # indices into keep
            out[layer] = np.sort(export.cells[layer][keep][best], axis=-1)

        self._run_all(run, range(n_layers))
        return out

    def _run_all(self, run, items: range) -> None:
        """run(item) for every item, in `n_threads` threads when there is more than one item."""
        if self.n_threads > 1 and len(items) > 1:
            with ThreadPoolExecutor(self.n_threads) as pool:
                list(pool.map(run, items))
        else:
            for item in items:
                run(item)

    def _workspace(self) -> Workspace:
        workspace = getattr(self._local, "workspace", None)
        if workspace is None:
            workspace = self._local.workspace = Workspace()
        return workspace


SELECTORS: dict[str, type[Selector]] = {}


def register_selector(cls: type[Selector]) -> type[Selector]:
    """Class decorator: make a selector selectable by its `name` (config, CLI)."""
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, SelectorParams)):
        raise TypeError(f"{cls.__name__}.Params must be a SelectorParams dataclass")
    SELECTORS[cls.name] = cls
    return cls


def selector_names() -> tuple[str, ...]:
    return tuple(SELECTORS)


def make_selector(config, name: str | None = None) -> Selector:
    """The selector named `name` (default: `config.selector`) of `config` (an `SFIConfig`), with its
    `selector_params` (another selector than the config's: with its default parameters)."""
    name = config.selector if name is None else name
    if name not in SELECTORS:
        raise ValueError(f"unknown selector {name!r}; known: {', '.join(SELECTORS)}")
    cls = SELECTORS[name]
    return cls.from_params(config.selector_params if name == config.selector else cls.Params())


@register_selector
class SFISelector(Selector):
    """The SFI Selector: power-mean evidence fused with key-norm and position priors, soft-NMS,
    cross-head exclusivity (SPEC section 2)."""

    name = "sfi"
    Params = SFISelectorParams

    def __init__(self, params: SFISelectorParams | None = None, *, n_threads: int | None = None, **changes):
        """`params` (default: `SFISelectorParams()`), with `changes` (its fields, e.g. nms_strength=1.0) applied."""
        super().__init__(n_threads)
        p = replace(params or SFISelectorParams(), **changes)
        self.params = p
        self.pool_window = p.pool_window
        self.alpha = p.alpha
        self.prior = dict(gamma=p.gamma, w_l2=p.w_l2, w_pos=p.w_pos, pos_beta=p.pos_beta, pos_power=p.pos_power,
                          pos_eta=p.pos_eta)
        self.lambda_clip_single = p.lambda_clip_single
        self.lambda_clip_multi = p.lambda_clip_multi
        self.nms_window = p.nms_window
        self.nms_strength = p.nms_strength
        self.cross_head_alpha = p.cross_head_alpha
        self.cross_head_temperature = p.cross_head_temperature

    @classmethod
    def from_params(cls, params):
        return cls(params)

    def device_params(self, k_head, n_sink, n_recent):
        if self.nms_strength:  # soft-NMS has no device version
            return None
        return DeviceSelectorParams(
            k_head=int(k_head), n_sink=int(n_sink), n_recent=int(n_recent), pool_window=int(self.pool_window),
            key_norm_exponent=-self.prior["gamma"] * self.prior["w_l2"], w_pos=self.prior["w_pos"],
            pos_beta=self.prior["pos_beta"], pos_power=self.prior["pos_power"], pos_eta=self.prior["pos_eta"],
            lambda_clip_single=self.lambda_clip_single, lambda_clip_multi=self.lambda_clip_multi,
            cross_head_alpha=self.cross_head_alpha, cross_head_temperature=self.cross_head_temperature)

    def lambda_max(self, n_rows: int) -> float:
        return self.lambda_clip_single if n_rows == 1 else self.lambda_clip_multi

    def score(self, export, layers, cells, workspace=None):
        if not math.isclose(export.alpha, self.alpha):
            raise ValueError(f"the evidence was exported with alpha={export.alpha}, the selector uses {self.alpha}")
        f = power_mean_evidence(export.require("evidence")[layers][..., cells], export.n_rows, self.alpha, workspace)
        f = local_pool(f, self.pool_window, workspace)
        r = structural_prior(export.require("key_norms")[layers][..., cells], **self.prior, workspace=workspace)
        q, _ = mix_evidence_and_prior(f, r, self.lambda_max(export.n_rows), workspace)
        s = np.log(np.maximum(q, _TINY, out=q), out=q)  # floor: no -inf, so no inf - inf in soft-NMS
        if self.nms_strength:
            s = soft_nms(s, self.nms_window, self.nms_strength, workspace)
        if s.shape[-2] > 2:
            s = cross_head_exclusivity(s, self.cross_head_alpha, self.cross_head_temperature, workspace=workspace)
        return s


@register_selector
class TopKMassSelector(Selector):
    """Plain top-k of the attention mass: the baseline the SFI Selector is compared with."""

    name = "topk_mass"
    Params = TopKMassParams

    def __init__(self, params: TopKMassParams | None = None, *, n_threads: int | None = None, **changes):
        """`params` (default: `TopKMassParams()`), with `changes` (its fields, e.g. pool_window=17) applied."""
        super().__init__(n_threads)
        self.params = replace(params or TopKMassParams(), **changes)
        self.pool_window = self.params.pool_window

    @classmethod
    def from_params(cls, params):
        return cls(params)

    def score(self, export, layers, cells, workspace=None):
        mass = np.asarray(export.require("mass")[layers][..., cells], dtype=_F32)
        return local_pool(mass, self.pool_window, workspace) if self.pool_window > 1 else mass


# -- using selections ---------------------------------------------------------------------------------
def assemble_memory(selected: np.ndarray, sink_cells: np.ndarray, recent_cells: np.ndarray) -> np.ndarray:
    """int32 [L, H, n_sink + k + n_recent]: the cells a fast step reads right after the refresh.

    Sink and recent cells (the same for every head) joined to each head's selection, sorted
    ascending. Raises ValueError if a cell appears twice (they must be disjoint by construction).
    """
    n_layers, n_heads, _ = selected.shape
    fixed = np.concatenate([np.asarray(sink_cells), np.asarray(recent_cells)]).astype(np.int32)
    memory = np.concatenate([selected.astype(np.int32), np.broadcast_to(fixed, (n_layers, n_heads, len(fixed)))],
                            axis=-1)
    memory.sort(axis=-1, kind="stable")  # radix sort for int32: 3x faster than the default here
    if memory.shape[-1] > 1 and np.any(memory[..., 1:] == memory[..., :-1]):
        raise ValueError("sink, recent and selected cells overlap")
    return memory


def refresh_overlap(old: np.ndarray, new: np.ndarray, per_head: bool = False) -> float | np.ndarray:
    """Share of the new selection already in the old one ("support stability"), over all heads.

    The numpy reference of what decoding records: the native side counts it while it checks a new
    selection (`SFINative.selection_overlap`).
    `old`, `new`: [..., k_old] and [..., k_new] cell ids with the same leading shape, unique per row.
    per_head=True gives the share per row instead (float64 [...]).
    """
    old = np.asarray(old)
    new = np.asarray(new)
    if old.shape[:-1] != new.shape[:-1]:
        raise ValueError(f"selections of different layouts: {old.shape} vs {new.shape}")
    if new.shape[-1] == 0:
        return np.zeros(new.shape[:-1]) if per_head else 0.0
    # a bitmap of the old row's cells, row by row: cheaper than sorting all keys (a refresh at 128K has
    # 36 x 8 rows of 2048 cells)
    mark = np.zeros(int(max(old.max(initial=0), new.max(initial=0))) + 1, dtype=bool)
    n_rows = int(np.prod(new.shape[:-1]))  # not -1: an empty old selection has no size to infer it from
    old_rows, new_rows = old.reshape(n_rows, old.shape[-1]), new.reshape(n_rows, new.shape[-1])
    hits = np.empty(len(new_rows), dtype=np.int64)
    for i, (o, n) in enumerate(zip(old_rows, new_rows)):
        mark[o] = True
        hits[i] = np.count_nonzero(mark[n])
        mark[o] = False
    share = hits.reshape(new.shape[:-1]) / new.shape[-1]
    return share if per_head else float(share.mean())


# -- helpers ------------------------------------------------------------------------------------------
def _normalise(x: np.ndarray) -> np.ndarray:
    """x / sum(x) over the last axis, in place; rows summing to 0 become uniform."""
    total = x.sum(axis=-1, keepdims=True)
    empty = total <= 0
    if np.any(empty):
        x[np.broadcast_to(empty, x.shape)] = 1
        total = np.where(empty, x.shape[-1], total)
    x *= (1 / total).astype(_F32)
    return x


if hasattr(np, "vecdot"):  # numpy >= 2.0: one pass, no temporary
    def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.vecdot(a, b).astype(_F32)
else:  # pragma: no cover
    def _rowdot(a: np.ndarray, b: np.ndarray) -> np.ndarray:
        return np.einsum("...k,...k->...", a, b).astype(_F32)
