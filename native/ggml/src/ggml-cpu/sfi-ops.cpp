// CPU forward of the SFI ops (see ggml-sfi.h)

#include "sfi-ops.h"

#include "ggml-sfi.h"

#include "ggml-cpu.h"
#include "ggml-cpu-impl.h"
#include "ggml-impl.h"
#include "ops.h"
#include "simd-mappings.h"
#include "vec.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

static float sfi_mask_value(const ggml_tensor * mask, int64_t c, int64_t r, int64_t b) {
    const char * p = (const char *) mask->data + c*mask->nb[0] + r*mask->nb[1] + (b % mask->ne[3])*mask->nb[3];
    return mask->type == GGML_TYPE_F16 ? GGML_CPU_FP16_TO_FP32(*(const ggml_fp16_t *) p) : *(const float *) p;
}

// a row of n values of type t as F32, with the CPU backend's vectorised conversions where it has them
static void sfi_row_to_f32(ggml_type t, const char * row, float * y, int64_t n) {
    switch (t) {
        case GGML_TYPE_F16:  ggml_cpu_fp16_to_fp32((const ggml_fp16_t *) row, y, n); break;
        case GGML_TYPE_BF16: ggml_cpu_bf16_to_fp32((const ggml_bf16_t *) row, y, n); break;
        default:             ggml_get_type_traits(t)->to_float(row, y, n);           break;
    }
}

#if defined(GGML_SIMD) && (defined(__AVX__) || defined(__ARM_NEON)) && !defined(__ARM_FEATURE_SVE)
#define SFI_DOT_ROWS_SIMD
// s[r] = x.q_r for R rows q_r of q (n floats each, one after the other), x read once
template <int R>
static void sfi_dot_rows_simd(int64_t n, const float * x, const float * q, float * s) {
    const int64_t n_simd = n - n % GGML_F32_EPR;
    GGML_F32_VEC acc[R];
    for (int r = 0; r < R; ++r) {
        acc[r] = GGML_F32_VEC_ZERO;
    }
    for (int64_t d = 0; d < n_simd; d += GGML_F32_EPR) {
        const GGML_F32_VEC xv = GGML_F32_VEC_LOAD(x + d);
        for (int r = 0; r < R; ++r) {
            acc[r] = GGML_F32_VEC_FMA(acc[r], GGML_F32_VEC_LOAD(q + r*n + d), xv);
        }
    }
    float lanes[GGML_F32_EPR];
    for (int r = 0; r < R; ++r) {
        GGML_F32_VEC_STORE(lanes, acc[r]);
        float sum = 0.0f;
        for (int e = 0; e < GGML_F32_EPR; ++e) {
            sum += lanes[e];
        }
        for (int64_t d = n_simd; d < n; ++d) {
            sum += x[d]*q[r*n + d];
        }
        s[r] = sum;
    }
}
#endif

// s[j] = x.q_j for the n_q rows q_j of q (n floats each, one after the other), x read once per four rows
static void sfi_dot_rows_f32(int64_t n, const float * x, const float * q, int64_t n_q, float * s) {
    int64_t j = 0;
#ifdef SFI_DOT_ROWS_SIMD
    for (; j + 4 <= n_q; j += 4) {
        sfi_dot_rows_simd<4>(n, x, q + j*n, s + j);
    }
    if (j + 2 <= n_q) {
        sfi_dot_rows_simd<2>(n, x, q + j*n, s + j);
        j += 2;
    }
    if (j < n_q) {
        sfi_dot_rows_simd<1>(n, x, q + j*n, s + j);
        j += 1;
    }
#endif
    for (; j < n_q; ++j) {
        ggml_vec_dot_f32((int) n, s + j, 0, x, 0, q + j*n, 0, 1);
    }
}

// the products of a KV head's query rows with its keys as the evidence op takes them (and mul_mat and flash attention):
// the rows, F32, rounded to the keys' vec_dot type. Keys of a float type: the rows kept as F32 (rounded), each key
// converted to F32 once and multiplied with every row; other keys: the rows in the vec_dot type, one vec_dot per key
// and row
struct sfi_key_products {
    const ggml_type_traits_cpu * k_traits;
    const ggml_type_traits_cpu * q_traits;
    ggml_type k_type;
    ggml_type vec_dot_type;
    int64_t   n_embd;
    bool      f32_rows;
    size_t    q_row_size;

