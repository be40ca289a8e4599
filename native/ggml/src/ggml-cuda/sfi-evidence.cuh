#pragma once

#include "common.cuh"

// ggml_sfi_evidence (see ggml-sfi.h)
void ggml_cuda_op_sfi_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_evidence_supported(const ggml_tensor * op);

// the evidence's last kernel, which ggml_sfi_flash_attn_evidence shares: per cell of nbl (head, batch) pairs, batches
// b0 .. b0+nbl-1, the sum over the n_q rows of exp(alpha*(s - max))*sum^-alpha = p^alpha, from the rows' scores
// [pair][n_q][n_kv] and (max, sum^-alpha) [pair][n_q] (max -INFINITY: a row without cells); into
// dst[((b0 + bl)*n_head_kv + h)*n_kv + c]
void ggml_cuda_sfi_evidence_sum(const float * scores, const float2 * stats, float * dst, int n_q, int n_kv, int n_head_kv, int b0,
        int nbl, float alpha, cudaStream_t stream);
