// ggml_sfi_sample: one block per row. The block's threads sum the row's softmax (an online max and sum each, then
// combined), load the candidates into shared memory and sort them (bitonic, largest logit first, then the smaller id);
// one thread then runs the pick, a few dozen steps for a sampler's top-k.

#include "sfi-sample.cuh"

#include "sfi-common.cuh"

#include "../ggml-sfi-sample.h"

#include <climits>

static constexpr int SFI_SAMPLE_THREADS = 1024;
static constexpr int SFI_SAMPLE_LOADS   = 8;

// whether candidate a comes before candidate b: the larger logit, then the smaller id
static __device__ __forceinline__ bool sfi_sample_before(const float va, const int ia, const float vb, const int ib) {
    return va > vb || (va == vb && ia < ib);
}

static __global__ void __launch_bounds__(SFI_SAMPLE_THREADS) sfi_sample_kernel(
        const float * __restrict__ logits, const int32_t * __restrict__ cand, const float * __restrict__ u,
        float * __restrict__ dst, const int n_vocab, const int k, const int k_pow2,
        const size_t s_logits, const size_t s_u, const float top_p, const float min_p, const float temp) {
    const int row  = blockIdx.x;
    const int lane = threadIdx.x % WARP_SIZE;
    const int warp = threadIdx.x / WARP_SIZE;

    const float   * x  = logits + row*s_logits;
    const int32_t * ids = cand + (size_t) row*k;

    __shared__ float c_val[GGML_SFI_SAMPLE_MAX_K];
    __shared__ int   c_id [GGML_SFI_SAMPLE_MAX_K];
    __shared__ float w_max[WARP_SIZE];
    __shared__ float w_sum[WARP_SIZE];

    // the softmax's sum over the row, relative to its max (SFI_SAMPLE_LOADS loads in flight per thread: one block
    // reads a vocabulary's row)
    float m = -INFINITY;
    float s = 0.0f;
    for (int i0 = threadIdx.x; i0 < n_vocab; i0 += SFI_SAMPLE_LOADS*blockDim.x) {
        float v[SFI_SAMPLE_LOADS];
#pragma unroll
        for (int e = 0; e < SFI_SAMPLE_LOADS; ++e) {
            const int i = i0 + e*blockDim.x;
            v[e] = i < n_vocab ? x[i] : -INFINITY;
        }
#pragma unroll
        for (int e = 0; e < SFI_SAMPLE_LOADS; ++e) {
            sfi_online_add(m, s, v[e]);
        }
    }
#pragma unroll
    for (int off = WARP_SIZE/2; off > 0; off >>= 1) {
        const float m2 = __shfl_xor_sync(0xffffffff, m, off);
        const float s2 = __shfl_xor_sync(0xffffffff, s, off);
        sfi_online_merge(m, s, m2, s2);
    }
    if (lane == 0) {
        w_max[warp] = m;
        w_sum[warp] = s;
    }

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
        float mt = -INFINITY;
        float st = 0.0f;
        for (int w = 0; w < (int) (blockDim.x/WARP_SIZE); ++w) {
            sfi_online_merge(mt, st, w_max[w], w_sum[w]);
        }
        const int pick = ggml_sfi_sample_pick(c_val, k, top_p, min_p, temp, u[row*s_u]);
        dst[2*row + 0] = (float) c_id[pick];
        dst[2*row + 1] = 1.0f/st;
    }
}

bool ggml_cuda_sfi_sample_supported(const ggml_tensor * op) {
    const ggml_tensor * logits = op->src[0];
    const ggml_tensor * cand   = op->src[1];
    return cand->ne[0] <= GGML_SFI_SAMPLE_MAX_K && logits->ne[0] <= INT_MAX && logits->ne[1] <= INT_MAX;
}

void ggml_cuda_op_sfi_sample(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * logits = dst->src[0];
    const ggml_tensor * cand   = dst->src[1];
    const ggml_tensor * u      = dst->src[2];

    GGML_ASSERT(ggml_cuda_sfi_sample_supported(dst) && ggml_is_contiguous(dst));

    const int k = (int) cand->ne[0];
    int k_pow2 = 1;
    while (k_pow2 < k) {
        k_pow2 *= 2;
    }

    sfi_sample_kernel<<<(int) logits->ne[1], SFI_SAMPLE_THREADS, 0, ctx.stream()>>>(
        (const float *) logits->data, (const int32_t *) cand->data, (const float *) u->data, (float *) dst->data,
        (int) logits->ne[0], k, k_pow2, logits->nb[1]/sizeof(float), u->nb[1]/sizeof(float),
        ggml_get_op_params_f32(dst, 0), ggml_get_op_params_f32(dst, 1), ggml_get_op_params_f32(dst, 2));
    CUDA_CHECK(cudaGetLastError());
}
