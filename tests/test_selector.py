"""The Selector: each stage against its formula written out with loops, then the whole pipeline."""
import math

import numpy as np
import pytest

from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.selector import (
    SELECTORS, AttentionExport, CandidateRange, SFISelector, TopKMassSelector, Workspace, assemble_memory,
    cross_head_exclusivity, local_pool, make_selector, mix_evidence_and_prior, power_mean_evidence, refresh_overlap,
    selector_names, sliding_max, soft_nms, structural_prior, top_k_per_row,
)

BETA = -math.log(0.6) / 0.9


def softmax_rows(logits):
    p = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return p / p.sum(axis=-1, keepdims=True)


def make_export(rng, n_layers=2, n_heads=4, n_cells=80, n_rows=3, alpha=0.5, positions=None):
    """Attention of n_rows query rows per (layer, head), reduced the way the native side exports it."""
    p = softmax_rows(rng.normal(0, 2.5, size=(n_layers, n_heads, n_rows, n_cells)))
    return AttentionExport(mass=p.sum(axis=2).astype(np.float32),
                           evidence=(p ** alpha).sum(axis=2).astype(np.float32),
                           key_norms=rng.uniform(0.5, 3.0, size=(n_layers, n_heads, n_cells)).astype(np.float32),
                           n_rows=n_rows, alpha=alpha, positions=positions), p


# -- direct formulas, one cell at a time ------------------------------------------------------------
def direct_evidence(p_rows, alpha):
    """f(k) ~ [(1/R) sum_r p_r(k)^alpha]^(1/alpha), normalised; p_rows [R, C]."""
    n_rows, n = p_rows.shape
    f = np.zeros(n)
    for k in range(n):
        f[k] = (sum(p_rows[r, k] ** alpha for r in range(n_rows)) / n_rows) ** (1 / alpha)
    return f / f.sum()


def direct_prior(norms, gamma, w_l2, w_pos, beta, power, eta):
    n = len(norms)
    r = np.zeros(n)
    for k in range(n):
        u = k / n
        pi = norms[k] ** (-gamma)
        delta = math.exp(-beta * u ** power + eta * math.log(1 - u))
        r[k] = pi ** w_l2 * delta ** w_pos
    return r / r.sum()


def direct_mix(f, r, lambda_max):
    lam = sum(f[k] * (f[k] - r[k]) for k in range(len(f))) / sum((f[k] - r[k]) ** 2 for k in range(len(f)))
    lam = min(max(lam, 0.0), lambda_max)
    return np.array([(1 - lam) * f[k] + lam * r[k] for k in range(len(f))]), lam


def direct_nms(s, window, strength):
    n = len(s)
    out = np.zeros(n)
    for k in range(n):
        peak = max(s[j] for j in range(n) if abs(j - k) <= window / 2)
        out[k] = s[k] - strength * max(0.0, peak - s[k])
    return out


def direct_cross_head(s_heads, alpha, temperature):
    n_heads, n = s_heads.shape
    out = np.zeros_like(s_heads)
    for k in range(n):
        z = sum(math.exp(s_heads[g, k] / temperature) for g in range(n_heads))
        for h in range(n_heads):
            rho = math.exp(s_heads[h, k] / temperature) / z
            out[h, k] = s_heads[h, k] + alpha * math.log(rho)
    return out


def direct_scores(p_rows, norms):
    """The whole SFI score of one head with the default parameters, before cross-head exclusivity."""
    f = direct_evidence(p_rows, 0.5)
    r = direct_prior(norms, gamma=0.5, w_l2=1.0, w_pos=0.7, beta=BETA, power=1.8, eta=0.4)
    q, _ = direct_mix(f, r, 0.35 if p_rows.shape[0] == 1 else 0.25)
    return direct_nms(np.log(q), 32, 1.0)


# -- stage by stage ------------------------------------------------------------------------------------
@pytest.mark.parametrize("alpha", [0.5, 1.0, 0.3])
def test_power_mean_evidence_matches_formula(alpha):
    rng = np.random.default_rng(1)
    p = softmax_rows(rng.normal(0, 3, size=(3, 5, 40)))  # [rows, heads, cells]
    evidence = (p ** alpha).sum(axis=0)  # what the native side exports, per head
    f = power_mean_evidence(evidence, n_rows=3, alpha=alpha)
    assert f.dtype == np.float32 and f.shape == (5, 40)
    for h in range(5):
        np.testing.assert_allclose(f[h], direct_evidence(p[:, h], alpha), rtol=2e-5, atol=1e-9)


