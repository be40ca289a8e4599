"""SFIConfig: defaults, the context-scaled budget, validation."""
import dataclasses
import math

import pytest

from sfi_gguf.config import SFIConfig
from sfi_gguf.policy import POLICIES
from sfi_gguf.selector import SELECTORS, make_selector


def test_defaults_follow_the_spec():
    c = SFIConfig()
    assert (c.n_sink, c.k_head, c.n_recent, c.min_context) == (4, None, 256, None)
    assert (c.policy, c.cooldown, c.min_gap, c.refresh_interval, c.n_prefill_queries) == \
        ("punctuation", 2, 16, 64, 16)
    # our additions to the trigger, measured in BENCHMARKS.md ("Trigger placement")
    assert (c.sentence_offset, c.warmup_refresh, c.confidence_floor) == (0, 8, 0.5)
    assert (c.selector, c.alpha, c.gamma, c.w_l2, c.w_pos, c.pos_power, c.pos_eta) == \
        ("sfi", 0.5, 0.5, 1.0, 0.7, 1.8, 0.4)
    assert c.pos_beta == pytest.approx(-math.log(0.6) / 0.9) and c.pos_beta == pytest.approx(0.568, abs=1e-3)
    assert (c.lambda_clip_single, c.lambda_clip_multi) == (0.35, 0.25)
    assert (c.nms_window, c.cross_head_alpha, c.cross_head_temperature) == (32, 0.85, 2.0)
    # our deviations, measured in BENCHMARKS.md: soft-NMS off (the paper: strength 1.0), evidence pooling on
    assert (c.nms_strength, c.pool_window) == (0.0, None)
    assert make_selector(c).pool_window == 17 and make_selector(c, "topk_mass").pool_window == 0


@pytest.mark.parametrize("n_context,k_head", [
    (131072, 2048), (32768, 2048), (8192, 2048), (8191, 1984), (4096, 1024), (2048, 512), (1000, 192), (300, 64),
    (0, 64),
])
def test_k_head_is_a_quarter_of_the_context_in_blocks_of_64_capped_at_2048(n_context, k_head):
    assert SFIConfig().resolve_k_head(n_context) == k_head


def test_explicit_k_head_wins():
    assert SFIConfig(k_head=512).resolve_k_head(131072) == 512
    assert SFIConfig(k_head=4096).resolve_k_head(1000) == 4096


def test_short_contexts_stay_dense():
    c = SFIConfig()
    assert c.resolve_min_context(4096) == 4 + 1024 + 256
    assert not c.stays_dense(4096)
    assert SFIConfig(k_head=4096).resolve_min_context(4000) == 4 + 4096 + 256
    assert SFIConfig(k_head=4096).stays_dense(4000)
    assert not SFIConfig(k_head=4096).stays_dense(4356)
    assert SFIConfig(min_context=10_000).stays_dense(9_999)
    assert not SFIConfig(min_context=0).stays_dense(10)
    assert SFIConfig(policy="dense").stays_dense(1_000_000)


@pytest.mark.parametrize("field,value", [
    ("n_sink", -1), ("n_recent", -5), ("n_sink", 1.5), ("n_sink", True), ("k_head", 0), ("k_head", -64),
    ("k_head", 2048.0), ("min_context", -1), ("cooldown", -1), ("min_gap", -1), ("refresh_interval", 0),
    ("fixed_period", 0), ("n_prefill_queries", 0), ("nms_window", 0), ("policy", "nope"), ("selector", "nope"),
    ("alpha", 0), ("alpha", float("nan")), ("alpha", float("inf")), ("gamma", float("nan")), ("w_l2", -1.0),
    ("w_pos", -0.1), ("pos_power", 0), ("nms_strength", -1), ("cross_head_alpha", -0.5),
    ("lambda_clip_single", 1.5), ("lambda_clip_multi", -0.1), ("cross_head_temperature", 0),
    ("sentence_offset", -1), ("warmup_refresh", -1), ("confidence_floor", 1.5), ("confidence_floor", -0.1),
])
def test_invalid_values_raise_naming_the_parameter(field, value):
    with pytest.raises(ValueError, match=rf"SFIConfig\.{field}="):
        SFIConfig(**{field: value})


def test_validate_rechecks_a_modified_config():
    c = SFIConfig()
    c.validate()
    object.__setattr__(c, "n_recent", -1)  # bypassing the frozen dataclass
    with pytest.raises(ValueError, match="n_recent"):
        c.validate()


def test_replace_validates_and_refuses_unknown_names():
    c = SFIConfig().replace(policy="fixed", fixed_period=32)
    assert (c.policy, c.fixed_period) == ("fixed", 32)
    with pytest.raises(ValueError, match="min_gap"):
        c.replace(min_gap=-3)
    with pytest.raises(ValueError, match="no parameter k_heads"):
        c.replace(k_heads=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_sink = 8


def test_every_registered_policy_and_selector_name_is_valid():
    assert set(POLICIES) == {"punctuation", "fixed", "static", "sink_recent", "dense"}
    assert set(SELECTORS) >= {"sfi", "topk_mass"}
    for name in POLICIES:
        assert SFIConfig(policy=name).policy == name
    for name in SELECTORS:
        assert SFIConfig(selector=name).selector == name
