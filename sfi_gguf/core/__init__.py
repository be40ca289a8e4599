"""The inference library: the patched llama.cpp's bindings, the model context, sampling, the token loop,
and Slow-Fast Inference (configuration, policies, selectors, the stepper, the engine). Imports nothing from
`sfi_gguf.serve` or `sfi_gguf.tools`."""
