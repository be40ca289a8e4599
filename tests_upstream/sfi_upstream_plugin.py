"""pytest plugin: llama-cpp-python 0.3.36's own test suite, run against sfi-gguf's patched llama.cpp.

Loaded by scripts/test_llama_cpp_python.sh with `-p sfi_upstream_plugin`, in a pytest run whose
rootdir is the sdist's top directory extracted to a temporary folder (their tests/ and their
pytest config, unmodified). This plugin only:

1. checks that the `llama_cpp` bindings loaded sfi-gguf's patched libllama (LLAMA_CPP_LIB_PATH, and
   the library exports `llama_sfi_version`) before any test runs;
2. replaces `huggingface_hub.hf_hub_download` (the tests' only way to get models; this machine
   cannot reach the hub) by a table of local stand-ins, before the test modules import it;
3. deselects, with the reason, the tests that cannot pass with any stand-in (DESELECT below);
4. writes a JSON report of every test's outcome (SFI_UPSTREAM_REPORT), printed by the script.

With SFI_UPSTREAM_DROPIN=1 it also puts `sfi_gguf.Llama` in place of `llama_cpp.Llama` (the tests call
`llama_cpp.Llama(...)`), so the same tests run through SFI's token loop; the report then says, per test,
which models decoded through SFI and how many of their steps were fast, slow and dense.
SFI_UPSTREAM_SFI (a JSON object of SFIConfig fields) replaces the default SFI settings of those models,
e.g. a small memory that makes SFI sparse at the tests' 32- and 64-cell contexts.

Environment (set by the script): LLAMA_CPP_LIB_PATH, SFI_UPSTREAM_SDIST (extracted sdist root),
SFI_UPSTREAM_DEFAULT_MODEL (sfi-gguf's default model), SFI_UPSTREAM_MODEL_CACHE (where random-weight
models are generated), SFI_UPSTREAM_REPORT (JSON report path).
"""
from __future__ import annotations

import ctypes
import hashlib
import json
import os
import time
from pathlib import Path

import pytest

EXPECTED_LLAMA_CPP_PYTHON = "0.3.36"
HERE = Path(__file__).resolve().parent

DEFAULT_MODEL = "default"  # sfi-gguf's default model: Qwen2.5-Coder-0.5B-Instruct Q8_0 (qwen2)

# (repo_id, filename) asked of hf_hub_download -> (stand-in, why it fits).
# A stand-in is DEFAULT_MODEL or a kind from random_gguf.KINDS (random weights, real tokenizer).
SUBSTITUTES: dict[tuple[str, str], tuple[str, str]] = {
    ("lmstudio-community/Qwen3.5-0.8B-GGUF", "Qwen3.5-0.8B-Q8_0.gguf"): (
        DEFAULT_MODEL,
        "a small real instruct model of the same family; the tests that use it check completions a "
        "real language model gives (the pangram, 'true', a number), which the stand-in must give too",
    ),
    ("ggml-org/models", "tinyllamas/stories15M-q4_0.gguf"): (
        DEFAULT_MODEL,
        "the tests only need a plain transformer (KV-cache) model and compare it with itself",
    ),
    ("QuantFactory/mamba-130m-hf-GGUF", "mamba-130m-hf.Q2_K.gguf"): (
        "mamba",
        "random-weight Mamba (same architecture: purely recurrent), GPT-NeoX tokenizer as mamba-130m; "
        "the tests only compare the model with itself",
    ),
    ("tiiuae/Falcon-H1-Tiny-90M-Instruct-GGUF", "Falcon-H1-Tiny-90M-Instruct-Q2_K.gguf"): (
        "falcon-h1",
        "random-weight Falcon-H1 (same architecture: hybrid attention + Mamba-2), Falcon tokenizer; "
        "the tests only compare the model with itself",
    ),
    ("CompendiumLabs/bge-small-en-v1.5-gguf", "bge-small-en-v1.5-q4_k_m.gguf"): (
        "bert",
        "random-weight BERT (same architecture, CLS pooling) with the real BGE tokenizer; the test "
        "checks embedding shapes and batched == one-by-one, not values",
    ),
}

# Test node ids (relative to the sdist root) that cannot run here, with the reason.
DESELECT: dict[str, str] = {
    "tests/test_llama.py::test_real_model": (
        "needs Qwen3.5-0.8B's exact tokenizer: asserts tokenize('Hello, world!') == "
        "[9419, 11, 1814, 0], token ids of that model's own vocabulary; no GGUF with it is available "
        "offline (the sdist's ggml-vocab-qwen35.gguf and the default model, both 151,936-token "
        "Qwen2-style vocabularies, give [9707, 11, 1879, 0]; Gemma 3's gives other ids)"
    ),
}

_state: dict = {"requests": {}, "current": None, "deselected": {}, "results": {}, "lib": {}}


# --- 1. the library under test --------------------------------------------------------------------

