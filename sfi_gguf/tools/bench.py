"""`sfi-gguf bench`: decode speed of SFI against dense decoding, same process, same context.

For every depth D the context holds D tokens of natural text. Then N tokens of the text's own
continuation are decoded teacher-forced (each step feeds the text's next token, so sentence-start
triggers fire as they would in real text; each step still takes the greedy argmax a real decode
takes): once densely and once with SFI, one after the other on the same KV cache (the prompt is
prefilled once and reused). The ceiling is dense decoding at a depth equal to the SFI memory
(sink + k_head + recent): a fast step cannot be cheaper than that.

Random-weight models in the shape of a real one (`random_model.SHAPES`) carry the default model's
tokenizer, so text, boundaries and triggers are those of real text; weights do not change the time.
"""
from __future__ import annotations

import argparse
import ctypes
import dataclasses
import os
import json
import platform
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from ..core.config import SFIConfig
from ..core.policy import TriggerPolicy
from ..core.stepper import Stepper
from .provenance import git_commit

DEFAULT_DEPTHS = (8192, 32768, 65536, 131072)


@dataclasses.dataclass
class BenchRow:
    """One depth: dense vs SFI decode speed from one run (JSON row of benchmarks/results)."""

    hardware: str
    model: str
    model_shape: str
    weight_type: str
    depth: int
    k_head: int
    budget: int
    decoded_tokens: int
    dense_tok_s: float
    sfi_tok_s: float
    ceiling_tok_s: float
    ratio: float
    slow_steps: int
    fast_steps: int
    dense_steps: int
    t_fast_s: float
    t_slow_s: float
    t_selector_s: float
    t_python_s: float
    flash_attn: bool
    n_gpu_layers: int
    n_threads: int
    policy: str
    git_commit: str
    batch: int = 1
    stagger: int = 0               # batched: steps between the sequences' starts (0: all at once), see run_bench_batched
    mixed_steps: int = 0           # batched: steps that held slow and fast sequences
    split_mode: str = "layer"
    n_gpus: int = 0                # GPUs holding layers (llama.cpp's device count; 0 on the CPU)
    selection_delay: int = 0       # > 0: the Selector ran in a background thread, overlapped with fast steps
    t_selector_background_s: float = 0.0  # its time there (not on the decoding thread)
    min_context: int = 0           # SFI below this context decodes densely
    device_selector: bool = False  # the Selector ran in the slow step's graph (when it had candidates)
    refresh_layer_groups: int = 1  # > 1: a device-Selector refresh renewed one group of layers in turn
    refresh_grid: int = 1          # > 1: slow steps fell on the steps that are multiples of it (batched: the batch's)
    slow_reasons: dict = dataclasses.field(default_factory=dict)  # why the slow steps fired (policy reasons)
    confidence_source: str = "model"  # what the low-confidence rule read: the model's own, or "trace: <model>"
    config_overrides: dict = dataclasses.field(default_factory=dict)  # SFIConfig fields not at their defaults
    composite_ops: bool = False    # fused_ops off (LLAMA_SFI_FUSED=0 or --variant fused_ops=off): SFI's fused ops
    #                                replaced by their composite definition
    fa_evidence_env: str | None = None  # LLAMA_SFI_FA_EVIDENCE as set ("0": a slow step's attention is flash
    #                                     attention + the evidence op even on a GPU; None: the default)
    keep_graphs_env: str | None = None  # LLAMA_SFI_KEEP_GRAPHS as set ("0": fast steps take the context's graphs)
    cuda_graphs_disabled: bool = False  # GGML_CUDA_DISABLE_GRAPHS set: every graph launched kernel by kernel
    kv_on_host: bool = False       # the KV cache in host memory (run_bench_kv_on_host): dense as llama.cpp runs it with
    #                                offload_kqv=False, SFI with only its view on the GPU
    dense_vram_tok_s: float = 0.0  # kv_on_host: dense with the cache in GPU memory (0: it did not fit)
    sfi_async_tok_s: float = 0.0   # kv_on_host: SFI with its refreshes computed on the CPU while the GPU decodes
    #                                (async_refresh) ...
    async_refreshes: int = 0       # ... their number, the triggers skipped while one was computed, the seconds
    async_skipped: int = 0         #     the worker took per refresh (export over the host cache + Selector)
    t_async_refresh_s: float = 0.0
    t_async_parts_s: dict = dataclasses.field(default_factory=dict)  # the async run's decoding thread: seconds of its
    #                                slow steps, fast steps, loads of refreshes (waits included); of them the waits and
    #                                the fast steps right after a load (which gather its memory into the view)
    t_async_export_s: float = 0.0  # of t_async_refresh_s, the export over the host cache (the rest: the Selector)
    dense_host_tokens: int = 0     # kv_on_host: tokens the dense host-KV row decoded (fewer than decoded_tokens where
    #                                --dense-host-n says: each of its steps reads the whole cache on the CPU)
    prefill_s: float = 0.0         # kv_on_host: seconds to extend the cache from the previous depth, host KV (0: loaded
                                   #   from the in-VRAM prefill, --prefill-in-vram) ...
    prefill_vram_s: float = 0.0    # ... and with the cache in GPU memory
    cache_host_bytes: int = 0      # kv_on_host: the KV cache in host memory ...
    view_device_bytes: int = 0     # ... and SFI's view (the KV bytes in GPU memory)
    sampling: str = "greedy"       # the pick each step makes (bench_sampler): greedy, default (in the graph), host
    type_kv: str = "f16"           # the KV cache's type (keys and values)


def config_overrides(config: SFIConfig) -> dict:
    """The fields and parameters of `config` that differ from `SFIConfig()`'s: {} for a run with the defaults."""
    return config.overrides()


def hardware(n_gpu_layers: int, n_gpus: int = 1) -> str:
    if n_gpu_layers:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                                 text=True, timeout=10)
            if out.returncode == 0 and out.stdout.strip():
                name = out.stdout.strip().splitlines()[0]
                return f"{n_gpus}x {name}" if n_gpus > 1 else name
        except (OSError, subprocess.SubprocessError):
            pass
    return f"CPU {platform.processor() or platform.machine()}"


