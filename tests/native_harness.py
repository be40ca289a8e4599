"""Raw llama.cpp contexts for the native tests: random-weight models, contexts with a reusable batch,
tensors observed through cb_eval, and the dense-vs-FAST pair that the exactness tests compare."""
from __future__ import annotations

import collections
import ctypes
import functools
import os
from pathlib import Path

import numpy as np
import pytest

from sfi_gguf.core import bindings, library
from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.context import decode_one_per_sequence
from sfi_gguf.core.bindings import SFINative

# one thread: the models are tiny, and OpenMP spin-waits badly when the 2 cores of CI are shared
THREADS = int(os.environ.get("SFI_TEST_THREADS", "1"))
NGL = int(os.environ.get("SFI_TEST_NGL", "0"))
GGML_TYPE_F16 = 1
GGML_TYPE_Q8_0 = 8


# -- helpers ---------------------------------------------------------------------------------------

class ggml_tensor(ctypes.Structure):
    """Head of struct ggml_tensor (ggml.h), enough to read a tensor seen by cb_eval."""
    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * 4),
        ("nb", ctypes.c_size_t * 4),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
    ]


@functools.cache
def _ggml_base():
    base = ctypes.CDLL(str(next(Path(library.find_lib_dir()).glob("libggml-base.*"))))
    base.ggml_op_name.restype = ctypes.c_char_p
    base.ggml_op_name.argtypes = [ctypes.c_int]
    return base


def ggml_op_name(op: int) -> str:
    return _ggml_base().ggml_op_name(op).decode()


class Capture:
    """cb_eval callback that copies F32 tensors whose name starts with one of `prefixes`.

    Only for host (CPU) tensors: the tests that use it run on the CPU backend.
    """

    def __init__(self, prefixes):
        self.prefixes = tuple(p.encode() for p in prefixes)
        self.seen: dict[str, list[np.ndarray]] = {}
        self.ops: dict[str, set[str]] = {}  # the ops (ggml_op_name) of the nodes of each name, of any type
        self.all_ops: collections.Counter = collections.Counter()  # the ops of every node computed, any name
        self.enabled = True

        def cb(t_ptr, ask, _user):
            t = ctypes.cast(t_ptr, ctypes.POINTER(ggml_tensor)).contents
            name = t.name
            if ask and self.enabled:
                self.all_ops[ggml_op_name(t.op)] += 1
            if ask and self.enabled and name.startswith(self.prefixes):
                self.ops.setdefault(name.decode(), set()).add(ggml_op_name(t.op))
            want = self.enabled and name.startswith(self.prefixes) and t.type == 0
            if ask:
                return want
            if want and t.data:
                ne = [t.ne[i] for i in range(4)]
                nb = [t.nb[i] for i in range(4)]
                size = (ne[3] - 1) * nb[3] + (ne[2] - 1) * nb[2] + (ne[1] - 1) * nb[1] + ne[0] * 4
                raw = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_uint8)), shape=(size,))
                arr = np.lib.stride_tricks.as_strided(raw.view(np.float32) if nb[0] == 4 else raw,
                                                      shape=ne[::-1], strides=nb[::-1]).copy()
                self.seen.setdefault(name.decode(), []).append(arr)
            return True

        self.fn = llama_cpp.ggml_backend_sched_eval_callback(cb)

    def last(self, name):
        return self.seen[name][-1]

    def clear(self):
        self.seen.clear()


class Model:
    def __init__(self, path, n_gpu_layers=NGL):
        llama_cpp._logger.set_verbose(False)
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        assert self.ptr, f"cannot load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def close(self):
        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None


class Ctx:
    """A context for sequence 0 (or n_seq_max sequences) with a reusable batch."""

    def __init__(self, model: Model, n_ctx=1024, flash_attn=True, type_kv=GGML_TYPE_F16, n_seq_max=1,
                 capture: Capture | None = None, n_batch=512, kv_unified=False, offload_kqv=True):
        self.model = model
        cp = llama_cpp.llama_context_default_params()
        cp.offload_kqv = offload_kqv
        cp.n_ctx = n_ctx
        cp.n_batch = n_batch
        cp.n_ubatch = n_batch
        cp.n_seq_max = n_seq_max
        cp.kv_unified = kv_unified
        cp.n_threads = THREADS
        cp.n_threads_batch = THREADS
        cp.type_k = type_kv
        cp.type_v = type_kv
        cp.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                              else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        if capture is not None:
            cp.cb_eval = capture.fn
            cp.cb_eval_user_data = None
        self.capture = capture
        self.ctx = llama_cpp.llama_init_from_model(model.ptr, cp)
        assert self.ctx
        self.mem = llama_cpp.llama_get_memory(self.ctx)
        self.batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0

    def decode(self, tokens, pos0=None, all_logits=False):
        pos0 = self.n_past if pos0 is None else pos0
        b = self.batch
        b.n_tokens = len(tokens)
        for i, t in enumerate(tokens):
            b.token[i] = int(t)
            b.pos[i] = pos0 + i
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = 0
            b.logits[i] = all_logits or i == len(tokens) - 1
        rc = llama_cpp.llama_decode(self.ctx, b)
        assert rc == 0, f"llama_decode: {rc}"
        self.n_past = max(self.n_past, pos0 + len(tokens))

    def logits(self, i=-1):
        p = llama_cpp.llama_get_logits_ith(self.ctx, i)
        return np.ctypeslib.as_array(p, shape=(self.model.n_vocab,)).copy()

    def seq_rm(self, p0, p1):
        assert llama_cpp.llama_memory_seq_rm(self.mem, 0, p0, p1)

    def close(self):
        if self.batch is not None:
            llama_cpp.llama_batch_free(self.batch)
            self.batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None


