"""Each default is written once: the policies' and selectors' Params dataclasses, the command line's
flags made from them, and the native library's defaults, which agree with them and are overridden
field by field through the C API."""
import argparse
import dataclasses

import pytest

from sfi_gguf import cli
from sfi_gguf.core.config import K_HEAD_LONG_CONTEXT, SFIConfig, parameter_owners
from sfi_gguf.core.params import Params, field_docs, field_help
from sfi_gguf.core.policy import POLICIES, PolicyParams, TriggerPolicy, make_policy, register_policy
from sfi_gguf.core.selector import SELECTORS, SFISelector, SFISelectorParams, TopKMassParams, make_selector

PARAM_CLASSES = list(dict.fromkeys(c.Params for c in [*POLICIES.values(), *SELECTORS.values()]))


def _parse(*argv, parser=None):
    if parser is None:
        parser = argparse.ArgumentParser()
        cli.add_sfi_args(parser)
    return parser.parse_args(list(argv))


def test_every_field_and_parameter_has_one_flag_whose_help_shows_its_default():
    parser = argparse.ArgumentParser()
    cli.add_sfi_args(parser)
    flags = {a.dest: a for a in parser._actions}
    fields = [f for f in dataclasses.fields(SFIConfig) if f.name not in ("policy_params", "selector_params")]
    for f in fields:
        assert f.name in flags, f.name
        if f.name not in ("policy", "selector"):
            assert flags[f.name].default is None  # left out: the field's default (see below)
    for params in PARAM_CLASSES:
        for f in dataclasses.fields(params):
            assert f.name in flags, (params, f.name)
            if f.default is not None and f.name in params.names() and params is parameter_owners()[f.name][0]:
                shown = f"{f.default:g}" if isinstance(f.default, float) else str(f.default)
                assert f"(default: {shown})" in flags[f.name].help, f.name
    assert flags["policy"].default == SFIConfig.policy and flags["selector"].default == SFIConfig.selector
    assert "topk_mass: 0" in flags["pool_window"].help  # one flag, the other owner's default named


def test_no_flags_give_the_default_config_and_flags_set_fields_and_parameters():
    assert cli.sfi_config_from_args(_parse()) == SFIConfig()
    assert cli.sfi_config_from_args(_parse("--dense")) is False
    config = cli.sfi_config_from_args(_parse("--k-head", "64", "--policy", "fixed", "--fixed-period", "8",
                                             "--selector", "topk_mass", "--pool-window", "5",
                                             "--device-selector", "off"))
    assert config == SFIConfig(k_head=64, policy="fixed", fixed_period=8, selector="topk_mass", pool_window=5,
                               device_selector=False)
    assert cli.sfi_config_from_args(_parse("--device-selector", "auto")).device_selector is None
    assert cli.sfi_config_from_args(_parse("--confidence-floor", "0", "--alpha", "0.25")) == \
        SFIConfig(confidence_floor=0.0, alpha=0.25)
    warnings = []
    config = cli.sfi_config_from_args(_parse("--policy", "fixed", "--refresh-interval", "8"), warn=warnings.append)
    assert config == SFIConfig(policy="fixed") and warnings == [
        "--refresh-interval has no effect with --policy fixed --selector sfi"]


def test_every_default_given_as_a_flag_changes_nothing():
    parser = argparse.ArgumentParser()
    cli.add_sfi_args(parser)
    for params, kind, name in [(c.Params, "policy", n) for n, c in POLICIES.items()] + \
                              [(c.Params, "selector", n) for n, c in SELECTORS.items()]:
        argv = [f"--{kind}", name]
        for f in dataclasses.fields(params):
            argv += [f"--{f.name.replace('_', '-')}", repr(f.default)]
        config = cli.sfi_config_from_args(parser.parse_args(argv))
        assert getattr(config, f"{kind}_params") == params(), name


def test_the_bench_flags_are_the_same_fields():
    from sfi_gguf.tools.bench import build_parser, config_overrides

    args = build_parser().parse_args([])
    assert cli.sfi_config_from_args(args) == SFIConfig() and config_overrides(cli.sfi_config_from_args(args)) == {}
    args = build_parser().parse_args(["--refresh-interval", "32", "--device-selector", "on", "--nms-strength", "1"])
    assert config_overrides(cli.sfi_config_from_args(args)) == {"refresh_interval": 32, "device_selector": True,
                                                              "nms_strength": 1.0}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--policy", "dense"])  # the bench compares SFI with dense itself


def test_field_docs_are_read_from_the_source():
    docs = field_docs(SFIConfig)
    assert docs["n_sink"].startswith("First cells of the context") and "policy_params" in docs
    assert field_docs(SFISelectorParams)["pool_window"].startswith("Max-pool the evidence")
    assert field_help(SFIConfig, "k_head") == ("Selected cells per layer and KV head (default: a quarter of the "
                                               "context, at most 2048, see `resolve_k_head`)")
    assert field_help(TopKMassParams, "pool_window").endswith("(default: 0)")
    for params in PARAM_CLASSES:
        for name in params.names():
            assert field_docs(params).get(name), (params, name)  # every parameter is documented


