#pragma once

// ggml ops of Slow-Fast Inference (SFI): the slow step's attention evidence, fused

#include "ggml.h"

#ifdef  __cplusplus
extern "C" {
#endif

    // The SFI evidence of each cell for each KV head: the attention probabilities of the query rows of the head's
    // GQA group, raised to alpha and summed over the rows,
    //   evidence[c, h, b] = sum_j softmax_c(mask[c, j % n_rows, 0, b % nm] + s(j, c))^alpha,
    //   s(j, c) = q[:, j, h, b] . k[:, c, h, b], or softcap*tanh(q . k) when softcap > 0,
    // the same values as soft_max_ext(mul_mat(k, q), mask) followed by the power and the sum, without the
    // [n_kv, n_q] probabilities of every row in a graph tensor: each key is read once.
    //
    // With key_norms, also the norm ||k[:, c, h, b]|| of every key, from the same read of the keys.
    //
    // q:    F32 [n_embd, n_q, n_head_kv, nb]  the query rows of each KV head, scaled (row j is token row j % n_rows)
    // k:    [n_embd, n_kv, n_head_kv, nb]     any type with to_float (F32, F16, Q8_0 ...), any strides
    // mask: F16 or F32 [n_kv, n_rows, 1, nm]  nb % nm == 0; -INFINITY excludes a cell
    // res:  F32 [n_kv, n_head_kv, nb, 1 + key_norms]: res[:, :, :, 0] the evidence; with key_norms, res[:, :, :, 1]
    //       holds the norms head by head within a cell, [n_head_kv, n_kv, nb] (ggml_sfi_evidence_key_norms), the rows
    //       a gather of cells reads
    //
    // alpha > 0; a row whose cells are all excluded adds nothing
    GGML_API struct ggml_tensor * ggml_sfi_evidence(
            struct ggml_context * ctx,
            struct ggml_tensor  * q,
            struct ggml_tensor  * k,
            struct ggml_tensor  * mask,
            int                   n_rows,
            float                 alpha,
            float                 softcap,
            bool                  key_norms);

    // views of a ggml_sfi_evidence result: the evidence F32 [n_kv, n_head_kv, nb], and the key norms F32
    // [n_head_kv, n_kv, nb] (the op computed them: key_norms)
    GGML_API struct ggml_tensor * ggml_sfi_evidence_values(struct ggml_context * ctx, struct ggml_tensor * res);
    GGML_API struct ggml_tensor * ggml_sfi_evidence_key_norms(struct ggml_context * ctx, struct ggml_tensor * res);

    // The indices of the k largest values of each row of a, in increasing order of index; of the values equal to the
    // k-th largest, those of the lowest indices. A selection (radix select on CUDA), not a sort.
    //
    // a:   F32 [n, ne1, ne2, ne3], rows contiguous, no NaN (-0 and +0 are one value)
    // res: I32 [k, ne1, ne2, ne3], 0 < k <= n
    GGML_API struct ggml_tensor * ggml_sfi_top_k(
            struct ggml_context * ctx,
            struct ggml_tensor  * a,
            int                   k);

#ifdef  __cplusplus
}
#endif
