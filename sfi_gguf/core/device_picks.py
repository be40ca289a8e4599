"""Picks made in the decode's graph: the token (and the model's top-1 probability) read back instead of the logits.

A step that picks on the host copies the vocabulary's logits from the device and runs the sampler chain there (and,
where SFI's trigger reads the model's confidence, a softmax over them): ~0.15 ms a token for a greedy argmax, more
for sampling, a few percent of a GPU step. With llama.cpp's backend sampling, a sampler chain attached to the
sequence adds the pick to the graph and the decode copies two numbers:

- greedy: the argmax and its probability (`llama_sfi_sampler_init_greedy`, native/src/llama-sfi-sampler.cpp), the
  same token as the host's argmax up to exact ties;
- sampling: llama.cpp's top-k, top-p, min-p and temperature samplers (`add_filters`), then dist's pick with
  the request's seed and the top-1 probability of the raw logits (`llama_sfi_sampler_init_dist`: its random number
  in a buffer every graph reads, as SFI keeps several graphs). The same seed gives the same tokens from run to run,
  and the host chain's tokens for that seed up to rounding (docs/python-api.md, "Sampling": the two sum the
  probabilities in another order).
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
_init_dist.argtypes = [llama_cpp.llama_sampler_p_ctypes, ctypes.c_uint32]
_init_dist.restype = llama_cpp.llama_sampler_p_ctypes
_dist_on_backend = lib.llama_sfi_sampler_dist_on_backend
_dist_on_backend.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_dist_on_backend.restype = ctypes.c_bool


@dataclass(frozen=True)
class DeviceChain:
    """The picks a decode's graph makes in place of the host chain (`Sampler.device_chain`): temperature 0 is the
    greedy pick, else llama.cpp's top-k, top-p, min-p and temperature samplers as `add_filters` orders them, then
    dist's pick with the seed."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


def add_filters(add, params) -> None:
    """`add` (a chain's llama_sampler_chain_add) llama-cpp-python's samplers that come before dist, in its order:
    top-k, typical, top-p, min-p, temperature (params: SamplingParams or DeviceChain; those they turn off left out).
    The host chain (`sampling.Sampler`) and the graph's both."""
    if params.top_k > 0:
        add(llama_cpp.llama_sampler_init_top_k(int(params.top_k)))
    if getattr(params, "typical_p", 1.0) < 1.0:
        add(llama_cpp.llama_sampler_init_typical(float(params.typical_p), 1))
    add(llama_cpp.llama_sampler_init_top_p(float(params.top_p), 1))
    if params.min_p > 0.0:
        add(llama_cpp.llama_sampler_init_min_p(float(params.min_p), 1))
    add(llama_cpp.llama_sampler_init_temp(float(params.temperature)))


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
            filters = _new_chain()
            add_filters(lambda s: llama_cpp.llama_sampler_chain_add(filters, s), picks)
            pick = _init_dist(filters, picks.seed)  # (owns the filters)
            on_backend = _dist_on_backend
        llama_cpp.llama_sampler_chain_add(chain, pick)  # the chain owns it
        if llama_cpp.llama_set_sampler(self.ctx, self.seq, chain) and on_backend(pick):
            self._chain = chain
            self.picks = picks
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

    def token(self, index: int) -> int:
        """The pick of output row `index` of the last decode."""
        return llama_cpp.llama_get_sampled_token_ith(self.ctx, index)

    def probability(self, index: int) -> float:
        """The probability of the most likely token under the softmax of the logits of row `index` (for a greedy
        chain, the pick's)."""
        return llama_cpp.llama_get_sampled_probs_ith(self.ctx, index)[0]