    static bool float_keys(ggml_type t) { return t == GGML_TYPE_F32 || t == GGML_TYPE_F16 || t == GGML_TYPE_BF16; }

    // bytes of a query row as set_row writes it
    static size_t row_bytes(ggml_type k_type, int64_t n_embd) {
        return float_keys(k_type) ? sizeof(float)*n_embd : ggml_row_size(ggml_get_type_traits_cpu(k_type)->vec_dot_type, n_embd);
    }

    sfi_key_products(const ggml_tensor * k, int64_t n_embd) : k_type(k->type), n_embd(n_embd) {
        k_traits     = ggml_get_type_traits_cpu(k->type);
        vec_dot_type = k_traits->vec_dot_type;
        q_traits     = ggml_get_type_traits_cpu(vec_dot_type);
        f32_rows     = float_keys(k->type);
        q_row_size   = row_bytes(k->type, n_embd);
        GGML_ASSERT(k_traits->vec_dot && (vec_dot_type == GGML_TYPE_F32 || q_traits->from_float));
    }

    // query row qj as row j of q_conv
    void set_row(char * q_conv, int64_t j, const float * qj) const {
        char * row = q_conv + j*q_row_size;
        if (!f32_rows) {
            q_traits->from_float(qj, row, n_embd);
            return;
        }
        float * r = (float *) row;
        for (int64_t d = 0; d < n_embd; ++d) {
            switch (vec_dot_type) {
                case GGML_TYPE_F16:  r[d] = GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(qj[d])); break;
                case GGML_TYPE_BF16: r[d] = GGML_BF16_TO_FP32(GGML_FP32_TO_BF16(qj[d]));         break;
                default:             r[d] = qj[d];                                               break;
            }
        }
    }

    // s[j] = the products of a key row with the n_q rows of q_conv; k_f32: the key as F32 after, when f32_rows
    void dots(const char * k_row, const char * q_conv, int64_t n_q, float * s, float * k_f32) const {
        if (f32_rows) {
            const float * x = (const float *) k_row;
            if (k_type != GGML_TYPE_F32) {
                sfi_row_to_f32(k_type, k_row, k_f32, n_embd);
                x = k_f32;
            }
            sfi_dot_rows_f32(n_embd, x, (const float *) q_conv, n_q, s);
            return;
        }
        for (int64_t j = 0; j < n_q; ++j) {
            k_traits->vec_dot(n_embd, s + j, 0, k_row, 0, q_conv + j*q_row_size, 0, 1);
        }
    }
};


// the norm of a key row of k's type (buf: n_embd floats, for a type other than F32; holding the row as F32 already when
// converted)
static float sfi_key_norm(const ggml_tensor * k, const char * k_row, float * buf, bool converted) {
    const float * x = (const float *) k_row;
    if (k->type != GGML_TYPE_F32) {
        if (!converted) {
            sfi_row_to_f32(k->type, k_row, buf, k->ne[0]);
        }
        x = buf;
    }
    float norm = 0.0f;
    ggml_vec_norm_f32((int) k->ne[0], &norm, x);
    return norm;
}

// ggml_sfi_evidence and ggml_sfi_flash_attn_evidence on the CPU, as flash decoding over chunks of cells. A cache holds a
// cell's keys (and values) of every KV head in one row, so a work item is a chunk of one stream's cells with all of
// their heads: the rows are read in order, and every thread has work whatever the number of KV heads. The chunks do not
// depend on the number of threads, and so neither do the results.
//   1. per item: the scores of each head's query rows (as ggml's flash attention defines them, softcap*tanh(q.k) +
//      mask, with the query rows rounded to the keys' vec_dot type as mul_mat and flash attention take them), the
//      key norms, the chunk's weights exp(s - its max), their sum, and for attention the weighted sum of its values;
//   2. per (stream, KV head) pair: each row's softmax over its chunks, and for attention the combined output;
//   3. per item: the evidence, the sum over the rows of p^alpha.
static constexpr int64_t SFI_CHUNK = 256;

struct sfi_chunked_attention {
    const ggml_tensor * q;
    const ggml_tensor * k;
    const ggml_tensor * v; // nullptr: the evidence op
    const ggml_tensor * mask;

    float softcap;
    float alpha;
    float q_scale;       // the evidence op's rows come scaled
    bool  norms;

