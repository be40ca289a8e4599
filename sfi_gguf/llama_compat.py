"""`sfi_gguf.Llama`: llama-cpp-python's `Llama`, whose token loop decodes with Slow-Fast Inference.

    from sfi_gguf import Llama        # instead of: from llama_cpp import Llama

It *is* a `llama_cpp.Llama` (a subclass): completion, chat handlers and chat formats, grammars and JSON
schemas, logits processors, stopping criteria, logprobs, embeddings, caches and state all come from
llama-cpp-python unchanged. Only `eval`, the one place where llama-cpp-python's `generate` (and so every
completion) puts tokens into the KV cache, is replaced:

- an `eval` of a prompt (several tokens, or the first `eval` of a `generate` call) is the SFI prefill:
  dense, with its last chunk the bootstrap slow step that selects the first sparse memory;
- an `eval` of one token during a `generate` is one SFI step: the trigger policy makes it slow (dense,
  refreshing the memory) or fast (attending to the compact view only).

With `offload_kqv=False` (the KV cache in host memory) and layers on a GPU, SFI keeps its compact view on the
GPU, as `SFILlama(kv_on_host=True)` does: fast steps read GPU memory only (flash attention needed).

The cells of the cache are tracked as llama-cpp-python tracks them (`input_ids[:n_tokens]`); anything that
cuts that history (`reset`, prefix reuse in `generate`, `load_state`) makes the next `eval` a prefill.
llama-cpp-python samples with its own sampler chain from the logits of the last row, as before.

The SFI settings: the constructor's `sfi=` (as `SFILlama`'s: an `SFIConfig`, a policy name, a dict of
SFIConfig fields, True for the defaults, False for plain llama-cpp-python decoding), or the attribute
`sfi_config` between calls. `last_sfi_stats` holds the `SFIStats` of the current or last generation.
`create_chat_completion` adds, with the GGUF's own chat template (the default chat format), what
llama-cpp-python's template handler leaves out: the model's calls read into `tool_calls` (`tool_choice`
"auto" and "required", `parallel_tool_calls`, the legacy `functions`; see `sfi_gguf.serve.tool_calls`), and
`response_format` in the OpenAI `json_schema` form (llama-cpp-python reads only `json_object` with a
"schema"). A chat handler or format chosen by the caller keeps its own tool handling.

Models SFI does not apply to (recurrent and hybrid models, embedding contexts, vocabulary-only loads,
speculative decoding with a draft model)
decode as llama-cpp-python does; `sfi_unavailable` says why.
"""
from __future__ import annotations

import functools
import inspect
import os
import sys
from typing import Optional, Sequence

import numpy as np

from .core.library import llama_cpp
from .core.config import SFIConfig
from .core.context import BorrowedContext, ContextError
from .core.devices import check_offload
from .core.engine import SFIEngine, check_fits, check_split, sfi_config
from .models import KNOWN_MODELS, resolve_model_path
from .serve import tool_calls

_SPLIT_MODES = {llama_cpp.LLAMA_SPLIT_MODE_NONE: "none", llama_cpp.LLAMA_SPLIT_MODE_LAYER: "layer",
                llama_cpp.LLAMA_SPLIT_MODE_ROW: "row"}


