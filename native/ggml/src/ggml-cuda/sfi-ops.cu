// SFI ops (see ggml-sfi.h) on CUDA
//
// ggml_sfi_top_k: a radix select, one block per row (below).
// ggml_sfi_evidence in three kernels per chunk of (head, batch) pairs:
//   scores:    one thread per cell reads its key once (16-byte loads, a row of the query group at a time from shared
//              memory, where every thread reads the same address), writes the scores, and the block's max and sum of
//              exp(s - max) per query row
//   row stats: per query row its max and sum^-alpha, merged from the blocks'
//   evidence:  per cell the sum over the rows of exp(alpha*(s - max))*sum^-alpha = p^alpha
// The scores of a chunk live in a pool buffer of at most SFI_SCORES_MAX_BYTES. The slow step reads the whole K cache
// here, so the scores kernel is made to keep enough loads in flight to run at the memory's speed.
// Keys (and the fused attention's values) are F16, Q8_0 or Q4_0 (sfi_lane_kv, sfi_load_block: quantized blocks are
// dequantized as they are read; the query rows are then quantized to Q8_0 as the CPU's and flash attention's are).

#include "sfi-ops.cuh"

#include "ggml-sfi.h"

#include <cfloat>
#include <climits>

static constexpr int    SFI_CELLS_PER_BLOCK   = 256; // threads of a scores block, one cell each
static constexpr int    SFI_ROWS_PER_PASS     = 8;   // query rows a thread accumulates at a time
static constexpr int    SFI_WARP_BLOCK_THREADS = 128; // sfi_evidence_scores_warp: 4 warps of 64 cells each
static constexpr int    SFI_ROW_THREADS       = 256;
static constexpr int    SFI_EVIDENCE_THREADS  = 256;
static constexpr size_t SFI_Q_SHARED_MAX      = 46*1024; // of the 48 KB a block may take, with the reduction's
static constexpr size_t SFI_SCORES_MAX_BYTES  = 256u << 20;

template <typename T>
static __device__ __forceinline__ float sfi_to_float(T x);
template <> __device__ __forceinline__ float sfi_to_float<half>(half x)   { return __half2float(x); }
template <> __device__ __forceinline__ float sfi_to_float<float>(float x) { return x; }

// The keys (and values) the kernels read: F16, or the blocks of Q8_0 and Q4_0 (32 values and an F16 scale d each),
// dequantized as they are loaded, as ggml-cuda's flash attention reads them. With quantized keys the query rows are
// quantized to Q8_0 first (the keys' vec_dot type: the CPU's products and flash attention's take them so), and a
// score is the sum over the blocks of d_k*d_q*(the integer dot product of the block).
static constexpr bool sfi_quantized(ggml_type t) {
    return t == GGML_TYPE_Q8_0 || t == GGML_TYPE_Q4_0;
}

static bool sfi_kv_type_supported(ggml_type t) {
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

// a row's 32 values of one quantized block at p, the integers (F32) in f; returns the block's scale
template <ggml_type T>
static __device__ __forceinline__ float sfi_load_block(const char * p, float (&f)[32]) {
    static_assert(sfi_quantized(T), "a quantized type");
    uint32_t x[8];
    if constexpr (T == GGML_TYPE_Q8_0) {
        sfi_load_b2<QK8_0>(x, p + sizeof(half));
    } else {
        uint32_t raw[4];
        sfi_load_b2<QK4_0/2>(raw, p + sizeof(half));
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            x[w]     = sfi_q4_0_to_int8(raw[w], 0);
            x[w + 4] = sfi_q4_0_to_int8(raw[w], 4);
        }
    }
#pragma unroll
    for (int e = 0; e < 32; ++e) {
        f[e] = sfi_int8_at(x, e);
    }
    return __half2float(*(const half *) p);
}

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

