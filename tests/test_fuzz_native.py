"""Fuzzing the `llama_sfi_*` C API, and the view invalidation after every cache-changing call.

A seeded random driver (no extra dependency, reproducible from the seed) runs a few hundred random
operations per tiny random-weight model (flash attention on and off, one ubatch per batch or
several): init/free with good and bad parameters, random modes,
selections with out-of-range, empty, duplicate, unsorted or wrongly shaped cells, decodes (also
ones llama.cpp refuses: bad tokens, wrong positions, a full cache), seq_rm/seq_add/seq_div/seq_keep,
clear, state save and load (whole context and one sequence), and the exports. The contract: every
call returns 0 or one of the documented error codes (never crashes), the status bits agree with the
mode of the last decode, and the exports have the documented shape. `scripts/asan_check.sh` runs
this file under AddressSanitizer, where a stray read or write in the patch becomes a report.

SFI_FUZZ_SEED and SFI_FUZZ_STEPS run it longer or with another seed; a failure prints the seed and
the last operations.

The second part proves that after each cache-changing call the next FAST step is either correct or
falls back to dense: a context with SFI and a dense reference context get the same operations; FAST
steps select every occupied cell in cell order, which is bit-identical to dense, so both caches stay
equal and a stale view (attending removed, shifted or replaced cells) would show in the logits.
"""
from __future__ import annotations

import ctypes
import os
from collections import Counter, deque

import numpy as np
import pytest

from sfi_gguf.core import bindings
from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.bindings import SFINative
from sfi_gguf.tools.random_model import random_model

THREADS = int(os.environ.get("SFI_TEST_THREADS", "1"))
SEED = int(os.environ.get("SFI_FUZZ_SEED", "7"))
STEPS = int(os.environ.get("SFI_FUZZ_STEPS", "600"))
ERRORS = {bindings.ERR_NOT_INIT, bindings.ERR_BAD_ARG, bindings.ERR_RANGE, bindings.ERR_DUPLICATE, bindings.ERR_COUNT,
          bindings.ERR_UNSUPPORTED, bindings.ERR_ALLOC, bindings.ERR_NO_SELECTION}
STATUS_BITS = (bindings.STATUS_VIEW_VALID | bindings.STATUS_LAST_FAST | bindings.STATUS_FELL_BACK_DENSE
               | bindings.STATUS_MASS_VALID)
GGML_TYPE_F16, GGML_TYPE_Q8_0 = 1, 8


class Context:
    """One llama_context for sequence 0 with the operations the fuzzer and the invalidation test use."""

    def __init__(self, model_path, n_ctx=256, n_batch=64, type_kv=GGML_TYPE_F16, n_ubatch=None, flash_attn=True):
        llama_cpp._logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mp)
        assert self.model
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.model))
        cp = llama_cpp.llama_context_default_params()
        cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_ubatch or n_batch, 1
        cp.n_threads = cp.n_threads_batch = THREADS
        cp.type_k = cp.type_v = type_kv
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        self.ctx = llama_cpp.llama_init_from_model(self.model, cp)
        assert self.ctx
        self.n_ctx = llama_cpp.llama_n_ctx(self.ctx)
        self.n_batch = n_batch
        self.n_ubatch = n_ubatch or n_batch
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)

    def pos_max(self) -> int:
        return llama_cpp.llama_memory_seq_pos_max(self.mem, 0)

    def decode(self, tokens, pos0=None) -> int:
        if not 0 < len(tokens) <= self.n_batch:  # the batch arrays hold n_batch tokens (no bounds check)
            raise ValueError(f"{len(tokens)} tokens for a batch of {self.n_batch}")
        pos0 = self.pos_max() + 1 if pos0 is None else pos0
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = int(t), pos0 + i, 1, i == len(tokens) - 1
            b.seq_id[i][0] = 0
        return llama_cpp.llama_decode(self.ctx, b)

    def logits(self) -> np.ndarray:
        p = llama_cpp.llama_get_logits_ith(self.ctx, -1)
        return np.ctypeslib.as_array(p, shape=(self.n_vocab,)).copy()

    def save(self, seq: bool) -> bytes:
        if seq:
            n = llama_cpp.llama_state_seq_get_size(self.ctx, 0)
            buf = (ctypes.c_uint8 * n)()
            assert llama_cpp.llama_state_seq_get_data(self.ctx, buf, n, 0) == n
        else:
            n = llama_cpp.llama_state_get_size(self.ctx)
            buf = (ctypes.c_uint8 * n)()
            assert llama_cpp.llama_state_get_data(self.ctx, buf, n) == n
        return bytes(buf)

    def load(self, blob: bytes, seq: bool) -> int:
        buf = (ctypes.c_uint8 * len(blob)).from_buffer_copy(blob)
        if seq:
            return llama_cpp.llama_state_seq_set_data(self.ctx, buf, len(blob), 0)
        return llama_cpp.llama_state_set_data(self.ctx, buf, len(blob))

    def occupied(self) -> np.ndarray:
        """Cells of sequence 0, in cell order (through the SFI API, which works without init)."""
        n = bindings._get_cell_pos(self.ctx, 0, None, 0)
        pos = np.empty(n, np.int32)
        assert bindings._get_cell_pos(self.ctx, 0, pos.ctypes.data_as(bindings._i32p), n) == n
        return np.flatnonzero(pos >= 0).astype(np.int32)

    def close(self):
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None


