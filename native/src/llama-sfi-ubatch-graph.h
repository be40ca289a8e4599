#pragma once

// What SFI adds to a ubatch's graph: its inputs (members of the KV attention inputs), its outputs (a member of
// llm_graph_result), and the FAST step's writes of the compact view

#include "ggml.h"
#include "ggml-backend.h"

#include <cstdint>
#include <utility>
#include <vector>

class llama_kv_cache_context;
struct llama_sfi_params;
struct llama_sfi_view;
struct llama_ubatch;

// graph inputs of the compact view (members of the KV attention inputs)
struct llama_sfi_graph_input {
    ggml_tensor * tail_idxs = nullptr; // I64 [n_tokens]    FAST: slots of the ubatch tokens (stream*c_max + slot)
    ggml_tensor * sel_slots = nullptr; // I64 [n]           FAST that gathers, SLOW that gathers: the slots 0 .. n-1
    ggml_tensor * tail_idxs_v = nullptr; // I64 [n_tokens*n_embd_v_gqa] FAST, V transposed: element of each channel

    // MIXED with FAST streams: their mask over their views, [n_view, n_tps, 1, ns] of the kq_mask's type (the kq_mask
    // is the cache's, for the other streams)
    ggml_tensor * fast_mask = nullptr;

    // FAST: per stream that gathers its selection (its first FAST step after it), I32 [n_sel, n_head_kv_max, n_layers] cells
    std::vector<std::pair<uint32_t, ggml_tensor *>> sel;

    // SLOW + device Selector, per stream of the ubatch: F32 [n_kv, 1, 1, ns] 0 for the cells in the Selector's
    // range, -inf for the others (candidates outside the range get no prior and no evidence, so they count for
    // nothing); F32 [1, n_kv, ns] the relative position u in [0, 1) of those cells in the range (0 outside),
    // from which the graph computes the position prior of the candidates only
    ggml_tensor * sel_mask = nullptr;
    ggml_tensor * sel_u    = nullptr;

    // SLOW export with key norms: I32 [n] the cells whose key norms the step takes (llama_sfi_plan::kn_cells)
    ggml_tensor * kn_cells = nullptr;

    // SLOW + device Selector that gathers (llama_sfi_view::gathers): I32 [n_sink + n_recent, n_rep, ns] the cells of
    // each stream outside the Selector's range (llama_sfi_cells_outside; the rest repeats the last: slots past the
    // selection), repeated n_rep = max(n_head_kv_max, n_layers) times (an index per head or per layer); sel_slots is
    // then [k_head + n_sink + n_recent]
    ggml_tensor * shared = nullptr;

    uint64_t key = 0; // the SFI topology the graph was built for (see llama_sfi_graph_key)
};

// the exports of a run of SLOW streams s0 .. s0+ns-1 of a ubatch (every stream of a SLOW ubatch), the ubatch's
// streams j0 .. j0+ns-1
struct llama_sfi_run_export {
    uint32_t s0 = 0;
    int64_t  ns = 0;
    uint32_t j0 = 0;

    // per covered layer: [n_cells, n_head_kv, ns] ([n_cells, ns] for the cells)
    std::vector<ggml_tensor *> mass;
    std::vector<ggml_tensor *> evidence;
    std::vector<ggml_tensor *> key_norms;
    std::vector<ggml_tensor *> cells;
    std::vector<ggml_tensor *> sel;  // I32 [k_head, n_head_kv, n*ns]: the device Selector's picks (indices into cells,
                                     //   or cell ids: sel_cells) for this layer and the n - 1 after it (nullptr: an
                                     //   earlier entry has them)

    std::vector<ggml_tensor *> sel_q;     // while the graph is built: each layer's scaled queries, keys,
    std::vector<ggml_tensor *> sel_k;     //   sinks and key norms per cell, from which the Selector takes
    std::vector<ggml_tensor *> sel_sinks; //   its scores after the last layer
    std::vector<ggml_tensor *> sel_kn;
    std::vector<ggml_tensor *> sel_fae;   //   ... or the layer's ggml_sfi_flash_attn_evidence, which gave them

    bool gathered  = false; // the graph gathered the device Selector's selection into the view ...
    bool sel_cells = false; // ... and sel holds the cell ids it gathered (the host maps no picks)

    bool has_selection() const;
};

