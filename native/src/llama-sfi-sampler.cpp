// Greedy sampling in the decode's graph, with the picked token's probability (include/llama-sfi.h)
//
// A decode step of a 4B model on a GPU takes a few milliseconds; copying its 150K logits to the host, the argmax
// over them and the softmax that gives the top-1 probability SFI's trigger reads cost a few percent of it. As a
// backend sampler (llama.cpp's backend sampling API) the argmax and the probability are three small ops at the end
// of the graph (one SFI op where the device has it), and the host reads back two numbers instead of the logits.
#include "llama-sfi.h"

#include "llama-impl.h"

#include "ggml-sfi.h"

#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

#include <algorithm>
#include <random>

struct llama_sfi_greedy {
    bool on_backend = false; // backend_init found every op on the output's device
    bool fused      = false; // ... and the graph takes the SFI op (ggml_sfi_greedy), not a softmax and an argmax
};

static const char * llama_sfi_greedy_name(const struct llama_sampler * /*smpl*/) {
    return "sfi-greedy";
}

// the host path (the sampler outside a backend chain): llama.cpp's greedy pick, the first of equal maxima
static void llama_sfi_greedy_apply(struct llama_sampler * /*smpl*/, llama_token_data_array * cur_p) {
    cur_p->selected = 0;
    for (size_t i = 1; i < cur_p->size; ++i) {
        if (cur_p->data[i].logit > cur_p->data[cur_p->selected].logit) {
            cur_p->selected = i;
        }
    }
}

static struct llama_sampler * llama_sfi_greedy_clone(const struct llama_sampler * /*smpl*/) {
    return llama_sfi_sampler_init_greedy();
}

static void llama_sfi_greedy_free(struct llama_sampler * smpl) {
    delete (llama_sfi_greedy *) smpl->ctx;
}

// logits [n_vocab] -> the argmax (I32 [1]) and its probability under softmax(logits) (F32 [1, 1])
static void llama_sfi_greedy_build(ggml_context * ctx, ggml_tensor * logits, ggml_tensor ** token, ggml_tensor ** prob) {
    const int64_t n_vocab = ggml_nelements(logits);

    ggml_tensor * row   = ggml_reshape_2d(ctx, logits, n_vocab, 1);
    ggml_tensor * probs = ggml_soft_max(ctx, row);

    *token = ggml_argmax(ctx, row);
    *prob  = ggml_get_rows(ctx, ggml_reshape_2d(ctx, probs, 1, n_vocab), *token);

    ggml_set_name(*token, "sfi_greedy_token");
    ggml_set_name(*prob,  "sfi_greedy_prob");
}

// a node that runs a kernel (not a leaf, not a view of another tensor)
static bool llama_sfi_computes(const ggml_tensor * t) {
    switch (t->op) {
        case GGML_OP_NONE:
        case GGML_OP_RESHAPE:
        case GGML_OP_VIEW:
        case GGML_OP_PERMUTE:
        case GGML_OP_TRANSPOSE:
            return false;
        default:
            return true;
    }
}

// the probe graphs' contexts: their ops, on tensors of a vocabulary's size, as the device would get them
static ggml_context * llama_sfi_probe_init(void) {
    ggml_init_params params = {
        /*.mem_size   =*/ 32*ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    return ggml_init(params);
}

static constexpr int64_t LLAMA_SFI_PROBE_VOCAB = 128*1024;

// whether the device of buft (none: the host, which runs everything) runs every node of the probe ctx that runs a
// kernel; frees ctx. what: the picks, for the warning (where warn: a device that lacks what an alternative provides
// is no news)
static bool llama_sfi_device_runs(ggml_backend_buffer_type_t buft, ggml_context * ctx, const char * what, bool warn = true) {
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    bool ok = true;
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (dev && llama_sfi_computes(t) && !ggml_backend_dev_supports_op(dev, t)) {
            if (warn) {
                LLAMA_LOG_WARN("%s: device '%s' lacks %s: %s on the host\n", __func__, ggml_backend_dev_name(dev), ggml_op_name(t->op), what);
            }
            ok = false;
        }
    }
    ggml_free(ctx);
    return ok;
}

