// The SFI graph of a ubatch: its inputs, the FAST step's gather of a selection and writes of the tail, and the SLOW
// step's gather of the device Selector's selection
#include "llama-sfi-ubatch-graph.h"

#include "llama-sfi-view.h"

#include "llama-batch.h"
#include "llama-kv-cache.h"

#include "ggml-backend.h"
#include "ggml-sfi.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>

//
// SFI ops or their composite definition
//

// an SFI op runs where the tensor it reads (storage) is, when that backend has it; RPC reports every op as supported
// without asking its server, so it keeps the composite ops. Without params.fused_ops, every backend keeps them (for
// comparisons, and to check the graph a backend without the ops builds).
bool llama_sfi_backend_runs(const llama_sfi_params & params, const ggml_tensor * op, const ggml_tensor * storage) {
    return params.fused_ops && llama_sfi_backend_has(op, storage);
}

bool llama_sfi_backend_has(const ggml_tensor * op, const ggml_tensor * storage) {
    if (storage->view_src) {
        storage = storage->view_src; // a view built for the graph has no buffer of its own yet
    }
    if (!storage->buffer) {
        return false;
    }
    ggml_backend_buffer_type_t buft = ggml_backend_buffer_get_type(storage->buffer);
    ggml_backend_dev_t dev = ggml_backend_buft_get_device(buft);
    if (!dev && ggml_backend_buft_is_host(buft)) {
        dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU); // the CPU buffer type names no device
    }
    if (!dev || strcmp(ggml_backend_reg_name(ggml_backend_dev_backend_reg(dev)), "RPC") == 0) {
        return false;
    }
    return ggml_backend_dev_supports_op(dev, op);
}

ggml_tensor * llama_sfi_top_k(ggml_context * ctx, const llama_sfi_params & params, ggml_tensor * a, int k,
        bool sorted_fallback, const ggml_tensor * storage) {
    ggml_tensor * t = ggml_sfi_top_k(ctx, a, k);
    if (llama_sfi_backend_runs(params, t, storage)) {
        return t;
    }
    return sorted_fallback ? ggml_cont(ctx, ggml_argsort_top_k(ctx, a, k)) : ggml_top_k(ctx, a, k);
}

static ggml_backend_buffer_t llama_sfi_buffer_of(const ggml_tensor * t) {
    return t->view_src ? t->view_src->buffer : t->buffer;
}

// dst [ne0, n, ne2, ne3] = the rows idx [n, ne2, ne3] of src [ne0, cells, ne2, ne3], whole rows in src's type
static void llama_sfi_gather_rows(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * src = dst->src[0];
    const ggml_tensor * idx = dst->src[1];

    const int64_t n      = dst->ne[1];
    const int64_t n_rows = n*dst->ne[2]*dst->ne[3];
    const size_t  row    = ggml_row_size(src->type, src->ne[0]);

    // a contiguous range of the output's rows per thread
    const int64_t r0 = n_rows*ith/nth;
    const int64_t r1 = n_rows*(ith + 1)/nth;
    for (int64_t r = r0; r < r1; ++r) {
        const int64_t i = r % n;
        const int64_t j = r / n % dst->ne[2];
        const int64_t l = r / n / dst->ne[2];

        const int32_t c = *(const int32_t *) ((const char *) idx->data + i*idx->nb[0] + j*idx->nb[1] + l*idx->nb[2]);
        memcpy((char *) dst->data + i*dst->nb[1] + j*dst->nb[2] + l*dst->nb[3],
               (const char *) src->data + c*src->nb[1] + j*src->nb[2] + l*src->nb[3], row);
    }
}

