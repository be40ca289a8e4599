#pragma once

// The FAST steps' own scheduler and graphs, and the graphs of SLOW and MIXED ubatches kept per mix of steps.
//
// llama.cpp reuses a graph (no rebuild, no allocation, its CUDA graph replayed as captured) only while it is the
// last one its scheduler computed. With one scheduler, the slow and the fast step would rebuild and re-allocate
// each other's graph at every switch, and the first fast step after a refresh would run uncaptured. A FAST step
// swaps these in for its decode instead, so that both graphs stay built.

#include "ggml-cpp.h"
#include "llama-graph.h"

#include <array>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

struct llama_context;

struct llama_sfi_fast_graphs {
    ggml_backend_sched_ptr sched; // made at the first FAST step, on the context's backends
    size_t max_nodes = 0;         // ... for graphs of at most this many nodes

    std::array<llm_graph_result_ptr, 2> gf_res_prev; // as llama_context's: by n_outputs > 0
    llm_graph_result * gf_res_prev_active = nullptr;

    // the context's graphs were reset (a reserve, a memory update): these cannot be reused either
    void reset();
};

// The graphs of the SLOW and MIXED ubatches, by their mix of steps (llama_sfi_graph_key).
//
// A MIXED ubatch's topology is its runs of streams of one step, so when the sequences of a batch refresh at
// different steps (a server's requests do), the next ubatch's graph is rarely the last one built: llama.cpp would
// rebuild it, allocate it and run it uncaptured at every step. These keep the last few built, and a decode whose
// ubatch has the key of one takes it (llama_context::process_ubatch); the context's scheduler allocates it again
// when another graph was allocated since, which costs far less than building it.
struct llama_sfi_kept_graphs {
    struct entry {
        uint64_t             key      = 0;
        uint64_t             last_use = 0;
        llm_graph_result_ptr res;

        std::vector<ggml_tensor *> allocated; // the tensors of its graph the scheduler allocates (no data when built)

        // the sources of its graph's tensors as built: splitting a graph over backends points a node's sources at
        // the scheduler's copies of them (inputs of another backend), which live until the scheduler splits again
        std::vector<std::pair<ggml_tensor *, std::array<ggml_tensor *, GGML_MAX_SRC>>> srcs;
    };

    std::vector<entry> entries;
    size_t   capacity = 0;
    uint64_t clock    = 0;

    // the graph for a ubatch of this key: the one kept for it, else a new one, else the least recently used one that is
    // not active (the context's last allocated graph), emptied
    llm_graph_result * get(uint64_t key, size_t max_nodes, const llm_graph_result * active);

    // res is one of these and holds a built graph
    bool keeps(const llm_graph_result * res) const;

    // res was built (llama_context::process_ubatch): if it is one of these, note which tensors the scheduler allocates
    void built(const llm_graph_result * res);

    // before res is allocated again: its scheduler-allocated tensors without data or buffer again (the scheduler's
    // buffers may have been freed or moved since, and tensors with data count as allocated elsewhere), and its nodes'
    // sources as built (not the copies of the last split)
    void unallocate(const llm_graph_result * res);

    // the context's graphs were reset: empty these too (they stay allocated, so no pointer to one dangles)
    void reset();

private:
    entry * find(const llm_graph_result * res);
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
