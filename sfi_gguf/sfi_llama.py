"""`SFILlama`: the user-facing model object."""
from __future__ import annotations

import functools
import os
import threading
import warnings
from dataclasses import replace
from typing import Iterator, Sequence, Union

from .serve import openai_api
from .core.library import llama_cpp
from .core.config import SFIConfig
from .core.context import ContextError, LlamaContext, default_threads
from .core.devices import check_offload
from .core.engine import (GPU_BATCHED_MIN_CONTEXT, GPU_MIN_CONTEXT, SFIEngine, check_fits as _check_fits,  # noqa: F401
                     check_split as _check_split, sfi_config as _sfi_config)
from .core.generate import Completion, GenerationStats, run_generation
from .models import resolve_model_path
from .core.sampling import Sampler, SamplingParams, is_int
from .core.stepper import Stepper

Message = dict  # {"role": ..., "content": ...}
Prompt = Union[str, Sequence[Message], Sequence[int]]

# Prompts longer than this show a progress bar while they are processed (when progress is on).
PROGRESS_MIN_TOKENS = 1024

# n_batch and the ubatch with kv_on_host: each ubatch of a prompt attends on the device over a copy of every cached
# cell, so a larger ubatch copies the cache fewer times (at 512 tokens a 32K prompt copied ~150 GB: 13x the in-VRAM
# prefill); its device buffers grow with it (the attention mask alone: n_ctx x ubatch x 2 bytes, 0.5 GiB at 128K)
KV_ON_HOST_BATCH = 4096
KV_ON_HOST_UBATCH = 2048


def _check_kv_on_host(n_gpu_layers: int, flash_attn: bool) -> None:
    """kv_on_host keeps the KV cache in host memory and the compact view on the device of each offloaded layer:
    it needs offloaded layers, a build with a GPU (or RPC) backend, and flash attention."""
    if not llama_cpp.llama_supports_gpu_offload():
        raise ValueError("kv_on_host=True needs a build with a GPU backend (CUDA, Metal, Vulkan) or RPC; this "
                         "llama.cpp runs on the CPU only, where the KV cache is in host memory anyway")
    if n_gpu_layers == 0:
        raise ValueError("kv_on_host=True keeps the KV cache in host memory and the SFI view on the GPU of each "
                         "offloaded layer: set n_gpu_layers (-1 = every layer)")
    if not flash_attn:
        raise ValueError("kv_on_host=True needs flash_attn=True (the view is gathered cell by cell)")


# ggml's GGML_MAX_N_THREADS: a compute graph never runs on more threads than this.
MAX_THREADS = 512


def _serialised(method):
    """Run a public method under the object's lock, on an open model.

    Why: one llama_context is not safe to use from two threads at once (two decodes into one batch
    abort in ggml); web apps and agent frameworks do call from several threads. And after close()
    every native pointer is gone: a ContextError is the answer, not a use-after-free.
    """
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            self._check_open()
            return method(self, *args, **kwargs)

    return locked


