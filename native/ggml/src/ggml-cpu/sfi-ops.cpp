// CPU forward of the SFI ops (see ggml-sfi.h)

#include "sfi-ops.h"

#include "ggml-sfi.h"
#include "../ggml-sfi-sample.h"

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

// the cells [c0, c0 + n_c) of stream b of t (K or V [D, n_kv, n_head_kv, ns]) as F32, [head][cell][D]:
// each cell's heads in turn, as a cache's row holds them
static void sfi_block_to_f32(const ggml_tensor * t, int64_t c0, int64_t n_c, int64_t b, float * y) {
    const int64_t D = t->ne[0];
    for (int64_t i = 0; i < n_c; ++i) {
        for (int64_t h = 0; h < t->ne[2]; ++h) {
            sfi_row_to_f32(t->type, (const char *) t->data + (c0 + i)*t->nb[1] + h*t->nb[2] + b*t->nb[3],
                    y + (h*n_c + i)*D, D);
        }
    }
}

// head h's rows of the cells [c0, c0 + n_c) of stream b of t as F32: t's own rows where F32, else those
// sfi_block_to_f32 wrote to `converted`; *stride: the floats from one row to the next
static const float * sfi_block_rows(const ggml_tensor * t, int64_t c0, int64_t n_c, int64_t h, int64_t b,
        const float * converted, int64_t * stride) {
    if (t->type == GGML_TYPE_F32) {
        *stride = t->nb[1]/sizeof(float);
        return (const float *) ((const char *) t->data + c0*t->nb[1] + h*t->nb[2] + b*t->nb[3]);
    }
    *stride = t->ne[0];
    return converted + h*n_c*t->ne[0];
}

#if defined(GGML_SIMD) && (defined(__AVX__) || defined(__ARM_NEON)) && !defined(__ARM_FEATURE_SVE)
#define SFI_ROWS_SIMD

// the sum of a vector's lanes
static inline float sfi_vec_hsum(GGML_F32_VEC v) {
#if defined(__AVX512F__)
    // the masked forms, every lane set: the unmasked ones start from an undefined register, which GCC 12 warns about
    v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, 0xffff, v, v, 0x4e)); // 256-bit halves
    v = _mm512_add_ps(v, _mm512_mask_shuffle_f32x4(v, 0xffff, v, v, 0xb1)); // 128-bit lanes
    v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, 0xffff, v, 0x4e));       // pairs
    v = _mm512_add_ps(v, _mm512_mask_permute_ps(v, 0xffff, v, 0xb1));       // neighbours
    return _mm512_cvtss_f32(v);
#elif defined(__AVX__)
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
#elif defined(__aarch64__)
    return vaddvq_f32(v);
#else
    float lanes[GGML_F32_EPR];
    GGML_F32_VEC_STORE(lanes, v);
    float sum = 0.0f;
    for (int e = 0; e < GGML_F32_EPR; ++e) {
        sum += lanes[e];
    }
    return sum;
#endif
}

// keys per block of the score kernel: as many as the vector registers hold accumulators for (4 rows each)
#if defined(__AVX512F__)
static constexpr int SFI_SCORE_KEYS = 4;
#else
static constexpr int SFI_SCORE_KEYS = 2;
#endif