# -- the random driver -------------------------------------------------------------------------------

class Fuzzer:
    """Random operations on one context, each checked against the C API's contract right away.

    It keeps what it expects (initialised or not, the mode, the parameters) so every return code and
    status bit can be checked, and the last operations, so a failure can be replayed from its seed.
    """

    def __init__(self, c: Context, rng: np.random.Generator):
        self.c, self.rng = c, rng
        self.inited = False
        self.mode = bindings.MODE_DENSE
        self.n_layers = self.n_head_kv = 0
        self.params = bindings.default_params()
        self.n_candidates = 0
        self.blobs: list[tuple[bytes, bool]] = []
        self.log: deque[str] = deque(maxlen=40)
        self.seen: Counter = Counter()  # what the run covered (asserted at the end)

    # every call goes through here: record it, check the return code
    def rc(self, what: str, value: int, allowed=frozenset({0}) | ERRORS) -> int:
        self.log.append(f"{what} -> {value}")
        self.seen[(what.split("(")[0], value)] += 1
        assert value in allowed, f"{what} returned {value}"
        return value

    def pick(self, *weighted):
        w = np.array([x[0] for x in weighted], float)
        return weighted[self.rng.choice(len(weighted), p=w / w.sum())][1]

    # -- operations ---------------------------------------------------------------------------------
    def op_init(self):
        r = self.rng
        p = bindings._default_params()
        bad = r.random() < 0.25  # one parameter out of range
        p.n_sel_max = int(self.pick((20, r.integers(1, 300)), (1, self.c.n_ctx + 7), (bad, 0), (bad, -5)))
        p.n_tail_max = int(self.pick((20, r.integers(1, 80)), (1, 300), (bad, 0), (bad, -1)))
        p.n_query_rows = int(self.pick((20, r.integers(1, 20)), (1, 1000), (bad, 0)))
        p.evidence_alpha = float(self.pick((6, 0.5), (4, 1.0), (4, 0.0), (4, 0.3), (bad, -1.0), (bad, float("nan"))))
        p.export_key_norms = bool(r.integers(2))
        valid = p.n_sel_max >= 1 and p.n_tail_max >= 1 and p.n_query_rows >= 1 and p.evidence_alpha >= 0
        ptr = ctypes.byref(p) if r.random() > 0.03 else None
        code = self.rc(f"init(sel_max={p.n_sel_max}, tail_max={p.n_tail_max}, rows={p.n_query_rows}, "
                       f"alpha={p.evidence_alpha}, norms={p.export_key_norms}, null={ptr is None})",
                       bindings._init(self.c.ctx, ptr))
        assert code == (0 if valid and ptr is not None else bindings.ERR_BAD_ARG)
        if code == 0:
            self.inited, self.mode, self.n_candidates = True, bindings.MODE_DENSE, 0
            self.params = {n: getattr(p, n) for n, _ in bindings.llama_sfi_params._fields_}
            self.n_layers = bindings._n_layers(self.c.ctx)
            hkv = ctypes.c_int32()
            heads = []
            for i in range(self.n_layers):
                self.rc("layer_info", bindings._layer_info(self.c.ctx, i, None, ctypes.byref(hkv)), {0})
                heads.append(hkv.value)
            self.n_head_kv = max(heads)
            assert self.status() == 0
        # refused parameters leave the previous SFI state (if any) as it was

    def op_free(self):
        bindings._free(self.c.ctx)
        self.log.append("free")
        self.inited = False
        assert bindings._n_layers(self.c.ctx) == 0 and self.status() == 0

    def op_mode(self):
        mode = int(self.pick((3, 0), (5, 1), (6, 2), (1, -1), (1, 3), (1, 1 << 30)))
        code = self.rc(f"set_mode({mode})", bindings._set_mode(self.c.ctx, mode))
        if not self.inited:
            assert code == bindings.ERR_NOT_INIT
        elif mode in (0, 1, 2):
            assert code == 0
            self.mode = mode
        else:
            assert code == bindings.ERR_BAD_ARG

    def op_candidates(self):
        n = int(self.pick((3, 0), (4, self.rng.integers(1, 64)), (1, 300), (1, 1 << 30), (1, -1)))
        code = self.rc(f"set_n_candidates({n})", bindings._set_n_candidates(self.c.ctx, n))
        if not self.inited:
            assert code == bindings.ERR_NOT_INIT
        elif n < 0:
            assert code == bindings.ERR_BAD_ARG
        else:
            assert code == 0
            self.n_candidates = n

    def op_selection(self):
        r, c = self.rng, self.c
        L, H = max(self.n_layers, 1), max(self.n_head_kv, 1)
        occ = c.occupied()
        n_sel_max = int(self.params["n_sel_max"])
        kind = self.pick((5, "good"), (1, "range"), (1, "negative"), (1, "empty_cell"), (1, "dup"), (1, "count"),
                         (1, "shape"), (1, "seq"), (1, "null"))
        n = int(r.integers(1, max(2, min(len(occ), n_sel_max) + 1))) if len(occ) else 1
        sel = np.empty((L, H, n), np.int32)
        for i in range(L):
            for h in range(H):
                sel[i, h] = r.permutation(occ)[:n] if len(occ) >= n else np.resize(occ, n) if len(occ) else 0
        seq, shape, ptr_null = 0, (L, H, n), False
        free = np.setdiff1d(np.arange(c.n_ctx), occ)
        if kind == "range":
            sel.flat[r.integers(sel.size)] = int(r.choice([c.n_ctx, c.n_ctx + 1, 1 << 30, np.iinfo(np.int32).max]))
        elif kind == "negative":
            sel.flat[r.integers(sel.size)] = int(r.choice([-1, -1000, np.iinfo(np.int32).min]))
        elif kind == "empty_cell" and len(free):
            sel.flat[r.integers(sel.size)] = int(r.choice(free))
        elif kind == "dup" and n >= 2:
            i, h = r.integers(L), r.integers(H)
            sel[i, h, -1] = sel[i, h, 0]
        elif kind == "count":
            n_bad = int(r.choice([0, n_sel_max + 1, n_sel_max + 1000]))
            shape = (L, H, n_bad)
            sel = np.resize(sel, shape) if n_bad else np.zeros(shape, np.int32)
        elif kind == "shape":
            shape = (L + int(r.choice([-1, 1])), H, n) if r.random() < 0.5 else (L, H + int(r.choice([-1, 1])), n)
            sel = np.resize(sel, tuple(max(1, s) for s in shape))
        elif kind == "seq":
            seq = int(r.choice([-1, 1, 64, -(1 << 20)]))
        elif kind == "null":
            ptr_null = True
        sel = np.ascontiguousarray(sel, np.int32)
        ptr = None if ptr_null else sel.ctypes.data_as(bindings._i32p)
        before = self.status()
        code = self.rc(f"set_selection({kind}, shape={shape}, seq={seq})",
                       bindings._set_selection(c.ctx, seq, ptr, *shape))
        if not self.inited:
            assert code == bindings.ERR_NOT_INIT
        elif code == 0:
            assert self.status() & bindings.STATUS_VIEW_VALID
        else:
            # a refused selection leaves the previous view alone
            assert self.status() & bindings.STATUS_VIEW_VALID == before & bindings.STATUS_VIEW_VALID
        if kind == "good" and self.inited and len(occ) >= n:
            assert code == 0, f"a valid selection was refused: {code}"

    def op_decode(self):
        r, c = self.rng, self.c
        kind = self.pick((12, "ok"), (1, "bad_token"), (1, "bad_pos"), (1, "fill"))
        n = int(self.pick((6, 1), (3, r.integers(2, 9)), (1, r.integers(9, c.n_batch + 1))))
        toks = [int(t) for t in r.integers(3, c.n_vocab, n)]
        pos0 = None
        if kind == "bad_token":
            toks[int(r.integers(n))] = int(r.choice([c.n_vocab, c.n_vocab + 100, -1]))
        elif kind == "bad_pos":
            pos0 = c.pos_max() + int(r.choice([3, 50])) if r.random() < 0.5 else max(0, c.pos_max() - 2)
        elif kind == "fill":
            n = c.n_batch
            toks = [int(t) for t in r.integers(3, c.n_vocab, n)]
        code = c.decode(toks, pos0)
        self.log.append(f"decode({kind}, n={n}, pos0={pos0}, mode={self.mode}) -> {code}")
        if code != 0:
            # only a full cache (1) may refuse a well-formed batch; bad tokens must be refused
            assert code == 1 if kind in ("ok", "fill") else True, f"decode({kind}) failed: {code}"
            assert code != 0 if kind == "bad_token" else True
            return code
        assert kind != "bad_token", "a batch with an out-of-vocabulary token was accepted"
        st = self.status()
        assert st & ~STATUS_BITS == 0, st
        if not self.inited:
            return code
        fast, fell = bool(st & bindings.STATUS_LAST_FAST), bool(st & bindings.STATUS_FELL_BACK_DENSE)
        self.seen[("decode", "fast" if fast else "fell_back" if fell else ("dense", "slow", "?")[self.mode])] += 1
        if self.mode == bindings.MODE_FAST:
            assert fast != fell, st
        else:
            assert not fast and not fell, st
        assert bool(st & bindings.STATUS_MASS_VALID) == (self.mode == bindings.MODE_SLOW), st
        if self.mode == bindings.MODE_SLOW:
            self.check_exports(n)
        if fell or self.mode != bindings.MODE_FAST:
            assert not st & bindings.STATUS_VIEW_VALID, st
        assert np.isfinite(c.logits()).all()
        return code

    def check_exports(self, n_tokens):
        c = self.c
        L, H, nc = (ctypes.c_int32() for _ in range(3))
        mass = bindings._seq_get_mass(c.ctx, 0, ctypes.byref(L), ctypes.byref(H), ctypes.byref(nc))
        assert mass and (L.value, H.value) == (self.n_layers, self.n_head_kv)
        occ = c.occupied()
        assert 0 < nc.value <= c.n_ctx
        m = np.ctypeslib.as_array(mass, shape=(L.value, H.value, nc.value))
        rows = bindings._seq_get_n_query_rows(c.ctx, 0)
        n_last_ubatch = (n_tokens - 1) % c.n_ubatch + 1  # the export covers the last ubatch
        assert rows == min(self.params["n_query_rows"], n_last_ubatch)
        assert np.isfinite(m).all() and (m >= 0).all()
        group = llama_cpp.llama_model_n_head(c.model) // H.value
        cand = bindings._seq_get_candidates(c.ctx, 0, None, None)
        self.seen[("export", "candidates" if self.n_candidates else "all")] += 1
        if self.n_candidates:  # the top cells of each layer only: ids of cells, no more than asked for
            assert cand and nc.value <= self.n_candidates
            ids = np.ctypeslib.as_array(cand, shape=(L.value, nc.value))
            assert ((ids >= 0) & (ids < c.n_ctx)).all()
            assert all(len(np.unique(row)) == len(row) for row in ids)
            assert (m.sum(-1) <= rows * group * (1 + 2e-3)).all()
        else:
            assert not cand and nc.value >= occ.max() + 1
            np.testing.assert_allclose(m.sum(-1), rows * group, rtol=2e-3)
        ev = bindings._seq_get_evidence(c.ctx, 0, None, None, None)
        assert bool(ev) == (self.params["evidence_alpha"] > 0)
        kn = bindings._seq_get_key_norms(c.ctx, 0, None, None, None)
        assert bool(kn) == bool(self.params["export_key_norms"])

    def op_cycle(self):
        """The intended use: a valid selection, FAST mode, a few decodes."""
        if not self.inited:
            return
        if self.rng.random() < 0.4:  # a slow step first, as SFI does before a refresh
            self.rc("set_mode(1)", bindings._set_mode(self.c.ctx, 1), {0})
            self.mode = bindings.MODE_SLOW
            self.op_decode()
        occ = self.c.occupied()
        if not len(occ):
            return
        n = int(self.rng.integers(1, min(len(occ), int(self.params["n_sel_max"])) + 1))
        sel = np.stack([np.stack([self.rng.permutation(occ)[:n] for _ in range(self.n_head_kv)])
                        for _ in range(self.n_layers)]).astype(np.int32)
        self.rc("set_selection(cycle)", bindings._set_selection(self.c.ctx, 0, sel.ctypes.data_as(bindings._i32p),
                                                               *sel.shape), {0})
        self.rc("set_mode(2)", bindings._set_mode(self.c.ctx, 2), {0})
        self.mode = bindings.MODE_FAST
        for _ in range(int(self.rng.integers(1, 5))):
            self.op_decode()

    def op_device_cycle(self):
        """The device Selector's cycle: a slow step that selects (and gathers its selection), load_selection, fast
        steps; load_selection is refused when the step made no selection or the view cannot hold it."""
        if not self.inited:
            return
        r, c = self.rng, self.c
        p = bindings._selector_default_params()
        p.k_head, p.n_sink, p.n_recent = int(r.integers(1, 24)), int(r.integers(0, 5)), int(r.integers(1, 24))
        n_cand = int(self.pick((3, r.integers(p.k_head, 64)), (1, 1 << 20)))
        code = self.rc("set_selector", bindings._set_selector(c.ctx, ctypes.byref(p)), {0, bindings.ERR_UNSUPPORTED})
        if code != 0:  # the Selector needs the evidence and the key norms
            assert self.params["evidence_alpha"] <= 0 or not self.params["export_key_norms"]
            return
        self.rc("set_n_candidates(device)", bindings._set_n_candidates(c.ctx, n_cand), {0})
        self.rc("set_mode(1)", bindings._set_mode(c.ctx, 1), {0})
        try:
            code = c.decode([int(t) for t in r.integers(3, c.n_vocab, int(self.pick((4, 1), (1, r.integers(2, 9)))))])
            self.log.append(f"decode(device slow) -> {code}")
            if code != 0:
                assert code == 1, f"a device slow step failed: {code}"  # only a full cache may refuse it
                return
            n_sel = ctypes.c_int32()
            made = bool(bindings._seq_get_selection(c.ctx, 0, None, None, ctypes.byref(n_sel)))
            code = self.rc(f"load_selection(k_head={p.k_head}, made={made})", bindings._seq_load_selection(c.ctx, 0),
                           {0, bindings.ERR_NO_SELECTION, bindings.ERR_COUNT})
            assert code != 0 or made
            if code == 0:
                assert self.status() & bindings.STATUS_VIEW_VALID
                assert bindings._seq_load_selection(c.ctx, 0) == 0  # still this step's: loading it again is the same
                self.rc("set_mode(2)", bindings._set_mode(c.ctx, 2), {0})
                self.mode = bindings.MODE_FAST
                codes = [self.op_decode() for _ in range(int(r.integers(1, 4)))]
                if 0 in codes:  # a refused batch is no decode
                    self.rc("load_selection(after a decode)", bindings._seq_load_selection(c.ctx, 0), {bindings.ERR_NO_SELECTION})
        finally:
            self.rc("set_selector(None)", bindings._set_selector(c.ctx, None), {0})
            self.rc("set_n_candidates(back)", bindings._set_n_candidates(c.ctx, self.n_candidates), {0})
            self.rc(f"set_mode({self.mode})", bindings._set_mode(c.ctx, self.mode), {0})

    def op_exports(self):
        c, r = self.c, self.rng
        for fn in (bindings._seq_get_mass, bindings._seq_get_evidence, bindings._seq_get_key_norms):
            outs = [ctypes.c_int32(-7) if r.random() < 0.8 else None for _ in range(3)]
            ptr = fn(c.ctx, 0, *[ctypes.byref(o) if o is not None else None for o in outs])
            if not ptr:
                assert all(o is None or o.value == 0 for o in outs)
        rows = bindings._seq_get_n_query_rows(c.ctx, 0)
        assert rows >= 0 if self.inited else rows == bindings.ERR_NOT_INIT
        seq = int(self.pick((6, 0), (1, 1), (1, -1)))
        n = int(self.pick((3, c.n_ctx), (1, 0), (1, 5), (1, c.n_ctx + 10), (1, -3)))
        buf = np.full(max(n, 0) + 4, -99, np.int32)
        null = r.random() < 0.1
        code = self.rc(f"get_cell_pos(seq={seq}, n={n}, null={null})",
                       bindings._get_cell_pos(c.ctx, seq, None if null else buf.ctypes.data_as(bindings._i32p), n),
                       frozenset({0, c.n_ctx}) | ERRORS)
        if seq == 0 and n >= 0 and not (null and n > 0):
            assert code == c.n_ctx
            assert (buf[min(n, c.n_ctx):] == -99).all()  # nothing written past min(n, kv_size)
        else:
            assert code == bindings.ERR_BAD_ARG
        i = int(r.integers(-2, self.n_layers + 2))
        code = self.rc(f"layer_info({i})", bindings._layer_info(c.ctx, i, None, None))
        assert code == (bindings.ERR_NOT_INIT if not self.inited else 0 if 0 <= i < self.n_layers else bindings.ERR_BAD_ARG)

    def op_cache(self, kind=None):
        r, c = self.rng, self.c
        kind = kind or self.pick((4, "seq_rm"), (2, "seq_add"), (1, "seq_div"), (1, "seq_keep"), (1, "clear"),
                         (2, "save"), (2, "load"))
        top = max(c.pos_max(), 0) + 1
        if kind == "seq_rm":
            p0 = int(r.integers(0, top + 1))
            p1 = int(self.pick((2, -1), (3, r.integers(p0, top + 2))))
            ok = llama_cpp.llama_memory_seq_rm(c.mem, 0, p0, p1)
            self.log.append(f"seq_rm({p0}, {p1}) -> {ok}")
        elif kind == "seq_add":
            p0 = int(r.integers(0, top + 1))
            delta = int(r.integers(-8, 9))
            llama_cpp.llama_memory_seq_add(c.mem, 0, p0, -1, delta)
            self.log.append(f"seq_add({p0}, -1, {delta})")
        elif kind == "seq_div":
            p0 = int(r.integers(0, top + 1))
            llama_cpp.llama_memory_seq_div(c.mem, 0, p0, -1, int(r.integers(2, 4)))
            self.log.append(f"seq_div({p0})")
        elif kind == "seq_keep":
            llama_cpp.llama_memory_seq_keep(c.mem, 0)
            self.log.append("seq_keep(0)")
        elif kind == "clear":
            llama_cpp.llama_memory_clear(c.mem, bool(r.integers(2)))
            self.log.append("clear")
        elif kind == "save":
            seq = bool(r.integers(2))
            self.blobs = (self.blobs + [(c.save(seq), seq)])[-3:]
            self.log.append(f"save(seq={seq})")
        elif kind == "load" and self.blobs:
            blob, seq = self.blobs[int(r.integers(len(self.blobs)))]
            if r.random() < 0.15:  # a truncated state must be refused, not read past its end
                blob = blob[: int(r.integers(0, len(blob)))]
                if seq:
                    llama_cpp.llama_memory_seq_rm(c.mem, 0, -1, -1)
            got = c.load(blob, seq)
            self.log.append(f"load(seq={seq}, {len(blob)} bytes) -> {got}")
            if got == 0:
                return  # refused: a failed load may or may not have touched the cache
        elif kind == "load":
            return
        # every change of the cells invalidates the view (saving does not change them)
        if self.inited and kind != "save":
            assert not self.status() & bindings.STATUS_VIEW_VALID, (kind, self.status())

    def status(self) -> int:
        return int(bindings._seq_status(self.c.ctx, 0))

    def run(self, steps: int):
        ops = [(2, self.op_init), (1, self.op_free), (4, self.op_mode), (5, self.op_selection), (10, self.op_decode),
               (4, self.op_cycle), (2, self.op_exports), (4, self.op_cache), (1, self.op_candidates),
               (3, self.op_device_cycle)]
        for _ in range(steps):
            if len(self.c.occupied()) > 0.8 * self.c.n_ctx and self.rng.random() < 0.5:
                self.op_cache("seq_rm")  # make room, most of the time (a full cache is also tested)
            op = self.pick(*ops) if self.inited or self.rng.random() < 0.3 else self.op_init
            op()