class Llama(llama_cpp.Llama):
    """`llama_cpp.Llama` with SFI decoding; every argument of `llama_cpp.Llama`, plus `sfi=`.

    `model_path` may also be None (sfi-gguf's default model) or a known model name, as for `SFILlama`.
    After `close()` every method raises `ContextError` (see `_open_only`).
    """

    _sfi_closed = False

    def __init__(self, model_path: str | os.PathLike | None = None, *args,
                 sfi: SFIConfig | str | bool | dict | None = True, **kwargs):
        # set first: llama_cpp.Llama.__del__ calls close() even when __init__ fails
        self._sfi_engine: Optional[SFIEngine] = None
        self._sfi_ctx: Optional[BorrowedContext] = None
        self._sfi_stepper = None
        self._sfi_fresh = True
        self.sfi_unavailable: Optional[str] = None
        self.sfi_config = sfi_config(sfi)
        self._sfi_requested = sfi is not False
        if model_path is None or (isinstance(model_path, str) and model_path in KNOWN_MODELS):
            model_path = resolve_model_path(model_path)  # the default model or a known name
        offload = check_offload(kwargs.get("n_gpu_layers", 0), kwargs.get("main_gpu", 0), kwargs.get("tensor_split"))
        super().__init__(str(model_path), *args, **kwargs)
        self.sfi_unavailable = self._sfi_reason_unavailable(kwargs)
        if self.sfi_unavailable is not None:
            return
        split_mode = _SPLIT_MODES.get(self.model_params.split_mode, "layer")
        check_split(self.sfi_config, split_mode)
        n_ctx = len(self.input_ids)
        check_fits(self.sfi_config, n_ctx)
        flash = self.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED
        self._sfi_ctx = BorrowedContext(self.model, self.ctx, n_ctx=n_ctx, n_batch=self.n_batch, flash_attn=flash,
                                        scores=self.scores if self._logits_all else None,
                                        kv_on_host=offload and not self.context_params.offload_kqv)
        self._sfi_engine = SFIEngine(self._sfi_ctx, self.model_params.n_gpu_layers if offload else 0, split_mode)

    def _sfi_reason_unavailable(self, kwargs: dict) -> Optional[str]:
        if not self._sfi_requested:
            return "sfi=False"
        if self.model_params.vocab_only:
            return "vocab_only=True: no weights are loaded"
        if self.context_params.embeddings:
            return "embedding=True: embedding contexts hold several sequences in one KV cache"
        if self.draft_model is not None:
            return "draft_model: speculative decoding evaluates several drafted tokens per step"
        if self._is_recurrent or self._is_hybrid:
            return "a recurrent or hybrid model: its state is not a KV cache SFI can select from"
        if (not self.context_params.offload_kqv and self.model_params.n_gpu_layers != 0
                and llama_cpp.llama_supports_gpu_offload()
                and self.context_params.flash_attn_type == llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED):
            # the cache in host memory, the layers on a GPU: SFI's view would go to the GPU (kv_on_host), which
            # gathers cells and so needs flash attention
            return "offload_kqv=False with layers on a GPU needs flash_attn=True for SFI"
        return None

    # -- the token loop ---------------------------------------------------------------------------
    def generate(self, tokens: Sequence[int], *args, **kwargs):
        """`llama_cpp.Llama.generate`; its first `eval` is an SFI prefill (a new selection for the new prompt)."""
        self._sfi_fresh = True
        return super().generate(tokens, *args, **kwargs)

    def eval(self, tokens: Sequence[int]):
        """`llama_cpp.Llama.eval` through SFI: a prompt is prefilled (bootstrap included), a token is one step."""
        ctx = self._sfi_ctx
        if ctx is None:
            return super().eval(tokens)
        n_past = self.n_tokens
        if len(ctx.tokens) != n_past:
            self._sfi_resync()
        stepper = self._sfi_stepper
        try:
            if len(tokens) == 1 and stepper is not None and not self._sfi_fresh:
                token = tokens[0]
                stepper.step(token)
                self.input_ids[n_past] = token
                self.n_tokens = n_past + 1
            else:
                self._sfi_prefill(ctx.tokens + list(tokens))
        except BaseException:
            self._sfi_stepper = None  # an interrupted step or prefill: the next eval starts anew
            raise
        self._requires_eval = False

    def sample(self, top_k: int = 40, top_p: float = 0.95, min_p: float = 0.05, typical_p: float = 1.0,
               temp: float = 0.80, repeat_penalty: float = 1.0, frequency_penalty: float = 0.0,
               presence_penalty: float = 0.0, tfs_z: float = 1.0, mirostat_mode: int = 0, mirostat_eta: float = 0.1,
               mirostat_tau: float = 5.0, penalize_nl: bool = True, logits_processor=None, grammar=None,
               idx: Optional[int] = None):
        """`llama_cpp.Llama.sample`. Plain greedy sampling of the last token (temperature 0, no penalty, logits
        processor or grammar) is an argmax over llama.cpp's logits in place, the token llama.cpp's greedy sampler
        picks (the first of equal maxima): its sampler chain would first build a candidate array of the whole
        vocabulary, ~0.2 ms a token (8% of a 4B model's step on a GPU)."""
        if (temp == 0.0 and repeat_penalty == 1.0 and frequency_penalty == 0.0 and presence_penalty == 0.0
                and logits_processor is None and grammar is None and self.ctx is not None
                and (idx is None or idx == self.n_tokens - 1)):
            ptr = llama_cpp.llama_get_logits_ith(self.ctx, -1)
            return int(np.argmax(np.ctypeslib.as_array(ptr, shape=(self._n_vocab,))))
        return super().sample(top_k=top_k, top_p=top_p, min_p=min_p, typical_p=typical_p, temp=temp,
                              repeat_penalty=repeat_penalty, frequency_penalty=frequency_penalty,
                              presence_penalty=presence_penalty, tfs_z=tfs_z, mirostat_mode=mirostat_mode,
                              mirostat_eta=mirostat_eta, mirostat_tau=mirostat_tau, penalize_nl=penalize_nl,
                              logits_processor=logits_processor, grammar=grammar, idx=idx)

    def _sfi_prefill(self, prompt: list[int]) -> None:
        if not prompt:
            return
        self._sfi_fresh = False
        self._sfi_stepper = None
        stepper = self._sfi_engine.stepper(self.sfi_config)
        decoded = stepper.prefill(prompt)
        start = len(prompt) - decoded
        self.input_ids[start:len(prompt)] = prompt[start:]
        self.n_tokens = len(prompt)
        self._sfi_stepper = stepper

    def _sfi_resync(self) -> None:
        """llama-cpp-python moved `n_tokens` (reset, a prefix cut in generate, a state load): the cache follows."""
        ctx = self._sfi_ctx
        n = self.n_tokens
        if len(ctx.tokens) > n:
            ctx.truncate(n)
        else:
            ctx.tokens = self.input_ids[:n].tolist()
        self._sfi_stepper = None

    def load_state(self, state) -> None:
        super().load_state(state)
        if self._sfi_ctx is not None:
            self._sfi_ctx.tokens = self.input_ids[:self.n_tokens].tolist()
            self._sfi_stepper = None

    # -- chat -------------------------------------------------------------------------------------
    def create_chat_completion(self, *args, parallel_tool_calls: Optional[bool] = None, **kwargs):
        """`llama_cpp.Llama.create_chat_completion`, the model's tool calls read into `tool_calls` (see above)."""
        a = _CHAT_SIGNATURE.bind(self, *args, **kwargs).arguments
        a.pop("self")
        a["response_format"] = _response_format(a.get("response_format"))
        if self.chat_handler is not None or not str(self.chat_format).startswith("chat_template."):
            if parallel_tool_calls is not None:
                raise ValueError("parallel_tool_calls needs the GGUF's own chat template (chat_format and "
                                 "chat_handler not set); the chosen handler has its own tool handling")
            return super().create_chat_completion(**a)
        request = tool_calls.tool_request(a.pop("tools", None), a.pop("tool_choice", None), a.pop("functions", None),
                                          a.pop("function_call", None), parallel_tool_calls,
                                          template=self.metadata.get("tokenizer.chat_template"))
        a["messages"] = tool_calls.template_messages(list(a["messages"]))
        if request.tools:
            a["tools"] = request.tools
        if request.forced:
            rf = a.get("response_format")
            if a.get("grammar") is not None or (rf is not None and rf.get("type") != "text"):
                raise ValueError(f"tool_choice {request.choice!r} and grammar / response_format both constrain "
                                 "the answer; give one")
            a["grammar"] = llama_cpp.LlamaGrammar.from_string(tool_calls.grammar(request), verbose=False)
        result = super().create_chat_completion(**a)
        if not request.active:
            return result
        if a.get("stream"):
            return _tool_chunks(result, request)
        choice = result["choices"][0]
        choice["message"], choice["finish_reason"] = tool_calls.message(
            choice["message"].get("content") or "", choice["finish_reason"], request)
        return result

    # -- SFI ----------------------------------------------------------------------------------------
    @property
    def last_sfi_stats(self):
        """The `SFIStats` of the current or last generation (None before the first, or without SFI)."""
        return getattr(self._sfi_stepper, "stats", None)

    @property
    def sfi_active(self) -> bool:
        """True when this model decodes through SFI (see `sfi_unavailable` otherwise)."""
        return self._sfi_ctx is not None

    def __getstate__(self):
        state = super().__getstate__()
        state["sfi"] = self.sfi_config if self._sfi_requested else False
        return state

    def __del__(self) -> None:
        if not sys.is_finalizing():  # at exit the modules' globals may be gone already; the process frees it all
            super().__del__()

    def close(self) -> None:
        self._sfi_closed = True
        engine, ctx = getattr(self, "_sfi_engine", None), getattr(self, "_sfi_ctx", None)
        self._sfi_engine = self._sfi_ctx = self._sfi_stepper = None
        if engine is not None:
            engine.close()  # the native SFI state goes before the llama_context it is attached to
        if ctx is not None:
            ctx.close()
        if hasattr(self, "_stack"):
            super().close()


