"""How closely SFI follows dense decoding: teacher-forced top-1 agreement and KL per step.

Free-running greedy outputs stop being comparable after their first difference, so we force both
decoders through the same continuation (the dense greedy one, or a given text: a greedy
continuation can fall into a repetition loop that any recent window reproduces) and compare, at
every step, the next-token distribution: does SFI's argmax equal dense's, and KL(dense || SFI).
The KL uses dense's top-`top_n` tokens plus the remaining mass as one bucket, so nothing of
vocabulary size is stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.config import SFIConfig
from ..core.stepper import Stepper


@dataclass
class Agreement:
    n_steps: int
    top1: np.ndarray          # bool [n_steps]: SFI argmax == dense argmax
    kl: np.ndarray            # float [n_steps]: KL(dense || SFI), nats
    tokens: list[int]         # the forced continuation (dense greedy or given)
    sfi_stats: object = None
    argmax: np.ndarray | None = None  # int64 [n_steps]: SFI's own argmax at every step

    @property
    def top1_rate(self) -> float:
        return float(self.top1.mean()) if self.n_steps else float("nan")

    @property
    def mean_kl(self) -> float:
        return float(self.kl.mean()) if self.n_steps else float("nan")

    def per_window(self, window: int = 100) -> list[dict]:
        """top-1 agreement and mean KL per `window` generated tokens."""
        return [{"start": s, "top1": float(self.top1[s:s + window].mean()),
                 "kl": float(self.kl[s:s + window].mean())} for s in range(0, self.n_steps, window)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _forced_run(stepper: Stepper, ctx, prompt: list[int], forced: list[int] | None, n_steps: int, visit) -> list[int]:
    """Prefill, then n_steps steps; `visit(i, logits)` sees the distribution before token i."""
    stepper.prefill(prompt)
    tokens = []
    for i in range(n_steps):
        logits = ctx.last_logits()
        visit(i, logits)
        token = forced[i] if forced is not None else int(np.argmax(logits))
        tokens.append(token)
        if i + 1 < n_steps:
            stepper.step(token)
    return tokens


@dataclass
class DenseReference:
    """The forced continuation of a prompt (dense greedy, or a given text) and dense's distribution
    at every step (top_n + rest)."""

    tokens: list[int]
    top: np.ndarray           # int64 [n_steps, top_n]: dense's top_n token ids
    logp: np.ndarray          # float64 [n_steps, top_n]: their log-probabilities
    argmax: np.ndarray        # int64 [n_steps]

    @property
    def n_steps(self) -> int:
        return len(self.tokens)


def kl_top_n(logp_top: np.ndarray, logq_top: np.ndarray) -> float:
    """KL(p || q) over p's top_n tokens (log-probabilities of both at those tokens) plus the rest of
    the vocabulary as one bucket, nats."""
    p = np.exp(logp_top)
    rest_p = max(1.0 - p.sum(), 1e-12)
    rest_q = max(1.0 - np.exp(logq_top).sum(), 1e-12)
    return float((p * (logp_top - logq_top)).sum() + rest_p * np.log(rest_p / rest_q))


def kl_to_reference(ref: DenseReference, i: int, logits: np.ndarray) -> float:
    """KL(dense || q) at step i over dense's top_n tokens plus the rest as one bucket, nats."""
    return kl_top_n(ref.logp[i], log_softmax(logits)[ref.top[i]])


def dense_reference(llm, prompt_tokens: list[int], n_steps: int, top_n: int = 64,
                    forced: list[int] | None = None) -> DenseReference:
    """Dense decoding of `n_steps` tokens after `prompt_tokens`, keeping dense's distributions:
    greedy, or forced through `forced` (e.g. the text that really follows the prompt)."""
    ctx = llm.context
    if forced is not None:
        if len(forced) < n_steps:
            raise ValueError(f"forced continuation has {len(forced)} tokens, fewer than {n_steps} steps")
        forced = list(forced[:n_steps])
    if len(prompt_tokens) + n_steps > ctx.n_ctx:
        raise ValueError(f"prompt ({len(prompt_tokens)}) + {n_steps} steps exceed n_ctx={ctx.n_ctx}")
    top = np.zeros((n_steps, top_n), dtype=np.int64)
    logp = np.zeros((n_steps, top_n))
    argmax = np.zeros(n_steps, dtype=np.int64)

    def keep(i, logits):
        lp = log_softmax(logits)
        best = np.argpartition(lp, -top_n)[-top_n:]
        top[i], logp[i], argmax[i] = best, lp[best], int(np.argmax(logits))

    tokens = _forced_run(llm.stepper(SFIConfig(policy="dense")), ctx, prompt_tokens, forced, n_steps, keep)
    return DenseReference(tokens=tokens, top=top, logp=logp, argmax=argmax)


def agreement_with(llm, prompt_tokens: list[int], ref: DenseReference, config: SFIConfig | None = None) -> Agreement:
    """SFI (`config`, default llm.sfi_config) forced through the continuation of `ref`."""
    n_steps = ref.n_steps
    top1 = np.zeros(n_steps, dtype=bool)
    kl = np.zeros(n_steps)
    argmax = np.zeros(n_steps, dtype=np.int64)

    def compare(i, logits):
        argmax[i] = int(np.argmax(logits))
        top1[i] = argmax[i] == ref.argmax[i]
        kl[i] = kl_to_reference(ref, i, logits)

    stepper = llm.stepper(config)
    _forced_run(stepper, llm.context, prompt_tokens, ref.tokens, n_steps, compare)
    return Agreement(n_steps=n_steps, top1=top1, kl=kl, tokens=ref.tokens, sfi_stats=getattr(stepper, "stats", None),
                     argmax=argmax)


def compare_with_dense(llm, prompt, n_steps: int = 256, top_n: int = 64) -> Agreement:
    """Dense greedy continuation of `prompt`, then SFI (llm.sfi_config) forced through it."""
    prompt_tokens = llm.prompt_tokens(prompt)
    return agreement_with(llm, prompt_tokens, dense_reference(llm, prompt_tokens, n_steps, top_n))