@pytest.mark.parametrize("name,type_kv,n_ubatch,fa", [
    ("tiny-llama", GGML_TYPE_F16, None, True), ("tiny-qwen3", GGML_TYPE_Q8_0, None, True),
    ("tiny-gemma3", GGML_TYPE_F16, None, True),
    ("tiny-qwen2", GGML_TYPE_F16, 16, True),  # batches of several ubatches: FAST tails and SLOW exports across them
    ("tiny-llama", GGML_TYPE_F16, None, False),  # flash attention off: V is stored transposed
    ("tiny-qwen2", GGML_TYPE_F16, 16, False),
])
def test_random_api_sequences_never_crash(name, type_kv, n_ubatch, fa):
    c = Context(random_model(name), n_ctx=256, n_batch=64, type_kv=type_kv, n_ubatch=n_ubatch, flash_attn=fa)
    seed = SEED + sum(map(ord, name)) + (0 if fa else 1)
    f = Fuzzer(c, np.random.default_rng(seed))
    try:
        f.run(STEPS)
        print(name, sorted(f.seen.items(), key=str))
        # the run reached the interesting states (true for the default seed and step count)
        if STEPS >= 300:
            for key in [("decode", "fast"), ("decode", "fell_back"), ("decode", "slow"), ("set_selection", 0),
                        ("set_selection", bindings.ERR_RANGE), ("set_selection", bindings.ERR_COUNT),
                        ("export", "all"), ("load_selection", 0), ("export", "candidates")]:
                assert f.seen[key] > 0, f"never saw {key}"
    except AssertionError as e:
        raise AssertionError(f"seed {seed} ({name}): {e}\nlast operations:\n  " + "\n  ".join(f.log)) from None
    finally:
        c.close()


