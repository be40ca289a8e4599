"""The SFI Selector in the slow step's graph against the numpy reference (sfi_gguf.core.selector).

With as many candidates as cells in the range, the device runs exactly the reference's stages on the full
export: its scores (captured with cb_eval on the CPU) must match `SFISelector.score` and its selection
`SFISelector.select`. With fewer candidates, the candidates are the cells of most pooled evidence summed over
the heads, and the stages run on them (test below, numpy written out). Set SFI_TEST_NGL=99 to run the
selection tests with the layers on a GPU (the score captures need host tensors and are skipped there).
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.bindings import SFINative, default_params
from sfi_gguf.core.selector import (AttentionExport, CandidateRange, SFISelector, cross_head_exclusivity, local_pool,
                               mix_evidence_and_prior, position_log_prior, power_mean_evidence)
from sfi_gguf.tools.random_model import random_model
from native_harness import GGML_TYPE_F16, GGML_TYPE_Q8_0, NGL, Capture, Ctx, Model, nmse, tokens_for

N_SINK, N_RECENT, K_HEAD = 4, 64, 96
# the slow step's attention as ggml_sfi_flash_attn_evidence (by default on a GPU, LLAMA_SFI_FA_EVIDENCE=1 on the CPU):
# its output equals flash attention's up to rounding, so a slow step is then close to a dense one, not bit-identical,
# and later layers' queries differ as much
FA_EVIDENCE = os.environ.get("LLAMA_SFI_FA_EVIDENCE", "1" if NGL > 0 else "0") == "1"
FLASH_ATTN = [pytest.param(True, id="fa"), pytest.param(False, id="no_fa")]


@pytest.fixture(scope="module")
def tiny_deep():
    """70 layers of 8 query heads: the device takes the softmaxes of 32 layers' scores at a time (256 rows),
    so three stacks, the last one short."""
    m = Model(random_model("tiny-llama", n_layer=70))
    yield m
    m.close()


def prefilled_pair(model, n_prompt, seed, capture=None, flash_attn=True, type_kv=GGML_TYPE_F16):
    """Two contexts holding the same prompt, and the token of the slow step."""
    toks = tokens_for(model, n_prompt + 1, seed=seed)
    pair = (Ctx(model, flash_attn=flash_attn, type_kv=type_kv),
            Ctx(model, flash_attn=flash_attn, type_kv=type_kv, capture=capture))
    for c in pair:
        for i in range(0, n_prompt, 256):
            c.decode(toks[i:min(i + 256, n_prompt)])
    return pair, toks[n_prompt:]


def device_selector_slow_step(ctx, token, n_cand, capture, **switches) -> SFINative:
    """A slow step of ctx with the device Selector over n_cand candidates, the ops capture saw before it forgotten;
    switches: the graph switches of llama_sfi_params (fused_ops, fa_evidence), the library's defaults if left out."""
    sfi = SFINative(ctx.ctx, **switches)
    sfi.set_n_candidates(n_cand)
    sfi.set_selector(SFISelector().device_params(K_HEAD, N_SINK, N_RECENT))
    sfi.set_mode(sfi.SLOW)
    capture.ops.clear()
    capture.all_ops.clear()
    ctx.decode([token])
    return sfi


