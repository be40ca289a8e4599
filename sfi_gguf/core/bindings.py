"""ctypes bindings of the `llama_sfi_*` C API (compact-view fast steps, attention-mass export).

The functions live in the same libllama (sfi-gguf's build) that llama-cpp-python loaded (`library.lib`), so they
act on the contexts created through `llama_cpp`. See native/include/llama-sfi.h for the
C-level documentation; this module adds numpy conversions and raises `SFIError` on error codes.

Typical cycle (one sequence; flash attention on or off; several sequences: pass seq= or
use `SFISequence`, see `batched`):

    sfi = SFINative(ctx, n_sel_max=..., n_tail_max=256, n_query_rows=1)
    sfi.set_mode(SFINative.SLOW);  decode(token)        # dense, exact logits + export
    mass = sfi.mass()                                   # [n_layers, n_head_kv, n_cells]
    sfi.set_selection(cells)                            # int32 [n_layers, n_head_kv, n_sel] cell ids
    sfi.set_mode(SFINative.FAST);  decode(...)          # attends to the selection + tail only
"""
from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import numpy as np

from .library import lib, llama_cpp
from .selector import DeviceSelectorParams

MODE_DENSE = 0
MODE_SLOW = 1
MODE_FAST = 2

STATUS_VIEW_VALID = 1
STATUS_LAST_FAST = 2
STATUS_FELL_BACK_DENSE = 4
STATUS_MASS_VALID = 8

ERR_NOT_INIT = -1
ERR_BAD_ARG = -2
ERR_RANGE = -3
ERR_DUPLICATE = -4
ERR_COUNT = -5
ERR_UNSUPPORTED = -6
ERR_ALLOC = -7
ERR_NO_SELECTION = -8
ERR_NO_QUERIES = -9

_ERROR_TEXT = {
    ERR_NOT_INIT: "SFI is not initialized on this context (llama_sfi_init not called, or freed)",
    ERR_BAD_ARG: "bad argument (null pointer, mode, sequence id or parameter)",
    ERR_RANGE: "a cell is outside the cache, empty, or not in the sequence",
    ERR_DUPLICATE: "a cell appears twice in one (layer, head) selection",
    ERR_COUNT: "n_sel outside [1, n_sel_max], or the selection shape does not match [n_layers, n_head_kv]",
    ERR_UNSUPPORTED: "unsupported context (several sequences in a unified KV cache, or an unsupported model/cache)",
    ERR_ALLOC: "could not allocate the compact buffers",
    ERR_NO_SELECTION: "no slow-step selection to load (none ran, or the sequence was decoded or edited since)",
    ERR_NO_QUERIES: "no fast step kept its queries (none was asked to, or the sequence was decoded or edited since)",
}


class SFIError(RuntimeError):
    """A llama_sfi_* call returned an error code (the code is in `.code`)."""

    def __init__(self, func: str, code: int):
        self.code = code
        super().__init__(f"{func} failed ({code}): {_ERROR_TEXT.get(code, 'unknown error')}")


class llama_sfi_params(ctypes.Structure):
    _fields_ = [
        ("n_sel_max", ctypes.c_int32),
        ("n_tail_max", ctypes.c_int32),
        ("n_query_rows", ctypes.c_int32),
        ("evidence_alpha", ctypes.c_float),
        ("export_key_norms", ctypes.c_bool),
        ("fused_ops", ctypes.c_bool),
        ("keep_graphs", ctypes.c_bool),
        ("fa_evidence", ctypes.c_int32),
    ]


class llama_sfi_selector_params(ctypes.Structure):
    _fields_ = [
        ("k_head", ctypes.c_int32),
        ("n_sink", ctypes.c_int32),
        ("n_recent", ctypes.c_int32),
        ("pool_window", ctypes.c_int32),
        ("key_norm_exponent", ctypes.c_float),
        ("w_pos", ctypes.c_float),
        ("pos_beta", ctypes.c_float),
        ("pos_power", ctypes.c_float),
        ("pos_eta", ctypes.c_float),
        ("lambda_clip_single", ctypes.c_float),
        ("lambda_clip_multi", ctypes.c_float),
        ("cross_head_alpha", ctypes.c_float),
        ("cross_head_temperature", ctypes.c_float),
    ]


_ctx_p = llama_cpp.llama_context_p_ctypes
_i32p = ctypes.POINTER(ctypes.c_int32)
_f32p = ctypes.POINTER(ctypes.c_float)


