#pragma once

// The compact view of a KV cache: per covered layer and stream, a buffer that holds the cells of a selection
// followed by the tail (the tokens of the FAST steps since the selection), and what a batch does with it

#include "llama-sfi.h"

#include "llama-kv-cache.h"

#include "ggml-cpp.h"

#include <cstdint>
#include <functional>
#include <limits>
#include <memory>
#include <unordered_map>
#include <utility>
#include <vector>

struct llama_ubatch;

// the compact view is padded like the dense n_kv (see llama_kv_cache::get_n_kv)
static constexpr uint32_t LLAMA_SFI_PAD = 256;

// what the decode in progress does with the compact view, per stream
enum llama_sfi_step {
    LLAMA_SFI_STEP_DENSE = 0,
    LLAMA_SFI_STEP_SLOW  = 1, // dense attention + export of the attention mass
    LLAMA_SFI_STEP_FAST  = 2, // attention over the compact view only
    LLAMA_SFI_STEP_MIXED = 3, // of a batch or ubatch: its streams take different steps
};

// the compact view of one llama_kv_cache
//   per layer and stream, a buffer with the same row layout and type as the cache: slot j < n_sel holds, for
//   KV head h, the K/V of cell sel[layer][h][j]; slots n_sel + t hold the tail, i.e. the tokens of the FAST
//   steps since the selection. One stream per sequence when the cache is not unified (batched decoding).
struct llama_sfi_view {
    struct layer {
        int32_t il;
        int32_t n_head_kv;

        ggml_tensor * k; // [n_embd_k_gqa, c_max, n_stream]
        ggml_tensor * v; // [n_embd_v_gqa, c_max, n_stream] (v_trans: per stream [c_max] slots per channel)

        ggml_tensor * kn; // F32 [n_head_kv, kv_size, n_stream]: ||K|| of each cell of the cache (see stream::kn_upto)
    };

    // the selection and the tail of one stream
    struct stream {
        bool valid           = false; // the view matches the cache
        bool gather_pending = false; // the selection has not been gathered into the view yet (the next FAST step does)

        int32_t n_sel = 0;
        int32_t n_own = 0; // the first n_own cells of each row are its own, the rest shared by every row

        float overlap = -1.0f; // of the own cells with the previous selection's (llama_sfi_seq_selection_overlap)

        uint32_t n_edits = 0; // edits of the cache seen by this stream (invalidate_seq)

        std::vector<int32_t>  sel;  // [n_layers][n_head_kv_max][n_sel] cell ids
        std::vector<uint32_t> tail; // cells written by FAST steps since the selection

        // a selection committed without its rows (the SLOW step gathered it into the view): sel and overlap are
        // written later (llama_sfi_context::resolve), sel still holds the rows of the selection before it, of
        // prev_n_sel cells with prev_n_own own ones
        bool    sel_pending = false;
        int32_t prev_n_sel  = 0;
        int32_t prev_n_own  = 0;

        int64_t n_in_range = 0; // SLOW with the device Selector: cells in the Selector's range (set with the inputs)

        bool capture = false; // the decode in progress, FAST, keeps its last token's queries (llama_sfi_seq_capture_queries)

        // the key norms in layer::kn hold for the cells below kn_upto, except kn_stale (written since): a SLOW
        // step that exports key norms takes the others' (llama_sfi_plan::kn_cells) when its inputs are set
        uint32_t              kn_upto = 0;
        std::vector<uint32_t> kn_stale;

        std::vector<int32_t> overlap_stamps; // store_rows' per-cell marks, kept between refreshes (streams resolve in parallel)

        void invalidate();
    };

    // nullptr if the cache can hold a compact view, otherwise the reason
    static const char * unsupported(const llama_kv_cache & kv);

    // throws on failure
    llama_sfi_view(llama_kv_cache & kv, const llama_sfi_params & params);

    llama_kv_cache & kv;

    const llama_sfi_params params;

    bool     v_trans       = false; // the cache stores V transposed (flash attention off), and so does the view
    bool     cache_on_host = false; // the cache is in host memory and the view on the device of its layers (offload_kqv
                                    //   off): graphs run what reads the cache on the CPU (llama_sfi_place_host_cache)
    size_t   bytes_device  = 0;     // the view's buffers (with the cache's key norms) in device / host memory
    size_t   bytes_host    = 0;
    uint32_t c_max         = 0; // slots per layer and stream: pad256(n_sel_max + n_tail_max)
    int32_t  n_head_kv_max = 0;

    std::vector<layer>  layers;
    std::vector<stream> streams;

    std::unordered_map<int32_t, int32_t> map_layer_ids; // model layer -> index in layers

    std::vector<std::pair<ggml_context_ptr, ggml_backend_buffer_ptr>> ctxs_bufs;

