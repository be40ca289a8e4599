"""llama.cpp's own sampler chain, configured like llama-cpp-python's `Llama` does it.

Sampling happens in C on the context's logits: no per-token copy of the vocabulary into Python.
"""
from __future__ import annotations

import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from ._native import llama_cpp

if TYPE_CHECKING:
    from .context import LlamaContext


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

    @property
    def has_penalties(self) -> bool:
        return self.repeat_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate(self) -> None:
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.repeat_penalty <= 0:
            raise ValueError(f"repeat_penalty must be > 0, got {self.repeat_penalty}")
        if self.seed is not None and not 0 <= self.seed < 2**32:
            raise ValueError(f"seed must be in [0, 2**32), got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= getattr(self, name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")


class Sampler:
    """Owns one llama_sampler chain; `sample` picks the next token from the last decode's logits.

    `logprobs` n (not None): every sampled token is recorded in `self.logprobs` as
    (token, its log-probability, [(token, log-probability)] of the n most likely tokens), from the raw
    logits (before penalties and temperature), as llama-cpp-python reports them.
    """

    def __init__(self, params: SamplingParams, logprobs: int | None = None):
        params.validate()
        if logprobs is not None and logprobs < 0:
            raise ValueError(f"logprobs must be >= 0, got {logprobs}")
        self.n_logprobs = logprobs
        self.logprobs: list[tuple[int, float, list[tuple[int, float]]]] = []
        # plain greedy reads the logits in place (an argmax over a zero-copy view): llama_sampler_sample
        # would first build a candidate array of the whole vocabulary, ~0.2 ms per token
        self._plain_greedy = params.temperature <= 0.0 and not params.has_penalties
        self.params = params
        self.seed = params.seed if params.seed is not None else random.randrange(2**32 - 1)
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        add = lambda s: llama_cpp.llama_sampler_chain_add(chain, s)  # noqa: E731
        if params.has_penalties:
            add(llama_cpp.llama_sampler_init_penalties(params.penalty_last_n, params.repeat_penalty,
                                                       params.frequency_penalty, params.presence_penalty))
        if params.temperature <= 0.0:
            add(llama_cpp.llama_sampler_init_greedy())
        else:
            if params.top_k > 0:
                add(llama_cpp.llama_sampler_init_top_k(params.top_k))
            add(llama_cpp.llama_sampler_init_top_p(params.top_p, 1))
            if params.min_p > 0.0:
                add(llama_cpp.llama_sampler_init_min_p(params.min_p, 1))
            add(llama_cpp.llama_sampler_init_temp(params.temperature))
            add(llama_cpp.llama_sampler_init_dist(self.seed))
        self._chain = chain

    def sample(self, ctx: "LlamaContext") -> int:
        """Sample from the logits of the last token of the last decode (and accept it)."""
        if self._plain_greedy:
            token = int(np.argmax(ctx.last_logits()))
            llama_cpp.llama_sampler_accept(self._chain, token)
        else:
            token = llama_cpp.llama_sampler_sample(self._chain, ctx.ctx, ctx.logits_index)
        if self.n_logprobs is not None:
            self.logprobs.append(_top_logprobs(ctx.last_logits(), token, self.n_logprobs))
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
