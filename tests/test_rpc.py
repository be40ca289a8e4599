"""SFI across machines: the layers on llama.cpp RPC backends (rpc-server processes, CPU backend, loopback).

Run by scripts/rpc_check.sh, which builds llama.cpp with GGML_RPC=ON, points SFI_GGUF_LIB_DIR at that
build and SFI_RPC_SERVER at its rpc-server (without them only the refusal of rpc_servers by a library
without RPC is checked). Two servers are started (and stopped) by the tests. Every layer's KV cache,
and so its SFI compact view, lives on the server holding the layer: selection gathers and fast-step
attention run there, and only the activations and the small SFI inputs cross the connection.
"""
from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

from sfi_gguf.core import devices
from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.sfi_llama import SFILlama
from sfi_gguf.tools.random_model import random_model
from batched_checks import mixed_equals_by_kind, staggered_refreshes
from native_harness import GGML_TYPE_F16, GGML_TYPE_Q8_0
from placement import PlacedModel, all_cells_equal_dense, buffer_names, llama_log

SERVER = os.environ.get("SFI_RPC_SERVER", "")

need_rpc = pytest.mark.skipif(not SERVER, reason="needs SFI_RPC_SERVER and an RPC build (scripts/rpc_check.sh)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_listening(port: int, proc: subprocess.Popen, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"rpc-server on port {port} exited with {proc.returncode}: {proc.stdout.read()}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"rpc-server on port {port} did not listen within {timeout} s")