class SFILlama:
    """A GGUF model with Slow-Fast Inference decoding.

    `model_path` None uses the default model (Qwen2.5-Coder-0.5B-Instruct, fetched and cached on first
    use); a known model name ("gemma3-270m") or a path to a .gguf file also work. n_ctx 0 means the
    model's training context.

    `sfi`: an `SFIConfig` (default: `SFIConfig()`, the method with its published defaults), a policy
    name ("punctuation", "fixed", "static", "sink_recent", "dense"), a dict of `SFIConfig` keywords (its
    fields and, by name, the parameters of its policy and selector), or False for plain dense decoding.
    `flash_attn`: SFI works with it on or off. Off is the faster path on CPUs at long context (ggml's
    CPU flash attention reads the KV cache once per query head); on is the default. Either way the same
    prompt again, served from the cache, continues as from a fresh object (docs/reliability.md, "Determinism").
    `n_parallel`: sequences the context holds (n_ctx cells each, one KV stream each) for
    `generate_batch`, which decodes them together; `generate` uses the first.
    `split_mode` ("layer", the default, "row" or "none"), `main_gpu` and `tensor_split` place the
    offloaded layers on several GPUs as in llama-cpp-python's `Llama`; SFI needs whole layers on one
    device ("layer" or "none"). `rpc_servers` ("host:port" of llama.cpp `rpc-server` processes, a list
    or comma-separated; needs a library built with GGML_RPC) adds their devices before the local GPUs.
    `type_kv`: the KV cache's type, "f16" (the default), "q8_0", "bf16" or "f32".
    """

    def __init__(self, model_path: str | os.PathLike | None = None, *, n_ctx: int = 4096,
                 n_gpu_layers: int = 0, n_threads: int | None = None, n_batch: int | None = None,
                 flash_attn: bool = True, verbose: bool = False, progress: bool = False,
                 sfi: SFIConfig | str | bool | None = True, split_mode: str = "layer", main_gpu: int = 0,
                 tensor_split: Sequence[float] | None = None, rpc_servers: Sequence[str] | str | None = None,
                 n_parallel: int = 1, kv_on_host: bool = False, type_kv: str = "f16"):
        _check_int("n_ctx", n_ctx, 0, "(0 = the model's training context)")
        _check_flags(kv_on_host=kv_on_host)
        if n_batch is None:
            n_batch = KV_ON_HOST_BATCH if kv_on_host else 512
        _check_int("n_batch", n_batch, 1)
        _check_int("n_parallel", n_parallel, 1)
        _check_int("n_gpu_layers", n_gpu_layers, -1, "(-1 = every layer)")
        _check_int("main_gpu", main_gpu, 0)
        if n_threads is not None:
            _check_int("n_threads", n_threads, 1)
            if n_threads > MAX_THREADS:
                raise ValueError(f"n_threads must be at most {MAX_THREADS} (ggml's limit), got {n_threads}")
            if n_threads > default_threads():
                warnings.warn(f"n_threads={n_threads} is more than this machine's {default_threads()} CPUs: "
                              "llama.cpp gets slower, not faster", RuntimeWarning, stacklevel=2)
        _check_flags(flash_attn=flash_attn, verbose=verbose, progress=progress)
        if kv_on_host:
            _check_kv_on_host(n_gpu_layers, flash_attn)
        self._lock = threading.RLock()  # see _serialised
        self.sfi_config = _sfi_config(sfi)
        self.split_mode = split_mode
        _check_split(self.sfi_config, split_mode)
        if not check_offload(n_gpu_layers, main_gpu, tensor_split, rpc_servers):
            n_gpu_layers = 0  # (warned) every layer stays on the CPU: SFI takes the CPU's defaults
        self.n_gpu_layers = n_gpu_layers
        self.model_path = resolve_model_path(model_path)
        self.progress = progress
        self._ctx = LlamaContext(self.model_path, n_ctx=n_ctx, n_gpu_layers=n_gpu_layers, n_threads=n_threads,
                                 n_batch=n_batch, flash_attn=flash_attn, verbose=verbose, split_mode=split_mode,
                                 main_gpu=main_gpu, tensor_split=tensor_split, rpc_servers=rpc_servers,
                                 n_seq_max=n_parallel, offload_kqv=not kv_on_host, type_kv=type_kv,
                                 n_ubatch=KV_ON_HOST_UBATCH if kv_on_host else None)
        try:
            _check_fits(self.sfi_config, self._ctx.n_ctx)
        except ValueError:
            self._ctx.close()  # nothing half-initialised: the model goes with the refused object
            raise
        self._generation = 0  # bumped by every generate(): a stream from an earlier call must not decode
        self.last_stats: GenerationStats | None = None
        self._engine = SFIEngine(self._ctx, self.n_gpu_layers, split_mode)
        self._chat_formatter = None
        self._batched = None  # BatchedDecoder, created by the first generate_batch

    # -- properties -----------------------------------------------------------------------------
    @property
    def n_ctx(self) -> int:
        return self._ctx.n_ctx

    @property
    def context(self) -> LlamaContext:
        return self._ctx

    @property
    def closed(self) -> bool:
        return self._ctx.ctx is None

    def _check_open(self) -> None:
        if self.closed:
            raise ContextError("the model was closed (SFILlama.close()); create a new one")

    @_serialised
    def reset(self) -> None:
        """Forget the KV cache, every sequence's (the next generate prefills its whole prompt)."""
        if self._batched is not None:
            self._batched.clear()
        else:
            self._ctx.clear()

    def close(self) -> None:
        """Free the model and its context; any later call raises ContextError. Waits for a call in
        progress in another thread (a stream stops at its next token)."""
        with self._lock:
            if self._batched is not None:
                self._batched.close()
                self._batched = None
            self._engine.close()
            self._ctx.close()

    @_serialised
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- text -----------------------------------------------------------------------------------
    @_serialised
    def tokenize(self, text: str | bytes, add_special: bool = True) -> list[int]:
        """`text` (a str, or UTF-8 bytes as llama-cpp-python's `tokenize` takes) as token ids."""
        return self._ctx.tokenize(text, add_special=add_special)

    @_serialised
    def detokenize(self, tokens: Sequence[int]) -> str:
        return self._ctx.detokenize(tokens)

    @_serialised
    def apply_chat_template(self, messages: Sequence[Message], add_generation_prompt: bool = True,
                            tools: Sequence[dict] | None = None) -> str:
        """The GGUF's chat template applied to messages.

        Rendered with Jinja exactly as llama-cpp-python's `Llama.create_chat_completion` (and
        transformers) do, so prompts, default system prompts included, are the same token for token.
        A message's content may be None or a list of text parts; other keys (tool_calls, name ...) go
        to the template as they are. `tools` (OpenAI tool objects) go to the template's `tools`.
        """
        template = self._ctx.chat_template()
        if template is None:
            raise ValueError(f"{self.model_path.name} has no chat template; pass a plain string prompt")
        if not messages:
            raise ValueError("messages is empty")
        key = (template, add_generation_prompt)
        if self._chat_formatter is None or self._chat_formatter[0] != key:
            from llama_cpp.llama_chat_format import Jinja2ChatFormatter

            def text(token: int) -> str:
                return llama_cpp.llama_vocab_get_text(self._ctx.vocab, token).decode(errors="replace") \
                    if token >= 0 else ""

            formatter = Jinja2ChatFormatter(template, eos_token=text(llama_cpp.llama_vocab_eos(self._ctx.vocab)),
                                            bos_token=text(llama_cpp.llama_vocab_bos(self._ctx.vocab)),
                                            add_generation_prompt=add_generation_prompt)
            self._chat_formatter = (key, formatter)
        return self._chat_formatter[1](messages=[_normalize_message(m) for m in messages],
                                       tools=list(tools) if tools else None).prompt

    @_serialised
    def prompt_tokens(self, prompt: Prompt, tools: Sequence[dict] | None = None) -> list[int]:
        """A prompt as tokens: text (a str, or bytes of UTF-8 text as llama-cpp-python reads them) is tokenized,
        messages are chat-formatted (with `tools`), token ids (a list of ints) pass through."""
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = bytes(prompt).decode("utf-8")
            except UnicodeDecodeError as exc:
                raise ValueError(f"a bytes prompt is UTF-8 text; byte {exc.start} is not UTF-8 ({exc.reason}). "
                                 "Token ids go in a list of ints") from None
        if isinstance(prompt, str):
            return self.tokenize(prompt)
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string, a list of chat messages (dicts) or a list of token ids "
                             f"(ints), got {type(prompt).__name__}: {prompt!r:.80}")
        if not prompt:  # [] is neither messages nor tokens: say what is wrong, not "no chat template"
            raise ValueError("the prompt is empty")
        if all(is_int(t) for t in prompt):
            bad = [t for t in prompt if not 0 <= t < self._ctx.n_vocab]
            if bad:
                raise ValueError(f"token ids out of range [0, {self._ctx.n_vocab}): {bad[:5]}")
            return [int(t) for t in prompt]
        if not all(isinstance(m, dict) for m in prompt):
            odd = next(x for x in prompt if not (is_int(x) if is_int(prompt[0]) else isinstance(x, dict)))
            raise ValueError("a list prompt is either chat messages (dicts) or token ids (ints, not bools), not a "
                             f"mix: it holds {odd!r} ({type(odd).__name__})")
        text = self.apply_chat_template(prompt, tools=tools)
        return self._ctx.tokenize(text, add_special=not self._starts_with_bos(text))

    def _starts_with_bos(self, text: str) -> bool:
        bos = llama_cpp.llama_vocab_bos(self._ctx.vocab)
        if bos < 0:
            return False
        bos_text = self._ctx.token_bytes(bos, special=True).decode(errors="replace")
        return bool(bos_text) and text.startswith(bos_text)

    # -- generation -----------------------------------------------------------------------------
    @property
    def _sfi_native(self):
        """The native SFI state (`bindings.SFINative`), once a stepper created it."""
        return self._engine.native

    @_serialised
    def memory(self):
        """Where the KV cache and SFI's compact view live: a `bindings.Memory` (bytes of each in device and host
        memory; with kv_on_host, the cache in host memory and only the view on the GPU), or None before the
        first SFI generation (which allocates the view)."""
        native = self._engine.native
        return native.memory() if native is not None and native._initialized else None

    @_serialised
    def effective_config(self, config: SFIConfig, batched: bool = False) -> SFIConfig:
        """`config` with the defaults that depend on where the model runs filled in."""
        return self._engine.effective_config(config, batched)

    @_serialised
    def stepper(self, config: SFIConfig | None = None) -> Stepper:
        """A stepper for the model's context, for driving decode steps yourself (benchmarks, agreement checks):
        dense for a dense config, else SFI with a fresh policy (the native view and vocabulary are kept).

        config: default the model's `sfi_config`. The stepper decodes into `self.context`: `prefill(tokens)`,
        then `step(token)` per token; `generate` does the same with sampling around it.
        """
        return self._engine.stepper(config or self.sfi_config)

    @_serialised
    def generate(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95,
                 top_k: int = 40, seed: int | None = None, stop: str | Sequence[str] | None = None,
                 stream: bool = False, min_p: float = 0.05, repeat_penalty: float = 1.0,
                 ignore_eos: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                 logprobs: int | None = None, sfi: SFIConfig | str | bool | None = None,
                 cancel: threading.Event | None = None, grammar=None, typical_p: float = 1.0,
                 mirostat_mode: int = 0, mirostat_tau: float = 5.0, mirostat_eta: float = 0.1,
                 logit_bias: dict | None = None, keep_special: Sequence[int] | None = None,
                 logits_processor=None, stopping_criteria=None,
                 sampling: SamplingParams | None = None) -> Union[Completion, Iterator[str]]:
        """Continue `prompt` (a string, chat messages to format with the model's template, or token ids).

        Returns a `Completion`; with stream=True, an iterator of text pieces (statistics in
        `self.last_stats` once it is exhausted). The KV cache of the longest common prefix with the
        previous call is reused. `logprobs` n: `Completion.logprobs` holds each sampled token's
        log-probability and the n most likely tokens (not with stream=True). `sfi` overrides the
        model's `sfi_config` for this call only. `cancel` (a threading.Event) set from another thread
        ends the generation before its next token (finish_reason "stop"): a server's client went away.
        `grammar` (a `llama_cpp.LlamaGrammar` or GBNF text) constrains the tokens with llama.cpp's grammar
        sampler (`LlamaGrammar.from_json_schema` turns a JSON schema into one). `typical_p`, `mirostat_mode`
        (1 or 2, with `mirostat_tau` and `mirostat_eta`) and `logit_bias` ({token id: bias}) are llama.cpp's
        samplers, placed as llama-cpp-python places them. `keep_special`: token ids of control tokens whose text
        stays in the output (a tool-call format's markers, such as Mistral's `[TOOL_CALLS]`); the others are left
        out, as llama.cpp detokenizes. `logits_processor` and `stopping_criteria` are llama-cpp-python's (callables
        of the tokens so far and the logits, or its `LogitsProcessorList` / `StoppingCriteriaList`): the first
        rewrites the logits before sampling, the second ends the generation (finish_reason "stop") before the
        token sampled when it answers True. `sampling`: a `SamplingParams` in place of the sampling keywords
        (temperature ... logit_bias), which are then left at their defaults.
        """
        _check_int("max_tokens", max_tokens, 0)
        _check_flags(stream=stream, ignore_eos=ignore_eos)
        if logprobs is not None and stream:
            raise NotImplementedError("logprobs with stream=True is not supported; stream without logprobs "
                                      "or ask for them without streaming")
        config = self.sfi_config if sfi is None else _sfi_config(sfi)
        stop_list = _stop_list(stop)
        params = SamplingParams.of(locals(), sampling)
        tokens = self.prompt_tokens(prompt)
        if not tokens:
            raise ValueError("the prompt is empty")
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, the context holds {self.n_ctx} "
                             "(n_ctx); shorten it or create SFILlama with a larger n_ctx")
        self._generation += 1  # from here on, an earlier stream must not decode any more
        stats = GenerationStats()
        self.last_stats = stats
        out_tokens: list[int] = []
        _check_callable("stopping_criteria", stopping_criteria)
        sampler = Sampler(params, self._ctx.n_vocab, logprobs=logprobs, grammar=openai_api.grammar_text(grammar),
                          vocab=self._ctx.vocab, logits_processor=logits_processor)
        stepper = self._engine.stepper(config or self.sfi_config)
        pieces = run_generation(self._ctx, tokens, sampler, stepper, max_tokens, stop_list, stats,
                                out_tokens, progress=self.progress and len(tokens) >= PROGRESS_MIN_TOKENS,
                                ignore_eos=ignore_eos, cancel=cancel, keep_special=_token_set(keep_special),
                                stopping_criteria=stopping_criteria)
        if max_tokens == 0:
            pieces = _prefill_only(stepper, self._ctx, tokens, stats)
        if stream:
            return _closing(pieces, sampler, self, self._generation)
        try:
            text = "".join(pieces)
        finally:
            sampler.close()
        return Completion(text=text, tokens=out_tokens, finish_reason=stats.finish_reason, stats=stats,
                          logprobs=sampler.logprobs if logprobs is not None else None)

    @_serialised
    def generate_batch(self, prompts: Sequence[Prompt], max_tokens: int = 256, temperature: float = 0.8,
                       top_p: float = 0.95, top_k: int = 40, seed: int | None = None,
                       stop: str | Sequence[str] | None = None, min_p: float = 0.05, repeat_penalty: float = 1.0,
                       ignore_eos: bool = False, frequency_penalty: float = 0.0, presence_penalty: float = 0.0,
                       sfi: SFIConfig | str | bool | None = None,
                       sampling: SamplingParams | None = None) -> list[Completion]:
        """Continue several prompts together: one `Completion` per prompt, in order.

        Up to `n_parallel` (see the constructor) sequences decode in the same llama_decode calls, each
        with its own SFI state (sampling seed: `seed + i` for prompt i when a seed is given); more
        prompts wait for a free sequence. A prompt reuses the longest prefix its sequence already holds, as
        `generate` does (`reset()` before: every prompt prefilled from scratch). `sampling`: as for `generate`.
        """
        if isinstance(prompts, str) or not len(prompts) or any(isinstance(p, (int, dict)) for p in prompts):
            raise ValueError("prompts must be a non-empty list of prompts (strings, lists of chat messages or "
                             "lists of token ids)")
        params = SamplingParams.of(locals(), sampling)
        requests = []
        for i, prompt in enumerate(prompts):
            try:
                requests.append(self.batch_request(
                    prompt, max_tokens=max_tokens, stop=stop, ignore_eos=ignore_eos, sfi=sfi,
                    sampling=params if params.seed is None else replace(params, seed=params.seed + i)))
            except ValueError as exc:
                raise ValueError(f"prompt {i}: {exc}") from None
        self._generation += 1  # the shared cache is rebuilt: an earlier stream must not decode any more
        self.batched_decoder().run(requests, progress=self.progress)
        self.last_stats = requests[-1].stats
        return [r.completion() for r in requests]

    @_serialised
    def batch_request(self, prompt: Prompt, max_tokens: int = 256, temperature: float = 0.8, top_p: float = 0.95,
                      top_k: int = 40, seed: int | None = None, stop: str | Sequence[str] | None = None,
                      min_p: float = 0.05, repeat_penalty: float = 1.0, ignore_eos: bool = False,
                      frequency_penalty: float = 0.0, presence_penalty: float = 0.0, logprobs: int | None = None,
                      sfi: SFIConfig | str | bool | None = None, cancel: threading.Event | None = None,
                      grammar=None, typical_p: float = 1.0, mirostat_mode: int = 0, mirostat_tau: float = 5.0,
                      mirostat_eta: float = 0.1, logit_bias: dict | None = None,
                      keep_special: Sequence[int] | None = None, logits_processor=None, stopping_criteria=None,
                      sampling: SamplingParams | None = None):
        """A `batched.Request` for `batched_decoder()`, checked like a `generate` call (`cancel`, `grammar`,
        `keep_special`, `logits_processor`, `stopping_criteria`, `sampling`: as there)."""
        from .core.batched import Request

        _check_int("max_tokens", max_tokens, 0)
        _check_flags(ignore_eos=ignore_eos)
        stop_list = _stop_list(stop)
        config = None if sfi is None else _sfi_config(sfi)
        tokens = self.prompt_tokens(prompt)
        if len(tokens) >= self.n_ctx:
            raise ValueError(f"the prompt has {len(tokens)} tokens, a sequence holds {self.n_ctx} (n_ctx)")
        params = SamplingParams.of(locals(), sampling)
        _check_callable("stopping_criteria", stopping_criteria)
        sampler = Sampler(params, self._ctx.n_vocab, logprobs=logprobs, grammar=openai_api.grammar_text(grammar),
                          vocab=self._ctx.vocab, logits_processor=logits_processor)
        return Request(tokens=tokens, sampler=sampler, max_tokens=max_tokens,
                       stop=stop_list, ignore_eos=ignore_eos, config=config, cancel=cancel,
                       keep_special=_token_set(keep_special), stopping_criteria=stopping_criteria)

    @_serialised
    def batched_decoder(self):
        """The `BatchedDecoder` over this model's n_parallel sequences (created on first use)."""
        from .core.batched import BatchedDecoder

        if self._batched is None:
            def slot_stepper(ctx: LlamaContext, config: SFIConfig | None) -> Stepper:
                return self._engine.stepper(config or self.sfi_config, ctx, batched=True)

            self._batched = BatchedDecoder(self._ctx, slot_stepper, lambda: self._sfi_native)
        return self._batched

    # -- llama-cpp-python's API (sfi_gguf/serve/openai_api.py) -------------------------------------------
    @_serialised
    def create_completion(self, prompt: Union[str, Sequence[int]], *args, **kwargs):
        """`llama_cpp.Llama.create_completion`: same arguments and dicts, plus `sfi=` and "sfi_stats"."""
        return openai_api.create_completion(self, prompt, *args, **kwargs)

    @_serialised
    def __call__(self, prompt: Union[str, Sequence[int]], *args, **kwargs):
        """`llama_cpp.Llama.__call__`: `create_completion`."""
        return openai_api.create_completion(self, prompt, *args, **kwargs)

    @_serialised
    def create_chat_completion(self, messages: Sequence[Message], *args, **kwargs):
        """`llama_cpp.Llama.create_chat_completion` with the GGUF's chat template, plus `sfi=`."""
        return openai_api.create_chat_completion(self, messages, *args, **kwargs)


