"""Reliability of SFILlama: bad input, half-initialised objects, interruptions, stale streams, determinism.

A local inference library runs inside the user's process: bad input must raise a clear Python
exception (naming the parameter) and leave nothing half-initialised behind; an interrupted or
superseded generation must leave the object usable, with the same output as a fresh object; and the
same seed and config must give the same tokens. Tiny random-weight models (sfi_gguf.tools.random_model) keep
this fast; SFI is made active at their small contexts with a small budget.
"""
from __future__ import annotations

import inspect
import re
import threading
import warnings

import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.context import ContextError
from sfi_gguf.core.devices import gpu_count, summary
from sfi_gguf.tools.random_model import random_model

THREADS = 1
N_CTX = 512
# SFI active from 100 cells on: 4 sink + 64 selected + 32 recent; refreshes every 16..32 steps
SFI = SFIConfig(k_head=64, n_recent=32, refresh_interval=32, min_gap=8)


def make(path, sfi=SFI, n_ctx=N_CTX, **kw):
    return SFILlama(str(path), n_ctx=n_ctx, n_threads=THREADS, sfi=sfi, **kw)


def prompt_tokens(n=200, seed=0):
    import numpy as np

    return [int(t) for t in np.random.default_rng(seed).integers(3, 300, n)]


class FreeCounter:
    """Counts llama_model_free / llama_free calls (monkeypatched into the llama_cpp module)."""

    def __init__(self, monkeypatch):
        self.models = self.contexts = 0
        real_model_free, real_free = llama_cpp.llama_model_free, llama_cpp.llama_free

        def model_free(m):
            self.models += 1
            real_model_free(m)

        def free(c):
            self.contexts += 1
            real_free(c)

        monkeypatch.setattr(llama_cpp, "llama_model_free", model_free)
        monkeypatch.setattr(llama_cpp, "llama_free", free)


# -- bad input: model files -----------------------------------------------------------------------

def test_missing_directory_and_non_gguf_files(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        SFILlama(tmp_path / "missing.gguf")
    with pytest.raises(ValueError, match="not a file"):
        SFILlama(tmp_path)
    text = tmp_path / "notes.gguf"
    text.write_text("just some text\n")
    with pytest.raises(ValueError, match="not a GGUF"):
        SFILlama(text)
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match="not a GGUF"):
        SFILlama(empty)


@pytest.mark.parametrize("cut", [4, 100, 5000, -1000])
def test_truncated_gguf_is_refused(tmp_path, tiny_path, cut):
    data = tiny_path.read_bytes()
    bad = tmp_path / "truncated.gguf"
    bad.write_bytes(data[:cut])
    with pytest.raises(ValueError, match="could not load"):
        SFILlama(bad, n_threads=THREADS)


def test_gguf_with_garbage_metadata_is_refused(tmp_path, tiny_path):
    data = bytearray(tiny_path.read_bytes())
    data[8:16] = (2**62).to_bytes(8, "little")  # tensor count: absurd
    bad = tmp_path / "garbage.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="could not load"):
        SFILlama(bad, n_threads=THREADS)


# -- bad input: context and configuration ---------------------------------------------------------

def test_a_model_path_of_the_wrong_type_names_the_parameter():
    with pytest.raises(ValueError, match="model_path must be"):
        SFILlama(5)


def test_n_ctx_above_training_context_frees_the_model(tiny_path, monkeypatch):
    freed = FreeCounter(monkeypatch)
    with pytest.raises(ValueError, match="n_ctx=40000 is above the model's training context"):
        make(tiny_path, n_ctx=40000)
    assert freed.models == 1


def test_n_ctx_too_large_for_memory_is_refused_before_llama_cpp_tries(monkeypatch):
    """Without the check llama.cpp fills gigabytes of cell metadata before failing (or the OOM killer
    ends the process); with it: a MemoryError naming n_ctx, and the model freed."""
    path = random_model("tiny-llama", n_ctx_train=2**30)
    freed = FreeCounter(monkeypatch)
    with pytest.raises(MemoryError, match=r"n_ctx=1073741824 needs at least .* GiB"):
        make(path, n_ctx=2**30)
    assert freed.models == 1


