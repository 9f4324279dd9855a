from dataclasses import dataclass, field
from typing import ClassVar

from .base_config import DiffusionRLConfig, inherited_field


@dataclass
class CoupledGRPOConfig(DiffusionRLConfig):
    r"""
    Configuration of [`CoupledGRPOTrainer`] (DiffuCoder's coupled-GRPO). Every field of [`DiffusionRLConfig`] and
    TRL's `GRPOConfig` applies, with DiffuCoder's defaults where it departs from TRL's: `loss_type="bnpo"` (the token
    mean over the micro-batch, as DiffuCoder's `compute_loss` reduces), `epsilon=0.5`, `beta=0.01` (k3 KL to the
    reference), `use_bias_correction_kl=False`, `scale_rewards="none"` and `leave_one_out=True` (advantage: reward
    minus the mean of the other rewards of the group). DiffuCoder's recipe also uses `num_iterations=2`,
    `num_generations=10`, `max_completion_length=256`, `diffusion_steps=256`, `temperature=1.0`,
    `learning_rate=1e-6` (cosine to 10%), `weight_decay=0.1`, `max_grad_norm=0.2` and a reference model synced every
    64 steps (`sync_ref_model=True`, `ref_model_sync_steps=64`), full fine-tuning (`examples/coupled_grpo_code.py`).

    Parameters:

        coupled_full_view (`bool`, *optional*, defaults to `True`):
            Average each token's pair score with its log-prob under the fully masked completion, as DiffuCoder's
            code does (three forward views per completion); `False` scores the complementary pair alone (two views),
            as DiffuCoder's README describes.
        coupled_t_range (`tuple[float, float]`, *optional*, defaults to `(0.2, 0.8)`):
            `(low, high)`, `0 < low <= high < 1`: each row's timestep t of the pair is drawn from U(low, high) (per
            row, from its mask seed and the inner iteration).
    """

    coupled_full_view: bool = field(
        default=True,
        metadata={
            "help": "Average each token's complementary-pair score with its fully masked log-prob (DiffuCoder's "
            "code: three views); false scores the pair alone (two views)."
        },
    )
    coupled_t_range: list[float] = field(
        default_factory=lambda: [0.2, 0.8],
        metadata={"help": "Range (low high) of the uniform timestep t of each row's complementary pair of masks."},
    )
    loss_type: str = inherited_field(DiffusionRLConfig, "loss_type", "bnpo", "(DiffuCoder: the token mean, bnpo.)")
    epsilon: float = inherited_field(DiffusionRLConfig, "epsilon", 0.5, "(DiffuCoder: 0.5.)")
    beta: float = inherited_field(DiffusionRLConfig, "beta", 0.01, "(DiffuCoder: 0.01, k3.)")
    use_bias_correction_kl: bool = inherited_field(
        DiffusionRLConfig, "use_bias_correction_kl", False, "(DiffuCoder: no.)"
    )
    scale_rewards: str = inherited_field(DiffusionRLConfig, "scale_rewards", "none", "(DiffuCoder: none.)")
    leave_one_out: bool = inherited_field(DiffusionRLConfig, "leave_one_out", True, "(DiffuCoder: on.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        "router_aux_loss_coef": ((None,), "the coupled views compute no Mixture-of-Experts router loss"),
    }

    def __post_init__(self):
        super().__post_init__()
        t_range = tuple(float(value) for value in self.coupled_t_range)
        if len(t_range) != 2 or not 0.0 < t_range[0] <= t_range[1] < 1.0:
            raise ValueError(
                f"`coupled_t_range` must be two numbers (low, high) with 0 < low <= high < 1, got "
                f"{self.coupled_t_range}."
            )
        self.coupled_t_range = t_range