def test_power_mean_evidence_without_evidence_is_uniform_and_tiny_evidence_is_kept():
    evidence = np.zeros((2, 10), dtype=np.float32)
    evidence[1, 3] = 1e-30  # far below float32's square range if not rescaled first
    evidence[1, 4] = 2e-30
    f = power_mean_evidence(evidence, n_rows=1, alpha=0.5)
    np.testing.assert_allclose(f[0], 0.1)
    np.testing.assert_allclose(f[1, [3, 4]], [0.2, 0.8], rtol=1e-5)
    assert f[1].sum() == pytest.approx(1.0)


@pytest.mark.parametrize("gamma,w_l2,w_pos", [(0.5, 1.0, 0.7), (0.3, 1.0, 0.7), (1.0, 1.0, 1.0), (0.5, 0.0, 0.7)])
def test_structural_prior_matches_formula(gamma, w_l2, w_pos):
    rng = np.random.default_rng(2)
    norms = rng.uniform(0.2, 5.0, size=(3, 50))
    r = structural_prior(norms, gamma=gamma, w_l2=w_l2, w_pos=w_pos, pos_beta=BETA, pos_power=1.8, pos_eta=0.4)
    for h in range(3):
        np.testing.assert_allclose(r[h], direct_prior(norms[h], gamma, w_l2, w_pos, BETA, 1.8, 0.4), rtol=2e-5)


def test_structural_prior_favours_small_norms_and_early_positions():
    flat = structural_prior(np.ones((1, 100)))
    assert np.all(np.diff(flat[0]) < 0)  # decays towards the recent window
    norms = np.ones((1, 100))
    norms[0, 50] = 0.25
    assert structural_prior(norms)[0, 50] == pytest.approx(2 * flat[0, 50] / (1 + flat[0, 50]), rel=1e-4)


@pytest.mark.parametrize("lambda_max", [0.35, 0.25, 1.0])
def test_mix_matches_closed_form_and_clips(lambda_max):
    rng = np.random.default_rng(3)
    f = softmax_rows(rng.normal(0, 2, size=(6, 30)))
    r = softmax_rows(rng.normal(0, 0.5, size=(6, 30)))
    r[0] = f[0] * 0.5 + 0.5 / 30  # between f and uniform: the raw lambda* is 2, clipped to lambda_max
    r[1] = f[1] ** 2 / np.sum(f[1] ** 2)  # a prior sharper than f: raw lambda* is negative -> 0
    q, lam = mix_evidence_and_prior(f, r, lambda_max)
    for h in range(6):
        want_q, want_lam = direct_mix(f[h], r[h], lambda_max)
        assert lam[h] == pytest.approx(want_lam, rel=1e-4, abs=1e-7)
        np.testing.assert_allclose(q[h], want_q, rtol=1e-4, atol=1e-8)
    assert lam[0] == pytest.approx(lambda_max)
    assert lam[1] == 0
    np.testing.assert_allclose(q.sum(axis=-1), 1, rtol=1e-5)


def test_mix_with_identical_distributions_keeps_the_evidence():
    f = np.full((1, 8), 1 / 8, dtype=np.float32)
    q, lam = mix_evidence_and_prior(f, f.copy(), 0.35)
    assert lam[0] == 0 and np.array_equal(q, f)


@pytest.mark.parametrize("half", [0, 1, 3, 16, 100])
def test_sliding_max_matches_loop(half):
    rng = np.random.default_rng(4)
    x = rng.normal(size=(2, 3, 57)).astype(np.float32)
    got = sliding_max(x, half)
    for idx in np.ndindex(2, 3):
        row = x[idx]
        want = [max(row[max(0, k - half):k + half + 1]) for k in range(57)]
        np.testing.assert_array_equal(got[idx], want)


