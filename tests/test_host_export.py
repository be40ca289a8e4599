"""The asynchronous refresh of a cache in host memory: a fast step keeps its token's queries, and the export over
the cache computed from them on the CPU (on any thread) equals the export a slow step of that token makes; the
stepper's `async_refresh` loads that export's selection while fast steps go on."""
import threading

import numpy as np
import pytest

from sfi_gguf.core.bindings import SFIError, SFINative
from sfi_gguf.core.config import SFIConfig
from native_harness import FLASH_ATTN, Ctx, all_cells, tokens_for

P = 200  # prompt tokens


def _slow_and_captured(model, n_candidates, flash_attn, threaded=False):
    """The export of token P by a slow step (context c) and by the host export of a fast step over every cell
    (context d), whose attention equals dense: the same queries, the same cache."""
    c, d = Ctx(model, flash_attn=flash_attn), Ctx(model, flash_attn=flash_attn)
    toks = tokens_for(model, P + 1, seed=5)
    c.decode(toks[:P])
    d.decode(toks[:P])
    slow, fast = SFINative(c.ctx), SFINative(d.ctx)
    slow.set_n_candidates(n_candidates)
    slow.set_mode(slow.SLOW)
    c.decode(toks[P:])
    fast.set_selection(all_cells(fast, P))
    fast.set_mode(fast.FAST)
    fast.capture_queries()
    d.decode(toks[P:])
    job = fast.host_export(n_candidates)
    if threaded:  # computed while the context decodes on
        worker = threading.Thread(target=job.compute, args=(2,))
        worker.start()
        d.decode(tokens_for(model, 8, seed=6))
        worker.join()
    else:
        job.compute(1)
    return c, d, slow, job


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_host_export_equals_the_slow_steps_export(tiny, flash_attn):
    c, d, slow, job = _slow_and_captured(tiny, 0, flash_attn)
    try:
        assert job.candidates() is None
        assert job.evidence().shape == slow.evidence().shape
        # (without flash attention the slow step's scores round the unscaled queries to F16, the evidence op the
        # scaled ones: the probabilities differ in the 4th digit)
        np.testing.assert_allclose(job.evidence(), slow.evidence(), rtol=1e-3, atol=1e-5)
        np.testing.assert_allclose(job.key_norms(), slow.key_norms(), rtol=1e-4, atol=1e-6)
    finally:
        job.close()
        c.close()
        d.close()


@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen3"])
def test_host_export_candidates_equal_the_slow_steps_while_the_context_decodes(fixture, request):
    """With candidates, and computed on another thread while the same context decodes more tokens (into other
    cells): the candidates and their values of a slow step's export."""
    model = request.getfixturevalue(fixture)
    c, d, slow, job = _slow_and_captured(model, 48, True, threaded=True)
    try:
        cells, want = job.candidates(), slow.candidates()
        assert cells.shape == want.shape == (slow.n_layers, 48)
        for i in range(slow.n_layers):
            assert sorted(cells[i].tolist()) == sorted(want[i].tolist())
            order, want_order = np.argsort(cells[i]), np.argsort(want[i])
            for got, ref in ((job.evidence(), slow.evidence()), (job.key_norms(), slow.key_norms())):
                np.testing.assert_allclose(got[i][:, order], ref[i][:, want_order], rtol=1e-4, atol=1e-6)
    finally:
        job.close()
        c.close()
        d.close()


def test_host_export_needs_a_fast_step_that_kept_its_queries(tiny):
    c = Ctx(tiny)
    try:
        toks = tokens_for(tiny, P + 3, seed=7)
        c.decode(toks[:P])
        sfi = SFINative(c.ctx)
        assert sfi.host_export(0) is None  # no capture asked
        sfi.capture_queries()
        c.decode(toks[P:P + 1])  # a dense decode: nothing kept, and the request ends with it
        assert sfi.host_export(0) is None
        sfi.set_selection(all_cells(sfi, P + 1))
        sfi.set_mode(sfi.FAST)
        c.decode(toks[P + 1:P + 2])
        assert sfi.host_export(0) is None  # a fast decode without a capture asked
        sfi.capture_queries()
        c.decode(toks[P + 2:])
        job = sfi.host_export(0)
        assert job.evidence() is None  # not computed yet
        job.compute(1)
        assert job.evidence().shape[:2] == (sfi.n_layers, sfi.n_head_kv)
        job.close()
        c.seq_rm(P + 2, -1)  # the token is gone: its queries no longer hold
        assert sfi.host_export(0) is None
        with pytest.raises(SFIError):
            sfi.host_export(-1)
        with pytest.raises(SFIError):
            sfi.capture_queries(seq=3)
    finally:
        c.close()


# -- SFIStepper with async_refresh -------------------------------------------------------------------

PROMPT = [int(t) for t in np.random.default_rng(3).integers(3, 300, 400)]  # (the tiny model's vocabulary: 304)


def _generate(llm, prompt, config, n=96):
    llm.reset()
    llm.sfi_config = config
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llm(tiny_path):
    from sfi_gguf import SFILlama

    with SFILlama(str(tiny_path), n_ctx=1024, n_threads=1) as model:
        yield model