def test_context_creation_failure_frees_the_model(tiny_path, monkeypatch):
    freed = FreeCounter(monkeypatch)
    monkeypatch.setattr(llama_cpp, "llama_init_from_model", lambda model, params: None)
    with pytest.raises(MemoryError, match="could not create a context with n_ctx=512"):
        make(tiny_path)
    assert freed.models == 1


@pytest.mark.parametrize("kwargs,match", [
    (dict(n_ctx=-1), "n_ctx must be an integer >= 0"), (dict(n_batch=0), "n_batch must be an integer >= 1"),
    (dict(n_threads=0), "n_threads must be an integer >= 1"), (dict(sfi="nope"), r"SFIConfig\.policy='nope'"),
    (dict(n_ctx="512"), "n_ctx must be an integer"), (dict(n_ctx=512.0), "n_ctx must be an integer"),
    (dict(n_threads=10_000), "n_threads must be at most 512"), (dict(n_threads=1.5), "n_threads must be an integer"),
    (dict(n_batch="512"), "n_batch must be an integer"), (dict(n_parallel=0), "n_parallel must be an integer >= 1"),
    (dict(kv_on_host="yes"), "kv_on_host must be True or False"),
    (dict(n_gpu_layers="all"), "n_gpu_layers must be an integer"), (dict(flash_attn="yes"), "flash_attn must be"),
    (dict(tensor_split="ab"), "tensor_split must hold"), (dict(rpc_servers=5), "rpc_servers must be"),
    (dict(split_mode=None), "split_mode must be one of"),
    (dict(sfi=dict(n_recent=-1)), r"SFIConfig\.n_recent=-1"), (dict(sfi=dict(k_head=-64)), r"SFIConfig\.k_head=-64"),
    (dict(sfi=dict(k_heads=5)), "k_heads"), (dict(sfi=3), "sfi must be"),
])
def test_bad_constructor_arguments_name_the_parameter(tiny_path, kwargs, match, monkeypatch):
    freed = FreeCounter(monkeypatch)
    args = {"n_ctx": N_CTX, "n_threads": THREADS, **kwargs}
    with pytest.raises(ValueError, match=match):
        SFILlama(str(tiny_path), **args)
    assert freed.models == 0  # refused before the model was loaded


@pytest.mark.parametrize("n_ctx", [1, 8, 300])
def test_n_ctx_is_exact(tiny_path, n_ctx):
    """llama.cpp allocates at least 256 cells (in steps of 256); the context still holds n_ctx tokens."""
    with make(tiny_path, n_ctx=n_ctx, sfi=True) as llm:
        assert llm.n_ctx == n_ctx
        with pytest.raises(ValueError, match=f"the context holds {n_ctx}"):
            llm.generate([5] * n_ctx, max_tokens=1)
        if n_ctx > 1:
            out = llm.generate([5] * (n_ctx - 1), max_tokens=50, temperature=0, ignore_eos=True)
            assert out.stats.n_ctx_end == n_ctx and len(out.tokens) == 2 and out.finish_reason == "length"


def test_more_threads_than_cpus_warns(tiny_path, monkeypatch):
    monkeypatch.setattr("sfi_gguf.sfi_llama.default_threads", lambda: 2)
    with pytest.warns(RuntimeWarning, match="more than this machine's 2 CPUs"):
        SFILlama(str(tiny_path), n_ctx=N_CTX, n_threads=3).close()


@pytest.mark.skipif(gpu_count() > 0, reason="a GPU is there to offload to")
def test_gpu_options_without_a_gpu_warn_and_run_on_the_cpu(tiny_path):
    """GPU placement options on a CPU-only build: a warning naming them (not silence), and SFI's CPU defaults."""
    from sfi_gguf import Llama

    cpu_defaults = make(tiny_path, sfi=True)
    try:
        expected = cpu_defaults.effective_config(SFIConfig())
    finally:
        cpu_defaults.close()
    for kwargs, named in ((dict(n_gpu_layers=-1), "n_gpu_layers=-1"), (dict(n_gpu_layers=99), "n_gpu_layers=99"),
                          (dict(main_gpu=1, split_mode="none"), "main_gpu=1"),
                          (dict(tensor_split=[3, 1]), "tensor_split=[3, 1]")):
        with pytest.warns(RuntimeWarning, match=rf"{re.escape(named)}.*no GPU to offload to \(this build's backends: "
                                                rf"CPU.*runs on the CPU"):
            llm = make(tiny_path, sfi=True, **kwargs)
        try:
            assert llm.n_gpu_layers == 0 and llm.effective_config(SFIConfig()) == expected
            assert llm.generate("hi", max_tokens=2, temperature=0).stats.n_generated >= 1
        finally:
            llm.close()
    with pytest.warns(RuntimeWarning, match="n_gpu_layers=-1, main_gpu=1: llama.cpp finds no GPU"):
        dropin = Llama(str(tiny_path), n_ctx=N_CTX, n_threads=1, n_gpu_layers=-1, main_gpu=1, verbose=False)
    try:
        assert dropin._sfi_engine.effective_config(SFIConfig()) == expected
    finally:
        dropin.close()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no option given: nothing to say
        make(tiny_path).close()
    info = summary()
    assert "CPU" in info["backends"] and info["gpu_offload"] is False and info["devices"]


