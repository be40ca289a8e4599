// The SFI state of a llama_context: each decode's step, and the copy of a slow step's exports to the host
#include "llama-sfi-context.h"

#include "llama-sfi-ubatch-graph.h"
#include "llama-sfi-view.h"

#include "llama-batch.h"
#include "llama-hparams.h"
#include "llama-impl.h"
#include "llama-kv-cache.h"
#include "llama-kv-cache-iswa.h"
#include "llama-model.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

void llama_sfi_export::reset() {
    valid    = false;
    in_range = false;
    n_cells  = 0;
    n_rows   = 0;
    n_sel    = 0;
    gathered = false;
    mapped   = true;
    seq      = -1;
    range    = {};
    n_edits  = 0;
    for (auto * v : { &cells, &selection, &picks }) {
        v->clear();
    }
    selection_in = nullptr;
    cells_in     = nullptr;
    shared.clear();
    for (auto * v : { &mass, &evidence, &key_norms }) {
        v->clear();
    }
}

void llama_sfi_export::own(size_t n_layers, size_t n_head_kv) {
    if (selection_in) {
        selection.assign(selection_in, selection_in + n_layers*n_head_kv*n_sel);
        selection_in = nullptr;
    }
    if (cells_in) {
        cells.assign(cells_in, cells_in + n_layers*n_cells);
        cells_in = nullptr;
    }
}

llama_sfi_context::llama_sfi_context(const llama_model & model, llama_kv_cache * kv, std::shared_ptr<llama_sfi_view> view,
        const llama_sfi_params & params) : model(model), kv(kv), view(std::move(view)), params(params) {
    exports.resize(this->view->streams.size());
    modes.assign(this->view->streams.size(), LLAMA_SFI_MODE_DENSE);
    status.assign(this->view->streams.size(), 0);
    capture_next.assign(this->view->streams.size(), 0);
    queries.resize(this->view->streams.size());
    kv->set_sfi(this->view);
}

llama_sfi_context::~llama_sfi_context() {
    if (kv->get_sfi() == view.get()) {
        kv->set_sfi(nullptr);
    }
}

void llama_sfi_context::decode_begin(const llama_batch & batch) {
    const size_t n_streams = view->streams.size();

    // tokens per stream of the batch
    std::vector<uint32_t> n_tokens(n_streams, 0);
    for (int32_t i = 0; i < batch.n_tokens; ++i) {
        for (int32_t k = 0; k < batch.n_seq_id[i]; ++k) {
            n_tokens[view->stream_of(batch.seq_id[i][k])]++;
        }
    }

    view->stream_steps.assign(n_streams, LLAMA_SFI_STEP_DENSE);

    bool first = true;
    for (size_t s = 0; s < n_streams; ++s) {
        if (n_tokens[s] == 0) {
            continue;
        }

        // the exports of a sequence last until its next decode
        exports[s].valid = false;
        queries[s].valid = false;
        status[s] = 0;

        const auto & st = view->streams[s];

        llama_sfi_step step = LLAMA_SFI_STEP_DENSE;
        switch (modes[s]) {
            case LLAMA_SFI_MODE_FAST:
                if (st.valid && st.tail.size() + n_tokens[s] <= (size_t) params.n_tail_max) {
                    step = LLAMA_SFI_STEP_FAST; // LAST_FAST once the decode succeeded (decode_end)
                } else {
                    status[s] |= LLAMA_SFI_STATUS_FELL_BACK_DENSE;
                }
                break;
            case LLAMA_SFI_MODE_SLOW:
                step = LLAMA_SFI_STEP_SLOW;
                break;
            default:
                break;
        }
        view->stream_steps[s] = step;

        view->streams[s].capture = capture_next[s] && step == LLAMA_SFI_STEP_FAST;
        capture_next[s] = 0;

        view->step = first || view->step == step ? step : LLAMA_SFI_STEP_MIXED;
        first = false;

        if (step == LLAMA_SFI_STEP_FAST) {
            continue;
        }

        // the tokens of a dense step do not go to the tail: the view of its stream is stale (its selection's rows
        // stay, for the layers a refresh of one group keeps; once written, the step's exports may replace them)
        resolve(s);
        view->streams[s].invalidate();
        if (step == LLAMA_SFI_STEP_SLOW) {
            exports[s].n_sel = 0; // the selection of an earlier slow step ends here, even if this one makes none
        }
    }

    if (first) {
        view->step = LLAMA_SFI_STEP_DENSE;
    }
}

