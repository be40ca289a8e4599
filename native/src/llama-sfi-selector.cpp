// The device Selector in the slow step's graph: the evidence of the refreshed layers, stacked, scored and cut to
// the k_head best cells per layer and KV head (sfi_gguf/selector.py is the reference), and gathered into the view
#include "llama-sfi-selector.h"

#include "llama-sfi-ubatch-graph.h"
#include "llama-sfi-layer-export.h"
#include "llama-sfi-view.h"

#include "ggml-backend.h"
#include "ggml-sfi.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <limits>
#include <tuple>

// the device Selector's softmaxes take at least this many rows at a time (layers stacked): a softmax runs
// one row per GPU block, and one layer's rows (one per head) keep most of a GPU's multiprocessors idle
static constexpr int64_t LLAMA_SFI_SOFTMAX_ROWS = 256;

// the evidence sum_r p_r^alpha [n_kv, 1, n_head_kv, n*ns] of n layers (layer-major) from their scaled scores,
// scores(a, b) = those of layers a .. b-1 stacked [n_kv, n_rows, n_head, (b - a)*ns] (rows = n_rows*n_head*ns per
// layer), with the softmaxes of several layers stacked (scores with sinks, a per-layer tensor, take theirs one
// layer at a time)
static ggml_tensor * llama_sfi_selector_evidence(
        const llama_sfi_layer_export & ex,
              size_t   n,
             int64_t   rows,
        const std::function<ggml_tensor * (size_t, size_t)> & scores,
        const std::vector<ggml_tensor *> & sinks,
             int64_t   n_head_kv) {
    const bool   any_sinks = std::any_of(sinks.begin(), sinks.end(), [](const ggml_tensor * t) { return t != nullptr; });
    const size_t n_stack   = any_sinks ? 1 : (size_t) std::max<int64_t>(1, (LLAMA_SFI_SOFTMAX_ROWS + rows - 1)/rows);

    std::vector<ggml_tensor *> evids;
    for (size_t first = 0; first < n; first += n_stack) {
        const size_t last = std::min(first + n_stack, n);

        ggml_tensor * p = ex.softmax(scores(first, last), n_stack == 1 ? sinks[first] : nullptr);

        evids.push_back(llama_sfi_group_sum(ex.ctx, llama_sfi_pow(ex.ctx, p, ex.view.params.evidence_alpha), n_head_kv));
    }

    return llama_sfi_stack(ex.ctx, evids, 3);
}

// the evidence [n_kv, 1, n_head_kv, n*ns] and the key norms [n_head_kv, n_kv, n*ns] of n layers as ggml_sfi_evidence
// ops: qs[l] the layers' scaled queries [n_embd_head, n_q, n_head_kv, ns], k4 the keys of all n as
// [n_embd_head, n_kv, n_head_kv, n] (one op; ns 1) or nullptr, ks[l] each layer's [n_embd_head, n_head_kv, n_kv, ns]
// (one op per layer, where the backend lacks the op of all n); { nullptr, nullptr } when the backend of the keys
// lacks the op (llama_sfi_selector_fused said so for each layer)
static std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_selector_evidence_fused(
        const llama_sfi_layer_export & ex,
        const std::vector<ggml_tensor *> & qs,
         ggml_tensor * k4,
        const std::vector<ggml_tensor *> & ks,
         ggml_tensor * storage) {
    ggml_context * ctx = ex.ctx;

    const float alpha = ex.view.params.evidence_alpha;

    std::vector<ggml_tensor *> ops;
    if (k4) {
        ops.push_back(ggml_sfi_evidence(ctx, llama_sfi_stack(ctx, qs, 3), k4, ex.mask, ex.n_rows, alpha, ex.cap, true));
    }
    if (ops.empty() || !llama_sfi_backend_runs(ex.view.params, ops[0], storage)) {
        ops.clear();
        for (size_t l = 0; l < qs.size(); ++l) {
            ops.push_back(ggml_sfi_evidence(ctx, qs[l], ggml_permute(ctx, ks[l], 0, 2, 1, 3), ex.mask, ex.n_rows, alpha, ex.cap, true));
        }
        if (!llama_sfi_backend_runs(ex.view.params, ops[0], storage)) {
            return { nullptr, nullptr };
        }
    }

    std::vector<ggml_tensor *> evids;
    std::vector<ggml_tensor *> norms;
    for (ggml_tensor * op : ops) {
        ggml_set_name(op, "sfi_evidence");
        ggml_tensor * e = ggml_sfi_evidence_values(ctx, op);
        evids.push_back(ggml_reshape_4d(ctx, e, e->ne[0], 1, e->ne[1], e->ne[2]));
        norms.push_back(ggml_sfi_evidence_key_norms(ctx, op));
    }
    return { llama_sfi_stack(ctx, evids, 3), llama_sfi_stack(ctx, norms, 2) };
}

