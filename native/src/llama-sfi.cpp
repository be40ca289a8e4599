// The SFI C API (include/llama-sfi.h)
#include "llama-sfi.h"

#include "llama-sfi-context.h"
#include "llama-sfi-host-export.h"
#include "llama-sfi-view.h"

#include "llama-impl.h"
#include "llama-context.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <exception>

#define LLAMA_SFI_API_VERSION 20

int32_t llama_sfi_version(void) {
    return LLAMA_SFI_API_VERSION;
}

// the environment's overrides of the execution defaults, read once
static bool llama_sfi_env_off(const char * name) {
    const char * env = getenv(name);
    return env && strcmp(env, "0") == 0;
}

struct llama_sfi_params llama_sfi_default_params(void) {
    static const bool    fused_ops   = !llama_sfi_env_off("LLAMA_SFI_FUSED");
    static const bool    keep_graphs = !llama_sfi_env_off("LLAMA_SFI_KEEP_GRAPHS");
    static const int32_t fa_evidence = [] {
        const char * env = getenv("LLAMA_SFI_FA_EVIDENCE");
        return env ? (strcmp(env, "1") == 0 ? 1 : 0) : -1;
    }();

    llama_sfi_params result = {
        /*.n_sel_max        =*/ 2048 + 4 + 256,
        /*.n_tail_max       =*/ 256,
        /*.n_query_rows     =*/ 1,
        /*.evidence_alpha   =*/ 0.5f,
        /*.export_key_norms =*/ true,
        /*.fused_ops        =*/ fused_ops,
        /*.keep_graphs      =*/ keep_graphs,
        /*.fa_evidence      =*/ fa_evidence,
    };

    return result;
}

// the KV cache SFI works on: the cache of a full-attention model, or the base cache of an iSWA model
static llama_kv_cache * llama_sfi_get_kv(const llama_context * ctx) {
    llama_memory_t mem = ctx->get_memory();

    if (auto * kv = dynamic_cast<llama_kv_cache *>(mem)) {
        return kv;
    }

    if (auto * kv_iswa = dynamic_cast<llama_kv_cache_iswa *>(mem)) {
        return kv_iswa->get_base();
    }

    return nullptr;
}

int32_t llama_sfi_init(struct llama_context * ctx, const struct llama_sfi_params * params) {
    if (!ctx || !params) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    if (params->n_sel_max < 1 || params->n_tail_max < 1 || params->n_query_rows < 1 ||
        !(std::isfinite(params->evidence_alpha) && params->evidence_alpha >= 0.0f) || (int64_t) params->n_sel_max + params->n_tail_max > INT32_MAX - LLAMA_SFI_PAD ||
        params->fa_evidence < -1 || params->fa_evidence > 1) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    llama_sfi_free(ctx);

    const auto & cparams = ctx->get_cparams();

    llama_kv_cache * kv = llama_sfi_get_kv(ctx);
    if (!kv) {
        LLAMA_LOG_ERROR("%s: SFI needs a KV cache (full attention or iSWA)\n", __func__);
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    if (cparams.n_seq_max != kv->get_n_stream()) {
        LLAMA_LOG_ERROR("%s: SFI needs one KV stream per sequence (n_seq_max = %u, kv_unified = %d)\n", __func__,
                cparams.n_seq_max, cparams.kv_unified);
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    if (const char * reason = llama_sfi_view::unsupported(*kv)) {
        LLAMA_LOG_ERROR("%s: SFI is not supported for this cache: %s\n", __func__, reason);
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    std::shared_ptr<llama_sfi_view> view;
    try {
        view = std::make_shared<llama_sfi_view>(*kv, *params);
    } catch (const std::exception & err) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, err.what());
        return LLAMA_SFI_ERR_ALLOC;
    }

    if (view->cache_on_host && view->v_trans) {
        LLAMA_LOG_ERROR("%s: a cache in host memory with the view on a device needs flash attention\n", __func__);
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    ctx->set_sfi(std::make_unique<llama_sfi_context>(ctx->get_model(), kv, std::move(view), *params));

    return 0;
}

int32_t llama_sfi_get_memory(const struct llama_context * ctx, struct llama_sfi_memory * mem) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }
    if (!mem) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    const llama_sfi_view & view = *ctx->get_sfi()->view;

    *mem = {};
    for (const auto & l : view.layers) {
        for (const ggml_tensor * t : { view.cache_k_of(l.il), view.cache_v_of(l.il) }) {
            (ggml_backend_buffer_is_host(t->buffer) ? mem->cache_host : mem->cache_device) += ggml_nbytes(t);
        }
    }
    mem->view_device   = (int64_t) view.bytes_device;
    mem->view_host     = (int64_t) view.bytes_host;
    mem->cache_on_host = view.cache_on_host;
    return 0;
}

