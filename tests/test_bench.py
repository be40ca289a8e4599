"""`sfi-gguf bench`: its rows say which settings differ from the defaults; confidence traces replayed where they
were taken, refused elsewhere."""
import json

import pytest

from sfi_gguf.tools.bench import (
    build_parser, config_overrides, forced_tokens_digest, load_confidence_trace, run_bench, text_tokens, trace_top1,
)
from sfi_gguf.cli import sfi_config_from_args
from sfi_gguf.core.config import SFIConfig
from sfi_gguf.sfi_llama import SFILlama
from sfi_gguf.tools.random_model import random_model

# every test runs a random model with the default model's tokenizer, copied from the downloaded model
pytestmark = pytest.mark.real_model
DEPTH, N_DECODE = 768, 48


@pytest.fixture(scope="module")
def model():
    """A tiny random model with the default model's tokenizer (the bench's text tokenizes as with real weights)."""
    return random_model("tiny-qwen3", n_layer=2, vocab="copy")


@pytest.fixture(scope="module")
def forced(model):
    llm = SFILlama(str(model), n_ctx=256, n_threads=2)
    try:
        return text_tokens(llm, DEPTH + N_DECODE)[DEPTH:]
    finally:
        llm.close()


def _trace(forced, top1):
    return {"model": "a-trained-model.gguf", "depths": {str(DEPTH): {"forced_sha256": forced_tokens_digest(forced),
                                                                       "top1": top1}}}


def test_bench_replays_the_trace_instead_of_the_models_confidence(model, forced):
    config = SFIConfig(k_head=64, n_recent=64, min_context=0, min_gap=8, warmup_refresh=0, refresh_interval=1000,
                       confidence_floor=0.5)
    run = dict(depths=[DEPTH], n_decode=N_DECODE, n_threads=2, config=config, log=lambda _: None)
    # a random model is never sure: a low-confidence refresh at every chance
    own = run_bench(model, **run)[0]
    assert own.confidence_source == "model" and own.slow_reasons.get("confidence", 0) >= N_DECODE // 9 - 1
    # a trace sure of every token: no low-confidence refresh; unsure of every token: the same as the model's own
    sure = run_bench(model, confidence_trace=_trace(forced, [0.99] * N_DECODE), **run)[0]
    assert sure.confidence_source == "trace: a-trained-model.gguf"
    assert "confidence" not in sure.slow_reasons and sure.slow_steps < own.slow_steps
    unsure = run_bench(model, confidence_trace=_trace(forced, [0.01] * N_DECODE), **run)[0]
    assert unsure.slow_reasons == own.slow_reasons


def test_a_trace_of_other_tokens_or_depths_is_refused_before_decoding(model, forced, tmp_path):
    other = list(forced)
    other[3] += 1
    with pytest.raises(ValueError, match="taken on other tokens"):
        trace_top1(_trace(other, [0.9] * N_DECODE), DEPTH, forced)
    with pytest.raises(ValueError, match="taken on other tokens"):  # too short for the run
        trace_top1(_trace(forced, [0.9] * (N_DECODE - 1)), DEPTH, forced)
    with pytest.raises(ValueError, match="no depth 1024"):
        trace_top1(_trace(forced, [0.9] * N_DECODE), 1024, forced)
    with pytest.raises(ValueError, match="no depth"):
        run_bench(model, depths=[1024], n_decode=N_DECODE, n_threads=2, config=SFIConfig(k_head=64, min_context=0),
                  confidence_trace=_trace(forced, [0.9] * N_DECODE), log=lambda _: None)
    path = tmp_path / "rows.json"
    path.write_text(json.dumps([{"depth": DEPTH}]))
    with pytest.raises(ValueError, match="not a confidence trace"):
        load_confidence_trace(path)