def test_k_head_larger_than_the_context(tiny_path, monkeypatch):
    freed = FreeCounter(monkeypatch)
    with pytest.raises(ValueError, match=r"SFIConfig\.k_head=1024: larger than the context \(n_ctx=512\)"):
        make(tiny_path, sfi=SFIConfig(k_head=1024))
    assert freed.models == 1 and freed.contexts == 1  # the context and the model were freed
    with make(tiny_path) as llm:
        with pytest.raises(ValueError, match=r"SFIConfig\.k_head=4096"):
            llm.generate(prompt_tokens(), max_tokens=4, sfi=SFIConfig(k_head=4096))
        # k_head == n_ctx is allowed (a budget covering the whole context), and the object still works
        out = llm.generate(prompt_tokens(), max_tokens=4, temperature=0, sfi=SFIConfig(k_head=N_CTX, min_context=0))
        assert len(out.tokens) == 4


def test_huge_budgets_do_not_allocate_beyond_the_context(tiny_path):
    """refresh_interval 2**40 would ask for a tail of 2**41 cells (wrapping in int32): the native
    capacities are capped at n_ctx. (No refresh but the bootstrap: the gap and T_max are huge, no
    warm-up, no confidence trigger.)"""
    with make(tiny_path, sfi=SFIConfig(k_head=64, n_recent=32, refresh_interval=2**40, n_prefill_queries=2**33,
                                       policy="punctuation", min_gap=2**40, warmup_refresh=0,
                                       confidence_floor=0.0)) as llm:
        out = llm.generate(prompt_tokens(), max_tokens=8, temperature=0)
        assert out.stats.sfi.n_fast == 7
        assert llm._sfi_native.params["n_tail_max"] == N_CTX and llm._sfi_native.params["n_query_rows"] == N_CTX


def test_bad_prompts(tiny_path):
    with make(tiny_path) as llm:
        with pytest.raises(ValueError, match="n_ctx"):
            llm.generate([5] * N_CTX, max_tokens=4)
        with pytest.raises(ValueError, match="token ids out of range"):
            llm.generate([5, 10**6], max_tokens=4)
        with pytest.raises(ValueError, match="token ids out of range"):
            llm.generate([5, -1], max_tokens=4)
        with pytest.raises(ValueError, match="prompt is empty"):
            llm.generate([], max_tokens=4)
        with pytest.raises(ValueError, match="max_tokens"):
            llm.generate("hi", max_tokens=-3)
        # what is not a prompt says what a prompt is, before anything reads it
        with pytest.raises(ValueError, match=r"prompt must be a string, a list of chat messages .* got int: 5"):
            llm.generate(5, max_tokens=4)
        with pytest.raises(ValueError, match=r"token ids \(ints, not bools\), not a mix: it holds True \(bool\)"):
            llm.generate([True, 5], max_tokens=4)
        with pytest.raises(ValueError, match=r"not a mix: it holds 'x' \(str\)"):
            llm.generate([{"role": "user", "content": "hi"}, "x"], max_tokens=4)
        with pytest.raises(ValueError, match=r"lone surrogate '\\udc80' at position 2"):
            llm.generate("hi\udc80", max_tokens=4)
        with pytest.raises(ValueError, match=r"a bytes prompt is UTF-8 text; byte 2 is not UTF-8"):
            llm.generate(b"hi\xff", max_tokens=4)
        assert llm.context.tokens == []  # nothing was decoded
        # a prompt one token short of the context: one decode fills it, the token sampled from that is last
        out = llm.generate([5] * (N_CTX - 1), max_tokens=50, temperature=0, ignore_eos=True)
        assert out.finish_reason == "length" and len(out.tokens) == 2 and out.stats.n_ctx_end == N_CTX
        # max_tokens beyond the context stops at the context
        out = llm.generate(prompt_tokens(), max_tokens=10_000, temperature=0, ignore_eos=True)
        assert out.finish_reason == "length" and out.stats.n_ctx_end == N_CTX
        assert len(out.tokens) == N_CTX - 200 + 1


