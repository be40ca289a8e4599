"""The build, the library check at import, and model assembly."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sfi_gguf
from sfi_gguf import _native
from sfi_gguf.context import LlamaContext
from sfi_gguf.models import KNOWN_MODELS, ensure_model, resolve_model_path
from sfi_gguf.random_model import random_model

REPO = Path(__file__).resolve().parent.parent


def test_patched_library_is_the_one_llama_cpp_uses():
    info = sfi_gguf.native_info()
    assert info["sfi_api_version"] == _native.EXPECTED_SFI_API_VERSION
    assert Path(info["library"]).parent == _native.find_lib_dir().resolve()
    # llama-cpp-python's bindings and our symbols share one CDLL
    assert _native.llama_cpp.llama_cpp._lib is _native.lib
    assert "CPU" in info["system_info"]


def test_refuses_when_llama_cpp_loaded_another_libllama(tmp_path):
    other = tmp_path / "otherlib"
    shutil.copytree(_native.find_lib_dir(), other)
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(other))
    code = "import llama_cpp\nimport sfi_gguf\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    assert "NativeLibraryError" in result.stderr and "already imported with another libllama" in result.stderr


def test_llama_cpp_imported_after_us_uses_our_library(tmp_path):
    code = ("import sfi_gguf, llama_cpp\n"
            "from sfi_gguf._native import find_lib_dir\n"
            "import pathlib\n"
            "assert pathlib.Path(llama_cpp.llama_cpp._lib._name).resolve().parent == find_lib_dir().resolve()\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_prepare_script_refuses_a_tree_without_llama_h(tmp_path):
    result = subprocess.run([sys.executable, str(REPO / "native" / "prepare_llama_cpp.py"), "--dest",
                             str(tmp_path / "out"), "--source", str(tmp_path)], capture_output=True, text=True)
    assert result.returncode != 0
    assert "not a llama.cpp tree" in result.stderr


@pytest.mark.real_model
def test_llama_cpp_logs_only_when_verbose(capfd):
    # the default model's vocabulary makes llama.cpp warn at every load ("control-looking token")
    path = random_model("tiny-qwen3", n_layer=2, vocab="copy")
    for verbose in (False, True):
        LlamaContext(path, n_ctx=256, n_gpu_layers=0, n_threads=1, n_batch=64, flash_attn=True,
                     verbose=verbose).close()
        if verbose:
            log = capfd.readouterr().err
            assert "control-looking token" in log and "llama_model_loader" in log
        else:
            assert capfd.readouterr().err == ""


@pytest.mark.real_model
def test_default_model_is_assembled_and_verified():
    path = ensure_model()
    assert path.stat().st_size == KNOWN_MODELS["qwen2.5-coder-0.5b-instruct"].size
    assert resolve_model_path(None) == path
    assert resolve_model_path("qwen2.5-coder-0.5b-instruct") == path


def test_resolve_model_path_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="model file not found"):
        resolve_model_path(tmp_path / "missing.gguf")
    text = tmp_path / "notes.txt"
    text.write_text("hello")
    with pytest.raises(ValueError, match="not a GGUF file"):
        resolve_model_path(text)
    with pytest.raises(ValueError, match="not a file"):
        resolve_model_path(tmp_path)
    with pytest.raises(ValueError, match="unknown model"):
        ensure_model("no-such-model")
