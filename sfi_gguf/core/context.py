"""One llama.cpp model + context, through llama-cpp-python's low-level bindings.

This is the only module that talks to llama.cpp's generic C API (the `llama_sfi_*` functions live in
`bindings.py`). It keeps one reusable batch so a decode step costs a few ctypes stores, not an allocation.
"""
from __future__ import annotations

import ctypes
import math
import os
from pathlib import Path
from typing import Sequence

import numpy as np

from .library import llama_cpp
from .progress import Progress
from .device_picks import GREEDY, DeviceChain, DevicePicks
from .policy import top1_probability


class ContextError(RuntimeError):
    """llama.cpp refused an operation (decode failure, allocation failure), or the context is closed."""


def default_threads() -> int:
    return max(1, os.cpu_count() or 1)


def utf8(text: str) -> bytes:
    """`text` as UTF-8, refusing what is not text by saying so (a raw UnicodeEncodeError names neither the
    argument nor the cause)."""
    if not isinstance(text, str):
        raise ValueError(f"text must be a str (or UTF-8 bytes), got {type(text).__name__}: {text!r:.80}")
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"the text holds a lone surrogate {text[exc.start]!r} at position {exc.start} (half of a "
                         "UTF-16 pair, e.g. from decoding bytes with errors='surrogateescape'), which is not "
                         "Unicode text; fix or drop it (s.encode('utf-8', 'replace').decode())") from None


def _available_memory() -> int | None:
    """MemAvailable + free swap from /proc/meminfo in bytes (None where there is no /proc)."""
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:]}
    except (OSError, ValueError, IndexError):
        return None
    if "MemAvailable" not in info:
        return None
    return info["MemAvailable"] + info.get("SwapFree", 0)


def decode_one_per_sequence(ctx, batch, steps: Sequence[tuple[int, int, int]]) -> int:
    """One llama_decode of one token for each of several sequences: steps are (seq, pos, token), each row with
    its logits (row i: steps[i]); `batch` holds at least len(steps) tokens. Returns llama_decode's code."""
    batch.n_tokens = len(steps)
    for i, (seq, pos, token) in enumerate(steps):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0], batch.logits[i] = token, pos, 1, seq, 1
    return llama_cpp.llama_decode(ctx, batch)