def _normalize_message(m: Message) -> Message:
    """OpenAI-style message -> what a chat template expects (content a string)."""
    if not isinstance(m, dict) or "role" not in m:
        raise ValueError(f"each message needs a 'role' and a 'content', got {m!r}")
    content = m.get("content")
    if "content" not in m and not m.get("tool_calls"):
        raise ValueError(f"each message needs a 'role' and a 'content', got {m!r}")
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                raise NotImplementedError(f"only text content parts are supported, got {part!r}")
            parts.append(str(part.get("text", "")))
        content = "".join(parts)
    return {**m, "role": str(m["role"]), "content": "" if content is None else str(content)}


def _prefill_only(stepper, ctx: LlamaContext, tokens, stats: GenerationStats) -> Iterator[str]:
    stats.n_prompt = len(tokens)
    stats.n_prompt_decoded = stepper.prefill(tokens)
    stats.finish_reason = "length"
    stats.n_ctx_end = len(ctx.tokens)
    return iter(())


def _check_int(name: str, value, minimum: int, meaning: str = "") -> None:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}{' ' + meaning if meaning else ''}, got {value!r}")


def _stop_list(stop) -> list[str]:
    """`stop` (None, a string or a list of strings) as a list, refusing anything else by name."""
    stops = [stop] if isinstance(stop, str) else stop
    if stops is None:
        return []
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) for s in stops):
        raise ValueError(f"stop must be None, a string or a list of strings, got {stop!r}")
    if "" in stops:  # llama-cpp-python's loop would find it at once and answer nothing: refused, not ignored
        raise ValueError(f"stop strings must not be empty, got {stop!r}")
    return list(stops)