def tokens_for(model: Model, n, seed=0):
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, model.n_vocab, n)]


def nmse(a, b):
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def all_cells(sfi: SFINative, n_cells: int, rng=None) -> np.ndarray:
    """Every cell [0, n_cells) for every (layer, head); permuted per head when rng is given."""
    sel = np.empty((sfi.n_layers, sfi.n_head_kv, n_cells), dtype=np.int32)
    for i in range(sfi.n_layers):
        for h in range(sfi.n_head_kv):
            sel[i, h] = rng.permutation(n_cells) if rng is not None else np.arange(n_cells)
    return sel


# flash attention off: the cache holds V transposed, the view does not (and the CPU runs the plain,
# often faster, attention path); every exactness test below runs both ways
FLASH_ATTN = [pytest.param(True, id="fa"), pytest.param(False, id="no_fa")]


def run_pair(model, n_prefill, n_steps, make_sel, type_kv=GGML_TYPE_F16, n_tail_max=64, n_ctx=1024, seed=0,
             flash_attn=True, offload_kqv=True):
    """Dense context A and FAST context B fed the same tokens (B's greedy choices are A's)."""
    a = Ctx(model, n_ctx=n_ctx, type_kv=type_kv, flash_attn=flash_attn, offload_kqv=offload_kqv)
    b = Ctx(model, n_ctx=n_ctx, type_kv=type_kv, flash_attn=flash_attn, offload_kqv=offload_kqv)
    try:
        toks = tokens_for(model, n_prefill, seed)
        a.decode(toks)
        b.decode(toks)
        sfi = SFINative(b.ctx, n_sel_max=max(n_prefill, 16), n_tail_max=n_tail_max)
        sfi.set_selection(make_sel(sfi, n_prefill))
        sfi.set_mode(sfi.FAST)
        out = []
        tok = int(np.argmax(a.logits()))
        for _ in range(n_steps):
            a.decode([tok])
            b.decode([tok])
            assert sfi.status() & bindings.STATUS_LAST_FAST, sfi.status()
            la, lb = a.logits(), b.logits()
            out.append((la, lb))
            tok = int(np.argmax(la))
        return out
    finally:
        a.close()
        b.close()


# -- several sequences in one context ----------------------------------------------------------------

N_SEQ = 3
N_CTX_SEQ = 512


class MultiCtx(Ctx):
    """A context with one KV stream per sequence and a batch of up to one token per sequence."""

    def __init__(self, model: Model, n_seq=N_SEQ, flash_attn=True, type_kv=GGML_TYPE_F16, offload_kqv=True):
        super().__init__(model, n_ctx=n_seq * N_CTX_SEQ, flash_attn=flash_attn, n_seq_max=n_seq, type_kv=type_kv,
                         offload_kqv=offload_kqv)
        self.n_past = [0] * n_seq

    def prefill(self, seq, tokens):
        b = self.batch
        b.n_tokens = len(tokens)
        for i, tok in enumerate(tokens):
            b.token[i], b.pos[i], b.n_seq_id[i], b.seq_id[i][0] = int(tok), self.n_past[seq] + i, 1, seq
            b.logits[i] = i == len(tokens) - 1
        assert llama_cpp.llama_decode(self.ctx, b) == 0
        self.n_past[seq] += len(tokens)

    def step(self, tokens: dict[int, int]) -> dict[int, np.ndarray]:
        """One token for each sequence in `tokens` (seq -> token), in one llama_decode; logits per seq."""
        seqs = sorted(tokens)
        assert decode_one_per_sequence(self.ctx, self.batch, [(s, self.n_past[s], int(tokens[s])) for s in seqs]) == 0
        out = {}
        for i, s in enumerate(seqs):
            self.n_past[s] += 1
            out[s] = self.logits(i)
        return out


def seq_cells(sfi: SFINative, seq: int) -> np.ndarray:
    return np.flatnonzero(sfi.cell_pos(seq) >= 0).astype(np.int32)


def select_all(sfi: SFINative, seq: int, order=None) -> None:
    cells = seq_cells(sfi, seq)
    sel = np.broadcast_to(cells, (sfi.n_layers, sfi.n_head_kv, len(cells))) if order is None else cells[order]
    sfi.set_selection(np.ascontiguousarray(sel), seq=seq)
