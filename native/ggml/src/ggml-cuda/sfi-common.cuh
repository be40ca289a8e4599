#pragma once

// What the SFI ops' kernels share (see ggml-sfi.h): the keys' and values' types and how a warp reads them, and the
// score loop of the warp kernels of ggml_sfi_evidence and ggml_sfi_flash_attn_evidence (a decode step's few query rows
// per KV head, keys read as flash attention reads them).

#include "common.cuh"

#include "ggml-sfi.h"

static constexpr int    SFI_CELLS_PER_BLOCK    = 256; // cells of a block of the score kernels
static constexpr int    SFI_WARP_BLOCK_THREADS = 128; // the warp kernels: 4 warps of 64 cells each
static constexpr int    SFI_EVIDENCE_THREADS   = 256; // sfi_evidence_sum
static constexpr size_t SFI_SCORES_MAX_BYTES   = 256u << 20; // the scores of a chunk of (head, batch) pairs

// a running softmax's (max m, sum s of exp(x - m)): x added (-INFINITY: nothing), and two such parts merged
static __device__ __forceinline__ void sfi_online_add(float & m, float & s, const float x) {
    if (x > m) {
        s = s*expf(m - x) + 1.0f;
        m = x;
    } else if (x != -INFINITY) {
        s += expf(x - m);
    }
}

static __device__ __forceinline__ void sfi_online_merge(float & m, float & s, const float m2, const float s2) {
    const float mx = fmaxf(m, m2);
    s = (m == -INFINITY ? 0.0f : s*expf(m - mx)) + (m2 == -INFINITY ? 0.0f : s2*expf(m2 - mx));
    m = mx;
}

template <typename T>
static __device__ __forceinline__ float sfi_to_float(T x);
template <> __device__ __forceinline__ float sfi_to_float<half>(half x)   { return __half2float(x); }
template <> __device__ __forceinline__ float sfi_to_float<float>(float x) { return x; }

// The keys (and values) the kernels read: F16, or the blocks of Q8_0 and Q4_0 (32 values and an F16 scale d each),
// dequantized as they are loaded, as ggml-cuda's flash attention reads them. With quantized keys the query rows are
// quantized to Q8_0 first (the keys' vec_dot type: the CPU's products and flash attention's take them so), and a
// score is the sum over the blocks of d_k*d_q*(the integer dot product of the block).
static constexpr __host__ __device__ bool sfi_quantized(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0;
}

static constexpr __host__ __device__ bool sfi_kv_type_supported(ggml_type t) {
    return t == GGML_TYPE_F16 || sfi_quantized(t);
}

// NB bytes (NB even) from a 2-byte aligned address (a block's values follow its 2-byte scale) into 32-bit words
template <int NB>
static __device__ __forceinline__ void sfi_load_b2(uint32_t (&x)[(NB + 3)/4], const char * p) {
    const uint16_t * p16 = (const uint16_t *) p;
#pragma unroll
    for (int i = 0; i < NB/2; ++i) {
        const uint32_t u = p16[i];
        x[i/2] = i % 2 == 0 ? u : x[i/2] | (u << 16);
    }
}

// byte e of x as a signed integer, as a float
static __device__ __forceinline__ float sfi_int8_at(const uint32_t * x, const int e) {
    return (float) (int8_t) (x[e/4] >> (8*(e % 4)));
}

// Q4_0's values (nibbles, low ones first in the block) at bytes x, shifted down by shift, as int8 (nibble - 8)
static __device__ __forceinline__ uint32_t sfi_q4_0_to_int8(const uint32_t x, const int shift) {
    return __vsub4((x >> shift) & 0x0F0F0F0Fu, 0x08080808u);
}

// a lane's E consecutive elements of a key or value row (the warp kernels: lane l has elements l*E .. l*E + E-1), as
// loaded: lane_offset(lane) is where the lane's elements (F16) or their block (quantized) start in a row, load()
// reads them, values() gives them as F32 (the integers of a quantized block, whose scale is d)
template <ggml_type T, int E>
struct sfi_lane_kv;

template <int E>
struct sfi_lane_kv<GGML_TYPE_F16, E> {
    half2 x[E/2];

    static __device__ __forceinline__ size_t lane_offset(const int lane) {
        return (size_t) lane*E*sizeof(half);
    }
    __device__ __forceinline__ void load(const char * p, const int) {
        if constexpr (E == 2) {
            *(uint32_t *) x = *(const uint32_t *) p;
        } else if constexpr (E == 4) {
            *(uint2 *) x = *(const uint2 *) p;
        } else {
            *(uint4 *) x = *(const uint4 *) p;
        }
    }
    __device__ __forceinline__ void values(float (&f)[E]) const {
#pragma unroll
        for (int e = 0; e < E/2; ++e) {
            const float2 v = __half22float2(x[e]);
            f[2*e]     = v.x;
            f[2*e + 1] = v.y;
        }
    }
};

