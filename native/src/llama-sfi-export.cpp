// The slow step's export: the attention mass, evidence and key norms of the last query rows, of every cell or of
// candidates chosen on the device, or the device Selector's selection (llama-sfi-selector.cpp)
#include "llama-sfi-export.h"

#include "llama-sfi-graph.h"
#include "llama-sfi-selector.h"
#include "llama-sfi-view.h"

#include "llama-hparams.h"
#include "llama-kv-cache.h"

#include <algorithm>
#include <functional>

// key norms are taken for at most this many cells per set of ops (the first SLOW step takes every cell's: its
// keys, gathered as F32, would otherwise take GBs of compute buffer)
static constexpr int64_t LLAMA_SFI_KEY_NORM_CHUNK = 16384;

ggml_tensor * llama_sfi_group_sum(ggml_context * ctx, ggml_tensor * p, int64_t n_head_kv) {
    const int64_t n_kv = p->ne[0];
    const int64_t ns   = p->ne[3];

    int64_t n = p->ne[1]*p->ne[2]/n_head_kv; // slices per KV head: query head h = h_kv*G + g, for each row

    p = ggml_reshape_4d(ctx, p, n_kv, n, n_head_kv, ns);
    if (n == 1) {
        return ggml_cont(ctx, p);
    }

    auto slices = [&](ggml_tensor * t, int64_t first, int64_t count) {
        return ggml_view_4d(ctx, t, n_kv, count, n_head_kv, ns, t->nb[1], t->nb[2], t->nb[3], first*t->nb[1]);
    };

    ggml_tensor * rest = nullptr; // sum of the slices left over when n was odd
    while (n > 1) {
        if (n % 2) {
            ggml_tensor * last = slices(p, n - 1, 1);
            rest = rest ? ggml_add(ctx, rest, last) : last;
            n -= 1;
        }
        p = ggml_add(ctx, slices(p, 0, n/2), slices(p, n/2, n/2));
        n /= 2;
    }

    return rest ? ggml_add(ctx, p, rest) : p;
}

ggml_tensor * llama_sfi_stack(ggml_context * ctx, std::vector<ggml_tensor *> ts, int dim) {
    while (ts.size() > 1) {
        std::vector<ggml_tensor *> next;
        for (size_t j = 0; j + 1 < ts.size(); j += 2) {
            next.push_back(ggml_concat(ctx, ts[j], ts[j + 1], dim));
        }
        if (ts.size() % 2) {
            next.push_back(ts.back());
        }
        ts = std::move(next);
    }
    return ts[0];
}

ggml_tensor * llama_sfi_key_norms_at(ggml_context * ctx, ggml_tensor * kn, ggml_tensor * cells) {
    return ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, kn, cells)));
}

ggml_tensor * llama_sfi_pow(ggml_context * ctx, ggml_tensor * p, float alpha) {
    if (alpha == 0.5f) {
        return ggml_sqrt(ctx, p);
    }
    if (alpha == 1.0f) {
        return p;
    }
    return ggml_exp(ctx, ggml_scale(ctx, ggml_log(ctx, p), alpha)); // log(0) = -inf -> 0
}

// the key norms ||K|| of every cell of layer il, for the streams s0 .. s0+ns-1: [n_head_kv, kv_size, ns], after the
// ops that take those of the cells in inp.kn_cells (written since they were last taken), dequantized to F32; the
// Selector gathers them at its candidates instead of gathering and squaring every candidate's keys per layer
static ggml_tensor * llama_sfi_key_norms(ggml_context * ctx, ggml_cgraph * gf, const llama_sfi_view & view,
        const llama_sfi_graph_input & inp, int32_t il, uint32_t s0, int64_t ns) {
    const auto & l = view.layers.at(view.layer_index(il));

    ggml_tensor * kn = l.kn;

    if (inp.kn_cells) {
        ggml_tensor * k = view.cache_k_of(il); // [n_embd_k_gqa, kv_size, n_stream]
        GGML_ASSERT(k->nb[2] == k->nb[1]*k->ne[1] && kn->ne[1] == k->ne[1]);

        const int64_t n_embd_head = k->ne[0]/l.n_head_kv;

        ggml_tensor * k_rows = ggml_view_2d(ctx, k,  k->ne[0],  k->ne[1]*k->ne[2],   k->nb[1],  0);
        ggml_tensor * kn_all = ggml_view_2d(ctx, kn, kn->ne[0], kn->ne[1]*kn->ne[2], kn->nb[1], 0);

        for (int64_t o = 0; o < inp.kn_cells->ne[0]; o += LLAMA_SFI_KEY_NORM_CHUNK) {
            const int64_t m = std::min(LLAMA_SFI_KEY_NORM_CHUNK, inp.kn_cells->ne[0] - o);

            ggml_tensor * cells = ggml_view_1d(ctx, inp.kn_cells, m, o*inp.kn_cells->nb[0]);
            ggml_tensor * x     = ggml_reshape_2d(ctx, ggml_get_rows(ctx, k_rows, cells), n_embd_head, l.n_head_kv*m);

            // the sums of squares as a product with a vector of ones (a sum_rows runs one CUDA block per key)
            ggml_tensor * ones = ggml_fill(ctx, ggml_view_1d(ctx, x, n_embd_head, 0), 1.0f);
            ggml_tensor * norm = ggml_sqrt(ctx, ggml_mul_mat(ctx, ggml_sqr(ctx, x), ones)); // [n_head_kv*m, 1]

            kn_all = ggml_set_rows(ctx, kn_all, ggml_reshape_2d(ctx, norm, l.n_head_kv, m), cells);
        }
        ggml_build_forward_expand(gf, kn_all);

        kn = kn_all; // later reads come after the updates
    }

    return ggml_view_3d(ctx, kn, l.n_head_kv, l.kn->ne[1], ns, l.kn->nb[1], l.kn->nb[2], s0*l.kn->nb[2]);
}