def host_export(full: SFINative, n_head: int) -> AttentionExport:
    mass = full.mass()
    return AttentionExport(mass=mass, evidence=full.evidence(), key_norms=full.key_norms(),
                           n_rows=full.n_query_rows() * (n_head // full.n_head_kv), alpha=0.5,
                           positions=full.cell_pos()[:mass.shape[2]])


def n_head_of(model) -> int:
    from sfi_gguf.core.library import llama_cpp

    return llama_cpp.llama_model_n_head(model.ptr)


def overlap(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean([len(np.intersect1d(x, y)) / len(x) for x, y in zip(a.reshape(-1, a.shape[-1]),
                                                                               b.reshape(-1, b.shape[-1]))]))


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen3", "tiny_deep"])  # 4 KV heads (cross-head exclusivity), 2, 70 layers
def test_device_selector_equals_numpy_reference(fixture, flash_attn, request):
    model = request.getfixturevalue(fixture)
    n_prompt = 700
    capture = Capture(["sfi_sel_score"]) if NGL == 0 else None
    (c, d), slow_token = prefilled_pair(model, n_prompt, seed=5, capture=capture, flash_attn=flash_attn)
    try:
        full, dev = SFINative(c.ctx), SFINative(d.ctx)
        selector = SFISelector()
        rng = CandidateRange.for_context(n_prompt + 1, N_SINK, N_RECENT)
        dev.set_n_candidates(len(rng))
        dev.set_selector(selector.device_params(K_HEAD, N_SINK, N_RECENT))
        for sfi in (full, dev):
            sfi.set_mode(sfi.SLOW)
        if capture is not None:
            capture.seen.clear()
        c.decode(slow_token)
        d.decode(slow_token)
        if FA_EVIDENCE:  # ggml's CPU flash attention sums F16 values in F16: the two differ by its rounding
            err = np.linalg.norm(d.logits() - c.logits()) / np.linalg.norm(c.logits())
            assert err < 1e-2, err
        else:
            assert np.array_equal(c.logits(), d.logits())  # still an exact dense step
        assert dev.mass() is None and dev.evidence() is None  # only the selection left the device

        export = host_export(full, n_head_of(model))
        expected = selector.select(export, rng, K_HEAD)
        got = dev.selection()
        L, H, _ = expected.shape
        assert got.shape == (L, H, K_HEAD)
        got = np.sort(got, axis=-1)
        assert all(len(np.unique(row)) == K_HEAD for row in got.reshape(-1, K_HEAD))
        assert overlap(expected, got) >= 0.99, overlap(expected, got)

        cells = dev.candidates()
        assert cells.shape == (L, len(rng)) and np.array_equal(np.sort(cells, -1), np.broadcast_to(
            np.arange(rng.start, rng.stop), (L, len(rng))))
        if capture is not None:
            reference = selector.score(export, slice(0, L), export.candidate_cells(rng))  # [L, H, C] by position
            # one score tensor per run of layers alike (layers stacked), [layer, H, n_cand] in candidate order
            scores = np.concatenate([t.reshape(-1, H, cells.shape[1]) for t in capture.seen["sfi_sel_score"]])
            assert len(scores) == L
            # without flash attention the host export is the attention's own softmax (its product of the unscaled
            # queries), the device's scores come from a product of the scaled ones: the CPU rounds both queries to
            # F16 for the product, so they agree to that rounding (~1e-4), not to F32's
            # (with the attention giving the evidence, the later layers' queries differ by the attention's rounding)
            tol = dict(rtol=1e-3, atol=5e-3) if FA_EVIDENCE else dict(rtol=1e-5, atol=2e-5) if flash_attn else dict(rtol=2e-4, atol=2e-3)
            for layer in range(L):
                device = scores[layer]
                np.testing.assert_allclose(device, reference[layer][:, cells[layer] - rng.start], **tol)
    finally:
        c.close()
        d.close()


def test_a_slow_step_without_the_selector_leaves_no_selection(tiny):
    (c, d), slow_token = prefilled_pair(tiny, 700, seed=5)
    try:
        c.close()
        dev = SFINative(d.ctx)
        rng = CandidateRange.for_context(701, N_SINK, N_RECENT)
        dev.set_n_candidates(len(rng))
        dev.set_selector(SFISelector().device_params(K_HEAD, N_SINK, N_RECENT))
        dev.set_mode(dev.SLOW)
        d.decode(slow_token)
        assert dev.selection_size() == K_HEAD
        dev.set_n_candidates(K_HEAD - 1)  # fewer candidates than k_head: this slow step runs no Selector
        d.decode(tokens_for(tiny, 1, seed=6))
        assert dev.selection_size() == 0 and dev.selection() is None
    finally:
        d.close()


def reference_with_candidates(export: AttentionExport, rng: CandidateRange, n_cand: int, k: int,
                              selector: SFISelector):
    """The device pipeline with fewer candidates than cells, in numpy: evidence pooled over the whole range,
    candidates by head-summed pooled evidence, then the stages on the candidates (f renormalised, the position
    prior at the candidates' true positions). Returns (candidate cells [L, n_cand] as sets, scores)."""
    sl = slice(rng.start, rng.stop)
    f = local_pool(power_mean_evidence(export.evidence[..., sl], export.n_rows, 0.5), selector.pool_window)
    best = np.argsort(-f.sum(axis=1), axis=-1, kind="stable")[:, :n_cand]  # [L, n_cand] indices into the range
    log_prior = selector.prior["w_pos"] * position_log_prior(len(rng), selector.prior["pos_beta"],
                                                             selector.prior["pos_power"], selector.prior["pos_eta"])
    out = []
    for layer in range(f.shape[0]):
        idx = best[layer]
        fc = f[layer][:, idx]
        fc = fc / fc.sum(-1, keepdims=True)
        norms = np.maximum(export.key_norms[layer][:, sl][:, idx], np.finfo(np.float32).tiny)
        log_r = -selector.prior["gamma"] * selector.prior["w_l2"] * np.log(norms) + log_prior[idx]
        r = np.exp(log_r - log_r.max(-1, keepdims=True))
        r = (r / r.sum(-1, keepdims=True)).astype(np.float32)
        q, _ = mix_evidence_and_prior(fc.astype(np.float32), r, selector.lambda_max(export.n_rows))
        s = np.log(np.maximum(q, np.finfo(np.float32).tiny))
        if s.shape[0] > 2:
            s = cross_head_exclusivity(s, selector.cross_head_alpha, selector.cross_head_temperature)
        out.append((idx + rng.start, s))
    return out


@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen3"])
def test_device_selector_with_fewer_candidates(fixture, request):
    model = request.getfixturevalue(fixture)
    n_prompt, n_cand = 900, 256
    capture = Capture(["sfi_sel_score"]) if NGL == 0 else None
    (c, d), slow_token = prefilled_pair(model, n_prompt, seed=9, capture=capture)
    try:
        full, dev = SFINative(c.ctx), SFINative(d.ctx)
        selector = SFISelector()
        rng = CandidateRange.for_context(n_prompt + 1, N_SINK, N_RECENT)
        dev.set_n_candidates(n_cand)
        dev.set_selector(selector.device_params(K_HEAD, N_SINK, N_RECENT))
        for sfi in (full, dev):
            sfi.set_mode(sfi.SLOW)
        c.decode(slow_token)
        d.decode(slow_token)
        export = host_export(full, n_head_of(model))
        reference = reference_with_candidates(export, rng, n_cand, K_HEAD, selector)
        sl = slice(rng.start, rng.stop)
        pooled_sum = local_pool(power_mean_evidence(export.evidence[..., sl], export.n_rows, 0.5),
                                selector.pool_window).sum(axis=1)  # [L, C]
        cells, got = dev.candidates(), np.sort(dev.selection(), axis=-1)
        compared = 0
        for layer, (ref_cells, ref_scores) in enumerate(reference):
            # the n_cand best head-summed pooled scores (pooling makes plateaus: ties at the cut may pick other cells)
            assert len(np.unique(cells[layer])) == n_cand
            np.testing.assert_allclose(np.sort(pooled_sum[layer][cells[layer] - rng.start])[::-1],
                                       np.sort(pooled_sum[layer])[::-1][:n_cand], rtol=1e-5)
            assert np.all(np.isin(got[layer], cells[layer]))  # picks come from the candidates
            assert np.all((got[layer] >= rng.start) & (got[layer] < rng.stop))
            ref_pick = np.sort(ref_cells[np.argsort(-ref_scores, axis=-1, kind="stable")[:, :K_HEAD]], axis=-1)
            assert overlap(ref_pick, got[layer]) >= 0.97
            if capture is not None and np.array_equal(np.sort(cells[layer]), np.sort(ref_cells)):
                order = np.argsort(ref_cells)
                # one tensor for the layers stacked: [layer, head, candidate]
                device = capture.last("sfi_sel_score").reshape(-1, ref_scores.shape[0], n_cand)[layer]
                by_cell = device[:, np.argsort(cells[layer])]
                tol = 3e-3 if FA_EVIDENCE else 1e-4
                np.testing.assert_allclose(by_cell, ref_scores[:, order], rtol=tol, atol=tol)
                compared += 1
        if capture is not None and os.environ.get("LLAMA_SFI_FUSED") != "0":
            # ggml_sfi_top_k breaks ties at the cut as the reference does (the lowest cells): the same candidates
            assert compared == len(reference)
    finally:
        c.close()
        d.close()


def test_candidates_outside_the_range_count_for_nothing(tiny):
    """More candidates than cells in the range: the extra ones (sink, recent window) are never picked and do
    not change the scores; fewer cells in the range than k_head: no selection (the caller falls back)."""
    n_prompt = 300
    (c, d), slow_token = prefilled_pair(tiny, n_prompt, seed=2)
    try:
        n_range = len(CandidateRange.for_context(n_prompt + 1, N_SINK, N_RECENT))
        selections = []
        for ctx, n_cand in ((c, n_range), (d, n_prompt)):
            sfi = SFINative(ctx.ctx)
            sfi.set_n_candidates(n_cand)
            sfi.set_selector(SFISelector().device_params(64, N_SINK, N_RECENT))
            sfi.set_mode(sfi.SLOW)
            ctx.decode(slow_token)
            selections.append(np.sort(sfi.selection(), axis=-1))
        assert np.all((selections[1] >= N_SINK) & (selections[1] < n_prompt + 1 - N_RECENT))
        assert overlap(*selections) >= 0.99
        dev = sfi
        dev.set_selector(SFISelector().device_params(n_range + 2, N_SINK, N_RECENT))  # the range grows by one
        d.decode([7])
        assert dev.selection() is None
        # k_head above the candidates: no Selector in the graph, an ordinary candidate export
        dev.set_n_candidates(32)
        dev.set_selector(SFISelector().device_params(64, N_SINK, N_RECENT))
        d.decode([8])
        assert dev.selection() is None and dev.mass().shape[2] == 32
        with pytest.raises(Exception):
            dev.set_selector({"k_head": -1})
        with pytest.raises(ValueError):
            dev.set_selector({"no_such_field": 1})
        dev.set_selector(None)
        d.decode([9])
        assert dev.selection() is None and dev.mass().shape[2] == 32
    finally:
        c.close()
        d.close()


def test_shared_cells_and_overlap(tiny):
    """set_selection(own, shared=...) reads like the assembled selection (own + shared in every row), and
    the native overlap is `refresh_overlap` of the own cells."""
    from sfi_gguf.core.selector import assemble_memory, refresh_overlap

    n_prompt = 400
    (c, d), token = prefilled_pair(tiny, n_prompt, seed=4)
    try:
        assembled, shared = SFINative(c.ctx), SFINative(d.ctx)
        rng = np.random.default_rng(0)
        L, H = shared.n_layers, shared.n_head_kv
        sink, recent = np.arange(4), np.arange(n_prompt - 32, n_prompt)

        def own(k):
            return np.stack([np.stack([rng.choice(np.arange(4, n_prompt - 32), k, replace=False) for _ in range(H)])
                             for _ in range(L)]).astype(np.int32)

        first, second = own(40), own(48)
        for sel in (first, second):
            assembled.set_selection(assemble_memory(np.sort(sel, -1), sink, recent))
            shared.set_selection(sel, shared=np.concatenate([sink, recent]))
        assert shared.selection_overlap() == pytest.approx(refresh_overlap(first, second), abs=1e-6)
        for sfi in (assembled, shared):
            sfi.set_mode(sfi.FAST)
        c.decode(token)
        d.decode(token)
        assert nmse(d.logits(), c.logits()) < 1e-5  # the same cells in other slots: only the summation order differs
        assert SFINative(c.ctx).selection_overlap() is None  # re-initialised: no previous selection
        with pytest.raises(Exception):
            shared.set_selection(second, shared=np.array([int(second[0, 0, 0])]))  # a shared cell twice in a row
    finally:
        c.close()
        d.close()


# the graph switches of llama_sfi_params, set per context: one process builds each context's graphs as it asks
SWITCHES = [pytest.param({}, id="defaults"), pytest.param({"fa_evidence": 1}, id="fa_evidence"),
            pytest.param({"fa_evidence": 0}, id="no_fa_evidence"), pytest.param({"fused_ops": False}, id="composite"),
            pytest.param({"fa_evidence": 1, "fused_ops": False}, id="composite_fa_evidence")]


@pytest.mark.skipif(NGL > 0, reason="reads the graph's nodes on the host through cb_eval")
@pytest.mark.parametrize("switches", SWITCHES)
def test_the_attention_gives_the_evidence_where_asked(tiny, switches):
    """With fa_evidence 1 (LLAMA_SFI_FA_EVIDENCE=1; by default on a GPU) every layer's attention in a slow step with
    the device Selector is ggml_sfi_flash_attn_evidence, which also gives the Selector its evidence and key norms; by
    default on the CPU it is llama.cpp's flash attention, and the evidence comes from ggml_sfi_evidence (or composite
    ops, fused_ops off: LLAMA_SFI_FUSED=0). The contexts of one process take the switches each asks for."""
    params = {**default_params(), **switches}
    capture = Capture(["sfi_fae", "sfi_evidence"])
    (c, d), token = prefilled_pair(tiny, 300, seed=10, capture=capture)
    try:
        sfi = device_selector_slow_step(d, token[0], 128, capture, **switches)
        ops = {op for ops in capture.ops.values() for op in ops} - {"VIEW", "RESHAPE"}  # the views of their results
        fused = params["fa_evidence"] == 1 and params["fused_ops"]  # (-1 on the CPU's keys: off)
        if not params["fused_ops"]:
            expected = set()  # the composite ops
        else:
            expected = {"SFI_FLASH_ATTN_EVIDENCE"} if fused else {"SFI_EVIDENCE"}
        assert ops == expected, capture.ops
        # the fused op replaces flash attention: it does not run next to it; the layers' evidence and key norms are
        # stacked for the Selector by one copy each (a pad, then sets in place), not by concats
        n_layer = llama_cpp.llama_model_n_layer(tiny.ptr)
        assert capture.all_ops["FLASH_ATTN_EXT"] == (0 if fused else n_layer), capture.all_ops
        if fused:
            assert capture.all_ops["CONCAT"] == 0 and capture.all_ops["SET"] == 2 * (n_layer - 1), capture.all_ops
        assert sfi.selection() is not None
    finally:
        c.close()
        d.close()


@pytest.mark.skipif(NGL > 0, reason="reads the graph's nodes on the host through cb_eval")
@pytest.mark.parametrize("fused_ops", [None, False], ids=["defaults", "composite"])
def test_the_gathers_copy_rows_as_they_are(tiny, fused_ops):
    """Both gathers of a selection into the view, the slow step's of the device Selector's picks and the first fast
    step's of a selection set from the host, copy the cache's rows with ggml_sfi_copy_rows where the backend has it
    (no F32 rows between a get_rows and a set_rows); with fused_ops off (LLAMA_SFI_FUSED=0), the composite ops."""
    composite = fused_ops is False or not default_params()["fused_ops"]
    expected = {"SET_ROWS"} if composite else {"SFI_COPY_ROWS"}
    capture = Capture(["sfi_gather"])
    (c, d), token = prefilled_pair(tiny, 500, seed=8, capture=capture)
    try:
        sfi = device_selector_slow_step(d, token[0], 256, capture, fused_ops=fused_ops)
        assert capture.ops == {"sfi_gather": expected}  # the slow step gathered its own selection
        selected = sfi.selection()
        sfi.load_selection()
        toks = tokens_for(tiny, 4, seed=9)
        sfi.set_mode(sfi.FAST)
        d.decode([toks[0]])
        assert sfi.last_fast

        rng = CandidateRange.for_context(d.n_past, N_SINK, N_RECENT)
        sink, recent = rng.sink_and_recent_cells(sfi.cell_pos())
        sfi.set_selection(selected, shared=np.concatenate([sink, recent]))
        capture.ops.clear()
        d.decode([toks[1]])
        assert sfi.last_fast
        assert capture.ops == {"sfi_gather": expected}  # the first fast step gathered the host's selection
    finally:
        c.close()
        d.close()


@pytest.mark.parametrize("fixture,flash_attn,type_kv", [
    pytest.param("tiny", True, GGML_TYPE_F16, id="fa"), pytest.param("tiny", False, GGML_TYPE_F16, id="no_fa"),
    # blocks of 32 values: the layers are gathered one by one, not as one span of the cache
    pytest.param("tiny", True, GGML_TYPE_Q8_0, id="fa-q8_0"),
    # more layers than KV heads (the shared cells' index is repeated per layer)
    pytest.param("tiny_deep", True, GGML_TYPE_F16, id="fa-70-layers")])
def test_a_slow_step_loads_its_own_selection(fixture, flash_attn, type_kv, request):
    """load_selection() after a slow step with the device Selector loads what set_selection(selection(), shared=
    sink + recent of the range) loads: the same slots (bit-identical fast steps) and the same overlap, which,
    with the selection's cells, are written natively once the next fast step is launched and read after it; it
    refuses when there is no slow-step selection to load (a decode or an edit since, or no Selector in the step)."""
    from sfi_gguf.core.bindings import SFIError

    tiny = request.getfixturevalue(fixture)
    n_prompt = 600
    (c, d), token = prefilled_pair(tiny, n_prompt, seed=6, flash_attn=flash_attn, type_kv=type_kv)
    try:
        host, native = SFINative(c.ctx), SFINative(d.ctx)
        toks = tokens_for(tiny, 40, seed=7)
        for sfi in (host, native):
            sfi.set_n_candidates(256)
            sfi.set_selector(SFISelector().device_params(K_HEAD, N_SINK, N_RECENT))
        overlaps = []
        for cycle, slow_token in enumerate((token[0], toks[10])):
            for sfi in (host, native):
                sfi.set_mode(sfi.SLOW)
            c.decode([slow_token])
            d.decode([slow_token])
            selected = host.selection()
            assert native.selection_size() == K_HEAD  # ... its cells not read yet
            rng = CandidateRange.for_context(c.n_past, N_SINK, N_RECENT)
            sink, recent = rng.sink_and_recent_cells(host.cell_pos())
            assert len(recent) == N_RECENT and c.n_past - 1 in host.cell_pos()[recent]  # the slow token's own cell
            host.set_selection(selected, shared=np.concatenate([sink, recent]))
            native.load_selection()
            for sfi in (host, native):
                sfi.set_mode(sfi.FAST)
            for i, t in enumerate(toks[cycle * 20:cycle * 20 + 8]):
                c.decode([t])
                d.decode([t])
                assert native.last_fast
                assert np.array_equal(c.logits(), d.logits())
                if i == 0:  # the rows were written while this step computed; the selection still reads
                    assert np.array_equal(selected, native.selection())
                    overlaps.append((host.selection_overlap(), native.selection_overlap()))
        assert overlaps[0] == (None, None) and overlaps[1][0] is not None and overlaps[1][0] == overlaps[1][1]

        with pytest.raises(SFIError):  # a decode since the slow step
            native.load_selection()
        native.set_mode(native.SLOW)
        d.decode([toks[30]])
        d.seq_rm(d.n_past - 1, -1)  # an edit since
        with pytest.raises(SFIError):
            native.load_selection()
        native.set_selector(None)
        d.decode([toks[31]], pos0=d.n_past - 1)  # a slow step without the Selector
        with pytest.raises(SFIError):
            native.load_selection()
    finally:
        c.close()
        d.close()


def test_generation_with_the_device_selector_follows_the_numpy_selector(tmp_path):
    """End to end (SFILlama, greedy): with every cell of the range a candidate, the device Selector makes the
    selections the numpy one makes, so the tokens and slow steps agree; every refresh ran on the device. And
    `sfi-gguf bench --device-selector on` records it in its rows."""
    import json

    from sfi_gguf import SFILlama, cli
    from sfi_gguf.core.config import SFIConfig
    from sfi_gguf.tools.random_model import random_model

    path = random_model("tiny-llama")
    llm = SFILlama(str(path), n_ctx=2048, n_threads=1)
    try:
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, 200, 1100)]
        base = SFIConfig(k_head=128, n_recent=64, policy="fixed", fixed_period=8, n_candidates=10**6)
        host = llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True, sfi=base.replace(device_selector=False))
        dev = llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True, sfi=base.replace(device_selector=True))
        s = dev.stats.sfi
        assert s.n_device_selections == s.n_slow + s.n_bootstrap and s.n_slow >= 4
        assert host.stats.sfi.n_device_selections == 0
        assert dev.tokens == host.tokens and s.slow_steps == host.stats.sfi.slow_steps
        assert s.refresh_overlap == pytest.approx(host.stats.sfi.refresh_overlap, abs=0.02)
    finally:
        llm.close()
    out = tmp_path / "bench.json"
    assert cli.main(["bench", "-m", str(path), "--depths", "1024", "-n", "16", "--k-head", "64", "-t", "1",
                     "--device-selector", "on", "--json", str(out)]) == 0
    assert [r["device_selector"] for r in json.loads(out.read_text())] == [True]


