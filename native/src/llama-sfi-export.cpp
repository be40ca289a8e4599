// The slow step's export of a layer: the attention mass, evidence and key norms of the last query rows, of every
// cell or of candidates chosen on the device; with the device Selector, its selection (llama-sfi-selector.cpp)
#include "llama-sfi-export.h"

#include "llama-sfi-ubatch-graph.h"
#include "llama-sfi-layer-export.h"
#include "llama-sfi-selector.h"
#include "llama-sfi-view.h"

#include "llama-hparams.h"
#include "llama-kv-cache.h"

#include "ggml-sfi.h"

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <cstring>

// key norms are taken for at most this many cells per set of ops (the first SLOW step takes every cell's: its
// keys, gathered as F32, would otherwise take GBs of compute buffer)
static constexpr int64_t LLAMA_SFI_KEY_NORM_CHUNK = 16384;

// the key norms ||K|| of every cell of layer il, for the streams s0 .. s0+ns-1: [n_head_kv, kv_size, ns], after the
// ops that take those of the cells in inp.kn_cells (written since they were last taken; once per layer and graph, for
// all its runs), dequantized to F32; the Selector gathers them at its candidates instead of gathering and squaring
// every candidate's keys per layer
static ggml_tensor * llama_sfi_key_norms(ggml_context * ctx, ggml_cgraph * gf, const llama_sfi_view & view,
        const llama_sfi_graph_input & inp, llama_sfi_graph_result & graph, int32_t il, uint32_t s0, int64_t ns) {
    const int32_t i = view.layer_index(il);
    const auto &  l = view.layers.at(i);

    graph.key_norms.resize(view.layers.size(), nullptr);

    ggml_tensor * kn = graph.key_norms[i] ? graph.key_norms[i] : l.kn;

    if (inp.kn_cells && !graph.key_norms[i]) {
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
        graph.key_norms[i] = kn;
    }

    return ggml_view_3d(ctx, kn, l.n_head_kv, l.kn->ne[1], ns, l.kn->nb[1], l.kn->nb[2], s0*l.kn->nb[2]);
}

// the probabilities of the layer's attention at the query rows, [n_kv, n_rows, n_head, ns]
static ggml_tensor * llama_sfi_export_probs(const llama_sfi_layer_export & ex) {
    ggml_context * ctx = ex.ctx;

    // without flash attention the attention just took them (kq [n_kv, n_tps, n_head, ns]): the export sums its last
    // rows instead of taking the scores and their softmax a second time
    ggml_tensor * p = ex.graph.kq;
    if (p && p->ne[0] == ex.n_kv && p->ne[1] == ex.n_tps && p->ne[2] == ex.n_head && p->ne[3] == ex.ns) {
        if (ex.n_rows < ex.n_tps) {
            p = ggml_cont(ctx, ggml_view_4d(ctx, p, ex.n_kv, ex.n_rows, ex.n_head, ex.ns, p->nb[1], p->nb[2], p->nb[3],
                        (ex.n_tps - ex.n_rows)*p->nb[1]));
        }
        return p;
    }

    return ex.softmax(ex.scores(ex.k, ex.q), ex.sinks);
}

// every cell's mass [n_kv, 1, n_head_kv, ns] and evidence (nullptr when alpha is 0)
static std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_export_sums(const llama_sfi_layer_export & ex, ggml_tensor * p) {
    const float alpha = ex.view.params.evidence_alpha;

    ggml_tensor * mass = llama_sfi_group_sum(ex.ctx, p, ex.n_head_kv);
    ggml_tensor * evid = alpha > 0.0f ? llama_sfi_group_sum(ex.ctx, llama_sfi_pow(ex.ctx, p, alpha), ex.n_head_kv) : nullptr;

    return { mass, evid };
}

// the export of every cell: [n_kv, n_head_kv, ns], cell i in column i
static void llama_sfi_export_every_cell(const llama_sfi_layer_export & ex) {
    ggml_context * ctx = ex.ctx;

    const auto [mass, evid] = llama_sfi_export_sums(ex, llama_sfi_export_probs(ex));

    ex.output(ggml_reshape_3d(ctx, mass, ex.n_kv, ex.n_head_kv, ex.ns), "sfi_mass", ex.res.mass);
    if (evid) {
        ex.output(ggml_reshape_3d(ctx, evid, ex.n_kv, ex.n_head_kv, ex.ns), "sfi_evidence", ex.res.evidence);
    }

    if (ex.kn) {
        ggml_tensor * kn = ggml_view_3d(ctx, ex.kn, ex.n_head_kv, ex.n_kv, ex.ns, ex.kn->nb[1], ex.kn->nb[2], 0);
        ex.output(ggml_cont(ctx, ggml_transpose(ctx, kn)), "sfi_key_norms", ex.res.key_norms);
    }
}