void llama_sfi_build_export(
        ggml_context * ctx,
         ggml_cgraph * gf,
    llama_sfi_graph_result & res,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
        const llama_hparams & hparams,
         ggml_tensor * q_cur,
         ggml_tensor * k,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
                 int   il) {
    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (!plan || !plan->exporting) {
        return;
    }

    const auto * view = &plan->view;

    const int32_t i = view->layer_index(il);
    GGML_ASSERT(i >= 0);

    // one set of ops for all the streams of the ubatch (its sequences): the ubatch holds the tokens stream
    // after stream, k is [n_embd_head, n_head_kv, n_kv, ns] and kq_mask [n_kv, n_tps, 1, ns]
    const int64_t n_embd_head = q_cur->ne[0];
    const int64_t n_head      = q_cur->ne[1];
    const int64_t n_head_kv   = k->ne[1];
    const int64_t n_kv        = k->ne[2];
    const int64_t ns          = k->ne[3];
    const int64_t n_tps       = q_cur->ne[2]/ns;
    const int64_t n_rows      = std::min<int64_t>(view->params.n_query_rows, n_tps);

    GGML_ASSERT(kq_mask->ne[3] == ns && kq_mask->ne[1] == n_tps);

    // every export is [n_cells, n_head_kv, ns]: all n_kv cells, or the n_cand candidates of the stream
    const int64_t n_cand = view->n_candidates > 0 ? std::min<int64_t>(view->n_candidates, n_kv) : 0;

    const bool on_device = n_cand > 0 && view->params.evidence_alpha > 0.0f && view->selects(n_cand) && inp.sel_mask;

    const size_t n_layers = view->layers.size();

    for (int64_t j = 0; j < ns; ++j) {
        GGML_ASSERT(plan->streams[j] == plan->streams[0] + j); // k's streams
    }

    // the key norms of the candidates; every layer takes those of the cells written since, refreshed or not
    // (they are taken per stream)
    ggml_tensor * kn = n_cand > 0 ? llama_sfi_key_norms(ctx, gf, *view, inp, il, plan->streams[0], ns) : nullptr;

    if (on_device && !view->refreshes(i)) {
        return;
    }

    // the same scores as flash attention: q of the last n_rows tokens of each stream against its (padded) cache,
    // scaled before the product; the GQA group's query heads (h = h_kv*n_gqa + g) and the rows are the columns of
    // one product per KV head: a product broadcast over the query heads reads a KV head's keys once per query head
    const int64_t n_gqa = n_head/n_head_kv;
    const float   cap   = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;

    ggml_tensor * q = ggml_view_4d(ctx, q_cur, n_embd_head, n_head, n_rows, ns,
            q_cur->nb[1], q_cur->nb[2], q_cur->nb[2]*n_tps, (n_tps - n_rows)*q_cur->nb[2]);
    q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3)); // [n_embd_head, n_rows, n_head, ns]
    q = ggml_scale(ctx, ggml_reshape_4d(ctx, q, n_embd_head, n_rows*n_gqa, n_head_kv, ns), cap > 0.0f ? kq_scale/cap : kq_scale);

    // kq [n_kv, n_rows*n_gqa, n_head_kv, nb] -> the scores [n_kv, n_rows, n_head, nb]
    auto scores_of = [&](ggml_tensor * kq) {
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        kq = ggml_reshape_4d(ctx, kq, n_kv, n_rows, kq->ne[1]/n_rows*kq->ne[2], kq->ne[3]);
        return cap > 0.0f ? ggml_scale(ctx, ggml_tanh(ctx, kq), cap) : kq; // flash attention: cap*tanh(scale*kq/cap)
    };

    ggml_tensor * mask = ggml_view_4d(ctx, kq_mask, n_kv, n_rows, 1, ns,
            kq_mask->nb[1], kq_mask->nb[2], kq_mask->nb[3], (n_tps - n_rows)*kq_mask->nb[1]);

    res.mass.resize(n_layers, nullptr);
    res.evidence.resize(n_layers, nullptr);
    res.key_norms.resize(n_layers, nullptr);
    res.cells.resize(n_layers, nullptr);
    res.sel.resize(n_layers, nullptr);
    res.sel_q.resize(n_layers, nullptr);
    res.sel_k.resize(n_layers, nullptr);
    res.sel_sinks.resize(n_layers, nullptr);
    res.sel_kn.resize(n_layers, nullptr);

    const float alpha = view->params.evidence_alpha;

    if (on_device) {
        // the Selector on the device: only its picks leave (no mass, evidence or key-norm export); it runs once,
        // after the last refreshed layer, on every run of refreshed layers with the same number of KV heads;
        // t_sfi_sel[i] and t_sfi_cells[i] are then the outputs of layer i's run
        res.sel_q[i]     = q;
        res.sel_k[i]     = k;
        res.sel_sinks[i] = sinks;
        res.sel_kn[i]    = kn;

        std::vector<size_t> refreshed;
        for (size_t j = 0; j < n_layers; ++j) {
            if (view->refreshes(j)) {
                refreshed.push_back(j);
            }
        }
        if ((size_t) i != refreshed.back()) {
            return;
        }
        for (size_t first = 0, last; first < refreshed.size(); first = last) {
            const int64_t h = res.sel_kn[refreshed[first]]->ne[0];
            for (last = first + 1; last < refreshed.size() && res.sel_kn[refreshed[last]]->ne[0] == h; ++last) {}

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

                bool span = ns == 1 && view->cache_k.t;
                for (size_t j = 0; j < ks.size() && span; ++j) {
                    const ggml_tensor * kj = ks[j];
                    span = refreshed[first + a + j] == l0 + j && kj->view_src == view->cache_k_of(view->layers[l0 + j].il) &&
                        ggml_are_same_shape(kj, k0) && ggml_are_same_stride(kj, k0) && kj->view_offs == k0->view_offs;
                }

                return span ? ggml_view_4d(ctx, view->cache_k.t, k0->ne[0], k0->ne[2], k0->ne[1], (int64_t) ks.size(),
                        k0->nb[2], k0->nb[1], view->cache_k.stride, l0*view->cache_k.stride + k0->view_offs) : nullptr;
            };

            // the scaled scores of the run's layers a .. b-1, stacked: one product of the span's keys with their queries,
            // stacked; else one product per layer, and their scores stacked
            auto scores = [&](size_t a, size_t b) {
                std::vector<ggml_tensor *> qs;
                std::vector<ggml_tensor *> ks;
                if (ggml_tensor * k4 = layers_of(a, b, qs, ks)) {
                    return scores_of(ggml_mul_mat(ctx, k4, llama_sfi_stack(ctx, qs, 3)));
                }

                std::vector<ggml_tensor *> kqs;
                for (size_t j = 0; j < ks.size(); ++j) {
                    kqs.push_back(scores_of(ggml_mul_mat(ctx, ggml_permute(ctx, ks[j], 0, 2, 1, 3), qs[j])));
                }
                return llama_sfi_stack(ctx, kqs, 3);
            };

            const ggml_tensor * q0 = res.sel_q[refreshed[first]];

            // the layers share the cache's mask; the fused op where the keys' backend has it (no sinks, no ALiBi)
            ggml_tensor * evid = nullptr;
            if (std::none_of(sinks_run.begin(), sinks_run.end(), [](const ggml_tensor * t) { return t != nullptr; }) &&
                    hparams.f_max_alibi_bias == 0.0f) {
                std::vector<ggml_tensor *> qs;
                std::vector<ggml_tensor *> ks;
                ggml_tensor * k4 = layers_of(0, last - first, qs, ks);
                evid = llama_sfi_build_evidence_fused(ctx, qs, k4, ks, view->cache_k_of(view->layers[refreshed[first]].il),
                        mask, n_rows, alpha, cap);
            }
            if (!evid) {
                evid = llama_sfi_build_evidence(ctx, last - first, q0->ne[1]*q0->ne[2]*q0->ne[3], scores, sinks_run, mask,
                        hparams.f_max_alibi_bias, alpha, h);
            }

            const auto [cells, picks] = llama_sfi_build_selector(ctx, *view, inp, evid, kns, n_cand, n_rows*(n_head/n_head_kv));

            for (ggml_tensor * t : { cells, picks }) {
                ggml_format_name(t, "%s-%zu", t == cells ? "sfi_cells" : "sfi_sel", refreshed[first]);
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
            for (size_t j = first; j < last; ++j) {
                res.cells[refreshed[j]] = cells;
                res.sel[refreshed[j]]   = picks;
            }

            if (inp.shared) {
                llama_sfi_build_load(ctx, gf, *view, mctx, inp, cells, picks, refreshed, first, last);
                res.gathered = true;
            }
        }
        return;
    }

    // without flash attention the attention just took these probabilities (kq [n_kv, n_tps, n_head, ns]): the
    // export sums its last rows instead of taking the scores and their softmax a second time
    ggml_tensor * p = res.kq;
    if (p && p->ne[0] == n_kv && p->ne[1] == n_tps && p->ne[2] == n_head && p->ne[3] == ns) {
        if (n_rows < n_tps) {
            p = ggml_cont(ctx, ggml_view_4d(ctx, p, n_kv, n_rows, n_head, ns, p->nb[1], p->nb[2], p->nb[3], (n_tps - n_rows)*p->nb[1]));
        }
    } else {
        p = ggml_soft_max_ext(ctx, scores_of(ggml_mul_mat(ctx, ggml_permute(ctx, k, 0, 2, 1, 3), q)), mask, 1.0f, hparams.f_max_alibi_bias);
        ggml_soft_max_add_sinks(p, sinks);
    }

    auto output = [&](ggml_tensor * t, const char * name, std::vector<ggml_tensor *> & dst) {
        ggml_format_name(t, "%s-%d", name, il);
        ggml_set_output(t);
        ggml_build_forward_expand(gf, t);
        dst[i] = t;
    };

    // [n_kv, 1, n_head_kv, ns] -> [n_head_kv, n_kv, ns]: one row per cell
    auto rows_per_cell = [&](ggml_tensor * t) {
        return ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_3d(ctx, t, n_kv, n_head_kv, ns)));
    };

    ggml_tensor * mass = llama_sfi_group_sum(ctx, p, n_head_kv);
    ggml_tensor * evid = alpha > 0.0f ? llama_sfi_group_sum(ctx, llama_sfi_pow(ctx, p, alpha), n_head_kv) : nullptr;

    if (n_cand == 0) {
        output(ggml_reshape_3d(ctx, mass, n_kv, n_head_kv, ns), "sfi_mass", res.mass);
        if (evid) {
            output(ggml_reshape_3d(ctx, evid, n_kv, n_head_kv, ns), "sfi_evidence", res.evidence);
        }

        if (view->params.export_key_norms) {
            ggml_tensor * kn = ggml_cast(ctx, k, GGML_TYPE_F32);           // [n_embd_head_k, n_head_kv, n_kv, ns]
            kn = ggml_sqrt(ctx, ggml_sum_rows(ctx, ggml_sqr(ctx, kn)));    // [1, n_head_kv, n_kv, ns]
            kn = ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_3d(ctx, kn, n_head_kv, n_kv, ns))); // [n_kv, n_head_kv, ns]
            output(kn, "sfi_key_norms", res.key_norms);
        }
        return;
    }

    // candidates: the n_cand cells with the most evidence (else mass) summed over the layer's KV heads, per
    // stream, so that only [n_cand, n_head_kv] values per layer and stream leave the device
    ggml_tensor * mass_rows = rows_per_cell(mass);                      // [n_head_kv, n_kv, ns]
    ggml_tensor * evid_rows = evid ? rows_per_cell(evid) : nullptr;

    ggml_tensor * score = ggml_sum_rows(ctx, evid_rows ? evid_rows : mass_rows); // [1, n_kv, ns]
    ggml_tensor * cells = ggml_top_k(ctx, ggml_reshape_2d(ctx, score, n_kv, ns), n_cand); // I32 [n_cand, ns]
    output(cells, "sfi_cells", res.cells);

    auto at_cells = [&](ggml_tensor * rows) { // [n_head_kv, n_kv, ns] -> [n_cand, n_head_kv, ns]
        return ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, rows, cells)));
    };

    output(at_cells(mass_rows), "sfi_mass", res.mass);
    if (evid_rows) {
        output(at_cells(evid_rows), "sfi_evidence", res.evidence);
    }

    if (view->params.export_key_norms) {
        output(llama_sfi_key_norms_at(ctx, kn, cells), "sfi_key_norms", res.key_norms);
    }
}
