// The export of a token computed on the CPU over a cache in host memory, from the queries a FAST step kept
#include "llama-sfi-host-export.h"

#include "llama-sfi-context.h"
#include "llama-sfi-view.h"

#include "llama-model.h"

#include "ggml-alloc.h"
#include "ggml-backend.h"
#include "ggml-cpp.h"
#include "ggml-sfi.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>

llama_sfi_host_export * llama_sfi_host_export_new(const llama_sfi_context & sfi, llama_seq_id seq, int32_t n_candidates, int32_t * err) {
    const auto & view = *sfi.view;

    auto fail = [&](int32_t e) -> llama_sfi_host_export * {
        if (err) {
            *err = e;
        }
        return nullptr;
    };

    const uint32_t s     = view.stream_of(seq);
    const auto &   qs    = sfi.queries[s];
    const auto &   cells = view.kv.get_cells(seq);

    if (!qs.valid || cells.seq_pos_max(seq) != qs.pos) {
        return fail(LLAMA_SFI_ERR_NO_QUERIES); // (a decode since, or an edit that removed the token)
    }
    if (sfi.params.evidence_alpha <= 0.0f) {
        return fail(LLAMA_SFI_ERR_UNSUPPORTED);
    }
    for (const auto & l : view.layers) {
        const ggml_tensor * k = view.cache_k_of(l.il);
        if (!k->buffer || !ggml_backend_buffer_is_host(k->buffer) || sfi.model.layers[l.il].attn_sinks) {
            return fail(LLAMA_SFI_ERR_UNSUPPORTED);
        }
    }

    auto * job = new llama_sfi_host_export();

    job->stream        = s;
    job->n_embd_head   = qs.n_embd_head;
    job->n_head_kv_max = view.n_head_kv_max;
    job->n_kv          = std::min<int64_t>(cells.size(), (int64_t) GGML_PAD(cells.used_max_p1(), LLAMA_SFI_PAD));
    job->n_cand        = n_candidates > 0 && n_candidates < job->n_kv ? n_candidates : 0;
    job->alpha         = sfi.params.evidence_alpha;
    job->softcap       = sfi.model.hparams.attn_soft_cap ? sfi.model.hparams.f_attn_logit_softcapping : 0.0f;

    job->layers.resize(view.layers.size());
    for (size_t i = 0; i < view.layers.size(); ++i) {
        auto & l = job->layers[i];
        l.k         = view.cache_k_of(view.layers[i].il);
        l.n_head    = qs.n_head[i];
        l.n_head_kv = view.layers[i].n_head_kv;
        l.q         = qs.q[i];
    }

    // the cells the token attended to: those of seq up to its position (SFI's caches have no SWA)
    const std::vector<uint8_t> holding = llama_sfi_cells_holding(cells, seq, 0, qs.pos + 1);
    job->mask.resize(job->n_kv);
    for (int64_t c = 0; c < job->n_kv; ++c) {
        job->mask[c] = holding[c] ? 0.0f : -INFINITY;
    }

    if (err) {
        *err = 0;
    }
    return job;
}

