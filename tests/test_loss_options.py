"""TRL's loss options (`GRPOConfig` fields) on every trainer: each one either acts on the objective or is refused at
config time, as the table in docs/trainers/index.md says (the table is read and every cell checked); and the options
the sequence-level trainers and LFPO honour (`mask_truncated_completions`, `delta`, `off_policy_mask_threshold`) do
what TRL's do, checked against computations written here on one rollout batch of the tiny LLaDA (CPU).
"""

import math
import pathlib
import re

import pytest
import torch
from trl import GRPOConfig

from trl_diffusion.trainer import (
    BGPOConfig,
    BGPOTrainer,
    DiffuGRPOConfig,
    ESPOConfig,
    ESPOTrainer,
    LFPOConfig,
    LFPOTrainer,
    VRPOConfig,
    VRPOTrainer,
    WD1Config,
)

from helpers import gradients, rollout_batch, select_rows, tiny_grpo_config, tiny_trainer

INDEX = pathlib.Path(__file__).parent.parent / "docs" / "trainers" / "index.md"
COLUMNS = {
    "DiffuGRPO": DiffuGRPOConfig,
    "VRPO": VRPOConfig,
    "BGPO": BGPOConfig,
    "ESPO": ESPOConfig,
    "LFPO": LFPOConfig,
    "wd1": WD1Config,
}
# A value other than TRL's default for each field of the table (booleans are flipped from the config's default).
TEST_VALUES = {
    "beta": 0.04,
    "epsilon": 0.3,
    "epsilon_high": 0.3,
    "delta": 1.5,
    "off_policy_mask_threshold": 0.5,
    "loss_type": "grpo",
    "importance_sampling_level": "sequence",
    "top_entropy_quantile": 0.5,
    "entropy_coef": 0.01,
    "entropy_coef_min": 0.1,
    "entropy_coef_max": 0.5,
    "entropy_coef_delta": 0.01,
    "entropy_target": 1.0,
    "sapo_temperature_neg": 1.5,
    "sapo_temperature_pos": 1.5,
    "vespo_k_pos": 1.0,
    "vespo_lambda_pos": 1.0,
    "vespo_k_neg": 1.0,
    "vespo_lambda_neg": 1.0,
    "router_aux_loss_coef": 0.01,
    "num_iterations": 2,
    "steps_per_generation": 2,
    "scale_rewards": "batch",
    "reward_weights": [2.0],
    "multi_objective_aggregation": "normalize_then_sum",
    "ref_model_mixup_alpha": 0.5,
    "ref_model_sync_steps": 4,
}
# Every GRPOConfig field that TRL's `_compute_loss` (or the advantages it uses) reads: the table must cover them.
LOSS_FIELDS = {*TEST_VALUES, "mask_truncated_completions", "use_bias_correction_kl", "use_adaptive_entropy"}
LOSS_FIELDS |= {"sync_ref_model"}


def loss_option_table() -> dict[str, dict[str, str]]:
    """docs/trainers/index.md's table of TRL's loss options: field -> {trainer: cell}."""
    text = INDEX.read_text()
    section = re.split(r"\n##", text.split("### TRL's loss options, per trainer", 1)[1], maxsplit=1)[0]
    header, _, *rows = [line for line in section.splitlines() if line.startswith("|")]
    trainers = [cell.strip() for cell in header.strip("|").split("|")[1:]]
    table = {}
    for row in rows:
        cells = [cell.strip() for cell in row.strip("|").split("|")]
        for name in re.findall(r"`(\w+)`", cells[0]):
            table[name] = dict(zip(trainers, cells[1:]))
    return table


def make_config(config_class, tmp_path, **overrides):
    return tiny_grpo_config(config_class, tmp_path, **overrides)


def non_default(config_class, name, tmp_path):
    default = getattr(make_config(config_class, tmp_path), name)
    return (not default) if isinstance(default, bool) else TEST_VALUES[name]


def test_the_table_covers_every_loss_option_and_trainer():
    table = loss_option_table()
    assert set(table) == LOSS_FIELDS, set(table) ^ LOSS_FIELDS
    assert all(set(cells) == set(COLUMNS) for cells in table.values())
    assert LOSS_FIELDS <= set(GRPOConfig.__dataclass_fields__)


@pytest.mark.parametrize("trainer", list(COLUMNS))
def test_each_loss_option_acts_or_is_refused_as_documented(trainer, tmp_path):
    config_class = COLUMNS[trainer]
    checked = 0
    for name, cells in loss_option_table().items():
        cell = cells[trainer]
        if cell == "—":
            continue
        value = non_default(config_class, name, tmp_path)
        requires_clip = "with `clip_sequence_ratio=True`" in cell
        if cell.startswith("refused") or requires_clip:
            with pytest.raises(ValueError, match=re.escape(f"`{name}=")) as error:
                make_config(config_class, tmp_path, **{name: value})
            assert "clip_sequence_ratio" in str(error.value) if requires_clip else True
        if cell.startswith("✓"):
            config = make_config(
                config_class, tmp_path, **{name: value}, **({"clip_sequence_ratio": True} if requires_clip else {})
            )
            assert getattr(config, name) == value
        checked += 1
    assert checked >= 12