// the scores of the rows j0 .. j0 + n_qc - 1 of n_q (as many as shared memory holds) for the block's cells, and per
// row the block's (max, sum of exp(s - max)) in parts[(pair*n_blocks + block)*n_q + j]; with kn (and j0 == 0) the
// norm of each key in kn[(b*n_kv + c)*n_head_kv + h]. Quantized keys: each thread reads its key block by block, and
// shared memory holds the rows quantized (their integers, then each block's scale)
template <int D, typename TM, ggml_type TK>
static __global__ void __launch_bounds__(SFI_CELLS_PER_BLOCK) sfi_evidence_scores(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ mask,
        float * __restrict__ scores, float2 * __restrict__ parts, float * __restrict__ kn,
        const int n_q, const int j0, const int n_qc, const int n_rows, const int n_kv, const int n_head_kv, const int b0, const int nm,
        const float softcap,
        const size_t nbq1, const size_t nbq2, const size_t nbq3,
        const size_t nbk1, const size_t nbk2, const size_t nbk3,
        const size_t nbm0, const size_t nbm1, const size_t nbm3) {
    constexpr int CHUNKS = D/8; // 16-byte loads of a key

    extern __shared__ float q_s[]; // [n_qc][D], then for quantized keys the scales [n_qc][D/QK8_0]
    __shared__ float buf_max[WARP_SIZE];
    __shared__ float buf_sum[WARP_SIZE];

    // the heads vary fastest over the grid: the blocks that run together read whole cache rows (every head of a
    // cell lies in one row), not one head's slice of many rows
    const int h    = blockIdx.x;
    const int tile = blockIdx.y;
    const int bl   = blockIdx.z;
    const int b    = b0 + bl;

    constexpr int NBLK = D/QK8_0;
    float * qd_s = q_s + n_qc*D;
    if constexpr (sfi_quantized(TK)) {
        for (int i = threadIdx.x; i < n_qc*NBLK; i += blockDim.x) {
            const int jl  = i / NBLK;
            const int blk = i % NBLK;
            const float * x = (const float *) (q + (j0 + jl)*nbq1 + h*nbq2 + b*nbq3) + blk*QK8_0;
            float xb[QK8_0];
#pragma unroll
            for (int e = 0; e < QK8_0; ++e) {
                xb[e] = x[e];
            }
            qd_s[i] = sfi_quantize_q8_0<QK8_0>(xb, 1);
#pragma unroll
            for (int e = 0; e < QK8_0; ++e) {
                q_s[jl*D + blk*QK8_0 + e] = xb[e];
            }
        }
    } else {
        for (int i = threadIdx.x; i < n_qc*D; i += blockDim.x) {
            const int j = j0 + i / D;
            const int d = i % D;
            // rounded to F16, as the attention's and cuBLAS's products of F16 keys round them
            q_s[i] = __half2float(__float2half_rn(*(const float *) (q + j*nbq1 + h*nbq2 + b*nbq3 + d*sizeof(float))));
        }
    }
    __syncthreads();

    const int  c     = tile*SFI_CELLS_PER_BLOCK + threadIdx.x;
    const bool valid = c < n_kv;

    const char  * k_row = k + (size_t) (valid ? c : 0)*nbk1 + h*nbk2 + b*nbk3;
    const uint4 * kc    = (const uint4 *) k_row;

    const size_t pair = (size_t) bl*n_head_kv + h;

    float * s_out = scores + pair*n_q*n_kv;
    const char * m_base = mask + (b % nm)*nbm3;

    const bool norms = kn && j0 == 0;

    for (int r0 = 0; r0 < n_qc; r0 += SFI_ROWS_PER_PASS) {
        const int nr = min(SFI_ROWS_PER_PASS, n_qc - r0);

        float acc[SFI_ROWS_PER_PASS] = { 0.0f };
        float sq = 0.0f;

        if constexpr (sfi_quantized(TK)) {
            using block_t = std::conditional_t<TK == GGML_TYPE_Q8_0, block_q8_0, block_q4_0>;
#pragma unroll 1
            for (int blk = 0; blk < NBLK; ++blk) {
                float kf[32];
                float dk = 0.0f;
                if (valid) {
                    dk = sfi_load_block<TK>(k_row + blk*sizeof(block_t), kf);
                } else {
#pragma unroll
                    for (int e = 0; e < 32; ++e) {
                        kf[e] = 0.0f;
                    }
                }
                if (norms && r0 == 0) {
                    float sb = 0.0f;
#pragma unroll
                    for (int e = 0; e < 32; ++e) {
                        sb += kf[e]*kf[e];
                    }
                    sq += dk*dk*sb;
                }
#pragma unroll
                for (int r = 0; r < SFI_ROWS_PER_PASS; ++r) {
                    if (r < nr) {
                        const float4 * qr = (const float4 *) (q_s + (r0 + r)*D + blk*QK8_0);
                        float p = 0.0f;
#pragma unroll
                        for (int e = 0; e < 8; ++e) {
                            const float4 qa = qr[e];
                            p += qa.x*kf[4*e] + qa.y*kf[4*e + 1] + qa.z*kf[4*e + 2] + qa.w*kf[4*e + 3];
                        }
                        acc[r] += p*dk*qd_s[(r0 + r)*NBLK + blk];
                    }
                }
            }
        } else {
#pragma unroll
            for (int ch0 = 0; ch0 < CHUNKS; ch0 += 8) {
                // eight 16-byte loads in flight per thread
                uint4 kv[8];
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    kv[e] = valid ? kc[ch0 + e] : make_uint4(0, 0, 0, 0);
                }
#pragma unroll
                for (int e = 0; e < 8; ++e) {
                    const half2 * k2 = (const half2 *) &kv[e];
                    const float2 k01 = __half22float2(k2[0]);
                    const float2 k23 = __half22float2(k2[1]);
                    const float2 k45 = __half22float2(k2[2]);
                    const float2 k67 = __half22float2(k2[3]);
                    if (norms && r0 == 0) {
                        sq += k01.x*k01.x + k01.y*k01.y + k23.x*k23.x + k23.y*k23.y
                            + k45.x*k45.x + k45.y*k45.y + k67.x*k67.x + k67.y*k67.y;
                    }
#pragma unroll
                    for (int r = 0; r < SFI_ROWS_PER_PASS; ++r) {
                        if (r < nr) {
                            const float4 * qr = (const float4 *) (q_s + (r0 + r)*D + (ch0 + e)*8);
                            const float4 qa = qr[0];
                            const float4 qb = qr[1];
                            acc[r] += qa.x*k01.x + qa.y*k01.y + qa.z*k23.x + qa.w*k23.y
                                    + qb.x*k45.x + qb.y*k45.y + qb.z*k67.x + qb.w*k67.y;
                        }
                    }
                }
            }
        }

        if (norms && r0 == 0 && valid) {
            kn[((size_t) b*n_kv + c)*n_head_kv + h] = sqrtf(sq);
        }

#pragma unroll
        for (int r = 0; r < SFI_ROWS_PER_PASS; ++r) {
            if (r >= nr) {
                break;
            }
            const int j = j0 + r0 + r;
            float s = -INFINITY;
            if (valid) {
                s = softcap > 0.0f ? softcap*tanhf(acc[r]) : acc[r];
                s += sfi_to_float(*(const TM *) (m_base + c*nbm0 + (j % n_rows)*nbm1));
                s_out[(size_t) j*n_kv + c] = s;
            }
            // one buffer per reduction: every thread has read buf_max before any passes the sum's barrier
            const float m = block_reduce<block_reduce_method::MAX, SFI_CELLS_PER_BLOCK>(s, buf_max);
            const float e = block_reduce<block_reduce_method::SUM, SFI_CELLS_PER_BLOCK>(m == -INFINITY ? 0.0f : expf(s - m), buf_sum);
            if (threadIdx.x == 0) {
                parts[(pair*gridDim.y + tile)*n_q + j] = make_float2(m, e);
            }
        }
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

// the same for a decode step's few query rows (n_q <= NQ <= 8), as flash attention reads keys: a warp reads whole key
// rows (each lane D/32 of a row's elements), the query rows in registers, 32/NQ cells at a time; the 32 partial
// dot products of each lane (cells x rows) are summed over the warp by a butterfly that leaves lane l with value l
// (31 shuffles for 32 sums). Each lane keeps the running max and sum of exp of its row for the block's part. With kn,
// each key's sum of squares is summed the same way (the 32/NQ cells' sums: log2(32/NQ) halvings and the rest plain).
template <int D, int NQ, typename TM, ggml_type TK>
static __global__ void __launch_bounds__(SFI_WARP_BLOCK_THREADS) sfi_evidence_scores_warp(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ mask,
        float * __restrict__ scores, float2 * __restrict__ parts, float * __restrict__ kn,
        const int n_q, const int n_rows, const int n_kv, const int n_head_kv, const int b0, const int nm,
        const float softcap,
        const size_t nbq1, const size_t nbq2, const size_t nbq3,
        const size_t nbk1, const size_t nbk2, const size_t nbk3,
        const size_t nbm0, const size_t nbm1, const size_t nbm3) {
    constexpr int E   = D/WARP_SIZE;       // elements of a key row per lane
    constexpr int CPI = WARP_SIZE/NQ;      // cells per iteration: CPI*NQ = 32 sums
    constexpr int N_WARPS = SFI_WARP_BLOCK_THREADS/WARP_SIZE;
    constexpr int CELLS_PER_WARP = SFI_CELLS_PER_BLOCK/N_WARPS;
    static_assert(CELLS_PER_WARP % CPI == 0, "a warp's cells come in whole iterations");

    const int h    = blockIdx.x;
    const int tile = blockIdx.y;
    const int bl   = blockIdx.z;
    const int b    = b0 + bl;

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    // the lane's elements of each query row, as the attention's products take them (rows past n_q: zeros)
    float qr[NQ][E];
    float qd[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
#pragma unroll
        for (int e = 0; e < E; ++e) {
            qr[j][e] = j < n_q ? *(const float *) (q + j*nbq1 + h*nbq2 + b*nbq3 + (lane*E + e)*sizeof(float)) : 0.0f;
        }
        qd[j] = sfi_query_lane<TK, E>(qr[j]);
    }

    const size_t pair = (size_t) bl*n_head_kv + h;

    float * s_out = scores + pair*n_q*n_kv;
    const char * k_base = k + h*nbk2 + b*nbk3 + sfi_lane_kv<TK, E>::lane_offset(lane);
    const char * m_base = mask + (b % nm)*nbm3;

    // after the butterfly, lane l holds the sum of value l = cell*NQ + row
    const int my_row  = lane % NQ;
    const int my_cell = lane / NQ;

    float run_max = -INFINITY;
    float run_sum = 0.0f;

    const int c_warp = tile*SFI_CELLS_PER_BLOCK + warp*CELLS_PER_WARP;

    for (int it = 0; it < CELLS_PER_WARP; it += CPI) {
        const int c0 = c_warp + it;

        sfi_lane_kv<TK, E> kh[CPI];
        sfi_warp_load_rows<TK, E, CPI>(kh, k_base, c0, n_kv, nbk1, lane);

        float v[WARP_SIZE];
        float sq[CPI];
        sfi_warp_scores<TK, E, NQ, CPI>(qr, qd, kh, v, sq, lane);

        if (kn) {
            sfi_warp_key_norms<CPI>(sq, lane, kn, b, h, c0, n_kv, n_head_kv);
        }

        const int c = c0 + my_cell;
        if (c < n_kv && my_row < n_q) {
            float s = softcap > 0.0f ? softcap*tanhf(v[0]) : v[0];
            s += sfi_to_float(*(const TM *) (m_base + c*nbm0 + (my_row % n_rows)*nbm1));
            s_out[(size_t) my_row*n_kv + c] = s;
            if (s > run_max) {
                run_sum = run_sum*expf(run_max - s) + 1.0f;
                run_max = s;
            } else if (s != -INFINITY) {
                run_sum += expf(s - run_max);
            }
        }
    }

    // the block's (max, sum) per row: first over the lanes of a row (lanes l = row mod NQ), then over the warps
#pragma unroll
    for (int o = NQ; o < WARP_SIZE; o <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, run_max, o);
        const float s2 = __shfl_xor_sync(0xffffffff, run_sum, o);
        const float m  = fmaxf(run_max, m2);
        run_sum = (run_max == -INFINITY ? 0.0f : run_sum*expf(run_max - m)) + (m2 == -INFINITY ? 0.0f : s2*expf(m2 - m));
        run_max = m;
    }

    __shared__ float2 part_s[N_WARPS][NQ];
    if (lane < NQ) {
        part_s[warp][lane] = make_float2(run_max, run_sum);
    }
    __syncthreads();
    if (threadIdx.x < NQ && threadIdx.x < n_q) {
        float m = -INFINITY;
        for (int w = 0; w < N_WARPS; ++w) {
            m = fmaxf(m, part_s[w][threadIdx.x].x);
        }
        float sum = 0.0f;
        if (m != -INFINITY) {
            for (int w = 0; w < N_WARPS; ++w) {
                const float2 pw = part_s[w][threadIdx.x];
                sum += pw.x == -INFINITY ? 0.0f : pw.y*expf(pw.x - m);
            }
        }
        parts[(pair*gridDim.y + tile)*n_q + threadIdx.x] = make_float2(m, sum);
    }
}

// per row (j, h, bl): its max and sum^-alpha of exp(s - max), merged from the n_parts blocks' (max, sum); max
// -INFINITY for a row whose cells are all excluded
static __global__ void sfi_evidence_row_stats(const float2 * __restrict__ parts, float2 * __restrict__ stats,
        const int n_q, const int n_parts, const float alpha) {
    const int    j    = blockIdx.x;
    const size_t pair = blockIdx.y + (size_t) gridDim.y*blockIdx.z;

    const float2 * p = parts + pair*n_parts*n_q + j;

    __shared__ float buf_max[WARP_SIZE];
    __shared__ float buf_sum[WARP_SIZE];

    float max = -INFINITY;
    for (int i = threadIdx.x; i < n_parts; i += blockDim.x) {
        max = fmaxf(max, p[(size_t) i*n_q].x);
    }
    max = block_reduce<block_reduce_method::MAX, SFI_ROW_THREADS>(max, buf_max);

    float sum = 0.0f;
    if (max != -INFINITY) {
        for (int i = threadIdx.x; i < n_parts; i += blockDim.x) {
            const float2 part = p[(size_t) i*n_q];
            if (part.x != -INFINITY) {
                sum += part.y*expf(part.x - max);
            }
        }
    }
    sum = block_reduce<block_reduce_method::SUM, SFI_ROW_THREADS>(sum, buf_sum);

    if (threadIdx.x == 0) {
        stats[pair*n_q + j] = make_float2(max, max == -INFINITY ? 0.0f : powf(sum, -alpha));
    }
}

