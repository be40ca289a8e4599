"""SFI decoding end to end on the real default model (CPU).

One model and one long natural-text prompt are shared by the tests: the KV cache of the prompt is
reused between them (prefix reuse), so the ~3.7K-token prefill is paid once.
"""
import pytest

from sfi_gguf.tools.agreement import agreement_with, compare_with_dense, dense_reference
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.tools.texts import natural_text

pytestmark = pytest.mark.real_model

N_CTX = 4096
PROMPT_TOKENS = 3700


# the `llm` fixture's SFILlama keywords (conftest.py)
LLM_ARGS = dict(n_ctx=N_CTX, n_threads=2, sfi=SFIConfig(k_head=512))


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenize(natural_text(16000, seed=1))[:PROMPT_TOKENS]


def _generate(llm, prompt, config, n=48):
    llm.sfi_config = config
    return llm.generate(prompt, max_tokens=n, temperature=0, ignore_eos=True)


def test_budget_covering_the_whole_context_equals_dense(llm, prompt):
    """Fast steps over every cell, in cell order, are bit-identical to dense steps on the CPU."""
    short = prompt[:1200]  # both runs prefill from scratch, so the cache content is bit-identical
    llm.reset()
    sfi = _generate(llm, short, SFIConfig(k_head=N_CTX, min_context=0), n=64)
    llm.reset()
    dense = _generate(llm, short, SFIConfig(policy="dense"), n=64)
    assert sfi.tokens == dense.tokens
    s = sfi.stats.sfi
    assert s.n_bootstrap == 1 and s.n_fast > 0 and s.n_fell_back == 0


def test_statistics_add_up(llm, prompt, monkeypatch):
    from sfi_gguf.core.context import LlamaContext

    softmaxes = []  # the confidence's softmax over the vocabulary runs only where the policy reads it
    real = LlamaContext.greedy_probability
    monkeypatch.setattr(LlamaContext, "greedy_probability", lambda ctx: softmaxes.append(1) or real(ctx))
    out = _generate(llm, prompt, SFIConfig(k_head=512), n=96)
    s = out.stats.sfi
    assert 0 < len(softmaxes) < s.n_fast  # every step's logits had one before (n_fast + n_slow + 1)
    steps = out.stats.n_generated - 1  # the first token comes from the prefill's logits
    assert s.n_fast + s.n_slow + s.n_dense == steps
    assert s.n_dense == 0 and s.n_bootstrap == 1 and s.n_fell_back == 0
    assert len(s.slow_steps) == s.n_slow == sum(s.reasons.values())
    assert len(s.refresh_overlap) == s.n_slow and all(0.0 <= x <= 1.0 for x in s.refresh_overlap)
    assert s.k_head == 512 and s.budget == 4 + 512 + 256
    assert s.t_fast > 0 and s.t_slow > 0 and s.t_selector > 0
    # the warm-up refresh 8 steps after the bootstrap; then min gap 16 and T_max 64 bound the distance
    # between consecutive slow steps
    assert s.slow_steps[0] == 8 and s.reasons["warmup"] == 1
    gaps = [b - a for a, b in zip([0] + s.slow_steps, s.slow_steps)]
    assert all(16 <= g <= 64 for g in gaps[1:])


def test_policies_by_name(llm, prompt):
    fixed = _generate(llm, prompt, SFIConfig(k_head=512, policy="fixed", fixed_period=20), n=64).stats.sfi
    assert fixed.slow_steps == [20, 40, 60] and fixed.reasons == {"period": 3}
    static = _generate(llm, prompt, SFIConfig(k_head=512, policy="static"), n=64).stats.sfi
    assert static.n_bootstrap == 1 and static.n_slow == 0 and static.n_fast == 63
    sink = _generate(llm, prompt, SFIConfig(k_head=512, policy="sink_recent"), n=64).stats.sfi
    assert sink.n_bootstrap == 0 and sink.n_slow == 0 and sink.n_fast == 63
    dense = _generate(llm, prompt, SFIConfig(policy="dense"), n=8)
    assert dense.stats.mode == "dense" and dense.stats.sfi is None