ggml_tensor * llama_sfi_copy_rows(ggml_context * ctx, const llama_sfi_params & params, ggml_tensor * dst,
        ggml_tensor * src, ggml_tensor * idx, ggml_tensor * slots, int64_t slot0) {
    ggml_tensor * t = ggml_sfi_copy_rows(ctx, dst, src, idx, slots);

    // from a cache in host memory into a view on a device: the rows are gathered on the CPU (pinned there by
    // llama_sfi_place_host_cache) and the scheduler copies them to the device in one transfer
    ggml_backend_buffer_t buf_src = llama_sfi_buffer_of(src);
    ggml_backend_buffer_t buf_dst = llama_sfi_buffer_of(dst);
    const bool across = buf_src && buf_dst && ggml_backend_buffer_is_host(buf_src) != ggml_backend_buffer_is_host(buf_dst);

    if (across && ggml_backend_buffer_is_host(buf_src) && src->type == dst->type && !ggml_is_quantized(src->type) &&
            src->nb[0] == ggml_type_size(src->type) && idx->type == GGML_TYPE_I32 && idx->ne[1] == src->ne[2] &&
            idx->ne[2] == src->ne[3]) {
        // the rows in the cache's type (get_rows gives F32 rows: twice the bytes of an F16 cache to copy), then one copy
        // into the slots, which follow each other (a quantized cache keeps get_rows: not every device copies quantized
        // rows into a strided view)
        ggml_tensor * args[] = { src, idx };
        ggml_tensor * rows = ggml_custom_4d(ctx, src->type, src->ne[0], idx->ne[0], src->ne[2], src->ne[3], args, 2,
                llama_sfi_gather_rows, GGML_N_TASKS_MAX, nullptr);
        ggml_tensor * into = ggml_view_4d(ctx, dst, dst->ne[0], idx->ne[0], dst->ne[2], dst->ne[3],
                dst->nb[1], dst->nb[2], dst->nb[3], slot0*dst->nb[1]);
        return ggml_set_name(ggml_cpy(ctx, rows, into), "sfi_gather");
    }

    if (across || !llama_sfi_backend_runs(params, t, src)) {
        // get_rows gives F32 rows: lossless for F16/BF16; for Q8_0/Q4_x, dequantize -> quantize gives back the same blocks
        t = ggml_set_rows(ctx, dst, ggml_get_rows(ctx, src, idx), slots);
    }
    return ggml_set_name(t, "sfi_gather");
}

void llama_sfi_place_host_cache(const llama_sfi_view & view, ggml_backend_sched_t sched, ggml_cgraph * gf) {
    if (!view.cache_on_host) {
        return;
    }

    ggml_backend_t cpu = nullptr;
    for (int i = 0; i < ggml_backend_sched_get_n_backends(sched); ++i) {
        ggml_backend_t b = ggml_backend_sched_get_backend(sched, i);
        if (ggml_backend_dev_type(ggml_backend_get_device(b)) == GGML_BACKEND_DEVICE_TYPE_CPU) {
            cpu = b;
        }
    }
    GGML_ASSERT(cpu && "a cache in host memory needs the CPU backend");

    std::vector<ggml_backend_buffer_t> cache_bufs;
    for (const auto & l : view.layers) {
        for (const ggml_tensor * t : { view.cache_k_of(l.il), view.cache_v_of(l.il), l.kn }) {
            if (std::find(cache_bufs.begin(), cache_bufs.end(), t->buffer) == cache_bufs.end()) {
                cache_bufs.push_back(t->buffer);
            }
        }
    }
    auto in_cache = [&](const ggml_tensor * t) {
        ggml_backend_buffer_t buf = llama_sfi_buffer_of(t);
        return buf && std::find(cache_bufs.begin(), cache_bufs.end(), buf) != cache_bufs.end();
    };

    int n_readers = 0;
    for (int i = 0; i < ggml_graph_n_nodes(gf); ++i) {
        ggml_tensor * node = ggml_graph_node(gf, i);
        if (ggml_is_empty(node) || in_cache(node)) {
            continue; // (a write into the cache runs where the cache is anyway)
        }
        switch (node->op) {
            case GGML_OP_NONE: case GGML_OP_VIEW: case GGML_OP_RESHAPE: case GGML_OP_PERMUTE: case GGML_OP_TRANSPOSE:
                continue;
            default:
                break;
        }
        bool reads = false;
        for (int j = 0; j < GGML_MAX_SRC && !reads; ++j) {
            reads = node->src[j] && in_cache(node->src[j]);
        }
        if (!reads) {
            continue;
        }
        ++n_readers;
        if (node->op == GGML_OP_FLASH_ATTN_EXT && node->src[0]->ne[1] >= LLAMA_SFI_HOST_ATTN_MAX_TOKENS) {
            continue;
        }
        ggml_backend_sched_set_tensor_backend(sched, node, cpu);
    }

    if (n_readers == 0) {
        // a step that reads no cell of the cache (FAST) only writes its tokens' K/V there: those writes go last, so
        // that the device computes the whole step and then copies the rows to the host once (a write between two
        // layers would make the device wait for the host at every layer). Nothing reads them, so the order stays
        // a topological one.
        ggml_tensor ** nodes = ggml_graph_nodes(gf);
        std::stable_partition(nodes, nodes + ggml_graph_n_nodes(gf), [&](const ggml_tensor * t) { return !in_cache(t); });
    }
}

//
// inputs
//

bool llama_sfi_run_export::has_selection() const {
    return std::any_of(sel.begin(), sel.end(), [](const ggml_tensor * t) { return t != nullptr; });
}

