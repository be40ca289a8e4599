// ggml_sfi_candidate_values: a thread per (candidate, batch)

#include "sfi-candidate-values.cuh"

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

bool ggml_cuda_sfi_candidate_values_supported(const ggml_tensor * op) {
    return op->src[0]->ne[1] <= 65535;
}

void ggml_cuda_op_sfi_candidate_values(ggml_backend_cuda_context & ctx, ggml_tensor * dst) {
    const ggml_tensor * cs    = dst->src[0];
    const ggml_tensor * u     = dst->src[1];
    const ggml_tensor * mask  = dst->src[2];
    const ggml_tensor * cells = dst->src[3];

    GGML_ASSERT(ggml_cuda_sfi_candidate_values_supported(dst));
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
