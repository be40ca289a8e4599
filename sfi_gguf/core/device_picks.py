"""Picks made in the decode's graph: the token (and the model's top-1 probability) read back instead of the logits.

A step that picks on the host copies the vocabulary's logits from the device and runs the sampler chain there (and,
where SFI's trigger reads the model's confidence, a softmax over them): ~0.15 ms a token for a greedy argmax, more
for sampling, a few percent of a GPU step. With llama.cpp's backend sampling, a sampler chain attached to the
sequence adds the pick to the graph and the decode copies two numbers:

- greedy: the argmax and its probability (`llama_sfi_sampler_init_greedy`, native/src/llama-sfi-sampler.cpp), the
  same token as the host's argmax up to exact ties;
- sampling: the pick of llama.cpp's top-k, top-p, min-p, temperature and dist samplers with the request's seed, and
  the top-1 probability of the raw logits (`llama_sfi_sampler_init_dist`: its random number in a buffer every graph
  reads, as SFI keeps several graphs). With top-k on, two SFI ops (the top-k candidates, then the whole chain's
  arithmetic over them in one kernel: `ggml_sfi_sample`); without, llama.cpp's backend samplers (~35 small ops, a
  sort of the vocabulary among them). The same seed gives the same tokens from run to run, and the host chain's
  tokens for that seed up to rounding (docs/python-api.md, "Sampling").
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

from .library import lib, llama_cpp

_init_greedy = lib.llama_sfi_sampler_init_greedy
_init_greedy.argtypes = []
_init_greedy.restype = llama_cpp.llama_sampler_p_ctypes
_greedy_on_backend = lib.llama_sfi_sampler_greedy_on_backend
_greedy_on_backend.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_greedy_on_backend.restype = ctypes.c_bool
_init_dist = lib.llama_sfi_sampler_init_dist
_init_dist.argtypes = [ctypes.c_int32, ctypes.c_float, ctypes.c_float, ctypes.c_float, ctypes.c_uint32]
_init_dist.restype = llama_cpp.llama_sampler_p_ctypes
_dist_on_backend = lib.llama_sfi_sampler_dist_on_backend
_dist_on_backend.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_dist_on_backend.restype = ctypes.c_bool
_dist_fused = lib.llama_sfi_sampler_dist_fused
_dist_fused.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_dist_fused.restype = ctypes.c_bool
_greedy_fused = lib.llama_sfi_sampler_greedy_fused
_greedy_fused.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_greedy_fused.restype = ctypes.c_bool


@dataclass(frozen=True)
class DeviceChain:
    """The picks a decode's graph makes in place of the host chain (`Sampler.device_chain`): temperature 0 is the
    greedy pick, else that of llama.cpp's top-k, top-p, min-p, temperature and dist samplers with the seed, in the
    host chain's order (`sampling.add_filters`)."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


GREEDY = DeviceChain()


def _new_chain():
    return llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())


class DevicePicks:
    """A sampler chain attached to one sequence of a context (`attach`), until `detach`.

    A chain is attached once in its life (llama.cpp initialises it for the graph then), and attaching or detaching
    one makes llama.cpp reserve its graphs again: `attach` keeps the chain attached for the same picks (a sampling
    chain restarts its random draws from its seed), and makes a new one for others.
    """

    def __init__(self, ctx, seq: int):
        self.ctx = ctx
        self.seq = seq
        self._chain = None
        self.picks: DeviceChain | None = None  # what the attached chain picks
        self.fused = False  # ... as the SFI ops (a device with them; sampling: top-k on), not llama.cpp's ops

    def attach(self, picks: DeviceChain = GREEDY) -> bool:
        """Attach a chain making `picks`; False (nothing attached) where the output's device cannot run its ops."""
        if self._chain is not None and self.picks == picks:
            llama_cpp.llama_sampler_reset(self._chain)  # (dist: its draws from the seed again)
            return True
        self.detach()
        chain = _new_chain()
        if picks.greedy:
            pick = _init_greedy()
            on_backend = _greedy_on_backend
        else:
            pick = _init_dist(picks.top_k, picks.top_p, picks.min_p, picks.temperature, picks.seed)
            on_backend = _dist_on_backend
        llama_cpp.llama_sampler_chain_add(chain, pick)  # the chain owns it
        if llama_cpp.llama_set_sampler(self.ctx, self.seq, chain) and on_backend(pick):
            self._chain = chain
            self.picks = picks
            self.fused = _greedy_fused(pick) if picks.greedy else _dist_fused(pick)
            return True
        llama_cpp.llama_set_sampler(self.ctx, self.seq, None)
        llama_cpp.llama_sampler_free(chain)
        return False

    def detach(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_set_sampler(self.ctx, self.seq, None)
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None
            self.picks = None
            self.fused = False

    def token(self, index: int) -> int:
        """The pick of output row `index` of the last decode."""
        return llama_cpp.llama_get_sampled_token_ith(self.ctx, index)

    def probability(self, index: int) -> float:
        """The probability of the most likely token under the softmax of the logits of row `index` (for a greedy
        chain, the pick's)."""
        return llama_cpp.llama_get_sampled_probs_ith(self.ctx, index)[0]
