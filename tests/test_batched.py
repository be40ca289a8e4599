"""`SFILlama.generate_batch`: several sequences decoding together, each with its own SFI state.

A random-weight model, greedy: a batched generation must give each prompt the tokens (and, with SFI,
the same slow steps) that a single-sequence generation gives it.
"""
from __future__ import annotations

import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.sampling import SamplingParams
from sfi_gguf.tools.random_model import random_model

LENGTHS = (300, 420, 250, 380)  # 4 prompts, 3 slots: the last waits for a free one
# the 250-token prompt decodes densely until its context reaches 280 (then a slow step), so its steps
# are dense while the others are fast or slow, and its slow steps fall between theirs
SMALL = SFIConfig(k_head=32, n_recent=32, n_sink=4, min_context=280, policy="fixed", fixed_period=8)


@pytest.fixture(scope="module")
def llm():
    model = SFILlama(str(random_model("tiny-llama")), n_ctx=1024, n_parallel=3, n_threads=1)
    yield model
    model.close()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(3, 200, n)] for n in LENGTHS]


def _batch(llm, prompts, sfi, n=40, **kw):
    return llm.generate_batch(prompts, max_tokens=n, temperature=0, sfi=sfi, ignore_eos=True, **kw)


def test_budget_covering_everything_equals_dense(llm, prompts):
    whole = _batch(llm, prompts, SFIConfig(k_head=1024, min_context=0))
    dense = _batch(llm, prompts, False)
    single = [llm.generate(p, max_tokens=40, temperature=0, sfi=False, ignore_eos=True) for p in prompts]
    for w, d, s in zip(whole, dense, single):
        assert w.tokens == d.tokens == s.tokens
        assert w.stats.sfi.n_fast >= 30  # it did decode sparsely
        assert d.stats.mode == "dense" and w.stats.mode == "sfi"


def test_each_sequence_decodes_as_it_would_alone(llm, prompts):
    """A small budget (sink 4 + 32 + recent 32 of 250-480 cells) refreshed every 8 steps; steps mix
    dense, slow and fast sequences (see SMALL)."""
    decoder = llm.batched_decoder()
    decoder.reset_timing()
    batch = _batch(llm, prompts, SMALL, n=60)
    assert batch[2].stats.sfi.slow_steps[0] == 30 and batch[0].stats.sfi.slow_steps[:4] == [8, 16, 24, 32]
    # one llama_decode per step, whatever its mix of slow, dense and fast sequences
    assert decoder.n_llama_decode == decoder.n_steps and decoder.n_decode["fast"] > 0
    assert decoder.n_decode["slow"] > 0 and decoder.n_decode["dense"] > 0
    for prompt, b in zip(prompts, batch):
        alone = llm.generate(prompt, max_tokens=60, temperature=0, sfi=SMALL, ignore_eos=True)
        assert b.tokens == alone.tokens
        assert b.stats.sfi.slow_steps == alone.stats.sfi.slow_steps and b.stats.sfi.n_slow >= 3
        assert b.stats.sfi.n_fast == alone.stats.sfi.n_fast
        assert b.stats.sfi.refresh_overlap == pytest.approx(alone.stats.sfi.refresh_overlap)


def test_stop_strings_lengths_and_seeds(llm, prompts):
    out = _batch(llm, prompts, SMALL, n=0)
    assert [o.tokens for o in out] == [[]] * 4 and {o.finish_reason for o in out} == {"length"}
    out = _batch(llm, prompts[:2], SMALL, n=5)
    assert [len(o.tokens) for o in out] == [5, 5]
    text = out[0].text
    cut = llm.generate_batch(prompts[:1], max_tokens=5, temperature=0, sfi=SMALL, ignore_eos=True,
                             stop=[text[2:4]])[0]
    assert cut.finish_reason == "stop" and cut.text == text[:2]
    a = llm.generate_batch(prompts[:2], max_tokens=8, temperature=1.0, seed=7, sfi=SMALL, ignore_eos=True)
    b = llm.generate_batch(prompts[:2], max_tokens=8, temperature=1.0, seed=7, sfi=SMALL, ignore_eos=True)
    assert [x.tokens for x in a] == [x.tokens for x in b]