    // the K (V) of every layer of the cache and of the view as one tensor, when the layers lie at one stride in one
    // buffer (same shape, a type without blocks): a SLOW step then gathers every layer's selection with one op per
    // tensor, not one per layer (llama_sfi_build_load), and takes the device Selector's scores of a stack of layers
    // with one product (llama_sfi_build_export)
    struct layer_span {
        ggml_tensor * t      = nullptr; // 1-D, from the first layer's data to the end of the last one's
        size_t        stride = 0;       // bytes from one layer to the next
    };

    layer_span cache_k, cache_v, view_k, view_v;

    ggml_context_ptr ctx_spans;

    int32_t n_candidates = 0; // SLOW: export this many candidate cells per layer (0: every cell)

    int32_t n_query_rows = 1; // SLOW: the last n_query_rows tokens of a slow stream's ubatch are its query rows

    llama_sfi_selector_params selector = {}; // SLOW with candidates: the device Selector (k_head 0: none)
    uint32_t selector_gen = 0;               // bumped by every llama_sfi_set_selector (its values are in the graph)

    // SLOW with the Selector: some layer keeps key norms of its own (layer::kn); false once a slow graph's Selector
    // took every layer's from its evidence op (llama_sfi_selector_fused), so that such steps take none
    bool selector_own_key_norms = true;

    int32_t refresh_groups = 1; // SLOW with the Selector: refresh the layers i % refresh_groups == refresh_group
    int32_t refresh_group  = 0;

    // the Selector runs in a SLOW step's graph over n_cand candidates
    bool selects(int64_t n_cand) const { return selector.k_head > 0 && selector.k_head <= n_cand; }

    bool refreshes(int32_t i) const { return i % refresh_groups == refresh_group; }

    // ... and gathers its selection, with the cells outside its range shared by every row, into the view (when it
    // refreshes every layer and the view holds it): llama_sfi_seq_load_selection then only commits it
    bool gathers(int64_t n_cand) const {
        return selects(n_cand) && refresh_groups == 1 && params.evidence_alpha > 0.0f && selector.n_sink + selector.n_recent > 0 &&
            (int64_t) selector.k_head + selector.n_sink + selector.n_recent <= params.n_sel_max;
    }

    // the decode in progress (set by llama_sfi_context::decode_begin): each stream's step, and the batch's (MIXED
    // when its streams' differ)
    std::vector<llama_sfi_step> stream_steps;
    llama_sfi_step step = LLAMA_SFI_STEP_DENSE;

    void invalidate_seq(llama_seq_id seq); // the stream of seq (every stream for seq < 0)

    // a checked selection -> stream st: rows (layer, head) of n_own own cells each, then the n_shared shared ones;
    // the next FAST step gathers it into the view unless the SLOW step did (gathered)
    void store_selection(stream & st, const int32_t * cells, int32_t n_own, const int32_t * shared, int32_t n_shared,
            bool gathered = false);

    // ... its rows only (stream::sel), and their overlap with the rows sel held (prev_n_sel cells, prev_n_own own)
    void store_rows(stream & st, const int32_t * cells, int32_t n_own, const int32_t * shared, int32_t n_shared,
            int32_t prev_n_sel, int32_t prev_n_own);

    uint32_t stream_of(llama_seq_id seq) const;

    // cells idxs of stream s were written (any step): their key norms are stale
    void note_written(uint32_t s, const std::vector<uint32_t> & idxs);

    // the cache's K changed other than by writing cells (an edit, a shift, a state load): no key norm holds
    void forget_key_norms(llama_seq_id seq); // the stream of seq (every stream for seq < 0)

    int32_t layer_index(int32_t il) const; // -1 if the layer is not covered

    // the cache's K / V of model layer il
    ggml_tensor * cache_k_of(int32_t il) const;
    ggml_tensor * cache_v_of(int32_t il) const;

    // number of slots attended by a FAST ubatch over streams s0..s1: the largest pad256(n_sel + tail)
    uint32_t n_view(uint32_t s0, uint32_t s1) const;

    // FAST ubatch placed in cells idxs of stream s: append them to its tail
    //   gather: set if this ubatch has to gather the selection of s
    //   returns the compact slot of the first token
    uint32_t apply_ubatch(uint32_t s, const std::vector<uint32_t> & idxs, bool & gather);

    ggml_tensor * get_k(ggml_context * ctx, int32_t il, uint32_t n_kv, uint32_t s0, uint32_t s1) const;
    ggml_tensor * get_v(ggml_context * ctx, int32_t il, uint32_t n_kv, uint32_t s0, uint32_t s1) const;

    // the mask of the streams of ubatch that attend to their views (steps[j]: the ubatch's j-th stream's step, FAST
    // for those; nullptr: every one), [n_slots, n_tps, 1, ns]; the rows of the others are left as they are
    void set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> * steps = nullptr) const;

    // the cache's mask, [n_kv, n_tps, 1, ns], of the streams of ubatch that attend to all their cells (steps[j] other
    // than FAST): the causal mask llama.cpp fills (SFI's caches have no SWA and no ALiBi), for those rows only
    void set_input_dense_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> & steps) const;

