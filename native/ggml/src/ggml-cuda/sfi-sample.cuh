#pragma once

#include "common.cuh"

// ggml_sfi_sample (see ggml-sfi.h)
void ggml_cuda_op_sfi_sample(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_sample_supported(const ggml_tensor * op);
