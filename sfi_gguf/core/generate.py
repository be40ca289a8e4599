"""The token-by-token decoding loop: prefill, sample, decode one token, stream text, stop.

The loop is independent of how a step attends to the cache: `Stepper` decides that (dense here;
the SFI stepper makes most steps fast). Everything per token stays in a few C calls.
"""
from __future__ import annotations

import codecs
import threading
import time
from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np

from .context import LlamaContext
from .device_picks import DeviceChain
from .sampling import Sampler


@dataclass
class GenerationStats:
    """What one generate() call did; times are wall-clock seconds."""

    n_prompt: int = 0            # prompt tokens
    n_prompt_decoded: int = 0    # of which were not already in the cache
    n_generated: int = 0         # sampled tokens (including a final end-of-generation token)
    n_ctx_end: int = 0           # cache length when generation stopped
    prefill_s: float = 0.0
    decode_s: float = 0.0
    finish_reason: str = ""      # "stop" (EOG or stop string), "length" (max_tokens or n_ctx)
    ended_on_eog: bool = False   # the last generated token is end-of-generation (not part of the text)
    stop_string: str | None = None  # the stop string that ended the generation, if one did
    seed: int = 0
    mode: str = "dense"
    sfi: object = None           # SFIStats when decoding with SFI

    @property
    def decode_tok_s(self) -> float:
        steps = max(self.n_generated - 1, 0)  # the first token comes from the prefill's logits
        return steps / self.decode_s if self.decode_s > 0 else 0.0


@dataclass
class Completion:
    text: str
    tokens: list[int]
    finish_reason: str
    stats: GenerationStats
    logprobs: list | None = None  # per sampled token (token, logprob, top [(token, logprob)]) when asked for


class DenseStepper:
    """Every step attends to the whole cache (plain llama.cpp decoding): a `stepper.Stepper`.

    last_chunk: the prompt's last tokens decoded on their own (`LlamaContext.prefill`), as the SFI stepper
    decodes its bootstrap rows (SFIConfig.n_prefill_queries, 16 by default): a prompt splits the same way
    dense or SFI, fresh or served from the cache, so the same prompt continues the same way.
    """

    mode = "dense"

    def __init__(self, ctx: LlamaContext, last_chunk: int = 16):
        self.ctx = ctx
        self.last_chunk = last_chunk

    def prefill(self, tokens: Sequence[int], progress: bool = False) -> int:
        return self.ctx.prefill(tokens, progress=progress, last_chunk=self.last_chunk)

    def step(self, token: int) -> None:
        self.ctx.decode_one(token)

    def plan(self, token: int) -> str:
        return "dense"

    def finish(self, kind: str, seconds: float) -> None:
        pass

    def annotate(self, stats: GenerationStats) -> None:
        pass