@pytest.mark.parametrize("window,strength", [(32, 1.0), (4, 0.5), (7, 2.0)])
def test_soft_nms_matches_formula(window, strength):
    rng = np.random.default_rng(5)
    s = rng.normal(size=(4, 90)).astype(np.float32)
    got = soft_nms(s, window, strength)
    for h in range(4):
        np.testing.assert_allclose(got[h], direct_nms(s[h].astype(np.float64), window, strength), rtol=1e-5, atol=1e-5)
    peaks = got == s  # local maxima keep their score, the rest goes down
    assert peaks.any() and np.all(got[~peaks] < s[~peaks])


def test_cross_head_exclusivity_matches_formula():
    rng = np.random.default_rng(6)
    s = rng.normal(0, 3, size=(2, 5, 40)).astype(np.float32)  # [layers, heads, cells]
    got = cross_head_exclusivity(s, alpha=0.85, temperature=2.0)
    for layer in range(2):
        np.testing.assert_allclose(got[layer], direct_cross_head(s[layer].astype(np.float64), 0.85, 2.0),
                                   rtol=1e-5, atol=1e-4)


def test_cross_head_exclusivity_pushes_a_shared_cell_to_the_head_that_wants_it_most():
    s = np.zeros((1, 3, 4), dtype=np.float32)
    s[0, :, 1] = [5.0, 4.0, 4.0]  # everyone wants cell 1, head 0 most
    out = cross_head_exclusivity(s)
    gain = out[0] - s[0]
    assert gain[0, 1] > gain[1, 1] == pytest.approx(gain[2, 1])


def test_top_k_per_row_is_the_k_largest_sorted_and_unique():
    rng = np.random.default_rng(7)
    scores = rng.permutation(3 * 4 * 50).reshape(3, 4, 50).astype(np.float32)  # distinct values
    best = top_k_per_row(scores, 7)
    assert best.shape == (3, 4, 7)
    for idx in np.ndindex(3, 4):
        assert list(best[idx]) == sorted(np.argsort(-scores[idx])[:7])
    assert top_k_per_row(scores, 50)[1, 2].tolist() == list(range(50))
    assert top_k_per_row(scores, 0).shape == (3, 4, 0)
    with pytest.raises(ValueError):
        top_k_per_row(scores, 51)


def test_stages_write_into_a_workspace_without_changing_results():
    rng = np.random.default_rng(8)
    export, _ = make_export(rng, n_layers=1, n_heads=4, n_cells=64)
    workspace = Workspace()
    for _ in range(2):  # reused buffers give the same answer
        f = power_mean_evidence(export.evidence, 3, 0.5, workspace)
        np.testing.assert_array_equal(f, power_mean_evidence(export.evidence, 3, 0.5))
        s = soft_nms(np.log(f), 32, 1.0, workspace)
        np.testing.assert_array_equal(s, soft_nms(np.log(f), 32, 1.0))
    assert export.evidence.dtype == np.float32  # inputs are never written to


# -- the whole selector ---------------------------------------------------------------------------------
@pytest.mark.parametrize("n_heads", [2, 4])
def test_sfi_scores_match_the_direct_pipeline(n_heads):
    rng = np.random.default_rng(9)
    export, p = make_export(rng, n_layers=2, n_heads=n_heads, n_cells=120, n_rows=3)
    candidates = CandidateRange(4, 100)
    sel = SFISelector(n_threads=1, nms_strength=1.0, pool_window=0)  # the paper's pipeline
    got = sel.score(export, slice(0, 2), slice(4, 100))
    for layer in range(2):
        want = np.stack([direct_scores(p[layer, h, :, 4:100], export.key_norms[layer, h, 4:100])
                         for h in range(n_heads)])
        if n_heads > 2:  # cross-head exclusivity only with more than two KV heads
            want = direct_cross_head(want, 0.85, 2.0)
        np.testing.assert_allclose(got[layer], want, rtol=1e-4, atol=1e-3)
    chosen = sel.select(export, candidates, 20)
    assert chosen.shape == (2, n_heads, 20) and chosen.dtype == np.int32
    for idx in np.ndindex(2, n_heads):
        want = set((np.argsort(-got[idx])[:20] + 4).tolist())
        assert set(chosen[idx].tolist()) == want