template <int E>
struct sfi_lane_kv<GGML_TYPE_Q8_0, E> {
    uint32_t x[(E + 3)/4]; // int8 values
    float    d;

    static __device__ __forceinline__ size_t lane_offset(const int lane) {
        return (size_t) (lane*E/QK8_0)*sizeof(block_q8_0);
    }
    __device__ __forceinline__ void load(const char * p, const int lane) {
        d = __half2float(*(const half *) p);
        sfi_load_b2<E>(x, p + sizeof(half) + lane*E % QK8_0);
    }
    __device__ __forceinline__ void values(float (&f)[E]) const {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            f[e] = sfi_int8_at(x, e);
        }
    }
};

template <int E>
struct sfi_lane_kv<GGML_TYPE_Q4_0, E> {
    uint32_t x[(E + 3)/4]; // the nibbles made int8
    float    d;

    static __device__ __forceinline__ size_t lane_offset(const int lane) {
        return (size_t) (lane*E/QK4_0)*sizeof(block_q4_0);
    }
    // element i < 16 of a block is byte i's low nibble, element 16 + i its high one
    __device__ __forceinline__ void load(const char * p, const int lane) {
        const int i = lane*E % QK4_0;
        d = __half2float(*(const half *) p);
        sfi_load_b2<E>(x, p + sizeof(half) + i % (QK4_0/2));
#pragma unroll
        for (int w = 0; w < (E + 3)/4; ++w) {
            x[w] = sfi_q4_0_to_int8(x[w], i >= QK4_0/2 ? 4 : 0);
        }
    }
    __device__ __forceinline__ void values(float (&f)[E]) const {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            f[e] = sfi_int8_at(x, e);
        }
    }
};

// values x quantized to Q8_0 as the CPU quantizes the keys' vec_dot operand: over a block of 32 values (here n_lanes
// lanes of 32/n_lanes values each, consecutive lanes) d = amax/127 (kept as F16) and x = round(x*127/amax); returns d
template <int E>
static __device__ __forceinline__ float sfi_quantize_q8_0(float (&x)[E], const int n_lanes) {
    float amax = 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        amax = fmaxf(amax, fabsf(x[e]));
    }
    for (int o = 1; o < n_lanes; o <<= 1) {
        amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, o));
    }
    // correctly rounded divisions (not fast math's), as the CPU divides
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
#pragma unroll
    for (int e = 0; e < E; ++e) {
        x[e] = rintf(x[e]*id);
    }
    return __half2float(__float2half_rn(__fdiv_rn(amax, 127.0f)));
}

// a lane's E elements of a query row as the products with keys of type TK take them: rounded to F16 (as the
// attention's and cuBLAS's products of F16 keys round them), or quantized to Q8_0 (the integers in x; returns the
// block's scale). Every lane of the warp calls it (the quantization's max is over lanes).
template <ggml_type TK, int E>
static __device__ __forceinline__ float sfi_query_lane(float (&x)[E]) {
    if constexpr (sfi_quantized(TK)) {
        return sfi_quantize_q8_0<E>(x, QK8_0/E);
    } else {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            x[e] = __half2float(__float2half_rn(x[e]));
        }
        return 1.0f;
    }
}

// one step of a butterfly sum over the warp of 2*O values per lane: the lanes with bit O set keep the upper half of
// their values, the others the lower, each adding its partner's; after the steps O = 16 .. 1 lane l holds the sum of
// every lane's value l
template <int O>
static __device__ __forceinline__ void sfi_butterfly(float * v, const int lane) {
    const bool upper = lane & O;
#pragma unroll
    for (int i = 0; i < O; ++i) {
        const float send = upper ? v[i] : v[i + O];
        const float keep = upper ? v[i + O] : v[i];
        v[i] = keep + __shfl_xor_sync(0xffffffff, send, O);
    }
    if constexpr (O > 1) {
        sfi_butterfly<O/2>(v, lane);
    }
}

// The warp kernels' score loop. A warp reads whole key rows (each lane E = D/32 of a row's elements) of CPI = 32/NQ
// cells at a time, the NQ query rows in registers; the 32 partial dot products of each lane (cells x rows) are summed
// over the warp by a butterfly that leaves lane l with value l = cell*NQ + row (31 shuffles for 32 sums). With key
// norms, each key's sum of squares is summed the same way (log2(CPI) halvings and the rest plain).

// the lane's elements of each of the NQ query rows, at(j, i) element i of row j (rows past n_q: zeros), as the
// products with keys of type TK take them (sfi_query_lane); qd: each row's block scale (quantized keys)
template <ggml_type TK, int E, int NQ, typename F>
static __device__ __forceinline__ void sfi_warp_query_rows(float (&qr)[NQ][E], float (&qd)[NQ], const int n_q, const int lane,
        const F & at) {
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            qr[j][e] = j < n_q ? at(j, lane*E + e) : 0.0f;
        }
        qd[j] = sfi_query_lane<TK, E>(qr[j]);
    }
}

