// ggml_sfi_sample and ggml_sfi_greedy: first, the segments of each row on blocks enough to fill the SMs (a row of a
// vocabulary on one block would take one SM tens of microseconds), each its running softmax sum and its first
// maximum; then one block per row merges its segments' and, with candidates, loads them into shared memory and sorts
// them (bitonic, largest logit first, then the smaller id), and one thread runs the pick, a few dozen steps for a
// sampler's top-k.

#include "sfi-sample.cuh"

#include "sfi-common.cuh"

#include "../ggml-sfi-sample.h"

#include <climits>

static constexpr int SFI_SAMPLE_THREADS = 1024;
static constexpr int SFI_SAMPLE_LOADS   = 8;
static constexpr int SFI_STATS_THREADS  = 256;

// whether candidate a comes before candidate b: the larger logit, then the smaller id
static __device__ __forceinline__ bool sfi_sample_before(const float va, const int ia, const float vb, const int ib) {
    return va > vb || (va == vb && ia < ib);
}

// a running softmax sum with the first index of the maximum
struct sfi_row_stats {
    float m;
    float s;
    int   arg;
};

static __device__ __forceinline__ void sfi_stats_merge(sfi_row_stats & a, const sfi_row_stats & b) {
    const int arg = b.m > a.m ? b.arg : a.m > b.m ? a.arg : min(a.arg, b.arg);
    sfi_online_merge(a.m, a.s, b.m, b.s);
    a.arg = arg;
}

// block b: segment b % n_seg of row b / n_seg, its running softmax sum and first maximum; SFI_SAMPLE_LOADS loads in
// flight per thread
static __global__ void __launch_bounds__(SFI_STATS_THREADS) sfi_row_stats_kernel(
        const float * __restrict__ logits, sfi_row_stats * __restrict__ stats, const int n_vocab, const size_t s_logits,
        const int n_seg) {
    const int row = blockIdx.x / n_seg;
    const int seg = blockIdx.x % n_seg;
    const int i0  = (int) ((int64_t) seg*n_vocab/n_seg);
    const int i1  = (int) ((int64_t) (seg + 1)*n_vocab/n_seg);

    const float * x = logits + row*s_logits;

    sfi_row_stats st = { -INFINITY, 0.0f, INT_MAX };
    for (int j0 = i0 + threadIdx.x; j0 < i1; j0 += SFI_SAMPLE_LOADS*blockDim.x) {
        float v[SFI_SAMPLE_LOADS];
#pragma unroll
        for (int e = 0; e < SFI_SAMPLE_LOADS; ++e) {
            const int j = j0 + e*blockDim.x;
            v[e] = j < i1 ? x[j] : -INFINITY;
        }
#pragma unroll
        for (int e = 0; e < SFI_SAMPLE_LOADS; ++e) {
            if (v[e] > st.m) { // (strictly: a thread sees its indices in increasing order)
                st.arg = j0 + e*blockDim.x;
            }
            sfi_online_add(st.m, st.s, v[e]);
        }
    }
    if (st.m == -INFINITY) {
        st.arg = i0 < i1 ? i0 : INT_MAX; // a row of -inf: its first index
    }

    __shared__ sfi_row_stats w_stats[SFI_STATS_THREADS/WARP_SIZE];
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        const sfi_row_stats o = {
            __shfl_xor_sync(0xffffffff, st.m, off), __shfl_xor_sync(0xffffffff, st.s, off), __shfl_xor_sync(0xffffffff, st.arg, off) };
        sfi_stats_merge(st, o);
    }
    if (threadIdx.x % WARP_SIZE == 0) {
        w_stats[threadIdx.x / WARP_SIZE] = st;
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int w = 1; w < (int) (blockDim.x/WARP_SIZE); ++w) {
            sfi_stats_merge(st, w_stats[w]);
        }
        stats[blockIdx.x] = st;
    }
}

