"""`sfi-gguf chat`: an interactive conversation that keeps its history.

One line of input is one user message; the answer streams to stdout. The conversation grows turn by
turn, so each turn only prefills the new message (the KV cache of the history is reused). Reads any
stream, so it also runs with piped input (`printf 'Hi\\n/quit\\n' | sfi-gguf chat`).
"""
from __future__ import annotations

import sys
from typing import TextIO

from .core.sampling import SamplingParams
from .core.stepper import format_sfi_stats

HELP = "commands: /reset forgets the conversation, /quit (or end of input) leaves, /help shows this"


def chat_loop(llm, system: str | None = None, max_tokens: int = 512, stats: bool = False,
              stdin: TextIO = sys.stdin, stdout: TextIO = sys.stdout, stderr: TextIO = sys.stderr,
              sampling: SamplingParams | None = None) -> int:
    """Run the conversation until /quit or end of input; `sampling` goes to `SFILlama.generate` (None: its
    defaults)."""
    if llm.context.chat_template() is None:
        raise ValueError(f"{llm.model_path.name} has no chat template; use `sfi-gguf run` for plain text")
    interactive = stdin.isatty()
    start = [{"role": "system", "content": system}] if system else []
    messages = list(start)
    if interactive:
        print(f"sfi-gguf chat ({llm.model_path.name}); {HELP}", file=stderr)
    while True:
        if interactive:
            stderr.write("> ")
            stderr.flush()
        line = stdin.readline()
        if not line:
            break
        text = line.strip()
        if not text:
            continue
        if text in ("/quit", "/exit"):
            break
        if text == "/reset":
            messages = list(start)
            print("[conversation reset]", file=stderr)
            continue
        if text == "/help":
            print(HELP, file=stderr)
            continue
        messages.append({"role": "user", "content": text})
        pieces = []
        try:
            for piece in llm.generate(messages, max_tokens=max_tokens, stream=True, sampling=sampling):
                stdout.write(piece)
                stdout.flush()
                pieces.append(piece)
        except ValueError as exc:  # e.g. the conversation no longer fits the context
            messages.pop()
            print(f"sfi-gguf chat: {exc} (/reset starts over)", file=stderr)
            continue
        stdout.write("\n")
        stdout.flush()
        messages.append({"role": "assistant", "content": "".join(pieces)})
        if stats:
            s = llm.last_stats
            print(f"[{s.mode}] {s.n_generated} tokens, {s.decode_tok_s:.1f} tok/s; prompt {s.n_prompt} tokens, "
                  f"{s.n_prompt_decoded} new (the rest reused from the cache); context {s.n_ctx_end}/{llm.n_ctx}; "
                  f"finish: {s.finish_reason}", file=stderr)
            if s.sfi is not None:
                print(format_sfi_stats(s.sfi), file=stderr)
        stderr.flush()
    return 0