def text_tokens(llm, n_tokens: int, seed: int = 0) -> list[int]:
    """At least n_tokens tokens of natural prose (the prompt and its forced continuation)."""
    from .texts import natural_text

    n_chars = 5 * n_tokens + 4096
    while True:
        tokens = llm.tokenize(natural_text(n_chars, seed=seed))
        if len(tokens) >= n_tokens:
            return tokens[:n_tokens]
        n_chars *= 2


def forced_tokens_digest(tokens: Sequence[int]) -> str:
    """Names a forced continuation, so that a confidence trace is replayed only on the tokens it was taken on."""
    import hashlib

    return hashlib.sha256(np.asarray(tokens, dtype=np.int32).tobytes()).hexdigest()


def load_confidence_trace(path: str | Path) -> dict:
    """A trace written by benchmarks/confidence_trace.py: per depth, a trained model's top-1 probabilities."""
    trace = json.loads(Path(path).read_text())
    if not isinstance(trace, dict) or not isinstance(trace.get("depths"), dict) or "model" not in trace:
        raise ValueError(f"{path}: not a confidence trace (benchmarks/confidence_trace.py writes them)")
    return trace


def trace_top1(trace: dict, depth: int, forced: Sequence[int]) -> list[float]:
    """The trace's top-1 probabilities for the continuation `forced` at `depth`; an error if it has none."""
    entry = trace["depths"].get(str(depth))
    if entry is None:
        raise ValueError(f"the confidence trace has no depth {depth} (it has {', '.join(trace['depths'])})")
    if entry["forced_sha256"] != forced_tokens_digest(forced) or len(entry["top1"]) < len(forced):
        from .texts import text_source

        raise ValueError(f"the confidence trace at depth {depth} was taken on other tokens (another text, "
                         f"tokenizer or length; its text: {trace.get('text_source', '?')}, this one's: "
                         f"{text_source()}): record it with benchmarks/confidence_trace.py, with --pydoc-topics "
                         "for another Python's text")
    return entry["top1"]


class ReplayedConfidence:
    """A policy whose confidence readings come from a recorded trace instead of the model at hand.

    This bench times random-weight models, which are never sure of their next token, so the
    low-confidence rule would fire at every chance (each `min_gap` steps): the worst case, not what a
    trained model does on the same text. Given `top1[i]`, the top-1 probability a trained model gave
    the i-th decoded token of this text (benchmarks/confidence_trace.py), the wrapped policy reads
    that instead, so its triggers fall where they would with real weights. Everything else is the
    wrapped policy's own.
    """

    def __init__(self, policy: TriggerPolicy, top1: Sequence[float]):
        self.policy = policy
        self.top1 = [float(p) for p in top1]
        self._n_tokens = 0

    def __getattr__(self, name):
        return getattr(self.policy, name)

    def reset(self, context: Sequence[int] = ()) -> None:
        self.policy.reset(context)
        self._n_tokens = 0

    def observe_confidence(self, top1: float) -> None:
        if self._n_tokens >= len(self.top1):
            raise ValueError(f"the confidence trace covers {len(self.top1)} tokens; token {self._n_tokens + 1} "
                             "asked for one")
        self.policy.observe_confidence(self.top1[self._n_tokens])

    def on_token(self, token: int) -> bool:
        self._n_tokens += 1
        return self.policy.on_token(token)


SAMPLINGS = ("greedy", "default", "host")


def bench_sampler(sampling: str, n_vocab: int):
    """The picks each step makes (and waits for) in a bench run, as a generation's would: "greedy" the greedy pick,
    "default" sampling with SamplingParams' defaults (temperature 0.8, top-k 40, top-p 0.95, min-p 0.05), both in
    the decode's graph where the device runs them; "host" that sampling on the host, over the copied logits."""
    from ..core.sampling import Sampler, SamplingParams

    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
    sampler = Sampler(SamplingParams(temperature=0.0 if sampling == "greedy" else 0.8, seed=0), n_vocab)
    if sampling == "host":
        sampler.device_chain = None
    return sampler


def decode_forced(llm, stepper: Stepper, prompt: Sequence[int], forced: Sequence[int], sampling: str = "greedy") -> float:
    """Prefill (reusing the cached prefix), then one step per forced token, each after the pick a real decode
    makes (`bench_sampler`); seconds of decoding.

    SFI statistics are reset after the prefill, so they cover the decoding only (the bootstrap
    slow step belongs to the prompt)."""
    ctx = llm.context
    sampler = bench_sampler(sampling, ctx.n_vocab)
    ctx.set_device_picks(sampler.device_chain)  # as a generation picks (run_generation)
    try:
        stepper.prefill(list(prompt))
        if hasattr(stepper, "stats"):
            for field in dataclasses.fields(stepper.stats):
                if field.name.startswith("t_"):  # every time the stats keep
                    setattr(stepper.stats, field.name, 0.0)
        t0 = time.perf_counter()
        for token in forced:
            sampler.sample(ctx)  # the pick a real decode makes (waits for the step)
            stepper.step(int(token))
        sampler.sample(ctx)
        return time.perf_counter() - t0
    finally:
        ctx.set_device_picks(None)
        sampler.close()


def _budget(config: SFIConfig, depth: int) -> int:
    """Cells a fast step reads right after a refresh at `depth`: the depth of the ceiling."""
    return config.n_sink + config.resolve_k_head(depth) + config.n_recent


