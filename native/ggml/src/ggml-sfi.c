// ggml ops of Slow-Fast Inference (SFI): graph constructors (see ggml-sfi.h)

#include "ggml-sfi.h"
#include "ggml-impl.h"

struct ggml_tensor * ggml_sfi_evidence(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * mask,
        int                   n_rows,
        float                 alpha,
        float                 softcap,
        bool                  key_norms) {
    GGML_ASSERT(q->type == GGML_TYPE_F32);
    GGML_ASSERT(mask->type == GGML_TYPE_F16 || mask->type == GGML_TYPE_F32);
    GGML_ASSERT(q->ne[0] == k->ne[0]);
    GGML_ASSERT(q->ne[2] == k->ne[2] && q->ne[3] == k->ne[3]);
    GGML_ASSERT(n_rows > 0 && q->ne[1] % n_rows == 0);
    GGML_ASSERT(mask->ne[0] == k->ne[1] && mask->ne[1] == n_rows && mask->ne[2] == 1);
    GGML_ASSERT(q->ne[3] % mask->ne[3] == 0);
    GGML_ASSERT(alpha > 0.0f && softcap >= 0.0f);

    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, k->ne[1], k->ne[2], k->ne[3], key_norms ? 2 : 1);

    int32_t params[4] = { n_rows, 0, 0, key_norms };
    memcpy(params + 1, &alpha,   sizeof(float));
    memcpy(params + 2, &softcap, sizeof(float));
    ggml_set_op_params(result, params, sizeof(params));

    result->op     = GGML_OP_SFI_EVIDENCE;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = mask;

    return result;
}

struct ggml_tensor * ggml_sfi_evidence_values(struct ggml_context * ctx, struct ggml_tensor * res) {
    GGML_ASSERT(res->op == GGML_OP_SFI_EVIDENCE);
    return ggml_view_3d(ctx, res, res->ne[0], res->ne[1], res->ne[2], res->nb[1], res->nb[2], 0);
}

struct ggml_tensor * ggml_sfi_evidence_key_norms(struct ggml_context * ctx, struct ggml_tensor * res) {
    GGML_ASSERT(res->op == GGML_OP_SFI_EVIDENCE && res->ne[3] == 2);
    const size_t row = res->ne[1]*sizeof(float); // the heads of a cell
    return ggml_view_3d(ctx, res, res->ne[1], res->ne[0], res->ne[2], row, row*res->ne[0], res->nb[3]);
}

struct ggml_tensor * ggml_sfi_candidate_scores(
        struct ggml_context * ctx,
        struct ggml_tensor  * evid,
        struct ggml_tensor  * mask,
        float                 alpha,
        int                   pool_window) {
    GGML_ASSERT(evid->type == GGML_TYPE_F32 && mask->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_contiguous(evid) && ggml_is_contiguous(mask));
    GGML_ASSERT(evid->ne[1] == 1 && mask->ne[0] == evid->ne[0] && mask->ne[1] == 1 && mask->ne[2] == 1);
    GGML_ASSERT(evid->ne[3] % mask->ne[3] == 0);
    GGML_ASSERT(alpha > 0.0f && pool_window >= 0);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, evid->ne[0], evid->ne[3], 1 + evid->ne[2]);

    int32_t params[2] = { 0, pool_window };
    memcpy(params, &alpha, sizeof(float));
    ggml_set_op_params(result, params, sizeof(params));

    result->op     = GGML_OP_SFI_CANDIDATE_SCORES;
    result->src[0] = evid;
    result->src[1] = mask;

    return result;
}

struct ggml_tensor * ggml_sfi_candidate_values(
        struct ggml_context * ctx,
        struct ggml_tensor  * cs,
        struct ggml_tensor  * u,
        struct ggml_tensor  * mask,
        struct ggml_tensor  * cells) {
    GGML_ASSERT(cs->op == GGML_OP_SFI_CANDIDATE_SCORES && cs->ne[2] >= 2);
    GGML_ASSERT(u->type == GGML_TYPE_F32 && mask->type == GGML_TYPE_F32 && cells->type == GGML_TYPE_I32);
    GGML_ASSERT(ggml_is_contiguous(u) && ggml_is_contiguous(mask) && ggml_is_contiguous(cells));
    GGML_ASSERT(ggml_nelements(u) == ggml_nelements(mask) && ggml_nelements(mask) % cs->ne[0] == 0);
    GGML_ASSERT(cs->ne[1] % (ggml_nelements(mask)/cs->ne[0]) == 0);
    GGML_ASSERT(cells->ne[1] == cs->ne[1] && cells->ne[2] == 1 && cells->ne[3] == 1);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, cells->ne[0], cs->ne[2] + 1, cs->ne[1]);

    result->op     = GGML_OP_SFI_CANDIDATE_VALUES;
    result->src[0] = cs;
    result->src[1] = u;
    result->src[2] = mask;
    result->src[3] = cells;

    return result;
}