def test_registries_find_each_policy_and_selector_by_name_with_its_params():
    pieces = ["a", ".", " b"]
    for name, cls in POLICIES.items():
        policy = make_policy(SFIConfig(policy=name), pieces)
        assert type(policy) is cls and policy.name == name
        assert issubclass(cls.Params, PolicyParams)
    for name, cls in SELECTORS.items():
        selector = make_selector(SFIConfig(selector=name))
        assert type(selector) is cls and selector.name == name and selector.params == cls.Params()
    assert make_selector(SFIConfig(nms_strength=1.0)).params == SFISelectorParams(nms_strength=1.0)
    # keyword changes on top of the params object
    assert SFISelector(nms_strength=1.0, pool_window=0).params == SFISelectorParams(nms_strength=1.0, pool_window=0)
    assert SFISelector(SFISelectorParams(alpha=0.25), w_pos=0.0).params == SFISelectorParams(alpha=0.25, w_pos=0.0)
    with pytest.raises(TypeError):
        SFISelector(period=3)


def test_a_new_policy_with_params_is_valid_in_the_config_at_once():
    @dataclasses.dataclass(frozen=True)
    class EveryParams(PolicyParams):
        every: int = 5
        """Steps between slow steps."""

        def validate(self):
            self.need_int("every", 1)

    class EveryPolicy(TriggerPolicy):
        """Slow every `every` steps."""
        name = "every_test"
        Params = EveryParams

        def __init__(self, params):
            super().__init__()
            self.every = params.every

        @classmethod
        def from_params(cls, params, pieces):
            return cls(params)

        def _trigger(self, token):
            return "period" if self.steps_since_refresh >= self.every else None

    register_policy(EveryPolicy)
    try:
        config = SFIConfig(policy="every_test", every=3)
        assert config.policy_params == EveryParams(3) and make_policy(config).every == 3
        with pytest.raises(ValueError, match=r"^EveryParams\.every=0"):
            SFIConfig(policy="every_test", every=0)
        parser = argparse.ArgumentParser()
        cli.add_sfi_args(parser)
        assert cli.sfi_config_from_args(parser.parse_args(["--policy", "every_test", "--every", "7"])) == \
            SFIConfig(policy="every_test", every=7)
    finally:
        del POLICIES["every_test"]
    with pytest.raises(TypeError, match="PolicyParams"):
        register_policy(type("Bad", (EveryPolicy,), {"name": "bad_test", "Params": dict}))


def test_params_base_checks_and_overrides():
    assert SFISelectorParams().overrides() == {} and SFISelectorParams(alpha=1.0).overrides() == {"alpha": 1.0}
    with pytest.raises(ValueError, match=r"^SFISelectorParams\.alpha=0: must be a finite number > 0"):
        SFISelectorParams(alpha=0)
    with pytest.raises(ValueError, match=r"^SFISelectorParams\.lambda_clip_single=2: must be in \[0, 1\]"):
        SFISelectorParams(lambda_clip_single=2)
    with pytest.raises(ValueError, match=r"^SFISelectorParams\.gamma=inf: must be a finite number$"):
        SFISelectorParams(gamma=float("inf"))
    assert issubclass(SFISelectorParams, Params)


def test_the_native_defaults_are_the_python_defaults_and_every_field_is_passed():
    native = pytest.importorskip("sfi_gguf.core.bindings")
    c_selector = native._selector_default_params()
    c_defaults = {name: getattr(c_selector, name) for name, _ in native.llama_sfi_selector_params._fields_}
    config = SFIConfig()
    python = SFISelector().device_params(0, config.n_sink, config.n_recent).as_dict()
    # the Python side passes every field through the C API: the C defaults never decide
    assert set(python) == set(c_defaults)
    for name, value in python.items():
        assert c_defaults[name] == pytest.approx(value, rel=1e-6), name  # float32 in C
    c_params = native.default_params()
    assert c_params["evidence_alpha"] == SFISelectorParams.alpha == config.selector_params.evidence_alpha
    assert c_params["n_sel_max"] == K_HEAD_LONG_CONTEXT + config.n_sink + config.n_recent
    assert TopKMassParams().evidence_alpha == SFISelectorParams.alpha  # the export's alpha without an SFI Selector


def test_the_punctuation_policy_sizes_the_fast_step_tail_by_its_refresh_interval():
    """The native tail holds the tokens decoded since the last refresh (a full tail is refreshed cheaply):
    the punctuation policy's T_max sizes it; the other policies take the 256-cell floor."""
    assert SFIConfig(policy="punctuation", refresh_interval=300).policy_params.t_max == 300
    assert SFIConfig(policy="fixed", fixed_period=300).policy_params.t_max is None
    assert SFIConfig(policy="static").policy_params.t_max is None