void llama_sfi_free(struct llama_context * ctx) {
    if (ctx && ctx->get_sfi()) {
        ctx->set_sfi(nullptr);
    }
}

int32_t llama_sfi_n_layers(const struct llama_context * ctx) {
    if (!ctx || !ctx->get_sfi()) {
        return 0;
    }

    return ctx->get_sfi()->view->layers.size();
}

int32_t llama_sfi_layer_info(const struct llama_context * ctx, int32_t i, int32_t * il, int32_t * n_head_kv) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    const auto & layers = ctx->get_sfi()->view->layers;

    if (i < 0 || (size_t) i >= layers.size()) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    if (il) {
        *il = layers[i].il;
    }

    if (n_head_kv) {
        *n_head_kv = layers[i].n_head_kv;
    }

    return 0;
}

static bool llama_sfi_mode_valid(enum llama_sfi_mode mode) {
    return mode == LLAMA_SFI_MODE_DENSE || mode == LLAMA_SFI_MODE_SLOW || mode == LLAMA_SFI_MODE_FAST;
}

int32_t llama_sfi_set_mode(struct llama_context * ctx, enum llama_sfi_mode mode) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (!llama_sfi_mode_valid(mode)) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    auto & modes = ctx->get_sfi()->modes;
    std::fill(modes.begin(), modes.end(), mode);

    return 0;
}

int32_t llama_sfi_seq_set_mode(struct llama_context * ctx, llama_seq_id seq, enum llama_sfi_mode mode) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    if (!llama_sfi_mode_valid(mode)) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    auto * sfi = ctx->get_sfi();

    sfi->modes[sfi->view->stream_of(seq)] = mode;

    return 0;
}

int32_t llama_sfi_set_selection(
        struct llama_context * ctx,
                llama_seq_id   seq,
             const int32_t   * cells,
                     int32_t   n_layers,
                     int32_t   n_head_kv,
                     int32_t   n_sel) {
    return llama_sfi_set_selection_shared(ctx, seq, cells, n_layers, n_head_kv, n_sel, nullptr, 0);
}

int32_t llama_sfi_set_selection_shared(
        struct llama_context * ctx,
                llama_seq_id   seq,
             const int32_t   * cells,
                     int32_t   n_layers,
                     int32_t   n_head_kv,
                     int32_t   n_own,
             const int32_t   * shared,
                     int32_t   n_shared) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    auto * sfi  = ctx->get_sfi();
    auto & view = *sfi->view;

    if ((!cells && n_own > 0) || (!shared && n_shared > 0) || n_own < 0 || n_shared < 0 ||
        seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    auto & st = view.streams[view.stream_of(seq)];

    const int64_t n_sel = (int64_t) n_own + n_shared;

    if (n_layers != (int32_t) view.layers.size() || n_head_kv != view.n_head_kv_max ||
        n_sel < 1 || n_sel > sfi->params.n_sel_max) {
        return LLAMA_SFI_ERR_COUNT;
    }

    const auto & kv_cells = view.kv.get_cells(seq);

    const uint32_t kv_size = kv_cells.size();

    // row (layer, head) r: its own cells, then the shared ones
    auto cell = [&](int64_t r, int64_t j) {
        return j < n_own ? cells[r*n_own + j] : shared[j - n_own];
    };

    const auto holds = llama_sfi_cells_holding(kv_cells, seq);

    // stamp[c] == id of the last (layer, head) that selected cell c
    std::vector<int32_t> stamp(kv_size, -1);

    for (int32_t i = 0; i < n_layers; ++i) {
        for (int32_t h = 0; h < view.layers[i].n_head_kv; ++h) {
            const int32_t id = i*n_head_kv + h;

            for (int64_t j = 0; j < n_sel; ++j) {
                const int32_t c = cell(id, j);

                if (c < 0 || (uint32_t) c >= kv_size || !holds[c]) {
                    return LLAMA_SFI_ERR_RANGE;
                }

                if (stamp[c] == id) {
                    return LLAMA_SFI_ERR_DUPLICATE;
                }

                stamp[c] = id;
            }
        }
    }

    sfi->resolve(view.stream_of(seq)); // the rows of a selection before this one, for the overlap
    view.store_selection(st, cells, n_own, shared, n_shared);

    return 0;
}

