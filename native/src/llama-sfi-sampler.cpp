// Greedy sampling in the decode's graph, with the picked token's probability (include/llama-sfi.h)
//
// A decode step of a 4B model on a GPU takes a few milliseconds; copying its 150K logits to the host, the argmax
// over them and the softmax that gives the top-1 probability SFI's trigger reads cost a few percent of it. As a
// backend sampler (llama.cpp's backend sampling API) the argmax and the probability are three small ops at the end
// of the graph, and the host reads back two numbers instead of the logits.
#include "llama-sfi.h"

#include "llama-impl.h"

#include "ggml.h"
#include "ggml-backend.h"

struct llama_sfi_greedy {
    bool on_backend = false; // backend_init found every op on the output's device
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

static bool llama_sfi_greedy_backend_init(struct llama_sampler * smpl, ggml_backend_buffer_type_t buft, uint32_t /*n_outputs_max_per_seq*/) {
    auto * sctx = (llama_sfi_greedy *) smpl->ctx;

    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);

    sctx->on_backend = true;
    if (dev) {
        // the ops on a probe graph of a vocabulary's size, as the device would get them
        ggml_init_params params = {
            /*.mem_size   =*/ 16*ggml_tensor_overhead(),
            /*.mem_buffer =*/ nullptr,
            /*.no_alloc   =*/ true,
        };
        ggml_context * ctx = ggml_init(params);

        ggml_tensor * logits = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, 128*1024);
        ggml_tensor * token  = nullptr;
        ggml_tensor * prob   = nullptr;
        llama_sfi_greedy_build(ctx, logits, &token, &prob);

        for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
            if (llama_sfi_computes(t) && !ggml_backend_dev_supports_op(dev, t)) {
                LLAMA_LOG_WARN("%s: device '%s' lacks %s: greedy picks on the host\n", __func__, ggml_backend_dev_name(dev), ggml_op_name(t->op));
                sctx->on_backend = false;
            }
        }
        ggml_free(ctx);
    }

    return sctx->on_backend;
}

static void llama_sfi_greedy_backend_apply(struct llama_sampler * /*smpl*/, struct ggml_context * ctx, struct ggml_cgraph * /*gf*/, struct llama_sampler_data * data) {
    ggml_tensor * token = nullptr;
    ggml_tensor * prob  = nullptr;
    llama_sfi_greedy_build(ctx, ggml_reshape_1d(ctx, data->logits, ggml_nelements(data->logits)), &token, &prob);

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