def test_calls_on_a_context_without_sfi_return_codes():
    c = Context(random_model("tiny-llama"))
    try:
        sel = np.zeros((2, 4, 1), np.int32)
        assert bindings._set_selection(c.ctx, 0, sel.ctypes.data_as(bindings._i32p), 2, 4, 1) == bindings.ERR_NOT_INIT
        assert bindings._set_mode(c.ctx, 1) == bindings.ERR_NOT_INIT
        assert bindings._layer_info(c.ctx, 0, None, None) == bindings.ERR_NOT_INIT
        assert bindings._seq_get_n_query_rows(c.ctx, 0) == bindings.ERR_NOT_INIT
        assert bindings._n_layers(c.ctx) == 0 and bindings._seq_status(c.ctx, 0) == 0
        assert not bindings._seq_get_mass(c.ctx, 0, None, None, None)
        bindings._free(c.ctx)  # free without init is a no-op
        # a NULL context
        assert bindings._init(None, ctypes.byref(bindings._default_params())) == bindings.ERR_BAD_ARG
        assert bindings._set_mode(None, 0) == bindings.ERR_NOT_INIT
        assert bindings._get_cell_pos(None, 0, None, 0) == bindings.ERR_BAD_ARG
        assert bindings._seq_status(None, 0) == 0 and bindings._n_layers(None) == 0
        bindings._free(None)
    finally:
        c.close()


