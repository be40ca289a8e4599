"""How closely SFI follows dense decoding: teacher-forced top-1 agreement and KL per step.

Free-running greedy outputs stop being comparable after their first difference, so we force both
decoders through the same continuation (the dense greedy one) and compare, at every step, the
next-token distribution: does SFI's argmax equal dense's, and KL(dense || SFI). The KL uses dense's
top-`top_n` tokens plus the remaining mass as one bucket, so nothing of vocabulary size is stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .config import SFIConfig


@dataclass
class Agreement:
    n_steps: int
    top1: np.ndarray          # bool [n_steps]: SFI argmax == dense argmax
    kl: np.ndarray            # float [n_steps]: KL(dense || SFI), nats
    tokens: list[int]         # the forced continuation (dense greedy)
    sfi_stats: object = None

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


def _log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max()
    return x - (m + np.log(np.exp(x - m).sum()))


def _forced_run(stepper, ctx, prompt: list[int], forced: list[int] | None, n_steps: int, visit) -> list[int]:
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


def compare_with_dense(llm, prompt, n_steps: int = 256, top_n: int = 64) -> Agreement:
    """Dense greedy continuation of `prompt`, then SFI (llm.sfi_config) forced through it."""
    ctx = llm.context
    prompt_tokens = llm.prompt_tokens(prompt)
    if len(prompt_tokens) + n_steps > ctx.n_ctx:
        raise ValueError(f"prompt ({len(prompt_tokens)}) + {n_steps} steps exceed n_ctx={ctx.n_ctx}")
    ref_top = np.zeros((n_steps, top_n), dtype=np.int64)
    ref_logp = np.zeros((n_steps, top_n))
    ref_arg = np.zeros(n_steps, dtype=np.int64)
    dense = SFIConfig(policy="dense")

    def keep_dense(i, logits):
        logp = _log_softmax(logits)
        top = np.argpartition(logp, -top_n)[-top_n:]
        ref_top[i], ref_logp[i], ref_arg[i] = top, logp[top], int(np.argmax(logits))

    forced = _forced_run(llm._stepper(dense), ctx, prompt_tokens, None, n_steps, keep_dense)

    top1 = np.zeros(n_steps, dtype=bool)
    kl = np.zeros(n_steps)

    def compare(i, logits):
        logq = _log_softmax(logits)
        top1[i] = int(np.argmax(logits)) == ref_arg[i]
        p = np.exp(ref_logp[i])
        rest_p = max(1.0 - p.sum(), 1e-12)
        rest_q = max(1.0 - np.exp(logq[ref_top[i]]).sum(), 1e-12)
        kl[i] = float((p * (ref_logp[i] - logq[ref_top[i]])).sum() + rest_p * np.log(rest_p / rest_q))

    stepper = llm._stepper()
    _forced_run(stepper, ctx, prompt_tokens, forced, n_steps, compare)
    stats = getattr(stepper, "stats", None)
    return Agreement(n_steps=n_steps, top1=top1, kl=kl, tokens=forced, sfi_stats=stats)
