#pragma once

// The export of a token computed on the CPU over a cache in host memory, from the queries a FAST step kept: the
// refresh of a context whose cache is in host memory runs off the decoding thread while the device decodes FAST steps

#include "llama-sfi.h"

#include <cstdint>
#include <vector>

struct llama_sfi_context;

struct llama_sfi_host_export {
    struct layer {
        const ggml_tensor * k = nullptr; // the cache's K of the layer, [n_embd_k_gqa, kv_size, n_stream]
        int64_t n_head    = 0;
        int64_t n_head_kv = 0;
        std::vector<float> q; // [n_embd_head, n_head] scaled
    };

    uint32_t stream      = 0;
    int64_t  n_embd_head = 0;
    int64_t  n_head_kv_max = 0;
    int64_t  n_kv        = 0; // cells read: the cache's first n_kv
    int64_t  n_cand      = 0; // candidates per layer (0: every cell)
    float    alpha       = 0.0f;
    float    softcap     = 0.0f;

    std::vector<layer> layers;
    std::vector<float> mask; // [n_kv]: 0 for the cells the token attended to, -inf for the others

    // the export, once computed: [n_layers][n_head_kv_max][n_cells], and the candidates [n_layers][n_cells]
    bool computed = false;
    int64_t n_cells = 0;
    std::vector<float>   evidence;
    std::vector<float>   key_norms;
    std::vector<int32_t> cells;
};

// the job of seq's captured queries (see llama_sfi_seq_host_export_begin); nullptr with *err set on failure
llama_sfi_host_export * llama_sfi_host_export_new(const llama_sfi_context & sfi, llama_seq_id seq, int32_t n_candidates, int32_t * err);
