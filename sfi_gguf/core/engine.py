"""The SFI engine of one model and context: the native compact view, the piece table of the vocabulary,
and the steppers that decode with them.

`SFILlama` (sfi_gguf's own API) and `sfi_gguf.Llama` (llama-cpp-python's `Llama`, its token loop running
SFI) both build their steppers here, so the two decode the same way.
"""
from __future__ import annotations

import dataclasses

from .config import SFIConfig
from .context import LlamaContext
from .generate import DenseStepper

# With layers on a GPU, SFI starts at this context (unless SFIConfig.min_context says otherwise): below
# it, SFI on the H200 measured slower than dense decoding, or at best even with it (BENCHMARKS.md, "Where SFI
# starts on a GPU": at 16K 1.01x for the Qwen3-4B shape and 0.94x for Qwen3-0.6B, at 24K 1.15x for both).
GPU_MIN_CONTEXT = 24576

# On the CPU, with the default budget (k_head a quarter of the context), SFI starts at this context (unless
# SFIConfig.min_context or an explicit k_head says otherwise): the default model on 2 threads measured 0.95x dense
# at 1K cells and 1.13x at 2K (BENCHMARKS.md, "Speed on the CPU").
CPU_MIN_CONTEXT = 2048

# Batched decoding (n_parallel sequences) with layers on a GPU: SFI starts at this context per sequence
# (unless SFIConfig.min_context says otherwise). On the H200 (BENCHMARKS.md, "Where batched SFI starts on a
# GPU"), batches of 2 to 16 whose sequences refresh together run 1.05x-1.27x batched dense at 16K and 1.21x-2.24x
# at 32K; with their refreshes staggered, as a server's requests are, 0.90x-0.95x at 16K and 1.21x at 32K.
GPU_BATCHED_MIN_CONTEXT = 32768


def sfi_config(sfi) -> SFIConfig:
    """An `sfi=` argument (an SFIConfig, a policy name, a dict of SFIConfig fields, a bool or None) as an SFIConfig."""
    if sfi is True or sfi is None:
        return SFIConfig()
    if sfi is False:
        return SFIConfig(policy="dense")
    if isinstance(sfi, str):
        return SFIConfig(policy=sfi)
    if isinstance(sfi, SFIConfig):
        return sfi
    if isinstance(sfi, dict):  # e.g. the "sfi" field of a server request: fields and parameters by name
        return SFIConfig(**sfi)
    raise ValueError(f"sfi must be an SFIConfig, a policy name, a dict of SFIConfig keywords or a bool, got {sfi!r}")


def check_fits(config: SFIConfig, n_ctx: int) -> None:
    """An explicit k_head above the context cannot be what the caller meant: say so, naming it.

    (k_head == n_ctx is fine: a budget covering the whole context, used to compare with dense.)
    """
    if not config.dense and config.k_head is not None and config.k_head > n_ctx:
        raise ValueError(f"SFIConfig.k_head={config.k_head}: larger than the context (n_ctx={n_ctx}); "
                         "use k_head <= n_ctx, or k_head=None to scale it to the context")


def check_split(config: SFIConfig, split_mode: str) -> None:
    """SFI gathers each layer's selected cells on the device that holds the layer's KV cache; with
    split_mode "row" the matrices of a layer are split across GPUs, a layout SFI is not built or tested for."""
    if not config.dense and split_mode == "row":
        raise ValueError("split_mode='row' is not supported with SFI; use split_mode='layer' (whole layers per GPU, "
                         "the default) or 'none', or sfi=False for dense decoding")