// s[r*s_stride + i] = x_i.q_r for NK keys x_i (x_stride floats apart) and R query rows q_r of q (n floats each, one
// after the other): each key and row read once, NK*R independent sums. NORM: norms[i*norm_stride] = |x_i| too
template <int NK, int R, bool NORM>
static void sfi_scores_block_simd(int64_t n, const float * x, int64_t x_stride, const float * q, float * s,
        int64_t s_stride, float * norms, int64_t norm_stride) {
    const int64_t n_simd = n - n % GGML_F32_EPR;
    GGML_F32_VEC acc[NK][R];
    GGML_F32_VEC acc_n[NK];
    for (int i = 0; i < NK; ++i) {
        acc_n[i] = GGML_F32_VEC_ZERO;
        for (int r = 0; r < R; ++r) {
            acc[i][r] = GGML_F32_VEC_ZERO;
        }
    }
    for (int64_t d = 0; d < n_simd; d += GGML_F32_EPR) {
        GGML_F32_VEC xv[NK];
        for (int i = 0; i < NK; ++i) {
            xv[i] = GGML_F32_VEC_LOAD(x + i*x_stride + d);
            if (NORM) {
                acc_n[i] = GGML_F32_VEC_FMA(acc_n[i], xv[i], xv[i]);
            }
        }
        for (int r = 0; r < R; ++r) {
            const GGML_F32_VEC qv = GGML_F32_VEC_LOAD(q + r*n + d);
            for (int i = 0; i < NK; ++i) {
                acc[i][r] = GGML_F32_VEC_FMA(acc[i][r], xv[i], qv);
            }
        }
    }
    for (int i = 0; i < NK; ++i) {
        const float * xi = x + i*x_stride;
        for (int r = 0; r < R; ++r) {
            float sum = sfi_vec_hsum(acc[i][r]);
            for (int64_t d = n_simd; d < n; ++d) {
                sum += xi[d]*q[r*n + d];
            }
            s[r*s_stride + i] = sum;
        }
        if (NORM) {
            float sum = sfi_vec_hsum(acc_n[i]);
            for (int64_t d = n_simd; d < n; ++d) {
                sum += xi[d]*xi[d];
            }
            norms[i*norm_stride] = sqrtf(sum);
        }
    }
}

// sfi_scores_block_simd for NK keys and every row, four at a time, the norms (where asked) with the first rows
template <int NK>
static void sfi_scores_keys_simd(int64_t n, const float * x, int64_t x_stride, const float * q, int64_t n_q, float * s,
        int64_t s_stride, float * norms, int64_t norm_stride) {
    int64_t j = 0;
    for (; j + 4 <= n_q; j += 4) {
        if (j == 0 && norms) {
            sfi_scores_block_simd<NK, 4, true>(n, x, x_stride, q, s, s_stride, norms, norm_stride);
        } else {
            sfi_scores_block_simd<NK, 4, false>(n, x, x_stride, q + j*n, s + j*s_stride, s_stride, nullptr, 0);
        }
    }
    for (; j < n_q; ++j) {
        if (j == 0 && norms) {
            sfi_scores_block_simd<NK, 1, true>(n, x, x_stride, q, s, s_stride, norms, norm_stride);
        } else {
            sfi_scores_block_simd<NK, 1, false>(n, x, x_stride, q + j*n, s + j*s_stride, s_stride, nullptr, 0);
        }
    }
}

// out[r*out_stride + d] += sum over the n_c cells c of w[r*w_stride + c]*v[c*v_stride + d], d < n, for R rows: each
// output block stays in registers over the cells
template <int R>
static void sfi_mad_rows_simd(int64_t n, int64_t n_c, const float * w, int64_t w_stride, const float * v,
        int64_t v_stride, float * out, int64_t out_stride) {
    constexpr int64_t B = 2*GGML_F32_EPR;
    const int64_t n_simd = n - n % B;
    for (int64_t d = 0; d < n_simd; d += B) {
        GGML_F32_VEC acc[R][2];
        for (int r = 0; r < R; ++r) {
            acc[r][0] = GGML_F32_VEC_ZERO;
            acc[r][1] = GGML_F32_VEC_ZERO;
        }
        for (int64_t c = 0; c < n_c; ++c) {
            bool weighted = false; // a cell no row weighs is skipped, as flash attention skips masked cells
            for (int r = 0; r < R; ++r) {
                weighted = weighted || w[r*w_stride + c] != 0.0f;
            }
            if (!weighted) {
                continue;
            }
            const float * vc = v + c*v_stride + d;
            const GGML_F32_VEC v0 = GGML_F32_VEC_LOAD(vc);
            const GGML_F32_VEC v1 = GGML_F32_VEC_LOAD(vc + GGML_F32_EPR);
            for (int r = 0; r < R; ++r) {
                const GGML_F32_VEC wr = GGML_F32_VEC_SET1(w[r*w_stride + c]);
                acc[r][0] = GGML_F32_VEC_FMA(acc[r][0], v0, wr);
                acc[r][1] = GGML_F32_VEC_FMA(acc[r][1], v1, wr);
            }
        }
        for (int r = 0; r < R; ++r) {
            float * o = out + r*out_stride + d;
            GGML_F32_VEC_STORE(o, GGML_F32_VEC_ADD(GGML_F32_VEC_LOAD(o), acc[r][0]));
            GGML_F32_VEC_STORE(o + GGML_F32_EPR, GGML_F32_VEC_ADD(GGML_F32_VEC_LOAD(o + GGML_F32_EPR), acc[r][1]));
        }
    }
    for (int r = 0; r < R; ++r) {
        for (int64_t d = n_simd; d < n; ++d) {
            float sum = 0.0f;
            for (int64_t c = 0; c < n_c; ++c) {
                if (w[r*w_stride + c] != 0.0f) {
                    sum += w[r*w_stride + c]*v[c*v_stride + d];
                }
            }
            out[r*out_stride + d] += sum;
        }
    }
}

