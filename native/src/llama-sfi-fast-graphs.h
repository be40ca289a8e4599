#pragma once

// The FAST steps' own scheduler and graphs.
//
// llama.cpp reuses a graph (no rebuild, no allocation, its CUDA graph replayed as captured) only while it is the
// last one its scheduler computed. With one scheduler, the slow and the fast step would rebuild and re-allocate
// each other's graph at every switch, and the first fast step after a refresh would run uncaptured. A FAST step
// swaps these in for its decode instead, so that both graphs stay built.

#include "ggml-cpp.h"
#include "llama-graph.h"

#include <array>
#include <cstddef>

struct llama_context;

struct llama_sfi_fast_graphs {
    ggml_backend_sched_ptr sched; // made at the first FAST step, on the context's backends
    size_t max_nodes = 0;         // ... for graphs of at most this many nodes

    std::array<llm_graph_result_ptr, 2> gf_res_prev; // as llama_context's: by n_outputs > 0
    llm_graph_result * gf_res_prev_active = nullptr;

    // the context's graphs were reset (a reserve, a memory update): these cannot be reused either
    void reset();
};

// for the decode of a FAST step: the context's scheduler and previous graphs swapped with the fast ones, and back
// when the decode returns (a friend of llama_context)
struct llama_sfi_fast_graphs_scope {
    explicit llama_sfi_fast_graphs_scope(llama_context & lctx);
    ~llama_sfi_fast_graphs_scope();

    llama_sfi_fast_graphs_scope(const llama_sfi_fast_graphs_scope &) = delete;
    llama_sfi_fast_graphs_scope & operator=(const llama_sfi_fast_graphs_scope &) = delete;

private:
    void swap();

    llama_context & lctx;

    llama_sfi_fast_graphs * graphs = nullptr; // swapped in
};
