// ggml_sfi_selector_scores: a block per (head, batch) row, its candidates strided over the threads (each thread
// keeps its own candidates from pass to pass: the row's prior logits, then d, stay in dst between the reductions),
// then a thread per (candidate, batch) for the cross-head term

#include "sfi-selector-scores.cuh"

#include "ggml-sfi.h"

#include <cfloat>

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
