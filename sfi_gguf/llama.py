"""`SFILlama`: the user-facing model object."""
from __future__ import annotations

import ctypes
import os
from typing import Iterator, Sequence, Union

from ._native import llama_cpp
from .config import SFIConfig
from .context import LlamaContext
from .generate import Completion, DenseStepper, GenerationStats, run_generation
from .models import resolve_model_path
from .sampling import Sampler, SamplingParams

Message = dict  # {"role": ..., "content": ...}
Prompt = Union[str, Sequence[Message], Sequence[int]]

# Prompts longer than this show a progress bar while they are processed (when progress is on).
PROGRESS_MIN_TOKENS = 1024


class SFILlama:
    """A GGUF model with Slow-Fast Inference decoding.

    `model_path` None uses the default model (Qwen2.5-Coder-0.5B-Instruct, fetched and cached on first
    use); a known model name ("gemma3-270m") or a path to a .gguf file also work. n_ctx 0 means the
    model's training context.

    `sfi`: an `SFIConfig` (default: `SFIConfig()`, the method with its published defaults), a policy
    name ("punctuation", "fixed", "static", "sink_recent", "dense"), or False for plain dense decoding.
    SFI needs flash attention (the compact view stores V like K).
    """

    def __init__(self, model_path: str | os.PathLike | None = None, *, n_ctx: int = 4096,
                 n_gpu_layers: int = 0, n_threads: int | None = None, n_batch: int = 512,
                 flash_attn: bool = True, verbose: bool = False, progress: bool = False,
                 sfi: SFIConfig | str | bool | None = True):
        if n_ctx < 0:
            raise ValueError(f"n_ctx must be >= 0 (0 = the model's training context), got {n_ctx}")
        if n_batch < 1:
            raise ValueError(f"n_batch must be >= 1, got {n_batch}")
        if n_threads is not None and n_threads < 1:
            raise ValueError(f"n_threads must be >= 1, got {n_threads}")
        self.sfi_config = _sfi_config(sfi)
        if self.sfi_config.policy != "dense" and not flash_attn:
            raise ValueError("SFI needs flash_attn=True (pass sfi=False for dense decoding without it)")
        self.model_path = resolve_model_path(model_path)
        self.progress = progress
        self._ctx = LlamaContext(self.model_path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                                 n_batch=n_batch, flash_attn=flash_attn, verbose=verbose)
        self.last_stats: GenerationStats | None = None
        self._sfi_native = None
        self._pieces = None

    # -- properties -----------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def context(self) -> LlamaContext:
        return self._ctx

    def reset(self) -> None:
        """Forget the KV cache (the next generate prefills its whole prompt)."""
        self._ctx.clear()

    def close(self) -> None:
        if self._sfi_native is not None:
            self._sfi_native.free()
            self._sfi_native = None
        self._ctx.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- text -----------------------------------------------------------------------------------
    def tokenize(self, text: str, add_special: bool = True) -> list[int]:
        return self._ctx.tokenize(text, add_special=add_special)

    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._ctx.detokenize(tokens)

    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True) -> str:
        """The GGUF's chat template applied to messages (llama.cpp's template engine)."""
        template = self._ctx.chat_template()
        if template is None:
            raise ValueError(f"{self.model_path.name} has no chat template; pass a plain string prompt")
        if not messages:
            raise ValueError("messages is empty")
        for m in messages:
            if not isinstance(m, dict) or "role" not in m or "content" not in m:
                raise ValueError(f"each message needs 'role' and 'content', got {m!r}")
        keep = [(str(m["role"]).encode(), str(m["content"]).encode()) for m in messages]
        chat = (llama_cpp.llama_chat_message * len(keep))()
        for i, (role, content) in enumerate(keep):
            chat[i].role = role
            chat[i].content = content
        size = sum(len(r) + len(c) for r, c in keep) * 2 + 256
        for _ in range(2):
            buf = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_chat_apply_template(template.encode(), chat, len(keep), add_generation_prompt,
                                                    buf, size)
            if n < 0:
                raise ValueError(f"llama.cpp does not support the chat template of {self.model_path.name}")
            if n <= size:
                return buf.raw[:n].decode("utf-8", errors="replace")
            size = n + 1
        raise RuntimeError("chat template output did not fit")

    def prompt_tokens(self, prompt: Prompt) -> list[int]:
        """A prompt as tokens: text is tokenized, messages are chat-formatted, token ids pass through."""
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if len(prompt) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self._ctx.n_vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {self._ctx.n_vocab}): {bad[:5]}")
            return list(prompt)
        text = self.apply_chat_template(prompt)
        return self._ctx.tokenize(text, add_special=not self._starts_with_bos(text))

    def _starts_with_bos(self, text: str) -> bool:
        bos = llama_cpp.llama_vocab_bos(self._ctx.vocab)
        if bos < 0:
            return False
        bos_text = self._ctx.token_bytes(bos, special=True).decode(errors="replace")
        return bool(bos_text) and text.startswith(bos_text)

    # -- generation -----------------------------------------------------------------------------
    def _stepper(self, config: SFIConfig | None = None):
        """Dense, or an SFI stepper with a fresh policy (the native view and vocabulary are kept)."""
        from .native import SFINative

        config = config or self.sfi_config
        if config.policy == "dense":
            if self._sfi_native is not None:
                self._sfi_native.set_mode(SFINative.DENSE)  # plain dense decodes from now on
            return DenseStepper(self._ctx)
        from .boundary import PieceTable
        from .policy import make_policy
        from .selector import make_selector
        from .sfi import SFIStepper

        params = dict(n_sel_max=config.n_sink + config.resolve_k_head(self.n_ctx) + config.n_recent,
                      n_tail_max=max(256, 2 * config.refresh_interval), n_query_rows=config.n_prefill_queries,
                      evidence_alpha=config.alpha, export_key_norms=True)
        if self._sfi_native is None:
            self._sfi_native = SFINative(self._ctx.ctx, **params)
        elif any(self._sfi_native.params[k] != v for k, v in params.items()):
            self._sfi_native.init(**params)  # the config changed since: new budgets
        if self._pieces is None and config.policy == "punctuation":
            self._pieces = PieceTable([self._ctx.token_bytes(t) for t in range(self._ctx.n_vocab)])
        return SFIStepper(self._ctx, self._sfi_native, config, make_policy(config, self._pieces),
                          make_selector(config))

    def generate(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95,
                 top_k: int = 40, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stream: bool = False, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 ignore_eos: bool = False) -> Union[Completion, Iterator[str]]:
        """Continue `prompt` (a string, chat messages to format with the model's template, or token ids).

        Returns a `Completion`; with stream=True, an iterator of text pieces (statistics in
        `self.last_stats` once it is exhausted). The KV cache of the longest common prefix with the
        previous call is reused.
        """
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 0:
            raise ValueError(f"max_tokens must be an int >= 0, got {max_tokens!r}")
        stop_list = [stop] if isinstance(stop, str) else list(stop or [])
        params = SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, min_p=min_p,
                                repeat_penalty=repeat_penalty, seed=seed)
        params.validate()
        tokens = self.prompt_tokens(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, the context holds {self.n_ctx} "
                             "(n_ctx); shorten it or create SFILlama with a larger n_ctx")
        stats = GenerationStats()
        self.last_stats = stats
        out_tokens: list[int] = []
        sampler = Sampler(params)
        stepper = self._stepper()
        pieces = run_generation(self._ctx, tokens, sampler, stepper, max_tokens, stop_list, stats,
                                out_tokens, progress=self.progress and len(tokens) >= PROGRESS_MIN_TOKENS,
                                ignore_eos=ignore_eos)
        if max_tokens == 0:
            pieces = _prefill_only(stepper, self._ctx, tokens, stats)
        if stream:
            return _closing(pieces, sampler)
        try:
            text = "".join(pieces)
        finally:
            sampler.close()
        return Completion(text=text, tokens=out_tokens, finish_reason=stats.finish_reason, stats=stats)


def _sfi_config(sfi) -> SFIConfig:
    if sfi is True or sfi is None:
        return SFIConfig()
    if sfi is False:
        return SFIConfig(policy="dense")
    if isinstance(sfi, str):
        return SFIConfig(policy=sfi)
    if isinstance(sfi, SFIConfig):
        return sfi
    raise ValueError(f"sfi must be an SFIConfig, a policy name or a bool, got {sfi!r}")


def _prefill_only(stepper, ctx: LlamaContext, tokens, stats: GenerationStats) -> Iterator[str]:
    stats.n_prompt = len(tokens)
    stats.n_prompt_decoded = stepper.prefill(tokens)
    stats.finish_reason = "length"
    stats.n_ctx_end = len(ctx.tokens)
    return iter(())


def _closing(pieces: Iterator[str], sampler: Sampler) -> Iterator[str]:
    try:
        yield from pieces
    finally:
        sampler.close()
