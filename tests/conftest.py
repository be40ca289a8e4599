"""Fixtures and checks shared by the test modules (tests/ is on sys.path: helpers are plain imports).

Tests that need a downloaded model (the default model, gemma3-270m, qwen2.5-coder-1.5b, or their tokenizer)
carry the `real_model` mark; `pytest -m "not real_model"` is the fast tier (random-weight models, pure Python,
numpy). Outside the mark, `sfi_gguf.models.ensure_model` fails the test, so a model fetched or assembled by an
unmarked test is caught. Model fixtures are module-scoped: a module's tests share one loaded model.
"""
from __future__ import annotations

import pytest

import sfi_gguf
from sfi_gguf import models
from sfi_gguf.tools.random_model import random_model
from native_harness import Model
from serving import running_server

_ensure_model = models.ensure_model


def _no_download(name: str = models.DEFAULT_MODEL, progress: bool = True):
    if name not in models.KNOWN_MODELS:
        return _ensure_model(name, progress)  # (its error for an unknown name)
    raise AssertionError(f"this test uses the downloaded model {name!r}: mark it real_model")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """Outside the real_model tier, ensure_model fails (in the test's setup, call and teardown), wherever it was
    imported from."""
    if item.get_closest_marker("real_model") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        module = getattr(item, "module", None)
        for owner in (models, sfi_gguf) + ((module,) if module is not None else ()):
            for name, value in list(vars(owner).items()):
                if value is _ensure_model:
                    mp.setattr(owner, name, _no_download)
        yield


# -- SFILlama on the default model, and its server ---------------------------------------------------

@pytest.fixture(scope="module")
def llm(request):
    """The default model, shared by a module's tests: SFILlama with the module's LLM_ARGS (its keywords), else a
    1024-token context on one thread (two threads spin-wait on CI's 2 shared cores)."""
    from sfi_gguf import SFILlama

    with SFILlama(None, **getattr(request.module, "LLM_ARGS", {"n_ctx": 1024, "n_threads": 1})) as model:
        yield model


@pytest.fixture(scope="module")
def server(llm):
    """`llm` served as "test-model" on a free loopback port."""
    with running_server(llm, "test-model") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server):
    """An openai client of `server`."""
    import openai

    return openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=300)


# -- random-weight models ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_path():
    return random_model("tiny-llama")


def _native_model(path):
    m = Model(path)
    yield m
    m.close()


@pytest.fixture(scope="module")
def tiny(tiny_path):
    """tiny-llama, loaded for the native tests' raw contexts (native_harness.Ctx)."""
    yield from _native_model(tiny_path)


@pytest.fixture(scope="module")
def tiny_qwen2():
    yield from _native_model(random_model("tiny-qwen2"))


@pytest.fixture(scope="module")
def tiny_qwen3():
    yield from _native_model(random_model("tiny-qwen3"))


@pytest.fixture(scope="module")
def tiny_gemma3():
    yield from _native_model(random_model("tiny-gemma3"))


@pytest.fixture(scope="module")
def real():
    """The default model for the native tests' raw contexts (mark its tests real_model)."""
    yield from _native_model(models.ensure_model())
