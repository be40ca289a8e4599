"""Sampling in the decode's graph (`LlamaContext.set_device_picks` with a sampling chain, `sfi_gguf.core.device_picks`,
native/src/llama-sfi-sampler.cpp): llama.cpp's top-k, top-p, min-p, temperature and dist samplers with the request's
seed, and the model's top-1 probability for SFI's trigger.

The same seed gives the same tokens from run to run, and here (the CPU, top-k 40: the SFI sampling ops) the host
chain's tokens for that seed; the top-1 probabilities are the host softmax's; requests whose logits something else
reads or changes keep the host chain; generations, single and batched, pick every token in the graph with the host's
tokens and slow steps.
"""
import os

import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.context import ContextError, LlamaContext
from sfi_gguf.core.device_picks import DeviceChain, DevicePicks
from sfi_gguf.models import ensure_model
from sfi_gguf.core.policy import top1_probability
from sfi_gguf.core.sampling import Sampler, SamplingParams
from sfi_gguf.tools.random_model import random_model
from sfi_gguf.tools.texts import natural_text

NGL = int(os.environ.get("SFI_TEST_NGL", "0"))  # 99: the layers and the output on the GPU (CUDA build)
PROMPT = "The three most important ideas in computer architecture are"


def _count_device_picks(monkeypatch) -> list:
    picks = []
    real = DevicePicks.token
    monkeypatch.setattr(DevicePicks, "token", lambda self, index: picks.append(1) or real(self, index))
    return picks


@pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.real_model), "tiny-llama"])
def test_device_sampling_repeats_per_seed_and_is_the_host_chains(model):
    path = ensure_model() if model == "default" else random_model(model)
    ctx = LlamaContext(path, 512, 0 if model == "default" else NGL, 2, 512, False, False)
    try:
        tokens = ctx.tokenize(PROMPT) if model == "default" else [1 + (7 * i) % 200 for i in range(40)]

        def run(seed: int, on_device: bool, temperature: float = 0.8, **params):
            """The same decodes from an empty cache, each token sampled with `seed`: (tokens, top-1 probabilities)."""
            sampler = Sampler(SamplingParams(temperature=temperature, seed=seed, **params), ctx.n_vocab)
            assert ctx.set_device_picks(sampler.device_chain if on_device else None) == on_device
            # with top-k on, the chain is the two SFI ops (ggml_sfi_top_k, ggml_sfi_sample); without, llama.cpp's
            assert ctx._device_picks.fused == (on_device and sampler.params.top_k > 0)
            try:
                ctx.clear()
                ctx.prefill(tokens)
                out, top1 = [], []
                for _ in range(16):
                    top1.append(ctx.greedy_probability())
                    out.append(sampler.sample(ctx))
                    ctx.decode_one(out[-1])
                if on_device:
                    with pytest.raises(ContextError, match="copied no logits"):
                        ctx.last_logits()
                    with pytest.raises(ContextError, match="greedy pick is not known"):
                        ctx.greedy_token()
                return out, top1
            finally:
                sampler.close()
                ctx.set_device_picks(None)

        device, device_top1 = run(11, True)
        assert run(11, True)[0] == device  # (the chain attached again: its draws restart from the seed)
        host, host_top1 = run(11, False)
        assert device == host
        np.testing.assert_allclose(device_top1, host_top1, rtol=1e-4)
        assert min(host_top1) < 0.9 and len(set(device)) > 4  # (a real choice at most steps)

        other = run(12, True)[0]
        assert other != device and other == run(12, False)[0]
        # no top-k: the whole vocabulary sorted in the graph, the same tokens again (the host chain's only up to the
        # rounding of sums over many candidates: docs/python-api.md)
        hot = dict(temperature=1.5, top_k=0, top_p=0.9, min_p=0.0)
        assert run(3, True, **hot)[0] == run(3, True, **hot)[0] != run(4, True, **hot)[0]
    finally:
        ctx.close()


def test_what_reads_or_changes_the_logits_keeps_the_host_chain():
    n_vocab = 1000

    def chain(grammar=None, logprobs=None, logits_processor=None, **params):
        sampler = Sampler(SamplingParams(seed=4, **params), n_vocab, logprobs=logprobs, grammar=grammar,
                          vocab=None, logits_processor=logits_processor)
        try:
            return sampler.device_chain
        finally:
            sampler.close()

    assert chain() == DeviceChain(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=4)
    assert chain(temperature=0) == DeviceChain(seed=4) and DeviceChain(seed=4).greedy
    assert chain(temperature=0, mirostat_mode=2) == DeviceChain(seed=4)  # (greedy whatever Mirostat says)
    for host_only in (dict(repeat_penalty=1.1), dict(presence_penalty=0.5), dict(logit_bias=((5, 2.0),)),
                      dict(typical_p=0.9), dict(mirostat_mode=1), dict(logprobs=2),
                      dict(logits_processor=lambda ids, scores: scores)):
        assert chain(**host_only) is None, host_only


