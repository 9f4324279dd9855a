import textwrap

from .cj_grpo_config import CJGRPOConfig
from .trajectory_trainer import TrajectoryRLTrainer


class CJGRPOTrainer(TrajectoryRLTrainer):
    r"""CJ-GRPO: GRPO on every transition the sampler made, so that the optimized trajectory is the rollout's.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: only the defaults of [`CJGRPOConfig`] (every step, Eq. 11, the
    k3 KL to the reference, and the ascending step-size schedule with EOS early rejection in the sampler). With
    `S_i` transitions in sample i and `D_{i,k}` the tokens its step k committed:
    `loss = (1/B) sum_i (1/S_i) sum_k mean_{n in D_{i,k}} [-min(rho_n A_i, clip(rho_n, 1 +- 0.5) A_i) + 0.04 k3]`.

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`CJGRPOConfig`].

    Example:

    ```python
    from trl_diffusion import CJGRPOConfig, CJGRPOTrainer

    trainer = CJGRPOTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=CJGRPOConfig(output_dir="llada-cj-grpo", max_completion_length=256, block_length=256),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = CJGRPOConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "cj-grpo"]
    _name = "CJGRPO"
    _paper = {
        "title": "Taming Masked Diffusion Language Models via Consistency Trajectory Reinforcement Learning with "
        "Fewer Decoding Step",
        "id": "2509.23924",
        "citation": textwrap.dedent("""\
            @article{yang2025cjgrpo,
                title        = {{Taming Masked Diffusion Language Models via Consistency Trajectory Reinforcement Learning with Fewer Decoding Step}},
                author       = {Jingyi Yang and Guanxu Chen and Xuhao Hu and Jing Shao},
                year         = 2025,
                eprint       = {arXiv:2509.23924},
            }"""),
    }