def test_failed_fast_decode_on_a_full_cache_leaves_a_usable_context():
    """llama_decode refuses a batch when the cache is full, after the SFI step was decided: the context
    must stay usable, and the status must not claim a fast step that did not run."""
    c = Context(random_model("tiny-llama"), n_ctx=256, n_batch=64)
    try:
        rng = np.random.default_rng(0)
        for _ in range(4):
            assert c.decode([int(t) for t in rng.integers(3, c.n_vocab, 60)]) == 0
        sfi = SFINative(c.ctx, n_sel_max=256, n_tail_max=64)
        sfi.set_selection(np.tile(c.occupied(), (sfi.n_layers, sfi.n_head_kv, 1)))
        sfi.set_mode(sfi.FAST)
        assert c.decode([5]) == 0 and sfi.last_fast
        assert c.decode([6] * 20) == 1  # 241 + 20 > 256: no slot
        # the refused batch changed nothing: a FAST step still works and matches a DENSE one (the status
        # in between is test_status_after_a_refused_decode)
        assert c.decode([7]) == 0 and sfi.last_fast
        fast = c.logits()
        assert llama_cpp.llama_memory_seq_rm(c.mem, 0, c.pos_max(), -1)
        sfi.set_mode(sfi.DENSE)
        assert c.decode([7]) == 0
        np.testing.assert_allclose(fast, c.logits(), atol=5e-3)
    finally:
        c.close()