void llama_sfi_context::decode_end() {
    if (view->step == LLAMA_SFI_STEP_FAST || view->step == LLAMA_SFI_STEP_MIXED) {
        for (uint32_t s = 0; s < view->streams.size(); ++s) {
            if (view->stream_steps[s] == LLAMA_SFI_STEP_FAST) {
                status[s] |= LLAMA_SFI_STATUS_LAST_FAST;
            }
        }

        // the host's part of the refreshes before this step, while its graph computes (a stream's alone: in parallel)
        std::vector<uint32_t> pending;
        for (uint32_t s = 0; s < view->streams.size(); ++s) {
            if (view->streams[s].sel_pending) {
                pending.push_back(s);
            }
        }
        llama_sfi_parallel_for(pending.size(), [&](int64_t k) { resolve(pending[k]); });
    }

    view->step = LLAMA_SFI_STEP_DENSE;
    view->stream_steps.assign(view->streams.size(), LLAMA_SFI_STEP_DENSE);
}

void llama_sfi_context::built(const llm_graph_result * res, ggml_backend_sched_t sched) {
    llama_sfi_place_host_cache(*view, sched, res->get_gf());
}

void llama_sfi_context::reset_graphs() {
    fast_graphs.reset();
}

uint32_t llama_sfi_context::n_graph_nodes() const {
    const uint32_t n_layer = model.hparams.n_layer();

    // compact-view writes and the attention-mass export, per layer and stream (the FAST gathers of a selection, the
    // exports of the slow streams), and the device Selector: one set of ops per layer for all the streams of a slow ubatch
    return 64u*n_layer*view->streams.size() + 64u*n_layer;
}

void llama_sfi_context::extract(ggml_backend_sched_t sched, const llama_sfi_graph_result & res, const llama_ubatch & ubatch) {
    for (const auto & run : res.runs) {
        extract_run(sched, run, ubatch);
    }
    if (!res.queries.empty()) {
        extract_queries(sched, res, ubatch);
    }
}

void llama_sfi_context::extract_queries(ggml_backend_sched_t sched, const llama_sfi_graph_result & res, const llama_ubatch & ubatch) {
    const int64_t ns = res.query_streams.size();

    GGML_ASSERT(ns > 0 && ubatch.n_tokens % ns == 0);

    const uint32_t n_tps = ubatch.n_tokens/ns;

    ggml_backend_sched_synchronize(sched);

    for (int64_t j = 0; j < ns; ++j) {
        const uint32_t s = res.query_streams[j];
        if (!view->streams[s].capture) {
            continue;
        }
        auto & qs = queries[s];
        qs.valid = true;
        qs.pos   = ubatch.pos[j*n_tps + n_tps - 1];
        qs.n_head.assign(res.queries.size(), 0);
        qs.q.resize(res.queries.size());
        for (size_t i = 0; i < res.queries.size(); ++i) {
            const ggml_tensor * t = res.queries[i];
            GGML_ASSERT(t && t->type == GGML_TYPE_F32 && t->ne[2] == ns);
            const size_t n = t->ne[0]*t->ne[1];
            qs.n_embd_head = t->ne[0];
            qs.n_head[i]   = t->ne[1];
            qs.q[i].resize(n);
            ggml_backend_tensor_get(t, qs.q[i].data(), j*t->nb[2], n*sizeof(float));
        }
    }
}