// one block per row: the row's segments' statistics merged; with candidates, these sorted and the pick among them,
// else the first maximum
static __global__ void __launch_bounds__(SFI_SAMPLE_THREADS) sfi_sample_kernel(
        const float * __restrict__ logits, const sfi_row_stats * __restrict__ stats, const int32_t * __restrict__ cand,
        const float * __restrict__ u, float * __restrict__ dst, const int n_seg, const int k, const int k_pow2,
        const size_t s_logits, const size_t s_u, const float top_p, const float min_p, const float temp) {
    const int row = blockIdx.x;

    const float   * x   = logits + row*s_logits;
    const int32_t * ids = cand + (size_t) row*k;

    __shared__ float c_val[GGML_SFI_SAMPLE_MAX_K];
    __shared__ int   c_id [GGML_SFI_SAMPLE_MAX_K];

    // the candidates, padded to a power of two with entries that sort last
    for (int j = threadIdx.x; j < k_pow2; j += blockDim.x) {
        const int id = j < k ? ids[j] : INT_MAX;
        c_val[j] = j < k ? x[id] : -INFINITY;
        c_id [j] = id;
    }
    __syncthreads();

    for (int size = 2; size <= k_pow2; size <<= 1) {
        for (int stride = size/2; stride > 0; stride >>= 1) {
            for (int i = threadIdx.x; i < k_pow2; i += blockDim.x) {
                const int j = i ^ stride;
                if (j > i) {
                    const bool first_half = (i & size) == 0; // sorted in candidate order, else in reverse
                    const bool swap = first_half ? sfi_sample_before(c_val[j], c_id[j], c_val[i], c_id[i])
                                                 : sfi_sample_before(c_val[i], c_id[i], c_val[j], c_id[j]);
                    if (swap) {
                        const float v = c_val[i]; c_val[i] = c_val[j]; c_val[j] = v;
                        const int   t = c_id [i]; c_id [i] = c_id [j]; c_id [j] = t;
                    }
                }
            }
            __syncthreads();
        }
    }

    if (threadIdx.x == 0) {
        sfi_row_stats st = stats[row*n_seg];
        for (int s = 1; s < n_seg; ++s) {
            sfi_stats_merge(st, stats[row*n_seg + s]);
        }
        const int token = k > 0 ? c_id[ggml_sfi_sample_pick(c_val, k, top_p, min_p, temp, u[row*s_u])] : st.arg;
        dst[2*row + 0] = (float) token;
        dst[2*row + 1] = 1.0f/st.s;
    }
}

bool ggml_cuda_sfi_sample_supported(const ggml_tensor * op) {
    const ggml_tensor * logits = op->src[0];
    const ggml_tensor * cand   = op->src[1];
    return (!cand || cand->ne[0] <= GGML_SFI_SAMPLE_MAX_K) && logits->ne[0] <= INT_MAX && logits->ne[1] <= INT_MAX;
}

// a row's segments for the statistics: enough blocks to fill the SMs, each of a few thousand logits at least
static int sfi_sample_n_seg(const int n_vocab, const int n_rows, const int nsm) {
    return std::max(1, std::min(std::min(n_vocab/2048, 2*nsm/std::max(n_rows, 1)), SFI_SAMPLE_THREADS));
}

void ggml_cuda_op_sfi_sample(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * cand   = dst->src[1];
    const ggml_tensor * u      = dst->src[2];

    GGML_ASSERT(ggml_cuda_sfi_sample_supported(dst) && ggml_is_contiguous(dst));

    const int n_vocab = (int) logits->ne[0];
    const int n_rows  = (int) logits->ne[1];
    const int k       = cand ? (int) cand->ne[0] : 0;
    int k_pow2 = k > 0 ? 1 : 0;
    while (k_pow2 < k) {
        k_pow2 *= 2;
    }
    const int n_seg = sfi_sample_n_seg(n_vocab, n_rows, ggml_cuda_info().devices[ctx.device].nsm);
    const size_t s_logits = logits->nb[1]/sizeof(float);

    cudaStream_t stream = ctx.stream();
    ggml_cuda_pool_alloc<sfi_row_stats> stats(ctx.pool(), (size_t) n_rows*n_seg);

    sfi_row_stats_kernel<<<n_rows*n_seg, SFI_STATS_THREADS, 0, stream>>>(
        (const float *) logits->data, stats.get(), n_vocab, s_logits, n_seg);
    CUDA_CHECK(cudaGetLastError());

    // (without candidates, a warp: nothing to sort)
    sfi_sample_kernel<<<n_rows, k > 0 ? SFI_SAMPLE_THREADS : WARP_SIZE, 0, stream>>>(
        (const float *) logits->data, stats.get(), cand ? (const int32_t *) cand->data : nullptr,
        u ? (const float *) u->data : nullptr, (float *) dst->data, n_seg, k, k_pow2, s_logits,
        u ? u->nb[1]/sizeof(float) : 0, ggml_get_op_params_f32(dst, 0), ggml_get_op_params_f32(dst, 1),
        ggml_get_op_params_f32(dst, 2));
    CUDA_CHECK(cudaGetLastError());
}
