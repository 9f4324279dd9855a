from dataclasses import dataclass

from .base_config import inherited_field, sampler_field
from .trajectory_config import TrajectoryRLConfig


@dataclass
class CJGRPOConfig(TrajectoryRLConfig):
    r"""
    Configuration of [`CJGRPOTrainer`] (CJ-GRPO, "Consistency Trajectory" GRPO). Every field of
    [`TrajectoryRLConfig`] (and so of [`DiffusionRLConfig`] and TRL's `GRPOConfig`) applies. Defaults follow
    CJ-GRPO's EOSER + ASS recipe: every denoising step replayed (the base's `transition_grouping=1`,
    `transition_selection="all"`), the paper's Eq. 11 reduction (`transition_reduction="sample"`: token mean per transition, mean over the
    sample's transitions, mean over samples; the code's pooling over the micro-batch is `"pooled"`), token-level PPO
    with `epsilon=0.5`, `beta=0.04` k3 towards the reference model, `scale_rewards="none"` (A = r - mean(r)),
    `temperature=1.0`, `learning_rate=3e-6`, and its two sampler options: the ascending step-size schedule
    (`schedule="ascending"`: step i of a block commits 2^i tokens, the last the rest, log2(block) steps per block by
    default) and EOS early rejection (`eos_rejection_min=0.01`, `eos_rejection_max=1.0`: terminator proposals'
    confidence scaled by gamma(t), rising from 0.01 to 1 over a block's steps). Both are sampler fields any trainer
    can use. The paper's recipe also uses a single block (`block_length = max_completion_length`, 256 tokens in 8
    steps), `num_generations=6`, `num_iterations=12` (8 for Countdown and Sudoku) and LoRA r=128, alpha=64
    (`examples/cj_grpo_sudoku.py`). CJ-GRPO's code trains the EOS fill after the answer; `elbo_region="canvas"` does
    too, the default `"answer"` stops at the first terminator.
    """

    epsilon: float = inherited_field(TrajectoryRLConfig, "epsilon", 0.5, "(CJ-GRPO: 0.5, on the token ratio.)")
    beta: float = inherited_field(TrajectoryRLConfig, "beta", 0.04, "(CJ-GRPO: 0.04, k3 towards the reference.)")
    scale_rewards: str = inherited_field(
        TrajectoryRLConfig, "scale_rewards", "none", "(CJ-GRPO: none, A = r - mean(r).)"
    )
    schedule: str = sampler_field("schedule", default="ascending", note="(CJ-GRPO: ascending, 2^i tokens at step i.)")
    eos_rejection_min: float | None = sampler_field(
        "eos_rejection_min", default=0.01, note="(CJ-GRPO's training: 0.01.)"
    )
    learning_rate: float = inherited_field(TrajectoryRLConfig, "learning_rate", 3e-6, "(CJ-GRPO: 3e-6.)")
