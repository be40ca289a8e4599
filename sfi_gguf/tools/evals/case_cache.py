"""A disk cache of what a long evaluation case costs before any SFI policy runs: the prompt's prefilled KV
(llama.cpp's sequence state) and dense's reference answer.

Why: on a CPU a 16K case spends ~15 minutes prefilling and ~5 dense decoding, an SFI policy 15-60 s; a
later run that adds a policy to cases already done loads both and pays only for the new policy.

Entries are keyed by the model file's identity, the context settings that change the KV's bits (KV
type, flash attention, batch size, offloaded layers) and the prompt's tokens (dense's reference also by
its max_tokens). A loaded state gives the same results as a fresh prefill: every prefill decodes the
prompt's last `SFIConfig.n_prefill_queries` tokens again (`LlamaContext.prefill`), and the native hooks
drop the SFI view and key norms when llama.cpp reads a state. Size: the state is the prompt's KV,
~12 KB per token for the default 0.5B model (~200 MB a 16K case); delete the folder to free it.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
from pathlib import Path

import llama_cpp
import numpy as np

from ... import models
from ..agreement import DenseReference

SUBDIR = "eval-cases"


def default_root() -> Path:
    return models.cache_dir() / SUBDIR


def model_identity(path: Path) -> str:
    """The model file's name, size and the hash of its first and last MiB (cheap, and changes with the weights)."""
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    return f"{path.name}:{size}:{digest.hexdigest()[:16]}"


class CaseCache:
    """Prompt states and dense references of one model and context (`llm`, an SFILlama) under `root`."""

    def __init__(self, llm, root: str | os.PathLike | None = None):
        ctx = llm.context
        self.root = Path(root) if root is not None else default_root()
        self.root.mkdir(parents=True, exist_ok=True)
        self.stem = llm.model_path.stem
        self._identity = (f"{model_identity(llm.model_path)}|kv={ctx.type_kv}|fa={int(ctx.flash_attn)}"
                          f"|batch={ctx.n_batch}|gpu_layers={llm.n_gpu_layers}")

    def _path(self, tokens, suffix: str, *extra) -> Path:
        digest = hashlib.sha256(self._identity.encode())
        digest.update(np.asarray(tokens, dtype=np.int32).tobytes())
        for x in extra:
            digest.update(f"|{x}".encode())
        return self.root / f"{self.stem}-{len(tokens)}-{digest.hexdigest()[:24]}{suffix}"

    # -- the prompt's KV --------------------------------------------------------------------------
    def restore_prompt(self, llm, tokens: list[int]) -> bool:
        """Bring `llm`'s cache to the stored state of `tokens`, if one is stored. True: the cache holds the prompt."""
        ctx = llm.context
        n = len(tokens)
        if ctx.tokens[:n] == list(tokens):
            return True
        path = self._path(tokens, ".state")
        if not path.exists():
            return False
        ctx.clear()
        got = (llama_cpp.llama_token * n)()
        n_got = ctypes.c_size_t(0)
        read = llama_cpp.llama_state_seq_load_file(ctx.ctx, str(path).encode(), ctx.seq, got, n, ctypes.byref(n_got))
        if not read or n_got.value != n or list(got) != list(tokens):
            ctx.clear()  # unreadable (another llama.cpp build's format, a cut file): prefill as if not stored
            return False
        ctx.tokens[:] = tokens
        ctx.sync()
        return ctx.tokens == list(tokens)

    def store_prompt(self, llm, tokens: list[int]) -> None:
        """Keep the state of `tokens` (the cache is cut back to them), unless it is stored already or the cache
        does not hold them."""
        ctx = llm.context
        n = len(tokens)
        path = self._path(tokens, ".state")
        if path.exists() or ctx.tokens[:n] != list(tokens):
            return
        ctx.truncate(n)
        tmp = path.with_name(path.name + ".tmp")
        array = (llama_cpp.llama_token * n)(*tokens)
        if llama_cpp.llama_state_seq_save_file(ctx.ctx, str(tmp).encode(), ctx.seq, array, n):
            os.replace(tmp, path)
        else:
            tmp.unlink(missing_ok=True)

    # -- dense's reference answer -------------------------------------------------------------------
    def reference(self, tokens: list[int], max_tokens: int) -> DenseReference | None:
        path = self._path(tokens, ".npz", "reference", max_tokens)
        if not path.exists():
            return None
        with np.load(path) as z:
            return DenseReference(tokens=[int(t) for t in z["tokens"]], top=z["top"], logp=z["logp"],
                                  argmax=z["argmax"])

    def store_reference(self, tokens: list[int], max_tokens: int, ref: DenseReference) -> None:
        path = self._path(tokens, ".npz", "reference", max_tokens)
        tmp = path.with_name(path.name + ".tmp.npz")
        np.savez(tmp, tokens=np.asarray(ref.tokens, dtype=np.int64), top=ref.top, logp=ref.logp, argmax=ref.argmax)
        os.replace(tmp, path)