static __global__ void sfi_evidence_sum(const float * __restrict__ scores, const float2 * __restrict__ stats, float * __restrict__ dst,
        const int n_q, const int n_kv, const int n_head_kv, const int b0, const float alpha) {
    const int h  = blockIdx.y;
    const int bl = blockIdx.z;
    const int c  = blockIdx.x*blockDim.x + threadIdx.x;

    const size_t pair = (size_t) bl*n_head_kv + h;

    extern __shared__ float2 st[]; // [n_q]
    for (int j = threadIdx.x; j < n_q; j += blockDim.x) {
        st[j] = stats[pair*n_q + j];
    }
    __syncthreads();

    if (c >= n_kv) {
        return;
    }

    const float * s = scores + pair*n_q*n_kv + c;

    float acc = 0.0f;
    for (int j = 0; j < n_q; ++j) {
        if (st[j].x != -INFINITY) {
            acc += expf(alpha*(s[(size_t) j*n_kv] - st[j].x))*st[j].y;
        }
    }
    dst[((size_t) (b0 + bl)*n_head_kv + h)*n_kv + c] = acc;
}

bool ggml_cuda_sfi_evidence_supported(const ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * mask = op->src[2];

    const int64_t D = q->ne[0];
    if (!sfi_kv_type_supported(k->type) || (D != 64 && D != 128 && D != 256) || q->nb[0] != sizeof(float)) {
        return false;
    }
    if (mask->type != GGML_TYPE_F16 && mask->type != GGML_TYPE_F32) {
        return false;
    }
    // F16 keys are read 16 bytes at a time, the blocks of quantized ones 2 bytes at a time
    const size_t align = k->type == GGML_TYPE_F16 ? 16 : 2;
    if (k->nb[1] % align || k->nb[2] % align || k->nb[3] % align || k->view_offs % align ||
            q->nb[1] % 4 || q->nb[2] % 4 || q->nb[3] % 4) {
        return false;
    }
    return (k->ne[1] + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK <= 65535; // tiles of cells are the grid's y
}

template <int D, ggml_type TK>
static void sfi_evidence_scores_launch(const ggml_tensor * dst, float * scores, float2 * parts, float * kn, int b0, int nbl, cudaStream_t stream) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * mask = dst->src[2];

    const int   n_rows  = ggml_get_op_params_i32(dst, 0);
    const float softcap = ggml_get_op_params_f32(dst, 2);

    const int n_q       = q->ne[1];
    const int n_kv      = k->ne[1];
    const int n_head_kv = k->ne[2];

    const dim3 grid(n_head_kv, (n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK, nbl);

    // a decode step's few rows: the warp kernel (keys read as flash attention reads them)
    if (n_q <= 8) {
        const dim3 grid_w(n_head_kv, (n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK, nbl);
        auto launch = [&](auto nq) {
            constexpr int NQ = decltype(nq)::value;
            if (mask->type == GGML_TYPE_F16) {
                sfi_evidence_scores_warp<D, NQ, half, TK><<<grid_w, SFI_WARP_BLOCK_THREADS, 0, stream>>>(
                    (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores, parts, kn,
                    n_q, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                    q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
            } else {
                sfi_evidence_scores_warp<D, NQ, float, TK><<<grid_w, SFI_WARP_BLOCK_THREADS, 0, stream>>>(
                    (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores, parts, kn,
                    n_q, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                    q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
            }
        };
        if (n_q <= 1) {
            launch(std::integral_constant<int, 1>());
        } else if (n_q <= 2) {
            launch(std::integral_constant<int, 2>());
        } else if (n_q <= 4) {
            launch(std::integral_constant<int, 4>());
        } else {
            launch(std::integral_constant<int, 8>());
        }
        return;
    }

    // the query rows that fit in shared memory at a time (every row of a decode step; the keys are read again per
    // chunk only for the many rows of a prompt's bootstrap)
    // (a row of quantized values carries its blocks' scales)
    const size_t row_bytes = (D + (sfi_quantized(TK) ? D/QK8_0 : 0))*sizeof(float);
    const int    n_q_chunk = (int) (SFI_Q_SHARED_MAX/row_bytes);

    for (int j0 = 0; j0 < n_q; j0 += n_q_chunk) {
        const int    n_qc = std::min(n_q_chunk, n_q - j0);
        const size_t smem = (size_t) n_qc*row_bytes;
        if (mask->type == GGML_TYPE_F16) {
            sfi_evidence_scores<D, half, TK><<<grid, SFI_CELLS_PER_BLOCK, smem, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores, parts, kn,
                n_q, j0, n_qc, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
        } else {
            sfi_evidence_scores<D, float, TK><<<grid, SFI_CELLS_PER_BLOCK, smem, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores, parts, kn,
                n_q, j0, n_qc, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
        }
    }
}

template <ggml_type TK>
static void sfi_evidence_scores_dispatch(const ggml_tensor * dst, int64_t D, float * scores, float2 * parts, float * kn, int b0, int nbl,
        cudaStream_t stream) {
    switch (D) {
        case  64: sfi_evidence_scores_launch< 64, TK>(dst, scores, parts, kn, b0, nbl, stream); break;
        case 128: sfi_evidence_scores_launch<128, TK>(dst, scores, parts, kn, b0, nbl, stream); break;
        case 256: sfi_evidence_scores_launch<256, TK>(dst, scores, parts, kn, b0, nbl, stream); break;
        default: GGML_ABORT("unsupported head size");
    }
}

static void sfi_evidence_scores_dispatch(const ggml_tensor * dst, int64_t D, ggml_type type_k, float * scores, float2 * parts, float * kn,
        int b0, int nbl, cudaStream_t stream) {
    switch (type_k) {
        case GGML_TYPE_F16:  sfi_evidence_scores_dispatch<GGML_TYPE_F16 >(dst, D, scores, parts, kn, b0, nbl, stream); break;
        case GGML_TYPE_Q8_0: sfi_evidence_scores_dispatch<GGML_TYPE_Q8_0>(dst, D, scores, parts, kn, b0, nbl, stream); break;
        case GGML_TYPE_Q4_0: sfi_evidence_scores_dispatch<GGML_TYPE_Q4_0>(dst, D, scores, parts, kn, b0, nbl, stream); break;
        default: GGML_ABORT("unsupported key type");
    }
}

void ggml_cuda_op_sfi_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_sfi_evidence_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const ggml_tensor * q = dst->src[0];
    const ggml_tensor * k = dst->src[1];

    const float alpha = ggml_get_op_params_f32(dst, 1);

    const int64_t D         = q->ne[0];
    const int64_t n_q       = q->ne[1];
    const int64_t n_kv      = k->ne[1];
    const int64_t n_head_kv = k->ne[2];
    const int64_t nb        = k->ne[3];

    const int64_t n_parts = (n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK; // scores blocks per pair

    cudaStream_t stream = ctx.stream();

    // (head, batch) pairs a chunk holds the scores of
    const size_t  pair_bytes = (size_t) n_q*n_kv*sizeof(float);
    const int64_t nbl_max    = std::max<int64_t>(1, std::min<int64_t>(nb, SFI_SCORES_MAX_BYTES/(pair_bytes*n_head_kv)));

    ggml_cuda_pool_alloc<float>  scores(ctx.pool(), (size_t) nbl_max*n_head_kv*n_q*n_kv);
    ggml_cuda_pool_alloc<float2> parts (ctx.pool(), (size_t) nbl_max*n_head_kv*n_parts*n_q);
    ggml_cuda_pool_alloc<float2> stats (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q);

    float * kn = ggml_get_op_params_i32(dst, 3) ? (float *) ((char *) dst->data + dst->nb[3]) : nullptr;

    for (int64_t b0 = 0; b0 < nb; b0 += nbl_max) {
        const int nbl = (int) std::min<int64_t>(nbl_max, nb - b0);

        sfi_evidence_scores_dispatch(dst, D, k->type, scores.get(), parts.get(), kn, (int) b0, nbl, stream);
        CUDA_CHECK(cudaGetLastError());

        sfi_evidence_row_stats<<<dim3(n_q, n_head_kv, nbl), SFI_ROW_THREADS, 0, stream>>>(
            parts.get(), stats.get(), n_q, n_parts, alpha);

        const dim3 grid((n_kv + SFI_EVIDENCE_THREADS - 1)/SFI_EVIDENCE_THREADS, n_head_kv, nbl);
        sfi_evidence_sum<<<grid, SFI_EVIDENCE_THREADS, n_q*sizeof(float2), stream>>>(
            scores.get(), stats.get(), (float *) dst->data, n_q, n_kv, n_head_kv, b0, alpha);
        CUDA_CHECK(cudaGetLastError());
    }
}

// ggml_sfi_top_k: one block per row, a radix select over the values as ordered 32-bit keys, 8 bits at a time from
// the top (four histogram passes find the k-th largest key exactly), then one pass in index order that writes the
// keys above it and the first of those equal to it. Each thread takes SFI_TOP_K_PER_THREAD consecutive values of a
// chunk, so that a block keeps enough loads in flight on a row of 128K cells.
static constexpr int SFI_TOP_K_THREADS    = 1024;
static constexpr int SFI_TOP_K_PER_THREAD = 8;

// larger floats to larger keys; -0 to the key of +0
static __device__ __forceinline__ uint32_t sfi_ordered_key(float v) {
    uint32_t b = __float_as_uint(v);
    b = b == 0x80000000u ? 0u : b;
    return b & 0x80000000u ? ~b : b | 0x80000000u;
}

// exclusive scan over the block of one value per thread (buf: a value per warp); *total gets the sum
static __device__ __forceinline__ int sfi_block_exclusive_scan(int v, int * buf, int * total) {
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    const int incl = warp_prefix_inclusive_sum<int>(v);
    __syncthreads();
    if (lane == WARP_SIZE - 1) {
        buf[warp] = incl;
    }
    __syncthreads();
    if (warp == 0) {
        const int n_warps = blockDim.x/WARP_SIZE;
        const int w = warp_prefix_inclusive_sum<int>(lane < n_warps ? buf[lane] : 0);
        if (lane < n_warps) {
            buf[lane] = w; // inclusive over the warps
        }
    }
    __syncthreads();
    *total = buf[blockDim.x/WARP_SIZE - 1];
    return (warp > 0 ? buf[warp - 1] : 0) + incl - v;
}

static __global__ void __launch_bounds__(SFI_TOP_K_THREADS) sfi_top_k_kernel(
        const float * __restrict__ x, const int32_t * __restrict__ ids, int32_t * __restrict__ dst, const int n, const int k,
        const int ne1) {
    const float   * xr    = x   + (size_t) blockIdx.x*n;
    int32_t       * out   = dst + (size_t) blockIdx.x*k;
    const int32_t * ids_r = ids ? ids + (size_t) (blockIdx.x/ne1)*n : nullptr; // the row's ids: those of its (i2, i3)

    __shared__ int hist[256];
    __shared__ int buf[WARP_SIZE];
    __shared__ int s_bin, s_above;

    constexpr int CHUNK = SFI_TOP_K_THREADS*SFI_TOP_K_PER_THREAD;

    const int lane = threadIdx.x % WARP_SIZE;

    uint32_t prefix = 0;
    uint32_t mask   = 0;
    int      rem    = k; // how many of the keys under the prefix are still to take

    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int i = threadIdx.x; i < 256; i += blockDim.x) {
            hist[i] = 0;
        }
        __syncthreads();

        for (int c0 = 0; c0 < n; c0 += CHUNK) {
            const int i0 = c0 + threadIdx.x*SFI_TOP_K_PER_THREAD;
            float v[SFI_TOP_K_PER_THREAD];
#pragma unroll
            for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
                v[e] = i0 + e < n ? xr[i0 + e] : 0.0f;
            }
#pragma unroll
            for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
                const uint32_t key = sfi_ordered_key(v[e]);
                const int bin = i0 + e < n && (key & mask) == prefix ? (int) ((key >> shift) & 255) : -1;
                // one atomic per distinct bin of the warp (many equal values, e.g. excluded cells, share a bin)
                const unsigned peers = __match_any_sync(0xffffffff, bin);
                if (bin >= 0 && lane == __ffs(peers) - 1) {
                    atomicAdd(&hist[bin], __popc(peers));
                }
            }
        }
        __syncthreads();

        // the bin of the rem-th largest key under the prefix: warp 0, 8 bins per lane from the top
        if (threadIdx.x < WARP_SIZE) {
            int cnt[8];
            int sum = 0;
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                cnt[j] = hist[255 - (lane*8 + j)];
                sum += cnt[j];
            }
            const int incl = warp_prefix_inclusive_sum<int>(sum);
            const int excl = incl - sum;
            if (excl < rem && rem <= incl) {
                int acc = excl;
                for (int j = 0; j < 8; ++j) {
                    if (acc + cnt[j] >= rem) {
                        s_bin   = 255 - (lane*8 + j);
                        s_above = acc;
                        break;
                    }
                    acc += cnt[j];
                }
            }
        }
        __syncthreads();

        prefix |= (uint32_t) s_bin << shift;
        mask   |= 255u << shift;
        rem    -= s_above;
        __syncthreads();
    }

    // prefix is the k-th largest key: every key above it, and the first rem keys equal to it, in index order
    int written  = 0;
    int eq_taken = 0;
    for (int c0 = 0; c0 < n; c0 += CHUNK) {
        const int i0 = c0 + threadIdx.x*SFI_TOP_K_PER_THREAD;

        uint32_t key[SFI_TOP_K_PER_THREAD];
        int n_gt = 0;
        int n_eq = 0;
#pragma unroll
        for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
            key[e] = i0 + e < n ? sfi_ordered_key(xr[i0 + e]) : 0u;
            n_gt += i0 + e < n && key[e] >  prefix;
            n_eq += i0 + e < n && key[e] == prefix;
        }

        int total_gt, total_eq;
        int gt_before = sfi_block_exclusive_scan(n_gt, buf, &total_gt);
        int eq_before = sfi_block_exclusive_scan(n_eq, buf, &total_eq);

        const int eq_left = rem - eq_taken; // equal keys still to take, in index order
        int pos = written + gt_before + min(eq_before, max(eq_left, 0));
        int eq  = eq_before;
#pragma unroll
        for (int e = 0; e < SFI_TOP_K_PER_THREAD; ++e) {
            if (i0 + e >= n) {
                break;
            }
            if (key[e] > prefix) {
                out[pos++] = ids_r ? ids_r[i0 + e] : i0 + e;
            } else if (key[e] == prefix) {
                if (eq < eq_left) {
                    out[pos++] = ids_r ? ids_r[i0 + e] : i0 + e;
                }
                eq++;
            }
        }

        written  += total_gt + min(total_eq, max(eq_left, 0));
        eq_taken += total_eq;
    }
}