private:
    template <typename T>
    void fill_kq_mask(T * data, const ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> * steps,
            T keep, T drop) const;

    template <typename T>
    void fill_dense_kq_mask(T * data, const ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> & steps,
            T keep, T drop) const;
};

// streams j0 .. j0+n-1 of a ubatch (in ubatch order) that take one step
struct llama_sfi_run {
    llama_sfi_step step;
    uint32_t j0;
    uint32_t n;
};

// what one batch does with the compact view, ubatch by ubatch (a member of llama_kv_cache_context)
struct llama_sfi_plan {
    llama_sfi_plan(llama_sfi_view & view, const std::vector<llama_ubatch> & ubatches);

    llama_sfi_view & view;

    const llama_sfi_step step; // of the batch: FAST streams attend to the compact view, SLOW ones that end a sequence export

    std::vector<bool> exports; // SLOW: per ubatch, whether it exports

    // the ubatch being processed (apply)
    llama_sfi_step ubatch_step = LLAMA_SFI_STEP_DENSE; // its streams' step, MIXED when they differ
    bool exporting = false; // some stream is SLOW, and the ubatch ends one of the batch's sequences
    bool capturing = false; // FAST, and some stream keeps its last token's queries (stream::capture)
    uint32_t s0 = 0;
    uint32_t s1 = 0;

    std::vector<uint32_t> streams; // stream of each sequence of the ubatch, in ubatch order
    std::vector<llama_sfi_step> steps; // ... and its step
    std::vector<llama_sfi_run> runs; // MIXED: the streams cut into runs of one step, in ubatch order
    uint32_t n_view = 0; // MIXED: the slots the FAST streams attend (FAST: the n_kv of the ubatch)

    std::vector<uint32_t> gathering; // FAST streams of the ubatch that gather their selection
    std::vector<uint32_t> tail0;     // per stream of the ubatch, the compact slot of its first token (FAST streams;
                                     //   the others write their tokens past any slot a mask keeps)

    // SLOW export with key norms: the cells whose key norms the step takes (written since they were last taken),
    // stream*kv_size + cell, padded to a multiple of LLAMA_SFI_PAD with the last one (its size is part of the graph)
    std::vector<int32_t> kn_cells;

    bool fast()  const { return ubatch_step == LLAMA_SFI_STEP_FAST; }
    bool mixed() const { return ubatch_step == LLAMA_SFI_STEP_MIXED; }

    // the ubatch writes the tokens of FAST streams to their views
    bool stores() const { return fast() || (mixed() && n_view > 0); }

    // ubatch u placed in sinfo, which attends n_kv cells of the cache: returns the number it attends instead (FAST:
    // slots of the view; MIXED: the cache's cells, the FAST streams' mask is an SFI input)
    uint32_t apply(size_t u, const llama_kv_cache::slot_info & sinfo, uint32_t n_kv);

    // FAST: the view instead of the cache
    ggml_tensor * get_k(ggml_context * ctx, int32_t il, uint32_t n_kv) const;
    ggml_tensor * get_v(ggml_context * ctx, int32_t il, uint32_t n_kv) const;

    void set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch) const;

    // MIXED: the mask of the FAST streams over their views, [n_view, n_tps, 1, ns]
    void set_input_fast_mask(ggml_tensor * dst, const llama_ubatch * ubatch) const;

    // the plan fills the ubatch's kq_mask: FAST, the view's; MIXED, the cache's rows of the other streams only
    bool fills_kq_mask() const { return fast() || mixed(); }
};

// an edit of the cells of seq (every sequence for seq < 0) invalidates its view; keys_changed: the K of cells that
// stay changed (a shift, a copy, a state load), so their key norms go too (view may be nullptr)
void llama_sfi_invalidate(llama_sfi_view * view, llama_seq_id seq = -1, bool keys_changed = true);

// positions [first, second) of seq the device Selector chooses from
std::pair<llama_pos, llama_pos> llama_sfi_selector_range(const llama_sfi_view & view, llama_seq_id seq);

// 1 for each cell that holds a position of seq in [p0, p1): the cells' state read once per cell, in order, for
// checks of every selected cell (per selected cell, its reads land all over the cells' arrays)
std::vector<uint8_t> llama_sfi_cells_holding(const llama_kv_cells & cells, llama_seq_id seq,
        llama_pos p0 = 0, llama_pos p1 = std::numeric_limits<llama_pos>::max());

// the cells of seq outside the Selector's range, in cell order: the sink (below it), then the recent ones (past it);
// the cells every row of a selection the device Selector makes shares (llama_sfi_seq_load_selection)
std::vector<int32_t> llama_sfi_cells_outside(const llama_kv_cells & cells, llama_seq_id seq, std::pair<llama_pos, llama_pos> range);

// fn(0) .. fn(n - 1) on up to 8 threads (the caller's one of them): the host's part of a batched refresh is per
// stream, and the GPU host has cores idle while its graph computes
void llama_sfi_parallel_for(int64_t n, const std::function<void(int64_t)> & fn);
