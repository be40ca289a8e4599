#pragma once

// The SFI state of a llama_context: the mode, what each decode does with the compact view, and the exports of the
// slow steps

#include "llama-sfi.h"
#include "llama-sfi-fast-graphs.h"

#include "ggml-backend.h"
#include "ggml-cpp.h"

#include <cstdint>
#include <memory>
#include <new>
#include <utility>
#include <vector>

class llama_kv_cache;
struct llama_model;
struct llama_batch;
struct llama_sfi_graph_result;
struct llama_sfi_run_export;
struct llama_sfi_view;
struct llama_ubatch;
struct llama_memory_context_i;
class llm_graph_result;

// an allocator whose resize leaves new elements uninitialised: a slow step's selection and candidates are MBs that it
// writes in full, and a fill before would cost as much as the copy
template <typename T>
struct llama_sfi_uninit_allocator : std::allocator<T> {
    template <typename U> struct rebind { using other = llama_sfi_uninit_allocator<U>; };

    using std::allocator<T>::allocator;

    template <typename U> void construct(U * p) noexcept { ::new ((void *) p) U; }
    template <typename U, typename... Args> void construct(U * p, Args &&... args) { ::new ((void *) p) U(std::forward<Args>(args)...); }
};

using llama_sfi_ints = std::vector<int32_t, llama_sfi_uninit_allocator<int32_t>>;

// the exports of a SLOW decode for one stream: [n_layers][n_head_kv_max][n_cells]
struct llama_sfi_export {
    bool valid = false;

    int32_t n_cells = 0;
    int32_t n_rows  = 0;

    std::vector<float> mass;
    std::vector<float> evidence;
    std::vector<float> key_norms;
    llama_sfi_ints cells; // [n_layers][n_cells]: the candidate cells, empty when all cells are exported

    int32_t n_sel = 0;
    llama_sfi_ints selection; // [n_layers][n_head_kv_max][n_sel]: the device Selector's cells, if it ran

    // a slow step's copy of one stream's picks and candidates that has their layout (picks that are cell ids, every
    // layer refreshed) stays where the copy put it, in the context's buffers, and is read there: the step copies MBs
    // less. own() moves it here before those buffers take another copy
    const int32_t * selection_in = nullptr;
    const int32_t * cells_in     = nullptr;

    const int32_t * selection_data() const { return selection_in ? selection_in : selection.data(); }
    const int32_t * cells_data()     const { return cells_in     ? cells_in     : cells.data(); }

    bool has_selection() const { return selection_in || !selection.empty(); }
    bool has_cells()     const { return cells_in     || !cells.empty(); }

    void own(size_t n_layers, size_t n_head_kv);
    std::vector<int32_t> shared;    // with a selection: the cells outside the Selector's range (sink, recent)
    bool gathered = false;          // ... and the step gathered them into the view

    // the device Selector's picks as the step left them, [n_layers][n_head_kv_max][n_sel] indices into the layer's
    // candidates (cells); selection holds their cells once mapped (llama_sfi_context::map_selection): a refresh's
    // host work then runs while the next step computes, or when something reads the selection
    llama_sfi_ints picks;
    bool mapped = true;
    bool in_range = false; // every pick is known to lie in the Selector's range (map_selection need not check it)

    llama_seq_id seq = -1;                      // the sequence of the stream at the step ...
    std::pair<llama_pos, llama_pos> range;      // ... and the positions its Selector chose from

    uint32_t n_edits = 0; // the stream's n_edits at the step: the cells above hold while it is unchanged

    // no export, the vectors' memory kept: a slow step's exports are MBs, and memory the allocator maps anew at every
    // refresh is paid for in page faults
    void reset();
};

// the queries of one stream's last token in a FAST decode that captured them (llama_sfi_seq_capture_queries)
struct llama_sfi_queries {
    bool      valid = false;
    llama_pos pos   = -1; // the token's position

    int64_t n_embd_head = 0;
    std::vector<int64_t>            n_head; // per covered layer
    std::vector<std::vector<float>> q;      // per covered layer, [n_embd_head, n_head] scaled (llama_sfi_capture_queries)
};

// SFI state of a llama_context
struct llama_sfi_context {
    llama_sfi_context(const llama_model & model, llama_kv_cache * kv, std::shared_ptr<llama_sfi_view> view, const llama_sfi_params & params);
    ~llama_sfi_context(); // detaches the view from the cache

    const llama_model & model;

    llama_kv_cache * kv;

    std::shared_ptr<llama_sfi_view> view;

    const llama_sfi_params params;

    std::vector<llama_sfi_mode> modes; // per stream: the step its next decodes ask for (llama_sfi_set_mode, llama_sfi_seq_set_mode)

    std::vector<uint32_t> status; // per stream: LLAMA_SFI_STATUS_LAST_FAST / FELL_BACK_DENSE of its last decode

    std::vector<llama_sfi_export> exports; // per stream, from the last SLOW decode of its sequence

    std::vector<uint8_t>           capture_next; // per stream: its next FAST decode keeps its queries
    std::vector<llama_sfi_queries> queries;      // per stream, from the last decode of its sequence that kept them

    llama_sfi_fast_graphs fast_graphs; // the scheduler and graphs of the FAST steps

    // res was built on sched, which allocates it next
    void built(const llm_graph_result * res, ggml_backend_sched_t sched);

    // the context reset its graphs (a reserve, a memory update)
    void reset_graphs();

    // each stream of the batch takes the step of its mode (or runs dense, see llama-sfi.h)
    void decode_begin(const llama_batch & batch);
    void decode_end();

    // copy the exports of a computed ubatch graph (of each run of its SLOW streams)
    void extract(ggml_backend_sched_t sched, const llama_sfi_graph_result & res, const llama_ubatch & ubatch);

    // the last SLOW step's selection of stream s -> the view (llama_sfi_seq_load_selection); returns 0 or an error.
    // A selection the step gathered into the view is committed at once, its rows (stream::sel, the overlap) later.
    int32_t load_selection(uint32_t s);

    // the picks of stream s's export -> its selection's cells
    void map_selection(uint32_t s);

    // the rows of a selection loaded without them (stream::sel_pending) -> stream s
    void resolve(uint32_t s);

    // nodes the SFI ops add to a graph at most
    uint32_t n_graph_nodes() const;

private:
    // extract_selection's copies of a run's picks and candidates, kept between steps: in the device's pinned host
    // memory where it has one (a copy from a device into pageable memory goes through a staging buffer)
    struct host_ints {
        ggml_backend_buffer_ptr pinned;
        std::vector<int32_t>    pageable;

        // room for n values, for copies from tensors of buffer type buft
        int32_t * get(size_t n, ggml_backend_buffer_type_t buft);
    };

    host_ints picks_buf;
    host_ints cells_buf;

    void extract_run(ggml_backend_sched_t sched, const llama_sfi_run_export & res, const llama_ubatch & ubatch);
    void extract_queries(ggml_backend_sched_t sched, const llama_sfi_graph_result & res, const llama_ubatch & ubatch);
    void extract_selection(ggml_backend_sched_t sched, const llama_sfi_run_export & res, const llama_ubatch & ubatch);
};