def _open(model, *, depths, n_decode: int, n_gpu_layers: int, n_threads: int | None, flash_attn: bool | None,
          config: SFIConfig | None, n_batch: int, split_mode: str, n_parallel: int = 1, kv_on_host: bool = False,
          type_kv: str = "f16", rpc_servers=None):
    """The model of a bench run (n_ctx for the deepest depth), the config, the depths ascending, and
    `shared`: the row fields every depth has in common but the git commit and the hardware."""
    from ..core.context import default_threads
    from ..core.devices import gpu_count
    from ..sfi_llama import SFILlama

    config = config or SFIConfig()
    depths = sorted(int(d) for d in depths)
    if flash_attn is None:  # the faster dense setting: flash attention on a GPU, plain attention on a CPU
        flash_attn = n_gpu_layers != 0 or type_kv in ("q8_0", "q4_0")  # (a quantized V cache needs it)
    llm = SFILlama(model, n_ctx=depths[-1] + n_decode + 64, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                   n_batch=n_batch, flash_attn=flash_attn, progress=True, sfi=config, split_mode=split_mode,
                   n_parallel=n_parallel, kv_on_host=kv_on_host, type_kv=type_kv, rpc_servers=rpc_servers)
    n_gpus = 0 if not n_gpu_layers else min(1, gpu_count()) if split_mode == "none" else gpu_count()
    effective = llm.effective_config(config, batched=n_parallel > 1)  # with the GPU defaults filled in
    shared = dict(model=Path(str(llm.model_path)).name, decoded_tokens=n_decode, flash_attn=llm.context.flash_attn,
                  n_gpu_layers=n_gpu_layers, n_threads=n_threads or default_threads(), policy=config.policy,
                  batch=n_parallel, split_mode=split_mode, n_gpus=n_gpus, type_kv=type_kv,
                  selection_delay=effective.selection_delay,
                  min_context=effective.min_context or 0, device_selector=bool(effective.device_selector),
                  refresh_layer_groups=effective.refresh_layer_groups, refresh_grid=effective.refresh_grid,
                  config_overrides=config_overrides(config),
                  composite_ops=os.environ.get("LLAMA_SFI_FUSED") == "0" or effective.fused_ops is False,
                  fa_evidence_env=os.environ.get("LLAMA_SFI_FA_EVIDENCE"),
                  keep_graphs_env=os.environ.get("LLAMA_SFI_KEEP_GRAPHS"),
                  cuda_graphs_disabled=os.environ.get("GGML_CUDA_DISABLE_GRAPHS") is not None)
    return llm, config, depths, shared


def _sfi_fields(llm, config: SFIConfig, depth: int, text, n_decode: int, sampling: str, replayed: dict) -> dict:
    """One SFI run at `depth` on the cached context: its row's SFI fields."""
    stepper = llm.stepper(config)
    if replayed and hasattr(stepper, "policy"):
        stepper.policy = ReplayedConfidence(stepper.policy, replayed[depth])
    seconds = decode_forced(llm, stepper, text[:depth], text[depth:depth + n_decode], sampling)
    llm.context.truncate(depth)
    s = stepper.stats if hasattr(stepper, "stats") else None
    native = (s.t_fast + s.t_slow + s.t_selector + s.t_dense) if s else seconds
    return dict(
        depth=depth, k_head=config.resolve_k_head(depth), budget=_budget(config, depth),
        sfi_tok_s=n_decode / seconds,
        slow_steps=s.n_slow if s else 0, fast_steps=s.n_fast if s else 0, dense_steps=s.n_dense if s else 0,
        t_fast_s=s.t_fast if s else 0.0, t_slow_s=s.t_slow if s else 0.0,
        t_selector_s=s.t_selector if s else 0.0, t_python_s=max(0.0, seconds - native),
        t_selector_background_s=s.t_selector_background if s else 0.0,
        slow_reasons=dict(s.reasons) if s else {})


def run_bench(model: str | Path, *, model_shape: str = "", weight_type: str = "", depths=DEFAULT_DEPTHS,
              n_decode: int = 256, n_gpu_layers: int = 0, n_threads: int | None = None,
              flash_attn: bool | None = None, config: SFIConfig | None = None, n_batch: int = 2048,
              split_mode: str = "layer", confidence_trace: dict | None = None, sampling: str = "greedy",
              type_kv: str = "f16", samplings: Sequence[str] = (), variants: Sequence[SFIConfig] = (),
              log: Callable[[str], None] = print) -> list[BenchRow]:
    """Dense vs SFI at each depth (ascending), plus the ceiling; returns one row per depth.

    `samplings`: several picks (`SAMPLINGS`) compared on the same context: a row per pick and depth, dense and SFI
    decoded with it. `variants`: more SFI configs decoded on the same context at each depth, a row each, beside
    dense's (their `config_overrides` say how they differ). Both default to `sampling` and `config` alone.
    `confidence_trace` (`load_confidence_trace`): the trigger policy reads a trained model's confidence
    on this text instead of the benchmarked model's (`ReplayedConfidence`)."""

    llm, config, depths, shared = _open(model, depths=depths, n_decode=n_decode, n_gpu_layers=n_gpu_layers,
                                        n_threads=n_threads, flash_attn=flash_attn, config=config, n_batch=n_batch,
                                        split_mode=split_mode, type_kv=type_kv)
    ctx = llm.context
    try:
        text = text_tokens(llm, depths[-1] + n_decode)
        budget_depth = _budget(config, depths[-1])
        # checked before any decoding: a trace of another text fails at once, not after an hour of prefill
        replayed = {d: trace_top1(confidence_trace, d, text[d:d + n_decode]) for d in depths} if confidence_trace else {}

        samplings = tuple(samplings) or (sampling,)
        configs = [config, *variants]

        def dense_at(depth: int, pick: str) -> float:
            ctx.truncate(min(len(ctx.tokens), depth))
            dense = llm.stepper(SFIConfig(policy="dense"))  # also puts the native view back to dense mode
            seconds = decode_forced(llm, dense, text[:depth], text[depth:depth + n_decode], pick)
            ctx.truncate(depth)
            return n_decode / seconds

        ceiling = dense_at(budget_depth, samplings[0])
        log(f"ceiling: dense at depth {budget_depth} (the SFI memory): {ceiling:.1f} tok/s")
        rows = []
        # once: nvidia-smi is a subprocess
        shared.update(git_commit=git_commit(12), hardware=hardware(n_gpu_layers, shared["n_gpus"]))
        for depth in depths:
            for pick in samplings:
                t0 = time.perf_counter()
                dense_tok_s = dense_at(depth, pick)
                log(f"depth {depth}: context ready and dense decoded ({pick}) in {time.perf_counter() - t0:.0f} s")
                for run_config in configs:
                    sfi = _sfi_fields(llm, run_config, depth, text, n_decode, pick, replayed)
                    row = BenchRow(**{**shared, "config_overrides": config_overrides(run_config)}, **sfi,
                                   model_shape=model_shape, weight_type=weight_type, sampling=pick,
                                   dense_tok_s=dense_tok_s, ceiling_tok_s=ceiling,
                                   ratio=dense_tok_s and sfi["sfi_tok_s"] / dense_tok_s,
                                   confidence_source=f"trace: {confidence_trace['model']}" if confidence_trace
                                   else "model")
                    rows.append(row)
                    log(format_row(row))
        return rows
    finally:
        llm.close()


