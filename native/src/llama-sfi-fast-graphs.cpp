// The FAST steps' own scheduler and graphs, swapped into the context for their decodes
#include "llama-sfi-fast-graphs.h"

#include "llama-context.h"
#include "llama-sfi-context.h"
#include "llama-sfi-view.h"

#include <utility>

void llama_sfi_fast_graphs::reset() {
    for (auto & res : gf_res_prev) {
        if (res) {
            res->reset();
        }
    }
    gf_res_prev_active = nullptr;
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