bool llama_sfi_selector_fused(const llama_sfi_layer_export & ex) {
    if (ex.sinks || ex.max_bias != 0.0f) {
        return false;
    }
    ggml_tensor * op = ggml_sfi_evidence(ex.ctx, ex.q, ggml_permute(ex.ctx, ex.k, 0, 2, 1, 3), ex.mask, ex.n_rows,
            ex.view.params.evidence_alpha, ex.cap, true);
    return llama_sfi_backend_runs(ex.view.params, op, ex.view.cache_k_of(ex.il));
}

// the candidate stage as composite ops (ggml_sfi_candidate_scores and ggml_sfi_candidate_values define it): the
// candidate cells I32 [n_cand, nb] and their values [n_cand, n_head_kv + 2, nb]
static std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_selector_candidates(
        ggml_context * ctx,
        const llama_sfi_view & view,
        const llama_sfi_graph_input & inp,
         ggml_tensor * evid,
             int64_t   n_cand,
        const ggml_tensor * storage) {
    const auto & sp = view.selector;

    const int64_t n_kv      = evid->ne[0];
    const int64_t n_head_kv = evid->ne[2];
    const int64_t nb        = evid->ne[3];

    ggml_tensor * mask = inp.sel_mask;

    const int64_t ns = mask->ne[3];

    auto per_pair = [&](ggml_tensor * t) { // [n, n_kv, ns] -> [n, n_kv, nb]
        return nb == ns ? t : ggml_repeat_4d(ctx, t, t->ne[0], n_kv, nb, 1);
    };

    // f = evidence^(1/alpha) normalised over the range: softmax of log(evidence)/alpha, masked
    ggml_tensor * f = ggml_soft_max_ext(ctx, ggml_log(ctx, evid), mask, 1.0f/view.params.evidence_alpha, 0.0f);

    if (sp.pool_window > 1) {
        // max over the neighbouring cells (zeros outside the range), then back to the range only
        const int half = sp.pool_window/2;

        ggml_tensor * keep = ggml_exp(ctx, mask); // 1 in the range, 0 outside
        f = ggml_mul(ctx, ggml_pool_2d(ctx, f, GGML_OP_POOL_MAX, 2*half + 1, 1, 1, 1, half, 0), keep);
        f = ggml_div(ctx, f, ggml_sum_rows(ctx, f));
    }

    // candidates: the most f summed over the heads (each head normalised: every head has its say), summed by
    // halving (a sum_rows over rows of n_head_kv values runs one CUDA block per cell)
    ggml_tensor * score = ggml_add(ctx, ggml_reshape_2d(ctx, llama_sfi_group_sum(ctx, f, 1), n_kv, nb), ggml_reshape_2d(ctx, mask, n_kv, ns));
    ggml_tensor * cells = llama_sfi_top_k(ctx, view.params, score, (int) n_cand, false, storage); // [n_cand, nb]

    // one gather of every value the Selector reads per candidate, f of each head, its relative position u and
    // the range mask: a gather of one-value rows costs about as much as one of ten
    ggml_tensor * vals = ggml_concat(ctx, ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_3d(ctx, f, n_kv, n_head_kv, nb))),
            per_pair(ggml_concat(ctx, inp.sel_u, ggml_reshape_3d(ctx, mask, 1, n_kv, ns), 0)), 0); // [n_head_kv + 2, n_kv, nb]
    vals = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, vals, cells)));                          // [n_cand, n_head_kv + 2, nb]

    return { cells, vals };
}

