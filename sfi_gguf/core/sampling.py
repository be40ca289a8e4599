"""llama.cpp's own sampler chain, configured like llama-cpp-python's `Llama` does it.

Sampling happens in C on the context's logits: no per-token copy of the vocabulary into Python.
"""
from __future__ import annotations

import math
import numbers
import random
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

import numpy as np

from .library import llama_cpp
from .device_picks import DeviceChain

if TYPE_CHECKING:
    from .context import LlamaContext


def add_filters(add, params) -> None:
    """`add` (a chain's llama_sampler_chain_add) llama-cpp-python's samplers that come before dist, in its order:
    top-k, typical, top-p, min-p, temperature (params: SamplingParams; those they turn off left out). The graph's
    picks (`llama_sfi_sampler_init_dist`, native/src/llama-sfi-sampler.cpp) take the same samplers in this order."""
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(int(params.top_k)))
    if params.typical_p < 1.0:
        add(llama_cpp.llama_sampler_init_typical(float(params.typical_p), 1))
    add(llama_cpp.llama_sampler_init_top_p(float(params.top_p), 1))
    if params.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(float(params.min_p), 1))
    add(llama_cpp.llama_sampler_init_temp(float(params.temperature)))


@dataclass(frozen=True)
class SamplingParams:
    """temperature <= 0 means greedy. seed None draws a random seed (reported in the stats)."""

    temperature: float = 0.8
    top_p: float = 0.95
    top_k: int = 40
    min_p: float = 0.05
    repeat_penalty: float = 1.0
    penalty_last_n: int = 64
    seed: int | None = None
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    typical_p: float = 1.0
    mirostat_mode: int = 0        # 1: Mirostat, 2: Mirostat 2.0 (in place of top-k/top-p/min-p)
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    logit_bias: tuple = ()        # ((token, bias), ...): added to the logits before everything else

    @classmethod
    def of(cls, arguments: dict, sampling: SamplingParams | None = None) -> SamplingParams:
        """The sampling of a call that takes llama-cpp-python's sampling keywords: those of its `arguments` (its
        locals()) that name a field (logit_bias as {token id: bias}), or `sampling`, one SamplingParams given in their
        place (the keywords left at their defaults). Validated: ValueError names the first bad parameter."""
        keywords = {f.name: arguments[f.name] for f in fields(cls) if f.name in arguments}
        keywords["logit_bias"] = logit_bias_items(keywords.get("logit_bias"))
        params = cls(**keywords)
        if sampling is not None:
            if not isinstance(sampling, SamplingParams):
                raise ValueError(f"sampling must be a SamplingParams, got {sampling!r}")
            if params != cls():
                changed = [f.name for f in fields(cls) if getattr(params, f.name) != getattr(cls(), f.name)]
                raise ValueError(f"give sampling or the sampling keywords, not both (got sampling and {changed})")
            params = sampling
        params.validate()
        return params

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        """Raise ValueError naming the first parameter of a wrong type or out of range, before any of
        them reaches ctypes (a bare ArgumentError) or the sampler chain (NaN or inf would sample garbage)."""
        finite = lambda v: is_real(v) and math.isfinite(v)  # noqa: E731
        checks = (
            ("temperature", finite(self.temperature), "a finite number (<= 0: greedy)"),
            ("top_p", finite(self.top_p) and 0 < self.top_p <= 1, "a number in (0, 1]"),
            ("min_p", finite(self.min_p) and 0 <= self.min_p <= 1, "a number in [0, 1]"),
            ("top_k", is_int(self.top_k) and self.top_k >= 0, "an integer >= 0"),
            ("repeat_penalty", finite(self.repeat_penalty) and self.repeat_penalty > 0, "a finite number > 0"),
            ("frequency_penalty", finite(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "a number in [-2, 2]"),
            ("presence_penalty", finite(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "a number in [-2, 2]"),
            ("penalty_last_n", is_int(self.penalty_last_n) and self.penalty_last_n >= 0, "an integer >= 0"),
            ("seed", self.seed is None or (is_int(self.seed) and 0 <= self.seed < 2**32),
             "None or an integer in [0, 2**32)"),
            ("typical_p", finite(self.typical_p) and 0 < self.typical_p <= 1, "a number in (0, 1]"),
            ("mirostat_mode", is_int(self.mirostat_mode) and self.mirostat_mode in (0, 1, 2), "0, 1 or 2"),
            ("mirostat_tau", finite(self.mirostat_tau) and self.mirostat_tau > 0, "a finite number > 0"),
            ("mirostat_eta", finite(self.mirostat_eta) and self.mirostat_eta > 0, "a finite number > 0"),
            ("logit_bias", isinstance(self.logit_bias, tuple) and all(
                isinstance(e, tuple) and len(e) == 2 and is_int(e[0]) and e[0] >= 0
                and is_real(e[1]) and not math.isnan(e[1]) for e in self.logit_bias),
             "a map of token ids to numbers"),
        )
        for name, ok, what in checks:
            if not ok:
                raise ValueError(f"{name} must be {what}, got {getattr(self, name)!r}")


def logit_bias_items(logit_bias) -> tuple:
    """A `logit_bias` argument ({token id (an int, or its digits as JSON keys are): bias}) as SamplingParams
    takes it; ValueError naming it otherwise."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise ValueError(f"logit_bias must be a map of token ids to numbers, got {logit_bias!r}")
    items = []
    for token, bias in logit_bias.items():
        if isinstance(token, str) and token.strip().lstrip("-").isdigit():
            token = int(token)
        if not is_int(token) or not is_real(bias) or math.isnan(bias):
            raise ValueError(f"logit_bias must be a map of token ids to numbers, got {token!r}: {bias!r}")
        items.append((int(token), float(bias)))
    return tuple(items)


def is_int(value) -> bool:
    """An integer (numpy's too), not a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A real number (an int, a float, numpy's), not a bool."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


class Sampler:
    """Owns one llama_sampler chain; `sample` picks the next token from the last decode's logits.

    `logprobs` n (not None): every sampled token is recorded in `self.logprobs` as
    (token, its log-probability, [(token, log-probability)] of the n most likely tokens), from the raw
    logits (before penalties and temperature), as llama-cpp-python reports them.
    `grammar` (GBNF text, root rule "root"; needs `vocab`): llama.cpp's grammar sampler in the chain, after
    the penalties, as llama-cpp-python places it: only tokens the grammar allows are sampled, and once it
    is complete only end-of-generation.
    `logits_processor` (llama-cpp-python's: a callable, or a `LogitsProcessorList`, of the tokens so far as an
    np.intc array and the logits as np.single, returning new logits) rewrites the logits before the chain
    samples (the log-probabilities reported stay the model's own).
    """

    def __init__(self, params: SamplingParams, n_vocab: int, logprobs: int | None = None,
                 grammar: str | None = None, vocab=None, logits_processor=None):
        params.validate()
        if logits_processor is not None and not callable(logits_processor):
            raise ValueError("logits_processor must be a callable (input_ids, scores) -> scores, such as a "
                             f"llama_cpp.LogitsProcessorList, got {logits_processor!r}")
        self.logits_processor = logits_processor
        if logprobs is not None and (not is_int(logprobs) or logprobs < 0):
            raise ValueError(f"logprobs must be None or an integer >= 0, got {logprobs!r}")
        self.n_logprobs = logprobs
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        # plain greedy reads the logits in place (an argmax over a zero-copy view): llama_sampler_sample
        # would first build a candidate array of the whole vocabulary, ~0.2 ms per token
        self._plain_greedy = (params.temperature <= 0.0 and not params.has_penalties and grammar is None
                              and not params.logit_bias)
        self.params = params
        self.seed = int(params.seed) if params.seed is not None else random.randrange(2**32 - 1)
        self._chain = None
        grammar_sampler = None
        if grammar is not None:
            if not isinstance(grammar, str) or not grammar.strip() or vocab is None:
                raise ValueError(f"grammar must be GBNF text (a non-empty string), got {grammar!r}")
            grammar_sampler = llama_cpp.llama_sampler_init_grammar(vocab, grammar.encode("utf-8"), b"root")
            if not grammar_sampler:
                raise ValueError("grammar: llama.cpp could not parse it (GBNF with a 'root' rule expected)")
        bad = [t for t, _ in params.logit_bias if t >= n_vocab]
        if bad:
            if grammar_sampler is not None:
                llama_cpp.llama_sampler_free(grammar_sampler)
            raise ValueError(f"logit_bias: token ids out of range [0, {n_vocab}): {bad[:5]}")
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.logit_bias:  # first, as llama-cpp-python applies it (a logits processor ahead of the chain)
            biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
                *[llama_cpp.llama_logit_bias(t, max(-1e30, min(1e30, b))) for t, b in params.logit_bias])
            add(llama_cpp.llama_sampler_init_logit_bias(n_vocab, len(params.logit_bias), biases))
        if params.has_penalties:
            add(llama_cpp.llama_sampler_init_penalties(n_vocab, int(params.penalty_last_n),
                                                       float(params.repeat_penalty),
                                                       float(params.frequency_penalty),
                                                       float(params.presence_penalty)))
        if grammar_sampler is not None:
            add(grammar_sampler)
        if params.temperature <= 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
        elif params.mirostat_mode == 1:  # as llama-cpp-python: Mirostat in place of top-k ... dist (m = 100)
            add(llama_cpp.llama_sampler_init_mirostat(n_vocab, self.seed, float(params.mirostat_tau),
                                                      float(params.mirostat_eta), 100))
        elif params.mirostat_mode == 2:
            add(llama_cpp.llama_sampler_init_mirostat_v2(self.seed, float(params.mirostat_tau),
                                                         float(params.mirostat_eta)))
        else:
            add_filters(add, params)
            add(llama_cpp.llama_sampler_init_dist(self.seed))
        self._chain = chain
        # what the decode's graph can pick in place of this chain (`device_chain`): the greedy pick, or top-k ... dist
        # (llama.cpp's backend samplers), when nothing else reads or changes the logits
        self.device_chain = None
        if logits_processor is None and logprobs is None:
            if self._plain_greedy:
                self.device_chain = DeviceChain(seed=self.seed)
            elif (params.temperature > 0.0 and params.mirostat_mode == 0 and params.typical_p >= 1.0
                  and not params.has_penalties and grammar is None and not params.logit_bias):
                self.device_chain = DeviceChain(temperature=float(params.temperature), top_k=int(params.top_k),
                                                top_p=float(params.top_p), min_p=float(params.min_p), seed=self.seed)

    def sample(self, ctx: "LlamaContext") -> int:
        """Sample from the logits of the last token of the last decode (and accept it)."""
        raw = None
        if self.logits_processor is not None:
            logits = ctx.last_logits()  # (a view of llama.cpp's buffer: the chain samples what is written here)
            raw = logits.copy() if self.n_logprobs is not None else None
            logits[:] = self.logits_processor(np.array(ctx.tokens, dtype=np.intc), logits.copy())
        picked = ctx.picked_token()  # the decode's graph ran `device_chain` (LlamaContext.set_device_picks)
        if picked is not None:
            token = picked
            llama_cpp.llama_sampler_accept(self._chain, token)
        elif self._plain_greedy:  # (of the logits the processor rewrote, if any: then they are on the host)
            token = ctx.greedy_token()
            llama_cpp.llama_sampler_accept(self._chain, token)
        else:
            token = llama_cpp.llama_sampler_sample(self._chain, ctx.ctx, ctx.logits_index)
        if self.n_logprobs is not None:
            self.logprobs.append(_top_logprobs(raw if raw is not None else ctx.last_logits(), token, self.n_logprobs))
        return token

    def close(self) -> None:
        if self._chain:
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


def _top_logprobs(logits: np.ndarray, token: int, n: int) -> tuple[int, float, list[tuple[int, float]]]:
    """log_softmax of the logits: the token's value and the n largest (only when logprobs are asked for)."""
    x = logits.astype(np.float64)
    lse = float(x.max() + np.log(np.exp(x - x.max()).sum()))
    n = min(n, len(x))
    top = np.argpartition(-x, n - 1)[:n] if n else np.empty(0, dtype=np.int64)
    top = top[np.argsort(-x[top], kind="stable")]
    return token, float(x[token]) - lse, [(int(t), float(x[t]) - lse) for t in top]
