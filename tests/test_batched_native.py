"""Several sequences in one llama_decode batch, each with its own compact view.

The references are ordinary dense decodes: a multi-sequence context without SFI fed the same batches
(bit-identical when every cell is selected in order), and single-sequence contexts (per-sequence
exports). Random-weight models, so the tests run anywhere; SFI_TEST_NGL puts them on a GPU.
"""
from __future__ import annotations

import numpy as np
import pytest

from sfi_gguf.core import bindings
from sfi_gguf.core.library import llama_cpp
from sfi_gguf.core.bindings import SFINative, SFISequence
import batched_checks
from native_harness import (FLASH_ATTN, GGML_TYPE_F16, GGML_TYPE_Q8_0, N_CTX_SEQ, N_SEQ, Ctx, MultiCtx, select_all,
                            seq_cells, tokens_for)

PROMPTS = (150, 201, 120)  # different lengths: the views differ in size and cells


def prefill_all(ctx: MultiCtx, model):
    for s, n in enumerate(PROMPTS):
        ctx.prefill(s, tokens_for(model, n, seed=10 + s))


def dense_and_selected(model, flash_attn=True):
    """Two contexts holding the same prompts: a (dense) and b, whose sequences select all their cells."""
    a, b = MultiCtx(model, flash_attn=flash_attn), MultiCtx(model, flash_attn=flash_attn)
    prefill_all(a, model)
    prefill_all(b, model)
    sfi = SFINative(b.ctx, n_sel_max=256, n_tail_max=64)
    for s in range(N_SEQ):
        select_all(sfi, s)
    return a, b, sfi


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_all_cells_per_sequence_is_bit_identical(tiny, flash_attn):
    """Every sequence selects all its cells: a batched FAST step equals the batched dense step."""
    a, b, sfi = dense_and_selected(tiny, flash_attn)
    try:
        sfi.set_mode(sfi.FAST)
        toks = {s: 5 + s for s in range(N_SEQ)}
        for _ in range(24):
            la, lb = a.step(toks), b.step(toks)
            for s in range(N_SEQ):
                assert sfi.status(s) & bindings.STATUS_LAST_FAST
                assert np.array_equal(la[s], lb[s]), s
            toks = {s: int(np.argmax(la[s])) for s in range(N_SEQ)}
    finally:
        a.close()
        b.close()


def test_sequences_see_only_their_own_cells(tiny):
    """A window selection (sink + last cells) per sequence in one batch equals the same selection in a
    single-sequence context: a view gathered from another sequence's stream would not."""
    b = MultiCtx(tiny)
    singles = [Ctx(tiny, n_ctx=N_CTX_SEQ) for _ in range(N_SEQ)]
    try:
        prefill_all(b, tiny)
        sfi_b = SFINative(b.ctx, n_sel_max=64, n_tail_max=64)
        sfi_1 = []
        for s, n in enumerate(PROMPTS):
            singles[s].decode(tokens_for(tiny, n, seed=10 + s))
            sfi_1.append(SFINative(singles[s].ctx, n_sel_max=64, n_tail_max=64))
            window = np.concatenate([np.arange(4), np.arange(n - 40, n)]).astype(np.int32)
            sel = np.ascontiguousarray(np.broadcast_to(window, (sfi_b.n_layers, sfi_b.n_head_kv, len(window))))
            sfi_b.set_selection(sel, seq=s)
            sfi_1[s].set_selection(sel)
            sfi_1[s].set_mode(SFINative.FAST)
        sfi_b.set_mode(SFINative.FAST)
        toks = {s: 7 for s in range(N_SEQ)}
        for _ in range(16):
            lb = b.step(toks)
            for s in range(N_SEQ):
                singles[s].decode([toks[s]])
                l1 = singles[s].logits()
                assert np.abs(lb[s] - l1).max() < 5e-3 and lb[s].argmax() == l1.argmax(), s
            toks = {s: int(np.argmax(lb[s])) for s in range(N_SEQ)}
    finally:
        b.close()
        for c in singles:
            c.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("n_candidates", [0, 64])
