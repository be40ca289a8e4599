// sfi-test-ops: the SFI ggml ops (ggml-sfi.h) on every backend against their definition, in the manner of llama.cpp's
// test-backend-ops: each case builds its inputs once and runs the op on each backend that supports it.
// ggml_sfi_evidence is compared by normalised mean squared error with the composite ggml ops it replaces, computed on
// the CPU (whose products round the queries to the keys' vec_dot type, as its attention does), and its key norms with
// the norms of the keys' values; ggml_sfi_top_k's
// indices must equal those of a sort by value and index exactly.
// Prints one line per case and backend; exits 1 if any case fails. Usage: sfi-test-ops [-v]
// sfi-test-ops perf [--cpu] [-s streams] [-t f16|q8_0|q4_0] [n_kv ...] times the ops instead, on each backend but the CPU
// (--cpu: on the CPU too, on every core: a slow step over a cache in host memory runs there), at a
// slow step's shape (a Qwen3-4B cache: 36 layers, 8 KV heads of 128, 4 query heads each, keys in the cache's layout, of
// -t's type, F16 by default); with -s, the attention of a batched slow step of that many streams (one KV stream per
// sequence), keys and values of -t's type; and a decode's picks from a vocabulary's logits, greedy's against the
// sampling ops', for one sequence and for -s

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpu.h"
#include "ggml-sfi.h"

#include <algorithm>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

struct evidence_case {
    int64_t    n_embd;
    int64_t    n_rows;    // token rows
    int64_t    n_gqa;     // query heads per KV head
    int64_t    n_head_kv;
    int64_t    n_kv;
    int64_t    nb;        // layers x streams
    int64_t    nm;        // mask batches (nb % nm == 0)
    ggml_type  type_k;
    ggml_type  type_mask;
    float      alpha;
    float      softcap;
    bool       transposed_k; // k given as a permuted view of [n_embd, n_head_kv, n_kv, nb], as the cache holds it
    bool       key_norms = true;

    std::string name() const {
        char buf[256];
        snprintf(buf, sizeof(buf), "sfi_evidence(D=%lld,rows=%lld,gqa=%lld,hkv=%lld,n_kv=%lld,nb=%lld,nm=%lld,k=%s,mask=%s,alpha=%g,cap=%g,perm=%d,norms=%d)",
                (long long) n_embd, (long long) n_rows, (long long) n_gqa, (long long) n_head_kv, (long long) n_kv,
                (long long) nb, (long long) nm, ggml_type_name(type_k), ggml_type_name(type_mask), alpha, softcap, transposed_k,
                key_norms);
        return buf;
    }
};

// the inputs of a case as F32 values: q, k (already rounded to type_k) and the mask
struct evidence_inputs {
    std::vector<float> q, k, mask;
};

static std::vector<float> round_to(ggml_type type, const std::vector<float> & x, int64_t n_per_row) {
    if (type == GGML_TYPE_F32) {
        return x;
    }
    const int64_t n_rows = (int64_t) x.size()/n_per_row;
    std::vector<uint8_t> packed(ggml_row_size(type, n_per_row)*n_rows);
    ggml_quantize_chunk(type, x.data(), packed.data(), 0, n_rows, n_per_row, nullptr);
    std::vector<float> out(x.size());
    ggml_get_type_traits(type)->to_float(packed.data(), out.data(), (int64_t) x.size());
    return out;
}

static std::vector<uint8_t> pack(ggml_type type, const std::vector<float> & x, int64_t n_per_row) {
    std::vector<uint8_t> packed(ggml_row_size(type, n_per_row)*(x.size()/n_per_row));
    if (type == GGML_TYPE_F32) {
        memcpy(packed.data(), x.data(), packed.size());
    } else {
        ggml_quantize_chunk(type, x.data(), packed.data(), 0, (int64_t) x.size()/n_per_row, n_per_row, nullptr);
    }
    return packed;
}

static evidence_inputs make_inputs(const evidence_case & tc, std::mt19937 & rng) {
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);

    const int64_t n_q = tc.n_rows*tc.n_gqa;

    evidence_inputs in;
    in.q.resize(tc.n_embd*n_q*tc.n_head_kv*tc.nb);
    for (float & v : in.q) {
        v = normal(rng)*0.3f; // scores of a few units, as scaled queries give
    }
    in.k.resize(tc.n_embd*tc.n_kv*tc.n_head_kv*tc.nb);
    for (float & v : in.k) {
        v = normal(rng);
    }
    // a few cells repeat an earlier key exactly: tied scores
    for (int64_t c = 3; c < tc.n_kv; c += 11) {
        for (int64_t hb = 0; hb < tc.n_head_kv*tc.nb; ++hb) {
            float * dst = in.k.data() + (hb*tc.n_kv + c)*tc.n_embd;
            memcpy(dst, dst - 3*tc.n_embd, tc.n_embd*sizeof(float));
        }
    }
    in.k = round_to(tc.type_k, in.k, tc.n_embd);

    // causal-looking mask: each row sees a prefix, a few cells excluded inside it, small biases elsewhere
    in.mask.resize(tc.n_kv*tc.n_rows*tc.nm);
    for (int64_t m = 0; m < tc.nm; ++m) {
        for (int64_t r = 0; r < tc.n_rows; ++r) {
            const int64_t visible = std::max<int64_t>(1, tc.n_kv - (tc.n_rows - 1 - r) - m);
            for (int64_t c = 0; c < tc.n_kv; ++c) {
                float v = c < visible ? 0.0f : -INFINITY;
                if (c > 0 && c % 17 == 5) {
                    v = -INFINITY;
                }
                in.mask[(m*tc.n_rows + r)*tc.n_kv + c] = v;
            }
            in.mask[(m*tc.n_rows + r)*tc.n_kv] = 0.0f; // never a row without cells
        }
    }
    in.mask = round_to(tc.type_mask, in.mask, tc.n_kv);
    return in;
}

// computes out's graph on backend (its inputs set) and returns out's values
template <typename T>
static std::vector<T> compute_and_get(ggml_backend_t backend, ggml_context * ctx, ggml_tensor * out) {
    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);

    std::vector<T> result(ggml_nelements(out));
    GGML_ASSERT(ggml_nbytes(out) == result.size()*sizeof(T));
    ggml_backend_tensor_get(out, result.data(), 0, ggml_nbytes(out));
    return result;
}

// runs build() on backend with the case's inputs in tensors of the case's types; returns dst as F32
static std::vector<float> run(ggml_backend_t backend, const evidence_case & tc, const evidence_inputs & in, bool reference,
        bool * supported) {
    const int64_t n_q = tc.n_rows*tc.n_gqa;

    ggml_init_params ip = { ggml_tensor_overhead()*64 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * q = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, tc.n_embd, n_q, tc.n_head_kv, tc.nb);
    ggml_tensor * k_store = tc.transposed_k
        ? ggml_new_tensor_4d(ctx, tc.type_k, tc.n_embd, tc.n_head_kv, tc.n_kv, tc.nb)
        : ggml_new_tensor_4d(ctx, tc.type_k, tc.n_embd, tc.n_kv, tc.n_head_kv, tc.nb);
    ggml_tensor * mask = ggml_new_tensor_4d(ctx, tc.type_mask, tc.n_kv, tc.n_rows, 1, tc.nm);

    ggml_tensor * k = tc.transposed_k ? ggml_permute(ctx, k_store, 0, 2, 1, 3) : k_store;

    ggml_tensor * out;
    if (reference) {
        // the definition: softmax of the scores per row, ^alpha, summed over the rows of each KV head
        ggml_tensor * kq = ggml_mul_mat(ctx, k, q);                           // [n_kv, n_q, n_head_kv, nb]
        ggml_prec_set_acc(kq, GGML_PREC_F32);
        if (tc.softcap > 0.0f) {
            kq = ggml_scale(ctx, ggml_tanh(ctx, kq), tc.softcap);
        }
        kq = ggml_reshape_4d(ctx, kq, tc.n_kv, tc.n_rows, tc.n_gqa*tc.n_head_kv, tc.nb);
        ggml_tensor * mask_f32 = tc.type_mask == GGML_TYPE_F32 ? mask : ggml_cast(ctx, mask, GGML_TYPE_F32);
        ggml_tensor * p = ggml_soft_max_ext(ctx, kq, mask_f32, 1.0f, 0.0f);
        p = ggml_exp(ctx, ggml_scale(ctx, ggml_log(ctx, p), tc.alpha));
        p = ggml_reshape_4d(ctx, p, tc.n_kv, n_q, tc.n_head_kv, tc.nb);
        out = ggml_sum_rows(ctx, ggml_cont(ctx, ggml_permute(ctx, p, 1, 0, 2, 3))); // [1, n_kv, n_head_kv, nb]
        out = ggml_reshape_3d(ctx, out, tc.n_kv, tc.n_head_kv, tc.nb);
    } else {
        out = ggml_sfi_evidence(ctx, q, k, mask, (int) tc.n_rows, tc.alpha, tc.softcap, tc.key_norms);
    }

    *supported = ggml_backend_supports_op(backend, out);
    std::vector<float> result;
    if (*supported) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);

        ggml_backend_tensor_set(q, in.q.data(), 0, ggml_nbytes(q));

        // k_store holds the keys of k's layout: [n_embd, n_kv, n_head_kv, nb], or [n_embd, n_head_kv, n_kv, nb] transposed
        std::vector<float> k_vals = in.k;
        if (tc.transposed_k) {
            for (int64_t b = 0; b < tc.nb; ++b) {
                for (int64_t h = 0; h < tc.n_head_kv; ++h) {
                    for (int64_t c = 0; c < tc.n_kv; ++c) {
                        memcpy(&k_vals[((b*tc.n_kv + c)*tc.n_head_kv + h)*tc.n_embd],
                               &in.k[((b*tc.n_head_kv + h)*tc.n_kv + c)*tc.n_embd], tc.n_embd*sizeof(float));
                    }
                }
            }
        }
        const std::vector<uint8_t> k_bytes = pack(k_store->type, k_vals, tc.n_embd);
        ggml_backend_tensor_set(k_store, k_bytes.data(), 0, ggml_nbytes(k_store));
        const std::vector<uint8_t> m_bytes = pack(tc.type_mask, in.mask, tc.n_kv);
        ggml_backend_tensor_set(mask, m_bytes.data(), 0, ggml_nbytes(mask));

        result = compute_and_get<float>(backend, ctx, out);
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return result;
}