// the export of the n_cand cells with the most evidence (else mass) summed over the layer's KV heads, per stream, so
// that only [n_cand, n_head_kv] values per layer and stream leave the device; the cells [n_cand, ns]
static void llama_sfi_export_candidates(const llama_sfi_layer_export & ex) {
    ggml_context * ctx = ex.ctx;

    const auto [mass, evid] = llama_sfi_export_sums(ex, llama_sfi_export_probs(ex));

    // [n_kv, 1, n_head_kv, ns] -> [n_head_kv, n_kv, ns]: one row per cell
    auto rows_per_cell = [&](ggml_tensor * t) {
        return ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_3d(ctx, t, ex.n_kv, ex.n_head_kv, ex.ns)));
    };

    ggml_tensor * mass_rows = rows_per_cell(mass);
    ggml_tensor * evid_rows = evid ? rows_per_cell(evid) : nullptr;

    ggml_tensor * score = ggml_sum_rows(ctx, evid_rows ? evid_rows : mass_rows); // [1, n_kv, ns]
    // I32 [n_cand, ns], by a selection where the keys' backend has it (ggml's top-k is a heap: ~60 ms per slow step for
    // the default model's 24 layers at 16K cells on two CPU cores)
    ggml_tensor * cells = llama_sfi_top_k(ctx, ex.view.params, ggml_reshape_2d(ctx, score, ex.n_kv, ex.ns), (int) ex.n_cand, false,
            ex.view.cache_k_of(ex.il));
    ex.output(cells, "sfi_cells", ex.res.cells);

    auto at_cells = [&](ggml_tensor * rows) { // [n_head_kv, n_kv, ns] -> [n_cand, n_head_kv, ns]
        return ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, rows, cells)));
    };

    ex.output(at_cells(mass_rows), "sfi_mass", ex.res.mass);
    if (evid_rows) {
        ex.output(at_cells(evid_rows), "sfi_evidence", ex.res.evidence);
    }

    if (ex.kn) {
        ex.output(llama_sfi_key_norms_at(ctx, ex.kn, cells), "sfi_key_norms", ex.res.key_norms);
    }
}

// the layer's flash attention (attn: build_attn_mha's output, a reshape of it) as ggml_sfi_flash_attn_evidence, which
// also gives the device Selector the layer's evidence and key norms from its one read of the keys, where the keys'
// backend has the op; nullptr where it does not apply (no flash attention, sinks, ALiBi, query rows that are not all
// the step's tokens, V transposed). Its output equals flash attention's up to rounding, so such a slow step is not
// bit-identical to a dense one. llama_sfi_params.fa_evidence 1 takes it on every backend that has it, 0 on none; -1
// on the keys of a device, and on a cache kept in host memory for layers on a device (kv_on_host), whose slow steps
// attend on the CPU: the op reads each key and value once for all the query heads of its group, where flash
// attention reads them once per query head and the evidence op the keys again. Not on a CPU-only model's cache: the
// CPU's op is the reference, and the CPU decodes faster without flash attention anyway.
static ggml_tensor * llama_sfi_fused_attention(const llama_sfi_layer_export & ex, ggml_tensor * attn) {
    const int32_t wanted = ex.view.params.fa_evidence; // 1, 0, or -1: by where the keys are
    const ggml_tensor * keys = ex.view.cache_k_of(ex.il); // the cache's own tensor, not a view: it has its buffer
    const bool enabled = wanted == 1 ||
        (wanted < 0 && keys->buffer && (!ggml_backend_buffer_is_host(keys->buffer) || ex.view.cache_on_host));
    ggml_tensor * fa = attn ? attn->view_src : nullptr;
    if (!enabled || !fa || fa->op != GGML_OP_FLASH_ATTN_EXT || fa->src[4] || ex.n_rows != ex.n_tps) {
        return nullptr;
    }
    // ggml_flash_attn_ext's params: scale, max_bias, softcap
    float params[3];
    memcpy(params, fa->op_params, sizeof(params));
    const float scale    = params[0];
    const float max_bias = params[1];
    const float softcap  = params[2];

    ggml_tensor * q    = fa->src[0];
    ggml_tensor * k    = fa->src[1];
    ggml_tensor * v    = fa->src[2];
    ggml_tensor * mask = fa->src[3];
    if (max_bias != 0.0f || !mask || q->type != GGML_TYPE_F32 || mask->type != GGML_TYPE_F16 ||
            k->nb[0] != ggml_type_size(k->type) || v->nb[0] != ggml_type_size(v->type)) {
        return nullptr;
    }

    ggml_tensor * op = ggml_sfi_flash_attn_evidence(ex.ctx, q, k, v, mask, scale, softcap, ex.view.params.evidence_alpha, true);
    if (!llama_sfi_backend_runs(ex.view.params, op, keys)) {
        return nullptr;
    }
    // build_attn_mha has put flash attention in the graph already: the fused op takes its node, so that flash
    // attention does not run as well, and attn, a view of that node, reads the fused op's output, which starts with
    // flash attention's (same layout)
    fa->type = op->type;
    memcpy(fa->ne,        op->ne,        sizeof(fa->ne));
    memcpy(fa->nb,        op->nb,        sizeof(fa->nb));
    memcpy(fa->op_params, op->op_params, sizeof(fa->op_params));
    memcpy(fa->src,       op->src,       sizeof(fa->src));
    fa->op = op->op;
    return fa;
}