    int64_t D, Dv, n_q, n_head_kv, n_streams, n_kv, n_chunks;
    int64_t n_tokens;    // attention: query row j = g*n_tokens + t is query head h*n_gqa + g at token t
    int64_t n_gqa;
    int64_t n_mask_rows; // row j takes mask row j % n_mask_rows

    size_t q_row_bytes;

    explicit sfi_chunked_attention(const ggml_tensor * dst) : q(dst->src[0]), k(dst->src[1]) {
        D         = q->ne[0];
        n_kv      = k->ne[1];
        n_head_kv = k->ne[2];
        n_chunks  = (n_kv + SFI_CHUNK - 1)/SFI_CHUNK;
        if (dst->op == GGML_OP_SFI_FLASH_ATTN_EVIDENCE) {
            v           = dst->src[2];
            mask        = dst->src[3];
            const float scale = ggml_get_op_params_f32(dst, 0);
            softcap     = ggml_get_op_params_f32(dst, 1);
            alpha       = ggml_get_op_params_f32(dst, 2);
            norms       = ggml_get_op_params_i32(dst, 3) != 0;
            q_scale     = softcap > 0.0f ? scale/softcap : scale;
            Dv          = v->ne[0];
            n_tokens    = q->ne[1];
            n_gqa       = q->ne[2]/n_head_kv;
            n_q         = n_gqa*n_tokens;
            n_streams   = q->ne[3];
            n_mask_rows = n_tokens;
        } else {
            // q [n_embd, n_q, n_head_kv, nb]: the rows grouped by KV head
            v           = nullptr;
            mask        = dst->src[2];
            n_mask_rows = ggml_get_op_params_i32(dst, 0);
            alpha       = ggml_get_op_params_f32(dst, 1);
            softcap     = ggml_get_op_params_f32(dst, 2);
            norms       = ggml_get_op_params_i32(dst, 3) != 0;
            q_scale     = 1.0f;
            Dv          = 0;
            n_tokens    = q->ne[1];
            n_gqa       = 1;
            n_q         = q->ne[1];
            n_streams   = k->ne[3];
        }
        q_row_bytes = sfi_key_products::row_bytes(k->type, D);
    }

    int64_t n_pairs() const { return n_streams*n_head_kv; }
    int64_t n_items() const { return n_streams*n_chunks; }
    int64_t part_floats() const { return 2 + Dv; }

    // the work buffer, shared: the weights [pair][row][n_kv], the chunks' partial results [pair][chunk][row] (max, sum,
    // output), each row's max and 1/sum [pair][row]; then per thread a key and a value as F32, a key's products, a
    // cell's mask values, a scaled query row and the rows of every head in the keys' vec_dot type
    size_t shared_bytes() const {
        return GGML_PAD(sizeof(float)*(n_pairs()*n_q*(n_kv + n_chunks*part_floats() + 2)), CACHE_LINE_SIZE);
    }
    size_t thread_bytes() const {
        return GGML_PAD(sizeof(float)*(D + Dv + 2*n_q + D) + q_row_bytes*n_head_kv*n_q, CACHE_LINE_SIZE);
    }

    float * weights(void * wdata, int64_t pair) const { return (float *) wdata + pair*n_q*n_kv; }
    float * part(void * wdata, int64_t pair, int64_t chunk, int64_t j) const {
        return (float *) wdata + n_pairs()*n_q*n_kv + ((pair*n_chunks + chunk)*n_q + j)*part_floats();
    }
    float * stats(void * wdata, int64_t pair, int64_t j) const {
        return (float *) wdata + n_pairs()*n_q*(n_kv + n_chunks*part_floats()) + (pair*n_q + j)*2;
    }
    float * thread(void * wdata, int ith) const { return (float *) ((char *) wdata + shared_bytes() + ith*thread_bytes()); }

    const float * q_row(int64_t j, int64_t h, int64_t b) const {
        return v ? (const float *) ((const char *) q->data + (j % n_tokens)*q->nb[1] + (h*n_gqa + j/n_tokens)*q->nb[2] + b*q->nb[3])
                 : (const float *) ((const char *) q->data + j*q->nb[1] + h*q->nb[2] + b*q->nb[3]);
    }
};

// [begin, end) of n items for this thread
static void sfi_thread_range(const ggml_compute_params * params, int64_t n, int64_t & begin, int64_t & end) {
    begin = n*params->ith/params->nth;
    end   = n*(params->ith + 1)/params->nth;
}

