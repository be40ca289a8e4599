#pragma once

// The slow step's export (and the reductions the device Selector shares with it)

#include "ggml.h"

#include <cstdint>
#include <vector>

class llama_kv_cache_context;
struct llama_hparams;
struct llama_sfi_graph_input;
struct llama_sfi_graph_result;

// SLOW: export the attention mass of the last query rows (next to flash attention), for layer il
void llama_sfi_build_export(
        ggml_context * ctx,
         ggml_cgraph * gf,
        llama_sfi_graph_result & res,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
        const llama_hparams & hparams,
         ggml_tensor * q_cur,
         ggml_tensor * k,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
                 int   il);

// p: [n_kv, n_rows, n_head, ns] -> [n_kv, 1, n_head_kv, ns], the sum over the rows and the GQA group
//   by halving, with adds of strided views that keep the cells contiguous: a permute + sum_rows summed
//   one tiny row per cell and took longer than the attention itself (0.7 ms per layer at 128K cells, H200)
ggml_tensor * llama_sfi_group_sum(ggml_context * ctx, ggml_tensor * p, int64_t n_head_kv);

// ts joined along dim, in order, by a tree of concats (log2(n) copies of the whole instead of n)
ggml_tensor * llama_sfi_stack(ggml_context * ctx, std::vector<ggml_tensor *> ts, int dim);

// kn [n_head_kv, kv_size, ns] (llama_sfi_key_norms) at the cells I32 [n, ns] of each stream -> [n, n_head_kv, ns]
ggml_tensor * llama_sfi_key_norms_at(ggml_context * ctx, ggml_tensor * kn, ggml_tensor * cells);

// p^alpha
ggml_tensor * llama_sfi_pow(ggml_context * ctx, ggml_tensor * p, float alpha);