class LlamaContext:
    """Model, context, vocabulary and a reusable batch for one sequence (`seq`, 0 by default).

    The KV cache content of the sequence is tracked as `self.tokens`: token i sits at position i.
    Callers that change the cache go through `truncate` so this list never lies.

    With n_seq_max > 1 the context holds that many sequences of n_ctx cells each, one KV stream per
    sequence (batched SFI, `sfi_gguf.core.batched`); `sequence(s)` gives the handle of sequence s.
    """

    KV_TYPES = {"f16": 1, "q8_0": 8, "q4_0": 2, "bf16": 30, "f32": 0}

    SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode

    _n_loans = 0                # lend_threads calls not yet returned ...
    _threads_before_loan = 0    # ... and the single-token decodes' threads before the first

    # picks in the graph (set_device_picks), per sequence: a context that owns its llama_context and its sequence
    # handles have them; borrowed contexts keep these defaults
    _device_picks: DevicePicks | None = None
    _all_device_picks: Sequence[DevicePicks] = ()
    _picks_on_device: DeviceChain | None = None  # ... attached, these picks: a decode copies its pick, not its logits
    _sampled_on_device: DeviceChain | None = None  # the picks the last decode made (None: it copied its logits)

    def __init__(self, model_path: Path, n_ctx: int, n_gpu_layers: int, n_threads: int | None,
                 n_batch: int, flash_attn: bool, verbose: bool, type_kv: str = "f16", split_mode: str = "layer",
                 main_gpu: int = 0, tensor_split: Sequence[float] | None = None,
                 rpc_servers: Sequence[str] | None = None, n_seq_max: int = 1, cb_eval=None,
                 offload_kqv: bool = True, n_ubatch: int | None = None):
        """cb_eval: a llama_cpp.ggml_backend_sched_eval_callback, called for every graph node (profiling,
        tests); kept alive with the context. offload_kqv False: the KV cache in host memory (llama.cpp's
        -nkvo); with SFI the compact view then lives on the device of its layer (kv_on_host). n_ubatch: the most
        tokens of a prompt in one graph (default 512, and never above n_batch)."""
        if n_seq_max < 1:
            raise ValueError(f"n_seq_max must be >= 1, got {n_seq_max}")
        llama_cpp._logger.set_verbose(verbose)
        self.seq = 0
        self._owner = True      # closes the model and context (sequence handles do not)
        self.logits_index = -1  # row of this sequence's logits in the last llama_decode's outputs
        self.kv_on_host = not offload_kqv and n_gpu_layers != 0  # the cache in host memory for layers on a device
        llama_cpp.llama_backend_init()
        self.model = None
        self.ctx = None
        self._batch = None
        mparams = llama_cpp.llama_model_default_params()
        mparams.n_gpu_layers = int(n_gpu_layers)
        self._set_devices(mparams, split_mode, main_gpu, tensor_split, rpc_servers)
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
        try:
            self._check_memory(n_ctx * n_seq_max, n_gpu_layers if offload_kqv else 0, type_kv)
        except MemoryError:
            self.close()
            raise
        n_threads = n_threads or default_threads()
        cparams = llama_cpp.llama_context_default_params()
        cparams.n_ctx = n_ctx * n_seq_max
        cparams.n_batch = max(min(n_batch, n_ctx), n_seq_max)
        cparams.n_ubatch = max(min(n_batch, n_ctx, n_ubatch or 512), n_seq_max)
        cparams.n_seq_max = n_seq_max
        cparams.kv_unified = False  # one KV stream per sequence: what batched SFI needs
        cparams.n_threads = n_threads
        cparams.n_threads_batch = n_threads
        self._cb_eval = cb_eval
        if cb_eval is not None:
            cparams.cb_eval = cb_eval
            cparams.cb_eval_user_data = None
        if type_kv not in self.KV_TYPES:
            self.close()
            raise ValueError(f"type_kv must be one of {', '.join(self.KV_TYPES)}, got {type_kv!r}")
        cparams.type_k = cparams.type_v = self.KV_TYPES[type_kv]
        cparams.offload_kqv = bool(offload_kqv)
        cparams.flash_attn_type = (llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED if flash_attn
                                   else llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED)
        ctx = llama_cpp.llama_init_from_model(model, cparams)
        if not ctx:
            self.close()
            raise MemoryError(f"llama.cpp could not create a context with n_ctx={n_ctx} "
                              "(not enough memory for the KV cache?)")
        self.ctx = ctx
        self.n_seq_max = n_seq_max
        self._device_picks = DevicePicks(ctx, 0)  # (sequence 0's: backend samplers are per sequence)
        self._all_device_picks = [self._device_picks]  # ... and its handles': detached before the context is freed
        # cells per sequence: what was asked for (llama.cpp rounds its allocation up to 256 cells)
        self.n_ctx = min(n_ctx, llama_cpp.llama_n_ctx(ctx) // n_seq_max)
        self.n_batch = min(cparams.n_batch, n_ctx)
        self.flash_attn = flash_attn
        self.type_kv = type_kv
        self.memory = llama_cpp.llama_get_memory(ctx)
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens: list[int] = []

    def _set_devices(self, mparams, split_mode: str, main_gpu: int, tensor_split, rpc_servers) -> None:
        """Which devices hold the offloaded layers, as llama-cpp-python's Llama sets them (plus RPC servers).

        split_mode "layer" (default): whole layers (and their KV cache) spread over the devices in the
        proportions of tensor_split (default: by free memory); "row": matrices split by rows across the
        GPUs; "none": everything on device main_gpu. rpc_servers ("host:port" of llama.cpp rpc-server
        processes, a list or comma-separated) puts their devices first in the list (sfi_gguf.core.devices).
        """
        if split_mode not in self.SPLIT_MODES:
            raise ValueError(f"split_mode must be one of {', '.join(self.SPLIT_MODES)}, got {split_mode!r}")
        mparams.split_mode = self.SPLIT_MODES[split_mode]
        mparams.main_gpu = int(main_gpu)
        self._tensor_split = self._devices = None  # kept alive until the model is loaded
        if tensor_split is not None:
            n_max = llama_cpp.llama_max_devices()
            try:
                values = [float(x) for x in tensor_split]
            except (TypeError, ValueError):
                values = [math.nan]
            if len(values) > n_max or any(not 0 <= x < math.inf for x in values):
                raise ValueError(f"tensor_split must hold at most {n_max} proportions >= 0, got {list(tensor_split)}")
            self._tensor_split = (ctypes.c_float * n_max)(*values)
            mparams.tensor_split = self._tensor_split
        if rpc_servers:
            from .devices import model_devices

            if not isinstance(rpc_servers, (str, list, tuple)) or not all(isinstance(e, str) for e in rpc_servers):
                raise ValueError(f"rpc_servers must be 'host:port' strings (a list, or comma-separated), got {rpc_servers!r}")

            self._devices = model_devices([e.strip() for e in rpc_servers.split(",")] if isinstance(rpc_servers, str)
                                          else list(rpc_servers))
            mparams.devices = ctypes.cast(self._devices, ctypes.c_void_p)

    def _check_memory(self, n_ctx: int, n_gpu_layers: int, type_kv: str) -> None:
        """Refuse a context that cannot fit in this machine's memory, before llama.cpp tries.

        Why: llama.cpp sizes its per-cell bookkeeping (host memory, tens of bytes per cell) and the KV
        cache from n_ctx; for an n_ctx far beyond the RAM it fills gigabytes before it fails, or gets the
        process killed by the OOM killer, instead of returning an error. The estimate is a lower bound
        (f16-sized K and V rows of every layer, 40 bytes of cell metadata), checked against
        MemAvailable; the KV part only when it stays on the host (no offloaded layers).
        """
        available = _available_memory()
        if available is None:
            return
        n_layer = llama_cpp.llama_model_n_layer(self.model)
        n_head_kv = llama_cpp.llama_model_n_head_kv(self.model) or self.n_head
        head_dim = llama_cpp.llama_model_n_embd(self.model) // max(1, self.n_head)
        kv_bytes = {"f32": 4, "f16": 2, "bf16": 2, "q8_0": 1.0625, "q4_0": 0.5625}.get(type_kv, 2)
        per_cell = 40 + (2 * n_layer * n_head_kv * head_dim * kv_bytes if n_gpu_layers == 0 else 0)
        need = n_ctx * per_cell
        if need > available:
            raise MemoryError(f"n_ctx={n_ctx} needs at least {need / 2**30:.1f} GiB for the KV cache, this machine "
                              f"has {available / 2**30:.1f} GiB available; use a smaller n_ctx")

    def sequence(self, seq: int) -> "LlamaContext":
        """The handle of sequence seq of this context: same model and cache, its own token list and batch."""
        if not 0 <= seq < self.n_seq_max:
            raise ValueError(f"seq must be in [0, {self.n_seq_max}), got {seq}")
        handle = object.__new__(LlamaContext)
        handle.__dict__.update(self.__dict__)
        handle.seq, handle._owner, handle.logits_index, handle.tokens = seq, False, -1, []
        handle._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        handle._device_picks = DevicePicks(self.ctx, seq)
        self._all_device_picks.append(handle._device_picks)
        handle._picks_on_device = handle._sampled_on_device = None
        return handle

    def _closed(self) -> ContextError:
        return ContextError("the model was closed (SFILlama.close()); create a new one")

    # -- lifetime -------------------------------------------------------------------------------
    def close(self) -> None:
        if self._batch is not None:
            llama_cpp.llama_batch_free(self._batch)
            self._batch = None
        if not self._owner:
            if self.ctx and self._device_picks is not None:
                self._device_picks.detach()  # (a no-op once the owner closed: it detached them all)
            self.ctx = self.model = None
            return
        if self.ctx:
            for device_picks in self._all_device_picks:
                device_picks.detach()
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
        if not self.model:
            raise self._closed()
        buf = ctypes.create_string_buffer(4096)
        n = llama_cpp.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode(errors="replace") if n >= 0 else None

    def chat_template(self) -> str | None:
        if not self.model:
            raise self._closed()
        tmpl = llama_cpp.llama_model_chat_template(self.model, None)
        return tmpl.decode(errors="replace") if tmpl else None

    # -- text <-> tokens ------------------------------------------------------------------------
    def tokenize(self, text: str | bytes, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """`text` (a str, or bytes: UTF-8 text, as llama-cpp-python's tokenize takes it) as token ids."""
        if not self.model:
            raise self._closed()
        data = bytes(text) if isinstance(text, (bytes, bytearray)) else utf8(text)
        cap = len(data) + 16
        buf = (llama_cpp.llama_token * cap)()
        n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        if n < 0:
            cap = -n
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(self.vocab, data, len(data), buf, cap, add_special, parse_special)
        return list(buf[:n])

    def token_bytes(self, token: int, special: bool = False) -> bytes:
        if not self.model:
            raise self._closed()
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
        if not self.ctx:
            raise self._closed()
        if self._sampled_on_device:
            raise ContextError("the last decode picked its token on the device (set_device_picks) and copied no "
                               "logits: detach it before a decode whose logits are read")
        ptr = ctypes.cast(llama_cpp.llama_get_logits_ith(self.ctx, self.logits_index), ctypes.POINTER(ctypes.c_float))
        return np.ctypeslib.as_array(ptr, shape=(self.n_vocab,))

    def set_device_picks(self, picks: DeviceChain | None) -> bool:
        """Picks made in the decode's graph from the next decode on (`picked_token`, `greedy_probability`; `last_logits`
        is then refused), or no longer (None), for this sequence: the greedy pick, or a sampling chain with its seed
        (`Sampler.device_chain`). A context that owns its llama_context and its sequence handles have them (not a
        borrowed one), where the output's device runs their ops: returns whether they are on."""
        if not self.ctx:
            if picks is None:  # (a generation's end after the context was closed)
                return False
            raise self._closed()
        if self._device_picks is None:
            return False
        if picks is not None:
            self._picks_on_device = picks if self._device_picks.attach(picks) else None
        else:
            self._device_picks.detach()
            self._picks_on_device = None
        return self._picks_on_device is not None

    def set_device_greedy(self, on: bool) -> bool:
        """`set_device_picks` of the greedy pick (on), or of none."""
        return self.set_device_picks(GREEDY if on else None)

    def picked_token(self) -> int | None:
        """The token the last decode's graph picked for this sequence (`set_device_picks`), or None when it copied
        the logits instead."""
        return self._device_picks.token(self.logits_index) if self._sampled_on_device else None

    def greedy_token(self) -> int:
        """The most likely next token after the last decode (the first of equal maxima on the host)."""
        if self._sampled_on_device:
            if not self._sampled_on_device.greedy:
                raise ContextError("the last decode sampled its token on the device (set_device_picks) and copied no "
                                   "logits: its greedy pick is not known")
            return self._device_picks.token(self.logits_index)
        return int(np.argmax(self.last_logits()))

    def greedy_probability(self) -> float:
        """The probability of `greedy_token` (the model's top-1 probability) under the softmax of the last decode's
        logits."""
        if self._sampled_on_device:
            return self._device_picks.probability(self.logits_index)
        return top1_probability(self.last_logits())

    def is_eog(self, token: int) -> bool:
        if not self.model:
            raise self._closed()
        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    # -- KV cache -------------------------------------------------------------------------------
    def lend_threads(self, n_kept: int) -> int:
        """While other work runs on the host's cores (an asynchronous refresh), single-token decodes run on n_kept of
        the context's threads (their host part is small with the layers on a GPU): returns how many it lent, to give
        back with `return_threads`. Loans nest (the sequences of a batch); the last return restores the count."""
        if not self._n_loans:
            self._threads_before_loan = llama_cpp.llama_n_threads(self.ctx)
        self._n_loans += 1
        n_lent = max(0, self._threads_before_loan - max(1, n_kept))
        llama_cpp.llama_set_n_threads(self.ctx, self._threads_before_loan - n_lent, llama_cpp.llama_n_threads_batch(self.ctx))
        return n_lent

    def return_threads(self) -> None:
        self._n_loans -= 1
        if not self._n_loans:
            llama_cpp.llama_set_n_threads(self.ctx, self._threads_before_loan, llama_cpp.llama_n_threads_batch(self.ctx))

    def truncate(self, n_keep: int) -> None:
        """Drop every cached token from position n_keep on."""
        if not self.ctx:
            raise self._closed()
        if n_keep < len(self.tokens):
            if not llama_cpp.llama_memory_seq_rm(self.memory, self.seq, n_keep, -1):
                self.clear()
                n_keep = 0
            del self.tokens[n_keep:]

    def sync(self) -> None:
        """Make `self.tokens` agree with the cache again after an interrupted call.

        Why: a KeyboardInterrupt (or any exception) raised between llama_decode returning and the token
        list being updated leaves one token in the cache that the list does not know about; the next
        decode at that position would be refused. The cache is the truth: drop what the list does not
        cover, and forget list entries the cache does not hold.
        """
        if not self.ctx:
            raise self._closed()
        n_cached = llama_cpp.llama_memory_seq_pos_max(self.memory, self.seq) + 1
        if n_cached > len(self.tokens):
            if not llama_cpp.llama_memory_seq_rm(self.memory, self.seq, len(self.tokens), -1):
                self.clear()
        elif n_cached < len(self.tokens):
            del self.tokens[max(n_cached, 0):]

    def clear(self) -> None:
        if not self.ctx:
            raise self._closed()
        if self.n_seq_max == 1:
            llama_cpp.llama_memory_clear(self.memory, True)
        else:
            llama_cpp.llama_memory_seq_rm(self.memory, self.seq, -1, -1)
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
            batch.seq_id[i][0] = self.seq
            batch.logits[i] = 0
        if want_last_logits:
            batch.logits[n - 1] = 1

    def decode(self, tokens: Sequence[int], want_last_logits: bool = True) -> None:
        """Append tokens to the cache in one llama_decode call (at most n_batch tokens)."""
        if not tokens:
            return
        if not self.ctx:
            raise self._closed()
        if len(tokens) > self.n_batch:
            raise ValueError(f"{len(tokens)} tokens exceed n_batch={self.n_batch}")
        if len(self.tokens) + len(tokens) > self.n_ctx:
            raise ContextError(f"context full: {len(self.tokens)} + {len(tokens)} tokens > n_ctx={self.n_ctx}")
        self._fill(tokens, len(self.tokens), want_last_logits)
        self.logits_index = -1
        self._sampled_on_device = self._picks_on_device if want_last_logits else None
        rc = llama_cpp.llama_decode(self.ctx, self._batch)
        if rc != 0:
            raise ContextError(f"llama_decode failed with code {rc}")
        self.tokens.extend(tokens)

    def decoded_in_batch(self, token: int, row: int) -> None:
        """`token` of this sequence was row `row` of a llama_decode of several sequences (`decode_one_per_sequence`):
        its logits, or its device pick, are that row's."""
        self.tokens.append(token)
        self.logits_index = row
        self._sampled_on_device = self._picks_on_device

    def decode_one(self, token: int) -> None:
        """One decode step: the hot path, kept to a few ctypes stores."""
        pos = len(self.tokens)
        if pos >= self.n_ctx or not self.ctx:
            raise self._closed() if not self.ctx else ContextError(f"context full: n_ctx={self.n_ctx}")
        batch = self._batch
        batch.n_tokens = 1
        batch.token[0] = token
        batch.pos[0] = pos
        batch.n_seq_id[0] = 1
        batch.seq_id[0][0] = self.seq
        batch.logits[0] = 1
        self.logits_index = -1
        self._sampled_on_device = self._picks_on_device
        rc = llama_cpp.llama_decode(self.ctx, batch)
        if rc != 0:
            raise ContextError(f"llama_decode failed with code {rc}")
        self.tokens.append(token)

    def prefill(self, tokens: Sequence[int], progress: bool = False, before_last_chunk=None,
                last_chunk: int = 0) -> int:
        """Bring the cache to exactly `tokens`, reusing the longest cached prefix.

        Returns how many tokens were actually decoded. The last token is always decoded so that its
        logits are available for sampling. `before_last_chunk()` runs right before the final
        llama_decode (SFI makes that one a slow step); chunking is the same with or without it, so
        the cache content is bit-identical either way.

        `last_chunk` n > 0: the prompt's last n tokens (all of a shorter prompt, at most n_batch) are the
        final llama_decode, on their own after the rest, also when the cache holds them (they are decoded
        again). Where a prompt splits then depends on the prompt alone, not on what the cache held: the same
        prompt again decodes exactly as a fresh prefill did, and leaves the same cache and logits bit for bit
        (llama.cpp's CPU kernels round a row differently in another batch shape, so re-decoding only the
        last token, after a fresh prefill decoded the whole prompt at once, would not). The steppers pass
        `SFIConfig.n_prefill_queries`: SFI's bootstrap reads its query rows from that decode. 0: the
        tokens not cached, in n_batch chunks.
        """
        if not tokens:
            raise ValueError("empty prompt")
        self.sync()
        common = 0
        for a, b in zip(self.tokens, tokens):
            if a != b:
                break
            common += 1
        common = min(common, len(tokens) - 1)
        last_chunk = min(max(0, last_chunk), self.n_batch, len(tokens))
        if last_chunk:
            common = min(common, len(tokens) - last_chunk)
        self.truncate(common)
        todo = list(tokens[common:])
        head = len(todo) - last_chunk  # decoded in n_batch chunks before the last one
        starts = list(range(0, head, self.n_batch)) + ([head] if last_chunk else [])
        bar = Progress(len(todo), "prompt", enabled=progress)
        for start, end in zip(starts, starts[1:] + [len(todo)]):
            chunk = todo[start:end]
            last = end == len(todo)
            if last and before_last_chunk is not None:
                before_last_chunk()
            self.decode(chunk, want_last_logits=last)
            bar.update(len(chunk))
        if progress:
            bar.close()
        return len(todo)


class BorrowedContext(LlamaContext):
    """The model and context of a `llama_cpp.Llama`, seen as a `LlamaContext` (sequence 0) for the SFI steppers.

    It owns neither (closing it frees only its batch). `n_ctx` is the Llama's (the length of its
    `input_ids`; llama.cpp may allocate more cells). `scores` (the Llama's `scores` array, with
    `logits_all=True`): every decoded row's logits are copied there, row i for position i, as
    llama-cpp-python's own `eval` does.
    """

    def __init__(self, model, ctx, n_ctx: int, n_batch: int, flash_attn: bool, scores: np.ndarray | None = None,
                 kv_on_host: bool = False):
        self.seq = 0
        self.kv_on_host = kv_on_host
        self._owner = False
        self.logits_index = -1
        self._cb_eval = None
        self._batch = None
        self.model = model
        self.ctx = ctx
        self.vocab = llama_cpp.llama_model_get_vocab(model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)
        self.n_ctx_train = llama_cpp.llama_model_n_ctx_train(model)
        self.n_head = llama_cpp.llama_model_n_head(model)
        self.n_seq_max = 1
        self.n_ctx = int(n_ctx)
        self.n_batch = int(n_batch)
        self.flash_attn = flash_attn
        self.memory = llama_cpp.llama_get_memory(ctx)
        self.scores = scores
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.tokens: list[int] = []

    def _fill(self, tokens: Sequence[int], start_pos: int, want_last_logits: bool) -> None:
        super()._fill(tokens, start_pos, want_last_logits)
        if self.scores is not None:
            for i in range(len(tokens)):
                self._batch.logits[i] = 1

    def decode(self, tokens: Sequence[int], want_last_logits: bool = True) -> None:
        start = len(self.tokens)
        super().decode(tokens, want_last_logits)
        if self.scores is not None and tokens:
            n = len(tokens)
            rows = np.ctypeslib.as_array(llama_cpp.llama_get_logits(self.ctx), shape=(n * self.n_vocab,))
            self.scores[start:start + n, :].reshape(-1)[:] = rows

    def decode_one(self, token: int) -> None:
        super().decode_one(token)
        if self.scores is not None:
            self.scores[len(self.tokens) - 1, :] = self.last_logits()