def test_selection_stays_inside_the_candidates_same_count_unique_sorted():
    rng = np.random.default_rng(10)
    export, _ = make_export(rng, n_layers=3, n_heads=4, n_cells=300)
    candidates = CandidateRange.for_context(300, n_sink=4, n_recent=64)
    assert (candidates.start, candidates.stop) == (4, 236)
    for selector in (SFISelector(n_threads=1), TopKMassSelector(n_threads=1)):
        chosen = selector.select(export, candidates, 50)
        assert chosen.shape == (3, 4, 50)
        assert chosen.min() >= 4 and chosen.max() < 236
        assert np.all(np.diff(chosen, axis=-1) > 0)  # sorted, hence unique


def test_selection_follows_cell_positions_when_cells_are_not_in_position_order():
    rng = np.random.default_rng(11)
    export, _ = make_export(rng, n_layers=2, n_heads=4, n_cells=200)  # cell i holds position i
    cell_of_position = rng.permutation(230)[:200]  # the same 200 positions scattered over 230 cells
    positions = np.full(230, -1)  # 30 cells stay empty
    positions[cell_of_position] = np.arange(200)
    scattered = {}
    for name in ("mass", "evidence", "key_norms"):
        array = np.full((2, 4, 230), 7.0, dtype=np.float32)  # empty cells: large values, never candidates
        array[..., cell_of_position] = getattr(export, name)
        scattered[name] = array
    moved = AttentionExport(**scattered, n_rows=export.n_rows, positions=positions)
    candidates = CandidateRange(4, 180)
    for selector in (SFISelector(n_threads=1), TopKMassSelector(n_threads=1)):
        in_order = selector.select(export, candidates, 30)
        got = selector.select(moved, candidates, 30)
        np.testing.assert_array_equal(got, np.sort(cell_of_position[in_order], axis=-1))
    sink, recent = candidates.sink_and_recent_cells(positions)
    assert sorted(positions[sink]) == [0, 1, 2, 3] and sorted(positions[recent]) == list(range(180, 200))


def test_all_candidates_are_kept_when_the_budget_covers_them():
    rng = np.random.default_rng(12)
    export, _ = make_export(rng, n_layers=2, n_heads=4, n_cells=60)
    chosen = SFISelector().select(export, CandidateRange(4, 40), k_head=100)
    assert chosen.shape == (2, 4, 36)
    assert np.all(chosen == np.arange(4, 40))


def test_threads_give_the_same_selection():
    rng = np.random.default_rng(13)
    export, _ = make_export(rng, n_layers=6, n_heads=4, n_cells=3000)
    candidates = CandidateRange(4, 2744)
    one = SFISelector(n_threads=1).select(export, candidates, 256)
    import sfi_gguf.core.selector as selector_module
    chunk = selector_module._CHUNK_ELEMENTS
    selector_module._CHUNK_ELEMENTS = 1  # one layer per chunk, so the threads really share the work
    try:
        many = SFISelector(n_threads=3).select(export, candidates, 256)
    finally:
        selector_module._CHUNK_ELEMENTS = chunk
    np.testing.assert_array_equal(one, many)


def test_topk_mass_selects_the_heaviest_cells():
    mass = np.zeros((1, 2, 50), dtype=np.float32)
    mass[0, 0, [10, 20, 30]] = [3, 2, 1]
    mass[0, 1, [2, 45, 11]] = [9, 9, 9]  # cell 2 is a sink cell, 45 is recent: not candidates
    chosen = TopKMassSelector().select(AttentionExport(mass=mass), CandidateRange(4, 40), 2)
    assert chosen[0, 0].tolist() == [10, 20]
    assert 11 in chosen[0, 1].tolist()