def test_bytes_are_utf8_text(tiny_path):
    """As in llama-cpp-python, bytes are UTF-8 text (token ids are a list of ints)."""
    with make(tiny_path, sfi=False) as llm:
        text = "Grüße, caches"
        assert llm.tokenize(text.encode()) == llm.tokenize(text) == llm.context.tokenize(text.encode())
        assert llm.tokenize(bytearray(text.encode()), add_special=False) == llm.tokenize(text, add_special=False)
        as_bytes = llm.generate(text.encode(), max_tokens=4, temperature=0, ignore_eos=True)
        assert as_bytes.stats.n_prompt == len(llm.tokenize(text))
        assert as_bytes.tokens == llm.generate(text, max_tokens=4, temperature=0, ignore_eos=True).tokens


@pytest.mark.parametrize("kwargs,match", [
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(temperature=float("inf")), "temperature must be a finite number"), (dict(temperature="0.5"), "temperature"),
    (dict(top_k=2.5), "top_k must be an integer"), (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(seed=1.5), "seed must be None or an integer"), (dict(seed=2**32), "seed"), (dict(seed=True), "seed"),
    (dict(top_p=float("nan")), "top_p"), (dict(min_p=2), "min_p"), (dict(repeat_penalty=0), "repeat_penalty"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"), (dict(frequency_penalty=3), "frequency_penalty"),
    (dict(stop=[1, 2]), "stop must be None, a string or a list of strings"), (dict(stop=5), "stop"),
    (dict(stop=["", "."]), "stop strings must not be empty"),
    (dict(max_tokens=2.0), "max_tokens must be"), (dict(logprobs=-1), "logprobs"),
    (dict(logprobs="3"), "logprobs"), (dict(stream="yes"), "stream must be True or False"),
    (dict(ignore_eos=None), "ignore_eos"), (dict(sfi={"k_head": "64"}), r"SFIConfig\.k_head"),
])
def test_bad_generation_arguments_name_the_parameter(tiny_path, kwargs, match):
    """Wrong types and values (NaN and inf too) raise ValueError naming the parameter, from generate,
    generate_batch and the llama-cpp-python API alike, before anything is decoded."""
    with make(tiny_path, n_parallel=2) as llm:
        with pytest.raises(ValueError, match=match):
            llm.generate("hi", **{"max_tokens": 2, **kwargs})
        if not {"stream", "logprobs"} & set(kwargs):
            with pytest.raises(ValueError, match=match):
                llm.generate_batch(["hi", "ho"], **{"max_tokens": 2, **kwargs})
        if "ignore_eos" not in kwargs:
            with pytest.raises(ValueError, match=match):
                llm.create_completion("hi", **{"max_tokens": 2, **kwargs})
        assert llm.context.tokens == []  # nothing was decoded
        assert llm.generate("hi", max_tokens=2, temperature=0).stats.n_generated >= 1


# an argument for each parameter without a default of a public SFILlama method (a new method whose
# parameter is missing here fails the test below, which then covers it)
CALL_ARGS = {"prompt": "hi", "messages": [{"role": "user", "content": "hi"}], "text": "hi", "tokens": [5, 6],
             "prompts": ["hi", "ho"], "config": SFIConfig()}


