// The compact view of a KV cache, its invalidation by edits of the cache, and the per-batch plan
#include "llama-sfi-view.h"

#include "llama-impl.h"
#include "llama-batch.h"
#include "llama-hparams.h"
#include "llama-kv-cache.h"
#include "llama-model.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <map>
#include <stdexcept>
#include <thread>

//
// llama_sfi_view
//

// the tensors ts, one per layer in order, as one span (see llama_sfi_view::layer_span); none when they do not lie at
// one stride in one buffer
static llama_sfi_view::layer_span llama_sfi_span_layers(ggml_context * ctx, const std::vector<ggml_tensor *> & ts) {
    const ggml_tensor * t0 = ts.empty() ? nullptr : ts[0];
    if (!t0 || !t0->buffer || !t0->data || ggml_blck_size(t0->type) != 1) {
        return {};
    }

    const char * data0 = (const char *) t0->data;
    const size_t size0 = ggml_nbytes(t0);

    if (ts.size() > 1 && (const char *) ts[1]->data < data0 + size0) {
        return {};
    }

    const size_t stride = ts.size() > 1 ? (size_t) ((const char *) ts[1]->data - data0) : size0;
    if (stride % ggml_type_size(t0->type) != 0) {
        return {};
    }

    for (size_t i = 1; i < ts.size(); ++i) {
        const ggml_tensor * t = ts[i];
        if (t->type != t0->type || t->buffer != t0->buffer || !ggml_are_same_shape(t, t0) || !ggml_are_same_stride(t, t0) ||
                (const char *) t->data != data0 + i*stride) {
            return {};
        }
    }

    ggml_tensor * span = ggml_new_tensor_1d(ctx, t0->type, ((ts.size() - 1)*stride + size0)/ggml_type_size(t0->type));

    const char * base = (const char *) ggml_backend_buffer_get_base(t0->buffer);
    if (data0 + ggml_backend_buffer_get_alloc_size(t0->buffer, span) > base + ggml_backend_buffer_get_size(t0->buffer)) {
        return {};
    }

    ggml_backend_tensor_alloc(t0->buffer, span, t0->data);

    return { span, stride };
}

const char * llama_sfi_view::unsupported(const llama_kv_cache & kv) {
    if (kv.other) {
        return "the cells are shared with another cache";
    }
    if (kv.swa_type != LLAMA_SWA_TYPE_NONE) {
        return "sliding-window cache";
    }
    if (kv.hparams.use_alibi) {
        return "ALiBi";
    }
    if (kv.hparams.n_pos_per_embd() != 1) {
        return "multi-dimensional positions";
    }
    if (kv.layers.empty() || kv.map_layer_ids.size() != kv.layers.size()) {
        return "no layers, or layers reused across the cache";
    }
    for (const auto & layer : kv.layers) {
        if (!layer.k || !layer.v) {
            return "K-only (MLA) cache";
        }
        if (!layer.k->buffer || !layer.v->buffer) {
            return "the cache is not allocated";
        }
        for (const auto * t : { layer.k, layer.v }) {
            switch (t->type) {
                case GGML_TYPE_F32:
                case GGML_TYPE_F16:
                case GGML_TYPE_BF16:
                case GGML_TYPE_Q8_0:
                case GGML_TYPE_Q4_0:
                case GGML_TYPE_Q4_1:
                case GGML_TYPE_Q5_0:
                case GGML_TYPE_Q5_1:
                    break;
                default:
                    return "unsupported cache type";
            }
        }
        if (kv.hparams.n_embd_k_gqa(layer.il) != (uint32_t) layer.k->ne[0] ||
            kv.hparams.n_embd_v_gqa(layer.il) != (uint32_t) layer.v->ne[0]) {
            return "padded cache rows";
        }
    }

    return nullptr;
}