// whether the output's device runs the pick's ops (those of llama_sfi_greedy_build); what: the sampler, for the warning
static bool llama_sfi_greedy_ops_supported(ggml_backend_buffer_type_t buft, const char * what) {
    ggml_context * ctx = llama_sfi_probe_init();
    ggml_tensor * token = nullptr;
    ggml_tensor * prob  = nullptr;
    llama_sfi_greedy_build(ctx, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, LLAMA_SFI_PROBE_VOCAB), &token, &prob);

    return llama_sfi_device_runs(buft, ctx, what);
}

// the greedy pick as one SFI op: logits [n_vocab] -> the pick (I32 [1]) and its probability (F32 [1])
static void llama_sfi_greedy_fused_build(ggml_context * ctx, ggml_tensor * logits, ggml_tensor ** token, ggml_tensor ** prob) {
    ggml_tensor * res = ggml_sfi_greedy(ctx, ggml_reshape_2d(ctx, logits, ggml_nelements(logits), 1));

    *token = ggml_cast(ctx, ggml_view_1d(ctx, res, 1, 0), GGML_TYPE_I32);
    *prob  = ggml_view_1d(ctx, res, 1, sizeof(float));

    ggml_set_name(*token, "sfi_greedy_token");
}

// whether the graph takes the SFI op: the SFI ops on (LLAMA_SFI_FUSED) and the output's device runs it
static bool llama_sfi_greedy_fused_supported(ggml_backend_buffer_type_t buft) {
    if (!llama_sfi_default_params().fused_ops) {
        return false;
    }
    ggml_context * ctx = llama_sfi_probe_init();
    ggml_tensor * token = nullptr;
    ggml_tensor * prob  = nullptr;
    llama_sfi_greedy_fused_build(ctx, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, LLAMA_SFI_PROBE_VOCAB), &token, &prob);

    return llama_sfi_device_runs(buft, ctx, "the SFI greedy op", /*warn =*/ false); // (llama.cpp's ops then)
}

static bool llama_sfi_greedy_backend_init(struct llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t /*n_outputs_max_per_seq*/) {
    auto * sctx = (llama_sfi_greedy *) smpl->ctx;
    sctx->fused      = llama_sfi_greedy_fused_supported(buft);
    sctx->on_backend = sctx->fused || llama_sfi_greedy_ops_supported(buft, "greedy picks");
    return sctx->on_backend;
}

static void llama_sfi_greedy_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx, struct ggml_cgraph * /*gf*/, struct llama_sampler_data * data) {
    const auto * sctx = (const llama_sfi_greedy *) smpl->ctx;

    ggml_tensor * logits = ggml_reshape_1d(ctx, data->logits, ggml_nelements(data->logits));
    ggml_tensor * token  = nullptr;
    ggml_tensor * prob   = nullptr;
    if (sctx->fused) {
        llama_sfi_greedy_fused_build(ctx, logits, &token, &prob);
    } else {
        llama_sfi_greedy_build(ctx, logits, &token, &prob);
    }

    // one candidate, the pick, with its probability
    data->sampled    = token;
    data->candidates = token;
    data->probs      = ggml_reshape_1d(ctx, prob, 1);
}

static struct llama_sampler_i llama_sfi_greedy_i = {
    /* .name              = */ llama_sfi_greedy_name,
    /* .accept            = */ nullptr,
    /* .apply             = */ llama_sfi_greedy_apply,
    /* .reset             = */ nullptr,
    /* .clone             = */ llama_sfi_greedy_clone,
    /* .free              = */ llama_sfi_greedy_free,
    /* .backend_init      = */ llama_sfi_greedy_backend_init,
    /* .backend_accept    = */ nullptr,
    /* .backend_apply     = */ llama_sfi_greedy_backend_apply,
    /* .backend_set_input = */ nullptr,
    /* .backend_reset     = */ nullptr,
    /* .copy_state        = */ nullptr,
};