def test_status_after_a_refused_decode():
    c = Context(random_model("tiny-llama"), n_ctx=256, n_batch=64)
    try:
        rng = np.random.default_rng(0)
        for _ in range(4):
            assert c.decode([int(t) for t in rng.integers(3, c.n_vocab, 60)]) == 0
        sfi = SFINative(c.ctx, n_sel_max=256, n_tail_max=64)
        sfi.set_selection(np.tile(c.occupied(), (sfi.n_layers, sfi.n_head_kv, 1)))
        sfi.set_mode(sfi.FAST)
        assert c.decode([6] * 20) == 1  # no slot: nothing was decoded
        assert not sfi.last_fast, sfi.status()
    finally:
        c.close()


def test_infinite_evidence_alpha_is_refused():
    c = Context(random_model("tiny-llama"))
    try:
        p = bindings._default_params()
        p.evidence_alpha = float("inf")
        assert bindings._init(c.ctx, ctypes.byref(p)) == bindings.ERR_BAD_ARG
    finally:
        c.close()


def test_budgets_beyond_the_cache_allocate_only_the_cache():
    """n_sel_max + n_tail_max far above the cache: the compact view is capped at the cache size."""
    def rss_mb() -> float:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20

    c = Context(random_model("tiny-llama"), n_ctx=256)
    try:
        before = rss_mb()
        sfi = SFINative(c.ctx, n_sel_max=10**7, n_tail_max=10**7)
        assert rss_mb() - before < 50  # uncapped: 2 x 10^7 slots x 2 layers x K and V ~ 20 GB
        assert c.decode([5, 6, 7]) == 0
        sfi.set_selection(np.tile(c.occupied(), (sfi.n_layers, sfi.n_head_kv, 1)))
        sfi.set_mode(sfi.FAST)
        assert c.decode([8]) == 0 and sfi.last_fast
    finally:
        c.close()