def test_async_refresh_with_every_cell_selected_equals_dense(tiny_llm):
    """Refreshes computed on the host and loaded a fixed delay later: with a budget of every cell, every memory
    holds every cell, so the tokens are dense's; no slow step after the bootstrap."""
    prompt = PROMPT
    config = SFIConfig(k_head=1024, min_context=0, policy="fixed", fixed_period=8, async_refresh=True,
                       selection_delay=3)
    out = _generate(tiny_llm, prompt, config)
    dense = _generate(tiny_llm, prompt, SFIConfig(policy="dense"))
    assert out.tokens == dense.tokens
    s = out.stats.sfi
    assert s.n_slow == 0 and s.n_bootstrap == 1 and s.n_host_refresh >= 8 and s.n_async == s.n_host_refresh
    assert s.t_selector_background > 0


def test_async_refresh_as_soon_as_ready(tiny_llm, monkeypatch):
    """Without a fixed delay each selection is loaded once its worker is done, within ASYNC_MAX_DELAY steps of
    its trigger (how many triggers come meanwhile, and are skipped, depends on the threads' timing)."""
    from sfi_gguf.core.plan import ASYNC_MAX_DELAY
    from sfi_gguf.core.stepper import SFIStepper

    started, loaded = [], []
    for name, steps in (("_start_host_refresh", started), ("_load_pending", loaded)):
        original = getattr(SFIStepper, name)

        def spy(self, *args, _original=original, _steps=steps, **kwargs):
            _steps.append(self._n_step)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(SFIStepper, name, spy)
    out = _generate(tiny_llm, PROMPT, SFIConfig(k_head=64, min_context=0, policy="fixed", fixed_period=4,
                                                async_refresh=True))
    s = out.stats.sfi
    assert s.n_slow == 0 and s.n_host_refresh == len(started) >= 4 and sum(s.reasons.values()) == s.n_host_refresh
    assert len(loaded) >= len(started) - 1  # (the last may still be computed when the generation ends)
    for start, load in zip(started, loaded):
        assert start < load <= start + 1 + ASYNC_MAX_DELAY


def test_async_refresh_is_validated():
    with pytest.raises(ValueError, match="async_refresh"):
        SFIConfig(async_refresh=True, redecode_tail=True)
    with pytest.raises(ValueError, match="async_refresh"):
        SFIConfig(async_refresh=1)
    SFIConfig(async_refresh=None, redecode_tail=True)  # (None: off with redecode_tail)


def test_async_refresh_in_a_batch_with_every_cell_selected_equals_dense(tiny_path):
    """Two sequences decoded together (one stream each): each refreshes on the host from its own queries (a fast
    step of the batch keeps the queries of the sequences that asked), and with a budget of every cell the tokens
    are dense's."""
    from sfi_gguf import SFILlama

    prompts = [PROMPT, PROMPT[:300]]
    config = SFIConfig(k_head=1024, min_context=0, policy="fixed", fixed_period=8, async_refresh=True,
                       selection_delay=3)
    runs = {}
    for name, sfi in (("async", config), ("dense", SFIConfig(policy="dense"))):
        with SFILlama(str(tiny_path), n_ctx=1024, n_threads=1, n_parallel=2, sfi=sfi) as llm:
            runs[name] = llm.generate_batch(prompts, max_tokens=48, temperature=0, ignore_eos=True)
    for out, dense in zip(runs["async"], runs["dense"]):
        assert out.tokens == dense.tokens
        s = out.stats.sfi
        assert s.n_slow == 0 and s.n_host_refresh >= 4 and s.n_fell_back == 0


def test_a_refresh_borrows_decode_threads_and_gives_them_back(tiny_path):
    """While refreshes compute, single-token decodes run on DECODE_THREADS_DURING_REFRESH threads (loans nest, one
    per sequence refreshing); prefill keeps its threads, and the last return restores the count."""
    from sfi_gguf.core.context import LlamaContext
    from sfi_gguf.core.library import llama_cpp
    from sfi_gguf.core.stepper import DECODE_THREADS_DURING_REFRESH

    ctx = LlamaContext(tiny_path, n_ctx=256, n_gpu_layers=0, n_threads=8, n_batch=256, flash_attn=True, verbose=False)
    try:
        assert ctx.lend_threads(DECODE_THREADS_DURING_REFRESH) == 8 - DECODE_THREADS_DURING_REFRESH
        assert ctx.lend_threads(DECODE_THREADS_DURING_REFRESH) == 8 - DECODE_THREADS_DURING_REFRESH
        assert llama_cpp.llama_n_threads(ctx.ctx) == DECODE_THREADS_DURING_REFRESH
        assert llama_cpp.llama_n_threads_batch(ctx.ctx) == 8
        ctx.return_threads()
        assert llama_cpp.llama_n_threads(ctx.ctx) == DECODE_THREADS_DURING_REFRESH
        ctx.return_threads()
        assert llama_cpp.llama_n_threads(ctx.ctx) == 8
    finally:
        ctx.close()