bool ggml_cuda_sfi_top_k_supported(const ggml_tensor * op) {
    const ggml_tensor * a = op->src[0];
    return a->type == GGML_TYPE_F32 && ggml_is_contiguous(a) && a->ne[0] <= INT32_MAX/2 && ggml_nrows(a) <= INT32_MAX;
}

void ggml_cuda_op_sfi_top_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * a = dst->src[0];

    GGML_ASSERT(ggml_cuda_sfi_top_k_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_I32 && ggml_is_contiguous(dst));

    const int n      = (int) a->ne[0];
    const int k      = (int) dst->ne[0];
    const int n_rows = (int) ggml_nrows(a);

    const ggml_tensor * ids = dst->src[1];

    sfi_top_k_kernel<<<n_rows, SFI_TOP_K_THREADS, 0, ctx.stream()>>>((const float *) a->data,
        ids ? (const int32_t *) ids->data : nullptr, (int32_t *) dst->data, n, k, (int) a->ne[1]);
    CUDA_CHECK(cudaGetLastError());
}

// ggml_sfi_candidate_scores over chunks of SFI_CAND_CHUNK cells of each (head, batch) row, so that a long row spreads
// over the GPU: per chunk the largest kept evidence (its log is the row's largest log-evidence), then per chunk, in
// tiles of SFI_CAND_TILE cells (the pool's halo in shared memory), the pooled weights of the kept cells, written to the
// head's plane, and their sum; a last kernel scales each head's plane by 1/(the row's sum) and adds the heads up per cell
static constexpr int SFI_CAND_THREADS  = 1024;
static constexpr int SFI_CAND_TILE     = 1024;
static constexpr int SFI_CAND_CHUNK    = 4*SFI_CAND_TILE;
static constexpr int SFI_CAND_HALF_MAX = 64; // pool windows up to 129 cells
static constexpr int SFI_CAND_SUM_THREADS = 256;

static __device__ __forceinline__ float sfi_cand_weight(const float e, const float m, const float lmax, const float inv_alpha) {
    return m != -INFINITY && e > 0.0f ? expf((logf(e) - lmax)*inv_alpha) : 0.0f;
}