def test_batched_slow_step_exports_per_sequence(tiny, n_candidates, flash_attn):
    """A SLOW batch of every sequence exports, per sequence, what a single-sequence slow step exports
    (the export is one set of ops over the ubatch's streams)."""
    b = MultiCtx(tiny, flash_attn=flash_attn)
    singles = [Ctx(tiny, n_ctx=N_CTX_SEQ, flash_attn=flash_attn) for _ in range(N_SEQ)]
    try:
        prefill_all(b, tiny)
        sfi_b = SFINative(b.ctx, n_sel_max=256, n_tail_max=64)
        sfi_b.set_n_candidates(n_candidates)
        sfi_b.set_mode(SFINative.SLOW)
        b.step({s: 9 for s in range(N_SEQ)})
        for s, n in enumerate(PROMPTS):
            singles[s].decode(tokens_for(tiny, n, seed=10 + s))
            sfi_1 = SFINative(singles[s].ctx, n_sel_max=256, n_tail_max=64)
            sfi_1.set_n_candidates(n_candidates)
            sfi_1.set_mode(SFINative.SLOW)
            singles[s].decode([9])
            for get in ("mass", "evidence", "key_norms"):
                x, ref = getattr(sfi_b, get)(s), getattr(sfi_1, get)()
                if n_candidates:  # the same cells (their order may differ on ties): compare per cell
                    cx, cr = sfi_b.candidates(s), sfi_1.candidates()
                    assert np.array_equal(np.sort(cx, axis=1), np.sort(cr, axis=1)), s
                    x = np.take_along_axis(x, np.argsort(cx, axis=1)[:, None, :], axis=2)
                    ref = np.take_along_axis(ref, np.argsort(cr, axis=1)[:, None, :], axis=2)
                n_cells = min(x.shape[2], ref.shape[2])  # n_kv is padded to the largest stream
                err = np.abs(x[:, :, :n_cells] - ref[:, :, :n_cells]).max() / np.abs(ref).max()
                assert err < 1e-3, (s, get, err)  # the batch of 3 rounds differently from a batch of 1
                assert not np.any(x[:, :, n_cells:]), (s, get)
            assert sfi_b.n_query_rows(s) == 1
    finally:
        b.close()
        for c in singles:
            c.close()


@pytest.mark.parametrize("flash_attn,type_kv", [
    pytest.param(True, GGML_TYPE_F16, id="fa"), pytest.param(False, GGML_TYPE_F16, id="no_fa"),
    # blocks of 32 values: each layer gathered on its own (all the streams at once)
    pytest.param(True, GGML_TYPE_Q8_0, id="fa-q8_0")])
def test_batched_slow_step_loads_each_sequence_s_selection(tiny, flash_attn, type_kv):
    """A slow batch of every sequence with the device Selector: load_selection(seq) gives each sequence the memory
    set_selection(selection(seq), shared=its sink + recent cells) gives it (bit-identical fast steps after)."""
    from sfi_gguf.core.selector import CandidateRange, SFISelector

    n_sink, n_recent, k_head = 4, 32, 48
    a, b = (MultiCtx(tiny, flash_attn=flash_attn, type_kv=type_kv), MultiCtx(tiny, flash_attn=flash_attn, type_kv=type_kv))
    try:
        prefill_all(a, tiny)
        prefill_all(b, tiny)
        host = SFINative(a.ctx, n_sel_max=n_sink + k_head + n_recent, n_tail_max=64)
        loads = SFINative(b.ctx, n_sel_max=n_sink + k_head + n_recent, n_tail_max=64)
        for sfi in (host, loads):
            sfi.set_n_candidates(64)
            sfi.set_selector(SFISelector().device_params(k_head, n_sink, n_recent))
            sfi.set_mode(SFINative.SLOW)
        a.step({s: 9 for s in range(N_SEQ)})
        b.step({s: 9 for s in range(N_SEQ)})
        for s in range(N_SEQ):
            selected = host.selection(s)
            assert np.array_equal(selected, loads.selection(s)), s
            rng = CandidateRange.for_context(a.n_past[s], n_sink, n_recent)
            sink, recent = rng.sink_and_recent_cells(host.cell_pos(s))
            host.set_selection(selected, seq=s, shared=np.concatenate([sink, recent]))
            loads.load_selection(s)
        for sfi in (host, loads):
            sfi.set_mode(SFINative.FAST)
        for step in range(6):
            tokens = {s: 20 + step + s for s in range(N_SEQ) if (step + s) % 3}  # not every sequence every step
            la, lb = a.step(tokens), b.step(tokens)
            for s in tokens:
                assert loads.status(s) & bindings.STATUS_LAST_FAST, (step, s)
                assert np.array_equal(la[s], lb[s]), (step, s)
    finally:
        a.close()
        b.close()


