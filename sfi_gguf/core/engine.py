"""The SFI engine of one model and context: the native compact view, the piece table of the vocabulary,
and the steppers that decode with them.

`SFILlama` (sfi_gguf's own API) and `sfi_gguf.Llama` (llama-cpp-python's `Llama`, its token loop running
SFI) both build their steppers here, so the two decode the same way.
"""
from __future__ import annotations

from .config import SFIConfig
from .context import LlamaContext
from .generate import DenseStepper
from .plan import CPU_MIN_CONTEXT, GPU_BATCHED_MIN_CONTEXT, GPU_MIN_CONTEXT, SFIPlan, effective_config, resolve_plan

__all__ = ["CPU_MIN_CONTEXT", "GPU_BATCHED_MIN_CONTEXT", "GPU_MIN_CONTEXT", "SFIEngine", "check_fits", "check_split",
           "sfi_config"]


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

    Each config is resolved once for the context into an `SFIPlan` (`plan`), which its steppers read. The native
    SFI state (`native`) is created on the first SFI stepper and kept (re-initialised when a plan needs other
    native parameters); the piece table of the vocabulary (sentence boundaries) likewise.
    """

    def __init__(self, ctx: LlamaContext, n_gpu_layers: int, split_mode: str):
        self.ctx = ctx
        self.n_gpu_layers = n_gpu_layers
        self.split_mode = split_mode
        self.native = None
        self.pieces = None
        self._plans: dict[tuple[SFIConfig, bool], SFIPlan] = {}

    def effective_config(self, config: SFIConfig, batched: bool = False) -> SFIConfig:
        """`config` with the defaults that depend on where the model runs filled in."""
        return effective_config(config, offloaded=bool(self.n_gpu_layers), batched=batched,
                                kv_on_host=self.ctx.kv_on_host)

    def plan(self, config: SFIConfig, batched: bool = False) -> SFIPlan:
        """The plan of `config` on this context (checked, its defaults filled in), resolved once per config."""
        key = (config, batched)
        plan = self._plans.get(key)
        if plan is None:
            if not config.dense:
                check_fits(config, self.ctx.n_ctx)
                check_split(config, self.split_mode)
            from .bindings import default_params

            native_defaults = default_params() if not config.dense else None
            plan = resolve_plan(config, self.ctx.n_ctx, offloaded=bool(self.n_gpu_layers), batched=batched,
                                kv_on_host=self.ctx.kv_on_host,
                                native_defaults=native_defaults)
            if len(self._plans) >= 64:  # a server's requests may each bring a config: keep the recent ones
                del self._plans[next(iter(self._plans))]
            self._plans[key] = plan
        return plan

    def stepper(self, config: SFIConfig, ctx: LlamaContext | None = None, batched: bool = False):
        """Dense, or an SFI stepper with a fresh policy (the native view and vocabulary are kept).

        ctx: the sequence to step (default: the first); batched generation passes each slot's.
        """
        from .bindings import SFINative, SFISequence

        ctx = ctx or self.ctx
        plan = self.plan(config, batched)
        if plan.dense:
            if self.native is not None and self.native._initialized:
                self.native.set_mode(SFINative.DENSE)  # plain dense decodes from now on
            return DenseStepper(ctx, last_chunk=plan.options.n_prefill_queries)
        from .boundary import PieceTable
        from .stepper import SFIStepper

        params = plan.native.as_dict()
        if self.native is None:
            self.native = SFINative(self.ctx.ctx, **params)
        elif not self.native._initialized or self.native.params != params:
            self.native.init(**params)  # another plan (new budgets, other graph switches), or a re-init failed
        if self.pieces is None and plan.policy.reads_text:
            self.pieces = PieceTable([self.ctx.token_bytes(t) for t in range(self.ctx.n_vocab)])
        native = self.native
        if self.ctx.n_seq_max > 1 or batched:  # (the batch loop reads each slot's own settings, even of one slot)
            native = SFISequence(native, ctx.seq)
        return SFIStepper(ctx, native, plan, plan.make_policy(self.pieces), plan.make_selector())

    def close(self) -> None:
        if self.native is not None:
            self.native.free()
            self.native = None