class _StopFilter:
    """Cuts the text at the first stop string; holds back a tail that could still become one."""

    def __init__(self, stop: Sequence[str]):
        self.stop = [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.emitted = 0
        self.matched: str | None = None  # the stop string that cut the text

    def push(self, piece: str) -> tuple[str, bool]:
        self.text += piece
        for s in self.stop:
            idx = self.text.find(s, max(0, self.emitted - len(s)))
            if idx >= 0:
                self.matched = s
                self.text = self.text[:idx]
                out = self.text[self.emitted:]
                self.emitted = len(self.text)
                return out, True
        safe = len(self.text)
        if self.hold:
            for k in range(min(self.hold, len(self.text)), 0, -1):
                tail = self.text[-k:]
                if any(s.startswith(tail) for s in self.stop):
                    safe = len(self.text) - k
                    break
        out = self.text[self.emitted:safe]
        self.emitted = max(self.emitted, safe)
        return out, False

    def flush(self) -> str:
        out = self.text[self.emitted:]
        self.emitted = len(self.text)
        return out


class TextStream:
    """Token bytes -> text pieces: UTF-8 decoded across token boundaries, cut at the first stop string."""

    def __init__(self, stop: Sequence[str]):
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._stops = _StopFilter(stop)

    def push(self, data: bytes) -> tuple[str, bool]:
        """The text that is safe to emit now, and whether a stop string was reached."""
        return self._stops.push(self._utf8.decode(data))

    @property
    def stop_string(self) -> str | None:
        """The stop string that was reached, if one was."""
        return self._stops.matched

    def close(self) -> str:
        """What was held back, for a text that ended without a stop string (length, context full)."""
        tail, _ = self._stops.push(self._utf8.decode(b"", final=True))
        return tail + self._stops.flush()


class Ending:
    """When one generation ends, and why: the decision of the single loop (`run_generation`) and the batched one.

    A sampled token (`accept`) ends it with "stop" at end-of-generation (unless ignore_eos) or a stop string,
    else with "length" at max_tokens; before the next token is decoded (`before_step`) it ends with "stop" when
    `cancel` is set, else with "length" when the context is full. `reason` (also stats.finish_reason) is None
    while it goes on.
    """

    def __init__(self, stop: Sequence[str], max_tokens: int, ignore_eos: bool, stats: GenerationStats,
                 out_tokens: list[int], cancel: threading.Event | None = None, keep_special: frozenset = frozenset(),
                 stopping_criteria=None):
        self.text = TextStream(stop)
        self.stopping_criteria = stopping_criteria
        self.keep_special = keep_special  # control tokens whose text stays (a tool-call format's markers)
        self.max_tokens, self.ignore_eos, self.cancel = max_tokens, ignore_eos, cancel
        self.stats, self.out_tokens = stats, out_tokens
        self.reason: str | None = None
        if max_tokens == 0:
            self._end("length")

    def _end(self, reason: str) -> str:
        self.reason = self.stats.finish_reason = reason
        return reason

    def accept(self, ctx: LlamaContext, token: int) -> str:
        """Record a sampled token; returns its text that is safe to emit now. A stopping criterion that answers
        True (llama-cpp-python's: the tokens so far and the logits the token came from) ends the generation
        with "stop" before the token, as llama-cpp-python does."""
        if self.stopping_criteria is not None and self.stopping_criteria(
                np.array(ctx.tokens, dtype=np.intc), ctx.last_logits().copy()):
            self._end("stop")
            return ""
        self.out_tokens.append(token)
        self.stats.n_generated += 1
        if not self.ignore_eos and ctx.is_eog(token):
            self.stats.ended_on_eog = True
            self._end("stop")
            return ""
        piece, stopped = self.text.push(ctx.token_bytes(token, special=token in self.keep_special))
        if stopped:
            self.stats.stop_string = self.text.stop_string
            self._end("stop")
        elif self.stats.n_generated >= self.max_tokens:
            self._end("length")
        return piece

    def before_step(self, ctx: LlamaContext) -> str | None:
        """Why the generation ends before its last sampled token is decoded, or None when it goes on."""
        if self.cancel is not None and self.cancel.is_set():
            return self._end("stop")
        if len(ctx.tokens) >= ctx.n_ctx:
            return self._end("length")
        return None

    def tail(self) -> str:
        """The text held back, once the generation ended by length (no stop string cut it)."""
        return self.text.close() if self.reason == "length" else ""


def picks_in_graph(sampler: Sampler, stopping_criteria) -> DeviceChain | None:
    """The picks a generation's decodes make in their graph (`LlamaContext.set_device_picks`), or None: the sampler's
    greedy pick or sampling chain (`Sampler.device_chain`) where nothing else reads the logits (a stopping criterion
    is given them)."""
    return sampler.device_chain if stopping_criteria is None else None


def start_generation(stepper, prompt_tokens: Sequence[int], sampler: Sampler, stats: GenerationStats,
                     progress: bool = False) -> None:
    """The stepper's prefill of the prompt, recorded in `stats` with the sampler's seed."""
    stats.n_prompt = len(prompt_tokens)
    stats.seed = sampler.seed
    stats.mode = stepper.mode
    t0 = time.perf_counter()
    stats.n_prompt_decoded = stepper.prefill(prompt_tokens, progress=progress)
    stats.prefill_s = time.perf_counter() - t0


def run_generation(ctx: LlamaContext, prompt_tokens: Sequence[int], sampler: Sampler, stepper,
                   max_tokens: int, stop: Sequence[str], stats: GenerationStats,
                   out_tokens: list[int], progress: bool = False, ignore_eos: bool = False,
                   cancel: threading.Event | None = None, keep_special: frozenset = frozenset(),
                   stopping_criteria=None) -> Iterator[str]:
    """Yields text pieces; fills `stats` and `out_tokens` as it goes (valid once exhausted).

    `cancel` set (by another thread) ends the generation before its next token, as a stop string would.
    """
    ctx.set_device_picks(picks_in_graph(sampler, stopping_criteria))
    try:
        start_generation(stepper, prompt_tokens, sampler, stats, progress)
    except BaseException:
        ctx.set_device_picks(None)
        raise
    ending = Ending(stop, max_tokens, ignore_eos, stats, out_tokens, cancel, keep_special, stopping_criteria)
    t_decode = time.perf_counter()
    try:
        while ending.reason is None:
            token = sampler.sample(ctx)
            piece = ending.accept(ctx, token)
            if piece:
                yield piece
            if ending.reason is not None or ending.before_step(ctx) is not None:
                break
            stepper.step(token)
        tail = ending.tail()
        if tail:
            yield tail
    finally:
        ctx.set_device_picks(None)
        stats.decode_s = time.perf_counter() - t_decode
        stats.finish_reason = ending.reason or "length"  # (abandoned or failed midway: as the length ran out)
        stats.n_ctx_end = len(ctx.tokens)
        stepper.annotate(stats)
