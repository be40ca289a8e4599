#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    //
    // Slow-Fast Inference (SFI): decoding over a compact view of the KV cache
    //
    // After llama_sfi_init(), every llama_decode() runs in the mode set by llama_sfi_set_mode() (sticky):
    //   DENSE: an ordinary decode step.
    //   SLOW:  an ordinary (dense, exact) decode step that also exports, for every covered layer, KV head and
    //          cell, the attention mass of the last n_query_rows tokens of the sequence's last ubatch, the
    //          evidence sum_r p_r^alpha and the key norms ||K|| (or, with the device Selector, only its selection).
    //   FAST:  attention reads only a compact per-layer buffer, the view: the cells of the selection given by
    //          llama_sfi_set_selection() (gathered per KV head on the first FAST step after it) followed by the
    //          tail, i.e. every token decoded by FAST steps since then. Without a valid view (no selection,
    //          invalidated, tail full) the step runs dense and sets LLAMA_SFI_STATUS_FELL_BACK_DENSE.
    // Any non-FAST decode of a sequence and anything that changes its cells (seq_rm/cp/add/div, seq_keep, clear,
    // K-shift, state load) invalidates its view.
    //
    // Several sequences (batched decoding): with n_seq_max > 1 the cache must keep one stream per sequence
    // (kv_unified = false); each sequence has its own view, selection, tail, exports and mode
    // (llama_sfi_seq_set_mode), so that one llama_decode() batch can hold slow, dense and fast sequences: each
    // attends as its mode says (a FAST sequence without a valid view with room in its tail runs dense), and the
    // weights are read once for all of them. Slow sequences of one batch share the export settings
    // (llama_sfi_set_n_candidates, llama_sfi_set_selector, llama_sfi_set_refresh_layers).
    //
    // Covered layers: the layers of the main KV cache (the non-SWA layers of iSWA models).
    // Requirements: n_seq_max == 1 or one stream per sequence, a non-MLA cache with F32/F16/BF16/Q8_0/Q4_0/Q4_1/
    // Q5_0/Q5_1 K/V types, no ALiBi, one position per token. Flash attention on or off (off: the view holds V
    // transposed, like the cache, so that the plain attention reads it without a copy).
    //
    // Calls return 0 (or a count) on success and one of the LLAMA_SFI_ERR_* codes on bad input; calls that return a
    // pointer return NULL and set their int32_t * outputs (each may be NULL) to 0. Nothing aborts on bad input.

    enum llama_sfi_mode {
        LLAMA_SFI_MODE_DENSE = 0,
        LLAMA_SFI_MODE_SLOW  = 1,
        LLAMA_SFI_MODE_FAST  = 2,
    };

    // bits of llama_sfi_seq_status()
#define LLAMA_SFI_STATUS_VIEW_VALID      1  // a selection is loaded and matches the cache
#define LLAMA_SFI_STATUS_LAST_FAST       2  // the last decode ran as a fast step
#define LLAMA_SFI_STATUS_FELL_BACK_DENSE 4  // the last decode was asked FAST but ran dense
#define LLAMA_SFI_STATUS_MASS_VALID      8  // the sequence's last decode was a slow step and exported

    // error codes (negative); 0 = ok
