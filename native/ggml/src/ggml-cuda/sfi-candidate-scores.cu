// ggml_sfi_candidate_scores over chunks of SFI_CAND_CHUNK cells of each (head, batch) row, so that a long row spreads
// over the GPU: per chunk the largest kept evidence (its log is the row's largest log-evidence), then per chunk, in
// tiles of SFI_CAND_TILE cells (the pool's halo in shared memory), the pooled weights of the kept cells, written to the
// head's plane, and their sum; a last kernel scales each head's plane by 1/(the row's sum) and adds the heads up per cell

#include "sfi-candidate-scores.cuh"

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

bool ggml_cuda_sfi_candidate_scores_supported(const ggml_tensor * op) {
    const int pool = ggml_get_op_params_i32(op, 1);
    return (pool > 1 ? pool/2 : 0) <= SFI_CAND_HALF_MAX && op->ne[1] <= 65535;
}

void ggml_cuda_op_sfi_candidate_scores(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * evid = dst->src[0];
    const ggml_tensor * mask = dst->src[1];

    GGML_ASSERT(ggml_cuda_sfi_candidate_scores_supported(dst));
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