# ---------------------------------------------------------------------------------------------- honoured options

TRAINERS = {
    "vrpo": (VRPOConfig, VRPOTrainer, dict(num_mc_samples=2)),
    "bgpo": (BGPOConfig, BGPOTrainer, dict(num_mc_samples=2)),
    "espo": (ESPOConfig, ESPOTrainer, dict(num_mc_samples=1)),
    "lfpo": (LFPOConfig, LFPOTrainer, dict(lfpo_num_states=2, lfpo_group_size=4)),
}


def loss_and_gradients(trainer, inputs):
    trainer.model.zero_grad()
    loss = trainer._compute_loss(trainer.model, inputs)
    loss.backward()
    return loss.detach(), gradients(trainer.model)


@pytest.mark.parametrize("name", list(TRAINERS))
def test_truncated_completions_are_left_out_of_the_loss(name, tiny_llada_dir, tmp_path):
    """`mask_truncated_completions=True`: TRL zeroes the completion mask of a completion with no terminator, and the
    loss (KL included) is that of the other completions alone, scaled by their share of the micro-batch."""
    config_class, trainer_class, options = TRAINERS[name]
    beta = 0.0 if name == "lfpo" else 0.04
    args = tiny_grpo_config(config_class, tmp_path, mask_truncated_completions=True, beta=beta, **options)
    trainer = tiny_trainer(trainer_class, tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    terminated = torch.isin(inputs["completion_canvas"], torch.tensor(trainer.eos_token_ids)).any(dim=1)
    kept = inputs["completion_mask"].any(dim=1)
    assert torch.equal(kept, terminated) and 0 < kept.sum() < len(kept)
    inputs["advantages"] = torch.linspace(-1.5, 2.0, len(kept))  # every row would move the policy

    loss, grads = loss_and_gradients(trainer, inputs)
    trainer.args.mask_truncated_completions = False
    rows = kept.nonzero().squeeze(1)
    expected_loss, expected_grads = loss_and_gradients(trainer, select_rows(inputs, rows))
    share = len(rows) / len(kept)
    print(f"\n[{name} mask_truncated_completions] kept {len(rows)} of {len(kept)}, loss {loss.item():.6g}")
    torch.testing.assert_close(loss, expected_loss * share, rtol=1e-5, atol=1e-7)
    assert grads.keys() == expected_grads.keys()
    for key, grad in expected_grads.items():
        torch.testing.assert_close(grads[key], grad * share, rtol=1e-4, atol=1e-7, msg=key)


@pytest.mark.parametrize("name", ["vrpo", "espo"])
def test_two_sided_clip_and_off_policy_mask_act_on_the_sequence_ratio(name, tiny_llada_dir, tmp_path):
    """Stored old terms shifted by hand give known sequence ratios rho = exp(d), d = (B_theta - B_old) / L. TRL's
    `delta` caps rho in the unclipped term, `min(min(rho, delta) A, clip(rho) A)`; `off_policy_mask_threshold` leaves
    out a completion with A < 0 and -d above it."""
    config_class, trainer_class, options = TRAINERS[name]
    args = tiny_grpo_config(config_class, tmp_path, beta=0.0, num_iterations=2, clip_sequence_ratio=True, **options)
    trainer = tiny_trainer(trainer_class, tiny_llada_dir, args)
    inputs = rollout_batch(trainer)
    length = args.max_completion_length
    d = torch.tensor([0.9, 0.9, 0.5, -0.5, -0.9, -0.9, 0.1, -0.1])
    advantages = torch.tensor([-1.0, 1.0, -2.0, -1.0, -1.5, 1.0, 0.5, -0.5])
    inputs["advantages"] = advantages
    # Before any update the stored old terms are the current ones (same masks): B_old = B_theta - L d.
    inputs["old_elbo_terms"] = inputs["old_elbo_terms"] - (length * d)[:, None, None]
    rho = d.exp()
    clipped = rho.clamp(1 - args.epsilon, 1 + args.epsilon) * advantages

    def loss_with(**settings):
        for key, value in settings.items():
            setattr(trainer.args, key, value)
        with torch.no_grad():
            return trainer._compute_loss(trainer.model, inputs).item()

    figures = {}
    for delta, threshold in ((None, None), (1.5, None), (None, 0.3), (1.5, 0.3)):
        unclipped = (rho if delta is None else rho.clamp(max=delta)) * advantages
        kept = torch.ones_like(d) if threshold is None else ((advantages >= 0) | (-d <= threshold)).float()
        expected = (-torch.minimum(unclipped, clipped) * kept).mean().item()
        figures[(delta, threshold)] = loss_with(delta=delta, off_policy_mask_threshold=threshold)
        assert figures[(delta, threshold)] == pytest.approx(expected, rel=1e-4, abs=1e-6), (delta, threshold)
    print(f"\n[{name} delta / off-policy mask] losses {figures}")
    assert len({round(v, 6) for v in figures.values()}) == 4  # each option changes the loss here
    assert all(math.isfinite(v) for v in figures.values())
