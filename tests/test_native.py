"""Native SFI patch: compact-view FAST steps, SLOW-step export, invalidation, error handling.

Most tests use tiny random-weight GGUFs (sfi_gguf.tools.random_model) on the CPU backend; the references are
a second, dense context fed the same tokens, dense decoding after llama_memory_seq_rm, and numpy
computations from tensors observed with cb_eval. Tests marked real_model use the default model.
Set SFI_TEST_NGL=99 to run them with the layers offloaded (CUDA build).
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from sfi_gguf.core import library
from sfi_gguf.core.library import lib, llama_cpp
from sfi_gguf.core import bindings
from sfi_gguf.core.bindings import SFIError, SFINative
from sfi_gguf.tools.random_model import random_model
from native_harness import (FLASH_ATTN, GGML_TYPE_Q8_0, NGL, Capture, Ctx, Model, all_cells, ggml_tensor, nmse, run_pair,
                            tokens_for)


# -- API and errors --------------------------------------------------------------------------------

def test_version_and_default_params():
    assert lib.llama_sfi_version() == library.EXPECTED_SFI_API_VERSION
    p = bindings.default_params()
    assert p["n_sel_max"] > 0 and p["n_tail_max"] > 0 and p["n_query_rows"] == 1


def test_calls_before_init_and_after_free(tiny):
    c = Ctx(tiny)
    try:
        assert bindings._set_mode(c.ctx, 2) == bindings.ERR_NOT_INIT
        sel = np.zeros((1, 1, 1), dtype=np.int32)
        assert bindings._set_selection(c.ctx, 0, sel.ctypes.data_as(bindings._i32p), 1, 1, 1) == bindings.ERR_NOT_INIT
        assert bindings._n_layers(c.ctx) == 0
        assert bindings._seq_status(c.ctx, 0) == 0
        n = ctypes.c_int32(-1)
        assert not bindings._seq_get_mass(c.ctx, 0, None, None, ctypes.byref(n)) and n.value == 0
        sfi = SFINative(c.ctx)
        assert sfi.n_layers == 2 and sfi.n_head_kv == 4
        sfi.free()
        with pytest.raises(SFIError) as e:
            sfi.set_mode(sfi.FAST)
        assert e.value.code == bindings.ERR_NOT_INIT
        sfi.free()  # twice is fine
        c.decode(tokens_for(tiny, 8))  # and decoding still works
    finally:
        c.close()


def test_init_refusals(tiny):
    c = Ctx(tiny, n_seq_max=2, kv_unified=True)  # several sequences need one stream each
    try:
        with pytest.raises(SFIError) as e:
            SFINative(c.ctx)
        assert e.value.code == bindings.ERR_UNSUPPORTED
    finally:
        c.close()
    c = Ctx(tiny)
    try:
        for bad in (dict(n_sel_max=0), dict(n_tail_max=0), dict(n_query_rows=0), dict(evidence_alpha=-1.0)):
            with pytest.raises(SFIError) as e:
                SFINative(c.ctx, **bad)
            assert e.value.code == bindings.ERR_BAD_ARG
        assert bindings._init(c.ctx, None) == bindings.ERR_BAD_ARG
        sfi = SFINative(c.ctx)
        with pytest.raises(SFIError) as e:
            sfi.set_mode(7)
        assert e.value.code == bindings.ERR_BAD_ARG
    finally:
        c.close()


def test_bad_selections(tiny):
    c = Ctx(tiny, n_ctx=512)
    try:
        c.decode(tokens_for(tiny, 40))
        sfi = SFINative(c.ctx, n_sel_max=32, n_tail_max=8)
        L, H = sfi.n_layers, sfi.n_head_kv
        good = np.tile(np.arange(16, dtype=np.int32), (L, H, 1))

        def code(sel, seq=0):
            with pytest.raises(SFIError) as e:
                sfi.set_selection(sel, seq=seq)
            return e.value.code

        bad = good.copy(); bad[1, 2, 3] = -1
        assert code(bad) == bindings.ERR_RANGE
        bad = good.copy(); bad[0, 0, 0] = 512          # == kv_size
        assert code(bad) == bindings.ERR_RANGE
        bad = good.copy(); bad[0, 3, 5] = 100          # empty cell
        assert code(bad) == bindings.ERR_RANGE
        bad = good.copy(); bad[1, 1, 7] = bad[1, 1, 2]  # duplicate in one (layer, head)
        assert code(bad) == bindings.ERR_DUPLICATE
        assert code(np.tile(np.arange(33, dtype=np.int32), (L, H, 1))) == bindings.ERR_COUNT  # > n_sel_max
        assert code(good[:1]) == bindings.ERR_COUNT       # wrong n_layers
        assert code(good[:, :2]) == bindings.ERR_COUNT    # wrong n_head_kv
        assert code(good[:, :, :0]) == bindings.ERR_COUNT  # empty
        assert code(good, seq=1) == bindings.ERR_BAD_ARG
        assert code(good, seq=-1) == bindings.ERR_BAD_ARG
        assert bindings._set_selection(c.ctx, 0, None, L, H, 16) == bindings.ERR_BAD_ARG
        assert not sfi.view_valid
        # the same cell in two heads or two layers is fine
        sfi.set_selection(good)
        assert sfi.view_valid
        # a failing call leaves the loaded selection alone
        assert code(bad) == bindings.ERR_DUPLICATE and sfi.view_valid
        assert sfi.cell_pos()[:41].tolist() == list(range(40)) + [-1]
        with pytest.raises(SFIError):
            sfi.cell_pos(seq=3)
    finally:
        c.close()


def test_large_selection_errors_name_the_first_bad_row_and_the_overlap_is_exact():
    """A selection of 36 layers x 8 heads x 512 cells: the error returned is the first bad row's (whatever
    comes later), a failed load keeps the previous selection, and the overlap with the previous one is exact."""
    m = Model(random_model("tiny-llama", n_layer=36, n_head=8, n_head_kv=8, head_dim=16, n_embd=128, n_ff=128))
    c = Ctx(m, n_ctx=1024, n_batch=1024)
    try:
        c.decode(tokens_for(m, 700))
        sfi = SFINative(c.ctx, n_sel_max=600, n_tail_max=8)
        L, H, n = sfi.n_layers, sfi.n_head_kv, 512
        rng = np.random.default_rng(3)
        first = np.stack([rng.permutation(690)[:n] for _ in range(L * H)]).reshape(L, H, n).astype(np.int32)
        second = np.stack([rng.permutation(690)[:n] for _ in range(L * H)]).reshape(L, H, n).astype(np.int32)
        shared = np.arange(690, 700, dtype=np.int32)
        sfi.set_selection(first, shared=shared)
        sfi.set_selection(second, shared=shared)
        hits = sum(len(np.intersect1d(first[i, h], second[i, h])) for i in range(L) for h in range(H))
        assert sfi.selection_overlap() == pytest.approx(hits / (L * H * n), rel=1e-6)

        def code(sel):
            with pytest.raises(SFIError) as e:
                sfi.set_selection(sel, shared=shared)
            return e.value.code

        def bad(**rows):  # row r = layer * H + head
            sel = second.copy()
            for kind, r in rows.items():
                i, h = divmod(r, H)
                if kind.startswith("dup"):
                    sel[i, h, 9] = sel[i, h, 4]
                else:
                    sel[i, h, 9] = 700  # an empty cell
            return sel

        assert code(bad(dup=1)) == bindings.ERR_DUPLICATE
        assert code(bad(rng=3, dup=6)) == bindings.ERR_RANGE
        assert code(bad(dup=4, rng=7)) == bindings.ERR_DUPLICATE
        assert code(bad(rng=L * H - 1)) == bindings.ERR_RANGE
        assert sfi.view_valid and sfi.selection_overlap() == pytest.approx(hits / (L * H * n), rel=1e-6)
    finally:
        c.close()
        m.close()


# -- FAST steps ------------------------------------------------------------------------------------


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen2", "tiny_qwen3"])
def test_all_cells_in_order_is_bit_identical(fixture, flash_attn, request):
    model = request.getfixturevalue(fixture)
    out = run_pair(model, 200, 40, lambda sfi, n: all_cells(sfi, n), flash_attn=flash_attn)
    for la, lb in out:
        assert np.array_equal(la, lb)


def test_all_cells_permuted_256_steps(tiny):
    """Cells in another order per head: same argmax over 256 steps, logits within tolerance.

    Flash attention rounds its running V*p sums through F16 (an F32 cache is cast to F16 before it),
    so a different cell order alone moves the logits of this random model (|logit| up to ~20) by up to
    ~2e-3 on the CPU (swapping only cells 0 and 1 moves them by ~2e-4) and 3.1e-3 on the H200; the
    argmax is the same at every step. Hence 5e-3, not the 1e-3 of an order-preserving kernel.
    """
    tol = 5e-3
    rng = np.random.default_rng(1)
    out = run_pair(tiny, 300, 256, lambda sfi, n: all_cells(sfi, n, rng), n_tail_max=256)
    d = max(float(np.abs(la - lb).max()) for la, lb in out)
    assert d < tol, d
    for la, lb in out:  # the same argmax, unless dense's top two are closer than the tolerance
        top2 = np.sort(la)[-2:]
        assert la.argmax() == lb.argmax() or top2[1] - top2[0] < 2 * tol


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("sink", [0, 4])
def test_window_matches_seq_rm(tiny, sink, flash_attn):
    P, W, steps = 300, 96, 24
    a = Ctx(tiny, flash_attn=flash_attn)
    b = Ctx(tiny, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P, seed=2)
        a.decode(toks)
        b.decode(toks)
        a.seq_rm(sink, P - W)   # reference: dense attention over sink + the last W cells
        sfi = SFINative(b.ctx, n_sel_max=128, n_tail_max=64)
        keep = np.r_[np.arange(sink), np.arange(P - W, P)].astype(np.int32)
        sfi.set_selection(np.tile(keep, (sfi.n_layers, sfi.n_head_kv, 1)))
        sfi.set_mode(sfi.FAST)
        tok = 5
        for _ in range(steps):
            a.decode([tok])
            b.decode([tok])
            assert sfi.last_fast
            la, lb = a.logits(), b.logits()
            assert nmse(lb, la) < 1e-4
            tok = int(np.argmax(la))
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(NGL > 0, reason="reads tensors on the host through cb_eval")
@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_per_head_selection_matches_numpy(tiny, flash_attn):
    """Different cells per KV head: the attention output of each layer equals numpy attention over those cells."""
    P, n_sel, steps = 160, 48, 3
    cap = Capture(["Qcur-", "Kcur-", "Vcur-", "kqv_out-"])
    c = Ctx(tiny, capture=cap, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P, seed=3)
        c.decode(toks)
        sfi = SFINative(c.ctx, n_sel_max=64, n_tail_max=8)
        L, H = sfi.n_layers, sfi.n_head_kv
        K = {i: cap.last(f"Kcur-{i}")[0] for i in range(L)}  # [T, HKV, D] (numpy order)
        V = {i: cap.last(f"Vcur-{i}")[0] for i in range(L)}
        rng = np.random.default_rng(4)
        sel = np.stack([np.stack([rng.choice(P, n_sel, replace=False) for _ in range(H)]) for _ in range(L)])
        sfi.set_selection(sel.astype(np.int32))
        sfi.set_mode(sfi.FAST)
        n_head = cap.last("Qcur-0")[0].shape[1]
        G = n_head // H
        tail = {i: ([], []) for i in range(L)}
        for step in range(steps):
            cap.clear()
            c.decode([7 + step])
            assert sfi.last_fast
            for i in range(L):
                q = cap.last(f"Qcur-{i}")[0][0]            # [n_head, D]
                tail[i][0].append(cap.last(f"Kcur-{i}")[0][0])
                tail[i][1].append(cap.last(f"Vcur-{i}")[0][0])
                got = cap.last(f"kqv_out-{i}")[0][0]       # [n_head*D]
                D = q.shape[1]
                ref, dense = [], []
                for h in range(n_head):
                    hk = h // G
                    kk = np.concatenate([K[i][sel[i, hk], hk], np.stack(tail[i][0])[:, hk]])
                    vv = np.concatenate([V[i][sel[i, hk], hk], np.stack(tail[i][1])[:, hk]])
                    kk = kk.astype(np.float16).astype(np.float32)
                    vv = vv.astype(np.float16).astype(np.float32)
                    s = kk @ q[h] / np.sqrt(D)
                    p = np.exp(s - s.max()); p /= p.sum()
                    ref.append(p @ vv)
                    kd = np.concatenate([K[i][:, hk], np.stack(tail[i][0])[:, hk]]).astype(np.float16).astype(np.float32)
                    vd = np.concatenate([V[i][:, hk], np.stack(tail[i][1])[:, hk]]).astype(np.float16).astype(np.float32)
                    s = kd @ q[h] / np.sqrt(D)
                    p = np.exp(s - s.max()); p /= p.sum()
                    dense.append(p @ vd)
                ref = np.concatenate(ref)
                assert nmse(got, ref) < 1e-5, (i, nmse(got, ref))
                assert nmse(got, np.concatenate(dense)) > 1e-3  # the selection really changed attention
    finally:
        c.close()


def test_tail_full_and_invalidation(tiny):
    P = 120
    a = Ctx(tiny)
    b = Ctx(tiny)
    try:
        toks = tokens_for(tiny, P, seed=5)
        a.decode(toks)
        b.decode(toks)
        sfi = SFINative(b.ctx, n_sel_max=256, n_tail_max=4)
        sfi.set_mode(sfi.FAST)

        holes = False  # after seq_rm + seq_add, new tokens fill holes: the dense cell order differs

        def step(tok, expect_fast):
            a.decode([tok])
            b.decode([tok])
            st = sfi.status()
            assert bool(st & bindings.STATUS_LAST_FAST) == expect_fast, st
            assert bool(st & bindings.STATUS_FELL_BACK_DENSE) == (not expect_fast), st
            la, lb = a.logits(), b.logits()
            if holes:
                assert np.abs(la - lb).max() < 5e-3 and la.argmax() == lb.argmax()
            else:
                assert np.array_equal(la, lb)

        step(9, False)  # no selection yet

        def sel(_n):  # every occupied cell (cell ids differ from positions after seq_rm + seq_add)
            cells = np.flatnonzero(sfi.cell_pos() >= 0).astype(np.int32)
            return np.tile(cells, (sfi.n_layers, sfi.n_head_kv, 1))

        sfi.set_selection(sel(b.n_past))
        for t in range(4):
            step(10 + t, True)
        step(20, False)  # tail full (n_tail_max = 4)
        assert not sfi.view_valid

        for change in ("seq_rm", "clear", "seq_add", "dense", "slow"):
            sfi.set_selection(sel(b.n_past))
            step(30, True)
            assert sfi.view_valid
            if change == "seq_rm":
                a.seq_rm(a.n_past - 1, -1); b.seq_rm(b.n_past - 1, -1)
                a.n_past -= 1; b.n_past -= 1
            elif change == "clear":
                for x in (a, b):
                    llama_cpp.llama_memory_clear(x.mem, True)
                    x.n_past = 0
                    x.decode(toks[:60])
            elif change == "seq_add":
                for x in (a, b):  # drop 10 cells, shift the rest back (K-shift)
                    x.seq_rm(4, 14)
                    llama_cpp.llama_memory_seq_add(x.mem, 0, 14, -1, -10)
                    x.n_past -= 10
                holes = True
            elif change == "dense":
                sfi.set_mode(sfi.DENSE)
                a.decode([31]); b.decode([31])
                sfi.set_mode(sfi.FAST)
            elif change == "slow":
                sfi.set_mode(sfi.SLOW)
                a.decode([32]); b.decode([32])
                assert np.abs(a.logits() - b.logits()).max() < 5e-3 and sfi.mass_valid
                sfi.set_mode(sfi.FAST)
            assert not sfi.view_valid, change
            try:
                step(40, False)
            except AssertionError as e:
                raise AssertionError(f"after {change}: {e}") from None
    finally:
        a.close()
        b.close()


def test_multi_token_fast_decode(tiny):
    """A FAST batch of several tokens is causal inside the tail."""
    P = 100
    a = Ctx(tiny)
    b = Ctx(tiny)
    try:
        toks = tokens_for(tiny, P + 6, seed=6)
        a.decode(toks[:P]); b.decode(toks[:P])
        sfi = SFINative(b.ctx, n_sel_max=128, n_tail_max=16)
        sfi.set_selection(all_cells(sfi, P))
        sfi.set_mode(sfi.FAST)
        a.decode(toks[P:], all_logits=True)
        b.decode(toks[P:], all_logits=True)
        assert sfi.last_fast
        for i in range(6):
            assert np.array_equal(a.logits(i), b.logits(i))
    finally:
        a.close()
        b.close()


# -- SLOW steps ------------------------------------------------------------------------------------

@pytest.mark.skipif(NGL > 0, reason="reads tensors on the host through cb_eval")
@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
@pytest.mark.parametrize("rows, extra", [(1, 0), (4, 0), (4, 3)])
def test_mass_matches_softmax(tiny, rows, extra, flash_attn):
    """`extra`: the slow ubatch holds more tokens than the query rows (as a bootstrap chunk does)."""
    P = 150
    cap = Capture(["kq_soft_max-", "Kcur-"])
    ref = Ctx(tiny, flash_attn=False, capture=cap)
    c = Ctx(tiny, flash_attn=flash_attn)
    d = Ctx(tiny, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P + extra + rows, seed=7)
        for x in (ref, c, d):
            x.decode(toks[:P])
        keys = {i: [cap.last(f"Kcur-{i}")[0]] for i in range(2)}
        sfi = SFINative(c.ctx, n_query_rows=rows, evidence_alpha=0.5)
        sfi.set_mode(sfi.SLOW)
        cap.clear()
        for x in (ref, c, d):
            x.decode(toks[P:])
        assert sfi.mass_valid and sfi.n_query_rows() == rows
        assert np.array_equal(c.logits(), d.logits())  # a slow step is an exact dense step
        mass, evid, norms = sfi.mass(), sfi.evidence(), sfi.key_norms()
        L, H, n_cells = mass.shape
        assert evid.shape == mass.shape == norms.shape
        for i in range(L):
            p = cap.last(f"kq_soft_max-{i}")[0]     # [n_head, T, n_kv]
            n_head = p.shape[0]
            G = n_head // H
            p = p[:, -rows:, :]
            assert p.shape[-1] == n_cells
            want = p.reshape(H, G * rows, n_cells).sum(1)
            # the export multiplies F16 K by F16-rounded q, like the reference's mul_mat; the reference
            # context runs attention without FA, so layers > 0 see slightly different hidden states
            np.testing.assert_allclose(mass[i], want, rtol=3e-3, atol=2e-4)
            np.testing.assert_allclose(mass[i].sum(-1), rows * G, rtol=1e-4)
            np.testing.assert_allclose(evid[i], np.sqrt(p).reshape(H, G * rows, n_cells).sum(1), rtol=3e-3, atol=2e-3)
            assert np.all(mass[i][:, P + extra + rows:] == 0)  # unused cells get exactly 0
            k = np.concatenate(keys[i] + [cap.last(f"Kcur-{i}")[0]])  # [P+extra+rows, HKV, D]
            kn = np.linalg.norm(k.astype(np.float16).astype(np.float32), axis=-1).T
            np.testing.assert_allclose(norms[i][:, :P + extra + rows], kn, rtol=1e-3, atol=1e-4)
        # after a following non-slow decode the export is gone
        sfi.set_mode(sfi.DENSE)
        c.decode([3])
        assert sfi.mass() is None and not sfi.mass_valid
    finally:
        for x in (ref, c, d):
            x.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_query_rows_set_between_slow_steps(tiny, flash_attn):
    """llama_sfi_set_n_query_rows: the next slow ubatch, of the same shape as the last, exports that many rows (its
    graph is not the last one's), the same mass as a context started with that many."""
    P = 150
    c, d = Ctx(tiny, flash_attn=flash_attn), Ctx(tiny, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P + 8, seed=7)
        for x in (c, d):
            x.decode(toks[:P])
        sfi, one_row = SFINative(c.ctx, n_query_rows=4), SFINative(d.ctx, n_query_rows=1)
        for s in (sfi, one_row):
            s.set_mode(s.SLOW)
        c.decode(toks[P:P + 4])
        G = llama_cpp.llama_model_n_head(tiny.ptr) // sfi.n_head_kv
        assert sfi.n_query_rows() == 4 and np.allclose(sfi.mass().sum(-1), 4 * G, rtol=1e-4)
        sfi.set_n_query_rows(1)
        c.decode(toks[P + 4:])
        d.decode(toks[P:P + 4])
        d.decode(toks[P + 4:])
        assert sfi.n_query_rows() == 1 and np.allclose(sfi.mass().sum(-1), G, rtol=1e-4)
        np.testing.assert_allclose(sfi.mass(), one_row.mass(), rtol=1e-5, atol=1e-7)
        with pytest.raises(SFIError):
            sfi.set_n_query_rows(0)
    finally:
        for x in (c, d):
            x.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_candidate_export_matches_full_export(tiny, flash_attn):
    """With candidates, a slow step exports the n cells of most head-summed evidence, with the values a
    full export has at those cells (chosen and gathered on the device)."""
    P, n = 200, 48
    c = Ctx(tiny, flash_attn=flash_attn)
    d = Ctx(tiny, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P + 1, seed=11)
        c.decode(toks[:P])
        d.decode(toks[:P])
        full, cand = SFINative(c.ctx), SFINative(d.ctx)
        cand.set_n_candidates(n)
        for sfi in (full, cand):
            sfi.set_mode(sfi.SLOW)
        c.decode(toks[P:])
        d.decode(toks[P:])
        assert np.array_equal(c.logits(), d.logits())  # still an exact dense step
        assert full.candidates() is None
        cells = cand.candidates()
        L, H, _ = full.mass().shape
        assert cells.shape == (L, n) and cand.mass().shape == (L, H, n) == cand.key_norms().shape
        score = full.evidence().sum(1)  # [L, n_cells]
        for i in range(L):
            assert len(set(cells[i].tolist())) == n and np.all(full.cell_pos()[cells[i]] >= 0)
            best = np.sort(score[i])[::-1][:n]  # the n best scores (ties may pick other cells)
            np.testing.assert_allclose(np.sort(score[i][cells[i]])[::-1], best, rtol=1e-5)
            for name in ("mass", "evidence", "key_norms"):
                np.testing.assert_allclose(getattr(cand, name)()[i], getattr(full, name)()[i][:, cells[i]],
                                           rtol=1e-5, atol=1e-7)
        # more candidates than cells: every (padded) cell; 0: back to the full export
        cand.set_n_candidates(10**6)
        d.decode([5])
        assert cand.candidates().shape[1] == cand.mass().shape[2] == full.mass().shape[2]
        cand.set_n_candidates(0)
        d.decode([6])
        assert cand.candidates() is None and cand.mass().shape[2] == full.mass().shape[2]
        with pytest.raises(SFIError):
            cand.set_n_candidates(-1)
    finally:
        c.close()
        d.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_candidate_key_norms_follow_the_cache(tiny, flash_attn):
    """The key norms a slow step reads at its candidates are kept per cell and taken only for the cells written
    since: after more tokens (cells below the last slow step's padded range, and past it) and after an edit that
    rewrites cells, they still equal the norms of a full export of the same cache by a view just initialized
    (which takes every cell's)."""
    P = 200
    c = Ctx(tiny, flash_attn=flash_attn)
    d = Ctx(tiny, flash_attn=flash_attn)
    try:
        full, cand = SFINative(c.ctx), SFINative(d.ctx)
        cand.set_n_candidates(10**6)  # every cell a candidate: every norm is compared

        def both(tokens, pos0=None, mode=SFINative.DENSE):
            if mode == SFINative.SLOW:
                full.init()  # no key norm kept from before
            for x, sfi in ((c, full), (d, cand)):
                sfi.set_mode(mode)
                x.decode(tokens, pos0)

        def check():
            cells = cand.candidates()
            assert cells is not None and full.candidates() is None
            live = full.cell_pos() >= 0
            for i in range(cells.shape[0]):
                keep = live[cells[i]]
                assert keep.sum() == live.sum()
                np.testing.assert_allclose(cand.key_norms()[i][:, keep], full.key_norms()[i][:, cells[i][keep]],
                                           rtol=1e-5, atol=1e-6)

        toks = tokens_for(tiny, P + 200, seed=12)
        both(toks[:P])
        both(toks[P:P + 1], mode=SFINative.SLOW)  # the first slow step takes every cell's norms
        check()
        both(toks[P + 1:P + 41])                  # cells below the padded range it took, and past it
        both(toks[P + 41:P + 42], mode=SFINative.SLOW)
        check()
        both(toks[P + 42:P + 43], mode=SFINative.SLOW)  # nothing new but its own cell
        check()
        c.seq_rm(150, -1)
        d.seq_rm(150, -1)
        both(toks[P + 50:P + 110], pos0=150)      # an edit: cells rewritten with other keys
        both(toks[P + 110:P + 111], pos0=210, mode=SFINative.SLOW)
        check()
    finally:
        c.close()
        d.close()


class NodeSizes:
    """cb_eval callback that records ne[0] of every node whose name starts with `prefix` (any type, no data)."""

    def __init__(self, prefix):
        self.prefix = prefix.encode()
        self.seen: list[int] = []

        def cb(t_ptr, ask, _user):
            t = ctypes.cast(t_ptr, ctypes.POINTER(ggml_tensor)).contents
            if not t.name.startswith(self.prefix):
                return not ask
            if not ask:
                self.seen.append(int(t.ne[0]))
            return True

        self.fn = llama_cpp.ggml_backend_sched_eval_callback(cb)


def test_removing_cells_keeps_the_other_cells_key_norms(tiny):
    """After cells are removed and rewritten (llama_memory_seq_rm, as a prompt-prefix reuse does), a slow step takes
    the key norms of the rewritten and new cells only, not of the whole cache again; a shift still
    takes them all. Seen in the size of the slow step's list of cells to update (padded to 256)."""
    sizes = NodeSizes("sfi_inp_kn_cells")
    c = Ctx(tiny, capture=sizes)
    try:
        sfi = SFINative(c.ctx)
        sfi.set_n_candidates(64)
        toks = tokens_for(tiny, 700, seed=13)

        def slow(tokens, pos0=None):
            sizes.seen.clear()
            sfi.set_mode(sfi.SLOW)
            c.decode(tokens, pos0)
            sfi.set_mode(sfi.DENSE)
            return max(sizes.seen)

        for i in range(0, 600, 200):
            c.decode(toks[i:i + 200])
        assert slow(toks[600:601]) >= 600     # the first slow step takes every cell's norm
        c.decode(toks[601:620])
        c.seq_rm(610, -1)
        c.decode(toks[640:650], pos0=610)     # cells rewritten with other keys
        assert slow(toks[650:651], pos0=620) == 256
        llama_cpp.llama_memory_seq_add(c.mem, 0, 0, -1, 1)  # a shift (RoPE of every key redone): all of them again
        c.n_past += 1
        assert slow(toks[651:652]) >= 600
    finally:
        c.close()


@pytest.mark.parametrize("keep_graphs", [True, False], ids=["fast-graphs", "context-graphs"])
@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_slow_then_fast_cycle(tiny, flash_attn, keep_graphs):
    """The intended cycle: slow step, select from its mass, fast steps; exact when everything is selected, with the
    fast steps on graphs of their own or on the context's."""
    P = 130
    a = Ctx(tiny, flash_attn=flash_attn)
    b = Ctx(tiny, flash_attn=flash_attn)
    try:
        toks = tokens_for(tiny, P, seed=8)
        a.decode(toks); b.decode(toks)
        sfi = SFINative(b.ctx, n_sel_max=512, n_tail_max=32, n_query_rows=1, keep_graphs=keep_graphs)
        tok = 11
        for cycle in range(3):
            sfi.set_mode(sfi.SLOW)
            a.decode([tok]); b.decode([tok])
            la, lb = a.logits(), b.logits()
            if cycle == 0:
                assert np.array_equal(la, lb)
            else:  # the cache holds tokens of fast steps over reordered cells
                assert np.abs(la - lb).max() < 5e-3 and la.argmax() == lb.argmax()
            mass = sfi.mass()
            pos = sfi.cell_pos()
            valid = np.flatnonzero(pos >= 0)
            assert mass.shape[2] >= len(valid)
            assert np.all(mass[:, :, pos[:mass.shape[2]] < 0] == 0)
            # order cells by mass, per head: all of them, so the result stays exact
            order = np.argsort(-mass[:, :, valid], axis=-1, kind="stable")
            sfi.set_selection(valid[order].astype(np.int32))
            sfi.set_mode(sfi.FAST)
            for _ in range(8):
                tok = int(np.argmax(a.logits()))
                a.decode([tok]); b.decode([tok])
                assert sfi.last_fast
                la, lb = a.logits(), b.logits()
                assert np.abs(la - lb).max() < 5e-3 and la.argmax() == lb.argmax()  # F16 V, cells reordered
            tok = int(np.argmax(a.logits()))
    finally:
        a.close()
        b.close()


# -- other models and cache types -----------------------------------------------------------------

def test_gemma3_iswa_global_layers(tiny_gemma3):
    c = Ctx(tiny_gemma3)
    try:
        sfi = SFINative(c.ctx)
        assert [l.il for l in sfi.layers] == [5]  # pattern 6: only the last layer is global
    finally:
        c.close()
    out = run_pair(tiny_gemma3, 200, 30, lambda sfi, n: all_cells(sfi, n))
    for la, lb in out:
        assert np.array_equal(la, lb)
    # slow export on the global layer
    c = Ctx(tiny_gemma3)
    try:
        c.decode(tokens_for(tiny_gemma3, 90))
        sfi = SFINative(c.ctx, n_query_rows=2)
        sfi.set_mode(sfi.SLOW)
        c.decode([5, 6])
        m = sfi.mass()
        assert m.shape[:2] == (1, 2)
        np.testing.assert_allclose(m.sum(-1), 2 * 2, rtol=1e-4)
    finally:
        c.close()


@pytest.mark.parametrize("fixture", ["tiny", "tiny_qwen3"])  # head_dim 32: plain; 64: Hadamard-rotated
def test_q8_0_cache(fixture, request):
    model = request.getfixturevalue(fixture)
    out = run_pair(model, 200, 30, lambda sfi, n: all_cells(sfi, n), type_kv=GGML_TYPE_Q8_0)
    for la, lb in out:
        assert np.array_equal(la, lb)
    rng = np.random.default_rng(9)
    out = run_pair(model, 200, 30, lambda sfi, n: all_cells(sfi, n, rng), type_kv=GGML_TYPE_Q8_0)
    for la, lb in out:
        assert np.abs(la - lb).max() < 1e-3 and la.argmax() == lb.argmax()


# -- the real default model ------------------------------------------------------------------------

@pytest.mark.real_model
@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_real_model_all_cells_equals_dense(real, flash_attn):
    out = run_pair(real, 160, 32, lambda sfi, n: all_cells(sfi, n), flash_attn=flash_attn)
    for la, lb in out:
        assert np.array_equal(la, lb)


@pytest.mark.real_model
def test_real_model_q8_0_and_slow(real):
    out = run_pair(real, 160, 16, lambda sfi, n: all_cells(sfi, n), type_kv=GGML_TYPE_Q8_0)
    for la, lb in out:
        assert np.array_equal(la, lb)
    c = Ctx(real)
    try:
        c.decode(tokens_for(real, 100))
        sfi = SFINative(c.ctx, n_query_rows=4)
        assert sfi.n_layers == 24 and sfi.n_head_kv == 2
        sfi.set_mode(sfi.SLOW)
        c.decode([100, 200, 300, 400])
        m = sfi.mass()
        np.testing.assert_allclose(m.sum(-1), 4 * 7, rtol=1e-4)
        assert np.all(sfi.key_norms()[:, :, :104] > 0)
    finally:
        c.close()


@pytest.mark.real_model
def test_real_gemma3_global_layers_all_cells_equal_dense():
    from sfi_gguf import ensure_model

    m = Model(ensure_model("gemma3-270m"))
    try:
        out = run_pair(m, 160, 16, lambda sfi, n: all_cells(sfi, n))
        for la, lb in out:
            assert np.array_equal(la, lb)
    finally:
        m.close()