def _public_methods():
    """Every public method of SFILlama, by introspection, with the positional arguments it needs."""
    for name, fn in inspect.getmembers(SFILlama, inspect.isfunction):
        if name.startswith("_") and name not in ("__call__", "__enter__"):
            continue
        params = list(inspect.signature(fn).parameters.values())[1:]
        needed = [p.name for p in params if p.default is p.empty
                  and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        missing = [n for n in needed if n not in CALL_ARGS]
        assert not missing, f"SFILlama.{name}: add an argument for {missing} to CALL_ARGS"
        yield name, [CALL_ARGS[n] for n in needed]


def test_every_public_method_after_close_raises_instead_of_crashing(tiny_path):
    llm = make(tiny_path, n_parallel=2)
    llm.generate(prompt_tokens(), max_tokens=4, temperature=0)
    llm.generate_batch([prompt_tokens(50), prompt_tokens(60)], max_tokens=2, temperature=0)
    stream = llm.generate(prompt_tokens(), max_tokens=8, temperature=0, stream=True)
    next(stream)
    llm.close()
    llm.close()  # twice is fine
    assert llm.closed
    methods = dict(_public_methods())
    assert {"generate", "create_chat_completion", "apply_chat_template", "tokenize", "reset"} <= set(methods)
    for name, args in methods.items():
        if name == "close":
            continue
        with pytest.raises(ContextError, match="closed"):
            getattr(llm, name)(*args)
    with pytest.raises(ContextError, match="closed"):
        next(stream)  # a stream open when its model was closed
    for call in (llm.context.chat_template, lambda: llm.context.metadata("general.name"), lambda: llm.context.is_eog(2)):
        with pytest.raises(ContextError, match="closed"):
            call()


# -- interruptions and stale streams --------------------------------------------------------------

@pytest.mark.parametrize("sfi", [SFI, False], ids=["sfi", "dense"])
def test_keyboard_interrupt_in_a_stream_leaves_the_object_usable(tiny_path, sfi):
    prompt = prompt_tokens(seed=1)
    with make(tiny_path, sfi=sfi) as fresh:
        want = fresh.generate(prompt, max_tokens=48, temperature=0, ignore_eos=True).tokens
    with make(tiny_path, sfi=sfi) as llm:
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(llm.generate(prompt, max_tokens=48, temperature=0, ignore_eos=True, stream=True)):
                if i == 30:  # past a few refreshes
                    raise KeyboardInterrupt
        assert llm.generate(prompt, max_tokens=48, temperature=0, ignore_eos=True).tokens == want


@pytest.mark.parametrize("sfi", [SFI, False], ids=["sfi", "dense"])
def test_interrupt_between_decode_and_bookkeeping(tiny_path, monkeypatch, sfi):
    """The worst moment: llama_decode has put the token in the cache, the token list does not know yet.
    The next call (here one that extends what the list holds, as a multi-turn call would) re-synchronises
    the list with the cache, and gives the output of an object that went through the same calls without
    the interruption (not of a fresh one: the reused prefix was decoded token by token, see
    test_prefix_reuse_is_close_to_fresh)."""
    prompt = prompt_tokens(seed=2)
    with make(tiny_path, sfi=sfi) as llm:
        real_decode, calls = llama_cpp.llama_decode, []

        def decode_then_interrupt(ctx, batch):
            rc = real_decode(ctx, batch)
            calls.append(rc)
            if len(calls) == 20:
                raise KeyboardInterrupt
            return rc

        monkeypatch.setattr(llama_cpp, "llama_decode", decode_then_interrupt)
        with pytest.raises(KeyboardInterrupt):
            llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True)
        monkeypatch.setattr(llama_cpp, "llama_decode", real_decode)
        ctx = llm.context
        assert llama_cpp.llama_memory_seq_pos_max(ctx.memory, 0) + 1 == len(ctx.tokens) + 1  # the list lies
        follow_up = list(ctx.tokens) + [7, 8, 9]
        got = llm.generate(follow_up, max_tokens=30, temperature=0, ignore_eos=True).tokens
    with make(tiny_path, sfi=sfi) as same_history:
        same_history.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True)
        assert got == same_history.generate(follow_up, max_tokens=30, temperature=0, ignore_eos=True).tokens


def test_a_superseded_stream_raises_instead_of_decoding(tiny_path):
    with make(tiny_path) as llm:
        first = llm.generate(prompt_tokens(seed=3), max_tokens=20, temperature=0, stream=True, ignore_eos=True)
        next(first)
        second = llm.generate(prompt_tokens(seed=4), max_tokens=20, temperature=0, ignore_eos=True)
        with pytest.raises(RuntimeError, match="superseded"):
            next(first)
        with make(tiny_path) as fresh:
            assert fresh.generate(prompt_tokens(seed=4), max_tokens=20, temperature=0, ignore_eos=True).tokens == \
                second.tokens