uint64_t llama_sfi_graph_key(const llama_kv_cache_context * mctx) {
    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (!plan) {
        return 0;
    }

    const auto * view = &plan->view;

    uint64_t key = 0;
    auto mix = [&](uint64_t x) { key = key*1099511628211ull ^ x; };

    if (plan->mixed()) {
        // the runs of streams of one step, and the slots the FAST ones attend
        mix(LLAMA_SFI_STEP_MIXED);
        for (const auto & run : plan->runs) {
            mix((uint64_t) run.step | (uint64_t) run.n << 2);
        }
        mix(plan->n_view);
    }

    if (plan->stores()) {
        // the gathers (which streams, how many cells) are part of the topology
        mix(LLAMA_SFI_STEP_FAST);
        for (const uint32_t s : plan->gathering) {
            const auto & st = view->streams[s];
            mix(4 | (uint64_t) s << 4 | (uint64_t) st.n_sel << 12);
        }
    }

    if (plan->capturing) {
        mix(LLAMA_SFI_STEP_FAST | 1u << 8); // (its queries are outputs)
    }

    if (plan->exporting) {
        // the Selector's parameters are constants of the graph
        const uint64_t selector = view->selector.k_head > 0 ? 1 + (uint64_t) (view->selector_gen & 0xffffff) : 0;

        // ... and so are the layers it refreshes
        const uint64_t groups = selector ? (uint64_t) view->refresh_groups << 16 | view->refresh_group : 0;

        // ... and the number of cells whose key norms it takes
        const uint64_t n_kn = plan->kn_cells.size();

        // ... and whether it gathers the selection
        const uint64_t gathers = view->n_candidates > 0 && view->gathers(std::min<int64_t>(view->n_candidates, mctx->get_n_kv()));

        // ... and the query rows of the export
        const uint64_t n_rows = view->n_query_rows;

        mix(LLAMA_SFI_STEP_SLOW);
        for (const uint64_t x : { (uint64_t) view->n_candidates, selector, groups, n_kn, gathers, n_rows }) {
            mix(x);
        }
    }

    return key;
}

void llama_sfi_build_inputs(ggml_context * ctx, const llama_kv_cache_context * mctx, const llama_ubatch & ubatch, llama_sfi_graph_input & inp) {
    inp.key = llama_sfi_graph_key(mctx);

    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (!plan) {
        return;
    }

    const auto * view = &plan->view;

    if (plan->exporting) {
        const int64_t n_kv = mctx->get_n_kv();
        const int64_t ns   = ubatch.n_seqs_unq;

        if (view->n_candidates > 0 && view->selects(std::min<int64_t>(view->n_candidates, n_kv))) {
            inp.sel_mask = ggml_new_tensor_4d(ctx, GGML_TYPE_F32, n_kv, 1, 1, ns);
            ggml_set_input(inp.sel_mask);
            ggml_set_name(inp.sel_mask, "sfi_inp_sel_mask");

            inp.sel_u = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, 1, n_kv, ns);
            ggml_set_input(inp.sel_u);
            ggml_set_name(inp.sel_u, "sfi_inp_sel_u");

            if (view->gathers(std::min<int64_t>(view->n_candidates, n_kv))) {
                const int64_t n_shared = view->selector.n_sink + view->selector.n_recent;

                const int64_t n_rep = std::max<int64_t>(view->n_head_kv_max, view->layers.size());

                inp.shared = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, n_shared, n_rep, ns);
                ggml_set_input(inp.shared);
                ggml_set_name(inp.shared, "sfi_inp_shared");

                inp.sel_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, view->selector.k_head + n_shared);
                ggml_set_input(inp.sel_slots);
                ggml_set_name(inp.sel_slots, "sfi_inp_sel_slots");
            }
        }

        if (!plan->kn_cells.empty()) {
            inp.kn_cells = ggml_new_tensor_1d(ctx, GGML_TYPE_I32, plan->kn_cells.size());
            ggml_set_input(inp.kn_cells);
            ggml_set_name(inp.kn_cells, "sfi_inp_kn_cells");
        }
    }

    if (!plan->stores()) {
        return;
    }

    if (plan->mixed()) {
        // the kq_mask's type: F16 with flash attention (the view then holds V as the cache does, not transposed)
        const int64_t ns = ubatch.n_seqs_unq;

        inp.fast_mask = ggml_new_tensor_4d(ctx, view->v_trans ? GGML_TYPE_F32 : GGML_TYPE_F16, plan->n_view, ubatch.n_tokens/ns, 1, ns);
        ggml_set_input(inp.fast_mask);
        ggml_set_name(inp.fast_mask, "sfi_inp_fast_mask");
    }

    inp.tail_idxs = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, ubatch.n_tokens);
    ggml_set_input(inp.tail_idxs);
    ggml_set_name(inp.tail_idxs, "sfi_inp_tail_idxs");

    if (view->v_trans) {
        inp.tail_idxs_v = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, (int64_t) ubatch.n_tokens*view->layers[0].v->ne[0]);
        ggml_set_input(inp.tail_idxs_v);
        ggml_set_name(inp.tail_idxs_v, "sfi_inp_tail_idxs_v");
    }

    int32_t n_sel_max = inp.sel_slots ? (int32_t) inp.sel_slots->ne[0] : 0; // a SLOW run's gather takes these slots too
    for (const uint32_t s : plan->gathering) {
        const auto & st = view->streams[s];

        ggml_tensor * sel = ggml_new_tensor_3d(ctx, GGML_TYPE_I32, st.n_sel, view->n_head_kv_max, view->layers.size());
        ggml_set_input(sel);
        ggml_format_name(sel, "sfi_inp_sel_s%u", s);

        inp.sel.emplace_back(s, sel);

        n_sel_max = std::max(n_sel_max, st.n_sel);
    }

    if (n_sel_max > 0 && (!inp.sel_slots || inp.sel_slots->ne[0] < n_sel_max)) {
        inp.sel_slots = ggml_new_tensor_1d(ctx, GGML_TYPE_I64, n_sel_max);
        ggml_set_input(inp.sel_slots);
        ggml_set_name(inp.sel_slots, "sfi_inp_sel_slots");
    }
}