static double nmse(const std::vector<float> & a, const std::vector<float> & ref) {
    double err = 0.0, norm = 0.0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (!std::isfinite(a[i])) {
            return INFINITY;
        }
        err  += (a[i] - ref[i])*(double) (a[i] - ref[i]);
        norm += ref[i]*(double) ref[i];
    }
    return norm > 0.0 ? err/norm : err;
}

// the op at a slow step's shape on backend, timed: milliseconds per op and the keys' bytes read per second
// ms per compute of gf on backend, over n_iter runs after 3
static double time_graph(ggml_backend_t backend, ggml_cgraph * gf, int n_iter) {
    for (int i = 0; i < 3; ++i) {
        ggml_backend_graph_compute(backend, gf);
    }
    const int64_t t0 = ggml_time_us();
    for (int i = 0; i < n_iter; ++i) {
        ggml_backend_graph_compute(backend, gf);
    }
    ggml_backend_synchronize(backend);
    return (ggml_time_us() - t0)/1000.0/n_iter;
}

static void perf(ggml_backend_t backend, int64_t n_kv, ggml_type type_kv) {
    const int64_t D = 128, n_q = 4, n_head_kv = 8, nb = 36;

    ggml_init_params ip = { ggml_tensor_overhead()*16 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * q       = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, n_q, n_head_kv, nb);
    ggml_tensor * k_store = ggml_new_tensor_4d(ctx, type_kv, D, n_head_kv, n_kv, nb);
    ggml_tensor * mask    = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, 1, 1, 1);
    ggml_tensor * out     = ggml_sfi_evidence(ctx, q, ggml_permute(ctx, k_store, 0, 2, 1, 3), mask, 1, 0.5f, 0.0f, true);

    if (!ggml_backend_supports_op(backend, out)) {
        ggml_free(ctx);
        return;
    }
    ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
    if (!buf) {
        printf("perf: %s cannot hold n_kv = %lld\n", ggml_backend_name(backend), (long long) n_kv);
        ggml_free(ctx);
        return;
    }
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 0.3f);
    std::vector<float> qv(ggml_nelements(q));
    for (float & v : qv) {
        v = normal(rng);
    }
    ggml_backend_tensor_set(q, qv.data(), 0, ggml_nbytes(q));
    ggml_backend_tensor_memset(k_store, 0x3a, 0, ggml_nbytes(k_store)); // every key element 0.7 (F16), finite (blocks)
    ggml_backend_tensor_memset(mask, 0, 0, ggml_nbytes(mask));

    ggml_cgraph * gf = ggml_new_graph(ctx);
    ggml_build_forward_expand(gf, out);
    const double ms = time_graph(backend, gf, 20);
    printf("perf %s: sfi_evidence n_kv %lld x %lld heads x %lld layers, %lld query rows, %s keys: %.3f ms, keys at %.0f GB/s\n",
            ggml_backend_name(backend), (long long) n_kv, (long long) n_head_kv, (long long) nb, (long long) n_q,
            ggml_type_name(type_kv), ms, ggml_nbytes(k_store)/(ms*1e6));
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// a decode's picks from the logits of n_rows sequences (a vocabulary of Qwen's size, each sequence its own ops, as a
// sampler per sequence builds them): greedy's (soft_max, argmax, the pick's probability; or ggml_sfi_greedy) against
// the SFI sampling ops (ggml_sfi_top_k's 40 candidates, ggml_sfi_sample, the token's cast), and each sampling op
// alone; times per sequence
static void perf_picks(ggml_backend_t backend, int64_t n_rows) {
    const int64_t n_vocab = 151936;
    const int     k       = 40;

    ggml_init_params ip = { ggml_tensor_overhead()*(20*n_rows + 4) + 5*ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * logits = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, n_vocab, n_rows);
    ggml_tensor * u      = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, n_rows);
    ggml_cgraph * g_greedy = ggml_new_graph(ctx);
    ggml_cgraph * g_fused  = ggml_new_graph(ctx);
    ggml_cgraph * g_sample = ggml_new_graph(ctx);
    ggml_cgraph * g_top_k  = ggml_new_graph(ctx);
    ggml_cgraph * g_pick   = ggml_new_graph(ctx);
    bool supported = true;
    for (int64_t r = 0; r < n_rows; ++r) {
        ggml_tensor * row   = ggml_view_2d(ctx, logits, n_vocab, 1, logits->nb[1], r*logits->nb[1]);
        ggml_tensor * ur    = ggml_view_2d(ctx, u, 1, 1, u->nb[1], r*u->nb[1]);
        ggml_tensor * token = ggml_argmax(ctx, row);
        ggml_tensor * prob  = ggml_get_rows(ctx, ggml_reshape_2d(ctx, ggml_soft_max(ctx, row), 1, n_vocab), token);
        ggml_tensor * cand  = ggml_sfi_top_k(ctx, row, k);
        ggml_tensor * res   = ggml_sfi_sample(ctx, row, cand, ur, 0.95f, 0.05f, 0.8f);
        ggml_tensor * tok   = ggml_cast(ctx, ggml_view_1d(ctx, res, 1, 0), GGML_TYPE_I32);
        ggml_tensor * gres  = ggml_sfi_greedy(ctx, row);
        ggml_tensor * gtok  = ggml_cast(ctx, ggml_view_1d(ctx, gres, 1, 0), GGML_TYPE_I32);
        for (ggml_tensor * t : { token, prob, cand, res, tok, gres, gtok }) {
            supported = supported && ggml_backend_supports_op(backend, t);
        }
        ggml_build_forward_expand(g_greedy, prob);
        ggml_build_forward_expand(g_fused, gtok);
        ggml_build_forward_expand(g_fused, ggml_view_1d(ctx, gres, 1, sizeof(float)));
        ggml_build_forward_expand(g_sample, tok);
        ggml_build_forward_expand(g_sample, ggml_view_1d(ctx, res, 1, sizeof(float)));
        ggml_build_forward_expand(g_top_k, cand);
        ggml_build_forward_expand(g_pick, res);
    }
    ggml_backend_buffer_t buf = supported ? ggml_backend_alloc_ctx_tensors(ctx, backend) : nullptr;
    if (!buf) {
        printf("perf: %s cannot time the picks\n", ggml_backend_name(backend));
        ggml_free(ctx);
        return;
    }
    std::mt19937 rng(9);
    std::normal_distribution<float> normal(0.0f, 3.0f);
    std::vector<float> lv(n_vocab*n_rows);
    for (float & v : lv) {
        v = normal(rng);
    }
    ggml_backend_tensor_set(logits, lv.data(), 0, ggml_nbytes(logits));
    std::vector<float> uv(n_rows, 0.5f);
    ggml_backend_tensor_set(u, uv.data(), 0, ggml_nbytes(u));

    const double us_greedy = time_graph(backend, g_greedy, 50)*1e3/n_rows;
    const double us_fused  = time_graph(backend, g_fused,  50)*1e3/n_rows;
    const double us_sample = time_graph(backend, g_sample, 50)*1e3/n_rows;
    const double us_top_k  = time_graph(backend, g_top_k,  50)*1e3/n_rows;
    const double us_pick   = time_graph(backend, g_pick,   50)*1e3/n_rows;
    printf("perf %s: picks from %lld rows of %lld logits, per row: greedy by soft_max, argmax, get_rows %.1f us, by "
           "sfi_greedy %.1f us; sampling (top-k %d) %.1f us (the graph of sfi_top_k alone %.1f us, with sfi_sample %.1f us)\n",
           ggml_backend_name(backend), (long long) n_rows, (long long) n_vocab, us_greedy, us_fused, k, us_sample,
           us_top_k, us_pick);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// a slow step's attention (Qwen3-4B's shape: 32 query heads of 128, 8 KV heads, one token per stream), each layer its