struct llama_sampler * llama_sfi_sampler_init_greedy(void) {
    return llama_sampler_init(&llama_sfi_greedy_i, new llama_sfi_greedy);
}

bool llama_sfi_sampler_greedy_on_backend(const struct llama_sampler * smpl) {
    return smpl && smpl->iface == &llama_sfi_greedy_i && ((const llama_sfi_greedy *) smpl->ctx)->on_backend;
}

bool llama_sfi_sampler_greedy_fused(const struct llama_sampler * smpl) {
    return llama_sfi_sampler_greedy_on_backend(smpl) && ((const llama_sfi_greedy *) smpl->ctx)->fused;
}

// Sampling in the decode's graph, with the model's confidence
//
// llama.cpp's dist sampler takes its random number from an input tensor of the graph it was built into, and fills the
// input of the last graph built; SFI keeps two graphs (a fast step's, and a slow or mixed step's) and runs
// them again without a rebuild, so that input would often be another graph's. This sampler draws from a random number
// in a buffer of its own that every graph reads and that it fills before each decode, drawn from its seed as
// llama.cpp's dist draws it on the host. Where the output's device has the SFI ops and top-k is on (1 to
// GGML_SFI_SAMPLE_MAX_K), the whole chain is two of them (ggml_sfi_top_k's candidates, ggml_sfi_sample's pick and the
// top-1 probability); elsewhere it runs llama.cpp's filters (top-k, top-p, min-p, temperature: constants in the
// graph, ~35 small ops with a sort of the vocabulary), then dist's ops and the top-1 probability's. It hands out the
// pick and, in place of the chain's probabilities, the top-1 probability of the raw logits that SFI's trigger reads.

struct llama_sfi_dist {
    int32_t top_k; // 0: off
    float   top_p;
    float   min_p;
    float   temp;
    uint32_t seed;

    llama_sampler * filters;   // owned: llama.cpp's samplers before dist
    llama_sampler * host_dist; // owned: llama.cpp's dist, for the host path (the sampler outside a backend chain)
    std::mt19937    rng;       // the backend path's draws

    // the random number of the next decode: one F32 in a buffer on the output's device
    ggml_context          * ctx_u = nullptr;
    ggml_backend_buffer_t   buf_u = nullptr;
    ggml_tensor           * u     = nullptr;

    bool on_backend = false; // backend_init found every op on the output's device, the filters' too
    bool fused      = false; // ... and the graph takes the SFI sampling ops, not the filters'

    ~llama_sfi_dist() {
        llama_sampler_free(filters);
        llama_sampler_free(host_dist);
        ggml_backend_buffer_free(buf_u);
        ggml_free(ctx_u);
    }
};

static const char * llama_sfi_dist_name(const struct llama_sampler * /*smpl*/) {
    return "sfi-dist";
}

static void llama_sfi_dist_accept(struct llama_sampler * smpl, llama_token token) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;
    llama_sampler_accept(sctx->filters, token);
    llama_sampler_accept(sctx->host_dist, token);
}

static void llama_sfi_dist_apply(struct llama_sampler * smpl, llama_token_data_array * cur_p) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;
    llama_sampler_apply(sctx->filters, cur_p);
    llama_sampler_apply(sctx->host_dist, cur_p);
}

static void llama_sfi_dist_reset(struct llama_sampler * smpl) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;
    llama_sampler_reset(sctx->filters);
    llama_sampler_reset(sctx->host_dist);
    sctx->rng.seed(sctx->seed);
}