// out: the attention output [Dv, n_head, n_tokens, ns] (nullptr for the evidence op); evid: the evidence
// [n_kv, n_head_kv, ns], then the key norms [n_head_kv, n_kv, ns] when asked for
static void sfi_compute_chunked_attention(const ggml_compute_params * params, const sfi_chunked_attention & a, float * out,
        float * evid) {
    const int64_t n_q       = a.n_q;
    const int64_t n_kv      = a.n_kv;
    const int64_t n_head_kv = a.n_head_kv;
    const int64_t n_chunks  = a.n_chunks;
    const int64_t Dv        = a.Dv;
    void * wdata = params->wdata;

    GGML_ASSERT(a.q->nb[0] == sizeof(float));
    GGML_ASSERT(!a.norms || a.k->type == GGML_TYPE_F32 || ggml_get_type_traits(a.k->type)->to_float);
    GGML_ASSERT(!a.v || a.v->type == GGML_TYPE_F32 || ggml_get_type_traits(a.v->type)->to_float);

    const sfi_key_products products(a.k, a.D);

    float * kf     = a.thread(wdata, params->ith);
    float * vf     = kf + a.D;
    float * row_s  = vf + Dv;
    float * mask_c = row_s + n_q;  // a cell's mask value for each row (the same for every head)
    float * q_sc   = mask_c + n_q;
    char  * q_conv = (char *) (q_sc + a.D); // [head][row]

    float * kn = a.norms ? evid + a.n_pairs()*n_kv : nullptr;

    int64_t i0, i1;
    sfi_thread_range(params, a.n_items(), i0, i1);
    int64_t q_stream = -1; // the stream whose query rows q_conv holds
    for (int64_t item = i0; item < i1; ++item) {
        const int64_t b  = item / n_chunks;
        const int64_t ch = item % n_chunks;
        const int64_t c0 = ch*SFI_CHUNK;
        const int64_t c1 = std::min(n_kv, c0 + SFI_CHUNK);

        if (b != q_stream) {
            for (int64_t h = 0; h < n_head_kv; ++h) {
                for (int64_t j = 0; j < n_q; ++j) {
                    const float * qj = a.q_row(j, h, b);
                    for (int64_t d = 0; d < a.D; ++d) {
                        q_sc[d] = a.q_scale*qj[d];
                    }
                    products.set_row(q_conv + h*n_q*a.q_row_bytes, j, q_sc);
                }
            }
            q_stream = b;
        }

        for (int64_t c = c0; c < c1; ++c) {
            for (int64_t j = 0; j < n_q; ++j) {
                mask_c[j] = j < a.n_mask_rows ? sfi_mask_value(a.mask, c, j, b) : mask_c[j % a.n_mask_rows];
            }
            for (int64_t h = 0; h < n_head_kv; ++h) {
                const char * k_row = (const char *) a.k->data + c*a.k->nb[1] + h*a.k->nb[2] + b*a.k->nb[3];
                products.dots(k_row, q_conv + h*n_q*a.q_row_bytes, n_q, row_s, kf);
                float * w = a.weights(wdata, b*n_head_kv + h);
                for (int64_t j = 0; j < n_q; ++j) {
                    const float s = a.softcap > 0.0f ? a.softcap*tanhf(row_s[j]) : row_s[j];
                    w[j*n_kv + c] = s + mask_c[j];
                }
                if (kn) {
                    kn[(b*n_kv + c)*n_head_kv + h] = sfi_key_norm(a.k, k_row, kf, products.f32_rows);
                }
            }
        }

        // each row's weights exp(s - the chunk's max), the chunk's max and sum
        for (int64_t h = 0; h < n_head_kv; ++h) {
            const int64_t pair = b*n_head_kv + h;
            float * w = a.weights(wdata, pair);
            for (int64_t j = 0; j < n_q; ++j) {
                float * wj = w + j*n_kv;
                float max = -INFINITY;
                for (int64_t c = c0; c < c1; ++c) {
                    max = std::max(max, wj[c]);
                }
                float * part = a.part(wdata, pair, ch, j);
                part[0] = max;
                if (max == -INFINITY) { // every cell of the chunk excluded
                    std::fill(wj + c0, wj + c1, 0.0f);
                    part[1] = 0.0f;
                } else {
                    part[1] = (float) ggml_vec_soft_max_f32((int) (c1 - c0), wj + c0, wj + c0, max);
                }
                std::fill(part + 2, part + 2 + Dv, 0.0f);
            }
        }

        if (a.v) {
            for (int64_t c = c0; c < c1; ++c) {
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    const int64_t pair = b*n_head_kv + h;
                    const char * vr = (const char *) a.v->data + c*a.v->nb[1] + h*a.v->nb[2] + b*a.v->nb[3];
                    const float * vr_f32 = (const float *) vr;
                    if (a.v->type != GGML_TYPE_F32) {
                        sfi_row_to_f32(a.v->type, vr, vf, Dv);
                        vr_f32 = vf;
                    }
                    const float * w = a.weights(wdata, pair);
                    for (int64_t j = 0; j < n_q; ++j) {
                        const float wc = w[j*n_kv + c];
                        if (wc != 0.0f) {
                            ggml_vec_mad_f32((int) Dv, a.part(wdata, pair, ch, j) + 2, vr_f32, wc);
                        }
                    }
                }
            }
        }
    }

    ggml_barrier(params->threadpool);

    // each row's softmax over its pair's chunks; the attention output combined from the chunks'
    sfi_thread_range(params, a.n_pairs(), i0, i1);
    for (int64_t pair = i0; pair < i1; ++pair) {
        for (int64_t j = 0; j < n_q; ++j) {
            float max = -INFINITY;
            for (int64_t i = 0; i < n_chunks; ++i) {
                max = std::max(max, a.part(wdata, pair, i, j)[0]);
            }
            double sum = 0.0;
            for (int64_t i = 0; i < n_chunks && max != -INFINITY; ++i) {
                const float * part = a.part(wdata, pair, i, j);
                sum += part[0] == -INFINITY ? 0.0 : (double) part[1]*expf(part[0] - max);
            }
            const float inv_sum = sum > 0.0 ? (float) (1.0/sum) : 0.0f;
            float * st = a.stats(wdata, pair, j);
            st[0] = max;
            st[1] = inv_sum;

            if (!out) {
                continue;
            }
            // [Dv, n_head, n_tokens, ns]; a row whose cells are all excluded gives zeros
            const int64_t h = pair % n_head_kv;
            const int64_t b = pair / n_head_kv;
            const int64_t n_head = n_head_kv*a.n_gqa;
            float * o = out + ((b*a.n_tokens + j % a.n_tokens)*n_head + h*a.n_gqa + j/a.n_tokens)*Dv;
            std::fill(o, o + Dv, 0.0f);
            for (int64_t i = 0; i < n_chunks && inv_sum != 0.0f; ++i) {
                const float * part = a.part(wdata, pair, i, j);
                if (part[0] != -INFINITY) {
                    ggml_vec_mad_f32((int) Dv, o, part + 2, expf(part[0] - max)*inv_sum);
                }
            }
        }
    }

    ggml_barrier(params->threadpool);

    // the evidence: p = w*exp(chunk max - row max)/sum
    sfi_thread_range(params, a.n_items(), i0, i1);
    for (int64_t item = i0; item < i1; ++item) {
        const int64_t b  = item / n_chunks;
        const int64_t ch = item % n_chunks;
        const int64_t c0 = ch*SFI_CHUNK;
        const int64_t c1 = std::min(n_kv, c0 + SFI_CHUNK);
        for (int64_t h = 0; h < n_head_kv; ++h) {
            const int64_t pair = b*n_head_kv + h;
            const float * w  = a.weights(wdata, pair);
            float       * ev = evid + pair*n_kv;
            std::fill(ev + c0, ev + c1, 0.0f);
            for (int64_t j = 0; j < n_q; ++j) {
                const float   m  = a.part(wdata, pair, ch, j)[0];
                const float * st = a.stats(wdata, pair, j);
                if (m == -INFINITY || st[1] == 0.0f) {
                    continue;
                }
                const float   f  = expf(m - st[0])*st[1];
                const float * wj = w + j*n_kv;
                if (a.alpha == 0.5f) {
                    const float sf = sqrtf(f);
                    for (int64_t c = c0; c < c1; ++c) {
                        ev[c] += sqrtf(wj[c])*sf;
                    }
                } else {
                    for (int64_t c = c0; c < c1; ++c) {
                        const float p = wj[c]*f;
                        ev[c] += p > 0.0f ? powf(p, a.alpha) : 0.0f;
                    }
                }
            }
        }
    }
}

