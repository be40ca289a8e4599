// The device Selector in the slow step's graph: the evidence of a stack of layers, scored and cut to the k_head best
// cells per layer and KV head (sfi_gguf/selector.py is the reference)
#include "llama-sfi-selector.h"

#include "llama-sfi-export.h"
#include "llama-sfi-graph.h"
#include "llama-sfi-view.h"

#include "ggml-sfi.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <limits>

// the device Selector's softmaxes take at least this many rows at a time (layers stacked): a softmax runs
// one row per GPU block, and one layer's rows (one per head) keep most of a GPU's multiprocessors idle
static constexpr int64_t LLAMA_SFI_SOFTMAX_ROWS = 256;

ggml_tensor * llama_sfi_build_evidence(
        ggml_context * ctx,
              size_t   n,
             int64_t   rows,
        const std::function<ggml_tensor * (size_t, size_t)> & scores,
        const std::vector<ggml_tensor *> & sinks,
         ggml_tensor * mask,
               float   max_bias,
               float   alpha,
             int64_t   n_head_kv) {
    const bool   any_sinks = std::any_of(sinks.begin(), sinks.end(), [](const ggml_tensor * t) { return t != nullptr; });
    const size_t n_stack   = any_sinks ? 1 : (size_t) std::max<int64_t>(1, (LLAMA_SFI_SOFTMAX_ROWS + rows - 1)/rows);

    std::vector<ggml_tensor *> evids;
    for (size_t first = 0; first < n; first += n_stack) {
        const size_t last = std::min(first + n_stack, n);

        ggml_tensor * p = ggml_soft_max_ext(ctx, scores(first, last), mask, 1.0f, max_bias);
        ggml_soft_max_add_sinks(p, n_stack == 1 ? sinks[first] : nullptr);

        evids.push_back(llama_sfi_group_sum(ctx, llama_sfi_pow(ctx, p, alpha), n_head_kv));
    }

    return llama_sfi_stack(ctx, evids, 3);
}

// the fused evidence op (ggml_sfi_evidence) runs where the keys are, when that backend has it; RPC reports every op
// as supported without asking its server, so it keeps the composite ops. LLAMA_SFI_FUSED=0 keeps them everywhere
// (for comparisons).
static bool llama_sfi_backend_runs(const ggml_tensor * op, const ggml_tensor * storage) {
    static const bool fused = [] {
        const char * env = getenv("LLAMA_SFI_FUSED");
        return !env || strcmp(env, "0") != 0;
    }();
    if (!fused || !storage->buffer) {
        return false;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(storage->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); // the CPU buffer type names no device
    }
    if (!dev || strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0) {
        return false;
    }
    return ggml_backend_dev_supports_op(dev, op);
}

ggml_tensor * llama_sfi_build_evidence_fused(
        ggml_context * ctx,
        const std::vector<ggml_tensor *> & qs,
         ggml_tensor * k4,
        const std::vector<ggml_tensor *> & ks,
         ggml_tensor * storage,
         ggml_tensor * mask,
             int64_t   n_rows,
               float   alpha,
               float   cap) {
    std::vector<ggml_tensor *> evids;
    if (k4) {
        evids.push_back(ggml_sfi_evidence(ctx, llama_sfi_stack(ctx, qs, 3), k4, mask, n_rows, alpha, cap));
    } else {
        for (size_t l = 0; l < qs.size(); ++l) {
            evids.push_back(ggml_sfi_evidence(ctx, qs[l], ggml_permute(ctx, ks[l], 0, 2, 1, 3), mask, n_rows, alpha, cap));
        }
    }
    if (!llama_sfi_backend_runs(evids[0], storage)) {
        return nullptr;
    }
    for (ggml_tensor *& e : evids) {
        e = ggml_reshape_4d(ctx, e, e->ne[0], 1, e->ne[1], e->ne[2]);
    }
    return llama_sfi_stack(ctx, evids, 3);
}