static __global__ void __launch_bounds__(SFI_CAND_THREADS) sfi_candidate_max(
        const float * __restrict__ evid, const float * __restrict__ mask, float * __restrict__ part_max,
        const int n_kv, const int n_head, const int ns) {
    const int chunk = blockIdx.x;
    const int h     = blockIdx.y;
    const int b     = blockIdx.z;

    const float * e = evid + ((size_t) b*n_head + h)*n_kv;
    const float * m = mask + (size_t) (b % ns)*n_kv;

    __shared__ float buf[WARP_SIZE];

    float emax = 0.0f;
    const int c1 = min(n_kv, (chunk + 1)*SFI_CAND_CHUNK);
    for (int c = chunk*SFI_CAND_CHUNK + threadIdx.x; c < c1; c += blockDim.x) {
        if (m[c] != -INFINITY) {
            emax = fmaxf(emax, e[c]);
        }
    }
    emax = block_reduce<block_reduce_method::MAX, SFI_CAND_THREADS>(emax, buf);
    if (threadIdx.x == 0) {
        part_max[((size_t) b*n_head + h)*gridDim.x + chunk] = emax;
    }
}

static __global__ void __launch_bounds__(SFI_CAND_THREADS) sfi_candidate_pool(
        const float * __restrict__ evid, const float * __restrict__ mask, float * __restrict__ out,
        const float * __restrict__ part_max, float * __restrict__ part_sum,
        const int n_kv, const int n_head, const int nb, const int ns, const float inv_alpha, const int half) {
    const int chunk    = blockIdx.x;
    const int n_chunks = gridDim.x;
    const int h        = blockIdx.y;
    const int b        = blockIdx.z;

    const size_t row = (size_t) b*n_head + h;

    const float * e = evid + row*n_kv;
    const float * m = mask + (size_t) (b % ns)*n_kv;
    float       * f = out  + ((size_t) (1 + h)*nb + b)*n_kv;

    __shared__ float buf[WARP_SIZE];
    __shared__ float w_s[SFI_CAND_TILE + 2*SFI_CAND_HALF_MAX];

    float emax = 0.0f;
    for (int i = threadIdx.x; i < n_chunks; i += blockDim.x) {
        emax = fmaxf(emax, part_max[row*n_chunks + i]);
    }
    emax = block_reduce<block_reduce_method::MAX, SFI_CAND_THREADS>(emax, buf);
    const float lmax = emax > 0.0f ? logf(emax) : -INFINITY;

    float sum = 0.0f;
    const int c_end = min(n_kv, (chunk + 1)*SFI_CAND_CHUNK);
    for (int c0 = chunk*SFI_CAND_CHUNK; c0 < c_end; c0 += SFI_CAND_TILE) {
        __syncthreads(); // the previous tile's reads (and the reduction's) are done
        for (int i = threadIdx.x; i < SFI_CAND_TILE + 2*half; i += blockDim.x) {
            const int c = c0 - half + i;
            w_s[i] = c >= 0 && c < n_kv ? sfi_cand_weight(e[c], m[c], lmax, inv_alpha) : 0.0f;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < SFI_CAND_TILE && c0 + i < c_end; i += blockDim.x) {
            float v = w_s[i + half];
            if (half > 0) {
                v = 0.0f;
                if (m[c0 + i] != -INFINITY) {
                    for (int d = 0; d <= 2*half; ++d) {
                        v = fmaxf(v, w_s[i + d]);
                    }
                }
            }
            f[c0 + i] = v;
            sum += v;
        }
    }
    __syncthreads(); // buf is reused
    sum = block_reduce<block_reduce_method::SUM, SFI_CAND_THREADS>(sum, buf);
    if (threadIdx.x == 0) {
        part_sum[row*n_chunks + chunk] = sum;
    }
}

static __global__ void __launch_bounds__(SFI_CAND_SUM_THREADS) sfi_candidate_sum(
        const float * __restrict__ mask, const float * __restrict__ part_sum, float * __restrict__ out,
        const int n_kv, const int n_head, const int nb, const int ns, const int n_chunks) {
    const int b = blockIdx.y;

    // 1/sum of each head's row, a warp per head
    extern __shared__ float inv_s[]; // [n_head]
    const int lane = threadIdx.x % WARP_SIZE;
    for (int h = threadIdx.x / WARP_SIZE; h < n_head; h += SFI_CAND_SUM_THREADS/WARP_SIZE) {
        float sum = 0.0f;
        for (int i = lane; i < n_chunks; i += WARP_SIZE) {
            sum += part_sum[((size_t) b*n_head + h)*n_chunks + i];
        }
        sum = warp_reduce_sum(sum);
        if (lane == 0) {
            inv_s[h] = sum > 0.0f ? 1.0f/sum : 0.0f;
        }
    }
    __syncthreads();

    const int c = blockIdx.x*blockDim.x + threadIdx.x;
    if (c >= n_kv) {
        return;
    }
    float score = 0.0f;
    for (int h = 0; h < n_head; ++h) {
        float * f = out + ((size_t) (1 + h)*nb + b)*n_kv + c;
        const float v = *f*inv_s[h];
        *f = v;
        score += v;
    }
    out[(size_t) b*n_kv + c] = score + mask[(size_t) (b % ns)*n_kv + c];
}

// ggml_sfi_candidate_values: a thread per (candidate, batch)
static __global__ void sfi_candidate_gather(const float * __restrict__ cs, const float * __restrict__ u, const float * __restrict__ mask,
        const int32_t * __restrict__ cells, float * __restrict__ out, const int n_kv, const int nb, const int n_head, const int ns,
        const int n_cand) {
    const int i = blockIdx.x*blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (i >= n_cand) {
        return;
    }
    const int c = cells[(size_t) b*n_cand + i];
    float * o = out + (size_t) b*(n_head + 2)*n_cand + i;
    for (int h = 0; h < n_head; ++h) {
        o[(size_t) h*n_cand] = cs[((size_t) (1 + h)*nb + b)*n_kv + c];
    }
    o[(size_t) n_head*n_cand]       = u   [(size_t) (b % ns)*n_kv + c];
    o[(size_t) (n_head + 1)*n_cand] = mask[(size_t) (b % ns)*n_kv + c];
}

bool ggml_cuda_sfi_candidate_supported(const ggml_tensor * op) {
    if (op->op == GGML_OP_SFI_CANDIDATE_SCORES) {
        const int pool = ggml_get_op_params_i32(op, 1);
        return (pool > 1 ? pool/2 : 0) <= SFI_CAND_HALF_MAX && op->ne[1] <= 65535;
    }
    return op->src[0]->ne[1] <= 65535;
}

