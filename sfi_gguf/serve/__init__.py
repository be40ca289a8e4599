"""Serving: the OpenAI- and Anthropic-compatible HTTP server, its parallel slots, llama-cpp-python's
completion API and tool calling. Imports from `sfi_gguf.core`, never from `sfi_gguf.tools`."""
