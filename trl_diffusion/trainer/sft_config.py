"""Configuration of [`DiffusionSFTTrainer`]: TRL's `SFTConfig` plus the masked-diffusion loss and canvas settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from trl import SFTConfig

from ..validation import (
    TRAINING_ARGUMENTS_RULES,
    FieldRule,
    integer,
    number,
)
from .base_config import CheckedConfig, MaskTokenConfig


@dataclass
class DiffusionSFTConfig(MaskTokenConfig, CheckedConfig, SFTConfig):
    r"""
    Configuration of [`DiffusionSFTTrainer`]: completion-only supervised fine-tuning of a masked diffusion language
    model (LLaDA's SFT recipe, also d1's first stage). Every [`~trl.SFTConfig`] field keeps its meaning unless stated
    below; the fields TRL uses for autoregressive packing and token-level losses are refused (see the end).

    Each completion is laid out on a canvas `[prompt (left-padded) | completion, EOS, EOS, ...]`, exactly what the
    diffusion sampler produces: the completion (ending with its terminator: the EOS token appended to a plain-text
    completion, or the chat template's end of turn) is filled with EOS up to the canvas length, and the EOS fill is
    trained on too, so the model learns to end its answers and pad the rest of the canvas.

    Parameters that control the diffusion loss:

        mask_token_id (`int`, *optional*):
            Id of the mask token. Default: the model config's `mask_token_id`, then the tokenizer's, then the known
            value of the model family (LLaDA 126336, Dream 151666). A model with none is refused.
        timestep_eps (`float`, *optional*, defaults to `1e-3`):
            Smallest masking ratio: each completion draws `t ~ U(timestep_eps, 1)` (LLaDA's `p = (1 - eps) t + eps`),
            and its masked tokens are weighted `1 / t`, so `timestep_eps` bounds the weight by `1 / timestep_eps`.

    Parameters that control the canvas:

        max_completion_length (`int`, *optional*):
            Length L of the completion canvas: every completion is filled with EOS up to L tokens, the canvas length
            the sampler will use (its `max_completion_length`). A longer completion raises an error. `None` fills each
            batch up to its longest completion (LLaDA's SFT: pad the answers of a batch with EOS).
        max_prompt_length (`int`, *optional*):
            Prompts longer than this are truncated from the left (the end of a prompt, with the chat template's
            generation prompt, is what the completion follows). `None` keeps them whole.
        max_length (`int`, *optional*):
            Longest canvas (prompt plus completion canvas) allowed. Unlike TRL's SFT, nothing is truncated to it:
            cutting a completion would drop its terminator. A longer example raises an error at construction (set
            `max_prompt_length` or filter the dataset). `None` is the model's context length.

    Fields of [`~trl.SFTConfig`] that are refused: `packing` and `padding_free` (documents packed together would
    attend to each other through bidirectional attention, and the canvas needs one prompt per row),
    `assistant_only_loss` and `completion_only_loss=False` (the loss is always over the completion of a
    prompt-completion dataset), `loss_type` other than `"nll"` and `label_smoothing_factor` (token-level
    autoregressive losses), and `dataset_kwargs={"skip_prepare_dataset": True}` (pre-tokenized `prompt_ids` /
    `completion_ids` datasets are used as they are anyway), and `router_aux_loss_coef` other than `None` / `0.0` (the
    loss adds no Mixture-of-Experts load-balancing term: a MoE model's router logits are not requested).
    """

    timestep_eps: float = field(
        default=1e-3,
        metadata={"help": "Smallest masking ratio: t ~ U(timestep_eps, 1), masked tokens weighted 1/t."},
    )
    max_completion_length: int | None = field(
        default=None,
        metadata={
            "help": "Length of the completion canvas; completions are filled with EOS up to it and trained on the "
            "fill. None: the longest completion of each batch."
        },
    )
    max_prompt_length: int | None = field(
        default=None,
        metadata={"help": "Prompts longer than this are truncated from the left. None keeps them whole."},
    )
    completion_only_loss: bool | None = field(
        default=True,
        metadata={"help": "Always True: the loss masks and scores the completion only (False is refused)."},
    )
    max_length: int | None = field(
        default=None,
        metadata={
            "help": "Longest canvas (prompt plus completion canvas); a longer example raises an error (nothing is "
            "truncated). None: the model's context length."
        },
    )

    # Inherited fields the masked-diffusion SFT refuses: name -> (the values it accepts, why). The first value is the
    # default. `__post_init__` raises on any other value, and `trl-diffusion sft` offers no flag for them.
    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        "packing": ((False,), "packed documents would attend to each other through bidirectional attention"),
        "padding_free": ((False,), "the canvas holds one left-padded prompt and its completion per row"),
        "eval_packing": ((None, False), "packed documents would attend to each other through bidirectional attention"),
        "assistant_only_loss": ((False,), "the loss is over the completion of a prompt-completion dataset"),
        "completion_only_loss": (
            (True, None),
            "the loss masks and scores the completion only; the prompt is the condition, as in LLaDA's SFT",
        ),
        "loss_type": (("nll",), "the loss is the masked-diffusion cross-entropy weighted by 1/t"),
        "label_smoothing_factor": ((0.0,), "the masked-diffusion loss has no label smoothing"),
        "router_aux_loss_coef": (
            (None, 0.0),
            "the masked-diffusion loss adds no Mixture-of-Experts load-balancing term (the router is trained by the "
            "diffusion loss alone)",
        ),
    }

    # The trainer the refusal messages name.
    checked_for: ClassVar[str] = "DiffusionSFTTrainer"

    # Type and range of each numeric field: name -> rule, checked at the start of `__post_init__` (see
    # `DiffusionRLConfig.field_rules`). `loss_type` is `unsupported_fields`'.
    field_rules: ClassVar[dict[str, FieldRule]] = {
        **TRAINING_ARGUMENTS_RULES,
        "timestep_eps": number(0, 1, low_inclusive=False, high_inclusive=False, note="the smallest masking ratio"),
        "max_completion_length": integer(1, optional=True, note="None: the longest completion of each batch"),
        "max_prompt_length": integer(1, optional=True, note="None keeps prompts whole"),
        "max_length": integer(1, optional=True, note="None: the model's context length"),
        "dataset_num_proc": integer(1, optional=True),
    }

    def __post_init__(self):
        super().__post_init__()
        # TRL's `None` guesses from the dataset; the prompt must always be told apart from the completion.
        self.completion_only_loss = True
        if (self.dataset_kwargs or {}).get("skip_prepare_dataset"):
            raise ValueError(
                "`dataset_kwargs={'skip_prepare_dataset': True}` is not supported: a dataset that is already "
                "tokenized (`prompt_ids` and `completion_ids` columns) is used as it is without it, and preparation "
                "is where prompts are truncated and lengths checked."
            )