def _check_library() -> dict:
    lib_dir = os.environ.get("LLAMA_CPP_LIB_PATH")
    if not lib_dir:
        raise pytest.UsageError("sfi-upstream: LLAMA_CPP_LIB_PATH is not set (run scripts/test_llama_cpp_python.sh)")
    import llama_cpp

    if llama_cpp.__version__ != EXPECTED_LLAMA_CPP_PYTHON:
        raise pytest.UsageError(
            f"sfi-upstream: llama_cpp {llama_cpp.__version__} is installed; these are the tests of "
            f"{EXPECTED_LLAMA_CPP_PYTHON}"
        )
    lib = llama_cpp.llama_cpp._lib
    loaded = Path(lib._name).resolve()
    if loaded.parent != Path(lib_dir).resolve():
        raise pytest.UsageError(f"sfi-upstream: llama_cpp loaded {loaded}, not the library in {lib_dir}")
    if not hasattr(lib, "llama_sfi_version"):
        raise pytest.UsageError(f"sfi-upstream: {loaded} has no llama_sfi_version: not sfi-gguf's patched llama.cpp")
    lib.llama_sfi_version.argtypes = []
    lib.llama_sfi_version.restype = ctypes.c_int32
    info = {
        "library": str(loaded),
        "llama_sfi_version": int(lib.llama_sfi_version()),
        "llama_cpp_python": llama_cpp.__version__,
    }
    # Multimodal: llama-cpp-python installed with LLAMA_BUILD=OFF has no libmtmd, and sfi-gguf does not
    # build one. llama_chat_format imports llama_cpp.mtmd_cpp lazily (only in the multimodal chat
    # handlers), so importing llama_cpp and llama_chat_format works; record what mtmd_cpp does.
    import llama_cpp.llama_chat_format  # noqa: F401  (must import fine without libmtmd)

    try:
        import llama_cpp.mtmd_cpp  # noqa: F401

        info["mtmd"] = "importable"
    except Exception as exc:  # FileNotFoundError from llama-cpp-python's loader
        info["mtmd"] = f"not importable: {type(exc).__name__}: {exc}"
    return info


# --- 2. hub downloads -> local stand-ins ---------------------------------------------------------

def _random_model(kind: str) -> Path:
    from random_gguf import make  # noqa: E402  (this folder is on sys.path: the plugin is imported from it)

    sdist = Path(os.environ["SFI_UPSTREAM_SDIST"])
    key = hashlib.sha256((HERE / "random_gguf.py").read_bytes() + sdist.name.encode()).hexdigest()[:12]
    cache = Path(os.environ.get("SFI_UPSTREAM_MODEL_CACHE") or sdist.parent / "models") / key
    path = cache / f"random-{kind}.gguf"
    if not path.exists():
        make(kind, sdist, path)
    return path


def _hf_hub_download(repo_id: str, filename: str, *args, **kwargs) -> str:
    key = (repo_id, filename)
    if key not in SUBSTITUTES:
        raise RuntimeError(
            f"sfi-upstream: the test asked the hub for {repo_id}/{filename}, which has no local "
            "stand-in (add it to SUBSTITUTES in tests_upstream/sfi_upstream_plugin.py)"
        )
    stand_in, _why = SUBSTITUTES[key]
    if stand_in == DEFAULT_MODEL:
        path = Path(os.environ["SFI_UPSTREAM_DEFAULT_MODEL"])
    else:
        path = _random_model(stand_in)
    if _state["current"]:
        _state["requests"].setdefault(_state["current"], []).append(
            {"asked": f"{repo_id}/{filename}", "stand_in": stand_in, "path": str(path)}
        )
    return str(path)


# --- 1b. sfi_gguf.Llama in place of llama_cpp.Llama (SFI_UPSTREAM_DROPIN=1) -------------------------

def _install_dropin() -> dict:
    import llama_cpp
    import sfi_gguf
    from sfi_gguf.core.config import SFIConfig

    overrides = json.loads(os.environ.get("SFI_UPSTREAM_SFI") or "{}")
    default_sfi = SFIConfig(**overrides) if overrides else True

    class DropInLlama(sfi_gguf.Llama):
        """sfi_gguf.Llama, counting what its generations did (the report's per-test SFI steps)."""

        def __init__(self, *args, **kwargs):
            kwargs.setdefault("sfi", default_sfi)
            super().__init__(*args, **kwargs)
            entry = _state["sfi"].setdefault(_state["current"] or "?", {
                "models": 0, "sfi_active": 0, "unavailable": [], "n_fast": 0, "n_slow": 0, "n_bootstrap": 0,
                "n_dense": 0})
            entry["models"] += 1
            if self.sfi_active:
                entry["sfi_active"] += 1
            else:
                entry["unavailable"].append(self.sfi_unavailable)
            self._sfi_report = entry

        def _sfi_prefill(self, prompt):
            super()._sfi_prefill(prompt)
            stats = self.last_sfi_stats  # a new stepper's: summed into the report when the test ends
            if stats is not None:
                _state["steppers"].setdefault(id(self._sfi_report), (self._sfi_report, []))[1].append(stats)

    DropInLlama.__name__ = DropInLlama.__qualname__ = "Llama"
    DropInLlama.__module__ = "sfi_gguf"
    llama_cpp.Llama = DropInLlama
    import llama_cpp.llama

    llama_cpp.llama.Llama = DropInLlama
    return {"dropin": "sfi_gguf.Llama in place of llama_cpp.Llama", "sfi": overrides or "defaults"}