def _check_callable(name: str, value) -> None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be a callable (input_ids, logits) -> bool, such as a "
                         f"llama_cpp.StoppingCriteriaList, got {value!r}")


def _token_set(tokens) -> frozenset:
    if tokens is None:
        return frozenset()
    if isinstance(tokens, (str, bytes)) or not all(is_int(t) for t in tokens):
        raise ValueError(f"keep_special must be a list of token ids, got {tokens!r}")
    return frozenset(int(t) for t in tokens)


def _check_flags(**flags) -> None:
    for name, value in flags.items():
        if not isinstance(value, bool):
            raise ValueError(f"{name} must be True or False, got {value!r}")


def _closing(pieces: Iterator[str], sampler: Sampler, owner: "SFILlama", generation: int) -> Iterator[str]:
    """The stream of one generate() call; frees its sampler however it ends.

    Each token is computed under the model's lock (`_serialised`), so a stream may be read in any
    thread; the lock is not held between tokens. A stream superseded by a later generate() call (from
    any thread: it rebuilt the shared KV cache) raises instead of decoding its next token into the
    other call's cache, and one whose model was closed raises ContextError.
    """
    try:
        while True:
            with owner._lock:
                owner._check_open()
                if owner._generation != generation:
                    raise RuntimeError("this stream was superseded by a later generate() call on the same model "
                                       "(they share one KV cache); finish or close a stream before the next call")
                try:
                    piece = next(pieces)
                except StopIteration:
                    return
            yield piece
    finally:
        with owner._lock:
            if hasattr(pieces, "close"):  # run_generation's own clean-up (statistics); iter(()) has none
                pieces.close()
            sampler.close()