void ggml_cuda_op_sfi_candidate_scores(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * evid = dst->src[0];
    const ggml_tensor * mask = dst->src[1];

    GGML_ASSERT(ggml_cuda_sfi_candidate_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const float alpha = ggml_get_op_params_f32(dst, 0);
    const int   pool  = ggml_get_op_params_i32(dst, 1);

    const int n_kv   = (int) evid->ne[0];
    const int n_head = (int) evid->ne[2];
    const int nb     = (int) evid->ne[3];
    const int ns     = (int) mask->ne[3];

    cudaStream_t stream = ctx.stream();

    const int n_chunks = (n_kv + SFI_CAND_CHUNK - 1)/SFI_CAND_CHUNK;

    ggml_cuda_pool_alloc<float> part_max(ctx.pool(), (size_t) n_chunks*n_head*nb);
    ggml_cuda_pool_alloc<float> part_sum(ctx.pool(), (size_t) n_chunks*n_head*nb);

    const dim3 grid(n_chunks, n_head, nb);
    sfi_candidate_max<<<grid, SFI_CAND_THREADS, 0, stream>>>(
        (const float *) evid->data, (const float *) mask->data, part_max.get(), n_kv, n_head, ns);
    sfi_candidate_pool<<<grid, SFI_CAND_THREADS, 0, stream>>>(
        (const float *) evid->data, (const float *) mask->data, (float *) dst->data, part_max.get(), part_sum.get(),
        n_kv, n_head, nb, ns, 1.0f/alpha, pool > 1 ? pool/2 : 0);
    sfi_candidate_sum<<<dim3((n_kv + SFI_CAND_SUM_THREADS - 1)/SFI_CAND_SUM_THREADS, nb), SFI_CAND_SUM_THREADS, n_head*sizeof(float), stream>>>(
        (const float *) mask->data, part_sum.get(), (float *) dst->data, n_kv, n_head, nb, ns, n_chunks);
    CUDA_CHECK(cudaGetLastError());
}

void ggml_cuda_op_sfi_candidate_values(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * cs    = dst->src[0];
    const ggml_tensor * u     = dst->src[1];
    const ggml_tensor * mask  = dst->src[2];
    const ggml_tensor * cells = dst->src[3];

    GGML_ASSERT(ggml_cuda_sfi_candidate_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    const int n_kv   = (int) cs->ne[0];
    const int nb     = (int) cs->ne[1];
    const int n_head = (int) cs->ne[2] - 1;
    const int n_cand = (int) cells->ne[0];
    const int ns     = (int) (ggml_nelements(mask)/n_kv);

    sfi_candidate_gather<<<dim3((n_cand + 255)/256, nb), 256, 0, ctx.stream()>>>(
        (const float *) cs->data, (const float *) u->data, (const float *) mask->data, (const int32_t *) cells->data,
        (float *) dst->data, n_kv, nb, n_head, ns, n_cand);
    CUDA_CHECK(cudaGetLastError());
}

// ggml_sfi_selector_scores: a block per (head, batch) row, its candidates strided over the threads (each thread
// keeps its own candidates from pass to pass: the row's prior logits, then d, stay in dst between the reductions),
// then a thread per (candidate, batch) for the cross-head term
static constexpr int SFI_SEL_THREADS = 256;

static __global__ void __launch_bounds__(SFI_SEL_THREADS) sfi_selector_rows(
        const float * __restrict__ vals, const float * __restrict__ kn, const int32_t * __restrict__ cells,
        float * __restrict__ dst, const int n_cand, const int n_head, const int n_kn, const ggml_sfi_selector_params p) {
    const int h = blockIdx.x;
    const int b = blockIdx.y;

    const float   * v_b  = vals + (size_t) b*(n_head + 2)*n_cand;
    const float   * f    = v_b + (size_t) h*n_cand;
    const float   * u    = v_b + (size_t) n_head*n_cand;
    const float   * m    = v_b + (size_t) (n_head + 1)*n_cand;
    const float   * kn_b = kn + (size_t) b*n_kn*n_head;
    const int32_t * c_b  = cells ? cells + (size_t) b*n_cand : nullptr;
    float         * s    = dst + ((size_t) b*n_head + h)*n_cand;

    __shared__ float buf_f[WARP_SIZE];
    __shared__ float buf_x[WARP_SIZE];
    __shared__ float buf_z[WARP_SIZE];
    __shared__ float buf_num[WARP_SIZE];
    __shared__ float buf_den[WARP_SIZE];

    float sum_f = 0.0f;
    float x_max = -INFINITY;
    for (int i = threadIdx.x; i < n_cand; i += SFI_SEL_THREADS) {
        const int   row   = c_b ? c_b[i] : i;
        const float u_pow = expf(p.pos_power*logf(u[i]));
        const float prior = p.w_pos*(-p.pos_beta*u_pow + p.pos_eta*logf(1.0f - u[i])) + m[i];
        const float x     = p.key_norm_exponent*logf(fminf(fmaxf(kn_b[(size_t) row*n_head + h], FLT_MIN), FLT_MAX)) + prior;
        s[i]  = x;
        x_max = fmaxf(x_max, x);
        sum_f += f[i];
    }
    sum_f = block_reduce<block_reduce_method::SUM, SFI_SEL_THREADS>(sum_f, buf_f);
    x_max = block_reduce<block_reduce_method::MAX, SFI_SEL_THREADS>(x_max, buf_x);

    float z = 0.0f;
    for (int i = threadIdx.x; i < n_cand; i += SFI_SEL_THREADS) {
        z += expf(s[i] - x_max);
    }
    z = block_reduce<block_reduce_method::SUM, SFI_SEL_THREADS>(z, buf_z);

    const float inv_f = sum_f > 0.0f ? 1.0f/sum_f : 0.0f;
    const float inv_z = 1.0f/z;

    float num = 0.0f;
    float den = 0.0f;
    for (int i = threadIdx.x; i < n_cand; i += SFI_SEL_THREADS) {
        const float fi = f[i]*inv_f;
        const float d  = fi - expf(s[i] - x_max)*inv_z;
        s[i] = d;
        num += fi*d;
        den += d*d;
    }
    num = block_reduce<block_reduce_method::SUM, SFI_SEL_THREADS>(num, buf_num);
    den = block_reduce<block_reduce_method::SUM, SFI_SEL_THREADS>(den, buf_den);

    const float lambda = fminf(fmaxf(num/(den + 1e-30f), 0.0f), p.lambda_max);
    for (int i = threadIdx.x; i < n_cand; i += SFI_SEL_THREADS) {
        s[i] = logf(fminf(fmaxf(f[i]*inv_f - lambda*s[i], FLT_MIN), FLT_MAX));
    }
}

static __global__ void sfi_selector_cross_head(float * __restrict__ dst, const int n_cand, const int n_head,
        const float alpha, const float inv_t) {
    const int i = blockIdx.x*blockDim.x + threadIdx.x;
    const int b = blockIdx.y;
    if (i >= n_cand) {
        return;
    }
    float * s = dst + (size_t) b*n_head*n_cand + i;

    float t_max = -INFINITY;
    for (int h = 0; h < n_head; ++h) {
        t_max = fmaxf(t_max, s[(size_t) h*n_cand]*inv_t);
    }
    float z = 0.0f;
    for (int h = 0; h < n_head; ++h) {
        z += expf(s[(size_t) h*n_cand]*inv_t - t_max);
    }
    const float log_z = t_max + logf(z);
    for (int h = 0; h < n_head; ++h) {
        const float v = s[(size_t) h*n_cand];
        s[(size_t) h*n_cand] = v + alpha*(v*inv_t - log_z);
    }
}

bool ggml_cuda_sfi_selector_scores_supported(const ggml_tensor * op) {
    return op->ne[1] <= 65535 && op->ne[2] <= 65535;
}

void ggml_cuda_op_sfi_selector_scores(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * vals  = dst->src[0];
    const ggml_tensor * kn    = dst->src[1];
    const ggml_tensor * cells = dst->src[2];

    GGML_ASSERT(ggml_cuda_sfi_selector_scores_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    ggml_sfi_selector_params p;
    memcpy(&p, dst->op_params, sizeof(p));

    const int n_cand = (int) vals->ne[0];
    const int n_head = (int) vals->ne[1] - 2;
    const int nb     = (int) vals->ne[2];
    const int n_kn   = (int) kn->ne[1];

    cudaStream_t stream = ctx.stream();

    sfi_selector_rows<<<dim3(n_head, nb), SFI_SEL_THREADS, 0, stream>>>(
        (const float *) vals->data, (const float *) kn->data, cells ? (const int32_t *) cells->data : nullptr,
        (float *) dst->data, n_cand, n_head, n_kn, p);
    if (p.cross_head_alpha != 0.0f) {
        sfi_selector_cross_head<<<dim3((n_cand + 255)/256, nb), 256, 0, stream>>>(
            (float *) dst->data, n_cand, n_head, p.cross_head_alpha, 1.0f/p.cross_head_temperature);
    }
    CUDA_CHECK(cudaGetLastError());
}

// ggml_sfi_copy_rows: the threads of a block copy SFI_COPY_UNITS units of T (16 bytes where the rows and their
// addresses allow it) of consecutive rows i of one (j, l)
static constexpr int SFI_COPY_THREADS = 256;
static constexpr int SFI_COPY_UNITS   = 1024; // per block

template <typename T>
static __global__ void sfi_copy_rows(const char * __restrict__ src, char * __restrict__ dst,
        const char * __restrict__ idx, const int64_t * __restrict__ slots,
        const int n, const int units_per_row,
        const size_t nbs1, const size_t nbs2, const size_t nbs3,
        const size_t nbd1, const size_t nbd2, const size_t nbd3,
        const size_t nbi0, const size_t nbi1, const size_t nbi2) {
    const int j = blockIdx.y;
    const int l = blockIdx.z;

    const int rows_per_block = max(1, SFI_COPY_UNITS/units_per_row);
    const int i0 = blockIdx.x*rows_per_block;

    for (int u = threadIdx.x; u < rows_per_block*units_per_row; u += blockDim.x) {
        const int i = i0 + u/units_per_row;
        const int e = u % units_per_row;
        if (i >= n) {
            break;
        }
        const int32_t c = *(const int32_t *) (idx + i*nbi0 + j*nbi1 + l*nbi2);
        const T * s = (const T *) (src + c*nbs1 + j*nbs2 + l*nbs3);
        T       * d = (T       *) (dst + slots[i]*nbd1 + j*nbd2 + l*nbd3);
        d[e] = s[e];
    }
}

bool ggml_cuda_sfi_copy_rows_supported(const ggml_tensor * op) {
    const ggml_tensor * idx = op->src[2];
    return idx->ne[1] <= 65535 && idx->ne[2] <= 65535 && idx->ne[0] <= INT_MAX;
}

void ggml_cuda_op_sfi_copy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * d     = dst->src[0];
    const ggml_tensor * src   = dst->src[1];
    const ggml_tensor * idx   = dst->src[2];
    const ggml_tensor * slots = dst->src[3];

    GGML_ASSERT(ggml_cuda_sfi_copy_rows_supported(dst));

    const int    n   = (int) idx->ne[0];
    const size_t row = ggml_row_size(src->type, src->ne[0]);

    // the widest unit every row start and length is a multiple of
    uintptr_t a = row | (uintptr_t) src->data | (uintptr_t) d->data;
    for (int i = 1; i < 4; ++i) {
        a |= src->nb[i] | d->nb[i];
    }
    const size_t unit = a % 16 == 0 ? 16 : a % 8 == 0 ? 8 : a % 4 == 0 ? 4 : 1;

    const int units_per_row  = (int) (row/unit);
    const int rows_per_block = std::max(1, SFI_COPY_UNITS/units_per_row);

    const dim3 grid((n + rows_per_block - 1)/rows_per_block, idx->ne[1], idx->ne[2]);

    auto launch = [&](auto t) {
        using T = decltype(t);
        sfi_copy_rows<T><<<grid, SFI_COPY_THREADS, 0, ctx.stream()>>>(
            (const char *) src->data, (char *) d->data, (const char *) idx->data, (const int64_t *) slots->data,
            n, units_per_row, src->nb[1], src->nb[2], src->nb[3], d->nb[1], d->nb[2], d->nb[3], idx->nb[0], idx->nb[1], idx->nb[2]);
    };
    switch (unit) {
        case 16: launch(uint4());    break;
        case  8: launch(uint2());    break;
        case  4: launch(uint32_t()); break;
        default: launch(uint8_t());  break;
    }
    CUDA_CHECK(cudaGetLastError());
}

// ggml_sfi_flash_attn_evidence for a decode step's few query rows per KV head (n_q = n_gqa*n_tokens <= NQ <= 8), keys
// and values of one type T (F16, Q8_0 or Q4_0), in three kernels per chunk of (head, stream) pairs:
//   partial:  the keys read as sfi_evidence_scores_warp reads them (a warp 32/NQ cells at a time, each lane D/32
//             elements of a row), and each cell's value row; a block takes every gridDim.y-th tile of 256 cells (a
//             few parts per pair keep the combine short: merging one part per tile took as long as the attention), each
//             warp keeps per query row a running max, sum and output over its cells (every lane the same max and
//             sum, and its D/32 elements of the output), the block merges its warps' and writes that part, the
//             scores and the key norms
//   combine:  per query row, the blocks' parts merged into the output, and the row's max and sum^-alpha
//   evidence: per cell, sfi_evidence_sum (ggml_sfi_evidence's)
template <int D, int NQ, ggml_type T>
static __global__ void __launch_bounds__(SFI_WARP_BLOCK_THREADS) sfi_fae_partial(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ v, const char * __restrict__ mask,
        float * __restrict__ scores, float2 * __restrict__ parts, float * __restrict__ part_out, float * __restrict__ kn,
        const int n_q, const int n_tokens, const int n_gqa, const int n_kv, const int n_head_kv, const int b0, const int nm,
        const float s_scale, const float softcap,
        const size_t nbq1, const size_t nbq2, const size_t nbq3,
        const size_t nbk1, const size_t nbk2, const size_t nbk3,
        const size_t nbv1, const size_t nbv2, const size_t nbv3,
        const size_t nbm1, const size_t nbm3) {
    constexpr int E   = D/WARP_SIZE;
    constexpr int CPI = WARP_SIZE/NQ;
    constexpr int N_WARPS = SFI_WARP_BLOCK_THREADS/WARP_SIZE;
    constexpr int CELLS_PER_WARP = SFI_CELLS_PER_BLOCK/N_WARPS;
    static_assert(CELLS_PER_WARP % CPI == 0, "a warp's cells come in whole iterations");

    const int h    = blockIdx.x;
    const int part = blockIdx.y;
    const int bl   = blockIdx.z;
    const int b    = b0 + bl;

    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    // the lane's elements of each query row, scaled (row j = g*n_tokens + t: query head h*n_gqa + g at token t), and
    // rounded as ggml_sfi_evidence rounds them (its scores, and those of flash attention's products)
    float qr[NQ][E];
    float qd[NQ];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        const char * qj = q + (j % n_tokens)*nbq1 + (h*n_gqa + j/n_tokens)*nbq2 + b*nbq3;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            qr[j][e] = j < n_q ? s_scale*((const float *) qj)[lane*E + e] : 0.0f;
        }
        qd[j] = sfi_query_lane<T, E>(qr[j]);
    }

    const size_t pair = (size_t) bl*n_head_kv + h;

    float * s_out = scores + pair*n_q*n_kv;
    const char * k_base = k + h*nbk2 + b*nbk3 + sfi_lane_kv<T, E>::lane_offset(lane);
    const char * v_base = v + h*nbv2 + b*nbv3 + sfi_lane_kv<T, E>::lane_offset(lane);
    const char * m_base = mask + (b % nm)*nbm3;

    const int my_row  = lane % NQ; // after the butterfly, lane l holds the score of (cell l/NQ, row l%NQ)
    const int my_cell = lane / NQ;

    __shared__ float p_s[N_WARPS][WARP_SIZE]; // the iteration's weights, [cell][row]

    float m_run[NQ];   // per row, the same in every lane
    float s_run[NQ];
    float o_run[NQ][E];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        m_run[j] = -INFINITY;
        s_run[j] = 0.0f;
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o_run[j][e] = 0.0f;
        }
    }
    float m_mine = -INFINITY; // m_run[my_row]

    for (int tile = part; tile*SFI_CELLS_PER_BLOCK < n_kv; tile += gridDim.y) {
        const int c_warp = tile*SFI_CELLS_PER_BLOCK + warp*CELLS_PER_WARP;

        for (int it = 0; it < CELLS_PER_WARP; it += CPI) {
            const int c0 = c_warp + it;
            if (c0 >= n_kv) {
                break; // the same for the whole warp
            }

            sfi_lane_kv<T, E> kh[CPI];
            sfi_lane_kv<T, E> vh[CPI];
            sfi_warp_load_rows<T, E, CPI>(kh, k_base, c0, n_kv, nbk1, lane);
            sfi_warp_load_rows<T, E, CPI>(vh, v_base, c0, n_kv, nbv1, lane);

            float sv[WARP_SIZE];
            float sq[CPI];
            sfi_warp_scores<T, E, NQ, CPI>(qr, qd, kh, sv, sq, lane);

            if (kn) {
                sfi_warp_key_norms<CPI>(sq, lane, kn, b, h, c0, n_kv, n_head_kv);
            }

            const int c = c0 + my_cell;
            float s = -INFINITY;
            if (c < n_kv && my_row < n_q) {
                s = softcap > 0.0f ? softcap*tanhf(sv[0]) : sv[0];
                s += __half2float(*(const half *) (m_base + c*sizeof(half) + (my_row % n_tokens)*nbm1));
                s_out[(size_t) my_row*n_kv + c] = s;
            }

            // the iteration's max of each row, then every row's in every lane
            float m_it = s;
#pragma unroll
            for (int o = NQ; o < WARP_SIZE; o <<= 1) {
                m_it = fmaxf(m_it, __shfl_xor_sync(0xffffffff, m_it, o));
            }
            m_mine = fmaxf(m_mine, m_it);
            p_s[warp][lane] = s == -INFINITY ? 0.0f : expf(s - m_mine);

            float corr[NQ];
#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                const float m_new = fmaxf(m_run[j], __shfl_sync(0xffffffff, m_it, j));
                corr[j]  = m_new == -INFINITY ? 1.0f : expf(m_run[j] - m_new);
                m_run[j] = m_new;
            }
            __syncwarp();

#pragma unroll
            for (int j = 0; j < NQ; ++j) {
                s_run[j] *= corr[j];
#pragma unroll
                for (int e = 0; e < E; ++e) {
                    o_run[j][e] *= corr[j];
                }
            }
#pragma unroll
            for (int i = 0; i < CPI; ++i) {
                float vf[E];
                vh[i].values(vf);
#pragma unroll
                for (int j = 0; j < NQ; ++j) {
                    const float w = p_s[warp][i*NQ + j];
                    s_run[j] += w;
                    float wv = w;
                    if constexpr (sfi_quantized(T)) {
                        wv *= vh[i].d;
                    }
#pragma unroll
                    for (int e = 0; e < E; ++e) {
                        o_run[j][e] += wv*vf[e];
                    }
                }
            }
            __syncwarp();
        }
    }

    // the block's part per row: the warps' merged
    __shared__ float m_w[N_WARPS][NQ];
    __shared__ float s_w[N_WARPS][NQ];
    __shared__ float o_w[N_WARPS][NQ][D];