def test_mixed_slow_and_fast_sequences(tiny):
    """Per step some sequences slow (one SLOW llama_decode), the others fast (one FAST llama_decode, not
    necessarily consecutive sequence ids); a slow sequence reloads all its cells ordered by mass."""
    a, b, sfi = dense_and_selected(tiny)
    try:
        toks = {s: 3 for s in range(N_SEQ)}
        for step in range(12):
            slow = {step % N_SEQ} if step % 2 else set()  # sequence 1 slow: fast ones are 0 and 2
            la = a.step(toks)
            lb = {}
            if slow:
                sfi.set_mode(SFINative.SLOW)
                lb.update(b.step({s: toks[s] for s in slow}))
            sfi.set_mode(SFINative.FAST)
            lb.update(b.step({s: toks[s] for s in toks if s not in slow}))
            for s in range(N_SEQ):
                assert np.abs(la[s] - lb[s]).max() < 5e-3 and la[s].argmax() == lb[s].argmax(), (step, s)
                assert bool(sfi.status(s) & bindings.STATUS_VIEW_VALID) == (s not in slow)
            for s in slow:
                mass = sfi.mass(s)
                assert mass is not None and sfi.mass((s + 1) % N_SEQ) is None
                cells = seq_cells(sfi, s)
                order = np.argsort(-mass[:, :, cells], axis=-1, kind="stable")
                select_all(sfi, s, order)
            toks = {s: int(np.argmax(la[s])) for s in range(N_SEQ)}
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("export", ["every_cell", "candidates", "device_selector"])
def test_one_decode_equals_its_sequences_decoded_by_kind(tiny, flash_attn, export):
    """One llama_decode whose sequences are slow, dense and fast in any mix (each in its own mode) gives
    every sequence the logits, exports and selection that the same step gives it as one decode per kind
    (slow ones together, then dense, then fast); the views keep working across such steps."""
    batched_checks.mixed_equals_by_kind(tiny, flash_attn, export)


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_staggered_refreshes(tiny, flash_attn):
    """Sequences that refresh at different steps (one slow sequence per step, in turn, with the device Selector)
    decode in one llama_decode what they decode as one decode per kind, although the mix changes at every step."""
    batched_checks.staggered_refreshes(tiny, flash_attn)


def test_many_sequences_refresh_and_export_together(tiny):
    """Every sequence gathers its selection in the same FAST ubatch, then every one is slow: the graph
    holds a gather or an export per layer and stream (it once ran out of graph nodes: 4 streams x 36
    layers on the H200; 48 streams x 2 layers here)."""
    n_seq = 48
    b = MultiCtx(tiny, n_seq=n_seq)
    try:
        for s in range(n_seq):
            b.prefill(s, tokens_for(tiny, 40 + s, seed=s))
        sfi = SFINative(b.ctx, n_sel_max=128, n_tail_max=16)
        for s in range(n_seq):
            select_all(sfi, s)
        sfi.set_mode(SFINative.FAST)
        b.step({s: 5 for s in range(n_seq)})
        assert sfi.last_fast
        sfi.set_mode(SFINative.SLOW)
        b.step({s: 6 for s in range(n_seq)})
        group = llama_cpp.llama_model_n_head(tiny.ptr) // sfi.n_head_kv
        for s in range(n_seq):
            mass = sfi.mass(s)
            n = 40 + s + 2  # the sequence's cells: its prompt and the two decoded tokens
            assert mass is not None
            # softmax rows of the group's query heads sum to 1 each, over the sequence's own cells only
            assert np.allclose(mass[:, :, :n].sum(axis=2), group, rtol=1e-3), s
            assert not np.any(mass[:, :, n:]), s
    finally:
        b.close()