static struct llama_sampler * llama_sfi_dist_clone(const struct llama_sampler * smpl) {
    const auto * sctx = (const llama_sfi_dist *) smpl->ctx;
    llama_sampler * result = llama_sfi_sampler_init_dist(sctx->top_k, sctx->top_p, sctx->min_p, sctx->temp, sctx->seed);
    auto * rctx = (llama_sfi_dist *) result->ctx;
    llama_sampler_free(rctx->host_dist); // (the filters hold no state: the new ones are these)
    rctx->host_dist = llama_sampler_clone(sctx->host_dist);
    rctx->rng       = sctx->rng;
    return result;
}

static void llama_sfi_dist_free(struct llama_sampler * smpl) {
    delete (llama_sfi_dist *) smpl->ctx;
}

// the filtered logits (data->logits, data->candidates) -> the pick (I32 [1]): the first candidate whose cumulative
// probability exceeds u times their sum, as llama.cpp's dist picks on the host
static ggml_tensor * llama_sfi_dist_build(ggml_context * ctx, const llama_sampler_data * data, ggml_tensor * u) {
    const int64_t n = ggml_nelements(data->logits);

    ggml_tensor * probs  = ggml_soft_max(ctx, ggml_reshape_1d(ctx, data->logits, n));
    ggml_tensor * cumsum = ggml_cumsum(ctx, probs);
    ggml_tensor * target = ggml_mul(ctx, ggml_view_1d(ctx, cumsum, 1, (n - 1)*ggml_element_size(cumsum)), u);

    // 1 where the cumulative sum is above the target: the pick is the first of them
    ggml_tensor * above = ggml_step(ctx, ggml_sub(ctx, cumsum, target));
    ggml_tensor * idxf  = ggml_clamp(ctx, ggml_sum(ctx, above), 1.0f, (float) n);
    ggml_tensor * idx   = ggml_cast(ctx, ggml_scale_bias(ctx, idxf, -1.0f, (float) n), GGML_TYPE_I32);

    ggml_tensor * token = data->candidates ?
        ggml_get_rows(ctx, ggml_reshape_2d(ctx, data->candidates, 1, ggml_nelements(data->candidates)), idx) : idx;
    ggml_set_name(token, "sfi_dist_token");
    return token;
}

// whether the output's device runs the top-1 probability's and dist's ops (the filters answer for theirs)
static bool llama_sfi_dist_ops_supported(ggml_backend_buffer_type_t buft) {
    if (!llama_sfi_greedy_ops_supported(buft, "sampling")) {
        return false;
    }

    ggml_context * ctx = llama_sfi_probe_init();
    llama_sampler_data data = { // as many candidates as a vocabulary, when no filter cuts them
        /*.logits     =*/ ggml_new_tensor_1d(ctx, GGML_TYPE_F32, LLAMA_SFI_PROBE_VOCAB),
        /*.probs      =*/ nullptr,
        /*.sampled    =*/ nullptr,
        /*.candidates =*/ ggml_new_tensor_1d(ctx, GGML_TYPE_I32, LLAMA_SFI_PROBE_VOCAB),
    };
    llama_sfi_dist_build(ctx, &data, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1));

    return llama_sfi_device_runs(buft, ctx, "sampling");
}

// the whole chain in two SFI ops: logits [n_vocab] -> the pick (I32 [1]) and the top-1 probability (F32 [1])
static void llama_sfi_sample_build(ggml_context * ctx, const llama_sfi_dist & p, ggml_tensor * logits, ggml_tensor * u,
        ggml_tensor ** token, ggml_tensor ** prob) {
    const int64_t n_vocab = ggml_nelements(logits);

    ggml_tensor * row  = ggml_reshape_2d(ctx, logits, n_vocab, 1);
    ggml_tensor * cand = ggml_sfi_top_k(ctx, row, (int) std::min<int64_t>(p.top_k, n_vocab));
    ggml_tensor * res  = ggml_sfi_sample(ctx, row, cand, ggml_reshape_2d(ctx, u, 1, 1), p.top_p, p.min_p, p.temp);

    *token = ggml_cast(ctx, ggml_view_1d(ctx, res, 1, 0), GGML_TYPE_I32);
    *prob  = ggml_view_1d(ctx, res, 1, sizeof(float));

    ggml_set_name(*token, "sfi_sample_token");
}