def test_one_sampling_object_samples_as_its_keywords(llm, prompts):
    """`sampling=SamplingParams(...)` in place of the sampling keywords: the same tokens from generate,
    generate_batch (seed + i for prompt i) and batch_request; keywords and an object together are refused."""
    keywords = dict(temperature=1.0, top_k=20, min_p=0.0, repeat_penalty=1.1, logit_bias={5: -2.0}, seed=11)
    sampling = SamplingParams.of(keywords)
    assert sampling == SamplingParams(temperature=1.0, top_k=20, min_p=0.0, repeat_penalty=1.1,
                                      logit_bias=((5, -2.0),), seed=11)
    common = dict(max_tokens=12, sfi=SMALL, ignore_eos=True)
    assert (llm.generate(prompts[0], sampling=sampling, **common).tokens
            == llm.generate(prompts[0], **keywords, **common).tokens)
    batch = dict(temperature=1.0, top_k=20, min_p=0.0, repeat_penalty=1.1, seed=11)
    by_object = llm.generate_batch(prompts[:2], sampling=SamplingParams(**batch), **common)
    assert [c.tokens for c in by_object] == [c.tokens for c in llm.generate_batch(prompts[:2], **batch, **common)]
    decoder = llm.batched_decoder()
    request = llm.batch_request(prompts[1], sampling=SamplingParams(**{**batch, "seed": 12}), **common)
    decoder.run([request])
    assert request.completion().tokens == by_object[1].tokens
    with pytest.raises(ValueError, match=r"not both .*'temperature'"):
        llm.generate(prompts[0], temperature=0.5, sampling=sampling)
    with pytest.raises(ValueError, match="sampling must be a SamplingParams"):
        llm.generate(prompts[0], sampling={"temperature": 0.5})
    with pytest.raises(ValueError, match="top_p must be"):
        llm.generate_batch(prompts[:1], sampling=SamplingParams(top_p=2.0))


def test_bad_input(llm, prompts):
    with pytest.raises(ValueError, match="non-empty list"):
        llm.generate_batch([])
    with pytest.raises(ValueError, match="non-empty list"):
        llm.generate_batch("one string")
    with pytest.raises(ValueError, match="lists of token ids"):
        llm.generate_batch(prompts[0])  # one prompt of token ids, not a list of prompts
    with pytest.raises(ValueError, match="prompt 1: the prompt has"):
        llm.generate_batch([prompts[0], [5] * 2000])
    with pytest.raises(ValueError, match="max_tokens"):
        llm.generate_batch(prompts, max_tokens=-1)
    with pytest.raises(ValueError, match="n_parallel"):
        SFILlama(str(random_model("tiny-llama")), n_parallel=0)


def test_single_generate_still_works_after_a_batch(llm, prompts):
    _batch(llm, prompts, SMALL, n=8)
    first = llm.generate(prompts[0], max_tokens=16, temperature=0, sfi=SMALL, ignore_eos=True)
    again = llm.generate(prompts[0], max_tokens=16, temperature=0, sfi=SMALL, ignore_eos=True)
    assert first.tokens == again.tokens


def test_a_model_of_one_sequence_decodes_a_batch_as_generate_does(prompts):
    """generate_batch with n_parallel=1: the prompts take turns in the one sequence, with slow steps."""
    one = SFILlama(str(random_model("tiny-llama")), n_ctx=1024, n_threads=1)
    try:
        batch = _batch(one, prompts[:2], SMALL, n=24)
        for prompt, b in zip(prompts, batch):
            alone = one.generate(prompt, max_tokens=24, temperature=0, sfi=SMALL, ignore_eos=True)
            assert b.tokens == alone.tokens and b.stats.sfi.slow_steps == alone.stats.sfi.slow_steps
            assert b.stats.sfi.n_slow >= 2
    finally:
        one.close()


def test_reset_clears_every_sequence(llm, prompts):
    _batch(llm, prompts[:3], False, n=4)
    # (prefixes reused: only each prompt's last n_prefill_queries tokens decoded again)
    assert [c.stats.n_prompt_decoded for c in _batch(llm, prompts[:3], False, n=4)] == [16, 16, 16]
    llm.reset()
    again = _batch(llm, prompts[:3], False, n=4)
    assert [c.stats.n_prompt_decoded for c in again] == [len(p) for p in prompts[:3]]