void llama_sfi_set_inputs(const llama_kv_cache_context * mctx, const llama_sfi_graph_input & inp) {
    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (!plan) {
        return;
    }

    auto & view = plan->view;

    if (inp.sel_mask && inp.sel_mask->buffer) {
        GGML_ASSERT(ggml_backend_buffer_is_host(inp.sel_mask->buffer) && ggml_backend_buffer_is_host(inp.sel_u->buffer));

        const auto & ub = mctx->get_ubatch();

        const int64_t n_kv  = inp.sel_mask->ne[0];
        const int64_t ns    = inp.sel_mask->ne[3];
        const int64_t n_tps = ub.n_tokens/ns;

        float * mask = (float *) inp.sel_mask->data;
        float * u    = (float *) inp.sel_u->data;

        const bool    has_shared = inp.shared && inp.shared->buffer;
        const int64_t n_shared   = has_shared ? inp.shared->ne[0] : 0;
        const int64_t n_rep      = has_shared ? inp.shared->ne[1] : 0;

        // per slow stream, its rows of the shared cells (copied below: the tensor may live on a device)
        std::vector<std::vector<int32_t>> shared_rows(ns);

        // the streams' cells apart: a batched refresh fills them in parallel
        llama_sfi_parallel_for(ns, [&](int64_t j) {
            if (plan->steps[j] != LLAMA_SFI_STEP_SLOW) {
                return; // (a MIXED ubatch's other streams: no run reads their rows)
            }

            const llama_seq_id seq = ub.seq_id[j*n_tps][0];

            const auto range = llama_sfi_selector_range(view, seq);

            const float scale = 1.0f/std::max<llama_pos>(1, range.second - range.first);

            const auto & cells = view.kv.get_cells(seq);

            const int64_t n_cells = std::min<int64_t>(n_kv, cells.size());

            int64_t n_in_range = 0;
            for (int64_t c = 0; c < n_kv; ++c) {
                const llama_pos p = c < n_cells && !cells.is_empty(c) && cells.seq_has(c, seq) ? cells.pos_get(c) : -1;

                const bool in_range = p >= range.first && p < range.second;

                mask[j*n_kv + c] = in_range ? 0.0f : -INFINITY;
                u   [j*n_kv + c] = in_range ? (p - range.first)*scale : 0.0f;

                n_in_range += in_range;
            }
            view.streams[view.stream_of(seq)].n_in_range = n_in_range;

            if (has_shared) {
                // at most n_sink + n_recent cells unless positions repeat (the step's gather is then not used, see
                // llama_sfi_context::extract_selection); the rest repeats the last one, into slots past the selection
                std::vector<int32_t> shared = llama_sfi_cells_outside(cells, seq, range);
                shared.resize(n_shared, shared.empty() ? 0 : shared.back());

                auto & rows = shared_rows[j];
                rows.resize(n_rep*n_shared);
                for (int64_t r = 0; r < n_rep; ++r) {
                    std::copy(shared.begin(), shared.end(), rows.begin() + r*n_shared);
                }
            }
        });

        // each stream's n_rep rows in one copy (one transfer, not n_rep)
        for (int64_t j = 0; j < ns; ++j) {
            if (!shared_rows[j].empty()) {
                GGML_ASSERT(inp.shared->nb[1] == n_shared*sizeof(int32_t));
                ggml_backend_tensor_set(inp.shared, shared_rows[j].data(), j*n_rep*inp.shared->nb[1],
                        shared_rows[j].size()*sizeof(int32_t));
            }
        }
    }

    if (inp.kn_cells && inp.kn_cells->buffer) {
        GGML_ASSERT((int64_t) plan->kn_cells.size() == inp.kn_cells->ne[0]);
        ggml_backend_tensor_set(inp.kn_cells, plan->kn_cells.data(), 0, ggml_nbytes(inp.kn_cells));

        // the step takes them now
        for (size_t j = 0; j < plan->streams.size(); ++j) {
            if (plan->steps[j] != LLAMA_SFI_STEP_SLOW) {
                continue;
            }
            auto & st = view.streams[plan->streams[j]];

            st.kn_upto = std::max(st.kn_upto, mctx->get_n_kv());
            st.kn_stale.clear();
        }
    }

    if (inp.fast_mask && inp.fast_mask->buffer) {
        plan->set_input_fast_mask(inp.fast_mask, &mctx->get_ubatch());
    }

    if (inp.tail_idxs && inp.tail_idxs->buffer) {
        GGML_ASSERT(ggml_backend_buffer_is_host(inp.tail_idxs->buffer));

        const auto & tail0 = plan->tail0; // per stream of the ubatch, in ubatch order

        const int64_t n_tps = inp.tail_idxs->ne[0]/tail0.size();

        int64_t * data = (int64_t *) inp.tail_idxs->data;
        for (size_t j = 0; j < tail0.size(); ++j) {
            const int64_t slot0 = (int64_t) plan->streams[j]*view.c_max + tail0[j];
            for (int64_t t = 0; t < n_tps; ++t) {
                data[j*n_tps + t] = slot0 + t;
            }
        }

        if (inp.tail_idxs_v && inp.tail_idxs_v->buffer) {
            GGML_ASSERT(ggml_backend_buffer_is_host(inp.tail_idxs_v->buffer));

            // element (slot, channel) of stream s of a transposed view buffer: (s*n_embd_v + channel)*c_max + slot
            const int64_t n_embd_v = inp.tail_idxs_v->ne[0]/inp.tail_idxs->ne[0];

            int64_t * data_v = (int64_t *) inp.tail_idxs_v->data;
            for (size_t j = 0; j < tail0.size(); ++j) {
                const int64_t s = plan->streams[j];
                for (int64_t t = 0; t < n_tps; ++t) {
                    for (int64_t c = 0; c < n_embd_v; ++c) {
                        data_v[(j*n_tps + t)*n_embd_v + c] = (s*n_embd_v + c)*view.c_max + tail0[j] + t;
                    }
                }
            }
        }
    }

    for (const auto & [s, sel] : inp.sel) {
        if (sel->buffer) {
            const auto & st = view.streams[s];

            GGML_ASSERT((size_t) ggml_nelements(sel) == st.sel.size());
            ggml_backend_tensor_set(sel, st.sel.data(), 0, ggml_nbytes(sel));
        }
    }

    if (inp.sel_slots && inp.sel_slots->buffer) {
        GGML_ASSERT(ggml_backend_buffer_is_host(inp.sel_slots->buffer));

        int64_t * data = (int64_t *) inp.sel_slots->data;
        for (int64_t i = 0; i < inp.sel_slots->ne[0]; ++i) {
            data[i] = i;
        }
    }
}

