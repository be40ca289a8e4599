"""One llama.cpp model + context, through llama-cpp-python's low-level bindings.

This is the only module that talks to llama.cpp's generic C API (the `llama_sfi_*` functions live in
`native.py`). It keeps one reusable batch so a decode step costs a few ctypes stores, not an allocation.
"""
from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from ._native import llama_cpp
from ._progress import Progress


class ContextError(RuntimeError):
    """llama.cpp refused an operation (decode failure, allocation failure)."""


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


class LlamaContext:
    """Model, context, vocabulary and a reusable batch for sequence 0.

    The KV cache content is tracked as `self.tokens`: token i sits at position i. Callers that change
    the cache go through `truncate` so this list never lies.
    """

    KV_TYPES = {"f16": 1, "q8_0": 8, "bf16": 30, "f32": 0}

    def __init__(self, model_path: Path, n_ctx: int, n_gpu_layers: int, n_threads: int | None,
                 n_batch: int, flash_attn: bool, verbose: bool, type_kv: str = "f16"):
        llama_cpp._logger.set_verbose(verbose)
        llama_cpp.llama_backend_init()
        self.model = None
        self.ctx = None
        self._batch = None
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not model:
            raise ValueError(f"llama.cpp could not load the model {model_path} (corrupt or unsupported GGUF); "
                             "run with verbose=True for llama.cpp's reason")
        self.model = model
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(model)
        self.n_head = llama_cpp.llama_model_n_head(model)
        if n_ctx <= 0:
            n_ctx = self.n_ctx_train
        if n_ctx > self.n_ctx_train:
            self.close()
            raise ValueError(f"n_ctx={n_ctx} is above the model's training context ({self.n_ctx_train})")
        n_threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx
        cparams.n_batch = min(n_batch, n_ctx)
        cparams.n_ubatch = min(n_batch, n_ctx, 512)
        cparams.n_seq_max = 1
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        if type_kv not in self.KV_TYPES:
            self.close()
            raise ValueError(f"type_kv must be one of {', '.join(self.KV_TYPES)}, got {type_kv!r}")
        cparams.type_k = cparams.type_v = self.KV_TYPES[type_kv]
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise MemoryError(f"llama.cpp could not create a context with n_ctx={n_ctx} "
                              "(not enough memory for the KV cache?)")
        self.ctx = ctx
        self.n_ctx = llama_cpp.llama_n_ctx(ctx)
        self.n_batch = cparams.n_batch
        self.flash_attn = flash_attn
        self.memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens: list[int] = []

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if self.ctx:
            llama_cpp.llama_free(self.ctx)
            self.ctx = None
        if self.model:
            llama_cpp.llama_model_free(self.model)
            self.model = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- model facts ----------------------------------------------------------------------------
    def metadata(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        tmpl = llama_cpp.llama_model_chat_template(self.model, None)
        return tmpl.decode(errors="replace") if tmpl else None

    # -- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        data = text.encode("utf-8")
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        buf = ctypes.create_string_buffer(64)
        n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        if n < 0:
            buf = ctypes.create_string_buffer(-n)
            n = llama_cpp.llama_token_to_piece(self.vocab, token, buf, len(buf), 0, special)
        return buf.raw[:n]

    def detokenize(self, tokens: Sequence[int], special: bool = False) -> str:
        return b"".join(self.token_bytes(t, special) for t in tokens).decode("utf-8", errors="replace")

    def last_logits(self) -> np.ndarray:
        """Logits of the last decoded token: a zero-copy float32 view, valid until the next decode."""
        ptr = ctypes.cast(llama_cpp.llama_get_logits_ith(self.ctx, -1), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def is_eog(self, token: int) -> bool:
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # -- KV cache -------------------------------------------------------------------------------
    def truncate(self, n_keep: int) -> None:
        """Drop every cached token from position n_keep on."""
        if n_keep < len(self.tokens):
            if not llama_cpp.llama_memory_seq_rm(self.memory, 0, n_keep, -1):
                llama_cpp.llama_memory_clear(self.memory, True)
                n_keep = 0
            del self.tokens[n_keep:]

    def clear(self) -> None:
        llama_cpp.llama_memory_clear(self.memory, True)
        self.tokens.clear()

    # -- decoding -------------------------------------------------------------------------------
    def _fill(self, tokens: Sequence[int], start_pos: int, want_last_logits: bool) -> None:
        batch = self._batch
        n = len(tokens)
        batch.n_tokens = n
        for i, tok in enumerate(tokens):
            batch.token[i] = tok
            batch.pos[i] = start_pos + i
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = 0
            batch.logits[i] = 0
        if want_last_logits:
            batch.logits[n - 1] = 1

    def decode(self, tokens: Sequence[int], want_last_logits: bool = True) -> None:
        """Append tokens to the cache in one llama_decode call (at most n_batch tokens)."""
        if not tokens:
            return
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens exceed n_batch={self.n_batch}")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextError(f"context full: {len(self.tokens)} + {len(tokens)} tokens > n_ctx={self.n_ctx}")
        self._fill(tokens, len(self.tokens), want_last_logits)
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise ContextError(f"llama_decode failed with code {rc}")
        self.tokens.extend(tokens)

    def decode_one(self, token: int) -> None:
        """One decode step: the hot path, kept to a few ctypes stores."""
        pos = len(self.tokens)
        if pos >= self.n_ctx:
            raise ContextError(f"context full: n_ctx={self.n_ctx}")
        batch = self._batch
        batch.n_tokens = 1
        batch.token[0] = token
        batch.pos[0] = pos
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = 0
        batch.logits[0] = 1
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise ContextError(f"llama_decode failed with code {rc}")
        self.tokens.append(token)

    def prefill(self, tokens: Sequence[int], progress: bool = False, before_last_chunk=None) -> int:
        """Bring the cache to exactly `tokens`, reusing the longest cached prefix.

        Returns how many tokens were actually decoded. The last token is always decoded so that its
        logits are available for sampling. `before_last_chunk()` runs right before the final
        llama_decode (SFI makes that one a slow step); chunking is the same with or without it, so
        the cache content is bit-identical either way.
        """
        if not tokens:
            raise ValueError("empty prompt")
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)
        self.truncate(common)
        todo = list(tokens[common:])
        bar = Progress(len(todo), "prompt", enabled=progress)
        for start in range(0, len(todo), self.n_batch):
            chunk = todo[start:start + self.n_batch]
            last = start + len(chunk) == len(todo)
            if last and before_last_chunk is not None:
                before_last_chunk()
            self.decode(chunk, want_last_logits=last)
            bar.update(len(chunk))
        if progress:
            bar.close()
        return len(todo)