llama_sfi_view::llama_sfi_view(llama_kv_cache & kv, const llama_sfi_params & params) : kv(kv), params(params),
        n_query_rows(params.n_query_rows) {
    v_trans = kv.v_trans;
    // a selection and its tail are distinct cells of the cache: never more slots than cells
    c_max   = GGML_PAD((uint32_t) std::min<int64_t>((int64_t) params.n_sel_max + params.n_tail_max, kv.get_size()), LLAMA_SFI_PAD);

    std::map<ggml_backend_buffer_type_t, ggml_context *> ctx_map;

    auto ctx_for_buft = [&](ggml_backend_buffer_type_t buft) {
        auto it = ctx_map.find(buft);
        if (it == ctx_map.end()) {
            ggml_init_params iparams = {
                /*.mem_size   =*/ 3u*kv.layers.size()*ggml_tensor_overhead(),
                /*.mem_buffer =*/ NULL,
                /*.no_alloc   =*/ true,
            };

            ggml_context * ctx = ggml_init(iparams);
            if (!ctx) {
                throw std::runtime_error("failed to create ggml context for the SFI view");
            }

            ctxs_bufs.emplace_back(ggml_context_ptr(ctx), nullptr);
            it = ctx_map.emplace(buft, ctx).first;
        }
        return it->second;
    };

    for (const auto & kl : kv.layers) {
        ggml_backend_buffer_type_t cache_buft = ggml_backend_buffer_get_type(kl.k->buffer);

        // a cache kept in host memory (offload_kqv off) for a layer that runs on a device: the view, which every FAST
        // step reads, lives on that device; the key norms stay with the cache, which only SLOW steps read
        ggml_backend_buffer_type_t view_buft = cache_buft;
        ggml_backend_dev_t dev = kv.model.dev_layer(kl.il);
        if (ggml_backend_buffer_is_host(kl.k->buffer) && dev && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
            view_buft = ggml_backend_dev_buffer_type(dev);
            cache_on_host = true;
        }

        ggml_context * ctx_view  = ctx_for_buft(view_buft);
        ggml_context * ctx_cache = ctx_for_buft(cache_buft);

        ggml_tensor * k = ggml_new_tensor_3d(ctx_view, kl.k->type, kl.k->ne[0], c_max, kv.get_n_stream());
        ggml_tensor * v = ggml_new_tensor_3d(ctx_view, kl.v->type, kl.v->ne[0], c_max, kv.get_n_stream());

        const int32_t n_head_kv = kv.hparams.n_head_kv(kl.il);

        ggml_tensor * kn = ggml_new_tensor_3d(ctx_cache, GGML_TYPE_F32, n_head_kv, kl.k->ne[1], kl.k->ne[2]);

        ggml_format_name(k,  "sfi_k_l%d",  kl.il);
        ggml_format_name(v,  "sfi_v_l%d",  kl.il);
        ggml_format_name(kn, "sfi_kn_l%d", kl.il);

        map_layer_ids[kl.il] = layers.size();
        layers.push_back({ (int32_t) kl.il, n_head_kv, k, v, kn });

        n_head_kv_max = std::max(n_head_kv_max, n_head_kv);
    }

    streams.resize(kv.get_n_stream());

    for (auto & [ctx, buf] : ctxs_bufs) {
        ggml_backend_buffer_type_t buft = nullptr;
        for (const auto & [b, c] : ctx_map) {
            if (c == ctx.get()) {
                buft = b;
            }
        }

        buf.reset(ggml_backend_alloc_ctx_tensors_from_buft(ctx.get(), buft));
        if (!buf) {
            size_t size = 0;
            for (ggml_tensor * t = ggml_get_first_tensor(ctx.get()); t; t = ggml_get_next_tensor(ctx.get(), t)) {
                size += ggml_backend_buft_get_alloc_size(buft, t);
            }
            throw std::runtime_error(format("failed to allocate the SFI view: %.2f MiB of %s (fewer layers on the device, "
                        "or a smaller n_sel_max / n_tail_max, need less)", size/1024.0/1024.0, ggml_backend_buft_name(buft)));
        }

        // the padding slots are masked, but must not hold NaNs
        ggml_backend_buffer_clear(buf.get(), 0);

        (ggml_backend_buffer_is_host(buf.get()) ? bytes_host : bytes_device) += ggml_backend_buffer_get_size(buf.get());

        LLAMA_LOG_INFO("%s: %10s SFI view buffer size = %8.2f MiB (%u slots, %zu layers, %zu streams)\n", __func__,
                ggml_backend_buffer_name(buf.get()), ggml_backend_buffer_get_size(buf.get())/1024.0/1024.0, c_max, layers.size(), streams.size());
    }

    ggml_init_params iparams = {
        /*.mem_size   =*/ 4*ggml_tensor_overhead(),
        /*.mem_buffer =*/ NULL,
        /*.no_alloc   =*/ true,
    };

    ctx_spans.reset(ggml_init(iparams));
    if (!ctx_spans) {
        throw std::runtime_error("failed to create ggml context for the SFI view");
    }

    std::vector<ggml_tensor *> ts[4];
    for (const auto & l : layers) {
        ts[0].push_back(cache_k_of(l.il));
        ts[1].push_back(cache_v_of(l.il));
        ts[2].push_back(l.k);
        ts[3].push_back(l.v);
    }

    cache_k = llama_sfi_span_layers(ctx_spans.get(), ts[0]);
    cache_v = llama_sfi_span_layers(ctx_spans.get(), ts[1]);
    view_k  = llama_sfi_span_layers(ctx_spans.get(), ts[2]);
    view_v  = llama_sfi_span_layers(ctx_spans.get(), ts[3]);

    LLAMA_LOG_DEBUG("%s: a SLOW step gathers its selection %s\n", __func__,
            cache_k.t && view_k.t && (v_trans || (cache_v.t && view_v.t)) ? "for every layer at once" : "layer by layer");
}