//
// gathers
//

// gather rows sel[:, h] of KV head h of the cache into slots 0 .. n_sel-1 of the view, for every head
static ggml_tensor * llama_sfi_gather(
        ggml_context * ctx,
        const llama_sfi_params & params,
         ggml_tensor * src,  // [n_embd_gqa, kv_size]
         ggml_tensor * dst,  // [n_embd_gqa, c_max]
         ggml_tensor * sel,  // I32 [n_sel, n_head_kv]
         ggml_tensor * slots,
             int64_t   n_embd_head,
             int64_t   n_head_kv) {
    ggml_tensor * src_h = ggml_view_3d(ctx, src, n_embd_head, src->ne[1], n_head_kv,
            src->nb[1], ggml_row_size(src->type, n_embd_head), 0);
    ggml_tensor * dst_h = ggml_view_3d(ctx, dst, n_embd_head, dst->ne[1], n_head_kv,
            dst->nb[1], ggml_row_size(dst->type, n_embd_head), 0);

    return llama_sfi_copy_rows(ctx, params, dst_h, src_h, sel, slots, 0);
}

// dst [n_sel, n_rows, n_head_kv] = the columns sel [n_sel, n_head_kv] of src [kv_size, n_rows, n_head_kv], each head its
// own columns: a gather of a transposed V in host memory, row by row (a get_rows of one-element rows costs ~12 ns
// an element on a CPU: 86 ms for the default model's 24 layers x 2 heads x 64 channels x 2308 cells)
template <typename T>
static void llama_sfi_gather_columns(ggml_tensor * dst, int ith, int nth, void * /*userdata*/) {
    const ggml_tensor * src = dst->src[0];
    const ggml_tensor * sel = dst->src[1];

    const int64_t n_sel  = dst->ne[0];
    const int64_t n_rows = dst->ne[1];

    for (int64_t r = ith; r < n_rows*dst->ne[2]; r += nth) {
        const int64_t d = r % n_rows;
        const int64_t h = r / n_rows;

        const T       * x   = (const T *) ((const char *) src->data + d*src->nb[1] + h*src->nb[2]);
        const int32_t * idx = (const int32_t *) ((const char *) sel->data + h*sel->nb[1]);
        T             * y   = (T *) ((char *) dst->data + d*dst->nb[1] + h*dst->nb[2]);

        for (int64_t j = 0; j < n_sel; ++j) {
            y[j] = x[idx[j]];
        }
    }
}