class SFIEngine:
    """Builds the steppers of one context (`ctx`, sequence 0; a batch passes each sequence's handle).

    The native SFI state (`native`) is created on the first SFI stepper and kept (re-initialised when a
    config needs other buffer sizes); the piece table of the vocabulary (sentence boundaries) likewise.
    """

    def __init__(self, ctx: LlamaContext, n_gpu_layers: int, split_mode: str):
        self.ctx = ctx
        self.n_gpu_layers = n_gpu_layers
        self.split_mode = split_mode
        self.native = None
        self.pieces = None

    def effective_config(self, config: SFIConfig, batched: bool = False) -> SFIConfig:
        """`config` with the defaults that depend on where the model runs filled in."""
        if self.n_gpu_layers and config.device_selector is None:
            # offloaded layers: the Selector runs in the slow step's graph (BENCHMARKS.md, "Speed on the GPU")
            config = dataclasses.replace(config, device_selector=True)
        if self.n_gpu_layers and config.min_context is None and batched:
            return dataclasses.replace(config, min_context=GPU_BATCHED_MIN_CONTEXT)
        if self.n_gpu_layers and config.min_context is None:
            # offloaded layers (a GPU, or RPC): a dense step is cheap until the context is long, and the
            # slow steps and the Selector cost more than the fast steps save below ~32K cells on the
            # H200 (BENCHMARKS.md, "Speed on the GPU")
            return dataclasses.replace(config, min_context=GPU_MIN_CONTEXT)
        if not self.n_gpu_layers and config.min_context is None and config.k_head is None:
            # the CPU with the default budget: dense below CPU_MIN_CONTEXT (above it the budget rule always holds)
            return dataclasses.replace(config, min_context=CPU_MIN_CONTEXT)
        return config

    def stepper(self, config: SFIConfig, ctx: LlamaContext | None = None, batched: bool = False):
        """Dense, or an SFI stepper with a fresh policy (the native view and vocabulary are kept).

        ctx: the sequence to step (default: the first); batched generation passes each slot's.
        """
        from .bindings import SFINative, SFISequence

        ctx = ctx or self.ctx
        if config.dense:
            if self.native is not None and self.native._initialized:
                self.native.set_mode(SFINative.DENSE)  # plain dense decodes from now on
            return DenseStepper(ctx, last_chunk=config.n_prefill_queries)
        n_ctx = self.ctx.n_ctx
        check_fits(config, n_ctx)
        check_split(config, self.split_mode)
        config = self.effective_config(config, batched)
        from .boundary import PieceTable
        from .policy import POLICIES, make_policy
        from .selector import make_selector
        from .stepper import SFIStepper

        # a selection or a tail never holds more cells than the context: capping at n_ctx keeps the native
        # buffers (allocated for the capacity) bounded, and the values inside int32
        t_max = config.policy_params.t_max  # the tail's capacity: twice the policy's T_max, at least 256 cells
        n_tail_max = min(n_ctx, max(256, 2 * (t_max or 0)))
        # a delayed selection keeps every cell that entered its range since it was chosen as recent
        # (SFIStepper._refresh_from_export): at most the delay, a full tail (a slow step skips the cheap
        # refresh) and the slow step's token beyond n_recent
        stretch = config.selection_delay + n_tail_max + 1 if config.selection_delay else 0
        params = dict(n_sel_max=min(n_ctx, config.n_sink + config.resolve_k_head(n_ctx) + config.n_recent + stretch),
                      n_tail_max=n_tail_max,
                      n_query_rows=min(n_ctx, config.n_prefill_queries),
                      evidence_alpha=config.selector_params.evidence_alpha, export_key_norms=True)
        if self.native is None:
            self.native = SFINative(self.ctx.ctx, **params)
        elif not self.native._initialized or any(self.native.params[k] != v for k, v in params.items()):
            self.native.init(**params)  # the config changed since (new budgets), or a re-init failed
        if self.pieces is None and POLICIES[config.policy].reads_text:
            self.pieces = PieceTable([self.ctx.token_bytes(t) for t in range(self.ctx.n_vocab)])
        native = self.native
        if self.ctx.n_seq_max > 1:
            native = SFISequence(native, ctx.seq)
        return SFIStepper(ctx, native, config, make_policy(config, self.pieces), make_selector(config))

    def close(self) -> None:
        if self.native is not None:
            self.native.free()
            self.native = None