def test_a_committed_trace_matches_the_bench_text_of_this_python(model):
    """benchmarks/data's trace for this Python's text (texts.py builds it from pydoc_data.topics) was taken on the
    tokens the bench decodes."""
    from pathlib import Path

    from sfi_gguf.tools.texts import text_source

    traces = [load_confidence_trace(p) for p in
              (Path(__file__).resolve().parent.parent / "benchmarks" / "data").glob("confidence-trace-*.json")]
    mine = [t for t in traces if t["text_source"] == text_source()]
    if not mine:
        pytest.skip(f"no committed trace for this Python's text ({text_source()})")
    trace = mine[0]
    llm = SFILlama(str(model), n_ctx=256, n_threads=2)
    try:
        depths = sorted(int(d) for d in trace["depths"])
        text = text_tokens(llm, depths[-1] + trace["n_decode"])
    finally:
        llm.close()
    for depth in depths:
        assert len(trace_top1(trace, depth, text[depth:depth + trace["n_decode"]])) == trace["n_decode"]


def test_a_row_records_the_settings_that_differ_from_the_defaults(model, monkeypatch):
    # the CLI's defaults are SFIConfig's: a run without SFI flags has no overrides
    cli_default = sfi_config_from_args(build_parser().parse_args([]))
    assert cli_default == SFIConfig() and config_overrides(cli_default) == {}
    config = SFIConfig(k_head=64, n_recent=64, min_context=0, confidence_floor=0.0)
    assert config_overrides(config) == {"k_head": 64, "n_recent": 64, "min_context": 0, "confidence_floor": 0.0}
    # the attention setting of the environment too (on the CPU "0" is the default's behaviour: nothing else changes)
    monkeypatch.setenv("LLAMA_SFI_FA_EVIDENCE", "0")
    monkeypatch.setenv("LLAMA_SFI_KEEP_GRAPHS", "1")
    monkeypatch.setenv("GGML_CUDA_DISABLE_GRAPHS", "1")
    row = run_bench(model, depths=[DEPTH], n_decode=8, n_threads=2, config=config, log=lambda _: None)[0]
    assert row.config_overrides == config_overrides(config) and row.composite_ops is False
    assert row.fa_evidence_env == "0" and row.keep_graphs_env == "1" and row.cuda_graphs_disabled is True


def test_a_quantized_cache_is_benched_and_recorded(model):
    """`--type-kv q8_0`: dense and SFI over a Q8_0 KV cache (flash attention on, as a quantized V needs), the row
    and the table say so."""
    from sfi_gguf.tools.bench import markdown_table

    assert build_parser().parse_args(["--type-kv", "q8_0"]).type_kv == "q8_0"
    config = SFIConfig(k_head=64, n_recent=64, min_context=0)
    row = run_bench(model, depths=[DEPTH], n_decode=8, n_threads=2, config=config, type_kv="q8_0", log=lambda _: None)[0]
    assert row.type_kv == "q8_0" and row.flash_attn and row.dense_tok_s > 0 and row.sfi_tok_s > 0
    assert "KV cache q8_0" in markdown_table([row])


def test_staggered_sequences_refresh_on_different_steps(model):
    """`--batch N --stagger S`: started S steps apart, the sequences' refreshes (on random weights one every
    16 steps after the last) fall on different steps, so the timed steps mix slow and fast sequences; a row
    says so, and a stagger the decoded tokens cannot hold is refused."""
    from sfi_gguf.tools.bench import run_bench_batched

    config = SFIConfig(k_head=64, n_recent=64, min_context=0)
    together = run_bench_batched(model, batch=4, depths=[DEPTH], n_decode=N_DECODE, n_threads=2, config=config,
                                 log=lambda _: None)[0]
    staggered, gridded = run_bench_batched(model, batch=4, depths=[DEPTH], n_decode=N_DECODE, n_threads=2,
                                           config=config, stagger=4, variants=[config.replace(refresh_grid=8)],
                                           log=lambda _: None)
    assert (together.stagger, staggered.stagger, staggered.batch) == (0, 4, 4)
    assert staggered.slow_steps > 0 and staggered.fast_steps > 0 and staggered.sfi_tok_s > 0
    assert staggered.mixed_steps > together.mixed_steps
    # a variant's row: its refreshes on every 8th step of the batch meet in fewer mixed steps
    assert (gridded.refresh_grid, staggered.refresh_grid) == (8, 1)
    assert gridded.config_overrides == {**staggered.config_overrides, "refresh_grid": 8}
    assert 0 < gridded.mixed_steps < staggered.mixed_steps and gridded.dense_tok_s == staggered.dense_tok_s
    with pytest.raises(ValueError):
        run_bench_batched(model, batch=4, depths=[DEPTH], n_decode=8, n_threads=2, config=config, stagger=4,
                          log=lambda _: None)