// flash attention off: cache and view hold V transposed, per stream one row of cells (slots) per channel: channel d
// of head h takes the elements sel[:, h] (sel: I32 [n, n_head_kv]) of its cache row into slots slot0 .. slot0+n-1
// of stream s
static void llama_sfi_build_gather_v_trans(
        ggml_context * ctx,
         ggml_cgraph * gf,
        const llama_sfi_view & view,
                 int   il,
            uint32_t   s,
         ggml_tensor * sel,
             int64_t   slot0) {
    const auto & l = view.layers[view.layer_index(il)];

    const int64_t n_sel = sel->ne[0];

    ggml_tensor * v_src = view.cache_v_of(il);

    const int64_t kv_size     = v_src->ne[1];
    const int64_t n_embd_v    = v_src->ne[0];
    const int64_t n_embd_head = n_embd_v/l.n_head_kv;

    ggml_tensor * dst = ggml_view_3d(ctx, l.v, n_sel, n_embd_head, l.n_head_kv,
            ggml_row_size(l.v->type, view.c_max), ggml_row_size(l.v->type, view.c_max*n_embd_head),
            s*l.v->nb[2] + ggml_row_size(l.v->type, slot0));

    const size_t ts = ggml_type_size(v_src->type);

    if (ggml_backend_buffer_is_host(v_src->buffer) && (ts == 2 || ts == 4)) {
        ggml_tensor * args[] = {
            ggml_view_3d(ctx, v_src, kv_size, n_embd_head, l.n_head_kv,
                    ggml_row_size(v_src->type, kv_size), ggml_row_size(v_src->type, kv_size*n_embd_head), s*v_src->nb[2]),
            sel,
        };
        ggml_tensor * vals = ggml_custom_4d(ctx, v_src->type, n_sel, n_embd_head, l.n_head_kv, 1, args, 2,
                ts == 2 ? llama_sfi_gather_columns<uint16_t> : llama_sfi_gather_columns<uint32_t>, GGML_N_TASKS_MAX, nullptr);
        ggml_build_forward_expand(gf, ggml_cpy(ctx, vals, dst));
        return;
    }

    ggml_tensor * src = ggml_view_4d(ctx, v_src, 1, kv_size, n_embd_head, l.n_head_kv,
            ggml_row_size(v_src->type, 1), ggml_row_size(v_src->type, kv_size), ggml_row_size(v_src->type, kv_size*n_embd_head),
            s*v_src->nb[2]);
    ggml_tensor * idx = ggml_repeat_4d(ctx, ggml_reshape_3d(ctx, ggml_is_contiguous(sel) ? sel : ggml_cont(ctx, sel), n_sel, 1, l.n_head_kv),
            n_sel, n_embd_head, l.n_head_kv, 1);

    ggml_tensor * vals = ggml_get_rows(ctx, src, idx); // [1, n_sel, n_embd_head, n_head_kv]
    ggml_build_forward_expand(gf, ggml_cpy(ctx, ggml_reshape_3d(ctx, vals, n_sel, n_embd_head, l.n_head_kv), dst));
}

