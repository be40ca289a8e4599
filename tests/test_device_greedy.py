"""Greedy picks made in the decode's graph (`LlamaContext.set_device_greedy`, native/src/llama-sfi-sampler.cpp).

The pick and its probability against the host's argmax and softmax of the same logits, on the real default model;
the logits refused while they are not copied; greedy generations (dense and SFI) equal to the host's picks.
"""
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.context import ContextError, LlamaContext
from sfi_gguf.core.device_picks import DevicePicks
from sfi_gguf.models import ensure_model
from sfi_gguf.core.policy import top1_probability
from sfi_gguf.tools.random_model import random_model
from sfi_gguf.tools.texts import natural_text

NGL = int(os.environ.get("SFI_TEST_NGL", "0"))  # 99: the layers and the output on the GPU (CUDA build)
PROMPT = "The three most important ideas in computer architecture are"


@pytest.mark.parametrize("flash_attn", [False, True], ids=["no_fa", "fa"])
@pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.real_model), "tiny-llama"])
def test_device_pick_is_the_host_argmax_with_its_probability(model, flash_attn):
    path = ensure_model() if model == "default" else random_model(model)
    ctx = LlamaContext(path, 512, 0 if model == "default" else NGL, 2, 512, flash_attn, False)
    try:
        tokens = ctx.tokenize(PROMPT) if model == "default" else [1 + (7 * i) % 200 for i in range(40)]

        def run(pick):  # the same decodes from an empty cache: (pick, its probability) after each
            ctx.clear()
            ctx.prefill(tokens)
            out = [pick()]
            for _ in range(12):
                ctx.decode_one(out[-1][0])
                out.append(pick())
            return out

        host = run(lambda: (int(np.argmax(ctx.last_logits())), top1_probability(ctx.last_logits())))
        assert ctx.set_device_greedy(True)
        assert ctx._device_picks.fused  # one SFI op (ggml_sfi_greedy: the CPU and CUDA have it)
        device = run(lambda: (ctx.greedy_token(), ctx.greedy_probability()))
        with pytest.raises(ContextError, match="copied no logits"):
            ctx.last_logits()

        assert [t for t, _ in device] == [t for t, _ in host]
        np.testing.assert_allclose([p for _, p in device], [p for _, p in host], rtol=1e-4)
        assert min(p for _, p in host) < 0.9  # (the probabilities are not all ~1)
        assert len(set(t for t, _ in host)) > 1

        assert not ctx.set_device_greedy(False)
        ctx.decode_one(device[-1][0])  # logits again from the next decode on
        assert int(np.argmax(ctx.last_logits())) == ctx.greedy_token()
    finally:
        ctx.close()


@pytest.mark.real_model
def test_sequence_handles_pick_on_the_device_each():
    ctx = LlamaContext(ensure_model(), 256, 0, 2, 256, False, False, n_seq_max=2)
    one = ctx.sequence(1)
    try:
        assert ctx.set_device_greedy(True) and one.set_device_greedy(True)
        assert one._device_picks.seq == 1
        one.prefill(ctx.tokenize(PROMPT))  # alone: its pick is its own row's
        token = one.greedy_token()
        with pytest.raises(ContextError, match="copied no logits"):
            one.last_logits()
        assert not one.set_device_greedy(False)
        one.truncate(0)
        one.prefill(ctx.tokenize(PROMPT))
        assert int(np.argmax(one.last_logits())) == token
    finally:
        one.close()
        ctx.close()