void llama_sfi_context::extract_run(ggml_backend_sched_t sched, const llama_sfi_run_export & res, const llama_ubatch & ubatch) {
    if (res.has_selection()) {
        extract_selection(sched, res, ubatch);
        return;
    }

    if (res.mass.empty()) {
        return;
    }

    const size_t n_layers  = view->layers.size();
    const size_t n_head_kv = view->n_head_kv_max;

    int64_t n  = 0; // cells per (layer, head, stream): n_kv, or the candidates
    int64_t ns = res.ns; // streams of the run: res.s0 ..
    for (const auto * t : res.mass) {
        if (t) {
            n = t->ne[0];
            GGML_ASSERT(t->ne[2] == ns);
        }
    }

    GGML_ASSERT(ns > 0 && ubatch.n_tokens % ubatch.n_seqs_unq == 0);

    const uint32_t n_tps = ubatch.n_tokens/ubatch.n_seqs_unq;

    for (int64_t j = 0; j < ns; ++j) {
        exports[res.s0 + j].reset();
    }

    // slow steps are rare: wait for the graph, then copy synchronously, one copy per layer and kind
    ggml_backend_sched_synchronize(sched);

    std::vector<uint8_t> buf;

    // ts[layer]: [width, n_head_kv(layer), ns] (or [width, ns]) -> dst(stream)[layer*row ...]
    auto copy = [&](const std::vector<ggml_tensor *> & ts, auto member, size_t row) {
        bool any = false;
        for (const auto * t : ts) {
            any |= t != nullptr;
        }
        for (int64_t j = 0; j < ns; ++j) {
            auto & dst = exports[res.s0 + j].*member;
            dst.assign(any ? n_layers*row : 0, 0);
        }
        for (size_t i = 0; any && i < n_layers; ++i) {
            const auto * t = ts[i];
            if (!t) {
                continue;
            }
            const size_t per_stream = ggml_nbytes(t)/ns;
            buf.resize(ggml_nbytes(t));
            ggml_backend_tensor_get(t, buf.data(), 0, ggml_nbytes(t));
            for (int64_t j = 0; j < ns; ++j) {
                auto & dst = exports[res.s0 + j].*member;
                GGML_ASSERT(per_stream <= row*sizeof(dst[0]));
                memcpy(dst.data() + i*row, buf.data() + j*per_stream, per_stream);
            }
        }
    };

    copy(res.mass,      &llama_sfi_export::mass,      n_head_kv*n);
    copy(res.evidence,  &llama_sfi_export::evidence,  n_head_kv*n);
    copy(res.key_norms, &llama_sfi_export::key_norms, n_head_kv*n);
    copy(res.cells,     &llama_sfi_export::cells,     n);

    for (int64_t j = 0; j < ns; ++j) {
        auto & ex = exports[res.s0 + j];

        ex.n_cells = n;
        ex.n_rows  = std::min<int32_t>(view->n_query_rows, n_tps);
        ex.valid   = n > 0;
    }
}