// own K and V of type_kv in a cache's layout, of ns streams of n_kv cells: flash attention alone, flash attention then
// ggml_sfi_evidence, and ggml_sfi_flash_attn_evidence, which does both from one read of the keys. 36/ns layers (at
// least one) keep the bytes read about those of 36 layers of one stream; times are printed per 36 layers
static void perf_attention(ggml_backend_t backend, int64_t n_kv, int64_t ns, ggml_type type_kv) {
    const int64_t D = 128, n_head = 32, n_head_kv = 8, n_layers = std::max<int64_t>(1, 36/ns);
    const float   scale = 1.0f/std::sqrt((float) D);
    const double  per36 = 36.0/n_layers;

    ggml_init_params ip = { ggml_tensor_overhead()*(16*n_layers + 16) + 3*ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, n_kv, 1, 1, ns);
    std::vector<ggml_tensor *> qs, ks, vs;
    // K and V as views of a cache's rows (a cell's heads side by side): [D*n_head_kv, n_kv, ns] -> [D, n_kv, n_head_kv, ns]
    std::vector<ggml_tensor *> k_stores, v_stores;
    const size_t hs = ggml_row_size(type_kv, D);
    for (int64_t l = 0; l < n_layers; ++l) {
        qs.push_back(ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, 1, n_head, ns));
        k_stores.push_back(ggml_new_tensor_3d(ctx, type_kv, D*n_head_kv, n_kv, ns));
        v_stores.push_back(ggml_new_tensor_3d(ctx, type_kv, D*n_head_kv, n_kv, ns));
        ks.push_back(ggml_view_4d(ctx, k_stores[l], D, n_kv, n_head_kv, ns, k_stores[l]->nb[1], hs, k_stores[l]->nb[2], 0));
        vs.push_back(ggml_view_4d(ctx, v_stores[l], D, n_kv, n_head_kv, ns, v_stores[l]->nb[1], hs, v_stores[l]->nb[2], 0));
    }
    ggml_cgraph * g_fa  = ggml_new_graph(ctx);
    ggml_cgraph * g_ev  = ggml_new_graph(ctx);
    ggml_cgraph * g_fae = ggml_new_graph(ctx);
    bool supported = true;
    for (int64_t l = 0; l < n_layers; ++l) {
        ggml_tensor * fa = ggml_flash_attn_ext(ctx, qs[l], ks[l], vs[l], mask, scale, 0.0f, 0.0f);
        ggml_prec_set_acc(fa, GGML_PREC_F32);
        ggml_tensor * qe = ggml_scale(ctx, ggml_reshape_4d(ctx, qs[l], D, n_head/n_head_kv, n_head_kv, ns), scale);
        ggml_tensor * ev = ggml_sfi_evidence(ctx, qe, ks[l], mask, 1, 0.5f, 0.0f, true);
        ggml_tensor * fae = ggml_sfi_flash_attn_evidence(ctx, qs[l], ks[l], vs[l], mask, scale, 0.0f, 0.5f, true);
        supported = supported && ggml_backend_supports_op(backend, fa) && ggml_backend_supports_op(backend, ev) &&
            ggml_backend_supports_op(backend, fae);
        ggml_build_forward_expand(g_fa, fa);
        ggml_build_forward_expand(g_ev, fa);
        ggml_build_forward_expand(g_ev, ev);
        ggml_build_forward_expand(g_fae, fae);
    }
    ggml_backend_buffer_t buf = supported ? ggml_backend_alloc_ctx_tensors(ctx, backend) : nullptr;
    if (!buf) {
        printf("perf: %s cannot time the attention of %lld streams at n_kv = %lld with %s K and V\n", ggml_backend_name(backend),
                (long long) ns, (long long) n_kv, ggml_type_name(type_kv));
        ggml_free(ctx);
        return;
    }
    std::mt19937 rng(8);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::vector<float> qv(D*n_head*ns);
    for (ggml_tensor * q : qs) {
        for (float & v : qv) {
            v = normal(rng);
        }
        ggml_backend_tensor_set(q, qv.data(), 0, ggml_nbytes(q));
    }
    for (int64_t l = 0; l < n_layers; ++l) {
        ggml_backend_tensor_memset(k_stores[l], 0x3a, 0, ggml_nbytes(k_stores[l])); // every element 0.7 (F16), finite (blocks)
        ggml_backend_tensor_memset(v_stores[l], 0x38, 0, ggml_nbytes(v_stores[l])); // 0.5
    }
    ggml_backend_tensor_memset(mask, 0, 0, ggml_nbytes(mask));

    const double ms_fa  = time_graph(backend, g_fa,  10)*per36;
    const double ms_ev  = time_graph(backend, g_ev,  10)*per36;
    const double ms_fae = time_graph(backend, g_fae, 10)*per36;
    const double gb = 2.0*36*ggml_nbytes(k_stores[0])/1e9;
    printf("perf %s: attention of 36 layers x %lld streams over n_kv %lld, %s K and V: flash attention %.3f ms (K+V at %.0f GB/s), "
           "+ sfi_evidence %.3f ms, sfi_flash_attn_evidence %.3f ms (K+V at %.0f GB/s)\n", ggml_backend_name(backend),
           (long long) ns, (long long) n_kv, ggml_type_name(type_kv), ms_fa, gb/ms_fa*1e3, ms_ev, ms_fae, gb/ms_fae*1e3);
    ggml_backend_buffer_free(buf);
    ggml_free(ctx);
}

// ggml_sfi_top_k: every backend's indices must equal the definition's exactly (a brute-force sort by value, then index)
// a backend without the op: a failure on the CPU (the reference), else a skip; returns the failures to count
static int not_supported(ggml_backend_t backend, ggml_backend_t cpu, const std::string & what, bool verbose) {
    if (backend == cpu) {
        printf("FAIL %s on %s: not supported (the CPU is the reference)\n", what.c_str(), ggml_backend_name(backend));
        return 1;
    }
    if (verbose) {
        printf("skip %s on %s: not supported\n", what.c_str(), ggml_backend_name(backend));
    }
    return 0;
}

// ggml_sfi_top_k's definition for one row: the indices of the k largest values by a stable sort (the lower index
// first among equal values), in increasing order
static std::vector<int32_t> top_k_ref(const float * x, int64_t n, int64_t k) {
    std::vector<int32_t> idx(n);
    for (int64_t i = 0; i < n; ++i) {
        idx[i] = (int32_t) i;
    }
    std::stable_sort(idx.begin(), idx.end(), [x](int32_t i, int32_t j) { return x[i] > x[j]; });
    std::sort(idx.begin(), idx.begin() + k);
    idx.resize(k);
    return idx;
}

struct top_k_case {
    int64_t n;
    int64_t k;
    int64_t n_rows;
    int     levels; // values drawn from this many levels (ties), 0: continuous

    std::string name() const {
        char buf[128];
        snprintf(buf, sizeof(buf), "sfi_top_k(n=%lld,k=%lld,rows=%lld,levels=%d)", (long long) n, (long long) k, (long long) n_rows, levels);
        return buf;
    }
};

static std::vector<int32_t> run_top_k(ggml_backend_t backend, const top_k_case & tc, const std::vector<float> & x, bool * supported) {
    ggml_init_params ip = { ggml_tensor_overhead()*8 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    ggml_tensor * a   = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, tc.n, tc.n_rows);
    ggml_tensor * out = ggml_sfi_top_k(ctx, a, (int) tc.k);

    *supported = ggml_backend_supports_op(backend, out);
    std::vector<int32_t> result;
    if (*supported) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(a, x.data(), 0, ggml_nbytes(a));
        result = compute_and_get<int32_t>(backend, ctx, out);
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return result;
}

static int test_top_k(const std::vector<ggml_backend_t> & backends, bool verbose, int * n_run) {
    const std::vector<top_k_case> cases = {
        { 1, 1, 3, 0 }, { 7, 3, 5, 0 }, { 1000, 1, 4, 0 }, { 1000, 1000, 2, 0 }, { 1000, 999, 2, 5 },
        { 8192, 2048, 288, 0 },       // a slow step's picks: k_head of the candidates, per (head, layer)
        { 8192, 2048, 20, 3 },        // many ties at the cut
        { 131328, 8192, 36, 0 },      // a slow step's candidates at 128K cells, per layer
        { 131328, 8192, 4, 40 },      // ... with plateaus
        { 70001, 4097, 3, 0 },        // odd sizes
        { 9000, 100, 2, 1 },          // every value equal: the lowest indices
        { 151936, 40, 1, 0 },         // a sampler's candidates in a vocabulary: on CUDA, the row's segments first
        { 151936, 40, 4, 3 },         // ... ties at the cut across segments
        { 151936, 1024, 2, 0 },       // ... the sampling op's largest k
        { 40000, 1, 1, 2 },
    };
    std::mt19937 rng(99);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int n_failed = 0;
    for (const top_k_case & tc : cases) {
        std::vector<float> x(tc.n*tc.n_rows);
        std::uniform_int_distribution<int> level(0, std::max(0, tc.levels - 1));
        for (size_t i = 0; i < x.size(); ++i) {
            x[i] = tc.levels > 0 ? (float) level(rng) : normal(rng);
            if (i % 13 == 4) {
                x[i] = -INFINITY; // excluded cells
            } else if (i % 29 == 7) {
                x[i] = tc.levels > 0 ? -0.0f : x[i]; // -0 ties +0
            }
        }
        // the definition
        std::vector<int32_t> ref(tc.k*tc.n_rows);
        for (int64_t r = 0; r < tc.n_rows; ++r) {
            const std::vector<int32_t> idx = top_k_ref(x.data() + r*tc.n, tc.n, tc.k);
            std::copy(idx.begin(), idx.end(), ref.begin() + r*tc.k);
        }
        for (ggml_backend_t backend : backends) {
            bool supported = false;
            const std::vector<int32_t> got = run_top_k(backend, tc, x, &supported);
            if (!supported) {
                if (verbose) {
                    printf("skip %s on %s: not supported\n", tc.name().c_str(), ggml_backend_name(backend));
                }
                continue;
            }
            const bool ok = got == ref;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s\n", ok ? "ok  " : "FAIL", tc.name().c_str(), ggml_backend_name(backend));
            }
        }
    }
    return n_failed;
}

// ggml_sfi_top_k_ids on every backend: the indices of ggml_sfi_top_k's definition, mapped through each row's ids
static int test_top_k_ids(const std::vector<ggml_backend_t> & backends, bool verbose, int * n_run) {
    struct ids_case { int64_t n, k, ne1, ne2; };
    const std::vector<ids_case> cases = { { 8192, 2048, 8, 5 }, { 7, 3, 2, 3 }, { 1000, 1000, 1, 2 }, { 4099, 17, 3, 1 },
        { 65536, 40, 1, 2 } }; // (the last: few long rows, on CUDA in two launches)
    std::mt19937 rng(5);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int n_failed = 0;
    for (const ids_case & tc : cases) {
        char name[96];
        snprintf(name, sizeof(name), "sfi_top_k_ids(n=%lld,k=%lld,ne1=%lld,ne2=%lld)", (long long) tc.n, (long long) tc.k,
                (long long) tc.ne1, (long long) tc.ne2);
        std::vector<float> x(tc.n*tc.ne1*tc.ne2);
        for (size_t i = 0; i < x.size(); ++i) {
            x[i] = i % 5 == 1 ? 0.5f : normal(rng); // ties
        }
        std::vector<int32_t> ids(tc.n*tc.ne2);
        for (auto & v : ids) {
            v = (int32_t) (rng() % 100000);
        }
        std::vector<int32_t> ref(tc.k*tc.ne1*tc.ne2);
        for (int64_t r = 0; r < tc.ne1*tc.ne2; ++r) {
            const std::vector<int32_t> idx = top_k_ref(x.data() + r*tc.n, tc.n, tc.k);
            for (int64_t j = 0; j < tc.k; ++j) {
                ref[r*tc.k + j] = ids[(r/tc.ne1)*tc.n + idx[j]];
            }
        }
        for (ggml_backend_t backend : backends) {
            ggml_init_params ip = { ggml_tensor_overhead()*8 + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            ggml_tensor * a   = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, tc.n, tc.ne1, tc.ne2);
            ggml_tensor * ti  = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, tc.n, tc.ne2);
            ggml_tensor * out = ggml_sfi_top_k_ids(ctx, a, (int) tc.k, ti);
            if (!ggml_backend_supports_op(backend, out)) {
                if (verbose) {
                    printf("skip %s on %s: not supported\n", name, ggml_backend_name(backend));
                }
                ggml_free(ctx);
                continue;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ggml_backend_tensor_set(a, x.data(), 0, ggml_nbytes(a));
            ggml_backend_tensor_set(ti, ids.data(), 0, ggml_nbytes(ti));
            const std::vector<int32_t> got = compute_and_get<int32_t>(backend, ctx, out);
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);
            const bool ok = got == ref;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s\n", ok ? "ok  " : "FAIL", name, ggml_backend_name(backend));
            }
        }
    }
    return n_failed;
}

