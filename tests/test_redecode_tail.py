"""SFIConfig.redecode_tail: a slow step decodes the fast steps' tokens again with its own, in one ubatch, so that
the cache holds dense KV (real default model, CPU; batches on a random-weight model)."""
import numpy as np
import pytest

from sfi_gguf import SFILlama
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.core.bindings import SFINative
from sfi_gguf.tools.agreement import agreement_with, dense_reference, log_softmax
from sfi_gguf.tools.random_model import random_model
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

N_CTX = 2048


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=N_CTX, n_threads=2)


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


def test_with_every_cell_selected_it_follows_dense(llm, forced):
    """With a memory of every cell, re-decoding the tail changes nothing that matters: every step's distribution is
    dense's up to rounding (a slow step's row is computed in a ubatch with its tail, a dense step's alone), so dense's
    argmax wins wherever it is not a near-tie (measured: KL at most 0.002; step 16 is a tie, 0.374 against 0.373)."""
    prompt, ref = forced
    config = SFIConfig(k_head=N_CTX, min_context=0, policy="fixed", fixed_period=8, redecode_tail=True)
    res = agreement_with(llm, prompt, ref, config)
    assert res.sfi_stats.n_slow >= 3 and res.sfi_stats.n_redecoded > 0
    p = np.sort(np.exp(ref.logp), axis=1)
    clear = p[:, -1] - p[:, -2] > 0.01
    assert clear.sum() > 40 and res.top1[clear].all()
    assert res.kl.max() < 0.01, res.kl


def _forced_slow_steps(llm, prompt, ref, two_decodes: bool):
    """Teacher-forced through dense's tokens with redecode_tail: each step's log-probabilities, and per refresh the
    selection (cells sorted per row) and the query rows its export summed. two_decodes: the slow step in the form
    the one-ubatch step replaces, the tail decoded densely, then the token alone."""
    config = SFIConfig(k_head=16, n_recent=16, min_context=0, policy="fixed", fixed_period=8, redecode_tail=True)
    stepper = llm.stepper(config)
    refreshes = []
    use_selection = stepper._use_selection

    def record(selected, *args, **kwargs):
        refreshes.append((np.sort(np.asarray(selected), axis=-1), stepper.native.n_query_rows()))
        return use_selection(selected, *args, **kwargs)

    def decode_in_two(tail, token):
        stepper.native.set_mode(SFINative.DENSE)
        stepper.ctx.prefill(stepper.ctx.tokens + tail)
        stepper.native.set_mode(SFINative.SLOW)
        stepper.ctx.decode_one(token)

    stepper._use_selection = record
    if two_decodes:
        stepper.decode_with_tail = decode_in_two
    stepper.prefill(prompt)
    logp = []
    for i, token in enumerate(ref.tokens):
        logp.append(log_softmax(llm.context.last_logits()))
        if i + 1 < ref.n_steps:
            stepper.step(token)
    return np.array(logp), refreshes, stepper.stats


def test_one_ubatch_slow_step_equals_the_tail_then_the_token(llm, forced):
    """The slow step over [tail..., token] in one ubatch exports its token's row alone: its selection and its
    distribution are those of decoding the tail densely and then the token as the slow step, up to the rounding of
    rows batched differently (measured: selections 98.6-99.7% the same, slow-step KL at most 0.0015)."""
    prompt, ref = forced
    one, sel_one, stats = _forced_slow_steps(llm, prompt, ref, False)
    two, sel_two, _ = _forced_slow_steps(llm, prompt, ref, True)
    assert stats.n_slow >= 4 and stats.n_redecoded == 7 * stats.n_slow  # 7 fast steps between slow steps
    # the bootstrap's 16 prompt rows, then one row (the token's) per slow step, in both forms
    assert [rows for _, rows in sel_one] == [rows for _, rows in sel_two] == [16] + [1] * stats.n_slow
    for (a, _), (b, _) in zip(sel_one, sel_two):
        rows = zip(a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1]))
        overlap = np.mean([len(np.intersect1d(x, y)) / x.size for x, y in rows])
        assert overlap > 0.97, overlap
    slow = [s for s in stats.slow_steps if s < ref.n_steps]  # step s decoded the token whose logits are row s
    kl = (np.exp(one) * (one - two)).sum(axis=1)[slow]
    assert kl.max() < 0.005 and kl.mean() < 0.001, kl
    # the steps after differ a little more (their selections are not all the same cells), but not where it shows
    p = np.sort(np.exp(ref.logp), axis=1)
    clear = p[:, -1] - p[:, -2] > 0.01
    assert (one.argmax(axis=1) == two.argmax(axis=1))[clear].all()


TINY = SFIConfig(k_head=32, n_recent=32, n_sink=4, min_context=280, policy="fixed", fixed_period=8,
                 redecode_tail=True)


def test_batched_sequences_redecode_as_they_would_alone():
    """In a batch a slow sequence decodes its tail and token in a ubatch of its own; every sequence gets the tokens,
    slow steps and re-decoded tails it gets alone (greedy, random-weight model; a prompt of 250 tokens decodes
    densely until its context reaches 280, so steps mix dense, slow and fast sequences)."""
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(3, 200, n)] for n in (300, 420, 250)]
    llm = SFILlama(str(random_model("tiny-llama")), n_ctx=1024, n_parallel=3, n_threads=1)
    try:
        decoder = llm.batched_decoder()
        decoder.reset_timing()
        batch = llm.generate_batch(prompts, max_tokens=60, temperature=0, sfi=TINY, ignore_eos=True)
        n_redecoding = 0
        for prompt, b in zip(prompts, batch):
            alone = llm.generate(prompt, max_tokens=60, temperature=0, sfi=TINY, ignore_eos=True)
            assert b.tokens == alone.tokens
            assert b.stats.sfi.slow_steps == alone.stats.sfi.slow_steps and b.stats.sfi.n_slow >= 3
            assert b.stats.sfi.n_redecoded == alone.stats.sfi.n_redecoded > 0
            assert b.stats.sfi.refresh_overlap == pytest.approx(alone.stats.sfi.refresh_overlap)
            n_redecoding += b.stats.sfi.n_redecoded // 7  # each such slow step re-decodes the 7 fast steps before it
        # one llama_decode per step, plus one for each slow step that re-decodes its tail apart
        assert decoder.n_llama_decode == decoder.n_steps + n_redecoding
    finally:
        llm.close()


def test_it_is_a_switch():
    with pytest.raises(ValueError, match="redecode_tail"):
        SFIConfig(redecode_tail=1)
    with pytest.raises(ValueError, match="redecode_tail"):
        SFIConfig(redecode_tail="on")
