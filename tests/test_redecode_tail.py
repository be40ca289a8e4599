"""SFIConfig.redecode_tail: a slow step decodes the fast steps' tokens again, so that the cache holds dense KV
(real default model, CPU)."""
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.config import SFIConfig
from sfi_gguf.tools.agreement import agreement_with, dense_reference
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

N_CTX = 2048


@pytest.fixture(scope="module")
def llm():
    model = SFILlama(None, n_ctx=N_CTX, n_threads=2)
    yield model
    model.close()


@pytest.fixture(scope="module")
def forced(llm):
    prompt = llm.tokenize(natural_text(8000, seed=3))[:1200]
    return prompt, dense_reference(llm, prompt, 48)


def _slow_step_kl(llm, prompt, ref, redecode: bool):
    """KL(dense || SFI) at each slow step after the first fast steps, teacher-forced through dense's tokens,
    with a memory small enough (16 selected and 16 recent cells) that fast steps' KV differs from dense's."""
    config = SFIConfig(k_head=16, n_recent=16, min_context=0, policy="fixed", fixed_period=8, redecode_tail=redecode)
    res = agreement_with(llm, prompt, ref, config)
    slow = [s for s in res.sfi_stats.slow_steps if s < ref.n_steps]  # step s decoded the token whose logits are row s
    assert len(slow) >= 4 and res.sfi_stats.n_fast > 0
    return res.kl[slow], res


def test_slow_steps_read_dense_kv_again(llm, forced):
    """With redecode_tail a slow step's distribution is dense's (the cache holds what dense decoding wrote, up
    to the batched kernels' rounding); without it, the fast steps' KV stays in the cache and the slow step
    reads it."""
    prompt, ref = forced
    with_redecode, res = _slow_step_kl(llm, prompt, ref, True)
    without, _ = _slow_step_kl(llm, prompt, ref, False)
    # (measured: mean 0.0006 with, the batched rows rounding apart from single-token ones; 0.028 without)
    assert with_redecode.mean() < 0.002, with_redecode
    assert without.mean() > 10 * with_redecode.mean(), (without, with_redecode)
    # the tokens after each slow step are decoded as usual: the same step counts as without it
    assert res.sfi_stats.n_slow + res.sfi_stats.n_fast == ref.n_steps - 1


def test_outputs_with_every_cell_selected_equal_dense(llm, forced):
    """With a memory of every cell, re-decoding the tail changes nothing that matters: the greedy tokens are
    dense's."""
    prompt, ref = forced
    llm.reset()
    llm.sfi_config = SFIConfig(k_head=N_CTX, min_context=0, policy="fixed", fixed_period=8, redecode_tail=True)
    out = llm.generate(prompt, max_tokens=32, temperature=0, ignore_eos=True)
    assert out.stats.sfi.n_slow >= 3
    assert out.tokens == ref.tokens[:32]


def test_a_batch_refuses_it():
    llm = SFILlama(None, n_ctx=512, n_threads=2, n_parallel=2, sfi=SFIConfig(redecode_tail=True, min_context=0))
    try:
        with pytest.raises(ValueError, match="redecode_tail"):
            llm.generate_batch(["Hello there", "Goodbye now"], max_tokens=4, temperature=0)
    finally:
        llm.close()


def test_it_is_a_switch():
    with pytest.raises(ValueError, match="redecode_tail"):
        SFIConfig(redecode_tail=1)
    with pytest.raises(ValueError, match="redecode_tail"):
        SFIConfig(redecode_tail="on")