void llama_sfi_view::stream::invalidate() {
    valid           = false;
    gather_pending  = false;
    tail.clear();

    if (sel_pending) {
        // the rows in sel are not this selection's
        sel_pending = false;
        n_sel = n_own = 0;
        sel.clear();
    }
}

void llama_sfi_view::invalidate_seq(llama_seq_id seq) {
    for (size_t s = 0; s < streams.size(); ++s) {
        if (seq < 0 || s == stream_of(seq)) {
            streams[s].invalidate();
            streams[s].n_edits++;
        }
    }
}

void llama_sfi_view::note_written(uint32_t s, const std::vector<uint32_t> & idxs) {
    auto & st = streams[s];

    for (const uint32_t c : idxs) {
        if (c < st.kn_upto) {
            st.kn_stale.push_back(c);
        }
    }

    // rewritten cells below the mark are rare (an edit forgets them all); past this many, take every cell again
    if (st.kn_stale.size() > st.kn_upto/2) {
        st.kn_upto = 0;
        st.kn_stale.clear();
    }
}

void llama_sfi_view::forget_key_norms(llama_seq_id seq) {
    for (size_t s = 0; s < streams.size(); ++s) {
        if (seq < 0 || s == stream_of(seq)) {
            streams[s].kn_upto = 0;
            streams[s].kn_stale.clear();
        }
    }
}

void llama_sfi_invalidate(llama_sfi_view * view, llama_seq_id seq, bool keys_changed) {
    if (!view) {
        return;
    }

    view->invalidate_seq(seq);
    if (keys_changed) {
        view->forget_key_norms(seq);
    }
}

uint32_t llama_sfi_view::stream_of(llama_seq_id seq) const {
    GGML_ASSERT(seq >= 0 && (size_t) seq < kv.seq_to_stream.size());

    return kv.seq_to_stream[seq];
}

int32_t llama_sfi_view::layer_index(int32_t il) const {
    const auto it = map_layer_ids.find(il);

    return it == map_layer_ids.end() ? -1 : it->second;
}

ggml_tensor * llama_sfi_view::cache_k_of(int32_t il) const {
    return kv.get_k_storage(il);
}

ggml_tensor * llama_sfi_view::cache_v_of(int32_t il) const {
    return kv.layers[kv.map_layer_ids.at(il)].v;
}

uint32_t llama_sfi_view::n_view(uint32_t s0, uint32_t s1) const {
    uint32_t n = 0;
    for (uint32_t s = s0; s <= s1; ++s) {
        n = std::max(n, GGML_PAD((uint32_t) (streams[s].n_sel + streams[s].tail.size()), LLAMA_SFI_PAD));
    }

    return n;
}