// the evidence [n_kv, n_head_kv, nb], then the key norms
void ggml_compute_forward_sfi_evidence(const ggml_compute_params * params, ggml_tensor * dst) {
    GGML_ASSERT(dst->src[1]->nb[0] == ggml_type_size(dst->src[1]->type));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    sfi_compute_chunked_attention(params, sfi_chunked_attention(dst), nullptr, (float *) dst->data);
}

// the output [Dv, n_head, n_tokens, ns], then the evidence and key norms as ggml_sfi_evidence gives them
void ggml_compute_forward_sfi_flash_attn_evidence(const ggml_compute_params * params, ggml_tensor * dst) {
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));
    const sfi_chunked_attention a(dst);
    float * out = (float *) dst->data;
    sfi_compute_chunked_attention(params, a, out, out + a.Dv*a.n_head_kv*a.n_gqa*a.n_tokens*a.n_streams);
}

size_t ggml_sfi_op_work_size(const ggml_tensor * node, int n_tasks) {
    switch (node->op) {
        case GGML_OP_SFI_FLASH_ATTN_EVIDENCE:
        case GGML_OP_SFI_EVIDENCE:
            {
                const sfi_chunked_attention a(node);
                return a.shared_bytes() + a.thread_bytes()*n_tasks;
            }
        case GGML_OP_SFI_TOP_K:
            return GGML_PAD(sizeof(int32_t)*node->src[0]->ne[0], CACHE_LINE_SIZE)*n_tasks; // a row's indices
        case GGML_OP_SFI_CANDIDATE_SCORES:
            return GGML_PAD(sizeof(float)*node->src[0]->ne[0], CACHE_LINE_SIZE)*n_tasks;   // a row's weights
        default:
            return 0;
    }
}

