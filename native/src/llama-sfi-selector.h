#pragma once

// The device Selector in the slow step's graph

struct llama_sfi_layer_export;

// SLOW with the device Selector, for the layer of ex: keeps its queries, keys, sinks and key norms, and after the last
// refreshed layer runs the Selector on every refreshed layer, stacked, and (llama_sfi_view::gathers) gathers its
// selection into the view
void llama_sfi_build_selection(const llama_sfi_layer_export & ex);

// whether the Selector takes the evidence and key norms of ex's layer from ggml_sfi_evidence (the backend of its keys
// has the op; no attention sinks, no ALiBi): the layer then needs no key norms of its own
bool llama_sfi_selector_fused(const llama_sfi_layer_export & ex);