def _bind(name, argtypes, restype):
    fn = getattr(lib, name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


_default_params = _bind("llama_sfi_default_params", [], llama_sfi_params)
_init = _bind("llama_sfi_init", [_ctx_p, ctypes.POINTER(llama_sfi_params)], ctypes.c_int32)
_free = _bind("llama_sfi_free", [_ctx_p], None)
_n_layers = _bind("llama_sfi_n_layers", [_ctx_p], ctypes.c_int32)
_layer_info = _bind("llama_sfi_layer_info", [_ctx_p, ctypes.c_int32, _i32p, _i32p], ctypes.c_int32)
_set_mode = _bind("llama_sfi_set_mode", [_ctx_p, ctypes.c_int], ctypes.c_int32)
_seq_set_mode = _bind("llama_sfi_seq_set_mode", [_ctx_p, ctypes.c_int32, ctypes.c_int], ctypes.c_int32)
_set_selection = _bind("llama_sfi_set_selection",
                       [_ctx_p, ctypes.c_int32, _i32p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32)
_set_selection_shared = _bind("llama_sfi_set_selection_shared",
                              [_ctx_p, ctypes.c_int32, _i32p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                               _i32p, ctypes.c_int32], ctypes.c_int32)
_seq_load_selection = _bind("llama_sfi_seq_load_selection", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_seq_selection_overlap = _bind("llama_sfi_seq_selection_overlap", [_ctx_p, ctypes.c_int32], ctypes.c_float)
_seq_get_mass = _bind("llama_sfi_seq_get_mass", [_ctx_p, ctypes.c_int32, _i32p, _i32p, _i32p], _f32p)
_seq_get_evidence = _bind("llama_sfi_seq_get_evidence", [_ctx_p, ctypes.c_int32, _i32p, _i32p, _i32p], _f32p)
_seq_get_key_norms = _bind("llama_sfi_seq_get_key_norms", [_ctx_p, ctypes.c_int32, _i32p, _i32p, _i32p], _f32p)
_set_n_candidates = _bind("llama_sfi_set_n_candidates", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_set_n_query_rows = _bind("llama_sfi_set_n_query_rows", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_seq_get_candidates = _bind("llama_sfi_seq_get_candidates", [_ctx_p, ctypes.c_int32, _i32p, _i32p], _i32p)
_selector_default_params = _bind("llama_sfi_selector_default_params", [], llama_sfi_selector_params)
_set_selector = _bind("llama_sfi_set_selector", [_ctx_p, ctypes.POINTER(llama_sfi_selector_params)], ctypes.c_int32)
_set_refresh_layers = _bind("llama_sfi_set_refresh_layers", [_ctx_p, ctypes.c_int32, ctypes.c_int32], ctypes.c_int32)
_seq_get_selection = _bind("llama_sfi_seq_get_selection", [_ctx_p, ctypes.c_int32, _i32p, _i32p, _i32p], _i32p)
_seq_selection_size = _bind("llama_sfi_seq_selection_size", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_seq_get_n_query_rows = _bind("llama_sfi_seq_get_n_query_rows", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_get_cell_pos = _bind("llama_sfi_get_cell_pos", [_ctx_p, ctypes.c_int32, _i32p, ctypes.c_int32], ctypes.c_int32)
_seq_status = _bind("llama_sfi_seq_status", [_ctx_p, ctypes.c_int32], ctypes.c_uint32)
_seq_capture_queries = _bind("llama_sfi_seq_capture_queries", [_ctx_p, ctypes.c_int32], ctypes.c_int32)
_seq_host_export_begin = _bind("llama_sfi_seq_host_export_begin", [_ctx_p, ctypes.c_int32, ctypes.c_int32, _i32p],
                               ctypes.c_void_p)
_host_export_compute = _bind("llama_sfi_host_export_compute", [ctypes.c_void_p, ctypes.c_int32], ctypes.c_int32)
_host_export_evidence = _bind("llama_sfi_host_export_evidence", [ctypes.c_void_p, _i32p, _i32p, _i32p], _f32p)
_host_export_key_norms = _bind("llama_sfi_host_export_key_norms", [ctypes.c_void_p, _i32p, _i32p, _i32p], _f32p)
_host_export_candidates = _bind("llama_sfi_host_export_candidates", [ctypes.c_void_p, _i32p, _i32p], _i32p)
_host_export_free = _bind("llama_sfi_host_export_free", [ctypes.c_void_p], None)


class llama_sfi_memory(ctypes.Structure):
    _fields_ = [("cache_device", ctypes.c_int64), ("cache_host", ctypes.c_int64), ("view_device", ctypes.c_int64),
                ("view_host", ctypes.c_int64), ("cache_on_host", ctypes.c_bool)]




def _copied(ptr, shape: tuple, dtype) -> np.ndarray:
    """The native array at ptr, copied by one memmove into a fresh array: np.ctypeslib.as_array would create (and
    ctypes cache forever) a new array type for every shape, and n_cells grows with the context."""
    out = np.empty(shape, dtype=dtype)
    ctypes.memmove(out.ctypes.data, ptr, out.nbytes)
    return out


def _check(func: str, rc: int) -> int:
    if rc < 0:
        raise SFIError(func, rc)
    return rc


def default_params() -> dict:
    p = _default_params()
    return {name: getattr(p, name) for name, _ in llama_sfi_params._fields_}


@dataclass(frozen=True)
class Memory:
    cache_device: int    # bytes of the KV cache in device memory
    cache_host: int      # ... in host memory
    view_device: int     # bytes of the compact view in device memory
    view_host: int       # ... in host memory (with the key norms of the cache's cells)
    cache_on_host: bool  # the cache in host memory, the view on the device of its layers (kv_on_host)


@dataclass(frozen=True)
class LayerInfo:
    index: int      # index among the covered layers
    il: int         # model layer
    n_head_kv: int


class SFINative:
    """SFI state of one llama_context (n_seq_max = 1, or one KV stream per sequence: kv_unified off)."""

    DENSE, SLOW, FAST = MODE_DENSE, MODE_SLOW, MODE_FAST

    def __init__(self, ctx, n_sel_max: int | None = None, n_tail_max: int | None = None,
                 n_query_rows: int | None = None, evidence_alpha: float | None = None,
                 export_key_norms: bool | None = None, **switches):
        """The `llama_sfi_params` fields given (None or left out: the library's defaults); `switches`: its graph
        switches fused_ops, keep_graphs and fa_evidence (-1, 0 or 1)."""
        self.ctx = ctx
        self._initialized = False
        self.init(n_sel_max, n_tail_max, n_query_rows, evidence_alpha, export_key_norms, **switches)

    # -- lifetime -------------------------------------------------------------------------------
    def init(self, n_sel_max=None, n_tail_max=None, n_query_rows=None, evidence_alpha=None,
             export_key_norms=None, *, fused_ops=None, keep_graphs=None, fa_evidence=None) -> None:
        p = _default_params()
        for name, value in (("n_sel_max", n_sel_max), ("n_tail_max", n_tail_max),
                            ("n_query_rows", n_query_rows), ("evidence_alpha", evidence_alpha),
                            ("export_key_norms", export_key_norms), ("fused_ops", fused_ops),
                            ("keep_graphs", keep_graphs), ("fa_evidence", fa_evidence)):
            if value is not None:
                setattr(p, name, value)
        self._initialized = False  # a failed re-init may already have freed the previous state
        self._selector = None      # ... and a (re-)init starts without a device Selector
        self._refresh_layers = (1, 0)  # ... refreshing every layer
        _check("llama_sfi_init", _init(self.ctx, ctypes.byref(p)))
        self.params = {name: getattr(p, name) for name, _ in llama_sfi_params._fields_}
        self._initialized = True
        self.layers = [self.layer_info(i) for i in range(_n_layers(self.ctx))]
        self.n_layers = len(self.layers)
        self.n_head_kv = max((l.n_head_kv for l in self.layers), default=0)

    def free(self) -> None:
        if self.ctx:
            _free(self.ctx)
        self._initialized = False

    # -- info -----------------------------------------------------------------------------------
    def layer_info(self, i: int) -> LayerInfo:
        il, hkv = ctypes.c_int32(), ctypes.c_int32()
        _check("llama_sfi_layer_info", _layer_info(self.ctx, i, ctypes.byref(il), ctypes.byref(hkv)))
        return LayerInfo(i, il.value, hkv.value)

    def status(self, seq: int = 0) -> int:
        return int(_seq_status(self.ctx, seq))

    def memory(self) -> Memory:
        """Where the KV cache and the compact view live (bytes in device and host memory)."""
        m = llama_sfi_memory()
        get_memory = _bind("llama_sfi_get_memory", [_ctx_p, ctypes.POINTER(llama_sfi_memory)], ctypes.c_int32)
        _check("llama_sfi_get_memory", get_memory(self.ctx, ctypes.byref(m)))
        return Memory(**{name: getattr(m, name) for name, _ in llama_sfi_memory._fields_})

    @property
    def view_valid(self) -> bool:
        return bool(self.status() & STATUS_VIEW_VALID)

    @property
    def last_fast(self) -> bool:
        return bool(self.status() & STATUS_LAST_FAST)

    @property
    def fell_back_dense(self) -> bool:
        return bool(self.status() & STATUS_FELL_BACK_DENSE)

    @property
    def mass_valid(self) -> bool:
        return bool(self.status() & STATUS_MASS_VALID)

    # -- control --------------------------------------------------------------------------------
    def set_mode(self, mode: int, seq: int | None = None) -> None:
        """The mode of the following decodes, for every sequence or for sequence `seq` only."""
        if seq is None:
            _check("llama_sfi_set_mode", _set_mode(self.ctx, int(mode)))
        else:
            _check("llama_sfi_seq_set_mode", _seq_set_mode(self.ctx, int(seq), int(mode)))

    def set_selection(self, cells, seq: int = 0, shared=None) -> None:
        """cells: int array [n_layers, n_head_kv, n_sel] of cell ids (see cell_pos()), in any order; shared:
        cells every (layer, head) also reads (the sink and the recent window), int array [n_shared]."""
        a = np.ascontiguousarray(cells, dtype=np.int32)
        if a.ndim != 3:
            raise SFIError("llama_sfi_set_selection", ERR_COUNT)
        if shared is None:
            rc = _set_selection(self.ctx, seq, a.ctypes.data_as(_i32p), a.shape[0], a.shape[1], a.shape[2])
        else:
            b = np.ascontiguousarray(shared, dtype=np.int32).reshape(-1)
            rc = _set_selection_shared(self.ctx, seq, a.ctypes.data_as(_i32p), a.shape[0], a.shape[1], a.shape[2],
                                       b.ctypes.data_as(_i32p), len(b))
        _check("llama_sfi_set_selection", rc)

    def load_selection(self, seq: int = 0) -> None:
        """Load the selection of seq's last slow step (`selection()`) with the sink and the recent window of the
        device Selector's range shared by every row, as `set_selection(selection(), shared=...)` would, without
        the host checking its cells again; call it before seq's next decode."""
        _check("llama_sfi_seq_load_selection", _seq_load_selection(self.ctx, seq))

    def selection_overlap(self, seq: int = 0) -> float | None:
        """Share of the own (not shared) cells of seq's selection that the one before it had, per (layer,
        head), over all of them; None when there was no previous selection with own cells."""
        overlap = float(_seq_selection_overlap(self.ctx, seq))
        return None if overlap < 0 else overlap

    def set_n_candidates(self, n_candidates: int) -> None:
        """Slow steps export only this many candidate cells per layer, chosen on the device (0: all)."""
        _check("llama_sfi_set_n_candidates", _set_n_candidates(self.ctx, int(n_candidates)))

    def set_n_query_rows(self, n_query_rows: int) -> None:
        """Slow steps from now on take the last n_query_rows tokens of a slow sequence's ubatch as query rows (the
        init parameter's value: `params["n_query_rows"]`)."""
        _check("llama_sfi_set_n_query_rows", _set_n_query_rows(self.ctx, int(n_query_rows)))

    def set_selector(self, params: DeviceSelectorParams | dict | None) -> None:
        """Slow steps with candidates run the Selector on the device with these parameters (a
        `selector.DeviceSelectorParams`, or a dict of some `llama_sfi_selector_params` fields, the others the C
        defaults; None: no device Selector) and export only its selection."""
        if params == self._selector:
            return  # unchanged: keep the compiled slow-step graph (new values are new graph constants)
        if params is None:
            _check("llama_sfi_set_selector", _set_selector(self.ctx, None))
            self._selector = None
            return
        fields = params.as_dict() if isinstance(params, DeviceSelectorParams) else params
        unknown = set(fields) - {name for name, _ in llama_sfi_selector_params._fields_}
        if unknown:
            raise ValueError(f"llama_sfi_selector_params has no field {', '.join(map(repr, sorted(unknown)))}")
        p = _selector_default_params()
        for name, value in fields.items():
            setattr(p, name, value)
        _check("llama_sfi_set_selector", _set_selector(self.ctx, ctypes.byref(p)))
        self._selector = params if isinstance(params, DeviceSelectorParams) else dict(params)

    def set_refresh_layers(self, n_groups: int, group: int) -> None:
        """Slow steps with the device Selector refresh only the layers i % n_groups == group; the others keep
        the own cells of the selection the view holds (n_groups 1: every layer)."""
        if (n_groups, group) == self._refresh_layers:
            return
        _check("llama_sfi_set_refresh_layers", _set_refresh_layers(self.ctx, int(n_groups), int(group)))
        self._refresh_layers = (n_groups, group)

    # -- exports --------------------------------------------------------------------------------
    def _export(self, fn, name: str, seq: int) -> np.ndarray | None:
        nl, nh, nc = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        ptr = fn(self.ctx, seq, ctypes.byref(nl), ctypes.byref(nh), ctypes.byref(nc))
        if not ptr:
            if not self._initialized:
                raise SFIError(name, ERR_NOT_INIT)
            return None
        return _copied(ptr, (nl.value, nh.value, nc.value), np.float32)

    def mass(self, seq: int = 0) -> np.ndarray | None:
        """[n_layers, n_head_kv, n_cells] of seq's last SLOW decode (None if there is none)."""
        return self._export(_seq_get_mass, "llama_sfi_seq_get_mass", seq)

    def evidence(self, seq: int = 0) -> np.ndarray | None:
        return self._export(_seq_get_evidence, "llama_sfi_seq_get_evidence", seq)

    def key_norms(self, seq: int = 0) -> np.ndarray | None:
        return self._export(_seq_get_key_norms, "llama_sfi_seq_get_key_norms", seq)

    def candidates(self, seq: int = 0) -> np.ndarray | None:
        """int32 [n_layers, n_cells]: the cells the last export's columns refer to (None: every cell,
        column i is cell i)."""
        nl, nc = ctypes.c_int32(), ctypes.c_int32()
        ptr = _seq_get_candidates(self.ctx, seq, ctypes.byref(nl), ctypes.byref(nc))
        return _copied(ptr, (nl.value, nc.value), np.int32) if ptr else None

    def selection(self, seq: int = 0) -> np.ndarray | None:
        """int32 [n_layers, n_head_kv, k_head]: the cells the device Selector kept in seq's last slow step,
        each row in no particular order (None: that step ran no device Selector)."""
        nl, nh, nk = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        ptr = _seq_get_selection(self.ctx, seq, ctypes.byref(nl), ctypes.byref(nh), ctypes.byref(nk))
        return _copied(ptr, (nl.value, nh.value, nk.value), np.int32) if ptr else None

    def selection_size(self, seq: int = 0) -> int:
        """k_head of the selection `selection()` would return, without reading it (0: none)."""
        return int(_seq_selection_size(self.ctx, seq))

    def n_query_rows(self, seq: int = 0) -> int:
        return _check("llama_sfi_seq_get_n_query_rows", _seq_get_n_query_rows(self.ctx, seq))

    def capture_queries(self, seq: int = 0) -> None:
        """seq's next fast decode also keeps its token's queries, for `host_export`."""
        _check("llama_sfi_seq_capture_queries", _seq_capture_queries(self.ctx, seq))

    def host_export(self, n_candidates: int, seq: int = 0) -> "HostExport | None":
        """The job that computes, over a cache in host memory, the export of seq's last token from the queries its
        fast decode kept (`capture_queries`); None when that decode kept none (it ran dense, or none was asked)."""
        err = ctypes.c_int32()
        job = _seq_host_export_begin(self.ctx, seq, int(n_candidates), ctypes.byref(err))
        if not job:
            if err.value == ERR_NO_QUERIES:
                return None
            raise SFIError("llama_sfi_seq_host_export_begin", err.value)
        return HostExport(job)

    def cell_pos(self, seq: int = 0) -> np.ndarray:
        """Position of every cell in seq (-1: empty or another sequence), int32 [kv_size]."""
        n = _check("llama_sfi_get_cell_pos", _get_cell_pos(self.ctx, seq, None, 0))
        out = np.empty(n, dtype=np.int32)
        _check("llama_sfi_get_cell_pos", _get_cell_pos(self.ctx, seq, out.ctypes.data_as(_i32p), n))
        return out


class HostExport:
    """A token's export over a cache in host memory, computed on the CPU by `compute` on any thread (ctypes
    releases the GIL) while the context decodes on: what a slow step of that token would export, from the queries
    its fast step kept. Its cells' keys must stay until `compute` returns (no edit of the sequence meanwhile)."""

    def __init__(self, job: int):
        self._job = job

    def compute(self, n_threads: int) -> None:
        _check("llama_sfi_host_export_compute", _host_export_compute(self._job, int(n_threads)))

    def _values(self, fn) -> np.ndarray | None:
        nl, nh, nc = ctypes.c_int32(), ctypes.c_int32(), ctypes.c_int32()
        ptr = fn(self._job, ctypes.byref(nl), ctypes.byref(nh), ctypes.byref(nc))
        return _copied(ptr, (nl.value, nh.value, nc.value), np.float32) if ptr else None

    def evidence(self) -> np.ndarray | None:
        """[n_layers, n_head_kv, n_cells] once computed (None before)."""
        return self._values(_host_export_evidence)

    def key_norms(self) -> np.ndarray | None:
        return self._values(_host_export_key_norms)

    def candidates(self) -> np.ndarray | None:
        """int32 [n_layers, n_cells]: the cells of the columns (None: every cell, column i is cell i)."""
        nl, nc = ctypes.c_int32(), ctypes.c_int32()
        ptr = _host_export_candidates(self._job, ctypes.byref(nl), ctypes.byref(nc))
        return _copied(ptr, (nl.value, nc.value), np.int32) if ptr else None

    def close(self) -> None:
        if self._job:
            _host_export_free(self._job)
            self._job = None

    def __del__(self):
        self.close()


class DeviceSelection:
    """The device Selector's selection of a slow step, [n_layers, n_head_kv, k_head] cells, read from the native
    side only when its cells are needed (`np.asarray`), so that the host's part of a refresh overlaps the next
    fast step. It can be read until the sequence's next slow step."""

    def __init__(self, native, k_head: int):
        self._native = native
        self.shape = (native.n_layers, native.n_head_kv, k_head)
        self._cells: np.ndarray | None = None

    def __array__(self, dtype=None, copy=None):
        if self._cells is None:
            cells = self._native.selection()
            if cells is None or cells.shape != self.shape:
                raise SFIError("llama_sfi_seq_get_selection", ERR_NO_SELECTION)
            self._cells = cells
        return self._cells if dtype is None else self._cells.astype(dtype)


class SFISequence:
    """One sequence's view of a multi-sequence `SFINative`: what `SFIStepper` calls, with the sequence id filled in.

    The per-sequence calls (exports, selection, status, mode) act on this sequence; the context-wide ones
    pass through. A candidate count, device Selector or group of layers to refresh acts at once (a
    sequence's prefill decodes alone) and is also kept here, for the batch loop to apply before the
    llama_decode that holds the sequence's slow step (it sets each sequence's mode itself). Any other
    `SFINative` attribute is refused: it would read sequence 0.
    """

    PER_SEQUENCE = frozenset({"status", "set_selection", "load_selection", "selection_overlap", "mass", "evidence",
                              "key_norms", "candidates", "selection", "selection_size", "n_query_rows", "cell_pos",
                              "set_mode", "capture_queries", "host_export"})
    SHARED = frozenset({"params", "n_layers", "n_head_kv", "set_n_query_rows"})

    def __init__(self, native: SFINative, seq: int):
        self.base, self.seq = native, seq
        self.n_candidates = 0
        self.selector: dict | None = None
        self.refresh_layers = (1, 0)

    def __getattr__(self, name: str):
        if name in self.PER_SEQUENCE:
            return functools.partial(getattr(self.base, name), seq=self.seq)
        if name in self.SHARED:
            return getattr(self.base, name)
        raise AttributeError(f"SFISequence has no {name!r} (not a per-sequence call of SFINative)")

    @property
    def fell_back_dense(self) -> bool:
        return bool(self.base.status(self.seq) & STATUS_FELL_BACK_DENSE)

    def set_n_candidates(self, n_candidates: int) -> None:
        self.n_candidates = n_candidates
        self.base.set_n_candidates(n_candidates)

    def set_selector(self, params: DeviceSelectorParams | dict | None) -> None:
        self.selector = params
        self.base.set_selector(params)

    def set_refresh_layers(self, n_groups: int, group: int) -> None:
        self.refresh_layers = (n_groups, group)
        self.base.set_refresh_layers(n_groups, group)