def _open_only(method):
    """`method`, refused with ContextError after close(): llama-cpp-python's objects keep pointers into the freed
    model (its vocabulary, which tokenize reads), so a call would crash the process, not raise."""
    @functools.wraps(method)
    def checked(self, *args, **kwargs):
        if self._sfi_closed:
            raise ContextError("the model was closed (Llama.close()); create a new one")
        return method(self, *args, **kwargs)

    return checked


for _name, _member in vars(llama_cpp.Llama).items():  # every public method of llama_cpp.Llama, and __call__
    if inspect.isfunction(_member) and (_name == "__call__" or not _name.startswith("_")) and _name != "close":
        setattr(Llama, _name, _open_only(getattr(Llama, _name)))

_CHAT_SIGNATURE = inspect.signature(llama_cpp.Llama.create_chat_completion)


def _response_format(rf):
    """The OpenAI json_schema form as llama-cpp-python's json_object with a schema (which it reads)."""
    if isinstance(rf, dict) and rf.get("type") == "json_schema":
        spec = rf.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError(f"response_format json_schema needs json_schema.schema (an object), got {spec!r}")
        return {"type": "json_object", "schema": schema}
    if rf is not None and (not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object")):
        raise ValueError(f"response_format must be of type text, json_object or json_schema, got {rf!r}")
    return rf


def _tool_chunks(chunks, request):
    """llama-cpp-python's chat chunks with the calls in their text as `delta.tool_calls`."""
    calls = tool_calls.CallStream(request)
    for chunk in chunks:
        choice = chunk["choices"][0]
        text = (choice.get("delta") or {}).get("content")
        if choice.get("finish_reason") is not None:
            for delta in calls.deltas(None):
                yield {**chunk, "choices": [{**choice, "delta": delta, "finish_reason": None}]}
            yield {**chunk, "choices": [{**choice, "finish_reason": calls.finish_reason(choice["finish_reason"])}]}
        elif text:
            for delta in calls.deltas(text):
                yield {**chunk, "choices": [{**choice, "delta": delta}]}
        else:
            yield chunk
