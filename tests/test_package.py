"""The build, the library check at import, the package's import structure, and model assembly."""
import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import sfi_gguf
from sfi_gguf.core import library
from sfi_gguf.core.context import LlamaContext
from sfi_gguf.models import KNOWN_MODELS, ensure_model, resolve_model_path
from sfi_gguf.tools.random_model import random_model

REPO = Path(__file__).resolve().parent.parent


def test_patched_library_is_the_one_llama_cpp_uses():
    info = sfi_gguf.native_info()
    assert info["sfi_api_version"] == library.EXPECTED_SFI_API_VERSION
    assert Path(info["library"]).parent == library.find_lib_dir().resolve()
    # llama-cpp-python's bindings and our symbols share one CDLL
    assert library.llama_cpp.llama_cpp._lib is library.lib
    assert "CPU" in info["system_info"]


def test_refuses_when_llama_cpp_loaded_another_libllama(tmp_path):
    other = tmp_path / "otherlib"
    shutil.copytree(library.find_lib_dir(), other)
    env = dict(os.environ, LLAMA_CPP_LIB_PATH=str(other), PYTHONPATH=str(REPO))  # this checkout's sfi_gguf
    code = "import llama_cpp\nimport sfi_gguf\n"
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode != 0
    assert "NativeLibraryError" in result.stderr and "already imported with another libllama" in result.stderr


def test_llama_cpp_imported_after_us_uses_our_library(tmp_path):
    code = ("import sfi_gguf, llama_cpp\n"
            "from sfi_gguf.core.library import find_lib_dir\n"
            "import pathlib\n"
            "assert pathlib.Path(llama_cpp.llama_cpp._lib._name).resolve().parent == find_lib_dir().resolve()\n"
            "print('ok')\n")
    result = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=str(REPO)),
                            capture_output=True, text=True, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_the_public_names():
    from sfi_gguf import PunctuationParams, SamplingParams, SFIConfig, SFISelectorParams, TopKMassParams
    from sfi_gguf.core import config, sampling

    assert all(hasattr(sfi_gguf, name) for name in sfi_gguf.__all__)
    assert SFIConfig is config.SFIConfig and SamplingParams is sampling.SamplingParams
    config = SFIConfig(policy_params=PunctuationParams(refresh_interval=64), selector="topk_mass")
    assert config == SFIConfig(refresh_interval=64, selector="topk_mass")
    assert isinstance(config.selector_params, TopKMassParams) and not isinstance(config.selector_params,
                                                                                SFISelectorParams)


def import_graph(root: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source (in functions too); packages'
    `__init__` left out (every submodule import runs it)."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph = {}
    for name, (path, is_package) in modules.items():
        here = name.split(".") if is_package else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                package = here[:len(here) - node.level + 1] if node.level else []
                base = ".".join(package + ([node.module] if node.module else []))
                for alias in node.names:  # `from . import x`: x is a module or a name in the package
                    targets.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
            elif isinstance(node, ast.Import):
                targets.update(alias.name for alias in node.names)
        graph[name] = {t for t in targets if t in modules and t != name and not modules[t][1]}
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), list(graph[start])
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo.extend(graph[module])
    return seen


# What each layer of the package may import: the library (core) nothing above it; serving (serve) the library; the
# public API at the top (SFILlama, Llama, the CLI, models) both; the benchmark and evaluation tooling anything.
MAY_IMPORT = {"core": {"core"}, "serve": {"core", "serve"}, "top": {"core", "serve", "top"},
              "tools": {"core", "serve", "top", "tools"}}


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in MAY_IMPORT else "top"


def test_no_import_circles_and_each_layer_imports_only_below_it():
    graph = import_graph(REPO / "sfi_gguf")
    assert "sfi_gguf.core.plan" in graph["sfi_gguf.core.stepper"]  # the graph sees relative imports
    assert "sfi_gguf.core.context" in graph["sfi_gguf.serve.slots"]
    assert "sfi_gguf.serve.openai_api" in graph["sfi_gguf.sfi_llama"]
    assert "sfi_gguf.tools.texts" in graph["sfi_gguf.tools.bench"]
    assert [m for m in graph if m in reachable(graph, m)] == []
    assert {layer(m) for m in graph} == set(MAY_IMPORT)
    assert [(m, t) for m in graph for t in graph[m] if layer(t) not in MAY_IMPORT[layer(m)]] == []


def test_the_layer_rule_catches_a_wrong_import(tmp_path):
    root = tmp_path / "sfi_gguf"
    for package in ("", "core", "serve", "tools"):
        (root / package).mkdir(exist_ok=True)
        (root / package / "__init__.py").write_text("")
    (root / "core" / "engine.py").write_text("from ..serve import slots\n")  # core reaching up into serve
    (root / "serve" / "slots.py").write_text("from ..core.engine import x\nfrom ..tools import bench\n")
    (root / "tools" / "bench.py").write_text("from .. import cli\n")
    (root / "cli.py").write_text("")
    graph = import_graph(root)
    assert sorted((m, t) for m in graph for t in graph[m] if layer(t) not in MAY_IMPORT[layer(m)]) == [
        ("sfi_gguf.core.engine", "sfi_gguf.serve.slots"), ("sfi_gguf.serve.slots", "sfi_gguf.tools.bench")]


def test_the_library_and_the_cli_load_no_tooling():
    code = ("import sys, sfi_gguf, sfi_gguf.cli, sfi_gguf.serve.server, sfi_gguf.cli_chat, sfi_gguf.serve.slots\n"
            "sfi_gguf.cli.build_parser()\n"
            "print(sorted(m for m in sys.modules if m.startswith('sfi_gguf.tools')))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


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


def test_library_log_filter_keeps_debug_lines_out_of_python():
    """Behind llama_sfi_log_set's filter a context's debug lines (llama.cpp logs some at every decode) never reach the
    callback, verbose or not; the info lines always do (verbose prints them)."""
    import ctypes

    from sfi_gguf.core import log as llama_log
    from sfi_gguf.core.library import lib, llama_cpp

    levels: list[int] = []

    @llama_cpp.llama_log_callback
    def capture(level, text, user_data):
        levels.append(level)

    path = random_model("tiny-qwen3", n_layer=2)
    seen = {}
    lib.llama_sfi_log_set(capture, ctypes.c_void_p(0), 2)
    try:
        for verbose in (False, True):
            levels.clear()
            LlamaContext(path, n_ctx=256, n_gpu_layers=0, n_threads=1, n_batch=64, flash_attn=True,
                         verbose=verbose).close()
            seen[verbose] = set(levels)
    finally:
        llama_log.install()
    debug, info = 1, 2  # enum ggml_log_level
    assert info in seen[False] and debug not in seen[False]
    assert info in seen[True] and debug not in seen[True]


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


def test_a_test_outside_the_real_model_tier_cannot_fetch_a_model():
    """conftest.py's guard of the fast tier (`pytest -m "not real_model"`): loading the default model from a test
    without the mark fails and says which mark is missing."""
    from sfi_gguf import SFILlama

    with pytest.raises(AssertionError, match="mark it real_model"):
        SFILlama(None)