// ggml_sfi_candidate_scores and ggml_sfi_candidate_values on every backend against their definition, written out here
struct candidates_case {
    int64_t n_kv;
    int64_t n_head;
    int64_t nb;
    int64_t ns;
    int64_t n_cand;
    float   alpha;
    int     pool_window;

    std::string name() const {
        char buf[160];
        snprintf(buf, sizeof(buf), "sfi_candidate_scores+values(n_kv=%lld,heads=%lld,nb=%lld,ns=%lld,n_cand=%lld,alpha=%g,pool=%d)",
                (long long) n_kv, (long long) n_head, (long long) nb, (long long) ns, (long long) n_cand, alpha, pool_window);
        return buf;
    }
};

// the definition: [n_kv, nb, 1 + n_head] (scores, then f per head), in double
static std::vector<float> candidate_scores_ref(const candidates_case & tc, const std::vector<float> & e, const std::vector<float> & m) {
    const int64_t n = tc.n_kv;
    const int     half = tc.pool_window > 1 ? tc.pool_window/2 : 0;
    std::vector<float> out(n*tc.nb*(1 + tc.n_head), 0.0f);
    for (int64_t b = 0; b < tc.nb; ++b) {
        const float * mb = m.data() + (b % tc.ns)*n;
        for (int64_t h = 0; h < tc.n_head; ++h) {
            const float * eh = e.data() + (b*tc.n_head + h)*n;
            std::vector<double> w(n, 0.0), g(n, 0.0);
            double sum_w = 0.0;
            for (int64_t c = 0; c < n; ++c) {
                w[c] = mb[c] != -INFINITY ? std::pow((double) eh[c], 1.0/tc.alpha) : 0.0;
                sum_w += w[c];
            }
            double sum = 0.0;
            for (int64_t c = 0; c < n; ++c) {
                double v = w[c];
                if (half > 0) {
                    v = 0.0;
                    for (int64_t d = std::max<int64_t>(0, c - half); d <= std::min<int64_t>(n - 1, c + half) && mb[c] != -INFINITY; ++d) {
                        v = std::max(v, w[d]);
                    }
                }
                g[c] = v;
                sum += v;
            }
            for (int64_t c = 0; c < n; ++c) {
                const float f = sum > 0.0 && sum_w > 0.0 ? (float) (g[c]/sum) : 0.0f;
                out[((1 + h)*tc.nb + b)*n + c] = f;
                out[b*n + c] += f;
            }
        }
        for (int64_t c = 0; c < n; ++c) {
            out[b*n + c] += mb[c];
        }
    }
    return out;
}

static int test_candidates(const std::vector<ggml_backend_t> & backends, ggml_backend_t cpu, bool verbose, int * n_run) {
    const std::vector<candidates_case> cases = {
        { 1000, 8, 3, 1, 256, 0.5f, 17 },
        { 257, 2, 4, 2, 64, 0.5f, 0 },      // no pooling, two streams
        { 70000, 8, 2, 1, 8192, 0.5f, 17 }, // a long context
        { 7, 4, 2, 1, 3, 0.3f, 3 },         // odd cell count, a window wider than the range's gaps
        { 5000, 4, 6, 3, 1000, 1.0f, 1 },   // window 1: no pooling
        { 3000, 8, 2, 1, 100, 0.5f, 129 },  // the widest window the GPU takes
    };
    std::mt19937 rng(77);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    int n_failed = 0;
    for (const candidates_case & tc : cases) {
        std::vector<float> e(tc.n_kv*tc.n_head*tc.nb), m(tc.n_kv*tc.ns), u(tc.n_kv*tc.ns);
        for (size_t i = 0; i < e.size(); ++i) {
            e[i] = i % 19 == 3 ? 0.0f : 4.0f*uniform(rng)*uniform(rng); // some cells without evidence
        }
        for (int64_t s = 0; s < tc.ns; ++s) {
            for (int64_t c = 0; c < tc.n_kv; ++c) {
                // a range: the sink and the recent cells outside, and a gap
                const bool in = c >= 1 + s && c < tc.n_kv - 2 && c % 23 != 9;
                m[s*tc.n_kv + c] = in ? 0.0f : -INFINITY;
                u[s*tc.n_kv + c] = in ? (float) c/tc.n_kv : 0.0f;
            }
        }
        const std::vector<float> ref = candidate_scores_ref(tc, e, m);

        // the candidates: some cells of each pair, any order, repeats allowed
        std::vector<int32_t> cells(tc.n_cand*tc.nb);
        for (auto & c : cells) {
            c = (int32_t) (rng() % tc.n_kv);
        }
        std::vector<float> ref_vals(tc.n_cand*(tc.n_head + 2)*tc.nb);
        for (int64_t b = 0; b < tc.nb; ++b) {
            for (int64_t i = 0; i < tc.n_cand; ++i) {
                const int64_t c = cells[b*tc.n_cand + i];
                for (int64_t h = 0; h < tc.n_head; ++h) {
                    ref_vals[(b*(tc.n_head + 2) + h)*tc.n_cand + i] = ref[((1 + h)*tc.nb + b)*tc.n_kv + c];
                }
                ref_vals[(b*(tc.n_head + 2) + tc.n_head)*tc.n_cand + i]     = u[(b % tc.ns)*tc.n_kv + c];
                ref_vals[(b*(tc.n_head + 2) + tc.n_head + 1)*tc.n_cand + i] = m[(b % tc.ns)*tc.n_kv + c];
            }
        }

        for (ggml_backend_t backend : backends) {
            ggml_init_params ip = { ggml_tensor_overhead()*16 + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);

            ggml_tensor * te = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, tc.n_kv, 1, tc.n_head, tc.nb);
            ggml_tensor * tm = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, tc.n_kv, 1, 1, tc.ns);
            ggml_tensor * tu = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, tc.n_kv, tc.ns);
            ggml_tensor * tc_cells = ggml_new_tensor_2d(ctx, GGML_TYPE_I32, tc.n_cand, tc.nb);
            ggml_tensor * cs   = ggml_sfi_candidate_scores(ctx, te, tm, tc.alpha, tc.pool_window);
            ggml_tensor * vals = ggml_sfi_candidate_values(ctx, cs, tu, tm, tc_cells);

            const bool supported = ggml_backend_supports_op(backend, cs) && ggml_backend_supports_op(backend, vals);
            if (!supported) {
                n_failed += not_supported(backend, cpu, tc.name(), verbose);
                ggml_free(ctx);
                continue;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ggml_backend_tensor_set(te, e.data(), 0, ggml_nbytes(te));
            ggml_backend_tensor_set(tm, m.data(), 0, ggml_nbytes(tm));
            ggml_backend_tensor_set(tu, u.data(), 0, ggml_nbytes(tu));
            ggml_backend_tensor_set(tc_cells, cells.data(), 0, ggml_nbytes(tc_cells));

            ggml_cgraph * gf = ggml_new_graph(ctx);
            ggml_build_forward_expand(gf, vals);
            GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);

            std::vector<float> got(ggml_nelements(cs)), got_vals(ggml_nelements(vals));
            ggml_backend_tensor_get(cs, got.data(), 0, ggml_nbytes(cs));
            ggml_backend_tensor_get(vals, got_vals.data(), 0, ggml_nbytes(vals));
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);

            // the scores hold -inf where the mask does: compare those exactly, the rest by nmse
            auto split_err = [](const std::vector<float> & a, const std::vector<float> & r) {
                std::vector<float> fa, fr;
                for (size_t i = 0; i < a.size(); ++i) {
                    if (std::isinf(r[i]) || std::isinf(a[i])) {
                        if (a[i] != r[i]) {
                            return (double) INFINITY;
                        }
                        continue;
                    }
                    fa.push_back(a[i]);
                    fr.push_back(r[i]);
                }
                return nmse(fa, fr);
            };
            const double err   = split_err(got, ref);
            const double err_v = split_err(got_vals, ref_vals);
            const bool   ok    = err < 1e-10 && err_v < 1e-10;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s: nmse %.3g, values %.3g\n", ok ? "ok  " : "FAIL", tc.name().c_str(), ggml_backend_name(backend), err, err_v);
            }
        }
    }
    return n_failed;
}

// ggml_sfi_selector_scores on every backend against its definition, written out here in double
struct selector_case {
    int64_t n_cand;
    int64_t n_head;
    int64_t nb;
    bool    with_cells;  // the key norms gathered by the op (of n_kn cells), else given at the candidates
    float   lambda_max;
    float   cross_alpha; // 0: no cross-head term
    int     levels;      // f drawn from this many levels (ties), 0: continuous

    std::string name() const {
        char buf[160];
        snprintf(buf, sizeof(buf), "sfi_selector_scores(n_cand=%lld,heads=%lld,nb=%lld,cells=%d,lambda_max=%g,cross=%g,levels=%d)",
                (long long) n_cand, (long long) n_head, (long long) nb, with_cells, lambda_max, cross_alpha, levels);
        return buf;
    }
};

