"""One validation layer for every numeric and choice field of every config (issue 25): the rules a config class
declares (`field_rules`, its own and its bases') are checked at construction, and each bad value kind (NaN, inf,
out of range, a float or a bool for an int, an unknown choice) is refused with a `ValueError` naming the field.
"""

import dataclasses
import math
import re
import time

import pytest
from trl import DPOConfig, GRPOConfig, SFTConfig

import trl_diffusion
import trl_diffusion.trainer as trainer_module
from trl_diffusion.trainer.base_config import SAMPLER_FIELDS
from trl_diffusion.validation import FieldRule, field_rules_of

CONFIG_CLASSES = sorted(
    {
        value
        for module in (trainer_module, trl_diffusion)
        for name in dir(module)
        if isinstance(value := getattr(module, name), type)
        and issubclass(value, (GRPOConfig, SFTConfig, DPOConfig))
        and name == value.__name__  # not a deprecated alias
    },
    key=lambda config_class: config_class.__name__,
)
IDS = [config_class.__name__ for config_class in CONFIG_CLASSES]

# Numeric fields no rule covers, and who checks them instead.
NOT_IN_THE_LAYER = {
    "pad_to_multiple_of": "int, 'auto' or None: TRL resolves 'auto' and parses the string form itself",
    "torch_empty_cache_steps": "transformers refuses anything but a positive int, naming it",
    "pass_rate_range": "a pair: the trajectory config checks 0 <= low <= high <= 1",
    "coupled_t_range": "a pair: the coupled-GRPO config checks 0 < low <= high < 1",
}


def build(config_class, tmp_path, **overrides):
    return config_class(output_dir=str(tmp_path), use_cpu=True, bf16=False, report_to="none", **overrides)


def is_numeric(f: dataclasses.Field) -> bool:
    return bool(re.search(r"\b(int|float)\b", str(f.type)))  # `int`, `float | None`, `list[float]`, ...


def bad_values(rule: FieldRule) -> list:
    """A value of each kind the rule refuses."""
    if rule.kind == "choice":
        return ["bogus", 3]
    values = [math.nan, math.inf, -math.inf, True]
    valid = max(rule.low if rule.low is not None else 2, 2)
    values.append(float(valid) if rule.kind == "int" else "0.5")  # a float for an int, a string for a number
    if rule.low is not None:
        values.append(rule.low if not rule.low_inclusive else rule.low - 1)
        values.append(-1.0 if rule.kind == "float" else -1)  # negative
        values.append(0)  # zero
    if rule.high is not None:
        values.append(rule.high if not rule.high_inclusive else rule.high + 1)
    if not rule.optional:
        values.append(None)
    if rule.each:  # a list field: the same values as its elements too
        values += [[1.0, value] for value in values]
    return [value for value in values if not rule.accepts(value)]


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=IDS)
def test_every_numeric_field_has_one_owner(config_class):
    """Each numeric field is the layer's, the sampler's (checked by `DiffusionGenerationConfig` when the config
    builds it), `unsupported_fields`' (held at its default) or listed in `NOT_IN_THE_LAYER` with its checker; and
    every rule names a field of the class."""
    rules = field_rules_of(config_class)
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    assert set(rules) <= set(fields), set(rules) - set(fields)
    sampler = set(SAMPLER_FIELDS) if issubclass(config_class, GRPOConfig) else set()
    owned = set(rules) | sampler | set(config_class.unsupported_fields) | set(NOT_IN_THE_LAYER)
    unowned = {name for name, f in fields.items() if is_numeric(f) and name not in owned}
    assert not unowned, f"numeric fields of {config_class.__name__} without a rule: {sorted(unowned)}"


def test_the_sweep_covers_every_config_class():
    assert len(CONFIG_CLASSES) == 22 and trl_diffusion.DiffusionSFTConfig in CONFIG_CLASSES
    assert trl_diffusion.DiffusionDPOConfig in CONFIG_CLASSES


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=IDS)
def test_defaults_construct(config_class, tmp_path):
    config = build(config_class, tmp_path)
    for name, rule in field_rules_of(config_class).items():
        assert rule.accepts(getattr(config, name)), name


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=IDS)
def test_every_bad_value_of_every_field_is_refused_naming_it(config_class, tmp_path):
    """Every (field, bad value) pair: construction only, so the whole sweep of a class takes well under a second."""
    start, missed, checked = time.perf_counter(), [], 0
    for name, rule in field_rules_of(config_class).items():
        values = bad_values(rule)
        assert math.nan in values or rule.kind == "choice", name
        for value in values:
            checked += 1
            try:
                build(config_class, tmp_path, **{name: value})
            except ValueError as error:
                message = str(error)
                if f"`{name}`" not in message or repr(value) not in message:
                    missed.append(f"{name}={value!r}: {message}")
            else:
                missed.append(f"{name}={value!r} accepted")
    assert not missed, "\n".join(missed)
    assert checked > 50
    assert time.perf_counter() - start < 20