# -- the KV cache in host memory (`--kv-on-host`) ------------------------------------------------

def _prefill(llm, prompt) -> float:
    """Seconds to extend the cache to `prompt` (dense, reusing the cached prefix)."""
    stepper = llm.stepper(SFIConfig(policy="dense"))
    t0 = time.perf_counter()
    stepper.prefill(list(prompt))
    return time.perf_counter() - t0


def _seq_state(ctx) -> ctypes.Array:
    """The cache of ctx's sequence as llama.cpp saves it (cells, K and V: GBs at long context, held once)."""
    from ..core.library import llama_cpp

    size = llama_cpp.llama_state_seq_get_size(ctx.ctx, ctx.seq)
    state = (ctypes.c_ubyte * size)()
    if llama_cpp.llama_state_seq_get_data(ctx.ctx, state, size, ctx.seq) != size:
        raise RuntimeError("llama_state_seq_get_data: the sequence's state could not be saved")
    return state


def _load_seq_state(ctx, state: ctypes.Array, tokens) -> None:
    """ctx's sequence from `state` (saved by `_seq_state` after decoding `tokens`, on another context)."""
    from ..core.library import llama_cpp

    ctx.clear()
    if llama_cpp.llama_state_seq_set_data(ctx.ctx, state, len(state), ctx.seq) != len(state):
        raise RuntimeError("llama_state_seq_set_data: the sequence's state could not be loaded")
    ctx.tokens[:] = list(tokens)


def _host_row(llm, config: SFIConfig, depth: int, text, n_decode: int, sampling: str, shared: dict,
              prefill_s: float, n_dense: int, log: Callable[[str], None]) -> BenchRow:
    """At `depth` (the cache holds text[:depth] in host memory): dense as llama.cpp runs it, SFI with slow steps over
    the host cache, and SFI with asynchronous refreshes; a row without the VRAM fields."""
    ctx = llm.context
    prompt, forced = text[:depth], text[depth:depth + n_decode]
    llm._engine.close()  # no SFI state: dense decoding places the attention as llama.cpp does
    n_dense = min(n_decode, n_dense or n_decode)
    dense_s = decode_forced(llm, llm.stepper(SFIConfig(policy="dense")), prompt, forced[:n_dense], sampling)
    dense_s *= n_decode / n_dense  # per n_decode tokens, as the other rows
    ctx.truncate(depth)
    log(f"depth {depth}: dense with host KV {n_decode / dense_s:.1f} tok/s ({n_dense} tokens)")
    stepper = llm.stepper(dataclasses.replace(config, async_refresh=False))  # refreshed by slow steps
    sfi_s = decode_forced(llm, stepper, prompt, forced, sampling)
    ctx.truncate(depth)
    memory = llm.memory()
    s = stepper.stats
    async_stepper = llm.stepper(dataclasses.replace(config, async_refresh=True, redecode_tail=False))
    async_s = decode_forced(llm, async_stepper, prompt, forced, sampling)
    ctx.truncate(depth)
    a = async_stepper.stats
    log(f"depth {depth}: SFI async {n_decode / async_s:.1f} tok/s: slow steps {a.t_slow:.2f} s, {a.n_fast} fast steps "
        f"{a.t_fast:.2f} s (those after a load {a.t_fast_after_load:.2f} s), refresh loads {a.t_selector:.2f} s "
        f"(waits {a.t_refresh_wait:.2f} s); a refresh "
        f"{a.t_selector_background / max(1, a.n_host_refresh):.2f} s, its export over the host cache "
        f"{a.t_host_export / max(1, a.n_host_refresh):.2f} s")
    return BenchRow(
        **shared, depth=depth, k_head=config.resolve_k_head(depth), budget=_budget(config, depth),
        dense_tok_s=n_decode / dense_s, sfi_tok_s=n_decode / sfi_s, ceiling_tok_s=0.0, ratio=dense_s / sfi_s,
        slow_steps=s.n_slow, fast_steps=s.n_fast, dense_steps=s.n_dense, t_fast_s=s.t_fast,
        t_slow_s=s.t_slow, t_selector_s=s.t_selector,
        t_python_s=max(0.0, sfi_s - (s.t_fast + s.t_slow + s.t_selector + s.t_dense)),
        slow_reasons=dict(s.reasons), prefill_s=prefill_s, dense_host_tokens=n_dense,
        sfi_async_tok_s=n_decode / async_s, async_refreshes=a.n_host_refresh, async_skipped=a.n_refresh_skipped,
        t_async_refresh_s=a.t_selector_background / max(1, a.n_host_refresh),
        t_async_parts_s=dict(slow=a.t_slow, fast=a.t_fast, load=a.t_selector, wait=a.t_refresh_wait,
                             gather=a.t_fast_after_load),
        t_async_export_s=a.t_host_export / max(1, a.n_host_refresh),
        cache_host_bytes=memory.cache_host if memory else 0,
        view_device_bytes=memory.view_device if memory else 0)


def _vram_pass(vram, config: SFIConfig, depths, text, n_decode: int, sampling: str):
    """Dense with the cache in GPU memory: the ceiling's seconds (dense at the SFI budget of the deepest depth), and
    per depth (ascending, each extending the cache) its prefill seconds and decode tok/s. The cache ends at
    text[:depths[-1]]."""
    budget_depth = _budget(config, depths[-1])
    ceiling_s = decode_forced(vram, vram.stepper(SFIConfig(policy="dense")), text[:budget_depth],
                              text[budget_depth:budget_depth + n_decode], sampling)
    vram.context.truncate(0)
    at = {}
    for depth in depths:
        prompt, forced = text[:depth], text[depth:depth + n_decode]
        vram.context.truncate(min(len(vram.context.tokens), depth))
        prefill_s = _prefill(vram, prompt)
        seconds = decode_forced(vram, vram.stepper(SFIConfig(policy="dense")), prompt, forced, sampling)
        vram.context.truncate(depth)
        at[depth] = (prefill_s, n_decode / seconds)
    return n_decode / ceiling_s, at


