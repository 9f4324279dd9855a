from dataclasses import dataclass, field
from typing import ClassVar

from ..generation import DiffusionGenerationConfig
from ..validation import FieldRule, integer
from .base_config import DiffusionRLConfig, inherited_field, refused_token_loss_fields, sampler_field


@dataclass
class MDPOConfig(DiffusionRLConfig):
    r"""
    Configuration of [`MDPOTrainer`] (MDPO, Masked Diffusion Policy Optimization, arXiv 2508.13148). Every field of
    [`DiffusionRLConfig`] (and so of TRL's `GRPOConfig`) applies. Defaults follow the training command of MDPO's
    README (`autonomousvision/mdpo`): `temperature=0.4`, `beta=0.02` (k2 KL towards the reference), `epsilon=0.2`,
    `learning_rate=7e-7`, `gradient_accumulation_steps=16`, `max_completion_length=512`, `block_length=512`,
    `diffusion_steps=128`, `max_prompt_length=320`, `sample_train_steps=8`, rollouts with running-confidence
    remasking scored at the sampling temperature (`running_confidence=True`, `tempered_confidence=True`, MDPO's RCR)
    and TRL's group z-score per step (`scale_rewards="group"`). `num_generations` stays TRL's: MDPO's code sets it
    to its number of GPUs (one completion per GPU).

    Parameters:

        sample_train_steps (`int`, *optional*, defaults to `8`):
            The denoising steps trained per rollout batch: the rewarded steps of largest `sum |A_t|` over the batch
            (every process's rows), the same steps for every completion. The README's command uses 8, the recipe
            file 16.
        reward_step_stride (`int`, *optional*, defaults to `1`):
            Reward the prediction of every this-many-th denoising step, counted back from the last (which is always
            rewarded): `1` rewards every step, as MDPO does, at one reward call per step and completion. The
            advantages are computed over the rewarded steps only, and only they can be trained.
        states_per_forward (`int`, *optional*, defaults to `8`):
            (completion, step) states per forward and backward: the loss is back-propagated chunk by chunk, so
            activation memory is that of one chunk (memory only: the loss is the same).

    Of TRL's loss options, `epsilon`, `epsilon_high`, `beta`, `use_bias_correction_kl` (off by default here, as in
    MDPO's code) and `mask_truncated_completions` act as in TRL, and `scale_rewards` scales each step's advantages
    (`group`: MDPO's; `batch`; `none`). Refused: TRL's token-level `loss_type`, `importance_sampling_level`, entropy
    options, `delta` and the `sapo_*` / `vespo_*` fields (MDPO's loss replaces them), `leave_one_out`,
    `multi_objective_aggregation="normalize_then_sum"`, `off_policy_mask_threshold` and `cfg_scale` (see
    `unsupported_fields`).
    """

    sample_train_steps: int = field(
        default=8,
        metadata={"help": "Denoising steps trained per rollout batch: those of largest sum |A_t| over the batch."},
    )
    reward_step_stride: int = field(
        default=1,
        metadata={
            "help": "Reward the prediction of every this-many-th step, counted back from the last (1: every step, "
            "MDPO's, one reward call per step and completion)."
        },
    )
    states_per_forward: int = field(
        default=8, metadata={"help": "(completion, step) states per forward and backward (memory only)."}
    )
    temperature: float = inherited_field(DiffusionRLConfig, "temperature", 0.4, "(MDPO: 0.4.)")
    beta: float = inherited_field(DiffusionRLConfig, "beta", 0.02, "(MDPO: 0.02, a k2 KL.)")
    learning_rate: float = inherited_field(DiffusionRLConfig, "learning_rate", 7e-7, "(MDPO: 7e-7.)")
    gradient_accumulation_steps: int = inherited_field(
        DiffusionRLConfig, "gradient_accumulation_steps", 16, "(MDPO: 16.)"
    )
    use_bias_correction_kl: bool = inherited_field(DiffusionRLConfig, "use_bias_correction_kl", False, "(MDPO: no.)")
    max_prompt_length: int | None = inherited_field(DiffusionRLConfig, "max_prompt_length", 320, "(MDPO: 320.)")
    block_length: int = sampler_field("block_length", default=512, note="(MDPO: 512, one block of the canvas.)")
    diffusion_steps: int | None = sampler_field("diffusion_steps", default=128, note="(MDPO: 128.)")
    running_confidence: bool = sampler_field("running_confidence", default=True, note="(MDPO: RCR rollouts.)")
    tempered_confidence: bool = sampler_field("tempered_confidence", default=True, note="(MDPO's code: tempered.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("MDPO's loss"),
        "delta": ((None,), "MDPO's loss clips with `epsilon` / `epsilon_high` only"),
        "off_policy_mask_threshold": ((None,), "MDPO's loss has no off-policy sequence mask"),
        "leave_one_out": ((False,), "MDPO's advantages are per-step group z-scores of its adv-v4 returns"),
        "multi_objective_aggregation": (
            ("sum_then_normalize",),
            "MDPO sums the weighted rewards of each step's prediction before its per-step normalization",
        ),
        "cfg_scale": (
            (0.0,),
            "the states are scored by the policy alone, and guided rollouts were drawn from another distribution",
        ),
        "edit_threshold": (
            (None,),
            "MDPO's per-step predictions are the masked positions' proposals, and token editing replaces committed "
            "tokens by proposals that no step's prediction records",
        ),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "sample_train_steps": integer(1, note="denoising steps trained per rollout batch"),
        "reward_step_stride": integer(1, note="1 rewards every step"),
        "states_per_forward": integer(1, note="(completion, step) states per forward and backward"),
    }

    def to_generation_config(self, adapter=None) -> DiffusionGenerationConfig:
        """The rollouts' sampler, recording every step's input, its prediction of the whole completion and the
        proposals' log-probabilities (three `(batch, L)` tensors per step): MDPO rewards and trains on them."""
        config = super().to_generation_config(adapter)
        config.record_predictions = True
        return config
