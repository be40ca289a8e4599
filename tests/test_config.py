"""SFIConfig: defaults, the context-scaled budget, validation, the parameters of the policy and selector."""
import dataclasses
import math

import pytest

from sfi_gguf.core.config import SFIConfig, parameter_owners
from sfi_gguf.core.params import Params
from sfi_gguf.core.plan import (CPU_MIN_CONTEXT, GPU_BATCHED_MIN_CONTEXT, GPU_MIN_CONTEXT, Budget, ExecOptions,
                                NativeParams, resolve_plan)
from sfi_gguf.core.policy import POLICIES, FixedParams, PolicyParams, PunctuationParams
from sfi_gguf.core.selector import SELECTORS, SelectorParams, SFISelectorParams, TopKMassParams, make_selector


def test_defaults_follow_the_spec():
    c = SFIConfig()
    assert (c.n_sink, c.k_head, c.n_recent, c.min_context, c.n_prefill_queries) == (4, None, 256, None, 16)
    p = c.policy_params
    assert (c.policy, type(p), p.cooldown, p.min_gap, p.refresh_interval) == ("punctuation", PunctuationParams, 2, 16, 64)
    # our additions to the trigger, measured in BENCHMARKS.md ("Trigger placement")
    assert (p.sentence_offset, p.warmup_refresh, p.confidence_floor) == (0, 8, 0.5)
    s = c.selector_params
    assert (c.selector, type(s), s.alpha, s.gamma, s.w_l2, s.w_pos, s.pos_power, s.pos_eta) == \
        ("sfi", SFISelectorParams, 0.5, 0.5, 1.0, 0.7, 1.8, 0.4)
    assert s.pos_beta == pytest.approx(-math.log(0.6) / 0.9) and s.pos_beta == pytest.approx(0.568, abs=1e-3)
    assert (s.lambda_clip_single, s.lambda_clip_multi) == (0.35, 0.25)
    assert (s.nms_window, s.cross_head_alpha, s.cross_head_temperature) == (32, 0.85, 2.0)
    # our deviations, measured in BENCHMARKS.md: soft-NMS off (the paper: strength 1.0), evidence pooling on
    assert (s.nms_strength, s.pool_window) == (0.0, 17)
    assert make_selector(c).pool_window == 17 and make_selector(c, "topk_mass").pool_window == 0
    assert SFIConfig(policy="fixed").policy_params == FixedParams(fixed_period=64)
    assert SFIConfig(selector="topk_mass").selector_params == TopKMassParams(pool_window=0)


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


@pytest.mark.parametrize("field,value", [  # the parameters of the policy and selector: in their Params' message
    ("n_sink", -1), ("n_recent", -5), ("n_sink", 1.5), ("n_sink", True), ("k_head", 0), ("k_head", -64),
    ("k_head", 2048.0), ("min_context", -1), ("cooldown", -1), ("min_gap", -1), ("refresh_interval", 0),
    ("fixed_period", 0), ("n_prefill_queries", 0), ("nms_window", 0), ("policy", "nope"), ("selector", "nope"),
    ("alpha", 0), ("alpha", float("nan")), ("alpha", float("inf")), ("gamma", float("nan")), ("w_l2", -1.0),
    ("w_pos", -0.1), ("pos_power", 0), ("nms_strength", -1), ("cross_head_alpha", -0.5),
    ("lambda_clip_single", 1.5), ("lambda_clip_multi", -0.1), ("cross_head_temperature", 0),
    ("sentence_offset", -1), ("warmup_refresh", -1), ("confidence_floor", 1.5), ("confidence_floor", -0.1),
    ("fused_ops", 1), ("fa_evidence", "on"), ("keep_graphs", 0), ("device_selector", 1),
])
def test_invalid_values_raise_naming_the_parameter(field, value):
    owner = "SFIConfig" if field in {f.name for f in dataclasses.fields(SFIConfig)} else r"\w+Params"
    with pytest.raises(ValueError, match=rf"^{owner}\.{field}="):
        SFIConfig(**{field: value})


def test_validate_rechecks_a_modified_config():
    c = SFIConfig()
    c.validate()
    object.__setattr__(c, "n_recent", -1)  # bypassing the frozen dataclass
    with pytest.raises(ValueError, match="n_recent"):
        c.validate()