static std::vector<float> selector_scores_ref(const selector_case & tc, const ggml_sfi_selector_params & p, const std::vector<float> & vals,
        const std::vector<float> & kn, const std::vector<int32_t> & cells, int64_t n_kn) {
    const int64_t n = tc.n_cand, H = tc.n_head;
    std::vector<double> s(n*H*tc.nb);
    for (int64_t b = 0; b < tc.nb; ++b) {
        const float * v = vals.data() + b*(H + 2)*n;
        const float * u = v + H*n;
        const float * m = v + (H + 1)*n;
        for (int64_t h = 0; h < H; ++h) {
            std::vector<double> x(n), f(n);
            double sum_f = 0.0, x_max = -INFINITY;
            for (int64_t i = 0; i < n; ++i) {
                const int64_t row = tc.with_cells ? cells[b*n + i] : i;
                const double  k   = std::min<double>(std::max<double>(kn[(b*n_kn + row)*H + h], FLT_MIN), FLT_MAX);
                const double  up  = u[i] > 0.0f ? std::pow((double) u[i], (double) p.pos_power) : 0.0;
                x[i]  = p.key_norm_exponent*std::log(k) + p.w_pos*(-p.pos_beta*up + p.pos_eta*std::log(1.0 - u[i])) + m[i];
                x_max = std::max(x_max, x[i]);
                sum_f += v[h*n + i];
            }
            double z = 0.0;
            for (int64_t i = 0; i < n; ++i) {
                z += std::exp(x[i] - x_max);
            }
            double num = 0.0, den = 0.0;
            for (int64_t i = 0; i < n; ++i) {
                f[i] = sum_f > 0.0 ? v[h*n + i]/sum_f : 0.0;
                const double d = f[i] - std::exp(x[i] - x_max)/z;
                num += f[i]*d;
                den += d*d;
            }
            const double lambda = std::min(std::max(num/(den + 1e-30), 0.0), (double) p.lambda_max);
            for (int64_t i = 0; i < n; ++i) {
                const double d = f[i] - std::exp(x[i] - x_max)/z;
                s[(b*H + h)*n + i] = std::log(std::min<double>(std::max<double>(f[i] - lambda*d, FLT_MIN), FLT_MAX));
            }
        }
        if (p.cross_head_alpha != 0.0f) {
            for (int64_t i = 0; i < n; ++i) {
                double t_max = -INFINITY, z = 0.0;
                for (int64_t h = 0; h < H; ++h) {
                    t_max = std::max(t_max, s[(b*H + h)*n + i]/p.cross_head_temperature);
                }
                for (int64_t h = 0; h < H; ++h) {
                    z += std::exp(s[(b*H + h)*n + i]/p.cross_head_temperature - t_max);
                }
                for (int64_t h = 0; h < H; ++h) {
                    double & v = s[(b*H + h)*n + i];
                    v += p.cross_head_alpha*(v/p.cross_head_temperature - t_max - std::log(z));
                }
            }
        }
    }
    return std::vector<float>(s.begin(), s.end());
}

static int test_selector_scores(const std::vector<ggml_backend_t> & backends, ggml_backend_t cpu, bool verbose, int * n_run) {
    const std::vector<selector_case> cases = {
        { 8192, 8, 36, true, 0.35f, 0.85f, 0 },  // a slow step's candidates: 36 layers, 8 KV heads
        { 8192, 8, 4, false, 0.25f, 0.85f, 0 },  // key norms given at the candidates, the multi-row clip
        { 1000, 2, 3, true, 0.35f, 0.0f, 0 },    // two KV heads: no cross-head term
        { 7, 4, 2, true, 0.35f, 0.85f, 0 },      // odd candidate count, fewer than a block's threads
        { 3001, 16, 2, false, 0.35f, 0.85f, 3 }, // ties in f
        { 513, 1, 5, true, 0.0f, 0.0f, 0 },      // one head, lambda clipped to 0: the evidence alone
    };
    ggml_sfi_selector_params p = { -0.5f, 0.7f, (float) (-std::log(0.6)/0.9), 1.8f, 0.4f, 0.0f, 0.0f, 2.0f };

    std::mt19937 rng(31);
    std::uniform_real_distribution<float> uniform(0.0f, 1.0f);
    int n_failed = 0;
    for (const selector_case & tc : cases) {
        const int64_t n = tc.n_cand, H = tc.n_head;
        const int64_t n_kn = tc.with_cells ? 3*n + 5 : n;
        p.lambda_max       = tc.lambda_max;
        p.cross_head_alpha = tc.cross_alpha;

        std::vector<float> vals(n*(H + 2)*tc.nb), kn(H*n_kn*tc.nb);
        std::vector<int32_t> cells(tc.with_cells ? n*tc.nb : 0);
        std::uniform_int_distribution<int> level(1, std::max(1, tc.levels));
        for (int64_t b = 0; b < tc.nb; ++b) {
            float * v = vals.data() + b*(H + 2)*n;
            for (int64_t i = 0; i < n; ++i) {
                const bool in = i % 11 != 5 || n < 11; // some candidates outside the range (u 0, mask -inf)
                for (int64_t h = 0; h < H; ++h) {
                    const float x = tc.levels > 0 ? 0.01f*level(rng) : uniform(rng)*uniform(rng);
                    v[h*n + i] = in && (i + h) % 17 != 3 ? x : 0.0f; // some candidates without evidence
                }
                v[H*n + i]       = in ? 0.999f*uniform(rng) : 0.0f;
                v[(H + 1)*n + i] = in ? 0.0f : -INFINITY;
            }
        }
        for (size_t i = 0; i < kn.size(); ++i) {
            kn[i] = i % 23 == 1 ? 0.0f : 0.2f + 8.0f*uniform(rng); // zero norms: clamped
        }
        for (auto & c : cells) {
            c = (int32_t) (rng() % n_kn);
        }
        const std::vector<float> ref = selector_scores_ref(tc, p, vals, kn, cells, n_kn);

        for (ggml_backend_t backend : backends) {
            ggml_init_params ip = { ggml_tensor_overhead()*8 + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);

            ggml_tensor * tv = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n, H + 2, tc.nb);
            ggml_tensor * tk = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, H, n_kn, tc.nb);
            ggml_tensor * tc_cells = tc.with_cells ? ggml_new_tensor_2d(ctx, GGML_TYPE_I32, n, tc.nb) : nullptr;
            ggml_tensor * out = ggml_sfi_selector_scores(ctx, tv, tk, tc_cells, p);

            if (!ggml_backend_supports_op(backend, out)) {
                n_failed += not_supported(backend, cpu, tc.name(), verbose);
                ggml_free(ctx);
                continue;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ggml_backend_tensor_set(tv, vals.data(), 0, ggml_nbytes(tv));
            ggml_backend_tensor_set(tk, kn.data(), 0, ggml_nbytes(tk));
            if (tc_cells) {
                ggml_backend_tensor_set(tc_cells, cells.data(), 0, ggml_nbytes(tc_cells));
            }
            const std::vector<float> got = compute_and_get<float>(backend, ctx, out);
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);

            const double err = nmse(got, ref);
            const bool   ok  = err < 1e-10;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s: nmse %.3g\n", ok ? "ok  " : "FAIL", tc.name().c_str(), ggml_backend_name(backend), err);
            }
        }
    }
    return n_failed;
}

// ggml_sfi_copy_rows on every backend against its definition: the bytes of every row of dst, copied or not
struct copy_rows_case {
    ggml_type type;
    int64_t   ne0;   // elements of a row
    int64_t   n_src; // rows of src per (j, l)
    int64_t   n_dst;
    int64_t   n;     // rows copied per (j, l)
    int64_t   ne2;   // heads: the rows of one cell lie side by side (strided views, as a cache's heads)
    int64_t   ne3;

    std::string name() const {
        char buf[160];
        snprintf(buf, sizeof(buf), "sfi_copy_rows(%s,ne0=%lld,src=%lld,dst=%lld,n=%lld,%lldx%lld)", ggml_type_name(type),
                (long long) ne0, (long long) n_src, (long long) n_dst, (long long) n, (long long) ne2, (long long) ne3);
        return buf;
    }
};

static int test_copy_rows(const std::vector<ggml_backend_t> & backends, bool verbose, int * n_run) {
    const std::vector<copy_rows_case> cases = {
        { GGML_TYPE_F16,  128, 1000, 2308, 2048, 8, 3 }, // a selection's own cells, heads x layers
        { GGML_TYPE_F16, 1024,  500,  300,   17, 1, 4 }, // whole cache rows (the shared cells)
        { GGML_TYPE_F16,   64,   37,   40,   37, 2, 1 },
        { GGML_TYPE_F16,    3,   50,   20,   20, 3, 2 }, // rows of 6 bytes: byte copies
        { GGML_TYPE_F32,   80,  100,  100,   99, 5, 1 }, // 320-byte rows
        { GGML_TYPE_Q8_0, 128,  300,  200,  150, 4, 2 }, // 136-byte rows of blocks
        { GGML_TYPE_F16,  128,    1,    1,    1, 1, 1 },
    };
    std::mt19937 rng(7);
    int n_failed = 0;
    for (const copy_rows_case & tc : cases) {
        const size_t  row     = ggml_row_size(tc.type, tc.ne0);
        const int64_t n_idx_r = tc.n + 3; // idx is a view of a wider tensor: strided

        std::vector<uint8_t> src_bytes(row*tc.ne2*tc.n_src*tc.ne3), dst_bytes(row*tc.ne2*tc.n_dst*tc.ne3);
        for (auto & b : src_bytes) { b = (uint8_t) rng(); }
        for (auto & b : dst_bytes) { b = (uint8_t) rng(); }

        std::vector<int32_t> idx(n_idx_r*tc.ne2*tc.ne3);
        for (auto & c : idx) { c = (int32_t) (rng() % tc.n_src); }
        std::vector<int64_t> slots(tc.n_dst);
        for (int64_t i = 0; i < tc.n_dst; ++i) { slots[i] = i; }
        std::shuffle(slots.begin(), slots.end(), rng);
        slots.resize(tc.n);

        // the definition: dst[:, slots[i], j, l] = src[:, idx[i, j, l], j, l]; a cell's heads side by side
        std::vector<uint8_t> ref = dst_bytes;
        for (int64_t l = 0; l < tc.ne3; ++l) {
            for (int64_t j = 0; j < tc.ne2; ++j) {
                for (int64_t i = 0; i < tc.n; ++i) {
                    const int64_t c = idx[(l*tc.ne2 + j)*n_idx_r + i];
                    memcpy(&ref[((l*tc.n_dst + slots[i])*tc.ne2 + j)*row], &src_bytes[((l*tc.n_src + c)*tc.ne2 + j)*row], row);
                }
            }
        }

        for (ggml_backend_t backend : backends) {
            ggml_init_params ip = { ggml_tensor_overhead()*16 + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);

            ggml_tensor * src_t = ggml_new_tensor_3d(ctx, tc.type, tc.ne0*tc.ne2, tc.n_src, tc.ne3);
            ggml_tensor * dst_t = ggml_new_tensor_3d(ctx, tc.type, tc.ne0*tc.ne2, tc.n_dst, tc.ne3);
            ggml_tensor * idx_t = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, n_idx_r, tc.ne2, tc.ne3);
            ggml_tensor * sl_t  = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, tc.n);

            ggml_tensor * s4 = ggml_view_4d(ctx, src_t, tc.ne0, tc.n_src, tc.ne2, tc.ne3, src_t->nb[1], row, src_t->nb[2], 0);
            ggml_tensor * d4 = ggml_view_4d(ctx, dst_t, tc.ne0, tc.n_dst, tc.ne2, tc.ne3, dst_t->nb[1], row, dst_t->nb[2], 0);
            ggml_tensor * iv = ggml_view_3d(ctx, idx_t, tc.n, tc.ne2, tc.ne3, idx_t->nb[1], idx_t->nb[2], 0);

            ggml_tensor * out = ggml_sfi_copy_rows(ctx, d4, s4, iv, sl_t);

            if (!ggml_backend_supports_op(backend, out)) {
                if (verbose) {
                    printf("skip %s on %s: not supported\n", tc.name().c_str(), ggml_backend_name(backend));
                }
                ggml_free(ctx);
                continue;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ggml_backend_tensor_set(src_t, src_bytes.data(), 0, src_bytes.size());
            ggml_backend_tensor_set(dst_t, dst_bytes.data(), 0, dst_bytes.size());
            ggml_backend_tensor_set(idx_t, idx.data(), 0, idx.size()*sizeof(int32_t));
            ggml_backend_tensor_set(sl_t, slots.data(), 0, slots.size()*sizeof(int64_t));

            ggml_cgraph * gf = ggml_new_graph(ctx);
            ggml_build_forward_expand(gf, out);
            GGML_ASSERT(ggml_backend_graph_compute(backend, gf) == GGML_STATUS_SUCCESS);

            std::vector<uint8_t> got(dst_bytes.size());
            ggml_backend_tensor_get(dst_t, got.data(), 0, got.size());

            const bool ok = got == ref;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s\n", ok ? "ok  " : "FAIL", tc.name().c_str(), ggml_backend_name(backend));
            }
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);
        }
    }
    return n_failed;
}