// the lane's elements of each of the CPI rows c0 .. c0+CPI-1 at base + c*nb1 (base: the lane's offset in a row
// added; past n_kv, the last row again): all the loads first
template <ggml_type T, int E, int CPI>
static __device__ __forceinline__ void sfi_warp_load_rows(sfi_lane_kv<T, E> (&rows)[CPI], const char * base, const int c0, const int n_kv,
        const size_t nb1, const int lane) {
#pragma unroll
    for (int i = 0; i < CPI; ++i) {
        const int c = min(c0 + i, n_kv - 1);
        rows[i].load(base + (size_t) c*nb1, lane);
    }
}

// the products of NQ query rows (qd: their blocks' scales, for quantized keys) with CPI keys, a lane's E elements of
// each: the 32 partial sums (cell*NQ + row) summed over the warp, lane l then holding value l; and each key's partial
// sum of squares of the lane's elements in sq
template <ggml_type TK, int E, int NQ, int CPI>
static __device__ __forceinline__ void sfi_warp_scores(const float (&qr)[NQ][E], const float (&qd)[NQ], const sfi_lane_kv<TK, E> (&kc)[CPI],
        float (&v)[WARP_SIZE], float (&sq)[CPI], const int lane) {
#pragma unroll
    for (int i = 0; i < CPI; ++i) {
        float kf[E];
        kc[i].values(kf);
        sq[i] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            sq[i] += kf[e]*kf[e];
        }
        if constexpr (sfi_quantized(TK)) {
            sq[i] *= kc[i].d*kc[i].d;
        }
#pragma unroll
        for (int j = 0; j < NQ; ++j) {
            float acc = 0.0f;
#pragma unroll
            for (int e = 0; e < E; ++e) {
                acc += qr[j][e]*kf[e];
            }
            if constexpr (sfi_quantized(TK)) {
                acc *= kc[i].d*qd[j];
            }
            v[i*NQ + j] = acc;
        }
    }

    sfi_butterfly<WARP_SIZE/2>(v, lane);
}

// the norms of keys c0 .. c0+CPI-1 of (head h, batch b) from the lanes' partial sums of squares (sfi_warp_scores):
// lane l sums cell l % CPI's (log2(CPI) halvings, then plain xors), lanes 0 .. CPI-1 write them
template <int CPI>
static __device__ __forceinline__ void sfi_warp_key_norms(float (&sq)[CPI], const int lane, float * kn, const int b, const int h,
        const int c0, const int n_kv, const int n_head_kv) {
    sfi_butterfly<CPI/2>(sq, lane);
#pragma unroll
    for (int o = CPI; o < WARP_SIZE; o <<= 1) {
        sq[0] += __shfl_xor_sync(0xffffffff, sq[0], o);
    }
    if (lane < CPI && c0 + lane < n_kv) {
        kn[((size_t) b*n_kv + c0 + lane)*n_head_kv + h] = sqrtf(sq[0]);
    }
}

// one step of the loop over the keys kc of cells c0 .. c0+CPI-1 (sfi_warp_load_rows) of KV head h and batch b: the
// scores of the query rows, and with kn each key's norm at kn[(b*n_kv + c)*n_head_kv + h]; lane l's score, that of
// cell c0 + l/NQ and row l % NQ, capped (softcap > 0: softcap*tanh), masked (the mask of type TM at
// m_base + c*nbm0 + (row % n_mask_rows)*nbm1), written to s_out[row*n_kv + c] and returned; -INFINITY past n_kv or n_q
template <typename TM, ggml_type TK, int E, int NQ, int CPI>
static __device__ __forceinline__ float sfi_warp_cell_scores(const float (&qr)[NQ][E], const float (&qd)[NQ],
        const sfi_lane_kv<TK, E> (&kc)[CPI], const int c0, const int n_kv, const int n_q, const float softcap,
        const char * m_base, const size_t nbm0, const size_t nbm1, const int n_mask_rows,
        float * s_out, float * kn, const int b, const int h, const int n_head_kv, const int lane) {
    float v[WARP_SIZE];
    float sq[CPI];
    sfi_warp_scores<TK, E, NQ, CPI>(qr, qd, kc, v, sq, lane);

    if (kn) {
        sfi_warp_key_norms<CPI>(sq, lane, kn, b, h, c0, n_kv, n_head_kv);
    }

    const int row = lane % NQ;
    const int c   = c0 + lane / NQ;
    float s = -INFINITY;
    if (c < n_kv && row < n_q) {
        s = softcap > 0.0f ? softcap*tanhf(v[0]) : v[0];
        s += sfi_to_float(*(const TM *) (m_base + c*nbm0 + (row % n_mask_rows)*nbm1));
        s_out[(size_t) row*n_kv + c] = s;
    }
    return s;
}