// the SFI Selector (sfi_gguf/selector.py, SFISelector) over the evidence of n layers of the same shape, for
// every stream of the ubatch, as one set of ops on the layers stacked (layer-major: batch b = layer*ns + stream):
// per layer ops were thousands of small kernels, and softmaxes and sums over a few long rows used a few
// multiprocessors of a GPU
//   evid [n_kv, 1, n_head_kv, n*ns] (sum_r p_r^alpha, llama_sfi_selector_evidence), and the key norms: kn
//   [n_head_kv, n_kv, n*ns] of the stacked layers (ggml_sfi_evidence's), else kns[l] the layers' [n_head_kv, kv_size, ns]
//   (llama_sfi_layer_export::kn)
//   returns the candidate cells I32 [n_cand, n*ns] and the picks I32 [k_head, n_head_kv, n*ns] (indices into them),
//   both chosen by a selection where the backend of the keys (storage) has ggml_sfi_top_k
static std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_selector_picks(
        ggml_context * ctx,
        const llama_sfi_view & view,
        const llama_sfi_graph_input & inp,
         ggml_tensor * evid,
         ggml_tensor * kn_stacked,
        const std::vector<ggml_tensor *> & kns,
             int64_t   n_cand,
             int64_t   n_rows,
        const ggml_tensor * storage) {
    const auto & sp = view.selector;

    const int64_t n_kv      = evid->ne[0];
    const int64_t n_head_kv = evid->ne[2];
    const int64_t nb        = evid->ne[3]; // (layer, stream) pairs

    // the range mask broadcasts over the layers (b % ns); the relative positions are gathered per pair
    ggml_tensor * mask = inp.sel_mask;

    const int64_t ns = mask->ne[3];

    const float tiny = std::numeric_limits<float>::min();
    const float big  = std::numeric_limits<float>::max();

    ggml_tensor * cells = nullptr;
    ggml_tensor * vals  = nullptr; // [n_cand, n_head_kv + 2, nb]: f of each head, u and the range mask per candidate

    // the candidate stage as two ops where the backend of the keys has them, else as composite ops
    ggml_tensor * cs = ggml_sfi_candidate_scores(ctx, ggml_is_contiguous(evid) ? evid : ggml_cont(ctx, evid), mask,
            view.params.evidence_alpha, sp.pool_window);
    if (llama_sfi_backend_runs(view.params, cs, storage)) {
        ggml_tensor * score = ggml_view_2d(ctx, cs, n_kv, nb, cs->nb[1], 0);

        cells = llama_sfi_top_k(ctx, view.params, score, (int) n_cand, false, storage);
        vals  = ggml_sfi_candidate_values(ctx, cs, inp.sel_u, mask, cells);
    } else {
        std::tie(cells, vals) = llama_sfi_selector_candidates(ctx, view, inp, evid, n_cand, storage);
    }

    const float lambda_max = n_rows == 1 ? sp.lambda_clip_single : sp.lambda_clip_multi;

    // the scores of the candidates as one op where the backend of the keys has it (the key norms gathered by the op
    // from the stacked layers' rows, or gathered here layer by layer), else as the composite ops below
    {
        ggml_tensor * kn_rows  = kn_stacked;
        ggml_tensor * kn_cells = cells;
        if (!kn_stacked) {
            std::vector<ggml_tensor *> norms;
            for (size_t l = 0; l < kns.size(); ++l) {
                ggml_tensor * cells_l = ggml_view_2d(ctx, cells, n_cand, ns, cells->nb[1], l*ns*cells->nb[1]);
                norms.push_back(ggml_get_rows(ctx, kns[l], cells_l));
            }
            kn_rows  = llama_sfi_stack(ctx, norms, 2);
            kn_cells = nullptr;
        }
        const ggml_sfi_selector_params op_params = {
            /*.key_norm_exponent      =*/ sp.key_norm_exponent,
            /*.w_pos                  =*/ sp.w_pos,
            /*.pos_beta               =*/ sp.pos_beta,
            /*.pos_power              =*/ sp.pos_power,
            /*.pos_eta                =*/ sp.pos_eta,
            /*.lambda_max             =*/ lambda_max,
            /*.cross_head_alpha       =*/ n_head_kv > 2 ? sp.cross_head_alpha : 0.0f,
            /*.cross_head_temperature =*/ sp.cross_head_temperature,
        };
        ggml_tensor * sc = ggml_sfi_selector_scores(ctx, vals, ggml_is_contiguous(kn_rows) ? kn_rows : ggml_cont(ctx, kn_rows),
                kn_cells, op_params);
        if (llama_sfi_backend_runs(view.params, sc, storage)) {
            ggml_set_name(sc, "sfi_sel_score");
            return { cells, llama_sfi_top_k(ctx, view.params, sc, sp.k_head, true, storage) };
        }
    }

    auto vals_rows = [&](int64_t first, int64_t n) {
        return ggml_cont(ctx, ggml_view_3d(ctx, vals, n_cand, n, nb, vals->nb[1], vals->nb[2], first*vals->nb[1]));
    };

    // from here on one row per (head, pair): [n_cand, n_head_kv, nb]
    ggml_tensor * fc = vals_rows(0, n_head_kv);
    fc = ggml_div(ctx, fc, ggml_sum_rows(ctx, fc));

    // structural prior r ~ ||K||^e delta(u)^w_pos; the key norms of the candidates, of the layers at once or layer by
    // layer
    ggml_tensor * kn = nullptr;
    if (kn_stacked) {
        kn = llama_sfi_key_norms_at(ctx, kn_stacked, cells);
    } else {
        std::vector<ggml_tensor *> norms;
        for (size_t l = 0; l < kns.size(); ++l) {
            GGML_ASSERT(kns[l]);
            ggml_tensor * cells_l = ggml_view_2d(ctx, cells, n_cand, ns, cells->nb[1], l*ns*cells->nb[1]);
            norms.push_back(llama_sfi_key_norms_at(ctx, kns[l], cells_l));
        }
        kn = llama_sfi_stack(ctx, norms, 2);
    }

    // position prior w_pos*(-pos_beta*u^pos_power + pos_eta*log(1 - u)) of the candidates, -inf outside the range
    ggml_tensor * u      = vals_rows(n_head_kv, 1);
    ggml_tensor * m      = vals_rows(n_head_kv + 1, 1);
    ggml_tensor * u_pow  = ggml_exp(ctx, ggml_scale(ctx, ggml_log(ctx, u), sp.pos_power)); // u = 0: exp(-inf) = 0
    ggml_tensor * prior  = ggml_add(ctx, ggml_scale(ctx, ggml_add(ctx, ggml_scale(ctx, u_pow, -sp.pos_beta),
                ggml_scale(ctx, ggml_log(ctx, ggml_scale_bias(ctx, u, -1.0f, 1.0f)), sp.pos_eta)), sp.w_pos), m);

    ggml_tensor * r = ggml_soft_max(ctx, ggml_add(ctx, ggml_scale(ctx, ggml_log(ctx, ggml_clamp(ctx, kn, tiny, big)), sp.key_norm_exponent), prior));

    // q = f - lambda (f - r), lambda = <f, f - r>/||f - r||^2 clipped
    ggml_tensor * d   = ggml_sub(ctx, fc, r);
    ggml_tensor * num = ggml_sum_rows(ctx, ggml_mul(ctx, fc, d));
    ggml_tensor * den = ggml_scale_bias(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, d)), 1.0f, 1e-30f); // f == r: lambda 0
    ggml_tensor * lam = ggml_clamp(ctx, ggml_div(ctx, num, den), 0.0f, lambda_max);

    ggml_tensor * sc = ggml_log(ctx, ggml_clamp(ctx, ggml_sub(ctx, fc, ggml_mul(ctx, d, lam)), tiny, big));

    if (n_head_kv > 2) {
        // cross-head exclusivity: s += alpha log softmax over the heads of s/T
        ggml_tensor * heads = ggml_soft_max_ext(ctx, ggml_cont(ctx, ggml_transpose(ctx, sc)), nullptr, 1.0f/sp.cross_head_temperature, 0.0f);
        sc = ggml_add(ctx, sc, ggml_scale(ctx, ggml_cont(ctx, ggml_transpose(ctx, ggml_log(ctx, heads))), sp.cross_head_alpha));
    }

    // the k_head best per (head, pair), all rows in one op
    ggml_set_name(sc, "sfi_sel_score");

    return { cells, llama_sfi_top_k(ctx, view.params, sc, sp.k_head, true, storage) };
}