// ggml_sfi_flash_attn_evidence on every backend against its definition: ggml_flash_attn_ext's output and
// ggml_sfi_evidence's values and key norms, computed on the CPU
struct fae_case {
    int64_t   D;
    int64_t   n_tokens;
    int64_t   n_gqa;
    int64_t   n_head_kv;
    int64_t   n_kv;
    int64_t   ns;
    ggml_type type_kv;
    float     softcap;
    float     alpha;
    bool      key_norms;

    std::string name() const {
        char buf[200];
        snprintf(buf, sizeof(buf), "sfi_flash_attn_evidence(D=%lld,tokens=%lld,gqa=%lld,hkv=%lld,n_kv=%lld,ns=%lld,kv=%s,cap=%g,alpha=%g,norms=%d)",
                (long long) D, (long long) n_tokens, (long long) n_gqa, (long long) n_head_kv, (long long) n_kv,
                (long long) ns, ggml_type_name(type_kv), softcap, alpha, key_norms);
        return buf;
    }
};

// the op's result, or (reference) the definition's values in the op's layout: output, evidence, key norms
static std::vector<float> run_fae(ggml_backend_t backend, const fae_case & tc, const std::vector<float> & qv,
        const std::vector<float> & kv, const std::vector<float> & vv, const std::vector<float> & mv, bool reference,
        bool * supported) {
    const int64_t n_head = tc.n_gqa*tc.n_head_kv;
    const int64_t n_pad  = tc.n_tokens + 1; // padded, as llama.cpp pads it
    const float   scale  = 1.0f/std::sqrt((float) tc.D);

    ggml_init_params ip = { ggml_tensor_overhead()*64 + ggml_graph_overhead(), nullptr, true };
    ggml_context * ctx = ggml_init(ip);

    // q as llama.cpp gives it to flash attention: a permuted view of [D, n_head, n_tokens, ns]
    ggml_tensor * q_store = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, tc.D, n_head, tc.n_tokens, tc.ns);
    ggml_tensor * q       = ggml_permute(ctx, q_store, 0, 2, 1, 3);                     // [D, n_tokens, n_head, ns]
    // k and v as views of a cache's rows: [D*n_head_kv, n_kv, ns] -> [D, n_kv, n_head_kv, ns]
    ggml_tensor * k_store = ggml_new_tensor_3d(ctx, tc.type_kv, tc.D*tc.n_head_kv, tc.n_kv, tc.ns);
    ggml_tensor * v_store = ggml_new_tensor_3d(ctx, tc.type_kv, tc.D*tc.n_head_kv, tc.n_kv, tc.ns);
    const size_t hs = ggml_row_size(tc.type_kv, tc.D);
    ggml_tensor * k = ggml_view_4d(ctx, k_store, tc.D, tc.n_kv, tc.n_head_kv, tc.ns, k_store->nb[1], hs, k_store->nb[2], 0);
    ggml_tensor * v = ggml_view_4d(ctx, v_store, tc.D, tc.n_kv, tc.n_head_kv, tc.ns, v_store->nb[1], hs, v_store->nb[2], 0);
    ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F16, tc.n_kv, n_pad, 1, tc.ns);

    ggml_tensor * out;
    if (reference) {
        // F32 keys and values: ggml's CPU flash attention sums F16 values in F16
        ggml_tensor * fa = ggml_flash_attn_ext(ctx, q, ggml_cast(ctx, k, GGML_TYPE_F32), ggml_cast(ctx, v, GGML_TYPE_F32),
                mask, scale, 0.0f, tc.softcap);
        ggml_prec_set_acc(fa, GGML_PREC_F32);
        // the evidence op's rows: query head h*n_gqa + g at token t is row g*n_tokens + t of KV head h, scaled
        ggml_tensor * qe = ggml_reshape_4d(ctx, ggml_cont(ctx, q), tc.D, tc.n_tokens*tc.n_gqa, tc.n_head_kv, tc.ns);
        qe = ggml_scale(ctx, qe, tc.softcap > 0.0f ? scale/tc.softcap : scale);
        ggml_tensor * me = ggml_view_4d(ctx, mask, tc.n_kv, tc.n_tokens, 1, tc.ns, mask->nb[1], mask->nb[2], mask->nb[3], 0);
        ggml_tensor * ev = ggml_sfi_evidence(ctx, qe, k, me, (int) tc.n_tokens, tc.alpha, tc.softcap, tc.key_norms);
        out = ggml_concat(ctx, ggml_reshape_1d(ctx, fa, ggml_nelements(fa)), ggml_reshape_1d(ctx, ev, ggml_nelements(ev)), 0);
    } else {
        out = ggml_sfi_flash_attn_evidence(ctx, q, k, v, mask, scale, tc.softcap, tc.alpha, tc.key_norms);
    }

    *supported = ggml_backend_supports_op(backend, out);
    std::vector<float> result;
    if (*supported) {
        ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
        ggml_backend_tensor_set(q_store, qv.data(), 0, ggml_nbytes(q_store));
        const std::vector<uint8_t> kb = pack(tc.type_kv, kv, tc.D);
        const std::vector<uint8_t> vb = pack(tc.type_kv, vv, tc.D);
        ggml_backend_tensor_set(k_store, kb.data(), 0, ggml_nbytes(k_store));
        ggml_backend_tensor_set(v_store, vb.data(), 0, ggml_nbytes(v_store));
        const std::vector<uint8_t> mb = pack(GGML_TYPE_F16, mv, tc.n_kv);
        ggml_backend_tensor_set(mask, mb.data(), 0, ggml_nbytes(mask));
        result = compute_and_get<float>(backend, ctx, out);
        ggml_backend_buffer_free(buf);
    }
    ggml_free(ctx);
    return result;
}

static int test_flash_attn_evidence(const std::vector<ggml_backend_t> & backends, ggml_backend_t cpu, bool verbose, int * n_run) {
    const std::vector<fae_case> cases = {
        { 128, 1, 4, 8, 1000, 1, GGML_TYPE_F16,  0.0f, 0.5f, true  }, // a decode step of Qwen3-4B's shape
        { 128, 1, 4, 2, 4099, 3, GGML_TYPE_F16,  0.0f, 0.5f, true  }, // streams, odd cell count
        {  64, 1, 7, 2,  777, 1, GGML_TYPE_F16,  0.0f, 0.5f, true  }, // Qwen2.5-0.5B's GQA of 7
        {  64, 2, 4, 2,  300, 2, GGML_TYPE_F16,  0.0f, 0.5f, false }, // two tokens per stream
        { 256, 1, 4, 1,  600, 1, GGML_TYPE_F16, 30.0f, 0.5f, true  }, // soft-capped scores (Gemma's head size)
        { 128, 1, 1, 8,  333, 1, GGML_TYPE_F16,  0.0f, 1.0f, true  }, // no GQA, alpha 1: the mass
        { 128, 1, 8, 1,    7, 1, GGML_TYPE_F16,  0.0f, 0.3f, false }, // a few cells
        { 128, 1, 4, 8, 70000, 1, GGML_TYPE_F16, 0.0f, 0.5f, false }, // long context
        {  72, 2, 3, 2,  301, 2, GGML_TYPE_F16,  0.0f, 0.5f, true  }, // a head size past the CPU's vector blocks
        // a quantized cache (keys and values of one type)
        { 128, 1, 4, 8, 1000, 1, GGML_TYPE_Q8_0, 0.0f, 0.5f, true  },
        { 128, 1, 4, 2, 4099, 3, GGML_TYPE_Q8_0, 0.0f, 0.5f, true  },
        {  64, 1, 7, 2,  777, 1, GGML_TYPE_Q8_0, 0.0f, 0.5f, true  },
        {  64, 2, 4, 2,  300, 2, GGML_TYPE_Q8_0, 0.0f, 0.5f, false },
        { 256, 1, 4, 1,  600, 1, GGML_TYPE_Q8_0, 30.0f, 0.5f, true },
        { 128, 1, 1, 8,  333, 1, GGML_TYPE_Q8_0, 0.0f, 1.0f, true  },
        { 128, 1, 4, 2,  500, 1, GGML_TYPE_Q4_0, 0.0f, 0.5f, true  },
        {  64, 1, 8, 1, 2000, 2, GGML_TYPE_Q4_0, 0.0f, 0.3f, true  },
        { 256, 2, 2, 2,  300, 1, GGML_TYPE_Q4_0, 0.0f, 0.5f, false },
    };
    std::mt19937 rng(21);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    int n_failed = 0;
    for (const fae_case & tc : cases) {
        const int64_t n_head = tc.n_gqa*tc.n_head_kv;
        const int64_t n_pad  = tc.n_tokens + 1; // padded, as llama.cpp pads it
        std::vector<float> qv(tc.D*n_head*tc.n_tokens*tc.ns), kv(tc.D*tc.n_head_kv*tc.n_kv*tc.ns), vv(kv.size());
        for (float & x : qv) { x = normal(rng)*2.0f; }
        for (float & x : kv) { x = normal(rng); }
        for (float & x : vv) { x = normal(rng); }
        kv = round_to(tc.type_kv, kv, tc.D);
        vv = round_to(tc.type_kv, vv, tc.D);
        // each stream's token t sees a prefix of the cells, some excluded inside it; a third stream sees a third of
        // them (the CPU's chunks of cells wholly excluded)
        std::vector<float> mv(tc.n_kv*n_pad*tc.ns, -INFINITY);
        for (int64_t b = 0; b < tc.ns; ++b) {
            for (int64_t t = 0; t < tc.n_tokens; ++t) {
                const int64_t visible = b == 2 ? tc.n_kv/3 : std::max<int64_t>(1, tc.n_kv - (tc.n_tokens - 1 - t) - 5*b);
                for (int64_t c = 0; c < visible; ++c) {
                    mv[(b*n_pad + t)*tc.n_kv + c] = c > 0 && c % 13 == 4 ? -INFINITY : 0.0f;
                }
            }
        }

        bool ok_ref = false;
        const std::vector<float> ref = run_fae(cpu, tc, qv, kv, vv, mv, true, &ok_ref);
        GGML_ASSERT(ok_ref);
        const size_t n_out = (size_t) tc.D*n_head*tc.n_tokens*tc.ns;

        for (ggml_backend_t backend : backends) {
            bool supported = false;
            const std::vector<float> got = run_fae(backend, tc, qv, kv, vv, mv, false, &supported);
            const char * name = ggml_backend_name(backend);
            if (!supported) {
                n_failed += not_supported(backend, cpu, tc.name(), verbose);
                continue;
            }
            GGML_ASSERT(got.size() == ref.size());
            const double err_out  = nmse(std::vector<float>(got.begin(), got.begin() + n_out), std::vector<float>(ref.begin(), ref.begin() + n_out));
            const double err_rest = nmse(std::vector<float>(got.begin() + n_out, got.end()), std::vector<float>(ref.begin() + n_out, ref.end()));
            // the op's products are the evidence op's (the scaled queries rounded to F16, or to Q8_0 for a quantized
            // cache), the output's definition here takes F32 products
            const double tol_out = tc.type_kv == GGML_TYPE_F16 ? 1e-6 : 5e-4;
            const bool   ok      = err_out < tol_out && err_rest < 1e-6;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s: nmse output %.3g, evidence and norms %.3g\n", ok ? "ok  " : "FAIL", tc.name().c_str(), name, err_out, err_rest);
            }
        }
    }
    return n_failed;
}