// streams j0 .. j0+n-1 of t, whose dim d is the ubatch's streams
static ggml_tensor * llama_sfi_streams(ggml_context * ctx, ggml_tensor * t, int d, uint32_t j0, uint32_t n) {
    int64_t ne[GGML_MAX_DIMS];
    for (int k = 0; k < GGML_MAX_DIMS; ++k) {
        ne[k] = k == d ? n : t->ne[k];
    }
    return ggml_view_4d(ctx, t, ne[0], ne[1], ne[2], ne[3], t->nb[1], t->nb[2], t->nb[3], j0*t->nb[d]);
}

// the SLOW inputs of streams j0 .. j0+n-1 of the ubatch (inp itself when they are all of them)
static llama_sfi_graph_input llama_sfi_run_inputs(ggml_context * ctx, const llama_sfi_graph_input & inp, uint32_t j0, uint32_t n) {
    llama_sfi_graph_input run = inp;
    if (inp.sel_mask && (j0 > 0 || n < inp.sel_mask->ne[3])) {
        run.sel_mask = llama_sfi_streams(ctx, inp.sel_mask, 3, j0, n);
        run.sel_u    = llama_sfi_streams(ctx, inp.sel_u,    2, j0, n);
        if (inp.shared) {
            run.shared = llama_sfi_streams(ctx, inp.shared, 2, j0, n);
        }
    }
    return run;
}