@pytest.mark.parametrize(
    "config_class", [c for c in CONFIG_CLASSES if issubclass(c, GRPOConfig)], ids=lambda c: c.__name__
)
def test_sampler_fields_are_refused_naming_them(config_class, tmp_path):
    """The sampler fields are the sampler's to check; it does so when the config is built."""
    for name, value in (
        ("temperature", math.nan),
        ("cfg_scale", math.inf),
        ("threshold", math.nan),
        ("eos_rejection_min", math.nan),
        ("block_length", 4.0),
        ("diffusion_steps", 8.0),
    ):
        with pytest.raises(ValueError, match=rf"`{name}\b"):
            build(config_class, tmp_path, **{name: value})


# Legitimate values at the edge of a range, each accepted wherever the class does not hold the field at a default.
EDGE_VALUES = {
    "beta": 0.0,  # no KL term
    "epsilon": 0,  # ESPO's Countdown recipe
    "epsilon_high": None,  # the same as epsilon
    "max_steps": -1,  # train for num_train_epochs
    "learning_rate": 0.0,
    "max_grad_norm": None,  # no clipping
    "warmup_steps": 0.5,  # a fraction of the run
    "scale_rewards": False,  # TRL's boolean spelling of "none"
    "entropy_coef": -0.01,  # entropy minimization
    "num_generations": 2,
    "max_prompt_length": None,
    "max_consecutive_failed_reward_steps": None,
    "mask_token_id": 0,
    "max_completion_length": None,  # SFT: the longest completion of each batch
    "lookahead_return_weight": 0.0,
    "pass_reward_threshold": -1.0,
    "ema_alpha": 0.0,  # a hard copy
    "eubo_beta": 1,
}


# Edge values legitimate only together with other fields: (class name, field) -> those fields' values.
EDGE_COMPANIONS = {
    # d-TreeRPO's completions are the leaves of its tree: 2 of them are a root with 2 children.
    ("TreeRPOConfig", "num_generations"): {"num_tree_samples": 2, "tree_contraction_factor": 1},
}


@pytest.mark.parametrize("config_class", CONFIG_CLASSES, ids=IDS)
def test_legitimate_edge_values_are_accepted(config_class, tmp_path):
    rules = field_rules_of(config_class)
    # The sequence-ELBO configs take a non-default clip range only with the clipped objective, which SPG refuses.
    clip_refused = "clip_sequence_ratio" in config_class.unsupported_fields
    clipped = (
        {"clip_sequence_ratio": True} if hasattr(config_class, "clip_sequence_ratio") and not clip_refused else {}
    )
    skipped = {"epsilon", "epsilon_high"} if clip_refused else set()
    checked = 0
    for name, value in EDGE_VALUES.items():
        if name in rules and name not in {*config_class.unsupported_fields, *skipped} and rules[name].accepts(value):
            companions = EDGE_COMPANIONS.get((config_class.__name__, name), {})
            config = build(config_class, tmp_path, **clipped, **companions, **{name: value})
            assert getattr(config, name) == ("none" if name == "scale_rewards" else value), name  # TRL maps False
            checked += 1
    assert checked >= 3


def test_messages_name_the_field_the_value_and_the_fix(tmp_path):
    config_class = trl_diffusion.DiffuGRPOConfig
    cases = {
        "beta": (math.nan, r"`beta` must be a finite number >= 0 \(0 disables the KL term\), got nan\."),
        "num_iterations": (0, r"`num_iterations` must be an integer >= 1 .*, got 0\."),
        "learning_rate": (math.nan, r"`learning_rate` must be a finite number >= 0"),
        "epsilon": (-0.1, r"`epsilon` must be a finite number >= 0"),
        "epsilon_high": (-0.1, r"`epsilon_high` must be a finite number >= 0, or None"),
        "per_device_train_batch_size": (4.0, r"got 4.0 \(float\): pass 4\."),
        "gradient_accumulation_steps": (True, r"got True \(bool\)"),
        "loss_type": ("dapoo", r"Unknown `loss_type` 'dapoo' \(did you mean 'dapo'.*choose one of 'grpo', "),
    }
    for name, (value, match) in cases.items():
        with pytest.raises(ValueError, match=match):
            build(config_class, tmp_path, **{name: value})
    with pytest.raises(ValueError, match=r"`transition_grouping` must be an integer >= 1 .*got 2.0 \(float\)"):
        build(trl_diffusion.TraceRLConfig, tmp_path, transition_grouping=2.0)