uint32_t llama_sfi_view::apply_ubatch(uint32_t s, const std::vector<uint32_t> & idxs, bool & gather) {
    auto & st = streams[s];

    GGML_ASSERT(st.valid);

    gather = st.gather_pending;
    st.gather_pending = false;

    const uint32_t slot0 = st.n_sel + st.tail.size();

    st.tail.insert(st.tail.end(), idxs.begin(), idxs.end());

    GGML_ASSERT(st.n_sel + st.tail.size() <= c_max);

    return slot0;
}

// streams s0..s1 of a view buffer as [n_embd_head, n_head_kv, n_kv, ns]
static ggml_tensor * llama_sfi_view_4d(ggml_context * ctx, ggml_tensor * t, int64_t n_embd_head, int64_t n_head_kv,
        uint32_t n_kv, uint32_t s0, uint32_t s1) {
    return ggml_view_4d(ctx, t,
            n_embd_head, n_head_kv, n_kv, s1 - s0 + 1,
            ggml_row_size(t->type, n_embd_head),
            t->nb[1],
            t->nb[2],
            t->nb[2]*s0);
}

ggml_tensor * llama_sfi_view::get_k(ggml_context * ctx, int32_t il, uint32_t n_kv, uint32_t s0, uint32_t s1) const {
    const auto & l = layers.at(layer_index(il));

    return llama_sfi_view_4d(ctx, l.k, kv.hparams.n_embd_head_k(il), l.n_head_kv, n_kv, s0, s1);
}

ggml_tensor * llama_sfi_view::get_v(ggml_context * ctx, int32_t il, uint32_t n_kv, uint32_t s0, uint32_t s1) const {
    const auto & l = layers.at(layer_index(il));

    const int64_t n_embd_head = kv.hparams.n_embd_head_v(il);

    if (!v_trans) {
        return llama_sfi_view_4d(ctx, l.v, n_embd_head, l.n_head_kv, n_kv, s0, s1);
    }

    // transposed like the cache (see llama_kv_cache::get_v): per stream one row of c_max slots per channel
    const int64_t n_embd_v = l.v->ne[0];

    return ggml_view_4d(ctx, l.v,
            n_kv, l.n_head_kv, n_embd_head, s1 - s0 + 1,
            ggml_row_size(l.v->type, c_max*n_embd_head),
            ggml_row_size(l.v->type, c_max),
            ggml_row_size(l.v->type, c_max*n_embd_v),
            ggml_row_size(l.v->type, c_max*n_embd_v)*s0);
}

// fill(data, keep, drop) with a mask's data as its type's values, and the values that keep or drop a slot: F16 with
// flash attention, F32 without
template <typename F>
static void llama_sfi_fill_mask(ggml_tensor * dst, F && fill) {
    GGML_ASSERT(ggml_backend_buffer_is_host(dst->buffer));

    if (dst->type == GGML_TYPE_F16) {
        fill((ggml_fp16_t *) dst->data, ggml_fp32_to_fp16(0.0f), ggml_fp32_to_fp16(-INFINITY));
    } else {
        GGML_ASSERT(dst->type == GGML_TYPE_F32);
        fill((float *) dst->data, 0.0f, -INFINITY);
    }
}

void llama_sfi_view::set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> * steps) const {
    llama_sfi_fill_mask(dst, [&](auto * data, auto keep, auto drop) { fill_kq_mask(data, dst, ubatch, steps, keep, drop); });
}

template <typename T>
void llama_sfi_view::fill_kq_mask(T * data, const ggml_tensor * dst, const llama_ubatch * ubatch,
        const std::vector<llama_sfi_step> * steps, T keep, T drop) const {
    const int64_t n_slots  = dst->ne[0];
    const int64_t n_tps    = dst->ne[1]; // tokens per stream; the ubatch holds them stream after stream
    const int64_t n_stream = dst->ne[3];

    GGML_ASSERT((int64_t) ubatch->n_tokens == n_tps*n_stream);

    for (int64_t j = 0; j < n_stream; ++j) {
        if (steps && (*steps)[j] != LLAMA_SFI_STEP_FAST) {
            continue;
        }

        const uint32_t s = stream_of(ubatch->seq_id[j*n_tps][0]);

        const auto & st    = streams[s];
        const auto & cells = kv.v_cells[s];

        GGML_ASSERT(st.n_sel + st.tail.size() <= (size_t) n_slots);

        for (int64_t t = 0; t < n_tps; ++t) {
            const int64_t i = j*n_tps + t;

            const llama_pos p1 = ubatch->pos[i];

            T * row = data + i*n_slots;

            // the selected cells are all in the past of the ubatch
            std::fill(row, row + st.n_sel, keep);

            // causal inside the tail (the tail ends with this ubatch)
            for (size_t k = 0; k < st.tail.size(); ++k) {
                row[st.n_sel + k] = cells.pos_get(st.tail[k]) <= p1 ? keep : drop;
            }

            std::fill(row + st.n_sel + st.tail.size(), row + n_slots, drop);
        }
    }
}