#endif

// ev[c] += sqrt(w[c])*f for n cells
static void sfi_vec_sqrt_mad(int64_t n, float * ev, const float * w, float f) {
    int64_t c = 0;
#if defined(__AVX512F__)
    const __m512 fv = _mm512_set1_ps(f);
    for (; c + 16 <= n; c += 16) { // (the masked sqrt: see sfi_vec_hsum)
        const __m512 wv = _mm512_loadu_ps(w + c);
        _mm512_storeu_ps(ev + c, _mm512_fmadd_ps(_mm512_mask_sqrt_ps(wv, 0xffff, wv), fv, _mm512_loadu_ps(ev + c)));
    }
#elif defined(__AVX__)
    const __m256 fv = _mm256_set1_ps(f);
    for (; c + 8 <= n; c += 8) {
        _mm256_storeu_ps(ev + c, _mm256_add_ps(_mm256_mul_ps(_mm256_sqrt_ps(_mm256_loadu_ps(w + c)), fv), _mm256_loadu_ps(ev + c)));
    }
#elif defined(__aarch64__)
    const float32x4_t fv = vdupq_n_f32(f);
    for (; c + 4 <= n; c += 4) {
        vst1q_f32(ev + c, vfmaq_f32(vld1q_f32(ev + c), vsqrtq_f32(vld1q_f32(w + c)), fv));
    }
#endif
    for (; c < n; ++c) {
        ev[c] += sqrtf(w[c])*f;
    }
}

// s[j*s_stride + c] = k_c.q_j for n_c keys k_c (k_stride floats apart) and the n_q rows q_j of q (n floats each, one
// after the other); norms: where not null, norms[c*norm_stride] = |k_c|
static void sfi_scores_f32(int64_t n, int64_t n_c, const float * k, int64_t k_stride, const float * q, int64_t n_q,
        float * s, int64_t s_stride, float * norms, int64_t norm_stride) {
    int64_t c = 0;
#ifdef SFI_ROWS_SIMD
    for (; c + SFI_SCORE_KEYS <= n_c; c += SFI_SCORE_KEYS) {
        sfi_scores_keys_simd<SFI_SCORE_KEYS>(n, k + c*k_stride, k_stride, q, n_q, s + c, s_stride,
                norms ? norms + c*norm_stride : nullptr, norm_stride);
    }
    for (; c < n_c; ++c) {
        sfi_scores_keys_simd<1>(n, k + c*k_stride, k_stride, q, n_q, s + c, s_stride,
                norms ? norms + c*norm_stride : nullptr, norm_stride);
    }
#endif
    for (; c < n_c; ++c) {
        const float * kc = k + c*k_stride;
        for (int64_t j = 0; j < n_q; ++j) {
            ggml_vec_dot_f32((int) n, s + j*s_stride + c, 0, kc, 0, q + j*n, 0, 1);
        }
        if (norms) {
            ggml_vec_norm_f32((int) n, norms + c*norm_stride, kc);
        }
    }
}