// rows split over the threads; per row the k best indices by a partial selection, then put in increasing order
void ggml_compute_forward_sfi_top_k(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * a   = dst->src[0];
    const ggml_tensor * ids = dst->src[1];

    const int64_t n      = a->ne[0];
    const int64_t k      = dst->ne[0];
    const int64_t n_rows = ggml_nrows(a);

    GGML_ASSERT(a->type == GGML_TYPE_F32 && dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));

    int32_t * idx = (int32_t *) ((char *) params->wdata + params->ith*GGML_PAD(sizeof(int32_t)*n, CACHE_LINE_SIZE));

    for (int64_t r = params->ith; r < n_rows; r += params->nth) {
        const int64_t i1 = r % a->ne[1];
        const int64_t i2 = (r / a->ne[1]) % a->ne[2];
        const int64_t i3 = r / (a->ne[1]*a->ne[2]);

        const float * x = (const float *) ((const char *) a->data + i1*a->nb[1] + i2*a->nb[2] + i3*a->nb[3]);

        for (int64_t i = 0; i < n; ++i) {
            idx[i] = (int32_t) i;
        }
        // the larger value first, the lower index among equal ones (-0 == +0)
        auto better = [x](int32_t i, int32_t j) { return x[i] > x[j] || (x[i] == x[j] && i < j); };
        std::nth_element(idx, idx + k - 1, idx + n, better);
        std::sort(idx, idx + k);

        if (ids) { // the row's ids: those of its (i2, i3)
            const int32_t * ids_r = (const int32_t *) ids->data + (i2 + i3*a->ne[2])*n;
            for (int64_t j = 0; j < k; ++j) {
                idx[j] = ids_r[idx[j]];
            }
        }

        memcpy((char *) dst->data + r*dst->nb[1], idx, k*sizeof(int32_t));
    }
}

