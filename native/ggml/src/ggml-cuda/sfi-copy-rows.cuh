#pragma once

#include "common.cuh"

// ggml_sfi_copy_rows (see ggml-sfi.h)
void ggml_cuda_op_sfi_copy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_copy_rows_supported(const ggml_tensor * op);