def test_refresh_of_one_group_of_layers(tiny):
    """llama_sfi_set_refresh_layers: a slow step refreshes only the layers of its group (their selection is
    the full step's) and hands back the other layers' own cells of the selection the view holds; without
    such a selection (another own count) it has none."""
    n_prompt = 500
    (c, d), token = prefilled_pair(tiny, n_prompt, seed=6)
    try:
        full, part = SFINative(c.ctx), SFINative(d.ctx)
        rng = CandidateRange.for_context(n_prompt + 1, N_SINK, N_RECENT)
        params = SFISelector().device_params(K_HEAD, N_SINK, N_RECENT)
        held = []
        for ctx, sfi in ((c, full), (d, part)):
            sfi.set_n_candidates(len(rng))
            sfi.set_selector(params)
            sfi.set_mode(sfi.SLOW)
            ctx.decode(token)
            sel = sfi.selection()
            sink, recent = rng.sink_and_recent_cells(sfi.cell_pos())
            sfi.set_selection(sel, shared=np.concatenate([sink, recent]))
            sfi.set_mode(sfi.FAST)
            ctx.decode([11])
            held.append(np.sort(sel, -1))
        assert part.n_layers == 2
        with pytest.raises(Exception):
            part.set_refresh_layers(0, 0)
        with pytest.raises(Exception):
            part.set_refresh_layers(2, 2)
        for group in (1, 0):
            part.set_refresh_layers(2, group)
            for ctx, sfi in ((c, full), (d, part)):
                sfi.set_mode(sfi.SLOW)
                ctx.decode([12 + group])
            new_full, new_part = np.sort(full.selection(), -1), np.sort(part.selection(), -1)
            assert overlap(new_part[group], new_full[group]) >= 0.99     # refreshed: the full step's cells
            assert np.array_equal(new_part[1 - group], held[1][1 - group])  # kept: the view's own cells
            assert not np.array_equal(new_full[1 - group], held[0][1 - group])  # (a refresh would change them)
        # the view holds a selection of another size: nothing to keep, no selection
        part.set_selection(held[1][:, :, :40], shared=np.arange(N_SINK))
        part.set_mode(part.SLOW)
        d.decode([20])
        assert part.selection() is None
        part.set_refresh_layers(1, 0)
        part.set_mode(part.SLOW)
        d.decode([21])
        assert part.selection() is not None
    finally:
        c.close()
        d.close()