// the device Selector's picks, per stream: [n_layers][n_head_kv_max][k_head] indices into each layer's candidates,
// mapped to cell ids later (map_selection)
void llama_sfi_context::extract_selection(ggml_backend_sched_t sched, const llama_sfi_run_export & res, const llama_ubatch & ubatch) {
    const size_t n_layers  = view->layers.size();
    const size_t n_head_kv = view->n_head_kv_max;

    const ggml_tensor * t0 = nullptr;
    const ggml_tensor * c0 = nullptr;
    for (size_t i = 0; i < n_layers && !t0; ++i) {
        t0 = res.sel[i];
        c0 = res.cells[i];
    }

    GGML_ASSERT(t0 && c0);

    const int64_t n_sel  = t0->ne[0];
    const int64_t n_cand = c0->ne[0];
    const int64_t ns     = res.ns; // streams of the run: res.s0 ..

    GGML_ASSERT(ns > 0 && ubatch.n_tokens % ubatch.n_seqs_unq == 0);

    const uint32_t n_tps = ubatch.n_tokens/ubatch.n_seqs_unq;

    ggml_backend_sched_synchronize(sched);

    const int32_t * picks = nullptr;
    const int32_t * cells = nullptr;

    std::vector<uint8_t> kept(ns, 1); // the layers not refreshed could keep their selection
    bool any_kept = false;

    // picks that are cell ids (res.sel_cells) go to the selection as they are, with nothing to map
    const bool ids = res.sel_cells;

    // one stream whose every layer the run refreshed, with cell ids of every KV head: the copies have the layout
    // of its selection and candidates, which are read where they are (llama_sfi_export::selection_in)
    bool in_place = ns == 1 && ids && t0->ne[1] == (int64_t) n_head_kv;
    for (size_t i = 0; i < n_layers; ++i) {
        in_place = in_place && res.sel[i] == t0 && res.cells[i] == c0;
    }

    for (int64_t j = 0; j < ns; ++j) {
        auto & ex = exports[res.s0 + j];

        // every row is written below: by a refreshed layer's picks, or for a layer not refreshed its kept cells (or
        // the stream keeps none, and its selection is not read), its candidates and picks -1
        ex.reset();
        if (in_place) {
            continue;
        }
        ex.selection.resize(n_layers*n_head_kv*n_sel);
        ex.cells.resize(n_layers*n_cand);
        if (!ids) {
            ex.picks.resize(n_layers*n_head_kv*n_sel);
        }
    }

    // the buffers take this step's copies: the exports still read from them get their own
    for (auto & ex : exports) {
        ex.own(n_layers, n_head_kv);
    }

    // t_sfi_sel[i] and t_sfi_cells[i]: the outputs of layer i's run of layers, layer-major (pair b = l*ns + j,
    // l the rank of layer i in its run); nullptr: layer i was not refreshed
    const ggml_tensor * run = nullptr;
    int64_t l = 0;

    // the layers of the run whose picks and candidates the buffers hold, copied to each stream's export in parallel
    struct layer_of_run {
        size_t  i;       // the layer
        int64_t l;       // its rank in the run
        int64_t h_layer; // its KV heads
    };
    std::vector<layer_of_run> copying;

    auto copy_run = [&]() {
        llama_sfi_parallel_for(copying.empty() ? 0 : ns, [&](int64_t j) {
            auto & ex  = exports[res.s0 + j];
            auto & dst = ids ? ex.selection : ex.picks;
            for (const auto & layer : copying) {
                const int64_t b = layer.l*ns + j;

                std::copy(cells + b*n_cand, cells + (b + 1)*n_cand, ex.cells.begin() + layer.i*n_cand);

                for (size_t h = 0; h < n_head_kv; ++h) {
                    // a layer with fewer KV heads repeats its first head's cells (never read)
                    const int32_t * src = picks + (b*layer.h_layer + ((int64_t) h < layer.h_layer ? h : 0))*n_sel;
                    std::copy_n(src, n_sel, dst.begin() + (layer.i*n_head_kv + h)*n_sel);
                }
            }
        });
        copying.clear();
    };

    for (size_t i = 0; i < n_layers; ++i) {
        const ggml_tensor * tp = res.sel[i];
        const ggml_tensor * tc = res.cells[i];

        if (!tp) {
            any_kept = true;
            // not refreshed: the own cells of the selection the view holds, as cell ids
            for (int64_t j = 0; j < ns; ++j) {
                const auto & st = view->streams[res.s0 + j];
                auto & ex = exports[res.s0 + j];

                std::fill_n(ex.cells.begin() + i*n_cand, n_cand, -1);
                if (!ids) {
                    std::fill_n(ex.picks.begin() + i*n_head_kv*n_sel, n_head_kv*n_sel, -1); // -1: a layer not refreshed
                }

                if (st.n_own != n_sel || st.sel.size() != n_layers*n_head_kv*st.n_sel) {
                    kept[j] = 0;
                    continue;
                }
                for (size_t h = 0; h < n_head_kv; ++h) {
                    std::copy_n(st.sel.begin() + (i*n_head_kv + h)*st.n_sel, n_sel, ex.selection.begin() + (i*n_head_kv + h)*n_sel);
                }
            }
            continue;
        }

        GGML_ASSERT(tc && tp->ne[0] == n_sel && tc->ne[0] == n_cand && tp->ne[2] % ns == 0 && tc->ne[1] == tp->ne[2]);

        if (tp != run) {
            copy_run(); // the buffers are the next run's now
            run = tp;
            l   = 0;
            int32_t * p = picks_buf.get(ggml_nelements(tp), ggml_backend_buffer_get_type(tp->buffer));
            int32_t * c = cells_buf.get(ggml_nelements(tc), ggml_backend_buffer_get_type(tc->buffer));
            ggml_backend_tensor_get(tp, p, 0, ggml_nbytes(tp));
            ggml_backend_tensor_get(tc, c, 0, ggml_nbytes(tc));
            picks = p;
            cells = c;
            if (in_place) {
                GGML_ASSERT(tp->ne[2] == (int64_t) n_layers && tc->ne[1] == (int64_t) n_layers);
                exports[res.s0].selection_in = p;
                exports[res.s0].cells_in     = c;
                break; // every layer's
            }
        }

        copying.push_back({ i, l, tp->ne[1] });
        ++l;
    }
    if (!in_place) {
        copy_run();
    }

    llama_sfi_parallel_for(ns, [&](int64_t j) {
        const uint32_t     s   = res.s0 + j;
        const llama_seq_id seq = ubatch.seq_id[(res.j0 + j)*n_tps][0];

        auto & ex = exports[s];
        auto & st = view->streams[s];

        ex.seq      = seq;
        ex.range    = llama_sfi_selector_range(*view, seq);
        ex.n_cells  = n_cand;
        ex.n_sel    = kept[j] ? n_sel : 0;
        ex.n_rows   = std::min<int32_t>(view->n_query_rows, n_tps);
        ex.n_edits  = st.n_edits;
        ex.mapped   = false;
        ex.valid    = true;

        // every candidate lies in the Selector's range when the range holds n_cand cells (the others score -inf
        // when the candidates are taken), and so does every pick of a refreshed layer; otherwise check the picks now
        ex.in_range = kept[j] && !any_kept && st.n_in_range >= n_cand;
        if (!ex.in_range) {
            map_selection(s);
        }

        if (ex.n_sel > 0) {
            ex.shared   = llama_sfi_cells_outside(view->kv.get_cells(seq), seq, ex.range);
            // the graph gathered the first n_sink + n_recent of them (more when a position is held by several cells)
            ex.gathered = res.gathered && !any_kept && ex.shared.size() <= (size_t) view->selector.n_sink + view->selector.n_recent;
        }
    });
}

