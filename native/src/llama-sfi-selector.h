#pragma once

// The device Selector in the slow step's graph

#include "ggml.h"

#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

struct llama_sfi_graph_input;
struct llama_sfi_view;

// the evidence sum_r p_r^alpha [n_kv, 1, n_head_kv, n*ns] of n layers (layer-major) from their scaled scores,
// scores(a, b) = those of layers a .. b-1 stacked [n_kv, n_rows, n_head, (b - a)*ns] (rows = n_rows*n_head*ns per
// layer), with the softmaxes of several layers stacked (scores with sinks, a per-layer tensor, take theirs one
// layer at a time)
ggml_tensor * llama_sfi_build_evidence(
        ggml_context * ctx,
              size_t   n,
             int64_t   rows,
        const std::function<ggml_tensor * (size_t, size_t)> & scores,
        const std::vector<ggml_tensor *> & sinks,
         ggml_tensor * mask,
               float   max_bias,
               float   alpha,
             int64_t   n_head_kv);

// the evidence [n_kv, 1, n_head_kv, n*ns] of n layers as ggml_sfi_evidence ops: qs[l] the layers' scaled queries
// [n_embd_head, n_q, n_head_kv, ns], k4 the keys of all n as [n_embd_head, n_kv, n_head_kv, n] (one op; ns 1) or
// nullptr, ks[l] then each layer's [n_embd_head, n_head_kv, n_kv, ns] (one op per layer); nullptr when the backend of
// the keys lacks the op
ggml_tensor * llama_sfi_build_evidence_fused(
        ggml_context * ctx,
        const std::vector<ggml_tensor *> & qs,
         ggml_tensor * k4,
        const std::vector<ggml_tensor *> & ks,
         ggml_tensor * storage,
         ggml_tensor * mask,
             int64_t   n_rows,
               float   alpha,
               float   cap);

// the SFI Selector (sfi_gguf/selector.py, SFISelector) over the evidence of n layers of the same shape, for
// every stream of the ubatch, as one set of ops on the layers stacked (layer-major: batch b = layer*ns + stream):
// per layer ops were thousands of small kernels, and softmaxes and sums over a few long rows used a few
// multiprocessors of a GPU
//   evid [n_kv, 1, n_head_kv, n*ns] (sum_r p_r^alpha, llama_sfi_build_evidence), kns[l] the layers' key norms
//   [n_head_kv, kv_size, ns] (llama_sfi_key_norms)
//   returns the candidate cells I32 [n_cand, n*ns] and the picks I32 [k_head, n_head_kv, n*ns] (indices into them)
std::pair<ggml_tensor *, ggml_tensor *> llama_sfi_build_selector(
        ggml_context * ctx,
        const llama_sfi_view & view,
        const llama_sfi_graph_input & inp,
         ggml_tensor * evid,
        const std::vector<ggml_tensor *> & kns,
             int64_t   n_cand,
             int64_t   n_rows);