void llama_sfi_view::set_input_dense_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch, const std::vector<llama_sfi_step> & steps) const {
    llama_sfi_fill_mask(dst, [&](auto * data, auto keep, auto drop) { fill_dense_kq_mask(data, dst, ubatch, steps, keep, drop); });
}

template <typename T>
void llama_sfi_view::fill_dense_kq_mask(T * data, const ggml_tensor * dst, const llama_ubatch * ubatch,
        const std::vector<llama_sfi_step> & steps, T keep, T drop) const {
    const int64_t n_kv     = dst->ne[0];
    const int64_t n_tps    = dst->ne[1];
    const int64_t n_stream = dst->ne[3];

    GGML_ASSERT((int64_t) ubatch->n_tokens == n_tps*n_stream);

    for (int64_t j = 0; j < n_stream; ++j) {
        if (steps[j] == LLAMA_SFI_STEP_FAST) {
            continue;
        }

        const llama_seq_id seq   = ubatch->seq_id[j*n_tps][0];
        const auto &       cells = kv.v_cells[stream_of(seq)];

        const int64_t n = std::min<int64_t>(n_kv, cells.used_max_p1());

        for (int64_t t = 0; t < n_tps; ++t) {
            const llama_pos p1 = ubatch->pos[j*n_tps + t];

            T * row = data + (j*n_tps + t)*n_kv;
            for (int64_t c = 0; c < n; ++c) {
                row[c] = !cells.is_empty(c) && cells.seq_has(c, seq) && cells.pos_get(c) <= p1 ? keep : drop;
            }
            std::fill(row + n, row + n_kv, drop);
        }
    }
}

//
// llama_sfi_plan
//

llama_sfi_plan::llama_sfi_plan(llama_sfi_view & view, const std::vector<llama_ubatch> & ubatches) : view(view), step(view.step) {
    // a SLOW batch exports in each ubatch that holds the last tokens of one of its sequences
    std::vector<size_t> last(LLAMA_MAX_SEQ, 0);
    for (size_t u = 0; u < ubatches.size(); ++u) {
        for (uint32_t j = 0; j < ubatches[u].n_seqs_unq; ++j) {
            last[ubatches[u].seq_id_unq[j]] = u;
        }
    }
    exports.assign(ubatches.size(), false);
    for (size_t u = 0; u < ubatches.size(); ++u) {
        for (uint32_t j = 0; j < ubatches[u].n_seqs_unq; ++j) {
            if (last[ubatches[u].seq_id_unq[j]] == u) {
                exports[u] = true;
            }
        }
    }
}