struct ggml_tensor * ggml_sfi_top_k(
        struct ggml_context * ctx,
        struct ggml_tensor  * a,
        int                   k) {
    GGML_ASSERT(a->type == GGML_TYPE_F32);
    GGML_ASSERT(a->nb[0] == sizeof(float) && a->nb[1] == a->ne[0]*sizeof(float));
    GGML_ASSERT(k > 0 && k <= a->ne[0]);

    struct ggml_tensor * result = ggml_new_tensor_4d(ctx, GGML_TYPE_I32, k, a->ne[1], a->ne[2], a->ne[3]);

    result->op     = GGML_OP_SFI_TOP_K;
    result->src[0] = a;

    return result;
}

struct ggml_tensor * ggml_sfi_top_k_ids(
        struct ggml_context * ctx,
        struct ggml_tensor  * a,
        int                   k,
        struct ggml_tensor  * ids) {
    GGML_ASSERT(ids->type == GGML_TYPE_I32 && ggml_is_contiguous(ids));
    GGML_ASSERT(ids->ne[0] == a->ne[0] && ids->ne[1] == a->ne[2] && ids->ne[2] == a->ne[3] && ids->ne[3] == 1);

    struct ggml_tensor * result = ggml_sfi_top_k(ctx, a, k);
    result->src[1] = ids;

    return result;
}

struct ggml_tensor * ggml_sfi_copy_rows(
        struct ggml_context * ctx,
        struct ggml_tensor  * dst,
        struct ggml_tensor  * src,
        struct ggml_tensor  * idx,
        struct ggml_tensor  * slots) {
    GGML_ASSERT(dst->type == src->type);
    GGML_ASSERT(idx->type == GGML_TYPE_I32 && slots->type == GGML_TYPE_I64 && ggml_is_contiguous(slots));
    GGML_ASSERT(dst->ne[0] == src->ne[0] && dst->ne[2] == src->ne[2] && dst->ne[3] == src->ne[3]);
    GGML_ASSERT(idx->ne[0] == ggml_nelements(slots) && idx->ne[1] == src->ne[2] && idx->ne[2] == src->ne[3] && idx->ne[3] == 1);
    GGML_ASSERT(ggml_is_contiguous_rows(dst) && ggml_is_contiguous_rows(src));

    struct ggml_tensor * result = ggml_view_tensor(ctx, dst);

    result->op     = GGML_OP_SFI_COPY_ROWS;
    result->src[0] = dst;
    result->src[1] = src;
    result->src[2] = idx;
    result->src[3] = slots;

    return result;
}

// the sections of a ggml_sfi_flash_attn_evidence result, in floats: the output, the evidence (the key norms as many)
static int64_t sfi_fae_n_out(const struct ggml_tensor * q, const struct ggml_tensor * v) {
    return v->ne[0]*q->ne[2]*q->ne[1]*q->ne[3];
}

static int64_t sfi_fae_n_evid(const struct ggml_tensor * k) {
    return k->ne[1]*k->ne[2]*k->ne[3];
}

struct ggml_tensor * ggml_sfi_flash_attn_evidence(
        struct ggml_context * ctx,
        struct ggml_tensor  * q,
        struct ggml_tensor  * k,
        struct ggml_tensor  * v,
        struct ggml_tensor  * mask,
        float                 scale,
        float                 softcap,
        float                 alpha,
        bool                  key_norms) {
    GGML_ASSERT(q->type == GGML_TYPE_F32 && mask->type == GGML_TYPE_F16);
    GGML_ASSERT(q->ne[0] == k->ne[0] && k->ne[1] == v->ne[1] && k->ne[2] == v->ne[2] && k->ne[3] == v->ne[3]);
    GGML_ASSERT(q->ne[2] % k->ne[2] == 0 && q->ne[3] == k->ne[3]);
    GGML_ASSERT(mask->ne[0] == k->ne[1] && mask->ne[1] >= q->ne[1] && mask->ne[2] == 1 && q->ne[3] % mask->ne[3] == 0);
    GGML_ASSERT(alpha > 0.0f && softcap >= 0.0f);

    struct ggml_tensor * result = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, sfi_fae_n_out(q, v) + sfi_fae_n_evid(k)*(key_norms ? 2 : 1));

    int32_t params[4] = { 0, 0, 0, key_norms };
    memcpy(params + 0, &scale,   sizeof(float));
    memcpy(params + 1, &softcap, sizeof(float));
    memcpy(params + 2, &alpha,   sizeof(float));
    ggml_set_op_params(result, params, sizeof(params));

    result->op     = GGML_OP_SFI_FLASH_ATTN_EVIDENCE;
    result->src[0] = q;
    result->src[1] = k;
    result->src[2] = v;
    result->src[3] = mask;

    return result;
}

struct ggml_tensor * ggml_sfi_flash_attn_evidence_output(struct ggml_context * ctx, struct ggml_tensor * res) {
    GGML_ASSERT(res->op == GGML_OP_SFI_FLASH_ATTN_EVIDENCE);
    const struct ggml_tensor * q = res->src[0];
    const struct ggml_tensor * v = res->src[2];
    const size_t nb1 = v->ne[0]*sizeof(float);
    return ggml_view_4d(ctx, res, v->ne[0], q->ne[2], q->ne[1], q->ne[3], nb1, nb1*q->ne[2], nb1*q->ne[2]*q->ne[1], 0);
}

