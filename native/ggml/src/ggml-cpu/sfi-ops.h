#pragma once

// CPU forward of the SFI ops (see ggml-sfi.h); the reference the other backends are tested against

#include "ggml.h"

#include <stddef.h>

#ifdef __cplusplus
extern "C" {
#endif

struct ggml_compute_params;

// bytes of work buffer a node of an SFI op takes with n_tasks threads
size_t ggml_sfi_op_work_size(const struct ggml_tensor * node, int n_tasks);

void ggml_compute_forward_sfi_evidence(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_top_k   (const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_candidate_scores(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_candidate_values(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_copy_rows       (const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_flash_attn_evidence(const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_selector_scores   (const struct ggml_compute_params * params, struct ggml_tensor * dst);
void ggml_compute_forward_sfi_sample            (const struct ggml_compute_params * params, struct ggml_tensor * dst);

#ifdef __cplusplus
}
#endif
