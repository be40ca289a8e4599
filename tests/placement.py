"""Helpers of test_multi_gpu.py and test_rpc.py: a model with its layers on chosen devices, llama.cpp's
log (to see which devices got the KV cache and the SFI view), and test_native's exactness check on it."""
from __future__ import annotations

import ctypes
import re
from contextlib import contextmanager

import numpy as np

from sfi_gguf.core import log as sfi_log
from sfi_gguf.core.library import llama_cpp
from native_harness import GGML_TYPE_F16, Model, all_cells, run_pair  # tests/ is on sys.path (pytest's import mode)

SPLIT_LAYER = llama_cpp.LLAMA_SPLIT_MODE_LAYER


class PlacedModel(Model):
    """native_harness.Model loaded with n_gpu_layers, split_mode, main_gpu and an explicit device list."""

    def __init__(self, path, n_gpu_layers=99, split_mode=SPLIT_LAYER, main_gpu=0, devices=None):
        llama_cpp.llama_backend_init()
        mp = llama_cpp.llama_model_default_params()
        mp.n_gpu_layers = n_gpu_layers
        mp.split_mode = split_mode
        mp.main_gpu = main_gpu
        if devices is not None:  # a NULL-terminated ggml_backend_dev_t array (sfi_gguf.core.devices.model_devices)
            mp.devices = ctypes.cast(devices, ctypes.c_void_p)
        self.ptr = llama_cpp.llama_model_load_from_file(str(path).encode(), mp)
        assert self.ptr, f"cannot load {path}"
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)


@contextmanager
def llama_log():
    """Everything llama.cpp and ggml log inside the block, as a list of text pieces."""
    pieces: list[str] = []

    @llama_cpp.llama_log_callback
    def callback(level, text, user_data):
        pieces.append(text.decode(errors="replace"))

    llama_cpp.llama_log_set(callback, ctypes.c_void_p(0))
    try:
        yield pieces
    finally:
        sfi_log.install()


def buffer_names(log: list[str], what: str) -> set[str]:
    """Buffers of the "KV" cache or the "SFI view" logged while contexts were created: CUDA0, RPC0[host:port] ..."""
    return set(re.findall(rf"(\S+) {what} buffer size", "".join(log)))


def all_cells_equal_dense(model, n_steps=64, flash_attn=True, n_prefill=200, type_kv=GGML_TYPE_F16, offload_kqv=True):
    """A FAST context whose selection is every cell, in order, against a dense one over n_steps greedy steps:
    same argmax at every step and max |logit difference| < 5e-3 (the tolerance of test_native's
    reordered-cells test). Returns (max difference, bit-identical at every step)."""
    out = run_pair(model, n_prefill, n_steps, lambda sfi, n: all_cells(sfi, n), n_tail_max=n_steps,
                   flash_attn=flash_attn, type_kv=type_kv, offload_kqv=offload_kqv)
    assert all(la.argmax() == lb.argmax() for la, lb in out)
    d = max(float(np.abs(la - lb).max()) for la, lb in out)
    assert d < 5e-3, d
    return d, all(np.array_equal(la, lb) for la, lb in out)
