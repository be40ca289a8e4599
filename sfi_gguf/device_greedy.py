"""Greedy picks made in the decode's graph: the token and its probability read back instead of the logits.

A greedy step on the host copies the vocabulary's logits from the device, takes their argmax and, where SFI's
trigger reads the model's confidence, a softmax over them: ~0.15 ms a token, a few percent of a GPU step. With
llama.cpp's backend sampling, a sampler chain attached to the sequence adds the argmax and the pick's probability
to the graph (`llama_sfi_sampler_init_greedy`, native/src/llama-sfi-sampler.cpp) and the decode copies two numbers.
The same token as the host's argmax, up to exact ties.
"""
from __future__ import annotations

import ctypes

from ._native import lib, llama_cpp

_init_greedy = lib.llama_sfi_sampler_init_greedy
_init_greedy.argtypes = []
_init_greedy.restype = llama_cpp.llama_sampler_p_ctypes
_on_backend = lib.llama_sfi_sampler_greedy_on_backend
_on_backend.argtypes = [llama_cpp.llama_sampler_p_ctypes]
_on_backend.restype = ctypes.c_bool


class DeviceGreedy:
    """A greedy sampler chain attached to one sequence of a context (`attach`), until `detach`.

    A chain is attached once in its life (llama.cpp initialises it for the graph then), so each `attach` makes a
    new one.
    """

    def __init__(self, ctx, seq: int):
        self.ctx = ctx
        self.seq = seq
        self._chain = None

    def attach(self) -> bool:
        """Attach a new chain; False (nothing attached) where the output's device cannot run its ops."""
        if self._chain is not None:
            return True
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        greedy = _init_greedy()
        llama_cpp.llama_sampler_chain_add(chain, greedy)  # the chain owns it
        if llama_cpp.llama_set_sampler(self.ctx, self.seq, chain) and _on_backend(greedy):
            self._chain = chain
            return True
        llama_cpp.llama_set_sampler(self.ctx, self.seq, None)
        llama_cpp.llama_sampler_free(chain)
        return False

    def detach(self) -> None:
        if self._chain is not None:
            llama_cpp.llama_set_sampler(self.ctx, self.seq, None)
            llama_cpp.llama_sampler_free(self._chain)
            self._chain = None

    def token(self, index: int) -> int:
        """The pick of output row `index` of the last decode."""
        return llama_cpp.llama_get_sampled_token_ith(self.ctx, index)

    def probability(self, index: int) -> float:
        """The pick's probability under the softmax of the logits of row `index`."""
        return llama_cpp.llama_get_sampled_probs_ith(self.ctx, index)[0]