def test_gpu_defaults(llm):
    """With offloaded layers a batch uses SFI from 32K cells per sequence unless min_context is set
    (BENCHMARKS.md: on the H200 batched SFI with staggered refreshes measured 0.90x-0.95x dense at 16K, 1.21x at 32K), a single
    sequence too, and the Selector runs in the slow step's graph unless device_selector says otherwise; on the
    CPU neither."""
    from sfi_gguf.core.engine import CPU_MIN_CONTEXT, GPU_BATCHED_MIN_CONTEXT, GPU_MIN_CONTEXT, SFIEngine

    config = SFIConfig()
    gpu = SFIEngine(llm._ctx, 99, llm.split_mode)  # only the config logic: nothing is offloaded here
    assert gpu.effective_config(config, batched=True).min_context == GPU_BATCHED_MIN_CONTEXT
    assert gpu.effective_config(config).min_context == GPU_MIN_CONTEXT
    assert gpu.effective_config(config.replace(min_context=8192), batched=True).min_context == 8192
    assert gpu.effective_config(config).device_selector is True
    # a batch's refreshes meet on every 8th step on a GPU; a single sequence and the CPU refresh at the trigger
    assert gpu.effective_config(config, batched=True).refresh_grid == 8
    assert gpu.effective_config(config).refresh_grid == llm.effective_config(config, batched=True).refresh_grid == 1
    assert gpu.effective_config(config.replace(device_selector=False)).device_selector is False
    # the CPU: dense below 2K cells with the default budget; an explicit k_head keeps the budget rule
    assert llm.effective_config(config, batched=True).min_context == CPU_MIN_CONTEXT
    assert llm.effective_config(config.replace(k_head=64)).min_context is None
    assert llm.effective_config(config).device_selector is None  # the CPU: the numpy Selector


def test_refresh_grid_puts_the_sequences_refreshes_on_the_same_steps(llm, prompts):
    """refresh_grid 4, a slow step every 6 (fixed) per sequence, sequences that start at different steps (3 slots, the
    4th prompt joins when one ends): every slow sequence-step of a step that decodes several falls on a step of the
    batch that is a multiple of 4, and a single generation refreshes on its own steps that are multiples of 4; alone in
    the batch, at its triggers."""
    config = SMALL.replace(min_context=0, fixed_period=6, refresh_grid=4)
    decoder = llm.batched_decoder()
    slow_at = []
    decode = decoder._decode

    def recording(group, tail=None):
        if len(decoder.active) > 1:  # (the last sequence decodes alone at the end)
            slow_at.extend(decoder._n_step for _, kind in group if kind == "slow")
        decode(group, tail)

    decoder._decode = recording
    batch_prompts = [prompts[0], prompts[1][:-30], prompts[3], prompts[2]]
    try:
        llm.reset()
        batch = _batch(llm, batch_prompts, config, n=50)
    finally:
        del decoder._decode
    # the batch's clock starts again with the next batch: the same prompts, the same slow steps and tokens
    llm.reset()
    again = _batch(llm, batch_prompts, config, n=50)
    assert [b.stats.sfi.slow_steps for b in again] == [b.stats.sfi.slow_steps for b in batch]
    assert [b.tokens for b in again] == [b.tokens for b in batch]
    assert len(slow_at) >= 20 and all(step % 4 == 0 for step in slow_at)
    assert len(set(slow_at)) < len(slow_at)  # several sequences in one refresh's step
    assert all(b.stats.sfi.n_slow >= 6 for b in batch) and all(b.stats.sfi.n_held_steps > 0 for b in batch[:3])
    alone = llm.generate(prompts[0], max_tokens=50, temperature=0, sfi=config, ignore_eos=True).stats.sfi
    ungridded = llm.generate(prompts[0], max_tokens=50, temperature=0, sfi=config.replace(refresh_grid=1),
                             ignore_eos=True).stats.sfi
    assert all(step % 4 == 0 for step in alone.slow_steps) and alone.n_held_steps > 0
    assert ungridded.slow_steps[:3] == [6, 12, 18] and alone.slow_steps[:3] == [8, 12, 20]
    # alone in a batch (a server's one request): nothing to meet, its triggers do not wait
    single = _batch(llm, prompts[:1], config, n=50)[0].stats.sfi
    assert single.slow_steps == ungridded.slow_steps and single.n_held_steps == 0