int32_t llama_sfi_seq_load_selection(struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    auto * sfi = ctx->get_sfi();

    return sfi->load_selection(sfi->view->stream_of(seq));
}

int32_t llama_sfi_seq_capture_queries(struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    auto * sfi = ctx->get_sfi();
    sfi->capture_next[sfi->view->stream_of(seq)] = 1;

    return 0;
}

struct llama_sfi_host_export * llama_sfi_seq_host_export_begin(struct llama_context * ctx, llama_seq_id seq,
        int32_t n_candidates, int32_t * err) {
    if (!ctx || !ctx->get_sfi()) {
        if (err) {
            *err = LLAMA_SFI_ERR_NOT_INIT;
        }
        return nullptr;
    }

    if (seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max || n_candidates < 0) {
        if (err) {
            *err = LLAMA_SFI_ERR_BAD_ARG;
        }
        return nullptr;
    }

    try {
        return llama_sfi_host_export_new(*ctx->get_sfi(), seq, n_candidates, err);
    } catch (const std::exception & e) {
        LLAMA_LOG_ERROR("%s: %s\n", __func__, e.what());
        if (err) {
            *err = LLAMA_SFI_ERR_ALLOC;
        }
        return nullptr;
    }
}

float llama_sfi_seq_selection_overlap(const struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi() || seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return -1.0f;
    }

    // written with the selection's rows (a const call that may write them: they are a cache of the selection)
    auto * sfi = ctx->get_sfi();
    sfi->resolve(sfi->view->stream_of(seq));

    return sfi->view->streams[sfi->view->stream_of(seq)].overlap;
}

// the export of seq's last SLOW decode, nullptr when there is none
static const llama_sfi_export * llama_sfi_seq_export(const struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi() || seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return nullptr;
    }

    const auto * sfi = ctx->get_sfi();
    const auto & ex  = sfi->exports[sfi->view->stream_of(seq)];

    return ex.valid ? &ex : nullptr;
}

static const float * llama_sfi_get_export(
        struct llama_context * ctx,
        llama_seq_id seq,
        const std::vector<float> llama_sfi_export::* data,
        int32_t * n_layers,
        int32_t * n_head_kv,
        int32_t * n_cells) {
    if (n_layers)  { *n_layers  = 0; }
    if (n_head_kv) { *n_head_kv = 0; }
    if (n_cells)   { *n_cells   = 0; }

    const auto * ex = llama_sfi_seq_export(ctx, seq);

    if (!ex || (ex->*data).empty()) {
        return nullptr;
    }

    if (n_layers)  { *n_layers  = ctx->get_sfi()->view->layers.size(); }
    if (n_head_kv) { *n_head_kv = ctx->get_sfi()->view->n_head_kv_max; }
    if (n_cells)   { *n_cells   = ex->n_cells; }

    return (ex->*data).data();
}

const float * llama_sfi_seq_get_mass(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    return llama_sfi_get_export(ctx, seq, &llama_sfi_export::mass, n_layers, n_head_kv, n_cells);
}

const float * llama_sfi_seq_get_evidence(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    return llama_sfi_get_export(ctx, seq, &llama_sfi_export::evidence, n_layers, n_head_kv, n_cells);
}