def test_generation_refreshing_one_group_of_layers_at_a_time():
    """SFIConfig.refresh_layer_groups=2 with the device Selector: the first refresh renews every layer, the
    later ones one group in turn; decoding runs sparse throughout."""
    from sfi_gguf import SFILlama
    from sfi_gguf.core.config import SFIConfig
    from sfi_gguf.tools.random_model import random_model

    llm = SFILlama(str(random_model("tiny-llama")), n_ctx=2048, n_threads=1)
    try:
        prompt = [int(t) for t in np.random.default_rng(1).integers(3, 200, 1100)]
        config = SFIConfig(k_head=128, n_recent=64, policy="fixed", fixed_period=8, n_candidates=512,
                           device_selector=True, refresh_layer_groups=2)
        out = llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True, sfi=config)
        s = out.stats.sfi
        assert s.n_slow >= 4 and s.n_device_selections == s.n_slow + s.n_bootstrap
        assert s.n_group_refresh == s.n_slow and s.n_fell_back == 0 and s.n_fast > 0
        # more groups than the model's 2 layers: as many groups as layers
        out = llm.generate(prompt, max_tokens=40, temperature=0, ignore_eos=True,
                           sfi=config.replace(refresh_layer_groups=5))
        assert out.stats.sfi.n_group_refresh == out.stats.sfi.n_slow >= 4
        with pytest.raises(ValueError):
            SFIConfig(refresh_layer_groups=0)
    finally:
        llm.close()


