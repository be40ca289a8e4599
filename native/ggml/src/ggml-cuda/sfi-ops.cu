// SFI ops (see ggml-sfi.h) on CUDA
//
// ggml_sfi_evidence in three kernels per chunk of (head, batch) pairs:
//   scores:    each key read once, by 8 lanes, against every query row of its head (the rows in shared memory)
//   row stats: per query row the max of its scores and sum^-alpha of their exponentials
//   evidence:  per cell the sum over the rows of exp(alpha*(s - max))*sum^-alpha = p^alpha
// The scores of a chunk live in a pool buffer of at most SFI_SCORES_MAX_BYTES.

#include "sfi-ops.cuh"

static constexpr int    SFI_LANES_PER_CELL    = 8;
static constexpr int    SFI_SCORES_THREADS    = 128;
static constexpr int    SFI_CELLS_PER_BLOCK   = 256;
static constexpr int    SFI_ROW_THREADS       = 256;
static constexpr int    SFI_EVIDENCE_THREADS  = 256;
static constexpr size_t SFI_Q_SHARED_MAX      = 48*1024;
static constexpr size_t SFI_SCORES_MAX_BYTES  = 256u << 20;

template <typename T>
static __device__ __forceinline__ float sfi_to_float(T x);
template <> __device__ __forceinline__ float sfi_to_float<half>(half x)   { return __half2float(x); }
template <> __device__ __forceinline__ float sfi_to_float<float>(float x) { return x; }

template <int D, typename TM>
static __global__ void sfi_evidence_scores(
        const char * __restrict__ q, const char * __restrict__ k, const char * __restrict__ mask, float * __restrict__ scores,
        const int n_q, const int j0, const int n_qc, const int n_rows, const int n_kv, const int n_head_kv, const int b0, const int nm,
        const float softcap,
        const size_t nbq1, const size_t nbq2, const size_t nbq3,
        const size_t nbk1, const size_t nbk2, const size_t nbk3,
        const size_t nbm0, const size_t nbm1, const size_t nbm3) {
    // the rows j0 .. j0 + n_qc - 1 of n_q (as many as shared memory holds)
    // lane l of a cell's 8 takes the element pairs l, l + 8, l + 16, ... of the key: the 8 lanes read 32 contiguous
    // bytes at a time, and their reads of a query row from shared memory fall in distinct banks
    constexpr int PPL      = D/(2*SFI_LANES_PER_CELL); // element pairs per lane
    constexpr int N_GROUPS = SFI_SCORES_THREADS/SFI_LANES_PER_CELL;

    extern __shared__ float2 q_s[]; // [n_qc][D/2]

    const int h  = blockIdx.y;
    const int bl = blockIdx.z;
    const int b  = b0 + bl;

    for (int i = threadIdx.x; i < n_qc*D/2; i += blockDim.x) {
        const int j = j0 + i / (D/2);
        const int d = i % (D/2);
        // rounded to F16, as the attention's and cuBLAS's products of F16 keys round them
        const float2 v = *(const float2 *) (q + j*nbq1 + h*nbq2 + b*nbq3 + d*sizeof(float2));
        q_s[i] = __half22float2(__float22half2_rn(v));
    }
    __syncthreads();

    const int group = threadIdx.x / SFI_LANES_PER_CELL;
    const int lane  = threadIdx.x % SFI_LANES_PER_CELL;

    const int c0 = blockIdx.x*SFI_CELLS_PER_BLOCK;
    const int c1 = min(c0 + SFI_CELLS_PER_BLOCK, n_kv);

    float * s_out = scores + (size_t) (bl*n_head_kv + h)*n_q*n_kv;

    const char * m_base = mask + (b % nm)*nbm3;

    // every lane runs every iteration (the shuffles take the whole warp), cells past the end compute on zeros
    for (int cb = c0; cb < c1; cb += N_GROUPS) {
        const int  c     = cb + group;
        const bool valid = c < c1;

        float2 kf[PPL];
        if (valid) {
            const half2 * kc = (const half2 *) (k + c*nbk1 + h*nbk2 + b*nbk3);
#pragma unroll
            for (int e = 0; e < PPL; ++e) {
                kf[e] = __half22float2(kc[lane + e*SFI_LANES_PER_CELL]);
            }
        } else {
#pragma unroll
            for (int e = 0; e < PPL; ++e) {
                kf[e] = make_float2(0.0f, 0.0f);
            }
        }

        for (int j = j0; j < j0 + n_qc; ++j) {
            const float2 * qj = q_s + (j - j0)*(D/2) + lane;
            float s = 0.0f;
#pragma unroll
            for (int e = 0; e < PPL; ++e) {
                const float2 qv = qj[e*SFI_LANES_PER_CELL];
                s += qv.x*kf[e].x + qv.y*kf[e].y;
            }
#pragma unroll
            for (int o = SFI_LANES_PER_CELL/2; o > 0; o >>= 1) {
                s += __shfl_xor_sync(0xffffffff, s, o, SFI_LANES_PER_CELL);
            }
            if (lane == 0 && valid) {
                if (softcap > 0.0f) {
                    s = softcap*tanhf(s);
                }
                s += sfi_to_float(*(const TM *) (m_base + c*nbm0 + (j % n_rows)*nbm1));
                s_out[(size_t) j*n_kv + c] = s;
            }
        }
    }
}