# -- threads ---------------------------------------------------------------------------------------

def _run_threads(target, n):
    errors = []

    def run(i):
        try:
            target(i)
        except BaseException as exc:  # noqa: BLE001  (reported by the test)
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_sharing_one_model_take_turns(tiny_path):
    """Calls from several threads are serialised: each gets the tokens of the same call alone (two
    llama_decode calls at once on one context abort the process in ggml). Every prompt starts with its
    own token, so no call reuses another's cache (a reused prefix may round differently)."""
    prompts = [[3 + k] + prompt_tokens(120, seed=10 + k) for k in range(12)]  # 4 threads x 3 calls
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True)
    with make(tiny_path) as llm:
        want = [llm.generate(p, **kw).tokens for p in prompts]
        got = {}

        def calls(i):
            for k in range(i, 12, 4):
                got[k] = llm.generate(prompts[k], **kw).tokens if k < 8 else \
                    llm.create_completion(prompts[k], max_tokens=24, temperature=0)["choices"][0]["text"]

        assert _run_threads(calls, 4) == []
        for k in range(12):
            if k < 8:
                assert got[k] == want[k]
            else:  # (the text may end early, on an end-of-generation token)
                assert llm.detokenize(want[k]).startswith(got[k])


def test_streams_in_threads_finish_or_are_superseded(tiny_path):
    """A stream holds the model only while it computes a token: a call from another thread in between
    supersedes it (RuntimeError at its next token), as a call from the same thread does; a stream that
    is not superseded gives the text of the same call alone."""
    prompts = [[3 + i] + prompt_tokens(120, seed=20 + i) for i in range(3)]
    kw = dict(max_tokens=32, temperature=0, ignore_eos=True)
    with make(tiny_path) as llm:
        want = [llm.generate(p, **kw).text for p in prompts]
        finished, superseded = {}, []

        def stream(i):
            pieces = []
            try:
                for piece in llm.generate(prompts[i], stream=True, **kw):
                    pieces.append(piece)
            except RuntimeError as exc:
                assert "superseded" in str(exc)
                superseded.append(i)
            else:
                finished[i] = "".join(pieces)

        assert _run_threads(stream, 3) == []
        assert len(finished) + len(superseded) == 3 and finished  # the last call's stream always finishes
        assert all(text == want[i] for i, text in finished.items())


def test_close_from_another_thread_waits_for_the_token_in_progress(tiny_path):
    llm = make(tiny_path)
    started, outcome = threading.Event(), []

    def reader(_):
        try:
            for i, _ in enumerate(llm.generate(prompt_tokens(), max_tokens=300, temperature=0, stream=True,
                                               ignore_eos=True)):
                started.set()
            outcome.append("finished")
        except ContextError as exc:
            outcome.append(str(exc))
        finally:
            started.set()

    thread = threading.Thread(target=reader, args=(0,))
    thread.start()
    started.wait()
    llm.close()
    thread.join()
    assert outcome == ["finished"] or "closed" in outcome[0]


# -- determinism -----------------------------------------------------------------------------------

@pytest.mark.parametrize("sfi", [SFI, SFI.replace(policy="fixed", fixed_period=8), False],
                         ids=["sfi", "sfi-fixed", "dense"])
def test_same_seed_same_config_same_tokens(tiny_path, sfi):
    """From a fresh object, from the cached prompt (test_the_same_prompt_again_continues_from_a_fresh_objects_logits)
    and after reset(): the same sampled tokens."""
    prompt = prompt_tokens(seed=5)
    kw = dict(max_tokens=64, temperature=0.9, top_k=0, top_p=1.0, min_p=0.0, seed=1234, ignore_eos=True)
    with make(tiny_path, sfi=sfi) as a:
        first = a.generate(prompt, **kw)
        cached = a.generate(prompt, **kw)
        a.reset()
        again = a.generate(prompt, **kw)
        other = a.generate(prompt, **{**kw, "seed": 99})
    with make(tiny_path, sfi=sfi) as b:
        fresh = b.generate(prompt, **kw)
    assert first.tokens == cached.tokens == again.tokens == fresh.tokens
    assert other.tokens != first.tokens  # the seed matters (the distribution of this random model is flat)
    if sfi is not False:
        s = first.stats.sfi
        assert s.n_bootstrap == 1 and s.n_fast > 30 and s.n_fell_back == 0