// ggml_sfi_sample on every backend against its definition, written out here in double: the pick of each row, where
// no decision of the chain lies within rounding of its threshold (such rows are left out), and the top-1 probability
struct sample_case {
    int64_t n_vocab;
    int64_t n_rows;
    int     k;
    float   top_p;
    float   min_p;
    float   temp;
    float   scale;  // logits drawn as scale*N(0, 1)
    int     levels; // > 0: logits rounded to 1/levels (ties)

    std::string name() const {
        char buf[160];
        if (k == 0) {
            snprintf(buf, sizeof(buf), "sfi_greedy(n_vocab=%lld,rows=%lld,scale=%g,levels=%d)", (long long) n_vocab,
                    (long long) n_rows, scale, levels);
            return buf;
        }
        snprintf(buf, sizeof(buf), "sfi_sample(n_vocab=%lld,rows=%lld,k=%d,top_p=%g,min_p=%g,temp=%g,scale=%g,levels=%d)",
                (long long) n_vocab, (long long) n_rows, k, top_p, min_p, temp, scale, levels);
        return buf;
    }
};

struct sample_ref_row {
    int32_t token;
    double  prob;
    double  margin; // how near the closest decision came to its threshold
};

static sample_ref_row sample_ref(const sample_case & tc, const float * x, double u) {
    sample_ref_row r = { -1, 0.0, INFINITY };

    double max = -INFINITY;
    for (int64_t i = 0; i < tc.n_vocab; ++i) {
        max = std::max(max, (double) x[i]);
    }
    double sum = 0.0;
    for (int64_t i = 0; i < tc.n_vocab; ++i) {
        sum += exp(x[i] - max);
    }
    r.prob = 1.0/sum;

    if (tc.k == 0) { // ggml_sfi_greedy: the first of the largest
        r.token = (int32_t) (std::max_element(x, x + tc.n_vocab) - x);
        return r;
    }

    std::vector<int32_t> ids = top_k_ref(x, tc.n_vocab, tc.k);
    std::sort(ids.begin(), ids.end(), [x](int32_t i, int32_t j) { return x[i] > x[j] || (x[i] == x[j] && i < j); });
    std::vector<double> c(tc.k);
    for (int j = 0; j < tc.k; ++j) {
        c[j] = x[ids[j]];
    }

    int n = tc.k;
    if (tc.top_p < 1.0f) {
        double s = 0.0;
        for (int i = 0; i < tc.k; ++i) {
            s += exp(c[i] - c[0]);
        }
        double cum = 0.0;
        for (int i = 0; i < tc.k; ++i) {
            cum += exp(c[i] - c[0])/s;
            r.margin = std::min(r.margin, fabs(cum - tc.top_p));
            if (cum >= tc.top_p) {
                n = i + 1;
                break;
            }
        }
    }
    if (tc.min_p > 0.0f) {
        const double min_logit = c[0] + log((double) tc.min_p);
        int i = 1;
        for (; i < n; ++i) {
            r.margin = std::min(r.margin, fabs(c[i] - min_logit));
            if (c[i] < min_logit) {
                break;
            }
        }
        n = i;
    }
    int pick = 0;
    if (n > 1) {
        double s = 0.0;
        for (int i = 0; i < n; ++i) {
            s += exp((c[i] - c[0])/tc.temp);
        }
        double run = 0.0;
        for (pick = 0; pick < n - 1; ++pick) {
            run += exp((c[pick] - c[0])/tc.temp);
            r.margin = std::min(r.margin, fabs(run - s*u)/s);
            if (run >= s*u) {
                break;
            }
        }
    }
    r.token = ids[pick];
    return r;
}

static int test_sample(const std::vector<ggml_backend_t> & backends, ggml_backend_t cpu, bool verbose, int * n_run) {
    const std::vector<sample_case> cases = {
        { 151936,  8,   40, 0.95f, 0.05f, 0.8f, 3.0f, 0 }, // a model's vocabulary, the default sampling
        { 151936,  3,   40, 1.00f, 0.00f, 1.0f, 2.0f, 0 }, // top-p and min-p off
        { 151936,  2,    1, 0.95f, 0.05f, 0.8f, 3.0f, 0 }, // top-k 1: the argmax
        {   5000, 16, 1024, 0.50f, 0.00f, 0.7f, 1.0f, 0 }, // the largest k
        {   1000, 16, 1000, 0.90f, 0.10f, 1.5f, 4.0f, 0 }, // k = n_vocab
        {  20000, 16,   50, 0.90f, 0.02f, 1.2f, 3.0f, 2 }, // ties, at the cut too
        {      7, 16,    3, 0.99f, 0.00f, 0.5f, 1.0f, 0 }, // tiny
        // k 0: ggml_sfi_greedy
        { 151936,  8,    0, 1.00f, 0.00f, 1.0f, 3.0f, 0 }, // a model's vocabulary
        { 151936,  4,    0, 1.00f, 0.00f, 1.0f, 1.0f, 1 }, // equal maxima: the first
        {   1000, 300,   0, 1.00f, 0.00f, 1.0f, 2.0f, 0 }, // many rows
        {      7, 16,    0, 1.00f, 0.00f, 1.0f, 1.0f, 0 }, // tiny
    };
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1.0f);
    std::uniform_real_distribution<double> uniform(0.0, 1.0);
    int n_failed = 0;
    for (const sample_case & tc : cases) {
        std::vector<float> x(tc.n_vocab*tc.n_rows);
        for (float & v : x) {
            v = tc.scale*normal(rng);
            v = tc.levels > 0 ? roundf(v*tc.levels)/tc.levels : v;
        }
        std::vector<float> u(tc.n_rows);
        std::vector<int32_t> cand(tc.k*tc.n_rows);
        std::vector<sample_ref_row> ref(tc.n_rows);
        for (int64_t r = 0; r < tc.n_rows; ++r) {
            u[r] = (float) uniform(rng);
            ref[r] = sample_ref(tc, x.data() + r*tc.n_vocab, u[r]);
            std::vector<int32_t> ids = top_k_ref(x.data() + r*tc.n_vocab, tc.n_vocab, tc.k);
            std::shuffle(ids.begin(), ids.end(), rng); // the op takes its candidates in any order
            std::copy(ids.begin(), ids.end(), cand.begin() + r*tc.k);
        }
        for (ggml_backend_t backend : backends) {
            ggml_init_params ip = { ggml_tensor_overhead()*8 + ggml_graph_overhead(), nullptr, true };
            ggml_context * ctx = ggml_init(ip);
            ggml_tensor * tl  = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, tc.n_vocab, tc.n_rows);
            ggml_tensor * tk  = tc.k > 0 ? ggml_new_tensor_2d(ctx, GGML_TYPE_I32, tc.k, tc.n_rows) : nullptr;
            ggml_tensor * tu  = tc.k > 0 ? ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 1, tc.n_rows) : nullptr;
            ggml_tensor * out = tc.k > 0 ? ggml_sfi_sample(ctx, tl, tk, tu, tc.top_p, tc.min_p, tc.temp) : ggml_sfi_greedy(ctx, tl);
            if (!ggml_backend_supports_op(backend, out)) {
                n_failed += not_supported(backend, cpu, tc.name(), verbose);
                ggml_free(ctx);
                continue;
            }
            ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, backend);
            ggml_backend_tensor_set(tl, x.data(), 0, ggml_nbytes(tl));
            if (tc.k > 0) {
                ggml_backend_tensor_set(tk, cand.data(), 0, ggml_nbytes(tk));
                ggml_backend_tensor_set(tu, u.data(), 0, ggml_nbytes(tu));
            }
            const std::vector<float> got = compute_and_get<float>(backend, ctx, out);
            ggml_backend_buffer_free(buf);
            ggml_free(ctx);

            bool ok = true;
            int n_checked = 0;
            for (int64_t r = 0; r < tc.n_rows; ++r) {
                ok = ok && fabs(got[2*r + 1] - ref[r].prob) <= 1e-5*ref[r].prob;
                if (ref[r].margin > 1e-5) {
                    ok = ok && got[2*r] == (float) ref[r].token;
                    n_checked++;
                }
            }
            ok = ok && n_checked > 0;
            (*n_run)++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s: %d of %lld rows' picks checked\n", ok ? "ok  " : "FAIL", tc.name().c_str(),
                        ggml_backend_name(backend), n_checked, (long long) tc.n_rows);
            }
        }
    }
    return n_failed;
}