// the SFI tensors of a graph (a member of llm_graph_result)
struct llama_sfi_graph_result {
    std::vector<llama_sfi_run_export> runs; // SLOW: the exports of each run of SLOW streams, in ubatch order

    std::vector<ggml_tensor *> key_norms; // per covered layer: every cell's key norms once the step took the new ones

    ggml_tensor * kq = nullptr; // the probabilities of the last attention without flash attention (the export takes them)

    // FAST that captures (llama_sfi_plan::capturing): per covered layer, F32 [n_embd_head, n_head, ns] the last token's
    // queries of each stream of the ubatch (query_streams, in ubatch order), scaled as the evidence op takes them
    std::vector<ggml_tensor *> queries;
    std::vector<uint32_t>      query_streams;
};

// whether the backend of storage (the tensor op reads) has op; RPC reports every op as supported without asking its
// server, so it has none here
bool llama_sfi_backend_has(const ggml_tensor * op, const ggml_tensor * storage);

// whether op, an SFI op, runs: with params.fused_ops, where the backend of storage has it; else the caller builds its
// composite definition (RPC always takes the composite ops; so does every backend without fused_ops)
bool llama_sfi_backend_runs(const llama_sfi_params & params, const ggml_tensor * op, const ggml_tensor * storage);

// the indices of the k best of each row of a: ggml_sfi_top_k (a selection, in increasing order) where it runs
// (llama_sfi_backend_runs on storage), else ggml's top-k ops (argsort_top_k, the best first, when sorted_fallback)
ggml_tensor * llama_sfi_top_k(ggml_context * ctx, const llama_sfi_params & params, ggml_tensor * a, int k,
        bool sorted_fallback, const ggml_tensor * storage);

// dst[:, slot0 + i, j, l] = src[:, idx[i, j, l], j, l], where slots holds slot0 .. slot0+n-1 (n = idx->ne[0]):
// ggml_sfi_copy_rows where it runs on the backend of src; from host memory to a device, the rows gathered on the CPU
// and copied over; else get_rows then set_rows
ggml_tensor * llama_sfi_copy_rows(ggml_context * ctx, const llama_sfi_params & params, ggml_tensor * dst,
        ggml_tensor * src, ggml_tensor * idx, ggml_tensor * slots, int64_t slot0);

// a cache in host memory with the view on a device (llama_sfi_view::cache_on_host): the nodes of gf that read the
// cache run on the CPU backend of sched, so that no step copies the cache to the device; but for the attention of a
// ubatch of at least LLAMA_SFI_HOST_ATTN_MAX_TOKENS tokens (a prompt), which the scheduler gives the device with a copy
// of the cells it reads: quadratic attention on the CPU would cost far more than the copy. A graph that reads no cell
// (FAST) writes its tokens into the cache after everything else.
static constexpr int64_t LLAMA_SFI_HOST_ATTN_MAX_TOKENS = 32;

void llama_sfi_place_host_cache(const llama_sfi_view & view, ggml_backend_sched_t sched, ggml_cgraph * gf);

// graph topology key of a KV cache context: 0 when SFI does not change the graph
uint64_t llama_sfi_graph_key(const llama_kv_cache_context * mctx);

void llama_sfi_build_inputs(ggml_context * ctx, const llama_kv_cache_context * mctx, const llama_ubatch & ubatch, llama_sfi_graph_input & inp);
void llama_sfi_set_inputs  (const llama_kv_cache_context * mctx, const llama_sfi_graph_input & inp);

// FAST: gather the selection (first step after it) and write the tail, for layer il
void llama_sfi_build_store(
        ggml_context * ctx,
         ggml_cgraph * gf,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
         ggml_tensor * k_cur,
         ggml_tensor * v_cur,
                 int   il);

// SLOW with the device Selector: gather the selection of the layers refreshed[first..last) for the streams s0 ..
// s0+ns-1 (their run of the Selector: own I32 [k_head, n_head_kv, nb] the cells it chose, pair b = rank*ns + stream)
// into the view: each row's own cells into slots 0 .. k_head-1, the shared ones (inp.shared) after them; the step
// wrote its own token's K/V to the cache before (every layer's store precedes the Selector)
void llama_sfi_build_load(
        ggml_context * ctx,
         ggml_cgraph * gf,
        const llama_sfi_view & view,
        const llama_sfi_graph_input  & inp,
            uint32_t   s0,
         ggml_tensor * own,
        const std::vector<size_t> & refreshed,
              size_t   first,
              size_t   last);
