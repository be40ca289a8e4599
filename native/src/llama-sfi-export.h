#pragma once

// The attention of a layer with what SFI adds to it: the slow step's export of the layer

#include "ggml.h"

#include <functional>

class llama_kv_cache_context;
struct llama_hparams;
struct llama_sfi_graph_input;
struct llama_sfi_graph_result;

// build_attn_mha of q [n_embd_head, n_head, n_tokens] over k, v [.., ns] with kq_mask [n_kv, n_tps, 1, ns]
using llama_sfi_attn_fn = std::function<ggml_tensor * (ggml_tensor * q, ggml_tensor * k, ggml_tensor * v, ggml_tensor * kq_mask)>;

// the attention of layer il (attn over q, the cache's k and v and kq_mask) with what SFI adds to it: a SLOW ubatch
// exports the attention of its sequences' last query rows next to it; a MIXED one attends per run of streams of one
// step (FAST runs to their views, the others to the cache) and exports for its SLOW runs. Returns the attention's
// output [n_embd_v, n_tokens]: attn's, or the same values from an op that also gave the export
// (ggml_sfi_flash_attn_evidence, see llama_sfi_fused_attention)
ggml_tensor * llama_sfi_build_attn(
        ggml_context * ctx,
         ggml_cgraph * gf,
        llama_sfi_graph_result & res,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
        const llama_hparams & hparams,
         ggml_tensor * q,
         ggml_tensor * k,
         ggml_tensor * v,
         ggml_tensor * kq_mask,
         ggml_tensor * sinks,
               float   kq_scale,
                 int   il,
        const llama_sfi_attn_fn & attn);