void llama_sfi_build_store(
        ggml_context * ctx,
         ggml_cgraph * gf,
        const llama_kv_cache_context * mctx,
        const llama_sfi_graph_input  & inp,
         ggml_tensor * k_cur,
         ggml_tensor * v_cur,
                 int   il) {
    const llama_sfi_plan * plan = mctx ? mctx->get_sfi() : nullptr;
    if (!plan || !plan->stores()) {
        return;
    }

    const auto * view = &plan->view;

    const int32_t i = view->layer_index(il);
    GGML_ASSERT(i >= 0);

    const auto & l = view->layers[i];

    for (const auto & [s, sel_s] : inp.sel) {
        const int32_t n_sel = view->streams[s].n_sel;

        ggml_tensor * sel   = ggml_view_2d(ctx, sel_s, n_sel, l.n_head_kv, sel_s->nb[1], i*sel_s->nb[2]);
        ggml_tensor * slots = ggml_view_1d(ctx, inp.sel_slots, n_sel, 0);

        // [n_embd_gqa, kv_size or c_max] rows of stream s of a cache or view buffer
        auto stream_rows = [&](ggml_tensor * t) {
            return ggml_view_2d(ctx, t, t->ne[0], t->ne[1], t->nb[1], s*t->nb[2]);
        };

        ggml_build_forward_expand(gf, llama_sfi_gather(ctx, view->params, stream_rows(view->cache_k_of(il)), stream_rows(l.k),
                    sel, slots, l.k->ne[0]/l.n_head_kv, l.n_head_kv));

        if (view->v_trans) {
            llama_sfi_build_gather_v_trans(ctx, gf, *view, il, s, sel, 0);
        } else {
            ggml_build_forward_expand(gf, llama_sfi_gather(ctx, view->params, stream_rows(view->cache_v_of(il)), stream_rows(l.v),
                        sel, slots, l.v->ne[0]/l.n_head_kv, l.n_head_kv));
        }
    }

    // the tail: same rows as written to the cache by cpy_k/cpy_v, at slot stream*c_max + slot
    GGML_ASSERT(ggml_row_size(k_cur->type, k_cur->ne[0]) == k_cur->nb[1]);
    GGML_ASSERT(ggml_row_size(v_cur->type, v_cur->ne[0]) == v_cur->nb[1]);

    k_cur = ggml_view_2d(ctx, k_cur, k_cur->ne[0]*k_cur->ne[1], k_cur->ne[2], k_cur->nb[2], 0);
    v_cur = ggml_view_2d(ctx, v_cur, v_cur->ne[0]*v_cur->ne[1], v_cur->ne[2], v_cur->nb[2], 0);

    ggml_tensor * k_all = ggml_view_2d(ctx, l.k, l.k->ne[0], l.k->ne[1]*l.k->ne[2], l.k->nb[1], 0);
    ggml_tensor * v_all = ggml_view_2d(ctx, l.v, l.v->ne[0], l.v->ne[1]*l.v->ne[2], l.v->nb[1], 0);

    ggml_build_forward_expand(gf, ggml_set_rows(ctx, k_all, k_cur, inp.tail_idxs));

    if (!view->v_trans) {
        ggml_build_forward_expand(gf, ggml_set_rows(ctx, v_all, v_cur, inp.tail_idxs));
        return;
    }

    // transposed: one element per channel, like llama_kv_cache::cpy_v (indices: inp.tail_idxs_v)
    GGML_ASSERT(v_cur->ne[0] == l.v->ne[0]);
    if (ggml_row_size(v_cur->type, v_cur->ne[0]) != v_cur->nb[1]) {
        v_cur = ggml_cont(ctx, v_cur);
    }
    ggml_build_forward_expand(gf, ggml_set_rows(ctx, ggml_reshape_2d(ctx, l.v, 1, ggml_nelements(l.v)),
                ggml_reshape_2d(ctx, v_cur, 1, ggml_nelements(v_cur)), inp.tail_idxs_v));
}