const float * llama_sfi_seq_get_key_norms(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    return llama_sfi_get_export(ctx, seq, &llama_sfi_export::key_norms, n_layers, n_head_kv, n_cells);
}

int32_t llama_sfi_set_n_candidates(struct llama_context * ctx, int32_t n_candidates) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (n_candidates < 0) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    ctx->get_sfi()->view->n_candidates = n_candidates;

    return 0;
}

int32_t llama_sfi_set_n_query_rows(struct llama_context * ctx, int32_t n_query_rows) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    if (n_query_rows < 1) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    ctx->get_sfi()->view->n_query_rows = n_query_rows;

    return 0;
}

const int32_t * llama_sfi_seq_get_candidates(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_cells) {
    if (n_layers) { *n_layers = 0; }
    if (n_cells)  { *n_cells  = 0; }

    const auto * ex = llama_sfi_seq_export(ctx, seq);

    if (!ex || !ex->has_cells()) {
        return nullptr;
    }

    if (n_layers) { *n_layers = ctx->get_sfi()->view->layers.size(); }
    if (n_cells)  { *n_cells  = ex->n_cells; }

    return ex->cells_data();
}

struct llama_sfi_selector_params llama_sfi_selector_default_params(void) {
    llama_sfi_selector_params result = {
        /*.k_head                 =*/ 0,
        /*.n_sink                 =*/ 4,
        /*.n_recent               =*/ 256,
        /*.pool_window            =*/ 17,
        /*.key_norm_exponent      =*/ -0.5f,
        /*.w_pos                  =*/ 0.7f,
        /*.pos_beta               =*/ (float) (-std::log(0.6)/0.9),
        /*.pos_power              =*/ 1.8f,
        /*.pos_eta                =*/ 0.4f,
        /*.lambda_clip_single     =*/ 0.35f,
        /*.lambda_clip_multi      =*/ 0.25f,
        /*.cross_head_alpha       =*/ 0.85f,
        /*.cross_head_temperature =*/ 2.0f,
    };

    return result;
}

int32_t llama_sfi_set_selector(struct llama_context * ctx, const struct llama_sfi_selector_params * params) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    auto * sfi = ctx->get_sfi();

    llama_sfi_selector_params sp = params ? *params : llama_sfi_selector_default_params();
    if (!params) {
        sp.k_head = 0;
    }

    const float reals[] = { sp.key_norm_exponent, sp.w_pos, sp.pos_beta, sp.pos_power, sp.pos_eta,
        sp.lambda_clip_single, sp.lambda_clip_multi, sp.cross_head_alpha, sp.cross_head_temperature };
    for (const float x : reals) {
        if (!std::isfinite(x)) {
            return LLAMA_SFI_ERR_BAD_ARG;
        }
    }

    if (sp.k_head < 0 || sp.n_sink < 0 || sp.n_recent < 0 || sp.pos_power <= 0.0f || sp.cross_head_temperature <= 0.0f) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    if (sp.k_head > 0 && (sfi->params.evidence_alpha <= 0.0f || !sfi->params.export_key_norms)) {
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    sfi->view->selector = sp;
    sfi->view->selector_gen++;

    return 0;
}

int32_t llama_sfi_set_refresh_layers(struct llama_context * ctx, int32_t n_groups, int32_t group) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    auto * view = ctx->get_sfi()->view.get();

    if (n_groups < 1 || group < 0 || group >= n_groups || (size_t) group >= view->layers.size()) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    view->refresh_groups = n_groups;
    view->refresh_group  = group;

    return 0;
}

const int32_t * llama_sfi_seq_get_selection(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_sel) {
    if (n_layers)  { *n_layers  = 0; }
    if (n_head_kv) { *n_head_kv = 0; }
    if (n_sel)     { *n_sel     = 0; }

    if (llama_sfi_seq_selection_size(ctx, seq) <= 0) {
        return nullptr;
    }

    auto * sfi = ctx->get_sfi();
    const uint32_t s = sfi->view->stream_of(seq);

    sfi->map_selection(s);

    const auto & ex = sfi->exports[s];
    if (!ex.has_selection()) {
        return nullptr;
    }

    if (n_layers)  { *n_layers  = sfi->view->layers.size(); }
    if (n_head_kv) { *n_head_kv = sfi->view->n_head_kv_max; }
    if (n_sel)     { *n_sel     = ex.n_sel; }

    return ex.selection_data();
}