// whether the graph takes the fused sampling: the SFI ops on (LLAMA_SFI_FUSED), top-k on and in the op's range, and
// the output's device runs the ops
static bool llama_sfi_sample_ops_supported(const llama_sfi_dist & p, ggml_backend_buffer_type_t buft) {
    if (!llama_sfi_default_params().fused_ops || p.top_k < 1 || p.top_k > GGML_SFI_SAMPLE_MAX_K) {
        return false;
    }

    ggml_context * ctx = llama_sfi_probe_init();
    ggml_tensor * token = nullptr;
    ggml_tensor * prob  = nullptr;
    llama_sfi_sample_build(ctx, p, ggml_new_tensor_1d(ctx, GGML_TYPE_F32, LLAMA_SFI_PROBE_VOCAB),
            ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 1), &token, &prob);

    return llama_sfi_device_runs(buft, ctx, "the SFI sampling ops", /*warn =*/ false); // (llama.cpp's filters then)
}

static bool llama_sfi_dist_backend_init(struct llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t n_outputs_max_per_seq) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;

    sctx->on_backend = false;
    sctx->fused      = false;
    if (n_outputs_max_per_seq != 1 || sctx->buf_u) {
        return false; // (one draw per decode: one output per sequence; one context per sampler)
    }
    sctx->fused = llama_sfi_sample_ops_supported(*sctx, buft);
    if (!sctx->fused && !llama_sfi_dist_ops_supported(buft)) {
        return false;
    }

    ggml_init_params params = {
        /*.mem_size   =*/ ggml_tensor_overhead(),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    sctx->ctx_u = ggml_init(params);
    sctx->u     = ggml_new_tensor_1d(sctx->ctx_u, GGML_TYPE_F32, 1);
    ggml_set_name(sctx->u, "sfi_dist_uniform");
    sctx->buf_u = ggml_backend_alloc_ctx_tensors_from_buft(sctx->ctx_u, buft);
    if (!sctx->buf_u) {
        return false;
    }

    // (the filters are left uninitialised unless the rest runs in the graph: their host path then applies them all)
    sctx->on_backend = sctx->fused || (sctx->filters->iface->backend_init &&
        sctx->filters->iface->backend_init(sctx->filters, buft, n_outputs_max_per_seq));

    return sctx->on_backend;
}

static void llama_sfi_dist_backend_accept(struct llama_sampler * smpl, struct ggml_context * ctx, struct ggml_cgraph * gf, struct ggml_tensor * selected_token) {
    const auto * sctx = (const llama_sfi_dist *) smpl->ctx;
    llama_sampler * filters = sctx->filters;
    if (!sctx->fused && filters->iface->backend_accept) {
        filters->iface->backend_accept(filters, ctx, gf, selected_token);
    }
}

static void llama_sfi_dist_backend_apply(struct llama_sampler * smpl, struct ggml_context * ctx, struct ggml_cgraph * gf, struct llama_sampler_data * data) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;

    ggml_tensor * logits = ggml_reshape_1d(ctx, data->logits, ggml_nelements(data->logits));
    ggml_tensor * token  = nullptr;
    ggml_tensor * prob   = nullptr;

    if (sctx->fused) {
        GGML_ASSERT(!data->candidates); // (the chain's first sampler)
        llama_sfi_sample_build(ctx, *sctx, logits, sctx->u, &token, &prob);
        data->sampled = token;
        data->probs   = prob;
        data->logits  = nullptr;
        return;
    }

    llama_sfi_greedy_build(ctx, logits, &token, &prob);

    sctx->filters->iface->backend_apply(sctx->filters, ctx, gf, data);

    // the pick and the top-1 probability: nothing else is copied to the host
    data->sampled    = llama_sfi_dist_build(ctx, data, sctx->u);
    data->probs      = ggml_reshape_1d(ctx, prob, 1);
    data->logits     = nullptr;
    data->candidates = nullptr;
}