#pragma unroll
    for (int j = 0; j < NQ; ++j) {
        if (lane == 0) {
            m_w[warp][j] = m_run[j];
            s_w[warp][j] = s_run[j];
        }
#pragma unroll
        for (int e = 0; e < E; ++e) {
            o_w[warp][j][lane*E + e] = o_run[j][e];
        }
    }
    __syncthreads();

    const size_t part0 = (pair*gridDim.y + part)*n_q;
    for (int i = threadIdx.x; i < n_q*D; i += blockDim.x) {
        const int j = i / D;
        const int d = i % D;
        float m = -INFINITY;
#pragma unroll
        for (int w = 0; w < N_WARPS; ++w) {
            m = fmaxf(m, m_w[w][j]);
        }
        float sum = 0.0f;
        float o   = 0.0f;
        if (m != -INFINITY) {
#pragma unroll
            for (int w = 0; w < N_WARPS; ++w) {
                const float f = m_w[w][j] == -INFINITY ? 0.0f : expf(m_w[w][j] - m);
                sum += s_w[w][j]*f;
                o   += o_w[w][j][d]*f;
            }
        }
        part_out[(part0 + j)*D + d] = o;
        if (d == 0) {
            parts[part0 + j] = make_float2(m, sum);
        }
    }
}

// per query row (j, h, bl): the n_parts blocks' parts merged, the output written in ggml_flash_attn_ext's layout, and
// the row's (max, sum^-alpha) for the evidence
template <int D>
static __global__ void __launch_bounds__(D) sfi_fae_combine(const float2 * __restrict__ parts, const float * __restrict__ part_out,
        float * __restrict__ out, float2 * __restrict__ stats,
        const int n_q, const int n_parts, const int n_tokens, const int n_gqa, const int n_head, const int b0, const float alpha) {
    const int    j    = blockIdx.x;
    const int    h    = blockIdx.y;
    const int    bl   = blockIdx.z;
    const size_t pair = (size_t) bl*gridDim.y + h;
    const int    d    = threadIdx.x;

    const float2 * p = parts    + pair*n_parts*n_q + j;
    const float  * o = part_out + (pair*n_parts*n_q + j)*D + d;

    float m = -INFINITY;
    for (int i = 0; i < n_parts; ++i) {
        m = fmaxf(m, p[(size_t) i*n_q].x);
    }
    float sum = 0.0f;
    float acc = 0.0f;
    if (m != -INFINITY) {
        for (int i = 0; i < n_parts; ++i) {
            const float2 pi = p[(size_t) i*n_q];
            const float  f  = pi.x == -INFINITY ? 0.0f : expf(pi.x - m);
            sum += pi.y*f;
            acc += o[(size_t) i*n_q*D]*f;
        }
    }

    const int b    = b0 + bl;
    const int head = h*n_gqa + j/n_tokens;
    const int t    = j % n_tokens;
    out[(((size_t) b*n_tokens + t)*n_head + head)*D + d] = sum > 0.0f ? acc/sum : 0.0f;
    if (d == 0) {
        stats[pair*n_q + j] = make_float2(m, m == -INFINITY || sum <= 0.0f ? 0.0f : powf(sum, -alpha));
    }
}