// per row (j, h, bl): its max and sum^-alpha of exp(s - max); max -INFINITY for a row whose cells are all excluded
static __global__ void sfi_evidence_row_stats(const float * __restrict__ scores, float2 * __restrict__ stats, const int n_kv, const float alpha) {
    const size_t  row = blockIdx.x + (size_t) gridDim.x*(blockIdx.y + (size_t) gridDim.y*blockIdx.z);
    const float * s   = scores + row*n_kv;

    __shared__ float buf[WARP_SIZE];

    float max = -INFINITY;
    for (int c = threadIdx.x; c < n_kv; c += blockDim.x) {
        max = fmaxf(max, s[c]);
    }
    max = warp_reduce_max(max);
    if (threadIdx.x % WARP_SIZE == 0) {
        buf[threadIdx.x / WARP_SIZE] = max;
    }
    __syncthreads();
    // every warp reduces the warps' maxima, so that every thread holds the block's
    max = threadIdx.x % WARP_SIZE < blockDim.x/WARP_SIZE ? buf[threadIdx.x % WARP_SIZE] : -INFINITY;
    max = warp_reduce_max(max);
    __syncthreads();

    float sum = 0.0f;
    if (max != -INFINITY) {
        for (int c = threadIdx.x; c < n_kv; c += blockDim.x) {
            sum += expf(s[c] - max);
        }
    }
    sum = warp_reduce_sum(sum);
    if (threadIdx.x % WARP_SIZE == 0) {
        buf[threadIdx.x / WARP_SIZE] = sum;
    }
    __syncthreads();
    sum = threadIdx.x % WARP_SIZE < blockDim.x/WARP_SIZE ? buf[threadIdx.x % WARP_SIZE] : 0.0f;
    sum = warp_reduce_sum(sum);

    if (threadIdx.x == 0) {
        stats[row] = make_float2(max, max == -INFINITY ? 0.0f : powf(sum, -alpha));
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
    if (k->type != GGML_TYPE_F16 || (D != 64 && D != 128 && D != 256) || q->nb[0] != sizeof(float)) {
        return false;
    }
    if (mask->type != GGML_TYPE_F16 && mask->type != GGML_TYPE_F32) {
        return false;
    }
    // keys are read as half2, queries as float2
    if (k->nb[1] % 4 || k->nb[2] % 4 || k->nb[3] % 4 || k->view_offs % 4 || q->nb[1] % 8 || q->nb[2] % 8 || q->nb[3] % 8) {
        return false;
    }
    return k->ne[1] <= INT32_MAX/2;
}

template <int D>
static void sfi_evidence_scores_launch(const ggml_tensor * dst, float * scores, int b0, int nbl, cudaStream_t stream) {
    const ggml_tensor * q    = dst->src[0];
    const ggml_tensor * k    = dst->src[1];
    const ggml_tensor * mask = dst->src[2];

    const int   n_rows  = ggml_get_op_params_i32(dst, 0);
    const float softcap = ggml_get_op_params_f32(dst, 2);

    const int n_q       = q->ne[1];
    const int n_kv      = k->ne[1];
    const int n_head_kv = k->ne[2];

    const dim3 grid((n_kv + SFI_CELLS_PER_BLOCK - 1)/SFI_CELLS_PER_BLOCK, n_head_kv, nbl);

    // the query rows that fit in shared memory at a time (every row of a decode step; the keys are read again per
    // chunk only for the many rows of a prompt's bootstrap)
    const int n_q_chunk = (int) (SFI_Q_SHARED_MAX/(D*sizeof(float)));

    for (int j0 = 0; j0 < n_q; j0 += n_q_chunk) {
        const int    n_qc = std::min(n_q_chunk, n_q - j0);
        const size_t smem = (size_t) n_qc*D*sizeof(float);
        if (mask->type == GGML_TYPE_F16) {
            sfi_evidence_scores<D, half><<<grid, SFI_SCORES_THREADS, smem, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores,
                n_q, j0, n_qc, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
        } else {
            sfi_evidence_scores<D, float><<<grid, SFI_SCORES_THREADS, smem, stream>>>(
                (const char *) q->data, (const char *) k->data, (const char *) mask->data, scores,
                n_q, j0, n_qc, n_rows, n_kv, n_head_kv, b0, mask->ne[3], softcap,
                q->nb[1], q->nb[2], q->nb[3], k->nb[1], k->nb[2], k->nb[3], mask->nb[0], mask->nb[1], mask->nb[3]);
        }
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

    cudaStream_t stream = ctx.stream();

    // (head, batch) pairs a chunk holds the scores of
    const size_t  pair_bytes = (size_t) n_q*n_kv*sizeof(float);
    const int64_t nbl_max    = std::max<int64_t>(1, std::min<int64_t>(nb, SFI_SCORES_MAX_BYTES/(pair_bytes*n_head_kv)));

    ggml_cuda_pool_alloc<float>  scores(ctx.pool(), (size_t) nbl_max*n_head_kv*n_q*n_kv);
    ggml_cuda_pool_alloc<float2> stats (ctx.pool(), (size_t) nbl_max*n_head_kv*n_q);

    for (int64_t b0 = 0; b0 < nb; b0 += nbl_max) {
        const int nbl = (int) std::min<int64_t>(nbl_max, nb - b0);

        switch (D) {
            case  64: sfi_evidence_scores_launch< 64>(dst, scores.get(), b0, nbl, stream); break;
            case 128: sfi_evidence_scores_launch<128>(dst, scores.get(), b0, nbl, stream); break;
            case 256: sfi_evidence_scores_launch<256>(dst, scores.get(), b0, nbl, stream); break;
            default: GGML_ABORT("unsupported head size");
        }
        CUDA_CHECK(cudaGetLastError());

        sfi_evidence_row_stats<<<dim3(n_q, n_head_kv, nbl), SFI_ROW_THREADS, 0, stream>>>(scores.get(), stats.get(), n_kv, alpha);

        const dim3 grid((n_kv + SFI_EVIDENCE_THREADS - 1)/SFI_EVIDENCE_THREADS, n_head_kv, nbl);
        sfi_evidence_sum<<<grid, SFI_EVIDENCE_THREADS, n_q*sizeof(float2), stream>>>(
            scores.get(), stats.get(), (float *) dst->data, n_q, n_kv, n_head_kv, b0, alpha);
        CUDA_CHECK(cudaGetLastError());
    }
}