def test_device_selector_each_sequence_decodes_as_it_would_alone(llm, prompts):
    """The Selector in the slow step's graph (128 candidates of each sequence, one set of ops for all the
    slow sequences of a step): each sequence gets the selections, hence the tokens, it gets alone."""
    config = SMALL.replace(device_selector=True, n_candidates=128)
    batch = _batch(llm, prompts, config, n=40)
    for prompt, b in zip(prompts, batch):
        alone = llm.generate(prompt, max_tokens=40, temperature=0, sfi=config, ignore_eos=True)
        assert b.tokens == alone.tokens and b.stats.sfi.slow_steps == alone.stats.sfi.slow_steps
        # the same selections up to a cell at a near-tie (a CUDA build with every layer on the CPU, after the
        # module's other batches, ranks one of a refresh's 256 cells otherwise: 1/256 of an overlap)
        assert b.stats.sfi.refresh_overlap == pytest.approx(alone.stats.sfi.refresh_overlap, abs=1.5/256)
        # every refresh (bootstrap or slow step) ran on the device
        assert b.stats.sfi.n_device_selections == b.stats.sfi.n_slow + b.stats.sfi.n_bootstrap >= 2


@pytest.mark.real_model
def test_default_model_batched_equals_alone_until_a_near_tie():
    """What docs/python-api.md promises for batches on the CPU: llama.cpp's kernels compute a row of a batch
    with other rounding than a single token (logits a few hundredths apart, growing through the KV
    cache), so a greedy prompt gets the tokens it gets alone up to the first near-tie, where the two
    may pick different tokens; after that they are different texts. (Measured on 16 short chat prompts,
    32 tokens, 4 slots: 4 diverge, at top-2 margins of 0.0007 to 0.09.) A batch that mixed up
    sequences or positions would diverge at once, at a wide margin."""
    questions = ["Write a haiku about rain.", "List three fruits.", "Why is the sky blue?",
                 "What is the boiling point of water?", "What is a cache?", "Name three primary colors.",
                 "What is 17 times 23?", "What is an API?"]
    with SFILlama(None, n_ctx=512, n_parallel=4, n_threads=1, sfi=False) as llm:
        prompts = [[{"role": "user", "content": q}] for q in questions]
        kw = dict(max_tokens=24, temperature=0, ignore_eos=True, logprobs=2)
        alone = [llm.generate(p, **kw) for p in prompts]
        batch = [llm.batch_request(p, **kw) for p in prompts]
        llm.batched_decoder().run(batch)
    for a, b in zip(alone, (r.completion() for r in batch)):
        d = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), len(a.tokens))
        assert d > 0  # the first token comes from the prefill, which a slot runs alone
        for i in range(d):  # the same tokens, at nearly the same log-probabilities
            assert abs(a.logprobs[i][1] - b.logprobs[i][1]) < 0.5
        if d < len(a.tokens):  # a different token: at a near-tie, in both
            for run in (a, b):
                (_, first), (_, second) = run.logprobs[d][2]
                assert first - second < 0.25


def test_sliding_window_model_batched_equals_alone(prompts):
    """Gemma 3 (iSWA: SFI covers the global layers; the sliding-window ones attend their own cache in the
    same graph): one llama_decode per step of slow, dense and fast sequences gives each prompt its tokens
    and slow steps alone."""
    gemma = SFILlama(str(random_model("tiny-gemma3")), n_ctx=1024, n_parallel=3, n_threads=1)
    try:
        decoder = gemma.batched_decoder()
        decoder.reset_timing()
        batch = gemma.generate_batch(prompts[:3], max_tokens=40, temperature=0, sfi=SMALL, ignore_eos=True)
        assert decoder.n_llama_decode == decoder.n_steps and decoder.n_decode["fast"] > 0
        for prompt, b in zip(prompts[:3], batch):
            alone = gemma.generate(prompt, max_tokens=40, temperature=0, sfi=SMALL, ignore_eos=True)
            assert b.tokens == alone.tokens and b.stats.sfi.slow_steps == alone.stats.sfi.slow_steps
    finally:
        gemma.close()
