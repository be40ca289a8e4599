"""Question answering over a long document with Slow-Fast Inference.

The document is natural English prose shipped with Python (sfi_gguf.tools.texts) with one fact planted in
the middle; the model reads all of it and answers a question about the fact. The context is long
enough for SFI to select a sparse memory: most answer tokens are fast steps that read only that memory.

    python examples/long_document_qa.py [--chars 12000] [--max-tokens 48] [--dense]
"""
import argparse
import time

from sfi_gguf import SFILlama
from sfi_gguf.core.stepper import format_sfi_stats
from sfi_gguf.tools.texts import natural_text

FACT = "The archive room on the third floor is opened with the access code 4817."
QUESTION = "According to the document, what is the access code of the archive room?"

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("-m", "--model", default=None)
parser.add_argument("--chars", type=int, default=12000, help="document length in characters (~4.5 per token)")
parser.add_argument("-n", "--max-tokens", type=int, default=48)
parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
parser.add_argument("--dense", action="store_true", help="plain dense decoding, for comparison")
args = parser.parse_args()

paragraphs = natural_text(args.chars, seed=7).split("\n\n")
paragraphs.insert(len(paragraphs) // 2, FACT)
document = "\n\n".join(paragraphs)

llm = SFILlama(args.model, n_ctx=8192, n_threads=args.threads, progress=True, sfi=not args.dense)
messages = [{"role": "system", "content": "Answer from the document only, in one sentence."},
            {"role": "user", "content": f"{document}\n\n{QUESTION}"}]
t0 = time.perf_counter()
reply = llm.create_chat_completion(messages, max_tokens=args.max_tokens, temperature=0)
answer = reply["choices"][0]["message"]["content"]
print(f"Q: {QUESTION}\nA: {answer}")
print(f"(correct: {'4817' in answer}; {time.perf_counter() - t0:.1f} s)")

s = llm.last_stats
print(f"prompt {s.n_prompt} tokens, {s.n_generated} generated at {s.decode_tok_s:.1f} tok/s, mode {s.mode}")
if s.sfi is not None:
    print(format_sfi_stats(s.sfi))
llm.close()