int32_t * llama_sfi_context::host_ints::get(size_t n, ggml_backend_buffer_type_t buft) {
    ggml_backend_dev_t dev = buft ? ggml_backend_buft_get_device(buft) : nullptr;
    ggml_backend_buffer_type_t host = dev && !ggml_backend_buft_is_host(buft) ? ggml_backend_dev_host_buffer_type(dev) : nullptr;
    if (host) {
        if (!pinned || ggml_backend_buffer_get_type(pinned.get()) != host || ggml_backend_buffer_get_size(pinned.get()) < n*sizeof(int32_t)) {
            pinned.reset(ggml_backend_buft_alloc_buffer(host, n*sizeof(int32_t)));
        }
        if (pinned) {
            return (int32_t *) ggml_backend_buffer_get_base(pinned.get());
        }
    }
    pageable.resize(n);
    return pageable.data();
}

void llama_sfi_context::map_selection(uint32_t s) {
    auto & ex = exports[s];
    if (ex.mapped) {
        return;
    }
    ex.mapped = true;

    const size_t  n_layers  = view->layers.size();
    const size_t  n_head_kv = view->n_head_kv_max;
    const int64_t n_sel     = ex.n_sel;
    const int64_t n_cand    = ex.n_cells;

    if (n_sel == 0) {
        ex.selection.clear();
        ex.selection_in = nullptr;
        ex.picks.clear();
        return;
    }

    // picks into the candidates (none when the step left cell ids)
    for (size_t i = 0; i < n_layers && !ex.picks.empty(); ++i) {
        const int32_t * cells = ex.cells.data() + i*n_cand;
        for (size_t h = 0; h < n_head_kv; ++h) {
            const int32_t * src = ex.picks.data()     + (i*n_head_kv + h)*n_sel;
            int32_t       * dst = ex.selection.data() + (i*n_head_kv + h)*n_sel;
            if (src[0] < 0) {
                continue; // a layer not refreshed: its cells are there
            }
            for (int64_t c = 0; c < n_sel; ++c) {
                GGML_ASSERT(src[c] >= 0 && src[c] < n_cand);
                dst[c] = cells[src[c]];
            }
        }
    }
    ex.picks.clear();

    // fewer cells in the range than k_head: some picks lie outside it, no selection (every cell checked, without a
    // branch per cell: a bad one is rare), unless the picks are known to lie in it
    uint8_t bad = 0;
    if (!ex.in_range) {
        const auto & kv_cells = view->kv.get_cells(ex.seq);
        const auto   in_range = llama_sfi_cells_holding(kv_cells, ex.seq, ex.range.first, ex.range.second);

        const uint32_t  n_cells = in_range.size();
        const int32_t * sel     = ex.selection_data();
        for (size_t k = 0; k < n_layers*n_head_kv*n_sel; ++k) {
            bad |= (uint32_t) sel[k] < n_cells ? in_range[sel[k]] ^ 1 : 1;
        }
    }

    const bool ok = ex.n_edits == view->streams[s].n_edits && bad == 0;

    if (!ok) {
        ex.selection.clear();
        ex.selection_in = nullptr;
        ex.shared.clear();
        ex.n_sel    = 0;
        ex.gathered = false;
    }
}