// the export of layer il for the SLOW streams s0 .. s0+ns-1 (ns = k->ne[3]) of a run, whose attention attn just gave;
// returns the attention's output to go on with (see llama_sfi_build_attn)
static ggml_tensor * llama_sfi_build_export(
        ggml_context * ctx,
         ggml_cgraph * gf,
        llama_sfi_graph_result & graph,
        llama_sfi_run_export & res,
        const llama_sfi_plan & plan,
        const llama_sfi_graph_input  & inp,
        const llama_hparams & hparams,
            uint32_t   s0,
         ggml_tensor * q_cur,
         ggml_tensor * k,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
         ggml_tensor * attn,
                 int   il) {
    const auto & view = plan.view;

    const int32_t i = view.layer_index(il);
    GGML_ASSERT(i >= 0);

    // one set of ops for all the streams of the run (its sequences): the ubatch holds the tokens stream after stream,
    // k is [n_embd_head, n_head_kv, n_kv, ns] and kq_mask [n_kv, n_tps, 1, ns]
    const int64_t n_embd_head = q_cur->ne[0];
    const int64_t n_head      = q_cur->ne[1];
    const int64_t n_head_kv   = k->ne[1];
    const int64_t n_kv        = k->ne[2];
    const int64_t ns          = k->ne[3];
    const int64_t n_tps       = q_cur->ne[2]/ns;
    const int64_t n_rows      = std::min<int64_t>(view.n_query_rows, n_tps);

    GGML_ASSERT(kq_mask->ne[3] == ns && kq_mask->ne[1] == n_tps);

    res.s0 = s0;
    res.ns = ns;

    // every export is [n_cells, n_head_kv, ns]: all n_kv cells, or the n_cand candidates of the stream
    const int64_t n_cand = view.n_candidates > 0 ? std::min<int64_t>(view.n_candidates, n_kv) : 0;

    // the device Selector runs in this graph (llama_sfi_build_inputs gave it its inputs)
    const bool selects = inp.sel_mask && view.params.evidence_alpha > 0.0f;

    // the same scores as flash attention: q of the last n_rows tokens of each stream against its (padded) cache,
    // scaled before the product; the GQA group's query heads (h = h_kv*n_gqa + g) and the rows are the columns of
    // one product per KV head: a product broadcast over the query heads reads a KV head's keys once per query head
    const int64_t n_gqa = n_head/n_head_kv;
    const float   cap   = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;

    ggml_tensor * q = ggml_view_4d(ctx, q_cur, n_embd_head, n_head, n_rows, ns,
            q_cur->nb[1], q_cur->nb[2], q_cur->nb[2]*n_tps, (n_tps - n_rows)*q_cur->nb[2]);
    q = ggml_cont(ctx, ggml_permute(ctx, q, 0, 2, 1, 3)); // [n_embd_head, n_rows, n_head, ns]
    q = ggml_scale(ctx, ggml_reshape_4d(ctx, q, n_embd_head, n_rows*n_gqa, n_head_kv, ns), cap > 0.0f ? kq_scale/cap : kq_scale);

    ggml_tensor * mask = ggml_view_4d(ctx, kq_mask, n_kv, n_rows, 1, ns,
            kq_mask->nb[1], kq_mask->nb[2], kq_mask->nb[3], (n_tps - n_rows)*kq_mask->nb[1]);

    const size_t n_layers = view.layers.size();

    for (auto * ts : { &res.mass, &res.evidence, &res.key_norms, &res.cells, &res.sel, &res.sel_q, &res.sel_k, &res.sel_sinks, &res.sel_kn, &res.sel_fae }) {
        ts->resize(n_layers, nullptr);
    }

    llama_sfi_layer_export ex = {
        /*.ctx       =*/ ctx,
        /*.gf        =*/ gf,
        /*.view      =*/ view,
        /*.inp       =*/ inp,
        /*.res       =*/ res,
        /*.graph     =*/ graph,
        /*.i         =*/ i,
        /*.il        =*/ il,
        /*.s0        =*/ s0,
        /*.n_kv      =*/ n_kv,
        /*.n_head    =*/ n_head,
        /*.n_head_kv =*/ n_head_kv,
        /*.ns        =*/ ns,
        /*.n_tps     =*/ n_tps,
        /*.n_rows    =*/ n_rows,
        /*.n_cand    =*/ n_cand,
        /*.cap       =*/ cap,
        /*.max_bias  =*/ hparams.f_max_alibi_bias,
        /*.q         =*/ q,
        /*.k         =*/ k,
        /*.mask      =*/ mask,
        /*.sinks     =*/ sinks,
        /*.kn        =*/ nullptr,
    };

    // the key norms of every cell; every layer takes those of the cells written since, refreshed or not (they are
    // taken per stream), unless the device Selector takes them from its evidence op, which reads every key anyway
    const bool fused = selects && llama_sfi_selector_fused(ex);
    if (selects ? !fused : view.params.export_key_norms) {
        ex.kn = llama_sfi_key_norms(ctx, gf, view, inp, graph, il, s0, ns);
    }
    if (selects) {
        // the first layer's verdict, unless a later one keeps its own (graphs are built layer by layer)
        plan.view.selector_own_key_norms = (i > 0 && view.selector_own_key_norms) || !fused;
    }

    if (selects && !view.refreshes(i)) {
        return attn;
    }

    if (selects) {
        if (ggml_tensor * fae = fused ? llama_sfi_fused_attention(ex, attn) : nullptr) {
            ggml_format_name(fae, "sfi_fae-%d", il);
            res.sel_fae[i] = fae; // attn now reads its output
        }
        llama_sfi_build_selection(ex);
    } else if (n_cand == 0) {
        llama_sfi_export_every_cell(ex);
    } else {
        llama_sfi_export_candidates(ex);
    }
    return attn;
}

