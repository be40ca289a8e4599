// The FAST steps' own scheduler and graphs, swapped into the context for their decodes, and the graphs kept per mix of steps
#include "llama-sfi-kept-graphs.h"

#include "llama-context.h"
#include "llama-sfi-context.h"
#include "llama-sfi-view.h"

#include <algorithm>
#include <utility>

void llama_sfi_fast_graphs::reset() {
    for (auto & res : gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    gf_res_prev_active = nullptr;
}

llm_graph_result * llama_sfi_kept_graphs::get(uint64_t key, size_t max_nodes, const llm_graph_result * active) {
    ++clock;

    entry * found  = nullptr;
    entry * oldest = nullptr;
    for (auto & e : entries) {
        if (e.key == key && e.res) {
            found = &e;
            break;
        }
        if (e.res.get() != active && (!oldest || e.last_use < oldest->last_use)) {
            oldest = &e;
        }
    }

    if (!found) {
        if (entries.size() < capacity || !oldest) {
            entries.emplace_back();
            found = &entries.back();
        } else {
            found = oldest;
        }
        found->key = key;
        found->res.reset(new llm_graph_result(max_nodes));
        found->allocated.clear();
        found->srcs.clear();
    } else if ((size_t) found->res->get_max_nodes() < max_nodes && found->res.get() != active) {
        found->res.reset(new llm_graph_result(max_nodes)); // the context reserved for larger graphs since
        found->allocated.clear();
        found->srcs.clear();
    }

    found->last_use = clock;

    return found->res.get();
}

llama_sfi_kept_graphs::entry * llama_sfi_kept_graphs::find(const llm_graph_result * res) {
    for (auto & e : entries) {
        if (e.res.get() == res) {
            return &e;
        }
    }
    return nullptr;
}

bool llama_sfi_kept_graphs::keeps(const llm_graph_result * res) const {
    return std::any_of(entries.begin(), entries.end(),
            [&](const entry & e) { return e.res.get() == res && ggml_graph_n_nodes(e.res->get_gf()) > 0; });
}

void llama_sfi_kept_graphs::built(const llm_graph_result * res) {
    entry * e = find(res);
    if (!e) {
        return;
    }

    // every tensor of the graph lives in the result's context (the weights and the cache are other contexts')
    ggml_context * ctx = e->res->get_ctx();

    e->allocated.clear();
    e->srcs.clear();
    for (ggml_tensor * t = ggml_get_first_tensor(ctx); t; t = ggml_get_next_tensor(ctx, t)) {
        if (!t->data) {
            e->allocated.push_back(t);
        }
        if (std::any_of(std::begin(t->src), std::end(t->src), [](const ggml_tensor * s) { return s != nullptr; })) {
            e->srcs.emplace_back(t, std::array<ggml_tensor *, GGML_MAX_SRC>{});
            std::copy(std::begin(t->src), std::end(t->src), e->srcs.back().second.begin());
        }
    }
}

void llama_sfi_kept_graphs::unallocate(const llm_graph_result * res) {
    entry * e = find(res);
    if (!e) {
        return;
    }

    for (ggml_tensor * t : e->allocated) {
        t->data   = nullptr;
        t->buffer = nullptr;
        t->extra  = nullptr;
    }
    for (const auto & [t, srcs] : e->srcs) {
        std::copy(srcs.begin(), srcs.end(), std::begin(t->src));
    }
}

void llama_sfi_kept_graphs::reset() {
    for (auto & e : entries) {
        if (e.res) {
            e.res->reset();
        }
        e.allocated.clear();
        e.srcs.clear();
    }
}

llama_sfi_fast_graphs_scope::llama_sfi_fast_graphs_scope(llama_context & lctx) : lctx(lctx) {
    auto * sfi = lctx.sfi.get();
    if (!sfi || sfi->view->step != LLAMA_SFI_STEP_FAST || !sfi->view->params.keep_graphs) {
        return;
    }

    auto & fast = sfi->fast_graphs;

    // the context's reserve sized its graphs; a reserve with more nodes (other adapters, a new SFI state) needs
    // a larger scheduler. No pipeline parallelism: a fast step decodes a token per sequence.
    const size_t max_nodes = lctx.get_gf_res_reserve()->get_max_nodes();
    if (!fast.sched || fast.max_nodes < max_nodes) {
        fast.reset();
        fast.sched.reset(ggml_backend_sched_new(lctx.backend_ptrs.data(), lctx.backend_buft.data(),
                lctx.backend_ptrs.size(), max_nodes, /*parallel =*/ false, lctx.cparams.op_offload));
        fast.max_nodes = max_nodes;
    }

    graphs = &fast;
    swap();
}

llama_sfi_fast_graphs_scope::~llama_sfi_fast_graphs_scope() {
    if (graphs) {
        swap();
    }
}

void llama_sfi_fast_graphs_scope::swap() {
    std::swap(lctx.sched,              graphs->sched);
    std::swap(lctx.gf_res_prev,        graphs->gf_res_prev);
    std::swap(lctx.gf_res_prev_active, graphs->gf_res_prev_active);
}