struct ggml_tensor * ggml_sfi_flash_attn_evidence_values(struct ggml_context * ctx, struct ggml_tensor * res) {
    GGML_ASSERT(res->op == GGML_OP_SFI_FLASH_ATTN_EVIDENCE);
    const struct ggml_tensor * k = res->src[1];
    const size_t nb1 = k->ne[1]*sizeof(float);
    return ggml_view_3d(ctx, res, k->ne[1], k->ne[2], k->ne[3], nb1, nb1*k->ne[2], sfi_fae_n_out(res->src[0], res->src[2])*sizeof(float));
}

struct ggml_tensor * ggml_sfi_flash_attn_evidence_key_norms(struct ggml_context * ctx, struct ggml_tensor * res) {
    GGML_ASSERT(res->op == GGML_OP_SFI_FLASH_ATTN_EVIDENCE && ggml_get_op_params_i32(res, 3));
    const struct ggml_tensor * k = res->src[1];
    const size_t nb1 = k->ne[2]*sizeof(float);
    return ggml_view_3d(ctx, res, k->ne[2], k->ne[1], k->ne[3], nb1, nb1*k->ne[1],
            (sfi_fae_n_out(res->src[0], res->src[2]) + sfi_fae_n_evid(k))*sizeof(float));
}

struct ggml_tensor * ggml_sfi_selector_scores(
        struct ggml_context * ctx,
        struct ggml_tensor  * vals,
        struct ggml_tensor  * kn,
        struct ggml_tensor  * cells,
        struct ggml_sfi_selector_params params) {
    const int64_t n_cand = vals->ne[0];
    const int64_t n_head = vals->ne[1] - 2;
    const int64_t nb     = vals->ne[2];

    GGML_ASSERT(vals->type == GGML_TYPE_F32 && kn->type == GGML_TYPE_F32);
    GGML_ASSERT(ggml_is_contiguous(vals) && ggml_is_contiguous(kn) && vals->ne[3] == 1);
    GGML_ASSERT(n_head >= 1 && kn->ne[0] == n_head && kn->ne[2] == nb && kn->ne[3] == 1);
    if (cells) {
        GGML_ASSERT(cells->type == GGML_TYPE_I32 && ggml_is_contiguous(cells));
        GGML_ASSERT(cells->ne[0] == n_cand && cells->ne[1] == nb && cells->ne[2] == 1 && cells->ne[3] == 1);
    } else {
        GGML_ASSERT(kn->ne[1] == n_cand);
    }
    GGML_ASSERT(params.cross_head_temperature > 0.0f && params.lambda_max >= 0.0f);

    struct ggml_tensor * result = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, n_cand, n_head, nb);

    ggml_set_op_params(result, &params, sizeof(params));

    result->op     = GGML_OP_SFI_SELECTOR_SCORES;
    result->src[0] = vals;
    result->src[1] = kn;
    result->src[2] = cells;

    return result;
}

struct ggml_tensor * ggml_sfi_sample(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits,
        struct ggml_tensor  * cand,
        struct ggml_tensor  * u,
        float                 top_p,
        float                 min_p,
        float                 temp) {
    const int64_t n_rows = logits->ne[1];

    GGML_ASSERT(logits->type == GGML_TYPE_F32 && cand->type == GGML_TYPE_I32 && u->type == GGML_TYPE_F32);
    GGML_ASSERT(logits->nb[0] == sizeof(float) && logits->ne[2] == 1 && logits->ne[3] == 1);
    GGML_ASSERT(ggml_is_contiguous(cand) && cand->ne[0] >= 1 && cand->ne[0] <= logits->ne[0] && cand->ne[1] == n_rows);
    GGML_ASSERT(cand->ne[2] == 1 && cand->ne[3] == 1);
    GGML_ASSERT(u->ne[0] == 1 && u->ne[1] == n_rows && u->ne[2] == 1 && u->ne[3] == 1);
    GGML_ASSERT(temp > 0.0f);

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 2, n_rows);

    const float params[3] = { top_p, min_p, temp };
    ggml_set_op_params(result, params, sizeof(params));

    result->op     = GGML_OP_SFI_SAMPLE;
    result->src[0] = logits;
    result->src[1] = cand;
    result->src[2] = u;

    return result;
}

struct ggml_tensor * ggml_sfi_greedy(
        struct ggml_context * ctx,
        struct ggml_tensor  * logits) {
    GGML_ASSERT(logits->type == GGML_TYPE_F32);
    GGML_ASSERT(logits->nb[0] == sizeof(float) && logits->ne[2] == 1 && logits->ne[3] == 1);

    struct ggml_tensor * result = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, 2, logits->ne[1]);

    result->op     = GGML_OP_SFI_SAMPLE; // (no candidates: the largest logit)
    result->src[0] = logits;

    return result;
}