@pytest.mark.parametrize("device_selector", [True, False], ids=["device", "host"])
def test_refresh_cycles_reuse_the_slow_and_the_fast_graph(device_selector):
    """Slow and fast steps alternate without rebuilding each other's graph: the fast steps compute on a
    scheduler of their own, so llama.cpp reuses both graphs (no rebuild, no allocation, a GPU's CUDA graphs
    replayed). A refresh rebuilds nothing with the device Selector, which gathers the selection in the slow
    step; a host selection is gathered by the first fast step after it, whose graph differs (two rebuilds)."""
    import llama_cpp

    from sfi_gguf import SFILlama
    from sfi_gguf.core.config import SFIConfig
    from sfi_gguf.tools.random_model import random_model

    llm = SFILlama(str(random_model("tiny-llama")), n_ctx=2048, n_threads=1)
    try:
        prompt = [int(t) for t in np.random.default_rng(3).integers(3, 200, 1100)]
        config = SFIConfig(k_head=128, n_recent=64, policy="fixed", fixed_period=8, n_candidates=512,
                           device_selector=device_selector)
        llm.generate(prompt[:-64], max_tokens=1, sfi=config)  # the graphs' first builds
        ctx = llm.context.ctx
        before = llama_cpp.llama_perf_context(ctx).n_reused
        out = llm.generate(prompt, max_tokens=64, temperature=0, ignore_eos=True, sfi=config)
        reused = llama_cpp.llama_perf_context(ctx).n_reused - before
        s = out.stats.sfi
        assert s.n_slow >= 7 and s.n_fast >= 48 and s.n_device_selections == (s.n_slow + 1 if device_selector else 0)
        steps = s.n_slow + s.n_fast  # the prompt's chunks build theirs (the cache holds most of it)
        rebuilds_per_refresh = 0 if device_selector else 2
        assert reused >= steps - rebuilds_per_refresh * s.n_slow - 4, (reused, steps)
    finally:
        llm.close()
