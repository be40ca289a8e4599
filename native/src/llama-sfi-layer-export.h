#pragma once

// One layer's export in the slow step's graph: what the export (llama-sfi-export.cpp) and the device Selector
// (llama-sfi-selector.cpp) build from, and the ops both use

#include "ggml.h"

#include <cstdint>
#include <vector>

struct llama_sfi_graph_input;
struct llama_sfi_graph_result;
struct llama_sfi_run_export;
struct llama_sfi_view;

// one layer's export: what every kind of export starts from
struct llama_sfi_layer_export {
    ggml_context * ctx;
    ggml_cgraph  * gf;

    const llama_sfi_view        & view;
    const llama_sfi_graph_input & inp; // its SLOW inputs: the run's streams
    llama_sfi_run_export        & res;
    llama_sfi_graph_result      & graph;

    int32_t  i;  // covered layer
    int      il; // model layer
    uint32_t s0; // the first stream of the run (its streams are consecutive)

    int64_t n_kv;
    int64_t n_head;
    int64_t n_head_kv;
    int64_t ns;     // streams of the run
    int64_t n_tps;  // tokens per stream
    int64_t n_rows; // query rows per stream: its last n_rows tokens
    int64_t n_cand; // candidates per stream (0: every cell)

    float cap;      // soft cap of the scores (0: none)
    float max_bias; // ALiBi

    ggml_tensor * q;     // [n_embd_head, n_rows*n_gqa, n_head_kv, ns] the scaled queries of the query rows
    ggml_tensor * k;     // [n_embd_head, n_head_kv, n_kv, ns] the keys the attention read
    ggml_tensor * mask;  // [n_kv, n_rows, 1, ns] the attention's mask of the query rows
    ggml_tensor * sinks; // the layer's attention sinks (nullptr: none)
    ggml_tensor * kn;    // [n_head_kv, kv_size, ns] the key norms of every cell (nullptr: none exported)

    // the scores of a product kq [n_kv, n_rows*n_gqa, n_head_kv, nb] of keys and scaled queries, or of a layer's keys
    // and queries: [n_kv, n_rows, n_head, nb], capped like flash attention's
    ggml_tensor * scores(ggml_tensor * kq) const;
    ggml_tensor * scores(ggml_tensor * k_l, ggml_tensor * q_l) const;

    // the attention's probabilities of scores [n_kv, n_rows, n_head, nb] (of nb/ns stacked layers: they share the
    // mask), with the sinks of their one layer (nullptr: none, or several layers)
    ggml_tensor * softmax(ggml_tensor * kq, ggml_tensor * sinks_l) const;

    // t as this layer's output dst[i], named name-il
    void output(ggml_tensor * t, const char * name, std::vector<ggml_tensor *> & dst) const;
};

// p: [n_kv, n_rows, n_head, ns] -> [n_kv, 1, n_head_kv, ns], the sum over the rows and the GQA group
//   by halving, with adds of strided views that keep the cells contiguous: a permute + sum_rows summed
//   one tiny row per cell and took longer than the attention itself (0.7 ms per layer at 128K cells, H200)
ggml_tensor * llama_sfi_group_sum(ggml_context * ctx, ggml_tensor * p, int64_t n_head_kv);

// p^alpha
ggml_tensor * llama_sfi_pow(ggml_context * ctx, ggml_tensor * p, float alpha);

// ts joined along dim, in order: with storage, by one copy of each where its backend can (pad, then set in place),
// else by a tree of concats (log2(n) copies of the whole instead of n)
ggml_tensor * llama_sfi_stack(ggml_context * ctx, std::vector<ggml_tensor *> ts, int dim, const ggml_tensor * storage = nullptr);

// kn [n_head_kv, kv_size, ns] (llama_sfi_layer_export::kn) at the cells I32 [n, ns] of each stream -> [n, n_head_kv, ns]
ggml_tensor * llama_sfi_key_norms_at(ggml_context * ctx, ggml_tensor * kn, ggml_tensor * cells);
