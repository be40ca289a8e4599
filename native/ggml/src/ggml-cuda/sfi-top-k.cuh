#pragma once

#include "common.cuh"

// ggml_sfi_top_k (see ggml-sfi.h)
void ggml_cuda_op_sfi_top_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_top_k_supported(const ggml_tensor * op);