@pytest.fixture(scope="module")
def servers():
    """Two rpc-server processes on loopback, one CPU thread each; their endpoints."""
    assert os.access(SERVER, os.X_OK), f"SFI_RPC_SERVER={SERVER} is not an executable"
    assert devices.has_rpc(), "the loaded library has no RPC backend: set SFI_GGUF_LIB_DIR to the RPC build"
    procs, endpoints = [], []
    try:
        for _ in range(2):
            port = _free_port()
            proc = subprocess.Popen([SERVER, "-H", "127.0.0.1", "-p", str(port), "-t", "1"],
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            procs.append(proc)
            _wait_listening(port, proc)
            endpoints.append(f"127.0.0.1:{port}")
        yield endpoints
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def four_layers() -> str:
    """tiny-qwen3 with 4 layers (f32 weights: no CPU repacking, local and remote run the same kernels)."""
    return random_model("tiny-qwen3", n_layer=4)


@need_rpc
@pytest.mark.parametrize("flash_attn, type_kv", [(True, GGML_TYPE_F16), (False, GGML_TYPE_F16), (True, GGML_TYPE_Q8_0)],
                         ids=["fa", "no_fa", "fa_q8_0"])
@pytest.mark.parametrize("n_gpu_layers", [99, 2], ids=["all_remote", "half_remote"])
def test_rpc_all_cells_equals_dense(servers, n_gpu_layers, flash_attn, type_kv):
    """The exactness test of test_native on layers held by two rpc-servers. all_remote: layers 0-2 on the
    first server, layer 3 and the output layer on the second; half_remote (2 layers offloaded, the output
    layer counting as one): layers 0-2 on the local CPU, layer 3 on the first server."""
    with llama_log() as log:
        m = PlacedModel(four_layers(), n_gpu_layers=n_gpu_layers, devices=devices.model_devices(servers))
        try:
            d, identical = all_cells_equal_dense(m, n_steps=64, flash_attn=flash_attn, type_kv=type_kv)
        finally:
            m.close()
    kv, view = buffer_names(log, "KV"), buffer_names(log, "SFI view")
    remote = {b for b in kv if b.startswith("RPC")}
    assert len(remote) == (2 if n_gpu_layers == 99 else 1) and ("CPU" in kv) == (n_gpu_layers < 4), kv
    assert view == kv, (view, kv)  # every view buffer sits with its layer's KV cache
    assert identical, d  # same kernels, cells in order: bit-identical


@need_rpc
def test_rpc_generation_equals_local(servers):
    """SFILlama(rpc_servers=...) greedy SFI generation (fast and slow steps) == the same model on the local CPU,
    with the Selector in the slow step's graph on both (the default with offloaded layers; the CPU default is
    the numpy Selector, which pools over candidate ranks and so picks other cells)."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 300, 700)]
    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=16,
                       min_context=0,  # offloaded layers: SFI also below GPU_MIN_CONTEXT
                       device_selector=True)
    results = []
    for placement in (dict(n_gpu_layers=99, rpc_servers=servers), dict(n_gpu_layers=0)):
        with SFILlama(four_layers(), n_ctx=1024, n_threads=1, flash_attn=True, sfi=config, **placement) as llm:
            out = llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True)
            s = out.stats.sfi
            assert s.n_fast > 0 and s.n_slow > 0 and s.n_fell_back == 0, s
            assert s.n_device_selections == s.n_slow + s.n_bootstrap, s
            results.append((out.tokens, s.slow_steps, s.refresh_overlap))
    assert results[0] == results[1]


@need_rpc
@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no_fa"])
def test_rpc_staggered_refreshes(servers, flash_attn):
    """Mixed steps whose mix changes at every step, with layers on the local CPU and on an rpc-server: the scheduler
    splits each graph over the two backends (a single backend never splits a graph)."""
    m = PlacedModel(four_layers(), n_gpu_layers=2, devices=devices.model_devices(servers))
    try:
        staggered_refreshes(m, flash_attn)
    finally:
        m.close()


@need_rpc
@pytest.mark.parametrize("type_kv", [GGML_TYPE_F16, GGML_TYPE_Q8_0], ids=["f16", "q8_0"])
def test_rpc_kv_on_host_all_cells_equals_dense(servers, type_kv):
    """The KV cache in host memory (offload_kqv off) and the layers on an rpc-server, which stands in for a GPU:
    the view goes to the server, the cache stays on the CPU, and a FAST step over every cell equals dense."""
    with llama_log() as log:
        m = PlacedModel(four_layers(), n_gpu_layers=99, devices=devices.model_devices(servers[:1]))
        try:
            all_cells_equal_dense(m, n_steps=32, type_kv=type_kv, offload_kqv=False)
        finally:
            m.close()
    kv, view = buffer_names(log, "KV"), buffer_names(log, "SFI view")
    assert kv == {"CPU"}, kv
    assert any(b.startswith("RPC") for b in view) and "CPU" in view, view  # the view remote, the key norms local


@need_rpc
@pytest.mark.parametrize("export", ["every_cell", "device_selector"])
def test_rpc_kv_on_host_mixed_step_equals_steps_alone(servers, export):
    """Batched decoding with the cache in host memory: one decode of slow, dense and fast sequences equals one
    decode per kind (slow steps attend over the host cache, fast ones over their views on the server)."""
    m = PlacedModel(four_layers(), n_gpu_layers=99, devices=devices.model_devices(servers[:1]))
    try:
        mixed_equals_by_kind(m, True, export, offload_kqv=False)
    finally:
        m.close()


@need_rpc
def test_rpc_kv_on_host_decodes_as_kv_on_device(servers):
    """SFILlama(kv_on_host=True) against the same model with the cache beside its layers, fed the same tokens: the
    same slow steps, and logits equal up to rounding (host slow steps attend with the fused attention + evidence op
    on the CPU, the rpc-server with flash attention and the evidence op); only the view is in device memory. The
    host cache's prompt goes in ubatches as large as the context allows (each copies the cache to the device), the
    other in ubatches of 512."""
    rng = np.random.default_rng(1)
    prompt = [int(t) for t in rng.integers(3, 300, 700)]
    forced = [int(t) for t in rng.integers(3, 300, 48)]
    # (refreshed by slow steps on both: with kv_on_host async_refresh is on unless set)
    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=16, min_context=0,
                       async_refresh=False)
    runs, memories = [], []
    for kv_on_host in (True, False):
        with SFILlama(four_layers(), n_ctx=1024, n_threads=1, n_gpu_layers=99, rpc_servers=servers[:1],
                      n_batch=None if kv_on_host else 512, sfi=config, kv_on_host=kv_on_host) as llm:
            assert llama_cpp.llama_n_ubatch(llm.context.ctx) == (1024 if kv_on_host else 512)
            stepper = llm.stepper(config)
            stepper.prefill(prompt)
            logits = []
            for token in forced:
                stepper.step(token)
                logits.append(llm.context.last_logits().copy())
            s = stepper.stats
            assert s.n_fast > 0 and s.n_slow > 0 and s.n_fell_back == 0, s
            runs.append((np.array(logits), s.slow_steps))
            memories.append(llm.memory())
    (host, host_slow), (device, device_slow) = runs
    assert host_slow == device_slow
    # (the two attentions round differently, and a near-tie in the flat evidence of random weights may pick another
    # cell: a few hundredths apart at some steps; test_rpc_kv_on_host_generation_equals_kv_on_device has them exact)
    assert np.abs(host - device).mean() < 2e-2, np.abs(host - device).mean()
    assert (host.argmax(-1) == device.argmax(-1)).mean() >= 0.9
    host, device = memories
    assert host.cache_on_host and host.cache_device == 0 and host.cache_host == device.cache_device > 0, memories
    assert 0 < host.view_device < host.cache_host and not device.cache_on_host, memories


@need_rpc
def test_rpc_kv_on_host_generation_equals_kv_on_device(servers):
    """With the slow steps' attention the same on both (flash attention + the evidence op: LLAMA_SFI_FA_EVIDENCE=0,
    read once per process, hence a subprocess), greedy SFI generation with the cache in host memory gives the tokens
    and slow steps of the same model with the cache beside its layers."""
    code = f"""
