#pragma once

#include "common.cuh"

// ggml_sfi_candidate_values (see ggml-sfi.h)
void ggml_cuda_op_sfi_candidate_values(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_candidate_values_supported(const ggml_tensor * op);