def test_short_context_stays_dense(llm):
    out = _generate(llm, "Caches keep recently used data close to the processor.", SFIConfig(k_head=512), n=8)
    s = out.stats.sfi
    assert s.n_dense == 7 and s.n_fast == 0 and s.n_bootstrap == 0


def test_multi_turn_reuses_the_cache_and_reselects(llm, prompt):
    first = _generate(llm, prompt, SFIConfig(k_head=512), n=16)
    follow_up = prompt + first.tokens + llm.tokenize(" In short,", add_special=False)
    second = _generate(llm, follow_up, SFIConfig(k_head=512), n=16)
    assert second.stats.n_prompt_decoded < 64  # only the new input (and the bootstrap rows) were decoded
    assert second.stats.sfi.n_bootstrap == 1 and second.stats.sfi.n_fast > 0


def test_agreement_with_dense_at_4k_context_beats_sink_recent(llm):
    """Teacher-forced over a 256-token dense continuation of natural text (3.7K-token prompt, k_head 512):
    the default policy (sentence starts + T_max + a warm-up refresh + the low-confidence trigger)
    follows dense on >= 90% of the tokens with few slow steps, and better than sink+recent at the
    same budget. The figures are in BENCHMARKS.md ("Trigger placement": 0.953, 12 slow steps at
    one thread)."""
    prompt = llm.tokenize(natural_text(30000, seed=1))[:PROMPT_TOKENS]
    ref = dense_reference(llm, prompt, 256)
    rates = {}
    for policy in ("punctuation", "sink_recent"):
        result = agreement_with(llm, prompt, ref, SFIConfig(k_head=512, policy=policy))
        rates[policy] = (result.top1_rate, result.mean_kl, result.sfi_stats.n_slow)
        print(f"{policy}: top-1 agreement {result.top1_rate:.3f}, mean KL {result.mean_kl:.4f}, "
              f"slow steps {result.sfi_stats.n_slow} {result.sfi_stats.reasons}")
    assert rates["punctuation"][0] > rates["sink_recent"][0] + 0.05
    assert rates["punctuation"][1] < rates["sink_recent"][1]
    assert rates["punctuation"][0] >= 0.90  # issue 4's target (measured 0.953)
    assert rates["punctuation"][2] <= 16  # a slow step every 16 tokens at most, on average


def test_agreement_on_a_repetitive_continuation_is_high(llm, prompt):
    """The prompt without a trailing paragraph break continues into a near-repetition loop, where
    the sparse memory holds what dense attends to: top-1 agreement 0.98 (k_head 512)."""
    llm.sfi_config = SFIConfig(k_head=512)
    result = compare_with_dense(llm, prompt, n_steps=256)
    print(f"top-1 agreement {result.top1_rate:.3f}, mean KL {result.mean_kl:.4f}")
    assert result.top1_rate >= 0.90


def test_cli_run_uses_sfi_and_prints_statistics(tmp_path):
    import subprocess
    import sys

    doc = tmp_path / "doc.txt"
    doc.write_text(natural_text(7000, seed=2))
    cmd = [sys.executable, "-m", "sfi_gguf.cli", "run", "-f", str(doc), "Summarize the text above.", "-n", "24",
           "-c", "2560", "-t", "2", "--seed", "1", "--k-head", "512"]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr
    assert "SFI: policy punctuation" in result.stderr and "fast" in result.stderr and "tok/s" in result.stderr
    dense = subprocess.run(cmd + ["--dense"], capture_output=True, text=True, timeout=900)
    assert dense.returncode == 0 and "[dense]" in dense.stderr and "SFI:" not in dense.stderr
    bad = subprocess.run(cmd[:4] + ["hi", "--k-head", "-5"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "k_head" in bad.stderr and "Traceback" not in bad.stderr