int main(int argc, char ** argv) {
    if (argc > 1 && strcmp(argv[1], "perf") == 0) {
        ggml_time_init();
        std::vector<int64_t> n_kvs;
        int64_t   ns      = 1;
        ggml_type type_kv = GGML_TYPE_F16;
        bool      cpu     = false;
        for (int i = 2; i < argc; ++i) {
            if (strcmp(argv[i], "--cpu") == 0) {
                cpu = true;
                continue;
            }
            if (strcmp(argv[i], "-s") == 0 && i + 1 < argc) {
                ns = std::max(1LL, atoll(argv[++i]));
                continue;
            }
            if (strcmp(argv[i], "-t") == 0 && i + 1 < argc) {
                const std::string t = argv[++i];
                type_kv = t == "q8_0" ? GGML_TYPE_Q8_0 : t == "q4_0" ? GGML_TYPE_Q4_0 : t == "f16" ? GGML_TYPE_F16 : GGML_TYPE_COUNT;
                if (type_kv == GGML_TYPE_COUNT) {
                    fprintf(stderr, "sfi-test-ops perf: -t takes f16, q8_0 or q4_0, not %s\n", t.c_str());
                    return 1;
                }
                continue;
            }
            n_kvs.push_back(atoll(argv[i]));
        }
        if (n_kvs.empty()) {
            n_kvs = { 32768, 131328 };
        }
        for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
            ggml_backend_dev_t dev = ggml_backend_dev_get(i);
            const bool is_cpu = ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU;
            if (is_cpu && !cpu) {
                continue;
            }
            if (ggml_backend_t b = ggml_backend_dev_init(dev, nullptr)) {
                if (is_cpu) {
                    ggml_backend_cpu_set_n_threads(b, (int) std::thread::hardware_concurrency());
                }
                for (int64_t n_kv : n_kvs) {
                    if (ns == 1) {
                        perf(b, n_kv, type_kv);
                    }
                    perf_attention(b, n_kv, ns, type_kv);
                }
                perf_picks(b, 1);
                if (ns > 1) {
                    perf_picks(b, ns);
                }
                ggml_backend_free(b);
            }
        }
        return 0;
    }

    const bool verbose = argc > 1 && strcmp(argv[1], "-v") == 0;

    std::vector<evidence_case> cases;
    for (int64_t D : { 64, 128, 256 }) {
        for (ggml_type tk : { GGML_TYPE_F16, GGML_TYPE_Q8_0, GGML_TYPE_Q4_0, GGML_TYPE_F32 }) {
            cases.push_back({ D, 1, 4, 8, 1000, 3, 1, tk, GGML_TYPE_F16, 0.5f, 0.0f, false });
            cases.push_back({ D, 1, 7, 2, 257, 2, 2, tk, GGML_TYPE_F32, 0.5f, 0.0f, true });
        }
    }
    cases.push_back({ 128, 16, 4, 2, 777, 1, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, false });  // bootstrap rows
    cases.push_back({ 64, 16, 7, 2, 300, 2, 2, GGML_TYPE_F16, GGML_TYPE_F32, 0.5f, 0.0f, true });   // odd GQA group
    cases.push_back({ 128, 16, 8, 2, 900, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, true });  // more rows than
    cases.push_back({ 256, 16, 4, 1, 333, 1, 1, GGML_TYPE_F16, GGML_TYPE_F32, 0.5f, 0.0f, false }); //   a GPU block holds
    cases.push_back({ 128, 1, 1, 4, 1, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, false });    // one cell
    cases.push_back({ 72, 1, 3, 2, 301, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, true });    // a head size past
    cases.push_back({ 72, 1, 5, 3, 65, 1, 1, GGML_TYPE_F32, GGML_TYPE_F16, 0.5f, 0.0f, true });     //   the vector blocks
    cases.push_back({ 128, 1, 2, 4, 7, 5, 5, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, true });     // odd cell count
    cases.push_back({ 128, 2, 4, 8, 4099, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 1.0f, 0.0f, false });  // alpha 1: mass
    cases.push_back({ 128, 1, 4, 8, 1500, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.3f, 0.0f, false });  // other alpha
    cases.push_back({ 256, 1, 2, 4, 600, 2, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 30.0f, false });  // soft-capped scores
    cases.push_back({ 128, 1, 4, 8, 70000, 1, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, false }); // long context
    cases.push_back({ 128, 1, 4, 8, 1000, 3, 1, GGML_TYPE_F16, GGML_TYPE_F16, 0.5f, 0.0f, true, false }); // no key norms
    // quantized keys: the bootstrap's many rows (a GPU reads them block by block), soft-capping, a long context
    cases.push_back({ 128, 16, 4, 2, 777, 1, 1, GGML_TYPE_Q8_0, GGML_TYPE_F16, 0.5f, 0.0f, false, false });
    cases.push_back({ 64, 16, 7, 2, 300, 2, 2, GGML_TYPE_Q4_0, GGML_TYPE_F32, 0.5f, 0.0f, true });
    cases.push_back({ 256, 16, 4, 1, 333, 1, 1, GGML_TYPE_Q8_0, GGML_TYPE_F32, 0.5f, 0.0f, true });
    cases.push_back({ 128, 2, 4, 8, 4099, 2, 1, GGML_TYPE_Q8_0, GGML_TYPE_F16, 0.3f, 0.0f, true });
    cases.push_back({ 256, 1, 2, 4, 600, 2, 1, GGML_TYPE_Q8_0, GGML_TYPE_F16, 0.5f, 30.0f, false });
    cases.push_back({ 128, 1, 4, 8, 20000, 1, 1, GGML_TYPE_Q4_0, GGML_TYPE_F16, 0.5f, 0.0f, false });

    ggml_backend_t cpu = ggml_backend_init_by_type(GGML_BACKEND_DEVICE_TYPE_CPU, nullptr);
    GGML_ASSERT(cpu);

    std::vector<ggml_backend_t> backends;
    for (size_t i = 0; i < ggml_backend_dev_count(); ++i) {
        ggml_backend_dev_t dev = ggml_backend_dev_get(i);
        if (ggml_backend_dev_type(dev) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            backends.push_back(cpu);
        } else if (ggml_backend_t b = ggml_backend_dev_init(dev, nullptr)) {
            backends.push_back(b);
        }
    }

    std::mt19937 rng(1234);
    int n_failed = 0, n_run = 0;
    for (const evidence_case & tc : cases) {
        const evidence_inputs in = make_inputs(tc, rng);

        bool ok_ref = false;
        const std::vector<float> ref = run(cpu, tc, in, true, &ok_ref);
        GGML_ASSERT(ok_ref);

        // the key norms by their definition, [n_head_kv, n_kv, nb]: of the keys' values (in.k holds them rounded)
        std::vector<float> ref_norms;
        if (tc.key_norms) {
            ref_norms.resize(tc.n_head_kv*tc.n_kv*tc.nb);
            for (int64_t b = 0; b < tc.nb; ++b) {
                for (int64_t h = 0; h < tc.n_head_kv; ++h) {
                    for (int64_t c = 0; c < tc.n_kv; ++c) {
                        const float * x = &in.k[((b*tc.n_head_kv + h)*tc.n_kv + c)*tc.n_embd];
                        double sq = 0.0;
                        for (int64_t d = 0; d < tc.n_embd; ++d) {
                            sq += (double) x[d]*x[d];
                        }
                        ref_norms[(b*tc.n_kv + c)*tc.n_head_kv + h] = (float) std::sqrt(sq);
                    }
                }
            }
        }

        for (ggml_backend_t backend : backends) {
            bool supported = false;
            const std::vector<float> got = run(backend, tc, in, false, &supported);
            const char * name = ggml_backend_name(backend);
            if (!supported) {
                n_failed += not_supported(backend, cpu, tc.name(), verbose);
                continue;
            }
            // the CPU takes the reference's own products; other backends round and sum in their own order
            const size_t n_evid = ref.size();
            GGML_ASSERT(got.size() == n_evid + ref_norms.size());
            const double err    = nmse(std::vector<float>(got.begin(), got.begin() + n_evid), ref);
            const double err_kn = tc.key_norms ? nmse(std::vector<float>(got.begin() + n_evid, got.end()), ref_norms) : 0.0;
            const double tol    = backend == cpu ? 1e-10 : 1e-6;
            const bool   ok     = err < tol && err_kn < tol;
            n_run++;
            n_failed += !ok;
            if (!ok || verbose) {
                printf("%s %s on %s: nmse %.3g, key norms %.3g\n", ok ? "ok  " : "FAIL", tc.name().c_str(), name, err, err_kn);
            }
        }
    }
    n_failed += test_top_k(backends, verbose, &n_run);
    n_failed += test_top_k_ids(backends, verbose, &n_run);
    n_failed += test_candidates(backends, cpu, verbose, &n_run);
    n_failed += test_copy_rows(backends, verbose, &n_run);
    n_failed += test_flash_attn_evidence(backends, cpu, verbose, &n_run);
    n_failed += test_selector_scores(backends, cpu, verbose, &n_run);
    n_failed += test_sample(backends, cpu, verbose, &n_run);

    printf("sfi-test-ops: %d runs, %d failed\n", n_run, n_failed);

    for (ggml_backend_t b : backends) {
        if (b != cpu) {
            ggml_backend_free(b);
        }
    }
    ggml_backend_free(cpu);
    return n_failed == 0 && n_run > 0 ? 0 : 1;
}
