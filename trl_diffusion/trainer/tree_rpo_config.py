from dataclasses import dataclass, field
from typing import ClassVar

from ..validation import FieldRule, integer, number
from .base_config import DiffusionRLConfig, inherited_field, refused_token_loss_fields, sampler_field


@dataclass
class TreeRPOConfig(DiffusionRLConfig):
    r"""
    Configuration of [`TreeRPOTrainer`] (d-TreeRPO, arXiv 2512.09675). Every field of [`DiffusionRLConfig`] (and so
    of TRL's `GRPOConfig`) applies. Defaults follow d-TreeRPO's recipe (`THU-BPM/d-TreeRPO`,
    `dtreerpo/slurm_scripts/dtreerpo.yaml`): a tree of depth 2 branching at step S/2 (`tree_contraction_factor=2`), 4
    children of the root and 4 of each inner node (16 leaves, `num_generations=16`), `epsilon=0.4`, `beta=0.01` (k3
    towards the reference, `use_bias_correction_kl=False`), `num_iterations=12`, `learning_rate=3e-5`, `max_completion_length=256`,
    `max_prompt_length=200`, `block_length=32`, `diffusion_steps=128`, `temperature=0.9` (d1's default, which its
    config inherits), advantages without std (`scale_rewards="none"`, only what TRL logs) and the self-distillation
    term with its schedules. One micro-batch of 16 rows is one prompt's tree (`per_device_train_batch_size=16`); the
    recipe's 4 prompts per step are `gradient_accumulation_steps=4`.

    Parameters:

        tree_contraction_factor (`int`, *optional*, defaults to `2`):
            s: the tree has s levels of edges, its nodes sitting at steps `0, S/s, 2S/s, ..., S` (S =
            `diffusion_steps`). Every branch step must be a block boundary (a multiple of the steps per block): the
            tree is built by resuming rollouts from their canvas at the branch step, which reproduces a rollout only
            at a block boundary (each block's schedule is set when the block starts).
        num_tree_samples (`int`, *optional*, defaults to `4`):
            Children of the root (d-TreeRPO's `num_tree_samples`).
        tree_branch_factor (`int`, *optional*, defaults to `4`):
            Children of every inner node. `num_generations` must equal the leaves per prompt,
            `num_tree_samples * tree_branch_factor ** (tree_contraction_factor - 1)`.
        edges_per_forward (`int`, *optional*, defaults to `8`):
            Tree edges (one forward each, on the parent state) per forward and backward: the loss is back-propagated
            chunk by chunk (memory only: the loss is the same).
        self_distillation (`bool`, *optional*, defaults to `True`):
            Add d-TreeRPO's self-distillation term `lambda(t) KL(q || pi_theta(. | parent))`, q the softmax(A /
            tau(t))-weighted mixture of the positive-advantage children's tokens at each position.
        self_distillation_lambda_max (`float`, *optional*, defaults to `3e-3`):
            lambda_max of `lambda(t) = lambda_max (exp(gamma t / T) - 1) / (exp(gamma) - 1)`, t the optimizer step
            and T `max_steps` (0 at the first step).
        self_distillation_gamma (`float`, *optional*, defaults to `2.0`):
            gamma of lambda(t).
        self_distillation_tau_max (`float`, *optional*, defaults to `2.0`):
            tau_max of `tau(t) = tau_max (1 - t / T) ** tau_exponent`, the temperature of the children's weights
            (read at rollout time).
        self_distillation_tau_exponent (`float`, *optional*, defaults to `0.7`):
            The exponent of tau(t) (d-TreeRPO's `self_distillation_beta`).

    Of TRL's loss options, `epsilon`, `epsilon_high`, `beta`, `use_bias_correction_kl` and
    `mask_truncated_completions` act as in TRL. Refused: TRL's token-level `loss_type`, `importance_sampling_level`,
    entropy options, `delta` and the `sapo_*` / `vespo_*` fields (the edge loss replaces them), `leave_one_out` and
    `scale_rewards` other than `"none"` (the tree advantages replace TRL's), `cfg_scale`, and the sampler settings
    whose steps depend on the data or that remask committed tokens (`threshold`, `early_stop`,
    `running_confidence`, `edit_threshold`): a branch step would no longer be a fixed point of every rollout.
    """

    tree_contraction_factor: int = field(
        default=2,
        metadata={"help": "s: levels of edges; nodes at steps 0, S/s, ..., S (each branch step a block boundary)."},
    )
    num_tree_samples: int = field(default=4, metadata={"help": "Children of the root of each prompt's tree."})
    tree_branch_factor: int = field(default=4, metadata={"help": "Children of every inner node of the tree."})
    edges_per_forward: int = field(default=8, metadata={"help": "Tree edges per forward and backward (memory only)."})
    self_distillation: bool = field(
        default=True,
        metadata={"help": "Add the self-distillation KL towards the softmax(A/tau)-weighted positive children."},
    )
    self_distillation_lambda_max: float = field(
        default=3e-3, metadata={"help": "lambda_max of lambda(t) = lambda_max (e^{gamma t/T} - 1)/(e^gamma - 1)."}
    )
    self_distillation_gamma: float = field(default=2.0, metadata={"help": "gamma of lambda(t)."})
    self_distillation_tau_max: float = field(
        default=2.0, metadata={"help": "tau_max of tau(t) = tau_max (1 - t/T)^exponent."}
    )
    self_distillation_tau_exponent: float = field(default=0.7, metadata={"help": "The exponent of tau(t)."})
    num_generations: int | None = inherited_field(
        DiffusionRLConfig, "num_generations", 16, "(d-TreeRPO: the 16 leaves of a 4 x 4 tree.)"
    )
    per_device_train_batch_size: int = inherited_field(
        DiffusionRLConfig, "per_device_train_batch_size", 16, "(d-TreeRPO: one prompt's tree.)"
    )
    gradient_accumulation_steps: int = inherited_field(
        DiffusionRLConfig, "gradient_accumulation_steps", 4, "(d-TreeRPO: 4 prompts per step.)"
    )
    num_iterations: int = inherited_field(DiffusionRLConfig, "num_iterations", 12, "(d-TreeRPO: 12.)")
    epsilon: float = inherited_field(DiffusionRLConfig, "epsilon", 0.4, "(d-TreeRPO: 0.4.)")
    beta: float = inherited_field(DiffusionRLConfig, "beta", 0.01, "(d-TreeRPO: 0.01, k3.)")
    use_bias_correction_kl: bool = inherited_field(
        DiffusionRLConfig, "use_bias_correction_kl", False, "(d-TreeRPO: no.)"
    )
    learning_rate: float = inherited_field(DiffusionRLConfig, "learning_rate", 3e-5, "(d-TreeRPO: 3e-5, LoRA.)")
    scale_rewards: str = inherited_field(DiffusionRLConfig, "scale_rewards", "none", "(d-TreeRPO: no std.)")
    temperature: float = inherited_field(DiffusionRLConfig, "temperature", 0.9, "(d-TreeRPO: d1's 0.9.)")
    max_prompt_length: int | None = inherited_field(DiffusionRLConfig, "max_prompt_length", 200, "(d-TreeRPO: 200.)")
    max_completion_length: int | None = inherited_field(
        DiffusionRLConfig, "max_completion_length", 256, "(d-TreeRPO: 256.)"
    )
    diffusion_steps: int | None = sampler_field("diffusion_steps", default=128, note="(d-TreeRPO: 128.)")

    unsupported_fields: ClassVar[dict[str, tuple[tuple, str]]] = {
        **DiffusionRLConfig.unsupported_fields,
        **refused_token_loss_fields("d-TreeRPO's edge loss"),
        "delta": ((None,), "d-TreeRPO's loss clips with `epsilon` / `epsilon_high` only"),
        "off_policy_mask_threshold": ((None,), "d-TreeRPO's loss has no off-policy sequence mask"),
        "leave_one_out": ((False,), "d-TreeRPO's advantages are the tree's sibling baselines"),
        "scale_rewards": (("none",), "d-TreeRPO's tree advantages divide by no standard deviation"),
        "cfg_scale": ((0.0,), "the edges are scored by the policy alone"),
        "threshold": (
            (None,),
            "a tree branches at fixed steps, and threshold decoding makes the steps data-dependent",
        ),
        "early_stop": ((False,), "a tree branches at fixed steps, and an early stop makes them data-dependent"),
        "running_confidence": (
            (False,),
            "the tree's nodes are rebuilt from the commit steps, which remasking committed tokens breaks",
        ),
        "edit_threshold": (
            (None,),
            "the tree's nodes are rebuilt from the commit steps, which replacing committed tokens (editing) breaks",
        ),
    }

    field_rules: ClassVar[dict[str, FieldRule]] = {
        "tree_contraction_factor": integer(1, note="levels of edges of the tree"),
        "num_tree_samples": integer(2, note="children of the root (at least 2: a child's baseline is its siblings)"),
        "tree_branch_factor": integer(2, note="children of an inner node (at least 2: siblings are the baseline)"),
        "edges_per_forward": integer(1, note="tree edges per forward and backward"),
        "self_distillation_lambda_max": number(0, note="0 turns the term off"),
        "self_distillation_gamma": number(0, low_inclusive=False),
        "self_distillation_tau_max": number(0, low_inclusive=False),
        "self_distillation_tau_exponent": number(0),
    }

    def __post_init__(self):
        super().__post_init__()
        leaves = self.num_tree_samples * self.tree_branch_factor ** (self.tree_contraction_factor - 1)
        if self.num_generations != leaves:
            raise ValueError(
                f"`num_generations` ({self.num_generations}) must equal the leaves of each prompt's tree, "
                f"`num_tree_samples * tree_branch_factor ** (tree_contraction_factor - 1)` = {leaves}: set "
                f"`num_generations={leaves}`, or change the tree."
            )
        if self.num_generations_eval not in (None, self.num_generations):
            raise ValueError(
                f"`num_generations_eval` ({self.num_generations_eval}) must be None or `num_generations` "
                f"({self.num_generations}): evaluation rollouts are trees of the same shape."
            )
        sampler = self.to_generation_config()
        if sampler.num_blocks % self.tree_contraction_factor:
            raise ValueError(
                f"The tree branches every 1/{self.tree_contraction_factor} of the denoising steps, which must fall on "
                f"a block boundary (the children resume their parent's canvas, which reproduces a rollout only there), "
                f"so the number of blocks (`max_completion_length / block_length` = {sampler.num_blocks}) must be a "
                f"multiple of `tree_contraction_factor` ({self.tree_contraction_factor}): change `block_length` or "
                "`tree_contraction_factor`."
            )