uint32_t llama_sfi_plan::apply(size_t u, const llama_kv_cache::slot_info & sinfo, uint32_t n_kv) {
    s0 = sinfo.s0;
    s1 = sinfo.s1;

    streams.assign(sinfo.strm.begin(), sinfo.strm.end());

    // the streams' steps (decode_begin), cut into runs of one step
    steps.clear();
    runs.clear();
    bool any_slow = false;
    for (const uint32_t s : streams) {
        const llama_sfi_step st = s < view.stream_steps.size() ? view.stream_steps[s] : step;
        if (runs.empty() || runs.back().step != st) {
            runs.push_back({ st, (uint32_t) steps.size(), 0 });
        }
        runs.back().n++;
        steps.push_back(st);
        any_slow |= st == LLAMA_SFI_STEP_SLOW;
    }
    ubatch_step = runs.size() == 1 ? runs[0].step : LLAMA_SFI_STEP_MIXED;
    exporting   = any_slow && exports[u];
    capturing   = false;
    for (const uint32_t s : streams) {
        capturing |= ubatch_step == LLAMA_SFI_STEP_FAST && view.streams[s].capture;
    }

    for (uint32_t j = 0; j < sinfo.n_stream(); ++j) {
        view.note_written(sinfo.strm[j], sinfo.idxs[j]);
    }

    // the device Selector's evidence op may give every norm it reads (then no layer keeps its own)
    const bool selects = view.n_candidates > 0 && view.selects(std::min<int64_t>(view.n_candidates, n_kv));

    kn_cells.clear();
    if (exporting && (selects ? view.selector_own_key_norms : view.params.export_key_norms)) {
        const int64_t size = view.kv.get_size();

        for (size_t j = 0; j < streams.size(); ++j) {
            if (steps[j] != LLAMA_SFI_STEP_SLOW) {
                continue;
            }
            const uint32_t s  = streams[j];
            const auto &   st = view.streams[s];

            for (const uint32_t c : st.kn_stale) {
                kn_cells.push_back(s*size + c);
            }
            for (uint32_t c = st.kn_upto; c < n_kv; ++c) {
                kn_cells.push_back(s*size + c);
            }
        }

        if (!kn_cells.empty()) {
            kn_cells.resize(GGML_PAD(kn_cells.size(), LLAMA_SFI_PAD), kn_cells.back());
        }
    }

    n_view = 0;
    gathering.clear();
    tail0.assign(sinfo.n_stream(), 0);

    if (!fast() && !mixed()) {
        return n_kv;
    }

    const uint32_t n_tps = sinfo.size();

    for (uint32_t j = 0; j < sinfo.n_stream(); ++j) {
        const uint32_t s = sinfo.strm[j];
        if (steps[j] != LLAMA_SFI_STEP_FAST) {
            // written where no mask of a FAST step keeps a slot before a FAST step wrote it (the last ones)
            tail0[j] = view.c_max - n_tps;
            continue;
        }
        bool gather = false;
        tail0[j] = view.apply_ubatch(s, sinfo.idxs[j], gather);
        if (gather) {
            gathering.push_back(s);
        }
        n_view = std::max(n_view, view.n_view(s, s));
    }

    return fast() ? n_view : n_kv;
}

ggml_tensor * llama_sfi_plan::get_k(ggml_context * ctx, int32_t il, uint32_t n_kv) const {
    return view.get_k(ctx, il, n_kv, s0, s1);
}

ggml_tensor * llama_sfi_plan::get_v(ggml_context * ctx, int32_t il, uint32_t n_kv) const {
    return view.get_v(ctx, il, n_kv, s0, s1);
}

void llama_sfi_plan::set_input_kq_mask(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    if (fast()) {
        view.set_input_kq_mask(dst, ubatch);
        return;
    }

    // MIXED: the FAST streams' rows are not read (their mask is sfi_inp_fast_mask)
    view.set_input_dense_kq_mask(dst, ubatch, steps);
}

void llama_sfi_plan::set_input_fast_mask(ggml_tensor * dst, const llama_ubatch * ubatch) const {
    view.set_input_kq_mask(dst, ubatch, &steps);
}

//
// cells
//

std::pair<llama_pos, llama_pos> llama_sfi_selector_range(const llama_sfi_view & view, llama_seq_id seq) {
    const llama_pos n_ctx = view.kv.get_cells(seq).seq_pos_max(seq) + 1;
    const llama_pos first = std::min<llama_pos>(view.selector.n_sink, std::max<llama_pos>(n_ctx, 0));

    return { first, std::max<llama_pos>(first, n_ctx - view.selector.n_recent) };
}

std::vector<uint8_t> llama_sfi_cells_holding(const llama_kv_cells & cells, llama_seq_id seq, llama_pos p0, llama_pos p1) {
    std::vector<uint8_t> res(cells.size(), 0);

    const uint32_t n = cells.used_max_p1();
    for (uint32_t c = 0; c < n; ++c) {
        res[c] = !cells.is_empty(c) && cells.seq_has(c, seq) && cells.pos_in(c, p0, p1);
    }

    return res;
}

