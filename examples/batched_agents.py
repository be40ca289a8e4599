"""Several conversations at once: one model, n_parallel sequences decoded together.

Each prompt gets its own KV stream and SFI state; the sequences share every llama_decode, so the
weights are read once per step for all of them. Run: python examples/batched_agents.py
"""
import argparse

from sfi_gguf import SFILlama

TASKS = [
    "Write a one-line Python function that reverses a string.",
    "Explain in two sentences what a KV cache is.",
    "Give three names for a cat that likes to sleep on keyboards.",
]

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("-m", "--model", default=None, help="GGUF path or known model name")
parser.add_argument("-n", "--max-tokens", type=int, default=96)
parser.add_argument("-t", "--threads", type=int, default=None, help="CPU threads (default: all cores)")
args = parser.parse_args()

llm = SFILlama(args.model, n_ctx=2048, n_threads=args.threads, n_parallel=len(TASKS))
answers = llm.generate_batch([[{"role": "user", "content": task}] for task in TASKS], max_tokens=args.max_tokens,
                             temperature=0)
for task, answer in zip(TASKS, answers):
    print(f"## {task}\n{answer.text.strip()}\n({answer.stats.n_generated} tokens, {answer.finish_reason})\n")
llm.close()