bool ggml_cuda_sfi_flash_attn_evidence_supported(const ggml_tensor * op) {
    const ggml_tensor * q    = op->src[0];
    const ggml_tensor * k    = op->src[1];
    const ggml_tensor * v    = op->src[2];
    const ggml_tensor * mask = op->src[3];

    const int64_t D   = q->ne[0];
    const int64_t n_q = q->ne[1]*(q->ne[2]/k->ne[2]);
    if (!sfi_kv_type_supported(k->type) || v->type != k->type || mask->type != GGML_TYPE_F16 || v->ne[0] != D) {
        return false;
    }
    if ((D != 64 && D != 128 && D != 256) || n_q > 8 || q->nb[0] != sizeof(float) || mask->nb[0] != sizeof(half)) {
        return false;
    }
    // a lane's load of a row: D/32 F16 values at once, or the values of a quantized block 2 bytes at a time
    const size_t align = k->type == GGML_TYPE_F16 ? D/WARP_SIZE*sizeof(half) : 2;
    for (const ggml_tensor * t : { k, v }) {
        if (t->nb[1] % align || t->nb[2] % align || t->nb[3] % align || t->view_offs % align) {
            return false;
        }
    }
    return (k->ne[1] + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK <= 65535 && q->ne[3] <= 65535;
}

// the blocks of sfi_fae_partial<D, NQ, T> an SM holds at once (its registers decide: 3 or 4 on sm_90 for F16)
template <int D, int NQ, ggml_type T>
static int sfi_fae_blocks_per_sm() {
    static const int n = [] {
        int blocks = 0;
        CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, sfi_fae_partial<D, NQ, T>, SFI_WARP_BLOCK_THREADS, 0));
        return std::max(1, blocks);
    }();
    return n;
}

template <int D, ggml_type T>
static void sfi_fae_launch(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * v    = dst->src[2];
    const ggml_tensor * mask = dst->src[3];

    const float scale   = ggml_get_op_params_f32(dst, 0);
    const float softcap = ggml_get_op_params_f32(dst, 1);
    const float alpha   = ggml_get_op_params_f32(dst, 2);
    const bool  norms   = ggml_get_op_params_i32(dst, 3) != 0;

    const int n_tokens  = (int) q->ne[1];
    const int n_head    = (int) q->ne[2];
    const int ns        = (int) q->ne[3];
    const int n_kv      = (int) k->ne[1];
    const int n_head_kv = (int) k->ne[2];
    const int n_gqa     = n_head/n_head_kv;
    const int n_q       = n_gqa*n_tokens;
    const int n_tiles   = (n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK;

    const float s_scale = softcap > 0.0f ? scale/softcap : scale;

    float * out  = (float *) dst->data;
    float * evid = out + (size_t) D*n_head*n_tokens*ns;
    float * kn   = norms ? evid + (size_t) n_kv*n_head_kv*ns : nullptr;

    cudaStream_t stream = ctx.stream();

    // (head, stream) pairs a chunk holds the scores of
    const size_t pair_bytes = (size_t) n_q*n_kv*sizeof(float);
    const int    nbl_max    = (int) std::max<size_t>(1, std::min<size_t>(ns, SFI_SCORES_MAX_BYTES/(pair_bytes*n_head_kv)));

    // parts per (head, stream) pair: as many blocks as the SMs hold at once, and no more (every block takes about
    // the same time, so a second wave of a few blocks would take nearly as long as the first)
    const int bps     = n_q <= 1 ? sfi_fae_blocks_per_sm<D, 1, T>() : n_q <= 2 ? sfi_fae_blocks_per_sm<D, 2, T>() :
                        n_q <= 4 ? sfi_fae_blocks_per_sm<D, 4, T>() : sfi_fae_blocks_per_sm<D, 8, T>();
    const int nsm     = ggml_cuda_info().devices[ctx.device].nsm;
    const int n_parts = std::max(1, std::min(n_tiles, bps*nsm/(n_head_kv*nbl_max)));

    ggml_cuda_pool_alloc<float>  scores  (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q*n_kv);
    ggml_cuda_pool_alloc<float2> parts   (ctx.pool(), (size_t) nbl_max*n_head_kv*n_parts*n_q);
    ggml_cuda_pool_alloc<float>  part_out(ctx.pool(), (size_t) nbl_max*n_head_kv*n_parts*n_q*D);
    ggml_cuda_pool_alloc<float2> stats   (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q);

    for (int b0 = 0; b0 < ns; b0 += nbl_max) {
        const int nbl = std::min(nbl_max, ns - b0);

        const dim3 grid(n_head_kv, n_parts, nbl);
        auto launch = [&](auto nq) {
            constexpr int NQ = decltype(nq)::value;
            sfi_fae_partial<D, NQ, T><<<grid, SFI_WARP_BLOCK_THREADS, 0, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) v->data, (const char *) mask->data,
                scores.get(), parts.get(), part_out.get(), kn,
                n_q, n_tokens, n_gqa, n_kv, n_head_kv, b0, (int) mask->ne[3], s_scale, softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], v->nb[1], v->nb[2], v->nb[3],
                mask->nb[1], mask->nb[3]);
        };
        if (n_q <= 1) {
            launch(std::integral_constant<int, 1>());
        } else if (n_q <= 2) {
            launch(std::integral_constant<int, 2>());
        } else if (n_q <= 4) {
            launch(std::integral_constant<int, 4>());
        } else {
            launch(std::integral_constant<int, 8>());
        }
        CUDA_CHECK(cudaGetLastError());

        sfi_fae_combine<D><<<dim3(n_q, n_head_kv, nbl), D, 0, stream>>>(
            parts.get(), part_out.get(), out, stats.get(), n_q, n_parts, n_tokens, n_gqa, n_head, b0, alpha);

        const dim3 grid_e((n_kv + SFI_EVIDENCE_THREADS - 1)/SFI_EVIDENCE_THREADS, n_head_kv, nbl);
        sfi_evidence_sum<<<grid_e, SFI_EVIDENCE_THREADS, n_q*sizeof(float2), stream>>>(
            scores.get(), stats.get(), evid, n_q, n_kv, n_head_kv, b0, alpha);
        CUDA_CHECK(cudaGetLastError());
    }
}

template <ggml_type T>
static void sfi_fae_dispatch(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    switch (dst->src[0]->ne[0]) {
        case  64: sfi_fae_launch< 64, T>(ctx, dst); break;
        case 128: sfi_fae_launch<128, T>(ctx, dst); break;
        case 256: sfi_fae_launch<256, T>(ctx, dst); break;
        default: GGML_ABORT("unsupported head size");
    }
}

void ggml_cuda_op_sfi_flash_attn_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    GGML_ASSERT(ggml_cuda_sfi_flash_attn_evidence_supported(dst));
    GGML_ASSERT(dst->type == GGML_TYPE_F32 && ggml_is_contiguous(dst));

    switch (dst->src[1]->type) {
        case GGML_TYPE_F16:  sfi_fae_dispatch<GGML_TYPE_F16 >(ctx, dst); break;
        case GGML_TYPE_Q8_0: sfi_fae_dispatch<GGML_TYPE_Q8_0>(ctx, dst); break;
        case GGML_TYPE_Q4_0: sfi_fae_dispatch<GGML_TYPE_Q4_0>(ctx, dst); break;
        default: GGML_ABORT("unsupported key type");
    }
}