// out[j*out_stride + d] += sum over the n_c cells c of w[j*w_stride + c]*v[c*v_stride + d], d < n, for the n_q rows j
static void sfi_mad_rows_f32(int64_t n, int64_t n_c, const float * w, int64_t w_stride, const float * v,
        int64_t v_stride, int64_t n_q, float * out, int64_t out_stride) {
    int64_t j = 0;
#ifdef SFI_ROWS_SIMD
    for (; j + 4 <= n_q; j += 4) {
        sfi_mad_rows_simd<4>(n, n_c, w + j*w_stride, w_stride, v, v_stride, out + j*out_stride, out_stride);
    }
    for (; j < n_q; ++j) {
        sfi_mad_rows_simd<1>(n, n_c, w + j*w_stride, w_stride, v, v_stride, out + j*out_stride, out_stride);
    }
#endif
    for (; j < n_q; ++j) {
        for (int64_t c = 0; c < n_c; ++c) {
            if (w[j*w_stride + c] != 0.0f) {
                ggml_vec_mad_f32((int) n, out + j*out_stride, v + c*v_stride, w[j*w_stride + c]);
            }
        }
    }
}

// the products of a KV head's query rows with its keys as the evidence op takes them (and mul_mat and flash attention):
// the rows, F32, rounded to the keys' vec_dot type. Keys of a float type, or of a type whose products with Q8_0 rows
// are those of the dequantized values (a block's F16 scale times small integers: exact in F32, so the F32 products
// differ from ggml's integer ones by rounding alone): the rows kept as F32 (rounded), a block's keys converted to F32
// once and multiplied with every row (sfi_scores_f32); other keys: the rows in the vec_dot type, one vec_dot per key
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

    static bool f32_keys(ggml_type t) {
        return float_keys(t) || (ggml_get_type_traits_cpu(t)->vec_dot_type == GGML_TYPE_Q8_0 &&
                ggml_get_type_traits(t)->to_float && ggml_get_type_traits(GGML_TYPE_Q8_0)->to_float);
    }

    // bytes of a query row as set_row writes it
    static size_t row_bytes(ggml_type k_type, int64_t n_embd) {
        return f32_keys(k_type) ? sizeof(float)*n_embd : ggml_row_size(ggml_get_type_traits_cpu(k_type)->vec_dot_type, n_embd);
    }

    sfi_key_products(const ggml_tensor * k, int64_t n_embd) : k_type(k->type), n_embd(n_embd) {
        k_traits     = ggml_get_type_traits_cpu(k->type);
        vec_dot_type = k_traits->vec_dot_type;
        q_traits     = ggml_get_type_traits_cpu(vec_dot_type);
        f32_rows     = f32_keys(k->type);
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
        if (!float_keys(k_type)) {
            // through the vec_dot type's blocks, as mul_mat quantizes the rows it multiplies with such keys
            std::vector<char> blocks(ggml_row_size(vec_dot_type, n_embd));
            q_traits->from_float(qj, blocks.data(), n_embd);
            ggml_get_type_traits(vec_dot_type)->to_float(blocks.data(), r, n_embd);
            return;
        }
        for (int64_t d = 0; d < n_embd; ++d) {
            switch (vec_dot_type) {
                case GGML_TYPE_F16:  r[d] = GGML_CPU_FP16_TO_FP32(GGML_CPU_FP32_TO_FP16(qj[d])); break;
                case GGML_TYPE_BF16: r[d] = GGML_BF16_TO_FP32(GGML_FP32_TO_BF16(qj[d]));         break;
                default:             r[d] = qj[d];                                               break;
            }
        }
    }

    // s[j] = the products of a key row of a quantized type with the n_q rows of q_conv (float keys: sfi_scores_f32)
    void dots(const char * k_row, const char * q_conv, int64_t n_q, float * s) const {
        for (int64_t j = 0; j < n_q; ++j) {
            k_traits->vec_dot(n_embd, s + j, 0, k_row, 0, q_conv + j*q_row_size, 0, 1);
        }
    }
};