void llama_sfi_build_selection(const llama_sfi_layer_export & ex) {
    ggml_context * ctx  = ex.ctx;
    const auto   & view = ex.view;
    auto         & res  = ex.res;

    const size_t i        = ex.i;
    const size_t n_layers = view.layers.size();

    // only the Selector's picks leave (no mass, evidence or key-norm export); it runs once, after the last refreshed
    // layer, on every run of refreshed layers with the same number of KV heads; res.sel[i] and res.cells[i] are then
    // the outputs of layer i's run
    res.sel_q[i]     = ex.q;
    res.sel_k[i]     = ex.k;
    res.sel_sinks[i] = ex.sinks;
    res.sel_kn[i]    = ex.kn;

    std::vector<size_t> refreshed;
    for (size_t j = 0; j < n_layers; ++j) {
        if (view.refreshes(j)) {
            refreshed.push_back(j);
        }
    }
    if (i != refreshed.back()) {
        return;
    }

    for (size_t first = 0, last; first < refreshed.size(); first = last) {
        // a run: layers of as many KV heads, all with the fused evidence op or all without (their own key norms)
        const int64_t h     = res.sel_k[refreshed[first]]->ne[1];
        const bool    fused = res.sel_kn[refreshed[first]] == nullptr;
        for (last = first + 1; last < refreshed.size() && res.sel_k[refreshed[last]]->ne[1] == h &&
                (res.sel_kn[refreshed[last]] == nullptr) == fused; ++last) {}

        std::vector<ggml_tensor *> sinks_run;
        std::vector<ggml_tensor *> kns;
        for (size_t j = first; j < last; ++j) {
            sinks_run.push_back(res.sel_sinks[refreshed[j]]);
            kns.push_back(res.sel_kn[refreshed[j]]);
        }

        // the queries and keys of the run's layers a .. b-1, and with one stream and layers at one stride in the cache
        // (llama_sfi_view::layer_span) the keys of them all as one view [n_embd_head, n_kv, n_head_kv, b - a]
        auto layers_of = [&](size_t a, size_t b, std::vector<ggml_tensor *> & qs, std::vector<ggml_tensor *> & ks) -> ggml_tensor * {
            for (size_t j = first + a; j < first + b; ++j) {
                qs.push_back(res.sel_q[refreshed[j]]);
                ks.push_back(res.sel_k[refreshed[j]]);
            }

            const ggml_tensor * k0 = ks[0];
            const size_t        l0 = refreshed[first + a];

            bool span = ex.ns == 1 && view.cache_k.t;
            for (size_t j = 0; j < ks.size() && span; ++j) {
                const ggml_tensor * kj = ks[j];
                span = refreshed[first + a + j] == l0 + j && kj->view_src == view.cache_k_of(view.layers[l0 + j].il) &&
                    ggml_are_same_shape(kj, k0) && ggml_are_same_stride(kj, k0) && kj->view_offs == k0->view_offs;
            }

            return span ? ggml_view_4d(ctx, view.cache_k.t, k0->ne[0], k0->ne[2], k0->ne[1], (int64_t) ks.size(),
                    k0->nb[2], k0->nb[1], view.cache_k.stride, l0*view.cache_k.stride + k0->view_offs) : nullptr;
        };

        // the scaled scores of the run's layers a .. b-1, stacked: one product of the span's keys with their queries,
        // stacked; else one product per layer, and their scores stacked
        auto scores = [&](size_t a, size_t b) {
            std::vector<ggml_tensor *> qs;
            std::vector<ggml_tensor *> ks;
            if (ggml_tensor * k4 = layers_of(a, b, qs, ks)) {
                return ex.scores(ggml_mul_mat(ctx, k4, llama_sfi_stack(ctx, qs, 3)));
            }

            std::vector<ggml_tensor *> kqs;
            for (size_t j = 0; j < ks.size(); ++j) {
                kqs.push_back(ex.scores(ks[j], qs[j]));
            }
            return llama_sfi_stack(ctx, kqs, 3);
        };

        const ggml_tensor * q0 = res.sel_q[refreshed[first]];

        // the layers share the cache's mask; the fused op where the keys' backend has it (no sinks, no ALiBi: the
        // layers then kept no key norms, see llama_sfi_selector_fused)
        ggml_tensor * evid = nullptr;
        ggml_tensor * kn   = nullptr;
        bool attention_gave_them = fused;
        for (size_t j = first; j < last; ++j) {
            attention_gave_them = attention_gave_them && res.sel_fae[refreshed[j]];
        }
        if (attention_gave_them) {
            // each layer's attention gave them (llama_sfi_fused_attention)
            std::vector<ggml_tensor *> evids;
            std::vector<ggml_tensor *> norms;
            for (size_t j = first; j < last; ++j) {
                ggml_tensor * e = ggml_sfi_flash_attn_evidence_values(ctx, res.sel_fae[refreshed[j]]);
                evids.push_back(ggml_reshape_4d(ctx, e, e->ne[0], 1, e->ne[1], e->ne[2]));
                norms.push_back(ggml_sfi_flash_attn_evidence_key_norms(ctx, res.sel_fae[refreshed[j]]));
            }
            // (a concat tree over 36 layers' evidence of 128K cells took 1.0 ms on an H200)
            const ggml_tensor * storage = view.cache_k_of(view.layers[refreshed[first]].il);
            evid = llama_sfi_stack(ctx, evids, 3, storage);
            kn   = llama_sfi_stack(ctx, norms, 2, storage);
        } else if (fused) {
            std::vector<ggml_tensor *> qs;
            std::vector<ggml_tensor *> ks;
            ggml_tensor * k4 = layers_of(0, last - first, qs, ks);
            std::tie(evid, kn) = llama_sfi_selector_evidence_fused(ex, qs, k4, ks, view.cache_k_of(view.layers[refreshed[first]].il));
            GGML_ASSERT(evid && kn);
        } else {
            evid = llama_sfi_selector_evidence(ex, last - first, q0->ne[1]*q0->ne[2]*q0->ne[3], scores, sinks_run, h);
        }

        auto [cells, picks] = llama_sfi_selector_picks(ctx, view, ex.inp, evid, kn, kns, ex.n_cand, ex.n_rows*(ex.n_head/ex.n_head_kv),
                view.cache_k_of(view.layers[refreshed[first]].il));

        if (ex.inp.shared) {
            // the cells of the picks, which the gather reads: the host then copies them as they are
            const int64_t k_head = picks->ne[0];
            const int64_t h      = picks->ne[1];
            const int64_t nb     = picks->ne[2];

            ggml_tensor * picked = picks->op == GGML_OP_SFI_TOP_K ? ggml_sfi_top_k_ids(ctx, picks->src[0], (int) k_head, cells) : nullptr;
            if (picked && llama_sfi_backend_runs(view.params, picked, view.cache_k_of(view.layers[refreshed[first]].il))) {
                picks = picked; // the selection writes the cells themselves
            } else {
                picks = ggml_get_rows(ctx, ggml_reshape_3d(ctx, cells, 1, cells->ne[0], nb), ggml_reshape_2d(ctx, picks, k_head*h, nb));
                picks = ggml_reshape_3d(ctx, picks, k_head, h, nb);
            }

            llama_sfi_build_load(ctx, ex.gf, view, ex.inp, ex.s0, picks, refreshed, first, last);
            res.gathered  = true;
            res.sel_cells = true;
        }

        for (ggml_tensor * t : { cells, picks }) {
            ggml_format_name(t, "%s-%zu", t == cells ? "sfi_cells" : "sfi_sel", refreshed[first]);
            ggml_set_output(t);
            ggml_build_forward_expand(ex.gf, t);
        }
        for (size_t j = first; j < last; ++j) {
            res.cells[refreshed[j]] = cells;
            res.sel[refreshed[j]]   = picks;
        }
    }
}
