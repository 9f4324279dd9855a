from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, integer, number
from .base_config import DiffusionRLConfig, MeanFieldConfig, inherited_field
from .diffu_grpo_config import DiffuGRPOConfig


@dataclass
class IGPOConfig(DiffuGRPOConfig):
    r"""
    Configuration of [`IGPOTrainer`] (IGPO, inpainting-guided policy optimization). Every field of
    [`DiffuGRPOConfig`] applies (d1's mean-field log-probs and TRL's token-level GRPO loss), plus the hint settings.
    Defaults follow the IGPO public code's run script (`run_igpo.sh`) where it departs from d1: `epsilon=0.2`
    (`epsilon_high` stays None, so the clip is symmetric as in the script), `beta=0.01`, `p_mask_prompt=0.0` (the
    code masks only the completion), `temperature=1.2`. The recipe also uses `num_iterations=4`,
    `num_generations=8`, `learning_rate=5e-7`, `max_completion_length=256`, `block_length=32`, `diffusion_steps=128`,
    `max_grad_norm=0.2`, LoRA r=128, alpha=64 on a 4-bit base, after a length-aligned SFT stage (`docs/trainers/igpo.md`).

    Parameters:

        solution_column (`str`, *optional*, defaults to `"solution"`):
            The dataset column holding each prompt's reference solution (text, e.g. a reasoning trace ending in the
            answer). Its tokens are the hints; the trainer refuses a training dataset without it.
        success_threshold (`float`, *optional*, defaults to `1.0`):
            A completion counts as correct when its weighted reward is at least this. A group fails when all its
            completions are scored and none is correct.
        hint_ratio_min (`float`, *optional*, defaults to `0.2`):
            Lower end of the injection ratio: each hinted completion draws eta ~ U[hint_ratio_min, hint_ratio_max]
            and reveals that fraction of the solution's chunks.
        hint_ratio_max (`float`, *optional*, defaults to `0.6`):
            Upper end of the injection ratio.
        hint_chunk_min_tokens (`int`, *optional*, defaults to `5`):
            Smallest chunk of the solution, in tokens. The solution is cut into consecutive chunks of U{min..max}
            tokens; a last piece shorter than this is never a hint.
        hint_chunk_max_tokens (`int`, *optional*, defaults to `10`):
            Largest chunk of the solution, in tokens.
        max_hinted_replacements (`int`, *optional*, defaults to `4`):
            In a failed group, at most this many completions are replaced by correct hinted ones (the code's
            `max_replacements`; fewer when fewer hinted completions are correct), and never all of them: at most
            `num_generations - 1` (a group of correct completions only has no advantage again).
        hint_entropy_ratio (`float`, *optional*, defaults to `0.2`):
            Entropy filtering: of the hint tokens of a completion, only this top fraction by the rollout policy's
            entropy at their position (at least one) is in the loss; generated tokens are all kept. 1.0 keeps
            every hint token.
    """

    solution_column: str = field(
        default="solution",
        metadata={"help": "Dataset column with each prompt's reference solution (text); its tokens are the hints."},
    )
    success_threshold: float = field(
        default=1.0,
        metadata={"help": "A completion is correct when its weighted reward is at least this."},
    )
    hint_ratio_min: float = field(
        default=0.2,
        metadata={"help": "Lower end of the injection ratio eta ~ U[min, max]: the fraction of chunks revealed."},
    )
    hint_ratio_max: float = field(
        default=0.6,
        metadata={"help": "Upper end of the injection ratio eta ~ U[min, max]: the fraction of chunks revealed."},
    )
    hint_chunk_min_tokens: int = field(
        default=5,
        metadata={"help": "Smallest chunk of the solution in tokens (a shorter last piece is never a hint)."},
    )
    hint_chunk_max_tokens: int = field(default=10, metadata={"help": "Largest chunk of the solution in tokens."})
    max_hinted_replacements: int = field(
        default=4,
        metadata={"help": "At most this many completions of a failed group are replaced by correct hinted ones."},
    )
    hint_entropy_ratio: float = field(
        default=0.2,
        metadata={"help": "Top fraction (by entropy) of a completion's hint tokens kept in the loss; 1.0 keeps all."},
    )

    epsilon: float = inherited_field(DiffusionRLConfig, "epsilon", 0.2, "(IGPO code: 0.2.)")
    beta: float = inherited_field(DiffusionRLConfig, "beta", 0.01, "(IGPO code: 0.01, k3.)")
    p_mask_prompt: float = inherited_field(MeanFieldConfig, "p_mask_prompt", 0.0, "(IGPO code: 0.)")
    temperature: float = inherited_field(DiffusionRLConfig, "temperature", 1.2, "(IGPO code: 1.2.)")

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "success_threshold": number(note="the weighted reward of a correct completion"),
        "hint_ratio_min": number(0, 1, note="the fraction of the solution's chunks revealed"),
        "hint_ratio_max": number(0, 1, note="the fraction of the solution's chunks revealed"),
        "hint_chunk_min_tokens": integer(1),
        "hint_chunk_max_tokens": integer(1),
        "max_hinted_replacements": integer(1, note="completions of a failed group replaced by hinted ones"),
        "hint_entropy_ratio": number(0, 1, low_inclusive=False, note="1 keeps every hint token"),
    }

    def __post_init__(self):
        super().__post_init__()
        if self.hint_ratio_min > self.hint_ratio_max:
            raise ValueError(
                f"`hint_ratio_min` ({self.hint_ratio_min}) exceeds `hint_ratio_max` ({self.hint_ratio_max}): the "
                "injection ratio is drawn from U[hint_ratio_min, hint_ratio_max]."
            )
        if self.hint_chunk_min_tokens > self.hint_chunk_max_tokens:
            raise ValueError(
                f"`hint_chunk_min_tokens` ({self.hint_chunk_min_tokens}) exceeds `hint_chunk_max_tokens` "
                f"({self.hint_chunk_max_tokens})."
            )
