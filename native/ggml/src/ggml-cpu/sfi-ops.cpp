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

// s[j] = x.q_j for the n_q rows q_j of q (n floats each, one after the other), x read once per four rows
static void sfi_dot_rows_f32(int64_t n, const float * x, const float * q, int64_t n_q, float * s) {
    int64_t j = 0;
#if defined(GGML_SIMD) && (defined(__AVX__) || defined(__ARM_NEON)) && !defined(__ARM_FEATURE_SVE)
    const int64_t n_simd = n - n % GGML_F32_EPR;
    for (; j + 4 <= n_q; j += 4) {
        const float * q0 = q + j*n;
        GGML_F32_VEC acc[4] = { GGML_F32_VEC_ZERO, GGML_F32_VEC_ZERO, GGML_F32_VEC_ZERO, GGML_F32_VEC_ZERO };
        for (int64_t d = 0; d < n_simd; d += GGML_F32_EPR) {
            const GGML_F32_VEC xv = GGML_F32_VEC_LOAD(x + d);
            for (int r = 0; r < 4; ++r) {
                acc[r] = GGML_F32_VEC_FMA(acc[r], GGML_F32_VEC_LOAD(q0 + r*n + d), xv);
            }
        }
        float lanes[GGML_F32_EPR];
        for (int r = 0; r < 4; ++r) {
            GGML_F32_VEC_STORE(lanes, acc[r]);
            float sum = 0.0f;
            for (int e = 0; e < GGML_F32_EPR; ++e) {
                sum += lanes[e];
            }
            for (int64_t d = n_simd; d < n; ++d) {
                sum += x[d]*q0[r*n + d];
            }
            s[j + r] = sum;
        }
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

// ggml_sfi_flash_attn_evidence on the CPU cuts each (KV head, stream) pair's cells into chunks of this many, one work
// item each, so that every thread has work whatever the number of KV heads; the chunks do not depend on the number of
// threads, and so neither do the results
static constexpr int64_t SFI_FAE_CHUNK = 1024;

// the fused op's work buffer: shared by the threads, the weights of every query row over every cell of each pair
// [pair][row][n_kv] and each chunk's partial result [pair][chunk][row] (max, sum, output); then per thread a key and a
// value as F32, the scaled query rows and those in the keys' vec_dot type
struct sfi_fae_work {
    int64_t n_q, n_kv, n_pairs, n_chunks, D, Dv;
    size_t  q_conv_bytes;

    explicit sfi_fae_work(const ggml_tensor * dst) {
        const ggml_tensor * q = dst->src[0];
        const ggml_tensor * k = dst->src[1];
        const ggml_tensor * v = dst->src[2];
        n_q          = q->ne[1]*(q->ne[2]/k->ne[2]);
        n_kv         = k->ne[1];
        n_pairs      = k->ne[2]*q->ne[3];
        n_chunks     = (n_kv + SFI_FAE_CHUNK - 1)/SFI_FAE_CHUNK;
        D            = q->ne[0];
        Dv           = v->ne[0];
        q_conv_bytes = sfi_key_products::row_bytes(k->type, D)*n_q;
    }

    int64_t part_floats() const { return 2 + Dv; }

    size_t shared_bytes() const {
        return GGML_PAD(sizeof(float)*(n_pairs*n_q*n_kv + n_pairs*n_chunks*n_q*part_floats()), CACHE_LINE_SIZE);
    }

    size_t thread_bytes() const {
        return GGML_PAD(sizeof(float)*(D + Dv + n_q*D + n_q) + q_conv_bytes, CACHE_LINE_SIZE);
    }

    float * weights(void * wdata, int64_t pair) const { return (float *) wdata + pair*n_q*n_kv; }

    float * part(void * wdata, int64_t pair, int64_t chunk, int64_t j) const {
        return (float *) wdata + n_pairs*n_q*n_kv + ((pair*n_chunks + chunk)*n_q + j)*part_floats();
    }

    float * thread(void * wdata, int ith) const { return (float *) ((char *) wdata + shared_bytes() + ith*thread_bytes()); }
};

// per thread: the scores of every query row of one (head, batch) pair, those rows in the keys' vec_dot type, and a
// key as F32 (for its norm)
static size_t sfi_evidence_bytes_per_thread(const ggml_tensor * dst) {
    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];
    return GGML_PAD(sizeof(float)*q->ne[1]*k->ne[1] + sfi_key_products::row_bytes(k->type, q->ne[0])*q->ne[1] +
            sizeof(float)*(q->ne[0] + q->ne[1]), CACHE_LINE_SIZE);
}

size_t ggml_sfi_op_work_size(const ggml_tensor * node, int n_tasks) {
    switch (node->op) {
        case GGML_OP_SFI_FLASH_ATTN_EVIDENCE:
            {
                const sfi_fae_work work(node);
                return work.shared_bytes() + work.thread_bytes()*n_tasks;
            }
        case GGML_OP_SFI_EVIDENCE:
            return sfi_evidence_bytes_per_thread(node)*n_tasks;
        case GGML_OP_SFI_TOP_K:
            return GGML_PAD(sizeof(int32_t)*node->src[0]->ne[0], CACHE_LINE_SIZE)*n_tasks; // a row's indices
        case GGML_OP_SFI_CANDIDATE_SCORES:
            return GGML_PAD(sizeof(float)*node->src[0]->ne[0], CACHE_LINE_SIZE)*n_tasks;   // a row's weights
        default:
            return 0;
    }
}

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

// the scores of a KV head's n_q query rows (q_conv: sfi_key_products::set_row) over the cells [c0, c1) of (head h,
// batch b), as flash attention defines them, softcap*tanh(q.k) + mask (row j's mask row: j % n_mask_rows), into
// scores[j*n_kv + c]; with kn each key's norm at kn[(b*n_kv + c)*n_head_kv + h] (k_f32: n_embd floats; row_s: n_q)
static void sfi_cell_scores(const sfi_key_products & products, const ggml_tensor * k, const ggml_tensor * mask, const char * q_conv,
        int64_t n_q, int64_t n_mask_rows, float softcap, int64_t h, int64_t b, int64_t c0, int64_t c1, float * scores,
        float * kn, float * k_f32, float * row_s) {
    const int64_t n_kv      = k->ne[1];
    const int64_t n_head_kv = k->ne[2];

    for (int64_t c = c0; c < c1; ++c) {
        const char * k_row = (const char *) k->data + c*k->nb[1] + h*k->nb[2] + b*k->nb[3];
        products.dots(k_row, q_conv, n_q, row_s, k_f32);
        for (int64_t j = 0; j < n_q; ++j) {
            float s = row_s[j];
            if (softcap > 0.0f) {
                s = softcap*tanhf(s);
            }
            scores[j*n_kv + c] = s + sfi_mask_value(mask, c, j % n_mask_rows, b);
        }
        if (kn) {
            kn[(b*n_kv + c)*n_head_kv + h] = sfi_key_norm(k, k_row, k_f32, products.f32_rows);
        }
    }
}

// one thread per (head, batch) pair at a time: the scores of every row, their max and sum, then the evidence. The
// products are the CPU's own (the query rows converted to the keys' vec_dot type, as mul_mat and flash attention do),
// so the probabilities are those of the attention the step computed
void ggml_compute_forward_sfi_evidence(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * mask = dst->src[2];

    const int32_t n_rows  = ggml_get_op_params_i32(dst, 0);
    const float   alpha   = ggml_get_op_params_f32(dst, 1);
    const float   softcap = ggml_get_op_params_f32(dst, 2);
    const bool    norms   = ggml_get_op_params_i32(dst, 3) != 0;

    const int64_t n_embd    = q->ne[0];
    const int64_t n_q       = q->ne[1];
    const int64_t n_head_kv = k->ne[2];
    const int64_t n_kv      = k->ne[1];
    const int64_t nb        = k->ne[3];

    GGML_ASSERT(q->nb[0] == sizeof(float));
    GGML_ASSERT(k->nb[0] == ggml_type_size(k->type));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const sfi_key_products products(k, n_embd);

    char  * work   = (char *) params->wdata + params->ith*sfi_evidence_bytes_per_thread(dst);
    float * scores = (float *) work;
    char  * q_conv = work + sizeof(float)*n_q*n_kv;
    float * k_f32  = (float *) (q_conv + products.q_row_size*n_q);
    float * row_s  = k_f32 + n_embd;

    GGML_ASSERT(!norms || k->type == GGML_TYPE_F32 || ggml_get_type_traits(k->type)->to_float);

    // the key norms [n_head_kv, n_kv, nb] after the evidence
    float * kn = norms ? (float *) ((char *) dst->data + dst->nb[3]) : nullptr;

    for (int64_t pair = params->ith; pair < n_head_kv*nb; pair += params->nth) {
        const int64_t h = pair % n_head_kv;
        const int64_t b = pair / n_head_kv;

        for (int64_t j = 0; j < n_q; ++j) {
            products.set_row(q_conv, j, (const float *) ((const char *) q->data + j*q->nb[1] + h*q->nb[2] + b*q->nb[3]));
        }

        sfi_cell_scores(products, k, mask, q_conv, n_q, n_rows, softcap, h, b, 0, n_kv, scores, kn, k_f32, row_s);

        float * evid = (float *) ((char *) dst->data + h*dst->nb[1] + b*dst->nb[2]);
        std::fill(evid, evid + n_kv, 0.0f);

        for (int64_t j = 0; j < n_q; ++j) {
            const float * sj = scores + j*n_kv;

            float max = -INFINITY;
            for (int64_t c = 0; c < n_kv; ++c) {
                max = std::max(max, sj[c]);
            }
            if (max == -INFINITY) {
                continue; // every cell excluded
            }
            double sum = 0.0;
            for (int64_t c = 0; c < n_kv; ++c) {
                sum += expf(sj[c] - max);
            }
            // p^alpha = exp(alpha*(s - max)) / sum^alpha
            const float scale = (float) std::pow(sum, -(double) alpha);
            for (int64_t c = 0; c < n_kv; ++c) {
                evid[c] += expf(alpha*(sj[c] - max))*scale;
            }
        }
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

// flash decoding over chunks of cells: each work item (a pair of KV head and stream, a chunk of its cells) computes the
// scores of the group's query rows as ggml's flash attention defines them, softcap*tanh(scale/softcap*q.k) + mask, with
// ggml_sfi_evidence's products (the scaled query rows in the keys' vec_dot type, so that the evidence is that op's),
// and the chunk's weights exp(s - its max), their sum and the weighted sum of its values; after a barrier, each item
// scales its weights by the pair's softmax into the evidence, and each pair's first item combines the chunks' outputs
void ggml_compute_forward_sfi_flash_attn_evidence(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const float scale   = ggml_get_op_params_f32(dst, 0);
    const float softcap = ggml_get_op_params_f32(dst, 1);
    const float alpha   = ggml_get_op_params_f32(dst, 2);
    const bool  norms   = ggml_get_op_params_i32(dst, 3) != 0;

    const sfi_fae_work work(dst);

    const int64_t D         = work.D;
    const int64_t Dv        = work.Dv;
    const int64_t n_tokens  = q->ne[1];
    const int64_t n_head    = q->ne[2];
    const int64_t n_kv      = work.n_kv;
    const int64_t n_head_kv = k->ne[2];
    const int64_t n_gqa     = n_head/n_head_kv;
    const int64_t n_q       = work.n_q;
    const int64_t n_chunks  = work.n_chunks;
    const int64_t n_items   = work.n_pairs*n_chunks;

    GGML_ASSERT(q->nb[0] == sizeof(float) && dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const ggml_to_float_t v_to_float = ggml_get_type_traits(v->type)->to_float;
    GGML_ASSERT((k->type == GGML_TYPE_F32 || ggml_get_type_traits(k->type)->to_float) && (v->type == GGML_TYPE_F32 || v_to_float));

    float * out  = (float *) dst->data;
    float * evid = out  + Dv*n_head*n_tokens*q->ne[3];
    float * kn   = evid + n_kv*work.n_pairs;

    const float s_scale = softcap > 0.0f ? scale/softcap : scale;

    const sfi_key_products products(k, D);

    float * kf     = work.thread(params->wdata, params->ith);
    float * vf     = kf + D;
    float * q_sc   = vf + Dv;          // [n_q][D]
    char  * q_conv = (char *) (q_sc + n_q*D);
    float * row_s  = (float *) (q_conv + work.q_conv_bytes); // [n_q]

    // a thread's items: a contiguous run, mostly chunks of one pair
    const int64_t item0 = n_items*params->ith/params->nth;
    const int64_t item1 = n_items*(params->ith + 1)/params->nth;

    int64_t q_pair = -1; // the pair whose query rows q_conv holds
    for (int64_t item = item0; item < item1; ++item) {
        const int64_t pair  = item / n_chunks;
        const int64_t chunk = item % n_chunks;
        const int64_t h     = pair % n_head_kv;
        const int64_t b     = pair / n_head_kv;
        const int64_t c0    = chunk*SFI_FAE_CHUNK;
        const int64_t c1    = std::min(n_kv, c0 + SFI_FAE_CHUNK);

        if (pair != q_pair) {
            // row j = g*n_tokens + t: query head h*n_gqa + g at token t
            for (int64_t j = 0; j < n_q; ++j) {
                const float * qj = (const float *) ((const char *) q->data + (j % n_tokens)*q->nb[1] +
                        (h*n_gqa + j/n_tokens)*q->nb[2] + b*q->nb[3]);
                for (int64_t d = 0; d < D; ++d) {
                    q_sc[j*D + d] = s_scale*qj[d];
                }
                products.set_row(q_conv, j, q_sc + j*D);
            }
            q_pair = pair;
        }

        float * w = work.weights(params->wdata, pair);
        sfi_cell_scores(products, k, mask, q_conv, n_q, n_tokens, softcap, h, b, c0, c1, w, norms ? kn : nullptr, kf, row_s);

        for (int64_t j = 0; j < n_q; ++j) {
            float * wj = w + j*n_kv;
            float max = -INFINITY;
            for (int64_t c = c0; c < c1; ++c) {
                max = std::max(max, wj[c]);
            }
            float * part = work.part(params->wdata, pair, chunk, j);
            part[0] = max;
            if (max == -INFINITY) { // every cell of the chunk excluded
                std::fill(wj + c0, wj + c1, 0.0f);
                part[1] = 0.0f;
            } else {
                part[1] = (float) ggml_vec_soft_max_f32((int) (c1 - c0), wj + c0, wj + c0, max);
            }
            std::fill(part + 2, part + 2 + Dv, 0.0f);
        }

        for (int64_t c = c0; c < c1; ++c) {
            const char * vr = (const char *) v->data + c*v->nb[1] + h*v->nb[2] + b*v->nb[3];
            const float * vr_f32 = (const float *) vr;
            if (v->type != GGML_TYPE_F32) {
                sfi_row_to_f32(v->type, vr, vf, Dv);
                vr_f32 = vf;
            }
            for (int64_t j = 0; j < n_q; ++j) {
                const float wc = w[j*n_kv + c];
                if (wc != 0.0f) {
                    ggml_vec_mad_f32((int) Dv, work.part(params->wdata, pair, chunk, j) + 2, vr_f32, wc);
                }
            }
        }
    }

    ggml_barrier(params->threadpool);

    // each row's softmax over the pair's cells: the max and sum of its chunks'
    std::vector<float> row_max(n_q), row_inv_sum(n_q);
    int64_t stats_pair = -1;
    for (int64_t item = item0; item < item1; ++item) {
        const int64_t pair  = item / n_chunks;
        const int64_t chunk = item % n_chunks;
        const int64_t c0    = chunk*SFI_FAE_CHUNK;
        const int64_t c1    = std::min(n_kv, c0 + SFI_FAE_CHUNK);

        if (pair != stats_pair) {
            for (int64_t j = 0; j < n_q; ++j) {
                float max = -INFINITY;
                for (int64_t i = 0; i < n_chunks; ++i) {
                    max = std::max(max, work.part(params->wdata, pair, i, j)[0]);
                }
                double sum = 0.0;
                for (int64_t i = 0; i < n_chunks && max != -INFINITY; ++i) {
                    const float * part = work.part(params->wdata, pair, i, j);
                    sum += part[0] == -INFINITY ? 0.0 : (double) part[1]*expf(part[0] - max);
                }
                row_max[j]     = max;
                row_inv_sum[j] = sum > 0.0 ? (float) (1.0/sum) : 0.0f;
            }
            stats_pair = pair;
        }

        // the evidence of the chunk's cells: sum over the rows of p^alpha, p = w*exp(chunk max - row max)/sum
        const float * w  = work.weights(params->wdata, pair);
        float       * ev = evid + pair*n_kv;
        std::fill(ev + c0, ev + c1, 0.0f);
        for (int64_t j = 0; j < n_q; ++j) {
            const float m = work.part(params->wdata, pair, chunk, j)[0];
            if (m == -INFINITY || row_inv_sum[j] == 0.0f) {
                continue;
            }
            const float   f  = expf(m - row_max[j])*row_inv_sum[j];
            const float * wj = w + j*n_kv;
            if (alpha == 0.5f) {
                const float sf = sqrtf(f);
                for (int64_t c = c0; c < c1; ++c) {
                    ev[c] += sqrtf(wj[c])*sf;
                }
            } else {
                for (int64_t c = c0; c < c1; ++c) {
                    const float p = wj[c]*f;
                    ev[c] += p > 0.0f ? powf(p, alpha) : 0.0f;
                }
            }
        }

        if (chunk != 0) {
            continue;
        }
        // [Dv, n_head, n_tokens, ns]; a row whose cells are all excluded gives zeros
        const int64_t h = pair % n_head_kv;
        const int64_t b = pair / n_head_kv;
        for (int64_t j = 0; j < n_q; ++j) {
            const int64_t head = h*n_gqa + j/n_tokens;
            const int64_t t    = j % n_tokens;
            float * o = out + ((b*n_tokens + t)*n_head + head)*Dv;
            std::fill(o, o + Dv, 0.0f);
            if (row_inv_sum[j] == 0.0f) {
                continue;
            }
            for (int64_t i = 0; i < n_chunks; ++i) {
                const float * part = work.part(params->wdata, pair, i, j);
                if (part[0] != -INFINITY) {
                    ggml_vec_mad_f32((int) Dv, o, part + 2, expf(part[0] - row_max[j])*row_inv_sum[j]);
                }
            }
        }
    }
}