# -- invalidation: the next FAST step after a cache change is exact or falls back to dense ----------------

EDITS = ["none", "seq_rm_tail", "seq_rm_middle", "seq_add", "seq_div", "seq_keep", "clear", "state_seq_load",
         "state_load", "dense_step", "slow_step", "reinit"]


def _edit(x: Context, kind: str, snapshot):
    """Apply one cache-changing operation to context x (the same on both contexts)."""
    top = x.pos_max() + 1
    if kind == "seq_rm_tail":
        assert llama_cpp.llama_memory_seq_rm(x.mem, 0, top - 3, -1)
    elif kind == "seq_rm_middle":
        assert llama_cpp.llama_memory_seq_rm(x.mem, 0, 10, 30)
    elif kind == "seq_add":  # remove a span and shift the rest back: a K-shift at the next decode
        assert llama_cpp.llama_memory_seq_rm(x.mem, 0, 4, 14)
        llama_cpp.llama_memory_seq_add(x.mem, 0, 14, -1, -10)
    elif kind == "seq_div":
        llama_cpp.llama_memory_seq_div(x.mem, 0, 40, -1, 2)
    elif kind == "seq_keep":
        llama_cpp.llama_memory_seq_keep(x.mem, 0)
    elif kind == "clear":
        llama_cpp.llama_memory_clear(x.mem, True)
        assert x.decode(snapshot["tokens"][:50], 0) == 0
    elif kind in ("state_seq_load", "state_load"):
        seq = kind == "state_seq_load"
        if seq:
            llama_cpp.llama_memory_seq_rm(x.mem, 0, -1, -1)
        assert x.load(snapshot[seq], seq) > 0