// the job's graph on a CPU backend: per layer, ggml_sfi_evidence of the queries over the keys with their norms, then
// (candidates) the n_cand cells with the most evidence summed over the KV heads, as a SLOW step's export takes them
static int32_t llama_sfi_host_export_run(llama_sfi_host_export & job, int32_t n_threads) {
    ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
    ggml_backend_ptr cpu(dev ? ggml_backend_dev_init(dev, nullptr) : nullptr);
    if (!cpu) {
        return LLAMA_SFI_ERR_ALLOC;
    }
    auto * set_n_threads = (ggml_backend_set_n_threads_t) ggml_backend_reg_get_proc_address(ggml_backend_dev_backend_reg(dev), "ggml_backend_set_n_threads");
    if (set_n_threads) {
        set_n_threads(cpu.get(), n_threads);
    }

    const size_t n_layers  = job.layers.size();
    const size_t n_tensors = 24*n_layers + 8;

    ggml_init_params ip = {
        /*.mem_size   =*/ ggml_tensor_overhead()*n_tensors + ggml_graph_overhead_custom(n_tensors, false),
        /*.mem_buffer =*/ nullptr,
        /*.no_alloc   =*/ true,
    };
    ggml_context_ptr ctx_ptr(ggml_init(ip));
    ggml_context * ctx = ctx_ptr.get();
    if (!ctx) {
        return LLAMA_SFI_ERR_ALLOC;
    }
    ggml_cgraph * gf = ggml_new_graph_custom(ctx, n_tensors, false);

    const int64_t D    = job.n_embd_head;
    const int64_t n_kv = job.n_kv;

    ggml_tensor * mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, n_kv, 1, 1, 1);
    ggml_set_input(mask);

    std::vector<ggml_tensor *> qs(n_layers), evs(n_layers), kns(n_layers), cands(n_layers, nullptr);
    for (size_t i = 0; i < n_layers; ++i) {
        const auto &  l = job.layers[i];
        ggml_tensor * k = const_cast<ggml_tensor *>(l.k);

        qs[i] = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, D, l.n_head/l.n_head_kv, l.n_head_kv, 1);
        ggml_set_input(qs[i]);

        // [n_embd_head, n_kv, n_head_kv, 1] of the stream
        ggml_tensor * k_s = ggml_view_4d(ctx, k, D, n_kv, l.n_head_kv, 1, k->nb[1], ggml_row_size(k->type, D), k->nb[2],
                job.stream*k->nb[2]);

        ggml_tensor * res  = ggml_sfi_evidence(ctx, qs[i], k_s, mask, 1, job.alpha, job.softcap, true);
        ggml_tensor * evid = ggml_reshape_2d(ctx, ggml_sfi_evidence_values(ctx, res), n_kv, l.n_head_kv);
        ggml_tensor * kn   = ggml_reshape_2d(ctx, ggml_sfi_evidence_key_norms(ctx, res), l.n_head_kv, n_kv);

        if (job.n_cand > 0) {
            ggml_tensor * rows  = ggml_cont(ctx, ggml_transpose(ctx, evid)); // [n_head_kv, n_kv]: one row per cell
            ggml_tensor * score = ggml_reshape_2d(ctx, ggml_sum_rows(ctx, rows), n_kv, 1);
            ggml_tensor * cells = ggml_reshape_1d(ctx, ggml_sfi_top_k(ctx, score, (int) job.n_cand), job.n_cand);

            evs[i]   = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, rows, cells))); // [n_cand, n_head_kv]
            kns[i]   = ggml_cont(ctx, ggml_transpose(ctx, ggml_get_rows(ctx, kn,   cells)));
            cands[i] = cells;
        } else {
            evs[i] = ggml_cont(ctx, evid);
            kns[i] = ggml_cont(ctx, ggml_transpose(ctx, kn)); // [n_kv, n_head_kv]
        }
        for (ggml_tensor * t : { evs[i], kns[i], cands[i] }) {
            if (t) {
                ggml_set_output(t);
                ggml_build_forward_expand(gf, t);
            }
        }
    }

    ggml_gallocr_ptr galloc(ggml_gallocr_new(ggml_backend_get_default_buffer_type(cpu.get())));
    if (!galloc || !ggml_gallocr_alloc_graph(galloc.get(), gf)) {
        return LLAMA_SFI_ERR_ALLOC;
    }

    ggml_backend_tensor_set(mask, job.mask.data(), 0, ggml_nbytes(mask));
    for (size_t i = 0; i < n_layers; ++i) {
        GGML_ASSERT(job.layers[i].q.size()*sizeof(float) == ggml_nbytes(qs[i]));
        ggml_backend_tensor_set(qs[i], job.layers[i].q.data(), 0, ggml_nbytes(qs[i]));
    }

    if (ggml_backend_graph_compute(cpu.get(), gf) != GGML_STATUS_SUCCESS) {
        return LLAMA_SFI_ERR_ALLOC;
    }

    const int64_t n_cells = job.n_cand > 0 ? job.n_cand : n_kv;
    const int64_t H       = job.n_head_kv_max;

    job.n_cells = n_cells;
    job.evidence .assign(n_layers*H*n_cells, 0.0f);
    job.key_norms.assign(n_layers*H*n_cells, 0.0f);
    job.cells    .assign(job.n_cand > 0 ? n_layers*n_cells : 0, 0);
    for (size_t i = 0; i < n_layers; ++i) {
        ggml_backend_tensor_get(evs[i], job.evidence .data() + i*H*n_cells, 0, ggml_nbytes(evs[i]));
        ggml_backend_tensor_get(kns[i], job.key_norms.data() + i*H*n_cells, 0, ggml_nbytes(kns[i]));
        if (cands[i]) {
            ggml_backend_tensor_get(cands[i], job.cells.data() + i*n_cells, 0, ggml_nbytes(cands[i]));
        }
    }
    job.computed = true;

    return 0;
}

int32_t llama_sfi_host_export_compute(struct llama_sfi_host_export * job, int32_t n_threads) {
    if (!job || n_threads < 1) {
        return LLAMA_SFI_ERR_BAD_ARG;
    }
    try {
        return llama_sfi_host_export_run(*job, n_threads);
    } catch (const std::exception &) {
        return LLAMA_SFI_ERR_ALLOC;
    }
}

// the job's values of member, [n_layers][n_head_kv][n_cells], once computed
static const float * llama_sfi_host_export_values(const llama_sfi_host_export * job, std::vector<float> llama_sfi_host_export::* member,
        int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    const bool ok = job && job->computed;
    if (n_layers)  { *n_layers  = ok ? (int32_t) job->layers.size() : 0; }
    if (n_head_kv) { *n_head_kv = ok ? (int32_t) job->n_head_kv_max : 0; }
    if (n_cells)   { *n_cells   = ok ? (int32_t) job->n_cells : 0; }
    return ok ? (job->*member).data() : nullptr;
}

const float * llama_sfi_host_export_evidence(const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    return llama_sfi_host_export_values(job, &llama_sfi_host_export::evidence, n_layers, n_head_kv, n_cells);
}

const float * llama_sfi_host_export_key_norms(const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_head_kv, int32_t * n_cells) {
    return llama_sfi_host_export_values(job, &llama_sfi_host_export::key_norms, n_layers, n_head_kv, n_cells);
}

const int32_t * llama_sfi_host_export_candidates(const struct llama_sfi_host_export * job, int32_t * n_layers, int32_t * n_cells) {
    const bool ok = job && job->computed && !job->cells.empty();
    if (n_layers) { *n_layers = ok ? (int32_t) job->layers.size() : 0; }
    if (n_cells)  { *n_cells  = ok ? (int32_t) job->n_cells : 0; }
    return ok ? job->cells.data() : nullptr;
}

void llama_sfi_host_export_free(struct llama_sfi_host_export * job) {
    delete job;
}
