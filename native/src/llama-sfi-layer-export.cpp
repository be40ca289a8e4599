// One layer's export in the slow step's graph, and the ops the export and the device Selector both use
#include "llama-sfi-layer-export.h"

#include "llama-sfi-ubatch-graph.h"

#include <cstdint>
#include <utility>

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

// ts stacked with one copy of each: the slices along dim are contiguous blocks of the stack when the dimensions
// past dim are 1, so the first is padded with zeros to the whole, flat (a flat pad keeps CUDA's grid limits out of
// the way), and the others are set into it in place; nullptr where that does not apply (shapes, types, offsets past
// set's int32 params) or the backend of storage lacks pad or set
static ggml_tensor * llama_sfi_stack_in_place(ggml_context * ctx, const std::vector<ggml_tensor *> & ts, int dim,
        const ggml_tensor * storage) {
    const ggml_tensor * t0 = ts[0];
    const size_t bytes = ggml_nbytes(t0);
    if (bytes*ts.size() > (size_t) INT32_MAX) {
        return nullptr;
    }
    for (const ggml_tensor * t : ts) {
        if (t->type != GGML_TYPE_F32 || !ggml_are_same_shape(t, t0) || !ggml_is_contiguous(t)) {
            return nullptr;
        }
    }
    for (int d = dim + 1; d < GGML_MAX_DIMS; ++d) {
        if (t0->ne[d] != 1) {
            return nullptr;
        }
    }
    const int64_t n = ggml_nelements(t0);
    auto flat = [&](ggml_tensor * t) { return ggml_reshape_1d(ctx, t, n); };

    ggml_tensor * stack = ggml_pad(ctx, flat(ts[0]), (int) (n*(ts.size() - 1)), 0, 0, 0);
    if (!llama_sfi_backend_has(stack, storage)) {
        return nullptr;
    }
    for (size_t l = 1; l < ts.size(); ++l) {
        ggml_tensor * next = ggml_set_1d_inplace(ctx, stack, flat(ts[l]), l*bytes);
        if (l == 1 && !llama_sfi_backend_has(next, storage)) {
            return nullptr;
        }
        stack = next;
    }
    int64_t ne[GGML_MAX_DIMS];
    for (int d = 0; d < GGML_MAX_DIMS; ++d) {
        ne[d] = d == dim ? t0->ne[d]*(int64_t) ts.size() : t0->ne[d];
    }
    return ggml_reshape_4d(ctx, stack, ne[0], ne[1], ne[2], ne[3]);
}

ggml_tensor * llama_sfi_stack(ggml_context * ctx, std::vector<ggml_tensor *> ts, int dim, const ggml_tensor * storage) {
    if (storage && ts.size() > 1) {
        if (ggml_tensor * stack = llama_sfi_stack_in_place(ctx, ts, dim, storage)) {
            return stack;
        }
    }
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

ggml_tensor * llama_sfi_layer_export::scores(ggml_tensor * kq) const {
    ggml_prec_set_acc(kq, GGML_PREC_F32);
    kq = ggml_reshape_4d(ctx, kq, n_kv, n_rows, kq->ne[1]/n_rows*kq->ne[2], kq->ne[3]);
    return cap > 0.0f ? ggml_scale(ctx, ggml_tanh(ctx, kq), cap) : kq; // flash attention: cap*tanh(scale*kq/cap)
}

ggml_tensor * llama_sfi_layer_export::scores(ggml_tensor * k_l, ggml_tensor * q_l) const {
    return scores(ggml_mul_mat(ctx, ggml_permute(ctx, k_l, 0, 2, 1, 3), q_l));
}

ggml_tensor * llama_sfi_layer_export::softmax(ggml_tensor * kq, ggml_tensor * sinks_l) const {
    ggml_tensor * p = ggml_soft_max_ext(ctx, kq, mask, 1.0f, max_bias);
    ggml_soft_max_add_sinks(p, sinks_l);
    return p;
}

void llama_sfi_layer_export::output(ggml_tensor * t, const char * name, std::vector<ggml_tensor *> & dst) const {
    ggml_format_name(t, "%s-%d", name, il);
    ggml_set_output(t);
    ggml_build_forward_expand(gf, t);
    dst[i] = t;
}
