import textwrap

from .trace_rl_config import TraceRLConfig
from .trajectory_trainer import TrajectoryRLTrainer


class TraceRLTrainer(TrajectoryRLTrainer):
    r"""TraceRL: PPO on the sampler's own trace, steps merged `transition_grouping` at a time.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: only the defaults of [`TraceRLConfig`] (shrinkage 8, k3 towards
    the old policy, per-transition token means, the pass-rate filter). Transition g, the steps `s*g .. s*g + s - 1`
    of a completion's trajectory, is scored on the canvas before its first step, its targets every token those steps
    committed:
    `loss = (1/#transitions) sum_(i, g) mean_{n in D_g} [-min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i) + 0.01 k3]`.

    Arguments are those of [`DiffusionRLTrainer`], with `args` a [`TraceRLConfig`].

    Example:

    ```python
    from trl_diffusion import TraceRLConfig, TraceRLTrainer

    trainer = TraceRLTrainer(
        model="GSAI-ML/LLaDA-8B-Instruct",
        reward_funcs=my_reward,
        args=TraceRLConfig(output_dir="llada-trace-rl", max_completion_length=256, block_length=32),
        train_dataset=dataset,
    )
    trainer.train()
    ```
    """

    config_class = TraceRLConfig
    _tag_names = ["trl", "trl-diffusion", "diffusion-lm", "trace-rl"]
    _name = "TraceRL"
    _paper = {
        "title": "Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models",
        "id": "2509.06949",
        "citation": textwrap.dedent("""\
            @article{wang2025tracerl,
                title        = {{Revolutionizing Reinforcement Learning Framework for Diffusion Large Language Models}},
                author       = {Yinjie Wang and Ling Yang and Bowen Li and Ye Tian and Ke Shen and Mengdi Wang},
                year         = 2025,
                eprint       = {arXiv:2509.06949},
            }"""),
    }