import numpy as np
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.sfi_llama import SFILlama
from sfi_gguf.tools.random_model import random_model
prompt = [int(t) for t in np.random.default_rng(1).integers(3, 300, 700)]
config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=16, min_context=0,
                   async_refresh=False)
runs = []
for kv_on_host in (True, False):
    with SFILlama(random_model("tiny-qwen3", n_layer=4), n_ctx=1024, n_threads=1, n_gpu_layers=99, n_batch=512,
                  rpc_servers={servers[:1]!r}, sfi=config, kv_on_host=kv_on_host) as llm:
        out = llm.generate(prompt, max_tokens=48, temperature=0, ignore_eos=True)
        assert out.stats.sfi.n_slow > 0 and out.stats.sfi.n_fast > 0, out.stats.sfi
        runs.append((out.tokens, out.stats.sfi.slow_steps))
assert runs[0] == runs[1], runs
"""
    env = dict(os.environ, LLAMA_SFI_FA_EVIDENCE="0")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]


@need_rpc
def test_rpc_bench_kv_on_host(servers):
    """`sfi-gguf bench --kv-on-host` on a model whose layers an rpc-server holds: each depth's row has dense with host
    KV, SFI with host KV (refreshed by slow steps, and asynchronously: the queries of a fast step on the device, the
    export on the CPU), dense with the cache beside the layers, both prefill times and where the bytes are."""
    from sfi_gguf.tools.bench import markdown_table
    from sfi_gguf.tools.bench import run_bench_kv_on_host

    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=8, min_context=0)
    runs = {}
    for prefill_in_vram in (False, True):  # True: the host cache loaded with the in-VRAM prefill's state
        runs[prefill_in_vram] = rows = run_bench_kv_on_host(
            four_layers(), depths=[384, 512], n_decode=24, n_gpu_layers=99, n_threads=1, config=config, n_batch=512,
            prefill_in_vram=prefill_in_vram, n_dense_host=8 if prefill_in_vram else 0, rpc_servers=servers[:1],
            log=lambda text: None)
        assert [r.depth for r in rows] == [384, 512]
        assert [r.dense_host_tokens for r in rows] == [8 if prefill_in_vram else 24] * 2
        for r in rows:
            assert r.kv_on_host and r.slow_steps > 0 and r.fast_steps > 0, r
            assert min(r.dense_tok_s, r.sfi_tok_s, r.dense_vram_tok_s, r.ceiling_tok_s, r.prefill_vram_s) > 0, r
            assert (r.prefill_s > 0) != prefill_in_vram, r
            assert 0 < r.view_device_bytes < r.cache_host_bytes, r
            assert r.sfi_async_tok_s > 0 and r.async_refreshes > 0 and r.t_async_refresh_s > 0, r
            parts = r.t_async_parts_s
            assert parts["fast"] > 0 and parts["load"] > 0, r
            assert parts["slow"] + parts["fast"] + parts["load"] < r.decoded_tokens / r.sfi_async_tok_s, r
            assert 0 <= parts["wait"] <= parts["load"] and 0 < r.t_async_export_s <= r.t_async_refresh_s, r
            assert 0 < parts["gather"] < parts["fast"], r
        assert "| 512 |" in markdown_table(rows)
    # the same cache either way: the same refreshes at the same steps
    assert [(r.slow_steps, r.fast_steps) for r in runs[True]] == [(r.slow_steps, r.fast_steps) for r in runs[False]]


@need_rpc
def test_rpc_kv_on_host_refreshes_asynchronously_by_default(servers):
    """With the cache in host memory a refresh reads it on the CPU: unless the config says otherwise, it is computed
    off the decoding thread (async_refresh), and no slow step runs after the bootstrap."""
    rng = np.random.default_rng(2)
    prompt = [int(t) for t in rng.integers(3, 300, 700)]
    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=8, min_context=0)
    with SFILlama(four_layers(), n_ctx=1024, n_threads=1, n_gpu_layers=99, rpc_servers=servers[:1], n_batch=512,
                  sfi=config, kv_on_host=True) as llm:
        assert llm.effective_config(config).async_refresh is True
        assert llm.effective_config(config.replace(redecode_tail=True)).async_refresh is False
        out = llm.generate(prompt, max_tokens=32, temperature=0, ignore_eos=True)
    s = out.stats.sfi
    assert s.n_slow == 0 and s.n_host_refresh > 0 and s.n_fast > 0, s


@need_rpc
def test_rpc_kv_on_host_refusals(servers):
    with pytest.raises(ValueError, match="n_gpu_layers"):
        SFILlama(four_layers(), kv_on_host=True, rpc_servers=servers[:1])
    with pytest.raises(ValueError, match="flash_attn"):
        SFILlama(four_layers(), kv_on_host=True, n_gpu_layers=99, flash_attn=False, rpc_servers=servers[:1])
    with pytest.raises(ValueError, match="True or False"):
        SFILlama(four_layers(), kv_on_host="yes")
