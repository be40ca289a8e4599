"""Quick start: load the default model, generate, chat, stream, and read the SFI statistics.

    python examples/quickstart.py [--max-tokens 64]
"""
import argparse

from sfi_gguf import SFILlama

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("-m", "--model", default=None, help="GGUF path or known model name")
parser.add_argument("-n", "--max-tokens", type=int, default=64)
parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
args = parser.parse_args()

llm = SFILlama(args.model, n_ctx=4096, n_threads=args.threads)  # SFI is on by default; SFILlama(..., sfi=False) decodes densely

# 1. the native API: a Completion with text, tokens and statistics
out = llm.generate("The key idea of caching is", max_tokens=args.max_tokens, temperature=0)
print(out.text)
print(f"-> {out.stats.n_generated} tokens at {out.stats.decode_tok_s:.1f} tok/s, finish: {out.finish_reason}\n")

# 2. llama-cpp-python's API: the same dicts as llama_cpp.Llama, plus "sfi_stats"
reply = llm.create_chat_completion([{"role": "user", "content": "Write a haiku about caches."}],
                                   max_tokens=args.max_tokens, temperature=0.7, seed=1)
print(reply["choices"][0]["message"]["content"])
print(f"-> usage {reply['usage']}, mode {reply['sfi_stats']['mode']}\n")

# 3. streaming, as with llama_cpp.Llama: chunks of the completion
for chunk in llm("Once upon a time", max_tokens=args.max_tokens, stream=True, seed=1):
    print(chunk["choices"][0]["text"], end="", flush=True)
print()
llm.close()