int32_t llama_sfi_seq_selection_size(const struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi() || seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return 0;
    }

    const auto * sfi = ctx->get_sfi();
    const uint32_t s = sfi->view->stream_of(seq);

    // the step's selection holds until the sequence's next SLOW step or an edit of its cells
    const auto & ex = sfi->exports[s];

    return ex.n_sel > 0 && ex.n_edits == sfi->view->streams[s].n_edits ? ex.n_sel : 0;
}

int32_t llama_sfi_seq_get_n_query_rows(const struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi()) {
        return LLAMA_SFI_ERR_NOT_INIT;
    }

    const auto * ex = llama_sfi_seq_export(ctx, seq);

    return ex ? ex->n_rows : 0;
}

int32_t llama_sfi_get_cell_pos(const struct llama_context * ctx, llama_seq_id seq, int32_t * pos, int32_t n) {
    if (!ctx) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    const llama_kv_cache * kv = llama_sfi_get_kv(ctx);
    if (!kv) {
        return LLAMA_SFI_ERR_UNSUPPORTED;
    }

    if (seq < 0 || (uint32_t) seq >= kv->get_n_seq_max() || n < 0 || (n > 0 && !pos)) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }

    const auto & cells = kv->get_cells(seq);

    const uint32_t kv_size = cells.size();

    for (int32_t i = 0; i < n && (uint32_t) i < kv_size; ++i) {
        pos[i] = !cells.is_empty(i) && cells.seq_has(i, seq) ? cells.pos_get(i) : -1;
    }

    return kv_size;
}

uint32_t llama_sfi_seq_status(const struct llama_context * ctx, llama_seq_id seq) {
    if (!ctx || !ctx->get_sfi() || seq < 0 || (uint32_t) seq >= ctx->get_cparams().n_seq_max) {
        return 0;
    }

    const auto * sfi = ctx->get_sfi();

    const uint32_t s = sfi->view->stream_of(seq);

    return sfi->status[s] |
        (sfi->view->streams[s].valid ? LLAMA_SFI_STATUS_VIEW_VALID : 0) |
        (sfi->exports[s].valid       ? LLAMA_SFI_STATUS_MASS_VALID : 0);
}

//
// log filter
//

static std::atomic<ggml_log_callback> llama_sfi_log_callback  { nullptr };
static std::atomic<void *>            llama_sfi_log_user_data { nullptr };
static std::atomic<int>               llama_sfi_log_min_level { GGML_LOG_LEVEL_NONE };

static void llama_sfi_log_filtered(enum ggml_log_level level, const char * text, void * /*user_data*/) {
    // a CONT line goes where the message it continues went (messages come from one thread at a time in practice)
    static thread_local bool dropped = false;
    if (level != GGML_LOG_LEVEL_CONT) {
        dropped = level != GGML_LOG_LEVEL_NONE && (int) level < llama_sfi_log_min_level.load(std::memory_order_relaxed);
    }
    if (dropped) {
        return;
    }
    const ggml_log_callback callback = llama_sfi_log_callback.load(std::memory_order_acquire);
    if (callback) {
        callback(level, text, llama_sfi_log_user_data.load(std::memory_order_relaxed));
    }
}

void llama_sfi_log_set(ggml_log_callback callback, void * user_data, enum ggml_log_level min_level) {
    if (!callback) {
        llama_log_set(nullptr, nullptr);
        return;
    }
    llama_sfi_log_user_data.store(user_data, std::memory_order_relaxed);
    llama_sfi_log_set_min_level(min_level);
    llama_sfi_log_callback.store(callback, std::memory_order_release);
    llama_log_set(llama_sfi_log_filtered, nullptr);
}

void llama_sfi_log_set_min_level(enum ggml_log_level min_level) {
    llama_sfi_log_min_level.store((int) min_level, std::memory_order_relaxed);
}
