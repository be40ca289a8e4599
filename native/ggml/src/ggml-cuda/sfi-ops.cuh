#include "common.cuh"

// SFI ops (see ggml-sfi.h)
void ggml_cuda_op_sfi_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_evidence_supported(const ggml_tensor * op);
void ggml_cuda_op_sfi_top_k(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_top_k_supported(const ggml_tensor * op);
void ggml_cuda_op_sfi_candidate_scores(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
void ggml_cuda_op_sfi_candidate_values(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_candidate_supported(const ggml_tensor * op);
void ggml_cuda_op_sfi_copy_rows(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_copy_rows_supported(const ggml_tensor * op);
void ggml_cuda_op_sfi_flash_attn_evidence(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_flash_attn_evidence_supported(const ggml_tensor * op);
void ggml_cuda_op_sfi_selector_scores(ggml_backend_cuda_context & ctx, ggml_tensor * dst);
bool ggml_cuda_sfi_selector_scores_supported(const ggml_tensor * op);
