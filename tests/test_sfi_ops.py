"""The SFI ggml ops (native/tests/sfi-test-ops.cpp) on every backend of the build against their definition.

The op test checks each op against the composite ggml ops it replaces, on the CPU (exact to the summation
order) and on every other backend the build has (a GPU: to rounding), over head sizes, GQA groups, key types
(F16, Q8_0, Q4_0, F32), cell counts, masks and soft-capping. The device Selector's tests (tests/test_device_selector.py) check
the selection the fused op leads to against the numpy Selector; below they run once more on the composite ops.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from sfi_gguf.core.library import find_lib_dir


def test_sfi_ops_match_their_definition_on_every_backend():
    binary = find_lib_dir() / "sfi-test-ops"
    assert binary.exists(), f"{binary} missing: the build installs it next to the library"
    out = subprocess.run([str(binary), "-v"], capture_output=True, text=True, timeout=600)
    print(out.stdout[-4000:])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    lines = [line for line in out.stdout.splitlines() if line.startswith("ok ")]
    assert any(" on CPU:" in line for line in lines)
    if os.environ.get("SFI_TEST_NGL"):
        assert any(" on CPU:" not in line for line in lines), "no GPU backend ran the ops"


def test_device_selector_on_the_composite_ops():
    """Backends without the fused ops (Metal, Vulkan, RPC) build the composite ops instead: the device Selector's
    tests again with LLAMA_SFI_FUSED=0 (read once per process, so in a child process), which keeps them
    everywhere. The tests in-process run the fused op on the CPU."""
    env = dict(os.environ, LLAMA_SFI_FUSED="0")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device_selector.py"],
                         capture_output=True, text=True, env=env, timeout=1200, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-2000:]


def test_device_selector_with_the_attention_giving_the_evidence():
    """LLAMA_SFI_FA_EVIDENCE=1 (read once per process, so in a child process; the default where the keys are on a
    GPU, not on the CPU): each refreshed layer's flash attention in a slow step is ggml_sfi_flash_attn_evidence, whose
    evidence and key norms the device Selector takes; its tests again, with the tolerances of an attention that equals
    flash attention up to rounding."""
    env = dict(os.environ, LLAMA_SFI_FA_EVIDENCE="1")
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/test_device_selector.py"],
                         capture_output=True, text=True, env=env, timeout=1200, cwd=Path(__file__).resolve().parent.parent)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout and "failed" not in out.stdout, out.stdout[-2000:]