def test_replace_validates_and_refuses_unknown_names():
    c = SFIConfig().replace(policy="fixed", fixed_period=32)
    assert (c.policy, c.policy_params) == ("fixed", FixedParams(fixed_period=32))
    with pytest.raises(ValueError, match="min_gap"):
        c.replace(min_gap=-3)
    with pytest.raises(ValueError, match="no parameter k_heads"):
        c.replace(k_heads=5)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.n_sink = 8
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.policy_params.fixed_period = 8
    # the same policy keeps its parameters; a new one starts from its defaults
    assert c.replace(k_head=64).policy_params.fixed_period == 32
    assert c.replace(policy="punctuation").policy_params == PunctuationParams()
    assert c.replace(fixed_period=8) == SFIConfig(policy="fixed", fixed_period=8)
    tuned = SFIConfig(alpha=0.25, pool_window=5)
    assert tuned.replace(n_recent=64).selector_params == SFISelectorParams(alpha=0.25, pool_window=5)
    assert tuned.replace(selector="topk_mass").selector_params == TopKMassParams()
    assert dataclasses.replace(tuned, device_selector=True).selector_params is tuned.selector_params


def test_flat_keywords_route_into_the_params_of_the_named_policy_and_selector():
    c = SFIConfig(policy="punctuation", min_gap=8, refresh_interval=32, selector="sfi", nms_strength=1.0)
    assert c.policy_params == PunctuationParams(min_gap=8, refresh_interval=32)
    assert c.selector_params == SFISelectorParams(nms_strength=1.0)
    assert SFIConfig(policy="fixed", fixed_period=8).policy_params == FixedParams(8)
    assert SFIConfig(selector="topk_mass", pool_window=9).selector_params == TopKMassParams(9)
    # None: the parameter's default (the CLI and old callers pass pool_window=None)
    assert SFIConfig(pool_window=None) == SFIConfig() and SFIConfig(selector="topk_mass", pool_window=None) == \
        SFIConfig(selector="topk_mass")
    # a nested object or a dict of its fields, with flat keywords on top
    assert SFIConfig(policy_params=PunctuationParams(cooldown=1), min_gap=4).policy_params == \
        PunctuationParams(cooldown=1, min_gap=4)
    assert SFIConfig(policy="fixed", policy_params={"fixed_period": 3}) == SFIConfig(policy="fixed", fixed_period=3)
    # another registered policy's parameter: checked, then without effect (the fixed policy reads no T_max)
    assert SFIConfig(policy="fixed", refresh_interval=32) == SFIConfig(policy="fixed")
    assert SFIConfig(policy="static", fixed_period=8, nms_window=4, selector="topk_mass").overrides() == \
        {"policy": "static", "selector": "topk_mass"}
    with pytest.raises(ValueError, match=r"^PunctuationParams\.refresh_interval=0"):
        SFIConfig(policy="fixed", refresh_interval=0)


def test_unknown_and_misplaced_parameters_raise_clearly():
    with pytest.raises(ValueError, match=r"unknown SFIConfig field or parameter 'refresh_intervall'.*known: .*refresh_interval"):
        SFIConfig(refresh_intervall=32)
    with pytest.raises(ValueError, match=r"SFIConfig\.policy_params: FixedParams has no parameter period"):
        SFIConfig(policy="fixed", policy_params={"period": 3})
    with pytest.raises(ValueError, match=r"SFIConfig\.policy_params=.*must be a FixedParams"):
        SFIConfig(policy="fixed", policy_params=PunctuationParams())
    with pytest.raises(ValueError, match=r"SFIConfig\.selector_params=.*must be a TopKMassParams"):
        SFIConfig(selector="topk_mass", selector_params=SFISelectorParams())
    with pytest.raises(ValueError, match=r"SFIConfig\.policy='nope'"):
        SFIConfig(policy="nope", min_gap=3)
    with pytest.raises(TypeError):
        PunctuationParams(period=3)


def test_overrides_name_what_differs_from_the_defaults():
    assert SFIConfig().overrides() == {}
    assert SFIConfig(k_head=64, confidence_floor=0.0, alpha=0.25).overrides() == \
        {"k_head": 64, "confidence_floor": 0.0, "alpha": 0.25}
    assert SFIConfig(policy="fixed", fixed_period=8).overrides() == {"policy": "fixed", "fixed_period": 8}
    c = SFIConfig(policy="fixed", fixed_period=8, n_recent=32, nms_strength=1.0)
    assert SFIConfig(**c.overrides()) == c  # keywords that rebuild the config


def test_each_policy_and_selector_owns_one_params_dataclass_with_its_defaults():
    for registry, base in ((POLICIES, PolicyParams), (SELECTORS, SelectorParams)):
        for name, cls in registry.items():
            assert issubclass(cls.Params, base) and dataclasses.is_dataclass(cls.Params), name
            assert cls.Params.__dataclass_params__.frozen, name
            defaults = cls.Params()
            defaults.validate()
            field = "policy" if registry is POLICIES else "selector"
            assert getattr(SFIConfig(**{field: name}), f"{field}_params") == defaults
    # a parameter name means one thing: never a field of SFIConfig itself
    config_fields = {f.name for f in dataclasses.fields(SFIConfig)}
    assert not config_fields & set(parameter_owners())
    assert parameter_owners()["pool_window"] == [SFISelectorParams, TopKMassParams]
    assert issubclass(PolicyParams, Params)