def test_each_step_samples_where_the_option_says(model, monkeypatch):
    """`--sampling`: every step of the dense, SFI and ceiling runs makes (and waits for) the pick a sampled generation
    makes: in the graph ("default"), or on the host over the copied logits ("host"); the row and table say which."""
    from sfi_gguf.core.device_picks import DevicePicks
    from sfi_gguf.tools.bench import markdown_table, run_bench_batched

    picks = []
    real = DevicePicks.token
    monkeypatch.setattr(DevicePicks, "token", lambda self, index: picks.append(self.picks) or real(self, index))
    assert build_parser().parse_args(["--sampling", "host"]).sampling == ["host"]
    config = SFIConfig(k_head=64, n_recent=64, min_context=0)
    row = run_bench(model, depths=[DEPTH], n_decode=8, n_threads=2, config=config, sampling="default",
                    log=lambda _: None)[0]
    assert row.sampling == "default" and "picks: default" in markdown_table([row])
    assert len(picks) == 3 * 9 and all(p.temperature == 0.8 and p.top_k == 40 for p in picks)
    assert run_bench(model, depths=[DEPTH], n_decode=8, n_threads=2, config=config, sampling="host",
                     log=lambda _: None)[0].sampling == "host"
    assert len(picks) == 3 * 9
    batched = run_bench_batched(model, batch=2, depths=[DEPTH], n_decode=8, n_threads=2, config=config,
                                sampling="default", log=lambda _: None)[0]
    assert batched.sampling == "default" and len(picks) == 3 * 9 + 3 * 2 * 9 and batched.sfi_tok_s > 0


def test_picks_and_configs_compared_on_the_same_context(model):
    """`--sampling greedy default --variant redecode_tail=on`: at each depth dense and SFI decode with each pick, and
    the variant's SFI run sits beside the default's over the same dense run; each row says its pick and changes."""
    from sfi_gguf.tools.bench import config_variant, main, markdown_table

    config = SFIConfig(k_head=64, n_recent=64, min_context=0)
    variant = config_variant(config, "redecode_tail=on")
    rows = run_bench(model, depths=[DEPTH], n_decode=8, n_threads=2, config=config, samplings=["greedy", "default"],
                     variants=[variant], log=lambda _: None)
    assert [(r.sampling, r.config_overrides.get("redecode_tail", False)) for r in rows] == [
        ("greedy", False), ("greedy", True), ("default", False), ("default", True)]
    assert rows[0].dense_tok_s == rows[1].dense_tok_s != rows[2].dense_tok_s
    assert all(r.sfi_tok_s > 0 and r.slow_steps > 0 for r in rows)
    table = markdown_table(rows)
    assert "| default | k_head=64, min_context=0, n_recent=64, redecode_tail=True |" in table
    with pytest.raises(ValueError):
        config_variant(config, "redecode_tail=maybe")
    with pytest.raises(SystemExit):
        main(["-m", str(model), "--batch", "2", "--sampling", "greedy", "default"])
    with pytest.raises(SystemExit, match="--kv-on-host"):
        main(["-m", str(model), "--prefill-in-vram"])
    with pytest.raises(SystemExit, match="--dense-host-n"):
        main(["-m", str(model), "--dense-host-n", "8"])
