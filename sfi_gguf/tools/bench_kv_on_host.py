"""`sfi-gguf bench --kv-on-host`: contexts larger than the GPU, the KV cache in host memory.

At each depth, in one process: dense decoding with the cache in host memory as llama.cpp runs it
(`offload_kqv=False`), SFI with the cache in host memory and only its compact view on the GPU
(`kv_on_host=True`), then, after that model is closed, dense decoding with the cache in GPU memory where it
fits (a model of its own, prefilled again). Each row also gives both prefill times and where the bytes are.
"""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable

from ..config import SFIConfig
from .bench import (DEFAULT_DEPTHS, BenchRow, _budget, _open, decode_forced, format_row, hardware, text_tokens)
from .provenance import git_commit


def _prefill(llm, prompt) -> float:
    """Seconds to extend the cache to `prompt` (dense, reusing the cached prefix)."""
    stepper = llm._stepper(SFIConfig(policy="dense"))
    t0 = time.perf_counter()
    stepper.prefill(list(prompt))
    return time.perf_counter() - t0


def run_bench_kv_on_host(model: str | Path, *, model_shape: str = "", weight_type: str = "", depths=DEFAULT_DEPTHS,
                         n_decode: int = 256, n_gpu_layers: int = 0, n_threads: int | None = None,
                         flash_attn: bool | None = None, config: SFIConfig | None = None, n_batch: int = 4096,
                         split_mode: str = "layer", sampling: str = "greedy", type_kv: str = "f16",
                         rpc_servers=None, log: Callable[[str], None] = print) -> list[BenchRow]:
    """Dense with host KV, SFI with host KV and dense with the KV in GPU memory at each depth; one row per depth.
    Prefill times are the seconds to extend the cache from the previous depth (the first: from empty).
    rpc_servers: layers on llama.cpp rpc-servers instead of the local GPUs (the tests' stand-in for a GPU)."""
    if not n_gpu_layers:
        raise ValueError("--kv-on-host keeps the cache in host memory for layers on a GPU: it needs -ngl")
    llm, config, depths, shared = _open(model, depths=depths, n_decode=n_decode, n_gpu_layers=n_gpu_layers,
                                        n_threads=n_threads, flash_attn=flash_attn, config=config, n_batch=n_batch,
                                        split_mode=split_mode, kv_on_host=True, type_kv=type_kv,
                                        rpc_servers=rpc_servers)
    shared.update(git_commit=git_commit(12), hardware=hardware(n_gpu_layers, shared["n_gpus"]), kv_on_host=True,
                  sampling=sampling)
    ctx = llm.context
    text = text_tokens(llm, depths[-1] + n_decode)
    rows = []
    try:
        for depth in depths:
            prompt, forced = text[:depth], text[depth:depth + n_decode]
            ctx.truncate(min(len(ctx.tokens), depth))
            prefill_s = _prefill(llm, prompt)
            llm._engine.close()  # no SFI state: dense decoding places the attention as llama.cpp does
            dense_s = decode_forced(llm, llm._stepper(SFIConfig(policy="dense")), prompt, forced, sampling)
            ctx.truncate(depth)
            log(f"depth {depth}: prefilled in {prefill_s:.1f} s, dense with host KV {n_decode / dense_s:.1f} tok/s")
            stepper = llm._stepper(config)
            sfi_s = decode_forced(llm, stepper, prompt, forced, sampling)
            ctx.truncate(depth)
            memory = llm.memory()
            s = stepper.stats
            rows.append(BenchRow(
                **shared, model_shape=model_shape, weight_type=weight_type, depth=depth,
                k_head=config.resolve_k_head(depth), budget=_budget(config, depth),
                dense_tok_s=n_decode / dense_s, sfi_tok_s=n_decode / sfi_s, ceiling_tok_s=0.0, ratio=dense_s / sfi_s,
                slow_steps=s.n_slow, fast_steps=s.n_fast, dense_steps=s.n_dense, t_fast_s=s.t_fast,
                t_slow_s=s.t_slow, t_selector_s=s.t_selector,
                t_python_s=max(0.0, sfi_s - (s.t_fast + s.t_slow + s.t_selector + s.t_dense)),
                slow_reasons=dict(s.reasons), prefill_s=prefill_s,
                cache_host_bytes=memory.cache_host if memory else 0,
                view_device_bytes=memory.view_device if memory else 0))
            log(format_row(rows[-1]))
    finally:
        llm.close()

    # the same depths with the cache in GPU memory, where it fits
    try:
        vram, *_ = _open(model, depths=depths, n_decode=n_decode, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                         flash_attn=flash_attn, config=config, n_batch=n_batch, split_mode=split_mode,
                         type_kv=type_kv, rpc_servers=rpc_servers)
    except (ValueError, MemoryError, RuntimeError) as e:
        log(f"dense with the KV cache in GPU memory: does not fit ({e})")
        return rows
    try:
        budget_depth = _budget(config, depths[-1])
        ceiling_s = decode_forced(vram, vram._stepper(SFIConfig(policy="dense")), text[:budget_depth],
                                  text[budget_depth:budget_depth + n_decode], sampling)
        vram.context.truncate(0)
        for row in rows:
            prompt, forced = text[:row.depth], text[row.depth:row.depth + n_decode]
            vram.context.truncate(min(len(vram.context.tokens), row.depth))
            row.prefill_vram_s = _prefill(vram, prompt)
            seconds = decode_forced(vram, vram._stepper(SFIConfig(policy="dense")), prompt, forced, sampling)
            vram.context.truncate(row.depth)
            row.dense_vram_tok_s = n_decode / seconds
            row.ceiling_tok_s = n_decode / ceiling_s
            log(f"depth {row.depth}: dense with the KV cache in GPU memory {row.dense_vram_tok_s:.1f} tok/s, "
                f"prefill {row.prefill_vram_s:.1f} s (host KV: {row.prefill_s:.1f} s); SFI with host KV / dense in "
                f"VRAM: {row.sfi_tok_s / row.dense_vram_tok_s:.2f}x")
    finally:
        vram.close()
    return rows