// FAST that captures: the last token's queries of each stream of the ubatch, q [n_embd_head, n_head, n_tokens] ->
// F32 [n_embd_head, n_head, ns] scaled as the evidence op takes them (llama_sfi_host_export reads them)
static void llama_sfi_capture_queries(ggml_context * ctx, ggml_cgraph * gf, llama_sfi_graph_result & res,
        const llama_sfi_plan & plan, const llama_hparams & hparams, ggml_tensor * q, float kq_scale, int il) {
    const int32_t i = plan.view.layer_index(il);
    if (i < 0) {
        return;
    }

    const int64_t ns    = plan.streams.size();
    const int64_t n_tps = q->ne[2]/ns;
    const float   cap   = hparams.attn_soft_cap ? hparams.f_attn_logit_softcapping : 0.0f;

    ggml_tensor * last = ggml_view_3d(ctx, q, q->ne[0], q->ne[1], ns, q->nb[1], n_tps*q->nb[2], (n_tps - 1)*q->nb[2]);
    ggml_tensor * t    = ggml_scale(ctx, ggml_cont(ctx, last), cap > 0.0f ? kq_scale/cap : kq_scale);
    ggml_set_output(t);
    ggml_format_name(t, "sfi_queries-%d", il);
    ggml_build_forward_expand(gf, t);

    res.queries.resize(plan.view.layers.size(), nullptr);
    res.queries[i]    = t;
    res.query_streams = plan.streams;
}

ggml_tensor * llama_sfi_build_attn(
        ggml_context * ctx,
         ggml_cgraph * gf,
        llama_sfi_graph_result & res,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
        const llama_hparams & hparams,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * v,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
                 int   il,
        const llama_sfi_attn_fn & attn) {
    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (plan && plan->capturing) {
        llama_sfi_capture_queries(ctx, gf, res, *plan, hparams, q, kq_scale, il);
    }
    if (!plan || (!plan->mixed() && !plan->exporting)) {
        return attn(q, k, v, kq_mask);
    }

    if (!plan->mixed()) {
        // SLOW: one run of every stream
        res.runs.resize(1);
        ggml_tensor * cur = attn(q, k, v, kq_mask);
        return llama_sfi_build_export(ctx, gf, res, res.runs[0], *plan, inp, hparams, plan->streams[0], q, k, kq_mask, sinks,
                kq_scale, cur, il);
    }

    // MIXED: per run, its tokens' queries over its streams' keys and values (the view's for FAST runs); the outputs
    // joined in ubatch order
    const int64_t n_tps = q->ne[2]/(int64_t) plan->streams.size();

    // the run's streams of t, whose dim 3 is the ubatch's streams
    auto streams = [&](ggml_tensor * t, const llama_sfi_run & run) { return llama_sfi_streams(ctx, t, 3, run.j0, run.n); };

    std::vector<ggml_tensor *> outs;
    size_t n_slow = 0;
    for (const auto & run : plan->runs) {
        ggml_tensor * q_r = ggml_view_3d(ctx, q, q->ne[0], q->ne[1], run.n*n_tps, q->nb[1], q->nb[2], run.j0*n_tps*q->nb[2]);

        const uint32_t s0 = plan->streams[run.j0];

        if (run.step == LLAMA_SFI_STEP_FAST) {
            const uint32_t s1 = plan->streams[run.j0 + run.n - 1];
            outs.push_back(attn(q_r, plan->view.get_k(ctx, il, plan->n_view, s0, s1), plan->view.get_v(ctx, il, plan->n_view, s0, s1),
                        streams(inp.fast_mask, run)));
            continue;
        }

        ggml_tensor * k_r    = streams(k, run);
        ggml_tensor * mask_r = streams(kq_mask, run);
        ggml_tensor * cur    = attn(q_r, k_r, streams(v, run), mask_r);
        if (run.step == LLAMA_SFI_STEP_SLOW && plan->exporting) {
            if (res.runs.size() <= n_slow) {
                res.runs.resize(n_slow + 1);
            }
            res.runs[n_slow].j0 = run.j0;
            cur = llama_sfi_build_export(ctx, gf, res, res.runs[n_slow], *plan, llama_sfi_run_inputs(ctx, inp, run.j0, run.n),
                    hparams, s0, q_r, k_r, mask_r, sinks, kq_scale, cur, il);
            n_slow++;
        }
        outs.push_back(cur);
    }

    ggml_tensor * cur = outs[0];
    for (size_t r = 1; r < outs.size(); ++r) {
        cur = ggml_concat(ctx, cur, outs[r], 1);
    }
    return cur;
}