int32_t llama_sfi_context::load_selection(uint32_t s) {
    auto & st = view->streams[s];
    auto & ex = exports[s];

    if (!ex.valid || ex.n_sel == 0 || ex.n_edits != st.n_edits) {
        return LLAMA_SFI_ERR_NO_SELECTION;
    }

    if ((int64_t) ex.n_sel + (int64_t) ex.shared.size() > params.n_sel_max) {
        return LLAMA_SFI_ERR_COUNT;
    }

    resolve(s);

    if (!ex.gathered) {
        map_selection(s);
        if (ex.n_sel == 0) {
            return LLAMA_SFI_ERR_NO_SELECTION;
        }
        view->store_selection(st, ex.selection_data(), ex.n_sel, ex.shared.data(), ex.shared.size());
        return 0;
    }

    // the view holds it: commit it, its rows follow (resolve)
    st.prev_n_sel     = st.n_sel;
    st.prev_n_own     = st.n_own;
    st.n_sel          = ex.n_sel + ex.shared.size();
    st.n_own          = ex.n_sel;
    st.valid          = true;
    st.gather_pending = false;
    st.sel_pending    = true;
    st.tail.clear();

    return 0;
}

void llama_sfi_context::resolve(uint32_t s) {
    auto & st = view->streams[s];
    if (!st.sel_pending) {
        return;
    }
    st.sel_pending = false;

    map_selection(s);

    const auto & ex = exports[s];
    if (ex.n_sel != st.n_own || ex.n_edits != st.n_edits) {
        // its picks were not all in the Selector's range (see map_selection): the view holds other cells
        LLAMA_LOG_WARN("%s: the selection of stream %u did not hold; its view is dropped\n", __func__, s);
        st.invalidate();
        st.n_sel = st.n_own = 0;
        st.sel.clear();
        return;
    }

    view->store_rows(st, ex.selection_data(), ex.n_sel, ex.shared.data(), ex.shared.size(), st.prev_n_sel, st.prev_n_own);
}