def run_bench_kv_on_host(model: str | Path, *, model_shape: str = "", weight_type: str = "", depths=DEFAULT_DEPTHS,
                         n_decode: int = 256, n_gpu_layers: int = 0, n_threads: int | None = None,
                         flash_attn: bool | None = None, config: SFIConfig | None = None, n_batch: int = 4096,
                         split_mode: str = "layer", sampling: str = "greedy", type_kv: str = "f16",
                         prefill_in_vram: bool = False, n_dense_host: int = 0, rpc_servers=None,
                         log: Callable[[str], None] = print) -> list[BenchRow]:
    """Dense with host KV, SFI with host KV and dense with the KV in GPU memory at each depth; one row per depth.
    Prefill times are the seconds to extend the cache from the previous depth (the first: from empty).
    prefill_in_vram: the host cache is not prefilled itself but loaded with the state of the prefill in GPU memory
    (the host-KV prefill copies the cached cells to the GPU for each ubatch: minutes at 128K); its prefill_s is 0.
    n_dense_host: tokens the dense host-KV row decodes (0: n_decode), its tok/s the same per step.
    rpc_servers: layers on llama.cpp rpc-servers instead of the local GPUs (the tests' stand-in for a GPU)."""
    if not n_gpu_layers:
        raise ValueError("--kv-on-host keeps the cache in host memory for layers on a GPU: it needs -ngl")
    kwargs = dict(depths=depths, n_decode=n_decode, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                  flash_attn=flash_attn, config=config, n_batch=n_batch, split_mode=split_mode, type_kv=type_kv,
                  rpc_servers=rpc_servers)
    state = at = None
    if prefill_in_vram:
        vram, config, depths, _ = _open(model, **kwargs)
        try:
            text = text_tokens(vram, depths[-1] + n_decode)
            ceiling, at = _vram_pass(vram, config, depths, text, n_decode, sampling)
            state = _seq_state(vram.context)
        finally:
            vram.close()
    llm, config, depths, shared = _open(model, **kwargs, kv_on_host=True)
    shared.update(git_commit=git_commit(12), hardware=hardware(n_gpu_layers, shared["n_gpus"]), kv_on_host=True,
                  sampling=sampling, model_shape=model_shape, weight_type=weight_type)
    text = text_tokens(llm, depths[-1] + n_decode)
    rows = []
    try:
        if state is not None:
            _load_seq_state(llm.context, state, text[:depths[-1]])
            state = None
            for depth in reversed(depths):  # each truncates the loaded cache
                llm.context.truncate(depth)
                rows.insert(0, _host_row(llm, config, depth, text, n_decode, sampling, shared, 0.0, n_dense_host, log))
                log(format_row(rows[0]))
        else:
            for depth in depths:
                llm.context.truncate(min(len(llm.context.tokens), depth))
                prefill_s = _prefill(llm, text[:depth])
                log(f"depth {depth}: prefilled in {prefill_s:.1f} s")
                rows.append(_host_row(llm, config, depth, text, n_decode, sampling, shared, prefill_s, n_dense_host,
                                            log))
                log(format_row(rows[-1]))
    finally:
        llm.close()

    if at is None:
        # the same depths with the cache in GPU memory, where it fits
        try:
            vram, *_ = _open(model, **kwargs)
        except (ValueError, MemoryError, RuntimeError) as e:
            log(f"dense with the KV cache in GPU memory: does not fit ({e})")
            return rows
        try:
            ceiling, at = _vram_pass(vram, config, depths, text, n_decode, sampling)
        finally:
            vram.close()
    for row in rows:
        row.prefill_vram_s, row.dense_vram_tok_s = at[row.depth]
        row.ceiling_tok_s = ceiling
        log(f"depth {row.depth}: dense with the KV cache in GPU memory {row.dense_vram_tok_s:.1f} tok/s, "
            f"prefill {row.prefill_vram_s:.1f} s (host KV: {row.prefill_s:.1f} s); SFI with host KV / dense in "
            f"VRAM: {row.sfi_tok_s / row.dense_vram_tok_s:.2f}x, asynchronous refreshes "
            f"{row.sfi_async_tok_s / row.dense_vram_tok_s:.2f}x")
    return rows


class ForcedTokens:
    """A sampler for the batched loop that feeds a fixed continuation (teacher forcing); it still makes the pick a
    real decode makes (`bench_sampler`: in the graph, as for a request), which waits for the step."""

    n_logprobs = None
    logprobs = None

    def __init__(self, tokens: Sequence[int], n_vocab: int, sampling: str = "greedy"):
        self.tokens = list(tokens)
        self.i = 0
        self.picker = bench_sampler(sampling, n_vocab)
        self.seed = self.picker.seed
        self.device_chain = self.picker.device_chain

    def sample(self, ctx) -> int:
        self.picker.sample(ctx)
        token = self.tokens[min(self.i, len(self.tokens) - 1)]
        self.i += 1
        return int(token)

    def close(self) -> None:
        self.picker.close()


def check_stagger(stagger: int, batch: int, n_decode: int) -> None:
    """ValueError unless sequences started `stagger` steps apart all start within the n_decode decoded tokens."""
    if stagger and batch < 2:
        raise ValueError("it needs --batch > 1")
    if stagger < 0 or stagger * (batch - 1) >= n_decode:
        raise ValueError(f"stagger {stagger}: the sequences' starts must lie within the {n_decode} decoded tokens "
                         f"(stagger x (batch - 1) < n)")