#define LLAMA_SFI_ERR_NOT_INIT     -1 // llama_sfi_init() was not called (or llama_sfi_free() was), or ctx is NULL
#define LLAMA_SFI_ERR_BAD_ARG      -2 // null pointer, bad mode, bad sequence id, bad parameter
#define LLAMA_SFI_ERR_RANGE        -3 // a cell outside [0, kv_size), empty or not in the sequence
#define LLAMA_SFI_ERR_DUPLICATE    -4 // a cell twice in one (layer, head) selection
#define LLAMA_SFI_ERR_COUNT        -5 // n_sel outside [1, n_sel_max], or n_layers/n_head_kv mismatch
#define LLAMA_SFI_ERR_UNSUPPORTED  -6 // > 1 sequence in a unified cache, unsupported cache/model
#define LLAMA_SFI_ERR_ALLOC        -7 // could not allocate the view
#define LLAMA_SFI_ERR_NO_SELECTION -8 // no selection of a SLOW step to load (none ran, a decode or an edit since)
#define LLAMA_SFI_ERR_NO_QUERIES   -9 // no FAST decode kept its queries to export from (llama_sfi_seq_capture_queries)

    // Version of this API: bumped whenever a llama_sfi_* call or struct changes, so that a caller binding the
    // calls by name (ctypes) can refuse a library it does not match.
    LLAMA_API int32_t llama_sfi_version(void);

    struct llama_sfi_params {
        int32_t n_sel_max;        // capacity of a selection per (layer, KV head), in cells
        int32_t n_tail_max;       // tokens FAST steps may append after a selection
        int32_t n_query_rows;     // SLOW: the last n_query_rows tokens of the ubatch are the query rows
        float   evidence_alpha;   // SLOW: also export sum_r p_r^alpha (0 = do not)
        bool    export_key_norms; // SLOW: also export ||K|| per (layer, KV head, cell)

        // how the steps are computed (the same results: fa_evidence changes a slow step's logits by rounding only)
        bool    fused_ops;        // SFI's fused ggml ops where the backend has them; false: their composite ggml
                                  // definition on every backend (what a backend without the ops runs)
        bool    keep_graphs;      // FAST steps decode with a scheduler and graphs of their own (so that the context's
                                  // graph, a slow step's, stays built); false: every ubatch takes the context's
                                  // scheduler and graph, as llama.cpp's own do
        int32_t fa_evidence;      // SLOW with flash attention: the attention as ggml_sfi_flash_attn_evidence, which
                                  // also gives the evidence and key norms: 1 on every backend that has it, 0 on none
                                  // (flash attention + ggml_sfi_evidence), -1 where the keys are in device memory (or
                                  // in host memory for layers on a device)
    };

    // n_sel_max 2308 (a 2048-cell selection, the sink and the recent window), n_tail_max 256, n_query_rows 1,
    // evidence_alpha 0.5, export_key_norms true, fused_ops true, keep_graphs true, fa_evidence -1. The environment
    // overrides the last three defaults (read once per process): LLAMA_SFI_FUSED=0 fused_ops false,
    // LLAMA_SFI_KEEP_GRAPHS=0 keep_graphs false, LLAMA_SFI_FA_EVIDENCE=1 / =0 fa_evidence 1 / 0.
    LLAMA_API struct llama_sfi_params llama_sfi_default_params(void);

    // Start SFI on ctx: allocates the view (per covered layer and stream, pad256(n_sel_max + n_tail_max) slots,
    // at most the cache's size) next to the cache, in the same buffer type; when the cache is in host memory
    // (offload_kqv off) and a layer runs on a device, its view on that device: FAST steps then read device memory
    // only, SLOW steps attend over the host cache on the CPU (this needs flash attention). Mode DENSE, no
    // selection, no candidates, no device Selector. Calling it again re-initializes.
    // Returns 0, or
    //   LLAMA_SFI_ERR_BAD_ARG:     ctx or params NULL, n_sel_max, n_tail_max or n_query_rows < 1, evidence_alpha
    //                              negative or not finite, n_sel_max + n_tail_max too large, fa_evidence not -1, 0
    //                              or 1; ctx is unchanged
    //   LLAMA_SFI_ERR_UNSUPPORTED: no KV cache, several sequences in a unified cache, or a cache or model SFI
    //                              does not cover (the log says why)
    //   LLAMA_SFI_ERR_ALLOC:       the view could not be allocated
    // After UNSUPPORTED or ALLOC, ctx has no SFI state (the previous one, if any, is freed).
    LLAMA_API int32_t llama_sfi_init(struct llama_context * ctx, const struct llama_sfi_params * params);

    // Where the KV cache and the view live, in bytes.
    struct llama_sfi_memory {
        int64_t cache_device;  // the KV cache's K and V in device memory
        int64_t cache_host;    // ... in host memory
        int64_t view_device;   // the view's buffers in device memory
        int64_t view_host;     // ... in host memory (with the key norms of the cache's cells)
        bool    cache_on_host; // the cache is in host memory and the view on the device of its layers
    };

    // Fills *mem. Returns 0, LLAMA_SFI_ERR_BAD_ARG (mem NULL) or LLAMA_SFI_ERR_NOT_INIT.
    LLAMA_API int32_t llama_sfi_get_memory(const struct llama_context * ctx, struct llama_sfi_memory * mem);

    // Stop SFI on ctx and free the view: decodes are ordinary again. No-op when ctx is NULL or has no SFI state.
    LLAMA_API void llama_sfi_free(struct llama_context * ctx);

    // Number of covered layers; 0 when ctx is NULL or has no SFI state.
    LLAMA_API int32_t llama_sfi_n_layers(const struct llama_context * ctx);

    // Covered layer i (0 <= i < llama_sfi_n_layers()): *il = its index in the model, *n_head_kv = its KV heads
    // (either output may be NULL). Returns 0, LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for i out of range.
    LLAMA_API int32_t llama_sfi_layer_info(const struct llama_context * ctx, int32_t i, int32_t * il, int32_t * n_head_kv);

    // Mode of the following llama_decode() calls (see above), for every sequence. Returns 0, LLAMA_SFI_ERR_NOT_INIT,
    // or LLAMA_SFI_ERR_BAD_ARG for a value that is not a llama_sfi_mode.
    LLAMA_API int32_t llama_sfi_set_mode(struct llama_context * ctx, enum llama_sfi_mode mode);

    // ... for sequence seq only (until the next call for it or llama_sfi_set_mode()). Returns 0,
    // LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for a bad mode or seq outside [0, n_seq_max).
    LLAMA_API int32_t llama_sfi_seq_set_mode(struct llama_context * ctx, llama_seq_id seq, enum llama_sfi_mode mode);

    // Selection of sequence seq for the FAST steps that follow: cells [n_layers][n_head_kv][n_sel] are cell ids
    // (llama_sfi_get_cell_pos gives their positions), n_layers = llama_sfi_n_layers(), n_head_kv = the largest
    // n_head_kv of the covered layers (the rows of heads a smaller layer lacks are ignored). Every (layer, head)
    // gets n_sel distinct cells of seq, in the view's slots in the given order; the next FAST step of seq gathers
    // them. Returns 0, or
    //   LLAMA_SFI_ERR_NOT_INIT
    //   LLAMA_SFI_ERR_BAD_ARG:   cells NULL with n_sel > 0, n_sel < 0, seq outside [0, n_seq_max)
    //   LLAMA_SFI_ERR_COUNT:     n_layers or n_head_kv other than above, n_sel outside [1, n_sel_max]
    //   LLAMA_SFI_ERR_RANGE:     a cell outside [0, kv_size), empty, or not holding seq
    //   LLAMA_SFI_ERR_DUPLICATE: a cell twice in one (layer, head) row
    // On error the sequence's selection and view are unchanged.
    LLAMA_API int32_t llama_sfi_set_selection(
            struct llama_context * ctx,
                    llama_seq_id   seq,
                 const int32_t   * cells,
                         int32_t   n_layers,
                         int32_t   n_head_kv,
                         int32_t   n_sel);

    // The same with n_shared more cells (e.g. the sink and the recent window) after the n_sel own cells of every
    // (layer, head), given once: shared [n_shared] (NULL when n_shared is 0). n_sel + n_shared is the count checked
    // against [1, n_sel_max], and no row may hold a cell twice (own and shared together). Returns as
    // llama_sfi_set_selection; LLAMA_SFI_ERR_BAD_ARG also for shared NULL with n_shared > 0, or n_shared < 0.
    LLAMA_API int32_t llama_sfi_set_selection_shared(
            struct llama_context * ctx,
                    llama_seq_id   seq,
                 const int32_t   * cells,
                         int32_t   n_layers,
                         int32_t   n_head_kv,
                         int32_t   n_sel,
                 const int32_t   * shared,
                         int32_t   n_shared);

    // Load the selection of seq's last SLOW step (llama_sfi_seq_get_selection) as llama_sfi_set_selection_shared
    // would, with the cells outside the device Selector's range (the sink and the recent window, that step's token
    // included) shared by every row, without checking its cells again (the step did); call it before seq's next
    // decode. When that step already gathered the selection into the view, the next FAST step does not gather it
    // again, and the host's part of the refresh (the selection's rows for later checks and loads, the overlap)
    // runs at the first read of them or once that FAST step's graph was launched, while it computes. Returns 0, or
    //   LLAMA_SFI_ERR_NOT_INIT
    //   LLAMA_SFI_ERR_BAD_ARG:      seq outside [0, n_seq_max)
    //   LLAMA_SFI_ERR_NO_SELECTION: seq's last decode was no SLOW step with a selection, or its cells changed since
    //   LLAMA_SFI_ERR_COUNT:        the selection and its shared cells exceed n_sel_max
    LLAMA_API int32_t llama_sfi_seq_load_selection(struct llama_context * ctx, llama_seq_id seq);

    // Share of the own cells (not the shared ones) of seq's selection that the selection before it had in the same
    // (layer, head), over every row ("support stability"). Returns -1 when there was no previous selection with own
    // cells, and for a NULL ctx, no SFI state or seq outside [0, n_seq_max).
    LLAMA_API float llama_sfi_seq_selection_overlap(const struct llama_context * ctx, llama_seq_id seq);

    // The exports of seq's last SLOW decode, [n_layers][n_head_kv][n_cells], owned by the context and valid until
    // the next llama_decode() of the sequence; n_cells is the padded n_kv of the step (column i is cell i), or with
    // candidates (llama_sfi_set_n_candidates) min(n_candidates, n_kv), column j being
    // llama_sfi_seq_get_candidates()[layer][j].
    //   mass:      sum over the query rows and the GQA group of the softmax probabilities
    //   evidence:  sum over the query rows and the GQA group of p^alpha (NULL when evidence_alpha is 0)
    //   key norms: ||K|| of the cell for the KV head, after the cache's rotation, which keeps norms (NULL without
    //              export_key_norms)
    // NULL (and the outputs 0) when seq's last decode was no SLOW step, when it ran the device Selector, for a NULL
    // ctx, no SFI state, or seq outside [0, n_seq_max).
    LLAMA_API const float * llama_sfi_seq_get_mass     (struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const float * llama_sfi_seq_get_evidence (struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const float * llama_sfi_seq_get_key_norms(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);

    // SLOW steps from now on export, per covered layer, only the n_candidates cells with the most evidence (the
    // mass when evidence_alpha is 0) summed over the layer's KV heads, chosen on the device (top-k), with their key
    // norms: what leaves the device shrinks from n_kv to n_candidates per (layer, head). 0 (the default) exports
    // every cell. Returns 0, LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for n_candidates < 0.
    LLAMA_API int32_t llama_sfi_set_n_candidates(struct llama_context * ctx, int32_t n_candidates);

    // SLOW steps from now on take the last n_query_rows tokens of each slow sequence's ubatch (at most its tokens) as
    // their query rows, in place of llama_sfi_params.n_query_rows: many rows for a bootstrap over the prompt's last
    // tokens, one for a step that decodes other tokens before its own in the same ubatch (their KV is written densely,
    // the export is its own row's). Returns 0, LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for n_query_rows < 1.
    LLAMA_API int32_t llama_sfi_set_n_query_rows(struct llama_context * ctx, int32_t n_query_rows);

    // The candidate cells of seq's last export, [n_layers][n_cells] (each row in no particular order; with the
    // device Selector, its candidates; -1 for a layer it did not refresh). NULL (and the outputs 0) when the export
    // covers every cell or there is none, for a NULL ctx, no SFI state, or seq outside [0, n_seq_max).
    LLAMA_API const int32_t * llama_sfi_seq_get_candidates(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_cells);

    // The SFI Selector on the device. With a selector set and candidates on, a SLOW step also scores, per covered
    // layer and KV head, the cells of each sequence whose position lies in [n_sink, n_ctx - n_recent) (n_ctx: the
    // sequence's largest position + 1) and keeps the k_head best, in its graph: only those cells leave the device
    // (llama_sfi_seq_get_selection, and the candidates: llama_sfi_seq_get_candidates); the mass, evidence and
    // key-norm exports are skipped.
    // The stages (sfi_gguf/selector.py is the reference):
    //   f = normalised evidence^(1/alpha), max-pooled over pool_window neighbouring cells, renormalised;
    //   candidates: the n_candidates cells with the most f summed over the layer's KV heads;
    //   on the candidates (f renormalised): r ~ max(||K||, tiny)^key_norm_exponent * delta(u)^w_pos with
    //   log delta(u) = -pos_beta*u^pos_power + pos_eta*log(1 - u), u the relative position in the range;
    //   q = f - lambda*(f - r), lambda = <f, f - r>/||f - r||^2 clipped to [0, lambda_clip_single] with one
    //   query row (else lambda_clip_multi); s = log q; with > 2 KV heads s += cross_head_alpha*log softmax over
    //   the heads of s/cross_head_temperature; the top k_head of s.
    // Windows run over cells: a sequence's cells hold consecutive positions unless its cache was edited.
    // Candidates outside the range count for nothing. k_head > n_candidates: the step exports as without a
    // selector; fewer than k_head cells in the range: the step has no selection.
    struct llama_sfi_selector_params {
        int32_t k_head;        // cells kept per layer and KV head (0: no selector)
        int32_t n_sink;        // the range starts at this position
        int32_t n_recent;      // ... and ends this many positions before the sequence's end
        int32_t pool_window;   // max-pool the evidence over 2*(pool_window/2) + 1 cells (<= 1: off)
        float   key_norm_exponent;
        float   w_pos;
        float   pos_beta;
        float   pos_power;
        float   pos_eta;
        float   lambda_clip_single;
        float   lambda_clip_multi;
        float   cross_head_alpha;
        float   cross_head_temperature;
    };

    // The reference's defaults, with k_head 0 (no selector): n_sink 4, n_recent 256, pool_window 17,
    // key_norm_exponent -0.5, w_pos 0.7, pos_beta -ln(0.6)/0.9, pos_power 1.8, pos_eta 0.4, lambda clips 0.35 and
    // 0.25, cross_head_alpha 0.85, cross_head_temperature 2.
    LLAMA_API struct llama_sfi_selector_params llama_sfi_selector_default_params(void);

    // The device Selector of the following SLOW steps with candidates; NULL or k_head 0: none. Its values are
    // constants of the slow step's graph (a change rebuilds it). Returns 0, or
    //   LLAMA_SFI_ERR_NOT_INIT
    //   LLAMA_SFI_ERR_BAD_ARG:     a value not finite, k_head, n_sink or n_recent < 0, pos_power or
    //                              cross_head_temperature <= 0
    //   LLAMA_SFI_ERR_UNSUPPORTED: k_head > 0 without evidence (evidence_alpha > 0) and key norms
    //                              (export_key_norms) in llama_sfi_params
    // On error the previous selector stays.
    LLAMA_API int32_t llama_sfi_set_selector(struct llama_context * ctx, const struct llama_sfi_selector_params * params);

    // Slow steps with the device Selector refresh only the layers i (of llama_sfi_layer_info) with
    // i % n_groups == group, and skip the other layers' export; their rows of the selection are the own cells of
    // the selection the sequence's view holds (a step whose view holds none with k_head own cells per row has
    // no selection). n_groups 1: every layer (the default). The reference's refresh_layer_groups.
    // Returns 0, LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for n_groups < 1, group outside
    // [0, n_groups) or group >= llama_sfi_n_layers().
    LLAMA_API int32_t llama_sfi_set_refresh_layers(struct llama_context * ctx, int32_t n_groups, int32_t group);

    // The selection of seq's last SLOW step, [n_layers][n_head_kv][n_sel] cell ids (n_sel = k_head), each row in
    // no particular order; it holds until seq's next SLOW step or an edit of its cells. NULL (and the outputs 0)
    // when that step ran no device Selector or had no selection, for a NULL ctx, no SFI state, or seq outside
    // [0, n_seq_max). The step copies the device's picks; they become cell ids at the first call of this (or
    // after the next FAST step was launched, see llama_sfi_seq_load_selection).
    LLAMA_API const int32_t * llama_sfi_seq_get_selection(struct llama_context * ctx, llama_seq_id seq,
            int32_t * n_layers, int32_t * n_head_kv, int32_t * n_sel);

    // n_sel of that selection without reading it (0: none), as llama_sfi_seq_get_selection would return it
    LLAMA_API int32_t llama_sfi_seq_selection_size(const struct llama_context * ctx, llama_seq_id seq);

    // Number of query rows summed in seq's last export: min(n_query_rows, the sequence's tokens in its last
    // ubatch); 0 when there is no export (also for seq outside [0, n_seq_max)). LLAMA_SFI_ERR_NOT_INIT without
    // SFI state or for a NULL ctx.
    LLAMA_API int32_t llama_sfi_seq_get_n_query_rows(const struct llama_context * ctx, llama_seq_id seq);

    // pos[i] = position of cell i in seq, -1 if the cell is empty or not in seq, for i < min(n, kv_size). Needs
    // no SFI state. Returns kv_size (pos may be NULL with n 0 to query it), or
    //   LLAMA_SFI_ERR_BAD_ARG:     ctx NULL, seq outside [0, n_seq_max), n < 0, pos NULL with n > 0
    //   LLAMA_SFI_ERR_UNSUPPORTED: the context has no KV cache SFI works on
    LLAMA_API int32_t llama_sfi_get_cell_pos(const struct llama_context * ctx, llama_seq_id seq, int32_t * pos, int32_t n);

    // The refresh of a cache in host memory off the decoding thread: the evidence of a token is computed on the CPU
    // over the host cache while the device decodes the next FAST steps, instead of in a SLOW step.
    //
    // llama_sfi_seq_capture_queries: the next FAST decode of seq also keeps its last token's queries of every covered
    // layer, scaled as its attention scales them. Returns 0, LLAMA_SFI_ERR_NOT_INIT, or LLAMA_SFI_ERR_BAD_ARG for seq
    // outside [0, n_seq_max).
    LLAMA_API int32_t llama_sfi_seq_capture_queries(struct llama_context * ctx, llama_seq_id seq);

    struct llama_sfi_host_export;

    // After that decode: a job that holds those queries and the cells of seq the token attended to (positions up to
    // its own), for llama_sfi_host_export_compute. n_candidates as llama_sfi_set_n_candidates (0: every cell). NULL
    // with *err (may be NULL) set to
    //   LLAMA_SFI_ERR_NOT_INIT
    //   LLAMA_SFI_ERR_BAD_ARG:      seq outside [0, n_seq_max), n_candidates < 0
    //   LLAMA_SFI_ERR_UNSUPPORTED:  the cache is not in host memory, or evidence_alpha is 0
    //   LLAMA_SFI_ERR_NO_QUERIES:   seq's last decode kept no queries (no capture asked, or it was not FAST)
    LLAMA_API struct llama_sfi_host_export * llama_sfi_seq_host_export_begin(struct llama_context * ctx, llama_seq_id seq,
            int32_t n_candidates, int32_t * err);

    // The job's export on the CPU with n_threads threads, on any thread: what a SLOW step of the token would export
    // (llama_sfi_seq_get_evidence, llama_sfi_seq_get_key_norms, llama_sfi_seq_get_candidates), computed from the
    // captured queries over the cache's keys. The cells the job reads must keep their keys until it returns: the
    // context may decode meanwhile (new tokens take other cells), but no edit of seq's cells. Returns 0,
    // LLAMA_SFI_ERR_BAD_ARG (job NULL, n_threads < 1) or LLAMA_SFI_ERR_ALLOC.
    LLAMA_API int32_t llama_sfi_host_export_compute(struct llama_sfi_host_export * job, int32_t n_threads);

    // The computed export, [n_layers][n_head_kv][n_cells] ([n_layers][n_cells] for the candidates, NULL when every
    // cell is exported, column i then being cell i), owned by the job; NULL (and the outputs 0) before compute.
    LLAMA_API const float   * llama_sfi_host_export_evidence  (const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const float   * llama_sfi_host_export_key_norms (const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const int32_t * llama_sfi_host_export_candidates(const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_cells);

    // frees the job (NULL: no-op); not while its compute runs
    LLAMA_API void llama_sfi_host_export_free(struct llama_sfi_host_export * job);

    // LLAMA_SFI_STATUS_* bits of seq (LAST_FAST and FELL_BACK_DENSE: of the last llama_decode() that held seq); 0 for
    // a NULL ctx, no SFI state, or seq outside [0, n_seq_max).
    LLAMA_API uint32_t llama_sfi_seq_status(const struct llama_context * ctx, llama_seq_id seq);

    // Greedy sampling in the decode's graph: a sampler for a llama_sampler_chain attached with llama_set_sampler()
    // (llama.cpp's backend sampling) that picks the first of the largest logits, as llama_sampler_init_greedy() does,
    // and its probability under the softmax of the logits: after llama_decode(), llama_get_sampled_token_ith() is the
    // token, llama_get_sampled_probs_ith() its probability (one value; llama_get_sampled_candidates_ith() is the
    // token again), and the logits are not copied to the host. Outside a backend chain it is the host's greedy pick.
    LLAMA_API struct llama_sampler * llama_sfi_sampler_init_greedy(void);

    // whether smpl (from llama_sfi_sampler_init_greedy) runs in the graph: after the llama_set_sampler() of its chain,
    // false when the output's device lacks one of its ops (then detach the chain: the decode would copy no logits)
    LLAMA_API bool llama_sfi_sampler_greedy_on_backend(const struct llama_sampler * smpl);

    // whether smpl (from llama_sfi_sampler_init_greedy) runs in the graph as one SFI op (ggml_sfi_greedy)
    LLAMA_API bool llama_sfi_sampler_greedy_fused(const struct llama_sampler * smpl);

    // Sampling in the decode's graph with the model's confidence: a sampler for a llama_sampler_chain attached with
    // llama_set_sampler() that picks as llama.cpp's samplers top-k (top_k 0: off), top-p, min-p (min_keep 1 each),
    // temperature and dist with this seed would (the random number drawn on the host as dist draws it, one a decode,
    // in a buffer every graph of the context reads: SFI's kept graphs too), and adds the probability of the most likely
    // token under the softmax of the logits: after llama_decode(), llama_get_sampled_token_ith() is the pick,
    // llama_get_sampled_probs_ith() that probability (one value), and nothing else is copied to the host. With top-k on
    // and a device with the SFI ops, two ops (ggml_sfi_top_k, ggml_sfi_sample); else llama.cpp's backend filters and
    // dist's ops. Outside a backend chain, llama.cpp's samplers on the host. NULL unless temp > 0.
    LLAMA_API struct llama_sampler * llama_sfi_sampler_init_dist(int32_t top_k, float top_p, float min_p, float temp, uint32_t seed);

    // whether smpl (from llama_sfi_sampler_init_dist) runs in the graph: after the llama_set_sampler() of its chain;
    // if false, detach the chain (the decode would copy no logits)
    LLAMA_API bool llama_sfi_sampler_dist_on_backend(const struct llama_sampler * smpl);

    // whether smpl (from llama_sfi_sampler_init_dist) runs in the graph as the two SFI ops
    LLAMA_API bool llama_sfi_sampler_dist_fused(const struct llama_sampler * smpl);

    // llama_log_set(callback, user_data) behind a filter that drops messages below min_level (and the lines that
    // continue them) before they reach callback: a callback into an interpreter costs tens of microseconds a
    // message, and a GPU backend logs debug lines at every decode. A NULL callback restores llama.cpp's default.
    LLAMA_API void llama_sfi_log_set(ggml_log_callback callback, void * user_data, enum ggml_log_level min_level);

    // the filter's min_level alone (no effect on a callback installed with llama_log_set)
    LLAMA_API void llama_sfi_log_set_min_level(enum ggml_log_level min_level);

#ifdef __cplusplus
}
#endif
