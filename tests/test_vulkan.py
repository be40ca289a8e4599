"""SFI with its layers on llama.cpp's Vulkan backend: the composite graph (Vulkan has none of our fused ops) on a GPU API
other than CUDA, the nearest this project gets to Metal's path without a Mac.

Run by scripts/vulkan_check.sh, which builds llama.cpp with GGML_VULKAN=ON and points SFI_GGUF_LIB_DIR at it (on a
machine without a GPU the device is Mesa's lavapipe, Vulkan on the CPU); skipped with a library without Vulkan.
The same script runs test_native's exactness tests and the device Selector's tests with the layers on the device.
"""
from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from sfi_gguf.core import devices
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.sfi_llama import SFILlama
from sfi_gguf.tools.random_model import random_model
from placement import PlacedModel, all_cells_equal_dense, buffer_names, llama_log
from native_harness import GGML_TYPE_F16, GGML_TYPE_Q8_0

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "native"))
import backend_audit  # noqa: E402

VULKAN = [d for d in devices.devices() if d["backend"] == "Vulkan"]
need_vulkan = pytest.mark.skipif(not VULKAN, reason="needs a library built with GGML_VULKAN=ON (scripts/vulkan_check.sh)")

# SFI's nodes that Vulkan does not run (its supports_op, source and device agree), so the scheduler computes them on
# the CPU: the slow step's keys times queries on a Q8_0 cache, whose per-head view is not contiguous in its first two
# dimensions (ggml-vulkan multiplies a quantized matrix in place only then); llama.cpp's own attention without flash
# attention has the same limit, and a Q8_0 V needs flash attention anyway. Named in docs/backends.md, "Apple Silicon".
VULKAN_GAPS = {"MUL_MAT F32 <- Q8_0, F32"}


def four_layers() -> str:
    return random_model("tiny-qwen3", n_layer=4)


@need_vulkan
@pytest.mark.parametrize("flash_attn, type_kv", [(True, GGML_TYPE_F16), (False, GGML_TYPE_F16), (True, GGML_TYPE_Q8_0)],
                         ids=["fa", "no_fa", "fa_q8_0"])
def test_kv_cache_and_view_on_the_device_all_cells_equal_dense(flash_attn, type_kv):
    """test_native's exactness check with every layer on the Vulkan device: the KV cache and the SFI view are
    there, and a fast step over every cell gives dense's logits."""
    with llama_log() as log:
        m = PlacedModel(four_layers(), n_gpu_layers=99)
        try:
            all_cells_equal_dense(m, n_steps=48, flash_attn=flash_attn, type_kv=type_kv)
        finally:
            m.close()
    kv, view = buffer_names(log, "KV"), buffer_names(log, "SFI view")
    assert kv == {VULKAN[0]["name"]} and view == kv, (kv, view)


@need_vulkan
def test_sfi_generation_on_the_device():
    """SFILlama greedy SFI generation with the layers on the Vulkan device and the Selector in the slow step's graph:
    fast and slow steps, every refresh selected on the device, none fell back to dense; the tokens are those of
    the same generation on the CPU (the CPU's fused ops and Vulkan's composite ones select the same cells)."""
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(3, 300, 700)]
    config = SFIConfig(k_head=64, n_sink=4, n_recent=32, policy="fixed", fixed_period=16, min_context=0,
                       device_selector=True)
    results = []
    for ngl in (99, 0):
        with SFILlama(four_layers(), n_ctx=1024, n_threads=1, flash_attn=True, sfi=config, n_gpu_layers=ngl) as llm:
            out = llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True)
            s = out.stats.sfi
            assert s.n_fast > 0 and s.n_slow > 0 and s.n_fell_back == 0, s
            assert s.n_device_selections == s.n_slow + s.n_bootstrap, s
            results.append(out.tokens)
    assert results[0] == results[1]


@need_vulkan
def test_sfi_nodes_run_on_the_device():
    """Every node of SFI's slow, fast and mixed graphs with the layers on the device: Vulkan's own supports_op
    agrees with its source (as backend_audit runs it) wherever the source's answer does not depend on the device,
    and every SFI node Vulkan supports was computed there; those it does not are VULKAN_GAPS only."""
    checkers = backend_audit.backends(backend_audit.read_sources(None))
    recorder = backend_audit.Recorder({"Vulkan": VULKAN[0]["ptr"]})
    names = {"device-selector", "device-selector-no-fa", "device-selector-q8_0", "host-selector-no-fa",
             "batched-mixed", "batched-mixed-no-fa"}
    steps = backend_audit.capture(recorder, n_gpu_layers=99, only=backend_audit.with_their_dense_runs(names))
    assert not recorder.errors, recorder.errors[:3]
    assert all(steps[n]["slow"] > 0 and steps[n]["fast"] > 0 for n in names), steps
    result = backend_audit.audit(recorder.seen, checkers)
    assert result["mismatches"] == []
    device = VULKAN[0]["name"]
    sfi = [r for r in result["rows"] if r["sfi"]]
    unsupported = {r["signature"] for r in sfi if False in r["device"]["Vulkan"]}
    assert unsupported == VULKAN_GAPS
    for r in sfi:
        if r["signature"] not in VULKAN_GAPS and r["buffers"]:
            assert r["buffers"] == {device}, (r["signature"], r["buffers"])
    # the host-only column gather is not built for a cache on the device
    assert not any(r["host_only"] for r in result["rows"])