def run_bench_batched(model: str | Path, *, batch: int, model_shape: str = "", weight_type: str = "",
                      depths=DEFAULT_DEPTHS, n_decode: int = 256, n_gpu_layers: int = 0,
                      n_threads: int | None = None, flash_attn: bool | None = None,
                      config: SFIConfig | None = None, n_batch: int = 2048, split_mode: str = "layer",
                      stagger: int = 0, sampling: str = "greedy", type_kv: str = "f16",
                      variants: Sequence[SFIConfig] = (), log: Callable[[str], None] = print) -> list[BenchRow]:
    """`run_bench` for `batch` sequences decoding together (`sfi_gguf.core.batched`): each sequence holds its
    own text at the same depth; tok/s are aggregate (batch x decoded tokens / seconds of the steps).

    stagger: sequence i starts i x stagger steps after the first, and only the steps in which all of them
    decode are timed, so that their refreshes fall on different steps, as a server's requests do (started
    together, each one's refreshes come a fixed number of steps after its last on random weights, and so
    stay in step). `variants`: more SFI configs decoded on the same contexts at each depth, a row each (as
    `run_bench`'s)."""
    from ..core.batched import Request

    check_stagger(stagger, batch, n_decode)

    llm, config, depths, shared = _open(model, depths=depths, n_decode=n_decode, n_gpu_layers=n_gpu_layers,
                                        n_threads=n_threads, flash_attn=flash_attn, config=config, n_batch=n_batch,
                                        split_mode=split_mode, n_parallel=batch, type_kv=type_kv)
    decoder = llm.batched_decoder()
    n_vocab = llm.context.n_vocab
    try:
        texts = [text_tokens(llm, depths[-1] + n_decode, seed=s) for s in range(batch)]

        def run(depth: int, cfg: SFIConfig) -> tuple[float, list]:
            """One teacher-forced decode of n_decode tokens per sequence; (seconds per batch x n_decode tokens
            of the timed steps, requests)."""
            requests = [Request(tokens=t[:depth], sampler=ForcedTokens(t[depth:depth + n_decode], n_vocab, sampling),
                                max_tokens=n_decode + 1, ignore_eos=True, config=cfg) for t in texts]
            if not stagger:
                for r in requests:
                    decoder.add(r)
                decoder.reset_timing()
                while decoder.active:
                    decoder.step()
                return decoder.t_steps, requests
            for i, r in enumerate(requests):  # the later ones join while the first ones decode
                decoder.add(r)
                for _ in range(stagger if i + 1 < len(requests) else 0):
                    decoder.step()
            decoder.reset_timing()
            while len(decoder.active) == batch and not any(r.done for r in requests):
                decoder.step()
            # the timed steps' times and counts, scaled to n_decode steps (what a run of all at once reports)
            scale = n_decode / max(1, decoder.n_steps)
            timed = decoder.t_steps * scale
            t_kinds = {k: v * scale for k, v in decoder.t_decode.items()}
            n_kinds = {k: round(v * scale) for k, v in decoder.n_decode.items()}
            n_mixed = round(decoder.n_mixed * scale)
            while decoder.active:
                decoder.step()
            decoder.t_decode, decoder.n_decode, decoder.n_mixed = t_kinds, n_kinds, n_mixed
            return timed, requests

        dense = SFIConfig(policy="dense")
        budget_depth = _budget(config, depths[-1])
        seconds, _ = run(budget_depth, dense)
        ceiling = batch * n_decode / seconds
        log(f"ceiling: dense at depth {budget_depth} (the SFI memory), batch {batch}: {ceiling:.1f} tok/s")
        rows = []
        shared.update(git_commit=git_commit(12), hardware=hardware(n_gpu_layers, shared["n_gpus"]), sampling=sampling)
        for depth in depths:
            t0 = time.perf_counter()
            dense_s, _ = run(depth, dense)
            log(f"depth {depth}: {batch} contexts ready and dense decoded in {time.perf_counter() - t0:.0f} s")
            for run_config in (config, *variants):
                sfi_s, requests = run(depth, run_config)
                stats = [r.stats.sfi for r in requests if r.stats.sfi is not None]
                selector = sum(s.t_selector for s in stats)
                decoded = sum(decoder.t_decode.values())
                row = BenchRow(
                    **{**shared, "config_overrides": config_overrides(run_config),
                       "refresh_grid": llm.effective_config(run_config, batched=True).refresh_grid},
                    model_shape=model_shape, weight_type=weight_type, depth=depth, stagger=stagger,
                    k_head=run_config.resolve_k_head(depth), budget=_budget(run_config, depth),
                    dense_tok_s=batch * n_decode / dense_s, sfi_tok_s=batch * n_decode / sfi_s, ceiling_tok_s=ceiling,
                    ratio=dense_s / sfi_s, slow_steps=decoder.n_decode["slow"], fast_steps=decoder.n_decode["fast"],
                    mixed_steps=decoder.n_mixed,
                    dense_steps=decoder.n_decode["dense"], t_fast_s=decoder.t_decode["fast"],
                    t_slow_s=decoder.t_decode["slow"] + decoder.t_decode["dense"], t_selector_s=selector,
                    t_python_s=max(0.0, sfi_s - decoded - selector),
                    t_selector_background_s=sum(s.t_selector_background for s in stats),
                    slow_reasons=dict(sum((Counter(s.reasons) for s in stats), Counter())))
                rows.append(row)
                log(format_row(row))
        return rows
    finally:
        llm.close()  # closes its batched decoder too


HEADER = ("| depth | dense tok/s | SFI tok/s | SFI/dense | ceiling tok/s | slow / fast steps | "
          "time fast / slow / selector / Python (s) |")


def format_row(r: BenchRow) -> str:
    return (f"| {r.depth} | {r.dense_tok_s:.1f} | {r.sfi_tok_s:.1f} | **{r.ratio:.2f}x** | {r.ceiling_tok_s:.1f} | "
            f"{r.slow_steps} / {r.fast_steps} | {r.t_fast_s:.2f} / {r.t_slow_s:.2f} / {r.t_selector_s:.2f} / "
            f"{r.t_python_s:.2f} |")


def markdown_table(rows: Sequence[BenchRow]) -> str:
    if not rows:
        return ""
    r0 = rows[0]
    batch = f"{r0.batch} sequences (aggregate tok/s), " if r0.batch > 1 else ""
    head = (f"{r0.hardware}, {batch}{r0.model_shape or r0.model} {r0.weight_type}, k_head {r0.k_head}, policy {r0.policy}, "
            f"flash attention {'on' if r0.flash_attn else 'off'}, {r0.decoded_tokens} tokens decoded per run, "
            f"picks: {r0.sampling}, KV cache {r0.type_kv}, commit {r0.git_commit}")
    if r0.kv_on_host:
        sep = "|---" * (KV_ON_HOST_HEADER.count("|") - 1) + "|"
        return "\n".join([head + ", KV cache in host memory", "", KV_ON_HOST_HEADER, sep] +
                         [format_kv_on_host_row(r) for r in rows])
    runs = {(r.sampling, json.dumps(r.config_overrides, sort_keys=True)) for r in rows}
    if len(runs) == 1:
        sep = "|---" * (HEADER.count("|") - 1) + "|"
        return "\n".join([head, "", HEADER, sep] + [format_row(r) for r in rows])
    # several picks or configs on the same contexts: each row says which
    header = "| picks | SFIConfig changes " + HEADER
    sep = "|---" * (header.count("|") - 1) + "|"
    return "\n".join([head.replace(f"picks: {r0.sampling}, ", ""), "", header, sep] +
                      [f"| {r.sampling} | {_changes(r.config_overrides)} " + format_row(r) for r in rows])