def test_soft_nms_spreads_the_budget_over_separate_regions():
    n = 400
    mass = np.full(n, 1e-6)
    mass[100:140] = np.exp(-0.5 * ((np.arange(100, 140) - 120) / 4.0) ** 2)  # one bump, top 1.0 at 120
    mass[300] = 0.7  # a separate peak, lower than the bump's top three cells
    export = AttentionExport(mass=mass[None, None].astype(np.float32),
                             evidence=np.sqrt(mass)[None, None].astype(np.float32),  # one row: p^0.5
                             key_norms=np.ones((1, 1, n), dtype=np.float32))
    candidates = CandidateRange(0, n)
    without = SFISelector(nms_strength=0.0, w_pos=0.0, pool_window=0).select(export, candidates, 6)[0, 0]
    with_nms = SFISelector(nms_strength=1.0, w_pos=0.0, pool_window=0).select(export, candidates, 6)[0, 0]
    assert without.tolist() in ([117, 118, 119, 120, 121, 122], [118, 119, 120, 121, 122, 123])
    assert with_nms.tolist() == [118, 119, 120, 121, 122, 300]


@pytest.mark.parametrize("window", [1, 4, 9, 17])
def test_local_pool_matches_formula(window):
    rng = np.random.default_rng(21)
    f = rng.random((2, 3, 50)).astype(np.float32)
    got = local_pool(f.copy(), window)
    half = window // 2
    want = np.empty_like(f)
    for idx in np.ndindex(2, 3):
        for k in range(50):
            want[idx + (k,)] = f[idx][max(0, k - half):k + half + 1].max()
        if window > 1:
            want[idx] /= want[idx].sum()
    np.testing.assert_allclose(got, want if window > 1 else f, rtol=1e-5)


def test_pooling_keeps_the_span_after_the_attended_key():
    """A question attends to the key (cells 200-202); the answer reads the value right after it."""
    n = 600
    rng = np.random.default_rng(22)
    mass = rng.uniform(1e-4, 1e-3, n)
    mass[200:203] = 1.0
    mass[rng.choice(np.arange(20, 180), 12, replace=False)] = 0.2  # scattered weaker peaks
    export = AttentionExport(mass=mass[None, None].astype(np.float32),
                             evidence=np.sqrt(mass)[None, None].astype(np.float32),
                             key_norms=np.ones((1, 1, n), dtype=np.float32))
    value = set(range(203, 211))
    for selector in (SFISelector, TopKMassSelector):
        plain = set(selector(pool_window=0).select(export, CandidateRange(4, n), 24)[0, 0].tolist())
        pooled = set(selector(pool_window=17).select(export, CandidateRange(4, n), 24)[0, 0].tolist())
        assert not value <= plain and value <= pooled


def test_zero_evidence_gives_finite_scores():
    export = AttentionExport(evidence=np.zeros((1, 4, 64), dtype=np.float32),
                             key_norms=np.ones((1, 4, 64), dtype=np.float32))
    scores = SFISelector().score(export, slice(0, 1), slice(0, 64))
    assert np.all(np.isfinite(scores))
    assert SFISelector().select(export, CandidateRange(0, 64), 10).shape == (1, 4, 10)


def test_selector_checks_its_inputs():
    evidence = np.ones((1, 2, 10), dtype=np.float32)
    with pytest.raises(ValueError, match="alpha"):
        SFISelector(alpha=0.5).select(AttentionExport(evidence=evidence, key_norms=evidence, alpha=0.3),
                                      CandidateRange(0, 10), 2)
    with pytest.raises(ValueError, match="key_norms"):
        SFISelector().select(AttentionExport(evidence=evidence), CandidateRange(0, 10), 2)
    with pytest.raises(ValueError, match="mass"):
        TopKMassSelector().select(AttentionExport(evidence=evidence), CandidateRange(0, 10), 2)
    with pytest.raises(ValueError, match="shape"):
        AttentionExport(evidence=evidence, key_norms=np.ones((1, 2, 9)))
    with pytest.raises(ValueError, match="n_rows"):
        AttentionExport(evidence=evidence, n_rows=0)
    with pytest.raises(ValueError):
        CandidateRange(5, 4)


def test_candidate_range_for_short_contexts():
    assert CandidateRange.for_context(1000, 4, 256) == CandidateRange(4, 744)
    assert len(CandidateRange.for_context(200, 4, 256)) == 0
    assert len(CandidateRange.for_context(2, 4, 256)) == 0
    sink, recent = CandidateRange(4, 744).sink_and_recent_cells(1000)
    assert sink.tolist() == [0, 1, 2, 3] and recent.tolist() == list(range(744, 1000))