def test_a_batch_left_unclosed_exits_cleanly():
    """The owner's context frees its llama_context after detaching its handles' samplers: at exit, whatever
    order the objects are collected in, no handle detaches through a freed context."""
    code = (f"from sfi_gguf import SFILlama\n"
            f"from sfi_gguf.tools.random_model import random_model\n"
            f"llm = SFILlama(random_model('tiny-llama'), n_ctx=512, n_threads=2, n_gpu_layers={NGL}, n_parallel=3)\n"
            f"out = llm.generate_batch([[1 + i % 50 for i in range(40 + s)] for s in range(3)], max_tokens=4, "
            f"temperature=0, ignore_eos=True)\n"
            f"assert [len(c.tokens) for c in out] == [4, 4, 4]\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]


@pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.real_model), "tiny-llama"])
def test_a_batch_picks_on_the_device_per_sequence(model, monkeypatch):
    """Sequences decoded together: the greedy ones pick in the graph, each its own row, with the tokens and the slow
    steps of the host's picks (logprobs make the host pick); beside a sampled one (in the graph too) and one that
    reads its logits."""
    path = None if model == "default" else random_model(model)
    llm = SFILlama(path, n_ctx=2048, n_threads=2, n_gpu_layers=0 if model == "default" else NGL, n_parallel=3,
                   sfi=SFIConfig(k_head=64, n_recent=64, min_context=0, confidence_floor=0.8))
    try:
        if model == "default":
            prompts = [llm.tokenize(natural_text(6000, seed=s))[:700] for s in range(3)]
        else:
            prompts = [[1 + (7 * i + 13 * s) % 200 for i in range(700)] for s in range(3)]
        picks = _count_device_picks(monkeypatch)

        def run(*kinds):  # one request per prompt: "device" / "host" greedy, or "sampled"; each prefilled anew
            llm.reset()
            requests = [llm.batch_request(p, max_tokens=32, ignore_eos=True, temperature=0.8 if k == "sampled" else 0,
                                          seed=5, logprobs=1 if k == "host" else None)
                        for p, k in zip(prompts, kinds)]
            llm.batched_decoder().run(requests)
            return [r.completion() for r in requests]

        device = run("device", "device", "device")
        assert len(picks) == 3 * 32
        host = run("host", "host", "host")
        assert len(picks) == 3 * 32
        assert [c.tokens for c in device] == [c.tokens for c in host]
        assert [c.stats.sfi.slow_steps for c in device] == [c.stats.sfi.slow_steps for c in host]
        assert sum(c.stats.sfi.n_slow for c in device) >= 6 and len({tuple(c.tokens) for c in device}) == 3

        mixed = run("device", "host", "sampled")
        assert len(picks) == 5 * 32
        assert [c.tokens for c in mixed[:2]] == [c.tokens for c in device[:2]]
        assert mixed[2].tokens == run("host", "host", "sampled")[2].tokens
    finally:
        llm.close()


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=4096, n_threads=2, sfi=SFIConfig(k_head=512))


def _count_device_picks(monkeypatch) -> list:
    picks = []
    real = DevicePicks.token
    monkeypatch.setattr(DevicePicks, "token", lambda self, index: picks.append(1) or real(self, index))
    return picks


@pytest.mark.real_model
def test_greedy_generations_pick_on_the_device_as_the_host_does(llm, monkeypatch):
    """SFI with its confidence trigger: the same tokens and the same slow steps whether the picks and the
    probabilities the trigger reads come from the graph or from the logits (logprobs make the host pick)."""
    prompt = llm.tokenize(natural_text(16000, seed=3))[:3000]
    llm.sfi_config = SFIConfig(k_head=512, confidence_floor=0.8)  # (more confidence refreshes)
    picks = _count_device_picks(monkeypatch)
    llm.reset()  # both prefill from scratch: the same cache, bit for bit
    on_device = llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True)
    assert len(picks) == 64
    llm.reset()
    on_host = llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True, logprobs=1)
    assert len(picks) == 64
    assert on_device.tokens == on_host.tokens
    s, h = on_device.stats.sfi, on_host.stats.sfi
    assert s.n_slow >= 2 and s.slow_steps == h.slow_steps and s.reasons == h.reasons
    assert s.reasons.get("confidence", 0) >= 1  # the trigger read the device's probabilities

    llm.sfi_config = SFIConfig(k_head=512)
    dense = llm.generate(PROMPT, max_tokens=24, temperature=0, sfi=False)
    dense_host = llm.generate(PROMPT, max_tokens=24, temperature=0, sfi=False, logprobs=1)
    assert dense.tokens == dense_host.tokens and len(picks) == 64 + 24


@pytest.mark.real_model
def test_a_generation_leaves_the_logits_to_the_next_decode(llm):
    llm.generate(PROMPT, max_tokens=4, temperature=0, sfi=False)
    ctx = llm.context
    assert not ctx._picks_on_device
    ctx.decode_one(ctx.greedy_token())
    assert ctx.last_logits().shape == (ctx.n_vocab,)