# the `llm` fixture's SFILlama keywords (conftest.py)
# (the model continues the document almost surely: top-1 probabilities of 0.9-1.0, so the confidence trigger fires
# within 48 sampled tokens, whatever a CPU's rounding makes of them, only with a floor that high)
LLM_ARGS = dict(n_ctx=4096, n_threads=2, sfi=SFIConfig(k_head=512, confidence_floor=0.999))


@pytest.mark.real_model
def test_sampled_generations_pick_in_the_graph_as_the_host_does(llm, monkeypatch):
    """SFI with its confidence trigger: the same tokens and slow steps whether the sampled picks and the top-1
    probabilities the trigger reads come from the graph or from the logits (logprobs make the host pick); the same
    seed, the same tokens again."""
    prompt = llm.tokenize(natural_text(16000, seed=5))[:3000]
    picks = _count_device_picks(monkeypatch)
    llm.reset()  # all prefill from scratch: the same cache, bit for bit
    on_device = llm.generate(prompt, max_tokens=48, temperature=0.8, seed=21, ignore_eos=True)
    assert len(picks) == 48
    llm.reset()
    again = llm.generate(prompt, max_tokens=48, temperature=0.8, seed=21, ignore_eos=True)
    llm.reset()
    on_host = llm.generate(prompt, max_tokens=48, temperature=0.8, seed=21, ignore_eos=True, logprobs=1)
    assert len(picks) == 96
    assert on_device.tokens == again.tokens == on_host.tokens
    s, h = on_device.stats.sfi, on_host.stats.sfi
    assert s.n_slow >= 2 and s.slow_steps == h.slow_steps and s.reasons == h.reasons
    assert s.reasons.get("confidence", 0) >= 1  # the trigger read the graph's probabilities


@pytest.mark.parametrize("model", [pytest.param("default", marks=pytest.mark.real_model), "tiny-llama"])
def test_a_batch_samples_in_the_graph_per_sequence(model, monkeypatch):
    """Sequences decoded together, each sampling with its own seed in its own row: the host chain's tokens and slow
    steps, the same again for the same seeds, beside a sequence that keeps the host chain (penalties)."""
    path = None if model == "default" else random_model(model)
    llm = SFILlama(path, n_ctx=2048, n_threads=2, n_gpu_layers=0 if model == "default" else NGL, n_parallel=3,
                   sfi=SFIConfig(k_head=64, n_recent=64, min_context=0, confidence_floor=0.8))
    try:
        if model == "default":
            prompts = [llm.tokenize(natural_text(6000, seed=s))[:700] for s in range(3)]
        else:
            prompts = [[1 + (7 * i + 13 * s) % 200 for i in range(700)] for s in range(3)]
        picks = _count_device_picks(monkeypatch)

        def run(*kinds):  # one request per prompt: "device" or "host" sampling, or "penalty"; each prefilled anew
            llm.reset()
            requests = [llm.batch_request(p, max_tokens=24, ignore_eos=True, temperature=0.8, seed=30 + i,
                                          logprobs=1 if k == "host" else None,
                                          repeat_penalty=1.2 if k == "penalty" else 1.0)
                        for i, (p, k) in enumerate(zip(prompts, kinds))]
            llm.batched_decoder().run(requests)
            return [r.completion() for r in requests]

        device = run("device", "device", "device")
        assert len(picks) == 3 * 24
        assert run("device", "device", "device")[1].tokens == device[1].tokens
        host = run("host", "host", "host")
        assert len(picks) == 6 * 24
        assert [c.tokens for c in device] == [c.tokens for c in host]
        assert [c.stats.sfi.slow_steps for c in device] == [c.stats.sfi.slow_steps for c in host]
        assert all(c.stats.sfi.n_slow >= 1 for c in device) and len({tuple(c.tokens) for c in device}) == 3

        mixed = run("device", "penalty", "device")
        assert len(picks) == 8 * 24
        assert [mixed[0].tokens, mixed[2].tokens] == [device[0].tokens, device[2].tokens]
    finally:
        llm.close()


@pytest.mark.real_model
def test_top1_probability_of_a_sampling_chain_is_the_softmaxs(llm):
    """What SFI's trigger reads after a sampled decode: the model's own top-1 probability, not the sampling chain's
    (after top-k and temperature)."""
    ctx = llm.context
    sampler = Sampler(SamplingParams(temperature=0.5, top_k=3, seed=1), ctx.n_vocab)
    try:
        ctx.clear()
        ctx.prefill(ctx.tokenize(PROMPT))
        host = top1_probability(ctx.last_logits())
        assert ctx.set_device_picks(sampler.device_chain)
        ctx.truncate(len(ctx.tokens) - 1)
        ctx.prefill(ctx.tokenize(PROMPT))
        assert ctx.greedy_probability() == pytest.approx(host, rel=1e-4) and host < 0.9
    finally:
        ctx.set_device_picks(None)
        sampler.close()