// the norm of a key row of a quantized type (buf: n_embd floats)
static float sfi_key_norm(const ggml_tensor * k, const char * k_row, float * buf) {
    sfi_row_to_f32(k->type, k_row, buf, k->ne[0]);
    float norm = 0.0f;
    ggml_vec_norm_f32((int) k->ne[0], &norm, buf);
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
    int64_t n_block;     // cells converted to F32 together (every head): ~256 KiB

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
        n_block     = std::clamp<int64_t>(64*1024/(n_head_kv*std::max(D, Dv)), 1, SFI_CHUNK);
    }

    int64_t n_pairs() const { return n_streams*n_head_kv; }
    int64_t n_items() const { return n_streams*n_chunks; }
    int64_t part_floats() const { return 2 + Dv; }

    // the work buffer, shared: the weights [pair][row][n_kv], the chunks' partial results [pair][chunk][row] (max, sum,
    // output), each row's max and 1/sum [pair][row]; then per thread a key as F32, a block's keys or values as F32,
    // a key's products, the chunk's mask rows, a scaled query row and the rows of every head in the keys'
    // vec_dot type
    size_t shared_bytes() const {
        return GGML_PAD(sizeof(float)*(n_pairs()*n_q*(n_kv + n_chunks*part_floats() + 2)), CACHE_LINE_SIZE);
    }
    size_t thread_bytes() const {
        return GGML_PAD(sizeof(float)*(D + n_block*n_head_kv*std::max(D, Dv) + n_q + SFI_CHUNK*n_q + D) +
                q_row_bytes*n_head_kv*n_q, CACHE_LINE_SIZE);
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

    float * kf      = a.thread(wdata, params->ith);
    float * chunk_f = kf + a.D;                                // a block's keys or values, [head][cell][D or Dv]
    float * row_s   = chunk_f + a.n_block*n_head_kv*std::max(a.D, Dv);
    float * mask_ch = row_s + n_q;                             // [mask row][cell], the same for every head
    float * q_sc    = mask_ch + SFI_CHUNK*n_q;
    char  * q_conv  = (char *) (q_sc + a.D);                   // [head][row]

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

        const int64_t n_c = c1 - c0;
        for (int64_t r = 0; r < std::min(a.n_mask_rows, n_q); ++r) {
            for (int64_t i = 0; i < n_c; ++i) {
                mask_ch[r*SFI_CHUNK + i] = sfi_mask_value(a.mask, c0 + i, r, b);
            }
        }
        // the scores of each head's rows: q.k, in the weights; keys taken as F32 a block of cells at a time, converted
        // in the order of the cache's rows
        for (int64_t s0 = c0; s0 < c1; s0 += a.n_block) {
            const int64_t n_s = std::min(c1, s0 + a.n_block) - s0;
            if (products.f32_rows && a.k->type != GGML_TYPE_F32) {
                sfi_block_to_f32(a.k, s0, n_s, b, chunk_f);
            }
            for (int64_t h = 0; h < n_head_kv; ++h) {
                float * w = a.weights(wdata, b*n_head_kv + h) + s0; // row j's at w + j*n_kv
                const char * k0  = (const char *) a.k->data + s0*a.k->nb[1] + h*a.k->nb[2] + b*a.k->nb[3];
                const char * q_h = q_conv + h*n_q*a.q_row_bytes;
                float * norms = kn ? kn + (b*n_kv + s0)*n_head_kv + h : nullptr; // cell i's at norms[i*n_head_kv]
                if (products.f32_rows) {
                    int64_t k_stride;
                    const float * kc = sfi_block_rows(a.k, s0, n_s, h, b, chunk_f, &k_stride);
                    sfi_scores_f32(a.D, n_s, kc, k_stride, (const float *) q_h, n_q, w, n_kv, norms, n_head_kv);
                    continue;
                }
                for (int64_t i = 0; i < n_s; ++i) {
                    const char * k_row = k0 + i*a.k->nb[1];
                    products.dots(k_row, q_h, n_q, row_s);
                    for (int64_t j = 0; j < n_q; ++j) {
                        w[j*n_kv + i] = row_s[j];
                    }
                    if (norms) {
                        norms[i*n_head_kv] = sfi_key_norm(a.k, k_row, kf);
                    }
                }
            }
        }
        // + softcap and mask
        for (int64_t h = 0; h < n_head_kv; ++h) {
            float * w = a.weights(wdata, b*n_head_kv + h) + c0;
            for (int64_t j = 0; j < n_q; ++j) {
                float * wj = w + j*n_kv;
                const float * mj = mask_ch + (j % a.n_mask_rows)*SFI_CHUNK;
                if (a.softcap > 0.0f) {
                    for (int64_t i = 0; i < n_c; ++i) {
                        wj[i] = a.softcap*tanhf(wj[i]) + mj[i];
                    }
                } else {
                    for (int64_t i = 0; i < n_c; ++i) {
                        wj[i] += mj[i];
                    }
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
            // per block of cells and head, the values (as F32) weighted into each row's partial output
            for (int64_t s0 = c0; s0 < c1; s0 += a.n_block) {
                const int64_t n_s = std::min(c1, s0 + a.n_block) - s0;
                if (a.v->type != GGML_TYPE_F32) {
                    sfi_block_to_f32(a.v, s0, n_s, b, chunk_f);
                }
                for (int64_t h = 0; h < n_head_kv; ++h) {
                    const int64_t pair = b*n_head_kv + h;
                    int64_t v_stride;
                    const float * vc = sfi_block_rows(a.v, s0, n_s, h, b, chunk_f, &v_stride);
                    sfi_mad_rows_f32(Dv, n_s, a.weights(wdata, pair) + s0, n_kv, vc, v_stride, n_q,
                            a.part(wdata, pair, ch, 0) + 2, a.part_floats());
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
                    sfi_vec_sqrt_mad(c1 - c0, ev + c0, wj + c0, sqrtf(f));
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

// rows split over the threads; per row the k best indices by a partial selection (a heap for few of many), then put in
// increasing order
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

        // the larger value first, the lower index among equal ones (-0 == +0)
        auto better = [x](int32_t i, int32_t j) { return x[i] > x[j] || (x[i] == x[j] && i < j); };
        if (16*k <= n) {
            // few of many (a sampler's candidates): a heap of the k best so far, the worst on top, which most
            // values fail to beat at one comparison
            for (int64_t i = 0; i < k; ++i) {
                idx[i] = (int32_t) i;
            }
            std::make_heap(idx, idx + k, better);
            for (int64_t i = k; i < n; ++i) {
                if (better((int32_t) i, idx[0])) {
                    std::pop_heap(idx, idx + k, better);
                    idx[k - 1] = (int32_t) i;
                    std::push_heap(idx, idx + k, better);
                }
            }
        } else {
            for (int64_t i = 0; i < n; ++i) {
                idx[i] = (int32_t) i;
            }
            std::nth_element(idx, idx + k - 1, idx + n, better);
        }
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

// rows split over the threads; per row the softmax's sum, then the candidates sorted and the pick (without
// candidates: the first of the largest logits)
void ggml_compute_forward_sfi_sample(const ggml_compute_params * params, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * cand   = dst->src[1];
    const ggml_tensor * u      = dst->src[2];

    const float top_p = ggml_get_op_params_f32(dst, 0);
    const float min_p = ggml_get_op_params_f32(dst, 1);
    const float temp  = ggml_get_op_params_f32(dst, 2);

    const int64_t n_vocab = logits->ne[0];
    const int     k       = cand ? (int) cand->ne[0] : 0;

    std::vector<int32_t> ids(k);
    std::vector<float>   c(k);

    for (int64_t r = params->ith; r < logits->ne[1]; r += params->nth) {
        const float * x = (const float *) ((const char *) logits->data + r*logits->nb[1]);

        float max = -INFINITY;
        ggml_vec_max_f32((int) n_vocab, &max, x);
        ggml_float sum = 0.0;
        float e[1024]; // (the exponentials, unused: the vectorised softmax writes them)
        for (int64_t i = 0; i < n_vocab; i += 1024) {
            sum += ggml_vec_soft_max_f32((int) std::min<int64_t>(1024, n_vocab - i), e, x + i, max);
        }

        float * out = (float *) ((char *) dst->data + r*dst->nb[1]);
        out[1] = (float) (1.0/sum);

        if (!cand) {
            out[0] = (float) (std::find(x, x + n_vocab, max) - x);
            continue;
        }

        memcpy(ids.data(), (const char *) cand->data + r*cand->nb[1], k*sizeof(int32_t));
        for (int j = 0; j < k; ++j) {
            GGML_ASSERT(ids[j] >= 0 && ids[j] < n_vocab);
        }
        std::sort(ids.begin(), ids.end(), [x](int32_t i, int32_t j) { return x[i] > x[j] || (x[i] == x[j] && i < j); });
        for (int j = 0; j < k; ++j) {
            c[j] = x[ids[j]];
        }
        const float ur = *(const float *) ((const char *) u->data + r*u->nb[1]);

        out[0] = (float) ids[ggml_sfi_sample_pick(c.data(), k, top_p, min_p, temp, ur)];
    }
}