std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_build_selector(
        ggml_context * ctx,
        const llama_sfi_view & view,
        const llama_sfi_graph_input & inp,
         ggml_tensor * evid,
        const std::vector<ggml_tensor *> & kns,
             int64_t   n_cand,
             int64_t   n_rows) {
    const auto & sp = view.selector;

    const int64_t n_kv      = evid->ne[0];
    const int64_t n_head_kv = evid->ne[2];
    const int64_t ns        = kns[0]->ne[2];
    const int64_t nb        = evid->ne[3]; // (layer, stream) pairs

    // the range mask broadcasts over the layers (b % ns); the relative positions are gathered per pair
    ggml_tensor * mask = inp.sel_mask;

    auto per_pair = [&](ggml_tensor * t) { // [n, n_kv, ns] -> [n, n_kv, nb]
        return nb == ns ? t : ggml_repeat_4d(ctx, t, t->ne[0], n_kv, nb, 1);
    };

    const float tiny = std::numeric_limits<float>::min();
    const float big  = std::numeric_limits<float>::max();

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
    ggml_tensor * cells = ggml_top_k(ctx, score, n_cand); // [n_cand, nb]

    // one gather of every value the Selector reads per candidate, f of each head, its relative position u and
    // the range mask: a gather of one-value rows costs about as much as one of ten
    ggml_tensor * vals = ggml_concat(ctx, ggml_cont(ctx, ggml_transpose(ctx, ggml_reshape_3d(ctx, f, n_kv, n_head_kv, nb))),
            per_pair(ggml_concat(ctx, inp.sel_u, ggml_reshape_3d(ctx, mask, 1, n_kv, ns), 0)), 0); // [n_head_kv + 2, n_kv, nb]
    vals = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, vals, cells)));                          // [n_cand, n_head_kv + 2, nb]

    auto vals_rows = [&](int64_t first, int64_t n) {
        return ggml_cont(ctx, ggml_view_3d(ctx, vals, n_cand, n, nb, vals->nb[1], vals->nb[2], first*vals->nb[1]));
    };

    // from here on one row per (head, pair): [n_cand, n_head_kv, nb]
    ggml_tensor * fc = vals_rows(0, n_head_kv);
    fc = ggml_div(ctx, fc, ggml_sum_rows(ctx, fc));

    // structural prior r ~ ||K||^e delta(u)^w_pos; the key norms come from each layer's norms per cell
    std::vector<ggml_tensor *> norms;
    for (size_t l = 0; l < kns.size(); ++l) {
        ggml_tensor * cells_l = ggml_view_2d(ctx, cells, n_cand, ns, cells->nb[1], l*ns*cells->nb[1]);
        norms.push_back(llama_sfi_key_norms_at(ctx, kns[l], cells_l));
    }
    ggml_tensor * kn = llama_sfi_stack(ctx, norms, 2);

    // position prior w_pos*(-pos_beta*u^pos_power + pos_eta*log(1 - u)) of the candidates, -inf outside the range
    ggml_tensor * u      = vals_rows(n_head_kv, 1);
    ggml_tensor * m      = vals_rows(n_head_kv + 1, 1);
    ggml_tensor * u_pow  = ggml_exp(ctx, ggml_scale(ctx, ggml_log(ctx, u), sp.pos_power)); // u = 0: exp(-inf) = 0
    ggml_tensor * prior  = ggml_add(ctx, ggml_scale(ctx, ggml_add(ctx, ggml_scale(ctx, u_pow, -sp.pos_beta),
                ggml_scale(ctx, ggml_log(ctx, ggml_scale_bias(ctx, u, -1.0f, 1.0f)), sp.pos_eta)), sp.w_pos), m);

    ggml_tensor * r = ggml_soft_max(ctx, ggml_add(ctx, ggml_scale(ctx, ggml_log(ctx, ggml_clamp(ctx, kn, tiny, big)), sp.key_norm_exponent), prior));

    // q = f - lambda (f - r), lambda = <f, f - r>/||f - r||^2 clipped
    const float lambda_max = n_rows == 1 ? sp.lambda_clip_single : sp.lambda_clip_multi;

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

    // the k_head best per (head, pair): one sort per row (a row loop of top-k calls costs more on CUDA)
    ggml_set_name(sc, "sfi_sel_score");

    return { cells, ggml_cont(ctx, ggml_argsort_top_k(ctx, sc, sp.k_head)) };
}