def test_cache_edit_invalidates_only_that_sequence(tiny):
    b = MultiCtx(tiny)
    try:
        prefill_all(b, tiny)
        sfi = SFINative(b.ctx, n_sel_max=256, n_tail_max=64)
        for s in range(N_SEQ):
            select_all(sfi, s)
        sfi.set_mode(SFINative.FAST)
        b.step({s: 4 for s in range(N_SEQ)})
        assert llama_cpp.llama_memory_seq_rm(b.mem, 1, PROMPTS[1] - 10, -1)
        b.n_past[1] = PROMPTS[1] - 10
        valid = [bool(sfi.status(s) & bindings.STATUS_VIEW_VALID) for s in range(N_SEQ)]
        assert valid == [True, False, True]
        b.step({0: 4, 2: 4})  # the other sequences stay fast
        assert sfi.last_fast and not sfi.fell_back_dense
        b.step({0: 4, 1: 4, 2: 4})  # the sequence with an invalid view runs dense, the others fast
        fell_back = [bool(sfi.status(s) & bindings.STATUS_FELL_BACK_DENSE) for s in range(N_SEQ)]
        last_fast = [bool(sfi.status(s) & bindings.STATUS_LAST_FAST) for s in range(N_SEQ)]
        valid = [bool(sfi.status(s) & bindings.STATUS_VIEW_VALID) for s in range(N_SEQ)]
        assert fell_back == [False, True, False] and last_fast == [True, False, True] and valid == [True, False, True]
    finally:
        b.close()


def test_a_sequence_s_mode_refuses_bad_input(tiny):
    b = MultiCtx(tiny)
    try:
        sfi = SFINative(b.ctx, n_sel_max=64, n_tail_max=16)
        for mode, seq in ((7, 0), (SFINative.FAST, N_SEQ), (SFINative.FAST, -1)):
            with pytest.raises(bindings.SFIError) as e:
                sfi.set_mode(mode, seq=seq)
            assert e.value.code == bindings.ERR_BAD_ARG
        sfi.set_mode(SFINative.SLOW, seq=1)  # one sequence slow, the others as set for all (dense)
        b.step({s: 3 for s in range(N_SEQ)})
        assert [sfi.mass(s) is not None for s in range(N_SEQ)] == [False, True, False]
    finally:
        b.close()


def test_sequence_view_acts_on_its_sequence(tiny):
    """SFISequence: the per-sequence calls read and write its own sequence; the export settings it asks for
    are kept per view; a call that would read sequence 0 is refused."""
    b = MultiCtx(tiny)
    try:
        prefill_all(b, tiny)
        sfi = SFINative(b.ctx, n_sel_max=256, n_tail_max=64)
        views = [SFISequence(sfi, s) for s in range(N_SEQ)]
        sfi.set_mode(SFINative.SLOW)
        b.step({s: 4 for s in range(N_SEQ)})
        for s, view in enumerate(views):
            assert np.array_equal(view.cell_pos(), sfi.cell_pos(s))
            assert np.array_equal(view.mass(), sfi.mass(s))
            assert view.n_query_rows() == sfi.n_query_rows(s)
        views[1].set_selection(np.broadcast_to(seq_cells(sfi, 1), (sfi.n_layers, sfi.n_head_kv, PROMPTS[1] + 1)))
        valid = [bool(sfi.status(s) & bindings.STATUS_VIEW_VALID) for s in range(N_SEQ)]
        assert valid == [False, True, False]
        views[2].set_n_candidates(16)
        views[2].set_refresh_layers(2, 1)
        assert (views[2].n_candidates, views[2].refresh_layers) == (16, (2, 1))
        assert (views[0].n_candidates, views[0].refresh_layers) == (0, (1, 0))
        assert views[0].n_layers == sfi.n_layers and views[0].params == sfi.params
        with pytest.raises(AttributeError):
            views[1].view_valid  # noqa: B018  (SFINative's reads sequence 0)
    finally:
        b.close()


def test_unified_cache_with_several_sequences_is_refused(tiny):
    c = Ctx(tiny, n_seq_max=2, kv_unified=True)
    try:
        with pytest.raises(bindings.SFIError) as e:
            SFINative(c.ctx)
        assert e.value.code == bindings.ERR_UNSUPPORTED
    finally:
        c.close()
