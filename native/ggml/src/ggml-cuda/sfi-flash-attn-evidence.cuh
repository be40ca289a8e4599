#pragma once

#include "common.cuh"

// ggml_sfi_flash_attn_evidence (see ggml-sfi.h)
void ggml_cuda_op_sfi_flash_attn_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_flash_attn_evidence_supported(const ggml_tensor * op);