def test_assemble_memory_adds_sink_and_recent_to_every_head():
    selected = np.array([[[10, 20, 30], [11, 12, 13]]], dtype=np.int32)  # [1 layer, 2 heads, 3]
    sink, recent = CandidateRange(4, 40).sink_and_recent_cells(44)
    memory = assemble_memory(selected, sink, recent)
    assert memory.shape == (1, 2, 4 + 3 + 4) and memory.dtype == np.int32
    assert memory[0, 0].tolist() == [0, 1, 2, 3, 10, 20, 30, 40, 41, 42, 43]
    assert memory[0, 1].tolist() == [0, 1, 2, 3, 11, 12, 13, 40, 41, 42, 43]
    with pytest.raises(ValueError, match="overlap"):
        assemble_memory(np.array([[[2, 20, 30]]]), sink, recent)


def test_refresh_overlap_is_the_share_of_new_cells_already_selected():
    old = np.array([[[1, 2, 3, 4], [5, 6, 7, 8]]])
    new = np.array([[[3, 4, 9, 10], [5, 6, 7, 8]]])
    assert refresh_overlap(old, new) == pytest.approx(6 / 8)
    np.testing.assert_allclose(refresh_overlap(old, new, per_head=True), [[0.5, 1.0]])
    assert refresh_overlap(old, old) == 1.0
    assert refresh_overlap(old, new[..., 2:]) == pytest.approx(2 / 4)  # another k: [9, 10] and [7, 8]
    with pytest.raises(ValueError):
        refresh_overlap(old, new[0])
    # an empty previous selection (the context was too short for one): nothing is kept
    assert refresh_overlap(old[..., :0], new) == 0.0


def test_registry_and_config():
    assert set(selector_names()) == set(SELECTORS) >= {"sfi", "topk_mass"}
    config = SFIConfig(alpha=0.25, nms_window=16, cross_head_temperature=3.0, lambda_clip_single=0.5)
    sel = make_selector(config)
    assert isinstance(sel, SFISelector)
    assert (sel.alpha, sel.nms_window, sel.cross_head_temperature, sel.lambda_max(1), sel.lambda_max(4)) == \
        (0.25, 16, 3.0, 0.5, 0.25)
    assert isinstance(make_selector(config, "topk_mass"), TopKMassSelector)
    assert isinstance(make_selector(config.replace(selector="topk_mass")), TopKMassSelector)
    with pytest.raises(ValueError, match="unknown selector"):
        make_selector(config, "nope")


def test_device_candidates_covering_every_cell_select_like_a_dense_export():
    """An export of C device candidates per layer (any order) that include every cell selects exactly
    what the dense export selects; a subset selects only among its cells."""
    rng = np.random.default_rng(7)
    L, H, N, k = 3, 2, 300, 40
    evidence = rng.random((L, H, N), dtype=np.float32) ** 4
    norms = 1 + rng.random((L, H, N), dtype=np.float32)
    dense = AttentionExport(evidence=evidence, key_norms=norms, n_rows=4, alpha=0.5)
    candidates = CandidateRange.for_context(N, 4, 32)
    selector = SFISelector(n_threads=1)
    want = selector.select(dense, candidates, k)
    order = np.stack([rng.permutation(N) for _ in range(L)]).astype(np.int32)
    sparse = AttentionExport(evidence=np.take_along_axis(evidence, order[:, None, :], -1),
                             key_norms=np.take_along_axis(norms, order[:, None, :], -1), n_rows=4, alpha=0.5,
                             positions=np.arange(N), cells=order)
    np.testing.assert_array_equal(selector.select(sparse, candidates, k), want)
    subset = order[:, :120]
    part = AttentionExport(evidence=np.take_along_axis(evidence, subset[:, None, :], -1),
                           key_norms=np.take_along_axis(norms, subset[:, None, :], -1), n_rows=4, alpha=0.5,
                           positions=np.arange(N), cells=subset)
    got = selector.select(part, candidates, k)
    for layer in range(L):
        inside = set(subset[layer][(subset[layer] >= candidates.start) & (subset[layer] < candidates.stop)].tolist())
        assert set(got[layer].ravel().tolist()) <= inside
    with pytest.raises(ValueError, match="cells"):
        AttentionExport(evidence=evidence, cells=order)  # cells need positions