def pytest_configure(config):
    _state["lib"] = _check_library()
    _state["sfi"] = {}
    _state["steppers"] = {}
    if os.environ.get("SFI_UPSTREAM_DROPIN") == "1":
        _state["lib"].update(_install_dropin())
    import huggingface_hub

    huggingface_hub.hf_hub_download = _hf_hub_download  # before the test modules import it


def pytest_report_header(config):
    lib = _state["lib"]
    return [
        f"sfi-upstream: llama-cpp-python {lib['llama_cpp_python']} tests against {lib['library']} "
        f"(llama_sfi_version {lib['llama_sfi_version']})",
        f"sfi-upstream: llama_cpp.mtmd_cpp {lib['mtmd']}",
    ] + ([f"sfi-upstream: {lib['dropin']}, SFI settings: {lib['sfi']}"] if "dropin" in lib else [])


# --- 3. tests that cannot run ------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)  # before -k/-m, so every DESELECT entry is checked against the suite
def pytest_collection_modifyitems(session, config, items):
    keep, drop = [], []
    for item in items:
        reason = DESELECT.get(item.nodeid)
        if reason is None:
            keep.append(item)
        else:
            drop.append(item)
            _state["deselected"][item.nodeid] = reason
    files = {item.nodeid.split("::")[0] for item in items}
    unknown = {n for n in DESELECT if n.split("::")[0] in files and n not in _state["deselected"]}
    if unknown:
        raise pytest.UsageError(f"sfi-upstream: DESELECT names tests that do not exist: {sorted(unknown)}")
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


# --- 4. report --------------------------------------------------------------------------------

@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _state["current"] = item.nodeid  # before the fixtures (which call hf_hub_download) run


def pytest_runtest_teardown(item):
    for entry, stats in _state.get("steppers", {}).values():
        for key in ("n_fast", "n_slow", "n_bootstrap", "n_dense"):
            entry[key] += sum(getattr(s, key) for s in stats)
    _state.get("steppers", {}).clear()


def pytest_runtest_logreport(report):
    entry = _state["results"].setdefault(report.nodeid, {"outcome": "passed", "duration_s": 0.0})
    entry["duration_s"] = round(entry["duration_s"] + report.duration, 2)
    if report.failed:
        entry["outcome"] = "failed" if report.when == "call" else "error"
    elif report.skipped and entry["outcome"] == "passed":
        entry["outcome"] = "skipped"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    tr = terminalreporter
    tr.section("sfi-upstream: deselected (cannot run here)")
    for nodeid, reason in _state["deselected"].items():
        tr.write_line(f"{nodeid}: {reason}")
    if _state["sfi"]:
        tr.section("sfi-upstream: sfi_gguf.Llama per test (models through SFI; steps fast / slow / dense)")
        for nodeid, e in _state["sfi"].items():
            tr.write_line(f"{nodeid}: {e['sfi_active']} of {e['models']} models through SFI; steps "
                          f"{e['n_fast']} fast, {e['n_slow']} slow (+{e['n_bootstrap']} bootstrap), {e['n_dense']} dense"
                          + (f"; not SFI: {sorted(set(e['unavailable']))}" if e["unavailable"] else ""))
    tr.section("sfi-upstream: stand-ins for hub models")
    for nodeid, requests in _state["requests"].items():
        for r in requests:
            tr.write_line(f"{nodeid}: {r['asked']} -> {r['stand_in']} ({Path(r['path']).name})")
    out = os.environ.get("SFI_UPSTREAM_REPORT")
    if out:
        results = dict(_state["results"])
        for nodeid, requests in _state["requests"].items():
            results.setdefault(nodeid, {})["stand_ins"] = sorted({r["stand_in"] for r in requests})
        for nodeid, sfi in _state["sfi"].items():
            results.setdefault(nodeid, {})["sfi"] = sfi
        for nodeid, reason in _state["deselected"].items():
            results[nodeid] = {"outcome": "deselected", "reason": reason}
        Path(out).write_text(json.dumps({
            "library": _state["lib"],
            "substitutes": {f"{r}/{f}": {"stand_in": s, "why": w} for (r, f), (s, w) in SUBSTITUTES.items()},
            "results": results,
            "exitstatus": int(exitstatus),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S"),
        }, indent=2))