std::vector<int32_t> llama_sfi_cells_outside(const llama_kv_cells & cells, llama_seq_id seq, std::pair<llama_pos, llama_pos> range) {
    // seq's (position, cell) pairs in position order: the few cells below and past the range, without a pass
    // over every cell
    const auto & by_pos = cells.seq_pos_get(seq);

    std::vector<int32_t> res;
    for (auto it = by_pos.begin(); it != by_pos.end() && it->first < range.first; ++it) {
        res.push_back(it->second);
    }
    std::sort(res.begin(), res.end());

    const size_t n_sink = res.size();
    for (auto it = by_pos.lower_bound({ std::max(range.first, range.second), 0 }); it != by_pos.end(); ++it) {
        res.push_back(it->second);
    }
    std::sort(res.begin() + n_sink, res.end());

    return res;
}

void llama_sfi_view::store_rows(stream & st, const int32_t * cells, int32_t n_own, const int32_t * shared, int32_t n_shared,
        int32_t prev_n_sel, int32_t prev_n_own) {
    const int32_t n_layers  = layers.size();
    const int32_t n_head_kv = n_head_kv_max;
    const int64_t n_sel     = (int64_t) n_own + n_shared;

    // support stability: own cells of each row the previous selection's row had
    st.overlap = -1.0f;
    if (prev_n_own > 0 && n_own > 0 && st.sel.size() == (size_t) n_layers*n_head_kv*prev_n_sel) {
        // stamp[c] == id of the last (layer, head) whose previous selection had cell c
        std::vector<int32_t> & stamp = st.overlap_stamps;
        stamp.assign(kv.get_size(), -1);

        int64_t n_hit = 0;
        int64_t n_all = 0;
        for (int32_t i = 0; i < n_layers; ++i) {
            for (int32_t h = 0; h < layers[i].n_head_kv; ++h) {
                const int32_t id = i*n_head_kv + h;

                const int32_t * prev = st.sel.data() + (int64_t) id*prev_n_sel;
                for (int32_t j = 0; j < prev_n_own; ++j) {
                    stamp[prev[j]] = id;
                }
                for (int32_t j = 0; j < n_own; ++j) {
                    n_hit += stamp[cells[(int64_t) id*n_own + j]] == id;
                }
                n_all += n_own;
            }
        }

        st.overlap = (float) ((double) n_hit/n_all);
    }

    st.sel.resize((size_t) n_layers*n_head_kv*n_sel);

    for (int32_t i = 0; i < n_layers; ++i) {
        for (int32_t h = 0; h < n_head_kv; ++h) {
            // heads a layer does not have: gather the cells of its first head, never read
            const int64_t src = (int64_t) i*n_head_kv + (h < layers[i].n_head_kv ? h : 0);

            int32_t * dst = st.sel.data() + ((size_t) i*n_head_kv + h)*n_sel;
            std::copy_n(cells + src*n_own, n_own, dst);
            std::copy_n(shared, n_shared, dst + n_own);
        }
    }
}

void llama_sfi_view::store_selection(stream & st, const int32_t * cells, int32_t n_own, const int32_t * shared, int32_t n_shared,
        bool gathered) {
    store_rows(st, cells, n_own, shared, n_shared, st.n_sel, st.n_own);

    st.n_sel          = n_own + n_shared;
    st.n_own          = n_own;
    st.valid          = true;
    st.gather_pending = !gathered;
    st.sel_pending    = false;
    st.tail.clear();
}

void llama_sfi_parallel_for(int64_t n, const std::function<void(int64_t)> & fn) {
    const int64_t n_threads = std::min<int64_t>({ n, 8, std::max<int64_t>(1, std::thread::hardware_concurrency()) });
    if (n_threads <= 1) {
        for (int64_t i = 0; i < n; ++i) {
            fn(i);
        }
        return;
    }

    std::atomic<int64_t> next { 0 };
    auto work = [&] {
        for (int64_t i = next++; i < n; i = next++) {
            fn(i);
        }
    };

    std::vector<std::thread> threads;
    threads.reserve(n_threads - 1);
    for (int64_t t = 1; t < n_threads; ++t) {
        threads.emplace_back(work);
    }
    work();
    for (auto & t : threads) {
        t.join();
    }
}
