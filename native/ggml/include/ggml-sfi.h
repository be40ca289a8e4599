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
    // k:    [n_embd, n_kv, n_head_kv, nb]     any type with to_float (F32, F16, Q8_0 ...), any strides (CUDA: F16, Q8_0
    //                                         or Q4_0, n_embd 64, 128 or 256)
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

    // Flash attention that also gives every cell's SFI evidence and key norm, from one read of the keys: the output of
    // ggml_flash_attn_ext(q, k, v, mask, scale, 0, softcap), and ggml_sfi_evidence's values over all the query rows of
    // each KV head's GQA group (row j = g*n_tokens + t of query head h*G + g at token t, scaled as the attention scales).
    // The scores are ggml_sfi_evidence's (the scaled queries rounded to the keys' products, e.g. F16), so the output
    // equals ggml_flash_attn_ext's up to rounding.
    //
    // q:    F32 [D, n_tokens, n_head, ns]   ggml_flash_attn_ext's q (any strides), n_head % n_head_kv == 0
    // k:    [D, n_kv, n_head_kv, ns]         any type with to_float, any strides; v: [D_v, n_kv, n_head_kv, ns] likewise
    //                                        (CUDA: k and v of one type, F16, Q8_0 or Q4_0, D = D_v 64, 128 or 256)
    // mask: F16 [n_kv, >= n_tokens, 1, nm]   ns % nm == 0; -INFINITY excludes a cell
    // res:  F32, read through the views below: the output [D_v, n_head, n_tokens, ns] (ggml_flash_attn_ext's layout),
    //       the evidence [n_kv, n_head_kv, ns], and with key_norms the norms [n_head_kv, n_kv, ns]
    GGML_API struct ggml_tensor * ggml_sfi_flash_attn_evidence(
            struct ggml_context * ctx,
            struct ggml_tensor  * q,
            struct ggml_tensor  * k,
            struct ggml_tensor  * v,
            struct ggml_tensor  * mask,
            float                 scale,
            float                 softcap,
            float                 alpha,
            bool                  key_norms);

    GGML_API struct ggml_tensor * ggml_sfi_flash_attn_evidence_output   (struct ggml_context * ctx, struct ggml_tensor * res);
    GGML_API struct ggml_tensor * ggml_sfi_flash_attn_evidence_values   (struct ggml_context * ctx, struct ggml_tensor * res);
    GGML_API struct ggml_tensor * ggml_sfi_flash_attn_evidence_key_norms(struct ggml_context * ctx, struct ggml_tensor * res);

    // views of a ggml_sfi_evidence result: the evidence F32 [n_kv, n_head_kv, nb], and the key norms F32
    // [n_head_kv, n_kv, nb] (the op computed them: key_norms)
    GGML_API struct ggml_tensor * ggml_sfi_evidence_values(struct ggml_context * ctx, struct ggml_tensor * res);
    GGML_API struct ggml_tensor * ggml_sfi_evidence_key_norms(struct ggml_context * ctx, struct ggml_tensor * res);

    // The device Selector's candidate stage over the evidence of each (KV head, batch) row: the evidence normalised
    // over the cells the mask keeps, f = e^(1/alpha) / sum e^(1/alpha), then (pool_window > 1) the max of f over the
    // pool_window/2 cells on each side, kept cells only, normalised again; and each cell's score, the sum of f over
    // the heads plus the mask:
    //   res[c, b, 1 + h] = f[c, h, b],   res[c, b, 0] = sum_h f[c, h, b] + mask[c, b % ns]
    // the same values as soft_max_ext(log(evid), mask, 1/alpha), pool_2d (max), the renormalisation and the head sum
    // of composite ops, from two reads of the evidence.
    //
    // evid: F32 [n_kv, 1, n_head, nb] contiguous, >= 0
    // mask: F32 [n_kv, 1, 1, ns] contiguous, 0 (kept) or -INFINITY (not), nb % ns == 0
    // res:  F32 [n_kv, nb, 1 + n_head]; a row of no kept cell (or no evidence) has f 0
    GGML_API struct ggml_tensor * ggml_sfi_candidate_scores(
            struct ggml_context * ctx,
            struct ggml_tensor  * evid,
            struct ggml_tensor  * mask,
            float                 alpha,
            int                   pool_window);

    // What the Selector reads of each candidate, gathered: f of every head, then u and the mask, at the cells chosen
    //   res[i, h, b] = cs[cells[i, b], b, 1 + h] (h < n_head),  res[i, n_head, b] = u[cells[i, b], b % ns],
    //   res[i, n_head + 1, b] = mask[cells[i, b], b % ns]
    //
    // cs:    a ggml_sfi_candidate_scores result [n_kv, nb, 1 + n_head]
    // u:     F32, n_kv*ns values, contiguous (cell c of stream s at s*n_kv + c); mask likewise
    // cells: I32 [n_cand, nb], each in [0, n_kv)
    // res:   F32 [n_cand, n_head + 2, nb]
    GGML_API struct ggml_tensor * ggml_sfi_candidate_values(
            struct ggml_context * ctx,
            struct ggml_tensor  * cs,
            struct ggml_tensor  * u,
            struct ggml_tensor  * mask,
            struct ggml_tensor  * cells);

    // The indices of the k largest values of each row of a, in increasing order of index; of the values equal to the
    // k-th largest, those of the lowest indices. A selection (radix select on CUDA), not a sort.
    //
    // a:   F32 [n, ne1, ne2, ne3], rows contiguous, no NaN (-0 and +0 are one value)
    // res: I32 [k, ne1, ne2, ne3], 0 < k <= n
    GGML_API struct ggml_tensor * ggml_sfi_top_k(
            struct ggml_context * ctx,
            struct ggml_tensor  * a,
            int                   k);

    // ggml_sfi_top_k's indices mapped through ids, the rows of ids broadcast over a's rows:
    //   res[j, i1, i2, i3] = ids[top_k[j, i1, i2, i3], i2, i3]
    // (e.g. the cells of the picks among each pair's candidates, without a gather after the selection)
    //
    // ids: I32 [n, ne2, ne3] contiguous
    GGML_API struct ggml_tensor * ggml_sfi_top_k_ids(
            struct ggml_context * ctx,
            struct ggml_tensor  * a,
            int                   k,
            struct ggml_tensor  * ids);

    // Rows copied as they are: dst[:, slots[i], j, l] = src[:, idx[i, j, l], j, l], whole rows of bytes of any type,
    // the gather of get_rows then set_rows without F32 rows between them (and without the dequantize / quantize of a
    // quantized cache). In place: the result is a view of dst.
    //
    // dst:   [ne0, n_dst, ne2, ne3], rows contiguous, any strides
    // src:   [ne0, n_src, ne2, ne3] of the type of dst, rows contiguous, any strides
    // idx:   I32 [n, ne2, ne3], any strides, each in [0, n_src)
    // slots: I64 [n] contiguous, each in [0, n_dst)
    GGML_API struct ggml_tensor * ggml_sfi_copy_rows(
            struct ggml_context * ctx,
            struct ggml_tensor  * dst,
            struct ggml_tensor  * src,
            struct ggml_tensor  * idx,
            struct ggml_tensor  * slots);

    // The device Selector's scores of its candidates (sfi_gguf/selector.py, SFISelector), from what
    // ggml_sfi_candidate_values gathered and the candidates' key norms: for each (head h, batch b) row of candidates i,
    //   f_i     = vals[i, h, b] / sum_i vals[i, h, b]                                    (0 where the sum is 0)
    //   prior_i = w_pos*(-pos_beta*u_i^pos_power + pos_eta*log(1 - u_i)) + m_i,  u_i = vals[i, n_head, b],
    //             m_i = vals[i, n_head + 1, b] (0 or -INFINITY), u^p = exp(p*log(u)) (0 at u = 0)
    //   r       = softmax_i(key_norm_exponent*log(clamp(kn_i, FLT_MIN, FLT_MAX)) + prior_i)
    //   d       = f - r,  lambda = clamp(<f, d>/(<d, d> + 1e-30), 0, lambda_max)
    //   s_i     = log(clamp(f_i - lambda*d_i, FLT_MIN, FLT_MAX))
    // and, where cross_head_alpha != 0, per candidate over the heads: s += cross_head_alpha*log softmax_h(s/T),
    // T = cross_head_temperature. The same values as the chain of composite ops it replaces, in one pass per row.
    //
    // vals:  F32 [n_cand, n_head + 2, nb] contiguous (ggml_sfi_candidate_values' layout)
    // kn:    F32 [n_head, n_kn, nb] contiguous: the key norms of a cell, head by head; with cells, row cells[i, b] is
    //        candidate i's (n_kn: all the cells), else row i (n_kn = n_cand)
    // cells: I32 [n_cand, nb] contiguous, each in [0, n_kn), or NULL
    // res:   F32 [n_cand, n_head, nb]; no NaN while each row has a candidate of m 0
    struct ggml_sfi_selector_params {
        float key_norm_exponent;
        float w_pos;
        float pos_beta;
        float pos_power;
        float pos_eta;
        float lambda_max;
        float cross_head_alpha;       // 0: no cross-head term
        float cross_head_temperature; // > 0
    };

    GGML_API struct ggml_tensor * ggml_sfi_selector_scores(
            struct ggml_context * ctx,
            struct ggml_tensor  * vals,
            struct ggml_tensor  * kn,
            struct ggml_tensor  * cells,
            struct ggml_sfi_selector_params params);

    // A token sampled from each row of logits, as llama.cpp's host samplers top-k, top-p (min_keep 1), min-p (min_keep
    // 1), temperature and dist pick it, with the top-1 probability of the row's softmax (what SFI's trigger reads): with
    // ggml_sfi_top_k's candidates, two ops in place of those samplers' ~40 small ones in a graph (a sort of the
    // vocabulary among them). Over the candidates c, sorted largest logit first (equal logits: the smaller id first):
    //   top-p  (top_p < 1): the first n of c whose probabilities under softmax(c) sum to >= top_p
    //   min-p  (min_p > 0): of those, the ones with logit >= c_0 + log(min_p)
    //   dist:  the first of the kept logits, divided by temp, whose running sum of exp(l/temp - c_0/temp) reaches u
    //          times their sum (ggml_sfi_sample_pick in ggml-sfi-sample.h writes it out)
    //
    // logits: F32 [n_vocab, n_rows], rows contiguous, no NaN
    // cand:   I32 [k, n_rows] contiguous: the ids of the row's k largest logits in any order (ggml_sfi_top_k), k >= 1
    //         (CUDA: k <= GGML_SFI_SAMPLE_MAX_K)
    // u:      F32 [1, n_rows]: a uniform draw in [0, 1) per row
    // res:    F32 [2, n_rows]: the token id (an integer, exact in F32) and 1/sum_v exp(logit_v - max_v logit_v)
    // temp > 0
#define GGML_SFI_SAMPLE_MAX_K 1024

    GGML_API struct ggml_tensor * ggml_sfi_sample(
            struct ggml_context * ctx,
            struct ggml_tensor  * logits,
            struct ggml_tensor  * cand,
            struct ggml_tensor  * u,
            float                 top_p,
            float                 min_p,
            float                 temp);

    // The same op without candidates: the greedy pick, the row's largest logit (the smaller id among equal ones, as
    // llama.cpp's greedy sampler picks), with the top-1 probability; one op in place of a softmax, an argmax and a
    // get_rows over the vocabulary. res as ggml_sfi_sample's.
    GGML_API struct ggml_tensor * ggml_sfi_greedy(
            struct ggml_context * ctx,
            struct ggml_tensor  * logits);

#ifdef  __cplusplus
}
#endif
