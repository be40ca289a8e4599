#pragma once

#include "llama.h"

#ifdef __cplusplus
extern "C" {
#endif

    //
    // Slow-Fast Inference (SFI): compact-view KV decoding
    //

    // API version of the SFI calls; bumped whenever a llama_sfi_* call or struct changes
    LLAMA_API int32_t llama_sfi_version(void);

    // Compact-view mode. After llama_sfi_init(), every llama_decode() runs in the mode set by
    // llama_sfi_set_mode() (sticky):
    //   DENSE: an ordinary decode step.
    //   SLOW:  an ordinary (dense, exact) decode step that also exports, for every covered layer,
    //          KV head and cell, the attention mass of the last n_query_rows tokens of the (last)
    //          ubatch, the power evidence sum_r p_r^alpha and the key norms ||K||.
    //   FAST:  attention reads only a compact per-layer buffer: the cells of the selection given
    //          by llama_sfi_set_selection() (gathered per KV head on the first FAST step after the
    //          selection) followed by the tail, i.e. every token decoded by FAST steps since then.
    //          Without a valid view (no selection, invalidated, tail full) the step runs dense and
    //          sets LLAMA_SFI_STATUS_FELL_BACK_DENSE.
    // Any non-FAST decode of a sequence and anything that changes its cells (seq_rm/cp/add/div,
    // seq_keep, clear, K-shift, state load) invalidates its view.
    // Several sequences (batched decoding): with n_seq_max > 1 the cache must keep one stream per
    // sequence (kv_unified = false); each sequence has its own view, selection, tail and exports, and
    // the mode applies to every sequence of a llama_decode() batch: FAST runs dense for the whole batch
    // unless every sequence in it has a valid view with room in its tail. A step where some sequences
    // are slow and others fast is two llama_decode() calls.
    // Covered layers: the layers of the main KV cache (the non-SWA layers for iSWA models).
    // Requirements: n_seq_max == 1 or one stream per sequence, a non-MLA cache with
    // F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 K/V types. Flash attention on or off (off: the compact view holds V transposed, like the
    // cache, so that the plain attention reads it without a copy).

    enum llama_sfi_mode {
        LLAMA_SFI_MODE_DENSE = 0,
        LLAMA_SFI_MODE_SLOW  = 1,
        LLAMA_SFI_MODE_FAST  = 2,
    };

    // bits of llama_sfi_seq_status()
#define LLAMA_SFI_STATUS_VIEW_VALID      1  // a selection is loaded and matches the cache
#define LLAMA_SFI_STATUS_LAST_FAST       2  // the last decode ran as a fast step
#define LLAMA_SFI_STATUS_FELL_BACK_DENSE 4  // the last decode was asked FAST but ran dense
#define LLAMA_SFI_STATUS_MASS_VALID      8  // the sequence's last decode was a slow step and exported mass

    // error codes (negative); 0 = ok
#define LLAMA_SFI_ERR_NOT_INIT    -1  // llama_sfi_init() was not called (or llama_sfi_free() was)
#define LLAMA_SFI_ERR_BAD_ARG     -2  // null pointer, bad mode, bad sequence id, bad parameter
#define LLAMA_SFI_ERR_RANGE       -3  // a cell outside [0, kv_size), empty or not in the sequence
#define LLAMA_SFI_ERR_DUPLICATE   -4  // a cell twice in one (layer, head) selection
#define LLAMA_SFI_ERR_COUNT       -5  // n_sel outside [1, n_sel_max], or n_layers/n_head_kv mismatch
#define LLAMA_SFI_ERR_UNSUPPORTED -6  // > 1 sequence in a unified cache, unsupported cache/model
#define LLAMA_SFI_ERR_ALLOC       -7  // could not allocate the compact buffers
#define LLAMA_SFI_ERR_NO_SELECTION -8 // no selection of a SLOW step to load (none ran, a decode or an edit since)

    struct llama_sfi_params {
        int32_t n_sel_max;        // capacity of a selection per (layer, KV head), in cells
        int32_t n_tail_max;       // tokens FAST steps may append after a selection
        int32_t n_query_rows;     // SLOW: the last n_query_rows tokens of the ubatch are the query rows
        float   evidence_alpha;   // SLOW: also export sum_r p_r^alpha (0 = do not)
        bool    export_key_norms; // SLOW: also export ||K|| per (layer, KV head, cell)
    };

    LLAMA_API struct llama_sfi_params llama_sfi_default_params(void);

    // allocates the compact buffers; calling it again re-initializes (and drops the selection)
    LLAMA_API int32_t llama_sfi_init(struct llama_context * ctx, const struct llama_sfi_params * params);
    LLAMA_API void    llama_sfi_free(struct llama_context * ctx);

    // number of covered layers (0 if not initialized); info of covered layer i: model layer index, KV heads
    LLAMA_API int32_t llama_sfi_n_layers  (const struct llama_context * ctx);
    LLAMA_API int32_t llama_sfi_layer_info(const struct llama_context * ctx, int32_t i, int32_t * il, int32_t * n_head_kv);

    // mode of the following llama_decode() calls
    LLAMA_API int32_t llama_sfi_set_mode(struct llama_context * ctx, enum llama_sfi_mode mode);

    // cells: [n_layers][n_head_kv][n_sel] cell ids (not positions), n_layers = llama_sfi_n_layers(),
    // n_head_kv = the largest n_head_kv of the covered layers (extra heads of smaller layers are ignored)
    // every (layer, head) gets n_sel distinct cells that belong to seq; the order sets the slot order
    LLAMA_API int32_t llama_sfi_set_selection(
            struct llama_context * ctx,
                    llama_seq_id   seq,
                 const int32_t   * cells,
                         int32_t   n_layers,
                         int32_t   n_head_kv,
                         int32_t   n_sel);

    // the same with n_shared more cells for every (layer, head), e.g. the sink and the recent window, after
    // each row's own n_sel cells (shared may be NULL when n_shared is 0); no copy of them per row is needed
    LLAMA_API int32_t llama_sfi_set_selection_shared(
            struct llama_context * ctx,
                    llama_seq_id   seq,
                 const int32_t   * cells,
                         int32_t   n_layers,
                         int32_t   n_head_kv,
                         int32_t   n_sel,
                 const int32_t   * shared,
                         int32_t   n_shared);

    // load the selection of seq's last SLOW step (llama_sfi_seq_get_selection) as llama_sfi_set_selection_shared
    // would, with the cells outside the device Selector's range (the sink and the recent window, this step's token
    // included) shared by every row, without checking its cells again (the step did); before seq's next decode
    LLAMA_API int32_t llama_sfi_seq_load_selection(struct llama_context * ctx, llama_seq_id seq);

    // share of the own cells (not the shared ones) of seq's selection that the selection before it had in the
    // same (layer, head), over every row ("support stability"); -1 when there was none with own cells
    LLAMA_API float llama_sfi_seq_selection_overlap(const struct llama_context * ctx, llama_seq_id seq);

    // exports of the last SLOW decode of sequence seq, [n_layers][n_head_kv][n_cells], NULL when there is
    // none; owned by the context, valid until the next llama_decode() of the sequence. n_cells: the padded n_kv of the step (cell i is
    // cell i), or with candidates (llama_sfi_set_n_candidates) min(n_candidates, n_kv), cell j being
    // llama_sfi_seq_get_candidates()[layer][j]
    //   mass:      sum over the query rows and the GQA group of the softmax probabilities
    //   evidence:  sum over the query rows and the GQA group of p^alpha
    //   key norms: ||K|| of the cell for the KV head (after the cache's rotation, which keeps norms)
    LLAMA_API const float * llama_sfi_seq_get_mass     (struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const float * llama_sfi_seq_get_evidence (struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);
    LLAMA_API const float * llama_sfi_seq_get_key_norms(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells);

    // SLOW steps from now on export, per covered layer, only the n_candidates cells with the most evidence
    // (the mass when evidence_alpha is 0) summed over the layer's KV heads, chosen on the device (top-k),
    // with their key norms: what leaves the device shrinks from n_kv to n_candidates per (layer, head).
    // 0 (the default) exports every cell.
    LLAMA_API int32_t llama_sfi_set_n_candidates(struct llama_context * ctx, int32_t n_candidates);

    // the candidate cells of the last export, [n_layers][n_cells] (in no particular order); NULL when the
    // export covers every cell
    LLAMA_API const int32_t * llama_sfi_seq_get_candidates(struct llama_context * ctx, llama_seq_id seq, int32_t * n_layers, int32_t * n_cells);

    // The SFI Selector on the device. With a selector set and candidates on, a SLOW step also scores,
    // per covered layer and KV head, the cells of each sequence whose position lies in [n_sink, n_ctx - n_recent)
    // (n_ctx: the sequence's largest position + 1) and keeps the k_head best, in its graph: only those cells
    // leave the device (llama_sfi_seq_get_selection, and the candidates: llama_sfi_seq_get_candidates); the
    // mass/evidence/key-norm exports are skipped.
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

    LLAMA_API struct llama_sfi_selector_params llama_sfi_selector_default_params(void);

    // NULL or k_head == 0: no selector; needs evidence (evidence_alpha > 0) and key norms
    LLAMA_API int32_t llama_sfi_set_selector(struct llama_context * ctx, const struct llama_sfi_selector_params * params);

    // slow steps with the device Selector refresh only the layers i (of llama_sfi_layer_info) with
    // i % n_groups == group, and skip the other layers' export; their rows of the selection are the own cells of
    // the selection the sequence's view holds (a step whose view holds none with k_head own cells per row has
    // no selection). n_groups 1: every layer (the default). The reference's refresh_layer_groups.
    LLAMA_API int32_t llama_sfi_set_refresh_layers(struct llama_context * ctx, int32_t n_groups, int32_t group);

    // the selection of seq's last SLOW step, [n_layers][n_head_kv][n_sel] cell ids, each row in no particular
    // order; NULL when that step ran no selector
    LLAMA_API const int32_t * llama_sfi_seq_get_selection(struct llama_context * ctx, llama_seq_id seq,
            int32_t * n_layers, int32_t * n_head_kv, int32_t * n_sel);

    // number of query rows summed in the last export (min(n_query_rows, tokens of the sequence in its ubatch))
    LLAMA_API int32_t llama_sfi_seq_get_n_query_rows(const struct llama_context * ctx, llama_seq_id seq);

    // pos[i] = position of cell i in seq, -1 if the cell is empty or not in seq, for i < min(n, kv_size)
    // returns kv_size (pos may be NULL to query it), or a negative error code
    LLAMA_API int32_t llama_sfi_get_cell_pos(const struct llama_context * ctx, llama_seq_id seq, int32_t * pos, int32_t n);

    // LLAMA_SFI_STATUS_* of seq (LAST_FAST and FELL_BACK_DENSE: the last llama_decode())
    LLAMA_API uint32_t llama_sfi_seq_status(const struct llama_context * ctx, llama_seq_id seq);

#ifdef __cplusplus
}
#endif