def _changes(overrides: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "-"


KV_ON_HOST_HEADER = ("| depth | dense, host KV tok/s | SFI, host KV tok/s | SFI / dense host | dense, KV in VRAM tok/s | "
                     "SFI host / dense VRAM | SFI async tok/s | async / dense VRAM | prefill host / VRAM (s) | "
                     "KV in VRAM (MiB) / cache in RAM (MiB) | slow / fast steps | async refreshes / skipped (s each) | "
                     "async: slow / fast / loads (waits) (s) |")


def format_kv_on_host_row(r: BenchRow) -> str:
    vram = f"{r.dense_vram_tok_s:.1f}" if r.dense_vram_tok_s else "does not fit"
    ratio_vram = f"**{r.sfi_tok_s / r.dense_vram_tok_s:.2f}x**" if r.dense_vram_tok_s else "-"
    async_vram = f"**{r.sfi_async_tok_s / r.dense_vram_tok_s:.2f}x**" if r.dense_vram_tok_s else "-"
    return (f"| {r.depth} | {r.dense_tok_s:.1f} | {r.sfi_tok_s:.1f} | **{r.ratio:.2f}x** | {vram} | {ratio_vram} | "
            f"{r.sfi_async_tok_s:.1f} | {async_vram} | {f'{r.prefill_s:.1f}' if r.prefill_s else '-'} / {r.prefill_vram_s:.1f} | "
            f"{r.view_device_bytes / 2**20:.0f} / {r.cache_host_bytes / 2**20:.0f} | {r.slow_steps} / {r.fast_steps} | "
            f"{r.async_refreshes} / {r.async_skipped} ({r.t_async_refresh_s:.2f}; export {r.t_async_export_s:.2f}) | "
            f"{' / '.join(f'{r.t_async_parts_s.get(k, 0.0):.2f}' for k in ('slow', 'fast', 'load'))} "
            f"({r.t_async_parts_s.get('wait', 0.0):.2f}) |")


def write_json(rows: Sequence[BenchRow], path: Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([dataclasses.asdict(r) for r in rows], indent=1) + "\n")
    return path


def config_variant(config: SFIConfig, text: str) -> SFIConfig:
    """`config` with the fields named in "FIELD=VALUE[,FIELD=VALUE]" changed; values as the field's type reads them
    (on/off for a flag, "none" for None)."""
    fields = {f.name for f in dataclasses.fields(SFIConfig)} - {"policy_params", "selector_params"}
    changes = {}
    for item in text.split(","):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip()
        if not sep or name not in fields:
            raise ValueError(f"{item!r}: expected FIELD=VALUE with FIELD one of {', '.join(sorted(fields))}")
        changes[name] = _field_value(getattr(config, name), value)
    variant = dataclasses.replace(config, **changes)
    variant.validate()
    return variant


def _field_value(current, value: str):
    """`value` read as the type of the field's current value (a field that is None takes on/off, a number or text)."""
    flag = {"on": True, "true": True, "off": False, "false": False}.get(value.lower())
    if value.lower() == "none":
        return None
    if isinstance(current, bool) or (current is None and flag is not None):
        if flag is None:
            raise ValueError(f"on or off, got {value!r}")
        return flag
    for kind in ((type(current),) if isinstance(current, (int, float)) else (int, float)):
        try:
            return kind(value)
        except ValueError:
            if current is not None:
                raise ValueError(f"a number, got {value!r}") from None
    return value


# -- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from ..cli import add_sfi_args
    from ..core.policy import POLICIES, MemoryMode
    from .random_model import SHAPES, WEIGHT_TYPES

    p = argparse.ArgumentParser(
        prog="sfi-gguf bench",
        description="Prefills D tokens of natural text, decodes N tokens teacher-forced on its continuation, "
                    "densely and with SFI on the same cache, and prints tok/s, the ratio, the slow-step count, "
                    "the time split and the ceiling (dense at a depth equal to the SFI memory).",
        epilog="examples:\n  sfi-gguf bench -ngl 99                                   # Qwen3-4B shape, F16, "
               "8K..128K\n  sfi-gguf bench -m qwen2.5-coder-0.5b-instruct --depths 4096 16384 -t 2   # CPU",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("-m", "--model", default="qwen3-4b",
                   help=f"a random-weight shape ({', '.join(s for s in SHAPES if not s.startswith('tiny'))}: "
                        "written once, cached, with the default model's tokenizer), a known model name or a .gguf")
    p.add_argument("--weight-type", default="f16", choices=WEIGHT_TYPES, help="weights of a random shape")
    p.add_argument("--vocab-source", default=None,
                   help="GGUF whose tokenizer a random shape copies (default: the default model)")
    p.add_argument("--depths", type=int, nargs="+", default=list(DEFAULT_DEPTHS), help="context depths (tokens)")
    p.add_argument("-n", "--n-decode", type=int, default=256, help="tokens decoded per run")
    p.add_argument("-ngl", "--n-gpu-layers", type=int, default=0, help="layers on the GPU (99 = all)")
    p.add_argument("-t", "--threads", type=int, default=None)
    p.add_argument("-sm", "--split-mode", choices=["layer", "none"], default="layer",
                   help="several GPUs: layer (whole layers per GPU, llama.cpp's default) or none (one GPU)")
    p.add_argument("--flash-attn", choices=["auto", "on", "off"], default="auto",
                   help="auto: on with a GPU, off on the CPU (the faster dense setting there)")
    add_sfi_args(p, dense=False, policies=[n for n, c in POLICIES.items() if c.memory is not MemoryMode.DENSE])
    p.add_argument("--confidence-trace", default=None,
                   help="JSON of a trained model's top-1 probabilities on the bench's text "
                        "(benchmarks/confidence_trace.py): the trigger reads those instead of the benchmarked "
                        "model's, so its low-confidence refreshes fall where real weights put them")
    p.add_argument("--batch", type=int, default=1,
                   help="sequences decoding together (batched SFI), each with its own text at the depth; "
                        "tok/s are then aggregate")
    p.add_argument("--stagger", type=int, default=0,
                   help="with --batch: start sequence i i x STAGGER steps after the first and time only the steps "
                        "in which all decode, so that their triggers fall on different steps (as a server's "
                        "requests do; e.g. 16 / batch: spread over the low-confidence rule's minimum gap; "
                        "refresh_grid then gathers their refreshes, --variant refresh_grid=1 leaves them apart)")
    p.add_argument("--sampling", choices=SAMPLINGS, nargs="+", default=["greedy"],
                   help="the pick each step makes and waits for: greedy (default) or default sampling (temperature "
                        "0.8, top-k 40, top-p 0.95, min-p 0.05), both in the decode's graph, or host: that sampling "
                        "on the host over the copied logits (the forced tokens are fed either way); several: a row "
                        "each, on the same context (single sequences)")
    p.add_argument("--variant", action="append", default=[], metavar="FIELD=VALUE[,FIELD=VALUE]",
                   help="one more SFI run per depth and pick on the same context, with these SFIConfig fields "
                        "changed (e.g. redecode_tail=on, refresh_grid=1): a row each beside the default's (single "
                        "sequences and batches; repeatable)")
    p.add_argument("--type-kv", default="f16", choices=["f16", "q8_0", "q4_0", "bf16", "f32"],
                   help="the KV cache's type (keys and values; a quantized V needs flash attention)")
    p.add_argument("--kv-on-host", action="store_true",
                   help="the KV cache in host memory: dense as llama.cpp runs it with offload_kqv=False, SFI with only "
                        "its view on the GPU, and dense with the cache in GPU memory where it fits (needs -ngl)")
    p.add_argument("--prefill-in-vram", action="store_true",
                   help="with --kv-on-host: fill the host cache with the state of a prefill with the cache in GPU "
                        "memory (which must fit) instead of prefilling it itself (a host-KV prefill copies the cached "
                        "cells to the GPU for every ubatch: minutes at 128K); its prefill time is then not measured")
    p.add_argument("--dense-host-n", type=int, default=0, metavar="N",
                   help="with --kv-on-host: decode N tokens in the dense host-KV row (default: -n; each of its steps "
                        "reads the whole cache on the CPU: seconds at 128K)")
    p.add_argument("--json", default=None, help="write the rows here (default: benchmarks/results/bench-<...>.json "
                                                 "when run from a checkout, else none)")
    p.add_argument("--markdown", default=None, help="also write the table to this Markdown file")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """`sfi-gguf bench ARGS`."""
    from ..cli import sfi_config_from_args
    from .random_model import SHAPES, random_model

    args = build_parser().parse_args(argv)

    shape, weight_type = "", ""
    model = args.model
    if model in SHAPES:
        shape, weight_type = model, args.weight_type
        extra = {"vocab_source": args.vocab_source} if args.vocab_source else {}
        model = random_model(model, weight_type=args.weight_type, **extra)
    config = sfi_config_from_args(args, warn=lambda text: print(f"sfi-gguf bench: warning: {text}", file=sys.stderr))
    if args.batch < 1:
        raise SystemExit("--batch must be >= 1")
    try:
        check_stagger(args.stagger, args.batch, args.n_decode)
    except ValueError as e:
        raise SystemExit(f"--stagger: {e}")
    trace = None
    if args.confidence_trace:
        if args.batch > 1:
            raise SystemExit("--confidence-trace: single sequences only (the batched bench has one text per sequence)")
        try:
            trace = load_confidence_trace(args.confidence_trace)
        except (OSError, ValueError) as e:
            raise SystemExit(f"--confidence-trace: {e}")
    kwargs = dict(model_shape=shape, weight_type=weight_type, depths=args.depths, n_decode=args.n_decode,
                  n_gpu_layers=args.n_gpu_layers, n_threads=args.threads,
                  flash_attn={"auto": None, "on": True, "off": False}[args.flash_attn], config=config,
                  split_mode=args.split_mode, sampling=args.sampling[0])
    try:
        variants = [config_variant(config, text) for text in args.variant]
    except ValueError as e:
        raise SystemExit(f"--variant: {e}")
    if (len(args.sampling) > 1 and args.batch > 1) or ((len(args.sampling) > 1 or variants) and args.kv_on_host):
        raise SystemExit("several --sampling values: single sequences; --variant: the KV cache in GPU memory")
    if args.prefill_in_vram and not args.kv_on_host:
        raise SystemExit("--prefill-in-vram: only with --kv-on-host")
    if args.dense_host_n < 0 or (args.dense_host_n and not args.kv_on_host):
        raise SystemExit("--dense-host-n: a positive count, only with --kv-on-host")
    if args.kv_on_host:
        if args.batch > 1 or trace or args.type_kv != "f16":
            raise SystemExit("--kv-on-host: single sequences without --confidence-trace, an F16 cache")
        rows = run_bench_kv_on_host(model, prefill_in_vram=args.prefill_in_vram, n_dense_host=args.dense_host_n,
                                    **kwargs)
    elif args.batch > 1:
        rows = run_bench_batched(model, batch=args.batch, stagger=args.stagger, type_kv=args.type_kv,
                                 variants=variants, **kwargs)
    else:
        rows = run_bench(model, confidence_trace=trace, type_kv=args.type_kv, samplings=args.sampling,
                         variants=variants, **kwargs)
    print()
    print(markdown_table(rows))
    if args.markdown:
        Path(args.markdown).write_text(markdown_table(rows) + "\n")
    out = args.json
    if out is None:
        results = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
        if results.is_dir():
            kind = "gpu" if args.n_gpu_layers else "cpu"
            batch = f"-batch{args.batch}" if args.batch > 1 else ""
            batch += "".join(f"-{pick}" for pick in args.sampling if pick != "greedy")
            batch += "-variants" if variants else ""
            batch += "-kv-on-host" if args.kv_on_host else ""
            batch += f"-kv-{args.type_kv}" if args.type_kv != "f16" else ""
            out = results / f"bench-{kind}-{shape or Path(str(model)).stem}{batch}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if out:
        print(f"wrote {write_json(rows, Path(out))}")
    return 0