static void llama_sfi_dist_backend_set_input(struct llama_sampler * smpl) {
    auto * sctx = (llama_sfi_dist *) smpl->ctx;

    if (!sctx->fused && sctx->filters->iface->backend_set_input) {
        sctx->filters->iface->backend_set_input(sctx->filters);
    }

    // as llama.cpp's dist draws it: a double in [0, 1), here as a float
    std::uniform_real_distribution<double> dist(0.0, 1.0);
    const float rnd = (float) dist(sctx->rng);
    ggml_backend_tensor_set(sctx->u, &rnd, 0, sizeof(rnd));
}

static void llama_sfi_dist_backend_reset(struct llama_sampler * smpl) {
    const auto * sctx = (const llama_sfi_dist *) smpl->ctx;
    llama_sampler * filters = sctx->filters;
    if (!sctx->fused && filters->iface->backend_reset) {
        filters->iface->backend_reset(filters);
    }
}

static void llama_sfi_dist_copy_state(const struct llama_sampler * src, struct llama_sampler * dst) {
    const auto * s = (const llama_sfi_dist *) src->ctx;
    auto       * d = (llama_sfi_dist *) dst->ctx;
    llama_sampler_copy(s->filters,   d->filters);
    llama_sampler_copy(s->host_dist, d->host_dist);
    d->rng = s->rng;
}

static struct llama_sampler_i llama_sfi_dist_i = {
    /* .name              = */ llama_sfi_dist_name,
    /* .accept            = */ llama_sfi_dist_accept,
    /* .apply             = */ llama_sfi_dist_apply,
    /* .reset             = */ llama_sfi_dist_reset,
    /* .clone             = */ llama_sfi_dist_clone,
    /* .free              = */ llama_sfi_dist_free,
    /* .backend_init      = */ llama_sfi_dist_backend_init,
    /* .backend_accept    = */ llama_sfi_dist_backend_accept,
    /* .backend_apply     = */ llama_sfi_dist_backend_apply,
    /* .backend_set_input = */ llama_sfi_dist_backend_set_input,
    /* .backend_reset     = */ llama_sfi_dist_backend_reset,
    /* .copy_state        = */ llama_sfi_dist_copy_state,
};

struct llama_sampler * llama_sfi_sampler_init_dist(int32_t top_k, float top_p, float min_p, float temp, uint32_t seed) {
    if (!(temp > 0.0f)) {
        return nullptr;
    }

    // llama.cpp's samplers in the host chain's order (sfi_gguf/core/sampling.py, add_filters)
    llama_sampler * filters = llama_sampler_chain_init(llama_sampler_chain_default_params());
    if (top_k > 0) {
        llama_sampler_chain_add(filters, llama_sampler_init_top_k(top_k));
    }
    llama_sampler_chain_add(filters, llama_sampler_init_top_p(top_p, 1));
    if (min_p > 0.0f) {
        llama_sampler_chain_add(filters, llama_sampler_init_min_p(min_p, 1));
    }
    llama_sampler_chain_add(filters, llama_sampler_init_temp(temp));

    return llama_sampler_init(&llama_sfi_dist_i, new llama_sfi_dist {
        std::max(top_k, 0), top_p, min_p, temp, seed, filters, llama_sampler_init_dist(seed), std::mt19937(seed) });
}

bool llama_sfi_sampler_dist_on_backend(const struct llama_sampler * smpl) {
    return smpl && smpl->iface == &llama_sfi_dist_i && ((const llama_sfi_dist *) smpl->ctx)->on_backend;
}

bool llama_sfi_sampler_dist_fused(const struct llama_sampler * smpl) {
    return llama_sfi_sampler_dist_on_backend(smpl) && ((const llama_sfi_dist *) smpl->ctx)->fused;
}
