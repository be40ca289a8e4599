"""SFIConfig.dense_layers (llama_sfi_params.n_dense_layers): fast steps attend to the whole cache in the first
layers and to the view in the others. With every layer dense a fast step is a dense step; with some, each layer
reads what it says (random-weight model, CPU)."""
import numpy as np
import pytest

from sfi_gguf.core import bindings
from sfi_gguf.core.bindings import SFIError, SFINative
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.engine import check_dense_layers
from native_harness import FLASH_ATTN, Ctx, MultiCtx, nmse, seq_cells, tokens_for

P = 120     # prompt tokens
N_SEL = 8   # a selection far from every cell: a fast step over it is not a dense one


def _fast_steps(model, n_dense_layers, flash_attn, n_steps=4):
    """Logits of n_steps FAST steps over a small selection with n_dense_layers, and of the same tokens dense."""
    a, b = Ctx(model, flash_attn=flash_attn), Ctx(model, flash_attn=flash_attn)
    try:
        toks = tokens_for(model, P + n_steps, seed=11)
        a.decode(toks[:P])
        b.decode(toks[:P])
        sfi = SFINative(b.ctx, n_sel_max=64, n_tail_max=16, n_dense_layers=n_dense_layers)
        rng = np.random.default_rng(0)
        sel = np.stack([np.stack([np.sort(rng.choice(P, N_SEL, replace=False)) for _ in range(sfi.n_head_kv)])
                        for _ in range(sfi.n_layers)]).astype(np.int32)
        sfi.set_selection(sel)
        sfi.set_mode(sfi.FAST)
        out = []
        for t in toks[P:]:
            a.decode([t])
            b.decode([t])
            assert sfi.status() & bindings.STATUS_LAST_FAST
            out.append((a.logits(), b.logits()))
        return sfi.n_layers, out
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_fast_steps_read_the_cache_in_the_dense_layers_and_the_view_in_the_others(tiny, flash_attn):
    n_layers, every = _fast_steps(tiny, 99, flash_attn)  # more than the model has: every layer
    assert n_layers >= 2
    for dense, fast in every:
        assert nmse(fast, dense) < 1e-10
    _, none = _fast_steps(tiny, 0, flash_attn)
    _, first = _fast_steps(tiny, 1, flash_attn)
    for (dense, sparse), (_, one) in zip(none, first):
        assert nmse(sparse, dense) > 1e-4  # the selection is far from dense ...
        assert nmse(one, dense) > 1e-6 and nmse(one, sparse) > 1e-6  # ... and one dense layer is neither


@pytest.mark.parametrize("flash_attn", FLASH_ATTN)
def test_in_a_batch_of_slow_and_fast_sequences(tiny, flash_attn):
    """A MIXED ubatch (sequence 0 slow, 1 and 2 fast) and a FAST one: with every layer dense, each sequence's
    logits are dense's."""
    sfi_ctx, dense_ctx = MultiCtx(tiny, flash_attn=flash_attn), MultiCtx(tiny, flash_attn=flash_attn)
    try:
        prompts = [tokens_for(tiny, 60 + 20 * s, seed=s) for s in range(3)]
        for c in (sfi_ctx, dense_ctx):
            for s, p in enumerate(prompts):
                c.prefill(s, p)
        sfi = SFINative(sfi_ctx.ctx, n_sel_max=128, n_tail_max=16, n_dense_layers=99)
        for modes in ((sfi.SLOW, sfi.FAST, sfi.FAST), (sfi.FAST, sfi.FAST, sfi.FAST)):
            for s, mode in enumerate(modes):
                sfi.set_mode(mode, seq=s)
                if mode == sfi.FAST and not sfi.status(s) & bindings.STATUS_VIEW_VALID:
                    first = seq_cells(sfi, s)[:N_SEL]  # (a slow step invalidated the view)
                    sfi.set_selection(np.ascontiguousarray(np.broadcast_to(first, (sfi.n_layers, sfi.n_head_kv, N_SEL))),
                                      seq=s)
            step = {s: 5 + s for s in range(3)}
            got, want = sfi_ctx.step(step), dense_ctx.step(step)
            for s in range(3):
                assert nmse(got[s], want[s]) < 1e-10, (modes, s)
            for s, mode in enumerate(modes):
                if mode == sfi.FAST:
                    assert sfi.status(s) & bindings.STATUS_LAST_FAST
    finally:
        sfi_ctx.close()
        dense_ctx.close()


def test_dense_layers_are_validated(tiny):
    with pytest.raises(ValueError, match="dense_layers"):
        SFIConfig(dense_layers=-1)
    with pytest.raises(ValueError, match="kv_on_host"):
        check_dense_layers(SFIConfig(dense_layers=2), kv_on_host=True)
    check_dense_layers(SFIConfig(dense_layers=2), kv_on_host=False)
    c = Ctx(tiny)
    try:
        with pytest.raises(SFIError) as err:
            SFINative(c.ctx, n_dense_layers=-1)
        assert err.value.code == bindings.ERR_BAD_ARG
    finally:
        c.close()