def test_dense_is_a_registered_policy():
    assert SFIConfig(policy="dense").dense and not SFIConfig().dense
    assert [name for name in POLICIES if SFIConfig(policy=name).dense] == ["dense"]


def test_every_registered_policy_and_selector_name_is_valid():
    assert set(POLICIES) == {"punctuation", "fixed", "static", "sink_recent", "dense"}
    assert set(SELECTORS) >= {"sfi", "topk_mass"}
    for name in POLICIES:
        assert SFIConfig(policy=name).policy == name
    for name in SELECTORS:
        assert SFIConfig(selector=name).selector == name


def test_a_plan_resolves_the_config_once_into_immutable_parts():
    """The plan holds the budget, the policy and Selector with their parameters, the execution options and the
    native parameters; a switch left None takes the library's default (the environment's override included)."""
    config = SFIConfig(k_head=128, n_recent=64, min_context=0, policy="fixed", fixed_period=8, device_selector=True,
                       selection_delay=2, keep_graphs=False)
    plan = resolve_plan(config, 4096, native_defaults={"fused_ops": False, "keep_graphs": True, "fa_evidence": 1})
    assert plan.budget == Budget(n_sink=4, k_head=128, n_recent=64)
    assert plan.policy is POLICIES["fixed"] and plan.policy_params == FixedParams(fixed_period=8)
    assert plan.make_policy(None).period == 8 and plan.make_policy(None) is not plan.make_policy(None)
    assert plan.selector is SELECTORS["sfi"] and plan.selector_params == SFISelectorParams()
    assert plan.options == ExecOptions(min_context=0, device_selector=True, selection_delay=2)
    tail = 256  # the fixed policy has no T_max: the floor
    assert plan.native == NativeParams(n_sel_max=4 + 128 + 64 + 2 + tail + 1, n_tail_max=tail, n_query_rows=16,
                                       evidence_alpha=0.5, fused_ops=False, keep_graphs=False, fa_evidence=1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.options.selection_delay = 0
    assert not plan.stays_dense(10) and plan.n_candidates_at(4096) == 512 and plan.n_candidates_at(1000) == 0
    # the defaults of a plain config: the budget scaled to the context, the switches the library's
    plan = resolve_plan(SFIConfig(fa_evidence=False), 8192, native_defaults={"fused_ops": True, "keep_graphs": True,
                                                                              "fa_evidence": 1})
    assert plan.budget.k_head_at(8192) == 2048 and plan.budget.k_head_at(2048) == 512
    assert (plan.native.fused_ops, plan.native.keep_graphs, plan.native.fa_evidence) == (True, True, 0)
    assert plan.stays_dense(CPU_MIN_CONTEXT - 1) and not plan.stays_dense(CPU_MIN_CONTEXT)  # the CPU's default
    assert resolve_plan(SFIConfig(k_head=64), 8192).stays_dense(323)  # an explicit budget: sink + k_head + recent
    assert not resolve_plan(SFIConfig(k_head=64), 8192).stays_dense(324)
    # layers on a GPU: the Selector in the slow step's graph, SFI from a longer context (per sequence in a batch)
    gpu = resolve_plan(SFIConfig(), 65536, offloaded=True)
    assert gpu.options.device_selector and gpu.options.min_context == GPU_MIN_CONTEXT
    assert resolve_plan(SFIConfig(), 65536, offloaded=True, batched=True).options.min_context == GPU_BATCHED_MIN_CONTEXT
    assert not resolve_plan(SFIConfig(device_selector=False), 65536, offloaded=True).options.device_selector
    # the cache in host memory: refreshes off the decoding thread unless the config says otherwise
    assert not gpu.options.async_refresh
    assert resolve_plan(SFIConfig(), 65536, offloaded=True, kv_on_host=True).options.async_refresh
    for config in (SFIConfig(async_refresh=False), SFIConfig(redecode_tail=True)):
        assert not resolve_plan(config, 65536, offloaded=True, kv_on_host=True).options.async_refresh
    # sink + recent only spends the selection's budget on the recent window; dense has no native state
    assert resolve_plan(SFIConfig(policy="sink_recent", k_head=64), 4096).budget.recent_at(4096) == 256 + 64
    assert resolve_plan(SFIConfig(policy="dense"), 4096).native is None


def test_the_graph_switches_are_config_fields_in_its_overrides():
    assert SFIConfig().overrides() == {}
    assert SFIConfig(fused_ops=False, fa_evidence=True).overrides() == {"fused_ops": False, "fa_evidence": True}