// one thread per (head, batch) row at a time: the weights w = e^(1/alpha) of the kept cells (relative to the row's
// largest, as a softmax takes them), pooled, normalised into f; a barrier, then the cells split over the threads
// for the head sums
void ggml_compute_forward_sfi_candidate_scores(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * evid = dst->src[0];
    const ggml_tensor * mask = dst->src[1];

    const float alpha = ggml_get_op_params_f32(dst, 0);
    const int   pool  = ggml_get_op_params_i32(dst, 1);
    const int   half  = pool > 1 ? pool/2 : 0;

    const int64_t n_kv   = evid->ne[0];
    const int64_t n_head = evid->ne[2];
    const int64_t nb     = evid->ne[3];
    const int64_t ns     = mask->ne[3];

    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const float * e_all = (const float *) evid->data;
    const float * m_all = (const float *) mask->data;
    float       * out   = (float *) dst->data;

    float * w = (float *) ((char *) params->wdata + params->ith*GGML_PAD(sizeof(float)*n_kv, CACHE_LINE_SIZE));

    for (int64_t row = params->ith; row < n_head*nb; row += params->nth) {
        const int64_t h = row % n_head;
        const int64_t b = row / n_head;

        const float * e = e_all + (b*n_head + h)*n_kv;
        const float * m = m_all + (b % ns)*n_kv;
        float       * f = out + ((1 + h)*nb + b)*n_kv;

        float lmax = -INFINITY;
        for (int64_t c = 0; c < n_kv; ++c) {
            if (m[c] != -INFINITY && e[c] > 0.0f) {
                lmax = std::max(lmax, logf(e[c]));
            }
        }
        for (int64_t c = 0; c < n_kv; ++c) {
            w[c] = m[c] != -INFINITY && e[c] > 0.0f ? expf((logf(e[c]) - lmax)/alpha) : 0.0f;
        }
        double sum = 0.0;
        for (int64_t c = 0; c < n_kv; ++c) {
            float v = w[c];
            if (half > 0) {
                v = 0.0f;
                if (m[c] != -INFINITY) {
                    for (int64_t d = std::max<int64_t>(0, c - half); d <= std::min<int64_t>(n_kv - 1, c + half); ++d) {
                        v = std::max(v, w[d]);
                    }
                }
            }
            f[c] = v;
            sum += v;
        }
        const float scale = sum > 0.0 ? (float) (1.0/sum) : 0.0f;
        for (int64_t c = 0; c < n_kv; ++c) {
            f[c] *= scale;
        }
    }

    ggml_barrier(params->threadpool);

    const int64_t per = (n_kv*nb + params->nth - 1)/params->nth;
    for (int64_t i = params->ith*per; i < std::min(n_kv*nb, (params->ith + 1)*per); ++i) {
        const int64_t c = i % n_kv;
        const int64_t b = i / n_kv;
        float score = 0.0f;
        for (int64_t h = 0; h < n_head; ++h) {
            score += out[((1 + h)*nb + b)*n_kv + c];
        }
        out[b*n_kv + c] = score + m_all[(b % ns)*n_kv + c];
    }
}

void ggml_compute_forward_sfi_candidate_values(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * cs    = dst->src[0];
    const ggml_tensor * u     = dst->src[1];
    const ggml_tensor * mask  = dst->src[2];
    const ggml_tensor * cells = dst->src[3];

    const int64_t n_kv   = cs->ne[0];
    const int64_t nb     = cs->ne[1];
    const int64_t n_head = cs->ne[2] - 1;
    const int64_t n_cand = cells->ne[0];
    const int64_t ns     = ggml_nelements(mask)/n_kv;

    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const float   * f   = (const float *) cs->data;
    const int32_t * idx = (const int32_t *) cells->data;
    float         * out = (float *) dst->data;

    for (int64_t b = params->ith; b < nb; b += params->nth) {
        const float * ub = (const float *) u->data    + (b % ns)*n_kv;
        const float * mb = (const float *) mask->data + (b % ns)*n_kv;
        for (int64_t i = 0; i < n_cand; ++i) {
            const int64_t c = idx[b*n_cand + i];
            GGML_ASSERT(c >= 0 && c < n_kv);
            for (int64_t h = 0; h < n_head; ++h) {
                out[(b*(n_head + 2) + h)*n_cand + i] = f[((1 + h)*nb + b)*n_kv + c];
            }
            out[(b*(n_head + 2) + n_head    )*n_cand + i] = ub[c];
            out[(b*(n_head + 2) + n_head + 1)*n_cand + i] = mb[c];
        }
    }
}