void llama_sfi_build_load(
        ggml_context * ctx,
         ggml_cgraph * gf,
        const llama_sfi_view & view,
        const llama_sfi_graph_input  & inp,
            uint32_t   s0,
         ggml_tensor * own,
        const std::vector<size_t> & refreshed,
              size_t   first,
              size_t   last) {
    const int64_t k_head   = own->ne[0];
    const int64_t h        = own->ne[1];
    const int64_t ns       = inp.shared->ne[2];
    const int64_t n_shared = inp.shared->ne[0];

    ggml_tensor * own_slots    = ggml_view_1d(ctx, inp.sel_slots, k_head, 0);
    ggml_tensor * shared_slots = ggml_view_1d(ctx, inp.sel_slots, n_shared, k_head*inp.sel_slots->nb[0]);

    // gather the selection of the run's layers of rank r0 .. r0+nl-1 from the cache into the view: src and dst are
    // spans of layers (llama_sfi_view::layer_span) in which those layers start at layer l0, t_src and t_dst a layer's
    // tensors (shapes and strides). One gather per tensor: the own cells per head with two of the heads, streams and
    // layers as the dims of the index (one gather per head when all three are several), the shared cells as rows
    auto gather = [&](const llama_sfi_view::layer_span & src, const ggml_tensor * t_src,
                      const llama_sfi_view::layer_span & dst, const ggml_tensor * t_dst, size_t l0, size_t r0, int64_t nl) {
        // [ne0, cells, ne2, ne3] of the layers, at byte offset offs within each stream's rows
        auto view_4d = [&](const llama_sfi_view::layer_span & sp, const ggml_tensor * t, int64_t ne0, int64_t ne2, size_t nb2,
                           int64_t ne3, size_t nb3, size_t offs) {
            return ggml_view_4d(ctx, sp.t, ne0, t->ne[1], ne2, ne3, t->nb[1], nb2, nb3, l0*sp.stride + s0*t->nb[2] + offs);
        };

        const int64_t d = t_src->ne[0]/h;

        const size_t hs_src = ggml_row_size(t_src->type, d);
        const size_t hs_dst = ggml_row_size(t_dst->type, d);

        const size_t own0 = r0*ns*own->nb[2]; // own: [k_head, h, nb], pair b = rank*ns + stream

        if (nl == 1 || ns == 1) {
            // the heads, and the streams (one layer) or the layers (one stream)
            const int64_t a = nl == 1 ? ns : nl;

            ggml_tensor * s4 = view_4d(src, t_src, d, h, hs_src, a, nl == 1 ? t_src->nb[2] : src.stride, 0);
            ggml_tensor * d4 = view_4d(dst, t_dst, d, h, hs_dst, a, nl == 1 ? t_dst->nb[2] : dst.stride, 0);

            ggml_tensor * idx = ggml_view_3d(ctx, own, k_head, h, a, own->nb[1], own->nb[2], own0);

            ggml_build_forward_expand(gf, llama_sfi_copy_rows(ctx, view.params, d4, s4, idx, own_slots, 0));
        } else {
            for (int64_t j = 0; j < h; ++j) {
                ggml_tensor * s4 = view_4d(src, t_src, d, ns, t_src->nb[2], nl, src.stride, j*hs_src);
                ggml_tensor * d4 = view_4d(dst, t_dst, d, ns, t_dst->nb[2], nl, dst.stride, j*hs_dst);

                ggml_tensor * idx = ggml_view_3d(ctx, own, k_head, ns, nl, own->nb[2], ns*own->nb[2], own0 + j*own->nb[1]);

                ggml_build_forward_expand(gf, llama_sfi_copy_rows(ctx, view.params, d4, s4, idx, own_slots, 0));
            }
        }

        // every layer takes its stream's list of shared cells
        ggml_tensor * s4 = view_4d(src, t_src, t_src->ne[0], ns, t_src->nb[2], nl, src.stride, 0);
        ggml_tensor * d4 = view_4d(dst, t_dst, t_dst->ne[0], ns, t_dst->nb[2], nl, dst.stride, 0);

        ggml_tensor * idx = ggml_view_3d(ctx, inp.shared, n_shared, ns, nl, inp.shared->nb[2], inp.shared->nb[1], 0);

        ggml_build_forward_expand(gf, llama_sfi_copy_rows(ctx, view.params, d4, s4, idx, shared_slots, k_head));
    };

    // layers that lie at one stride in the cache and in the view take one gather per tensor for all of them, the
    // others one per layer (a layer's tensor as a span of one layer)
    bool spans = view.cache_k.t && view.view_k.t && (view.v_trans || (view.cache_v.t && view.view_v.t));
    for (size_t r = first; r < last; ++r) {
        spans = spans && refreshed[r] == refreshed[first] + (r - first);
    }

    if (spans) {
        const auto & l = view.layers[refreshed[first]];

        gather(view.cache_k, view.cache_k_of(l.il), view.view_k, l.k, refreshed[first], 0, last - first);
        if (!view.v_trans) {
            gather(view.cache_v, view.cache_v_of(l.il), view.view_v, l.v, refreshed[first], 0, last - first);
        }
    }

    auto one = [](ggml_tensor * t) { return llama_sfi_view::layer_span { t, ggml_nbytes(t) }; };

    for (size_t r = first; r < last; ++r) {
        const int32_t il = view.layers[refreshed[r]].il;
        const auto &  l  = view.layers[refreshed[r]];

        if (!spans) {
            ggml_tensor * k = view.cache_k_of(il);
            ggml_tensor * v = view.cache_v_of(il);

            gather(one(k), k, one(l.k), l.k, 0, r - first, 1);
            if (!view.v_trans) {
                gather(one(v), v, one(l.v), l.v, 0, r - first, 1);
            }
        }

        ggml_tensor * own_r = ggml_view_3d(ctx, own, k_head, h, ns, own->nb[1], own->nb[2], (r - first)*ns*own->nb[2]);

        if (!view.v_trans) {
            continue;
        }

        // V transposed: one stream at a time
        for (int64_t j = 0; j < ns; ++j) {
            llama_sfi_build_gather_v_trans(ctx, gf, view, il, s0 + j, ggml_view_2d(ctx, own_r, k_head, h, own_r->nb[1], j*own_r->nb[2]), 0);
            llama_sfi_build_gather_v_trans(ctx, gf, view, il, s0 + j,
                    ggml_view_2d(ctx, inp.shared, n_shared, h, inp.shared->nb[1], j*inp.shared->nb[2]), k_head);
        }
    }
}