@pytest.mark.parametrize("flash_attn", [True, False], ids=["fa", "no-fa"])
@pytest.mark.parametrize("sfi", [SFI, True, False], ids=["sfi", "sfi-below-threshold", "dense"])
def test_the_same_prompt_again_continues_from_a_fresh_objects_logits(tiny_path, monkeypatch, sfi, flash_attn):
    """A prompt's last n_prefill_queries tokens are a llama_decode of their own, fresh or served from the cache:
    the same prompt again decodes them again, in the batch shape a fresh prefill gave them, so its logits are a
    fresh object's bit for bit (and so are the tokens that follow), after a finished generation, an interrupted
    one (KeyboardInterrupt in a stream, between llama_decode and the bookkeeping, a cancel) and reset(). (A
    fresh prefill that decoded the whole prompt at once, and a cached prompt that decoded only its last token
    again, rounded apart: llama.cpp's CPU kernels round a row by its batch's shape.)"""
    import numpy as np

    prompt = prompt_tokens(seed=6)
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True)
    with make(tiny_path, sfi=sfi, flash_attn=flash_attn) as fresh:
        fresh.generate(prompt, max_tokens=0)
        want = fresh.context.last_logits().copy()

    def prompt_logits(llm, n_decoded=SFI.n_prefill_queries):
        assert llm.generate(prompt, max_tokens=0).stats.n_prompt_decoded == n_decoded
        return llm.context.last_logits()

    with make(tiny_path, sfi=sfi, flash_attn=flash_attn) as llm:
        llm.generate(prompt, **kw)
        assert np.array_equal(prompt_logits(llm), want)
        with pytest.raises(KeyboardInterrupt):
            for i, _ in enumerate(llm.generate(prompt, stream=True, **kw)):
                if i == 10:
                    raise KeyboardInterrupt
        assert np.array_equal(prompt_logits(llm), want)
        real_decode, calls = llama_cpp.llama_decode, []

        def decode_then_interrupt(ctx, batch):
            rc = real_decode(ctx, batch)
            calls.append(rc)
            if len(calls) == 2:  # the first step after the prefill (of the last tokens only: the prompt is cached)
                raise KeyboardInterrupt  # ... its token in the cache, not yet in the token list
            return rc

        with monkeypatch.context() as patch:
            patch.setattr(llama_cpp, "llama_decode", decode_then_interrupt)
            with pytest.raises(KeyboardInterrupt):
                llm.generate(prompt, **kw)
        assert np.array_equal(prompt_logits(llm), want)
        cancel = threading.Event()
        for i, _ in enumerate(llm.generate(prompt, stream=True, cancel=cancel, **kw)):
            if i == 10:
                cancel.set()
        assert llm.last_stats.finish_reason == "stop" and llm.last_stats.n_generated < kw["max_tokens"]
        assert np.array_equal(prompt_logits(llm), want)
        llm.reset()
        assert np.array_equal(prompt_logits(llm, len(prompt)), want)


@pytest.mark.parametrize("n", [512, 515, 530])
def test_bootstrap_has_all_its_query_rows_whatever_the_prompt_length(tiny_path, n):
    """The bootstrap slow step's query rows are the last tokens of the prefill's final llama_decode: a
    prompt of n_batch + 3 tokens used to bootstrap from 3 rows instead of n_prefill_queries (16)."""
    with make(tiny_path, n_ctx=1024) as llm:
        llm.generate(prompt_tokens(n), max_tokens=1, temperature=0)
        assert llm._sfi_native.n_query_rows() == SFI.n_prefill_queries


def test_slow_step_reasons_add_up_when_the_context_grows_past_the_threshold(tiny_path):
    """A prompt below the SFI threshold (100 cells here) decodes densely; the step that crosses it is
    slow without a policy trigger, and counts as "threshold", so the statistics still add up."""
    with make(tiny_path) as llm:
        s = llm.generate(prompt_tokens(50), max_tokens=120, temperature=0, ignore_eos=True).stats.sfi
    assert s.n_dense > 0 and s.n_fast > 0 and s.reasons.get("threshold") == 1
    assert sum(s.reasons.values()) == s.n_slow == len(s.slow_steps)