// the batches split over the threads: a thread scores every head's row of its batch, then the heads of each candidate
void ggml_compute_forward_sfi_selector_scores(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * vals  = dst->src[0];
    const ggml_tensor * kn    = dst->src[1];
    const ggml_tensor * cells = dst->src[2];

    ggml_sfi_selector_params p;
    memcpy(&p, dst->op_params, sizeof(p));

    const int64_t n_cand = vals->ne[0];
    const int64_t n_head = vals->ne[1] - 2;
    const int64_t nb     = vals->ne[2];
    const int64_t n_kn   = kn->ne[1];

    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const float tiny = std::numeric_limits<float>::min();
    const float big  = std::numeric_limits<float>::max();

    for (int64_t b = params->ith; b < nb; b += params->nth) {
        const float   * v_b   = (const float *) vals->data + b*(n_head + 2)*n_cand;
        const float   * u     = v_b + n_head*n_cand;
        const float   * m     = v_b + (n_head + 1)*n_cand;
        const float   * kn_b  = (const float *) kn->data + b*n_kn*n_head;
        const int32_t * c_b   = cells ? (const int32_t *) cells->data + b*n_cand : nullptr;
        float         * out_b = (float *) dst->data + b*n_head*n_cand;

        for (int64_t h = 0; h < n_head; ++h) {
            const float * f = v_b + h*n_cand;
            float       * s = out_b + h*n_cand; // the prior's logits x first, then the scores

            double sum_f = 0.0;
            float  x_max = -INFINITY;
            for (int64_t i = 0; i < n_cand; ++i) {
                const int64_t row = c_b ? c_b[i] : i;
                GGML_ASSERT(row >= 0 && row < n_kn);
                const float u_pow = expf(p.pos_power*logf(u[i]));
                const float prior = p.w_pos*(-p.pos_beta*u_pow + p.pos_eta*logf(1.0f - u[i])) + m[i];
                s[i]  = p.key_norm_exponent*logf(std::min(std::max(kn_b[row*n_head + h], tiny), big)) + prior;
                x_max = std::max(x_max, s[i]);
                sum_f += f[i];
            }
            double z = 0.0;
            for (int64_t i = 0; i < n_cand; ++i) {
                z += expf(s[i] - x_max);
            }
            const float inv_f = sum_f > 0.0 ? (float) (1.0/sum_f) : 0.0f;
            const float inv_z = (float) (1.0/z);
            double num = 0.0;
            double den = 0.0;
            for (int64_t i = 0; i < n_cand; ++i) {
                const float fi = f[i]*inv_f;
                const float d  = fi - expf(s[i] - x_max)*inv_z;
                s[i] = d; // d from here on
                num += (double) fi*d;
                den += (double) d*d;
            }
            const float lambda = std::min(std::max((float) (num/(den + 1e-30)), 0.0f), p.lambda_max);
            for (int64_t i = 0; i < n_cand; ++i) {
                s[i] = logf(std::min(std::max(f[i]*inv_f - lambda*s[i], tiny), big));
            }
        }

        if (p.cross_head_alpha != 0.0f) {
            const float inv_t = 1.0f/p.cross_head_temperature;
            for (int64_t i = 0; i < n_cand; ++i) {
                float t_max = -INFINITY;
                for (int64_t h = 0; h < n_head; ++h) {
                    t_max = std::max(t_max, out_b[h*n_cand + i]*inv_t);
                }
                double z = 0.0;
                for (int64_t h = 0; h < n_head; ++h) {
                    z += expf(out_b[h*n_cand + i]*inv_t - t_max);
                }
                const float log_z = t_max + logf((float) z);
                for (int64_t h = 0; h < n_head; ++h) {
                    float & s = out_b[h*n_cand + i];
                    s += p.cross_head_alpha*(s*inv_t - log_z);
                }
            }
        }
    }
}

// the rows split over the threads; each a memcpy
void ggml_compute_forward_sfi_copy_rows(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * src   = dst->src[1];
    const ggml_tensor * idx   = dst->src[2];
    const ggml_tensor * slots = dst->src[3];

    const int64_t n   = idx->ne[0];
    const int64_t ne2 = idx->ne[1];
    const int64_t ne3 = idx->ne[2];

    const int64_t n_src = src->ne[1];
    const int64_t n_dst = dst->ne[1];

    const size_t row = ggml_row_size(src->type, src->ne[0]);

    const int64_t * sl = (const int64_t *) slots->data;

    for (int64_t r = params->ith; r < n*ne2*ne3; r += params->nth) {
        const int64_t i = r % n;
        const int64_t j = (r / n) % ne2;
        const int64_t l = r / (n*ne2);

        const int32_t c = *(const int32_t *) ((const char *) idx->data + i*idx->nb[0] + j*idx->nb[1] + l*idx->nb[2]);
        GGML_ASSERT(c >= 0 && c < n_src && sl[i] >= 0 && sl[i] < n_dst);

        memcpy((char *) dst->data + sl[i]*dst->nb[1] + j*dst->nb[2] + l*dst->nb[3],
               (const char *) src->data + c*src->nb[1] + j*src->nb[2] + l*src->nb[3], row);
    }
}
