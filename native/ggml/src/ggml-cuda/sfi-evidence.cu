// ggml_sfi_evidence (see ggml-sfi.h) on CUDA, in three kernels per chunk of (head, batch) pairs:
//   scores:    one thread per cell reads its key once (16-byte loads, a row of the query group at a time from shared
//              memory, where every thread reads the same address), writes the scores, and the block's max and sum of
//              exp(s - max) per query row; a decode step's few rows take the warp kernel instead (keys read as flash
//              attention reads them, sfi-common.cuh)
//   row stats: per query row its max and sum^-alpha, merged from the blocks'
//   evidence:  per cell the sum over the rows of exp(alpha*(s - max))*sum^-alpha = p^alpha
// The scores of a chunk live in a pool buffer of at most SFI_SCORES_MAX_BYTES. The slow step reads the whole K cache
// here, so the scores kernel is made to keep enough loads in flight to run at the memory's speed.
// Keys are F16, Q8_0 or Q4_0 (sfi_lane_kv, sfi_load_block: quantized blocks are dequantized as they are read; the
// query rows are then quantized to Q8_0 as the CPU's and flash attention's are).

#include "sfi-evidence.cuh"

#include "sfi-common.cuh"

static constexpr int    SFI_ROWS_PER_PASS = 8;   // query rows a thread of the scores kernel accumulates at a time
static constexpr int    SFI_ROW_THREADS   = 256;
static constexpr size_t SFI_Q_SHARED_MAX  = 46*1024; // of the 48 KB a block may take, with the reduction's

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

// the same for a decode step's few query rows (n_q <= NQ <= 8), as flash attention reads keys (the score loop of
// sfi-common.cuh, 32/NQ cells at a time). Each lane keeps the running max and sum of exp of its row for the block's
// part.
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

    // the lane's elements of each query row, as the attention's products take them
    float qr[NQ][E];
    float qd[NQ];
    sfi_warp_query_rows<TK, E, NQ>(qr, qd, n_q, lane, [&](const int j, const int i) {
        return *(const float *) (q + j*nbq1 + h*nbq2 + b*nbq3 + i*sizeof(float));
    });

    const size_t pair = (size_t) bl*n_head_kv + h;

    float * s_out = scores + pair*n_q*n_kv;
    const char * k_base = k + h*nbk2 + b*nbk3 + sfi_lane_kv<TK, E>::lane_offset(lane);
    const char * m_base = mask + (b % nm)*nbm3;

    float run_max = -INFINITY;
    float run_sum = 0.0f;

    const int c_warp = tile*SFI_CELLS_PER_BLOCK + warp*CELLS_PER_WARP;

    for (int it = 0; it < CELLS_PER_WARP; it += CPI) {
        const int c0 = c_warp + it;

        sfi_lane_kv<TK, E> kh[CPI];
        sfi_warp_load_rows<TK, E, CPI>(kh, k_base, c0, n_kv, nbk1, lane);

        // the lane's score (-INFINITY: none) into its row's running max and sum
        const float s = sfi_warp_cell_scores<TM, TK, E, NQ, CPI>(qr, qd, kh, c0, n_kv, n_q, softcap, m_base, nbm0, nbm1, n_rows,
                s_out, kn, b, h, n_head_kv, lane);
        sfi_online_add(run_max, run_sum, s);
    }

    // the block's (max, sum) per row: first over the lanes of a row (lanes l = row mod NQ), then over the warps
#pragma unroll
    for (int o = NQ; o < WARP_SIZE; o <<= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, run_max, o);
        const float s2 = __shfl_xor_sync(0xffffffff, run_sum, o);
        sfi_online_merge(run_max, run_sum, m2, s2);
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

void ggml_cuda_sfi_evidence_sum(const float * scores, const float2 * stats, float * dst, int n_q, int n_kv, int n_head_kv, int b0,
        int nbl, float alpha, cudaStream_t stream) {
    const dim3 grid((n_kv + SFI_EVIDENCE_THREADS - 1)/SFI_EVIDENCE_THREADS, n_head_kv, nbl);
    sfi_evidence_sum<<<grid, SFI_EVIDENCE_THREADS, n_q*sizeof(float2), stream>>>(scores, stats, dst, n_q, n_kv, n_head_kv, b0, alpha);
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

        ggml_cuda_sfi_evidence_sum(scores.get(), stats.get(), (float *) dst->data, n_q, n_kv, n_head_kv, b0, nbl, alpha, stream);
        CUDA_CHECK(cudaGetLastError());
    }
}