@pytest.mark.parametrize("fa", [True, False], ids=["fa", "no_fa"])
@pytest.mark.parametrize("kind", EDITS)
def test_fast_step_after_a_cache_change_is_exact_or_dense(kind, fa):
    """Context b (SFI) and reference a (no SFI) get identical operations. b's FAST steps select every
    occupied cell in cell order (bit-identical to dense), so the two caches stay equal. After the change,
    b asks for a FAST step without a new selection: it must report FELL_BACK_DENSE and give a's logits
    (or, for "none", run fast with a's logits). Then a fresh selection makes FAST steps exact again."""
    path = random_model("tiny-llama")
    a, b = Context(path, n_ctx=512, flash_attn=fa), Context(path, n_ctx=512, flash_attn=fa)
    try:
        rng = np.random.default_rng(11)
        toks = [int(t) for t in rng.integers(3, a.n_vocab, 100)]
        for x in (a, b):
            assert x.decode(toks[:60]) == 0 and x.decode(toks[60:]) == 0
        snapshot = {"tokens": toks, True: b.save(True), False: b.save(False)}
        sfi = SFINative(b.ctx, n_sel_max=512, n_tail_max=64)

        def select_all():
            sfi.set_selection(np.tile(b.occupied(), (sfi.n_layers, sfi.n_head_kv, 1)))
            sfi.set_mode(sfi.FAST)

        def step(tok, expect_fast, exact=True):
            assert a.decode([tok]) == 0 and b.decode([tok]) == 0
            st = sfi.status()
            assert bool(st & bindings.STATUS_LAST_FAST) == expect_fast, (kind, st)
            assert bool(st & bindings.STATUS_FELL_BACK_DENSE) == (not expect_fast), (kind, st)
            la, lb = a.logits(), b.logits()
            if exact:
                assert np.array_equal(la, lb), (kind, float(np.abs(la - lb).max()))
            else:  # see test_native.test_all_cells_permuted_256_steps: F16 accumulation in another order
                assert np.abs(la - lb).max() < 5e-3 and la.argmax() == lb.argmax(), kind

        select_all()
        for t in range(5):
            step(20 + t, True)
        assert np.array_equal(a.occupied(), b.occupied())

        if kind == "dense_step":
            sfi.set_mode(sfi.DENSE)
            assert a.decode([40]) == 0 and b.decode([40]) == 0
            sfi.set_mode(sfi.FAST)
        elif kind == "slow_step":
            sfi.set_mode(sfi.SLOW)
            assert a.decode([41]) == 0 and b.decode([41]) == 0
            assert np.array_equal(a.logits(), b.logits()) and sfi.mass_valid
            sfi.set_mode(sfi.FAST)
        elif kind == "reinit":
            sfi.init(n_sel_max=512, n_tail_max=64)
            sfi.set_mode(sfi.FAST)
        else:
            for x in (a, b):
                _edit(x, kind, snapshot)
        assert np.array_equal(a.occupied(), b.occupied())
        if kind != "none":
            assert not sfi.view_valid, kind
        step(50, kind == "none")
        step(51, kind == "none")  # and it stays dense until the next selection
        # a fresh selection makes FAST steps right again; after holes were made, new tokens fill them, so
        # the cache's cell order and the compact order (selection, then tail) differ: not bit-identical
        holes = kind in ("seq_rm_middle", "seq_add", "seq_div", "clear", "state_seq_load", "state_load")
        select_all()
        for t in range(3):
            step(60 + t, True, exact=not holes)
    finally:
        a.close()
        b.close()


def test_edit_between_selection_and_first_fast_step():
    """The selection is gathered on the first FAST step: cells removed in between must not be read."""
    path = random_model("tiny-llama")
    a, b = Context(path), Context(path)
    try:
        toks = [int(t) for t in np.random.default_rng(12).integers(3, a.n_vocab, 80)]
        for x in (a, b):
            assert x.decode(toks[:40]) == 0 and x.decode(toks[40:]) == 0
        sfi = SFINative(b.ctx, n_sel_max=256, n_tail_max=16)
        sfi.set_selection(np.tile(b.occupied(), (sfi.n_layers, sfi.n_head_kv, 1)))
        sfi.set_mode(sfi.FAST)
        for x in (a, b):
            assert llama_cpp.llama_memory_seq_rm(x.mem, 0, 70, -1)
            assert x.decode([9, 10, 11]) == 0  # new tokens land in the freed cells
        assert sfi.fell_back_dense and np.array_equal(a.logits(), b.logits())
    finally:
        a.close()
        b.close()
