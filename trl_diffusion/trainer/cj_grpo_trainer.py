from .cj_grpo_config import CJGRPOConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .utils import trainer_example


@trainer_example('output_dir="llada-cj-grpo", max_completion_length=256, block_length=256')
class CJGRPOTrainer(TrajectoryRLTrainer, name="CJGRPO", tags=("cj-grpo",), paper="2509.23924"):
    r"""CJ-GRPO: GRPO on every transition the sampler made, so that the optimized trajectory is the rollout's.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: only the defaults of [`CJGRPOConfig`] (every step, Eq. 11, the
    k3 KL to the reference, and the ascending step-size schedule with EOS early rejection in the sampler). With
    `S_i` transitions in sample i and `D_{i,k}` the tokens its step k committed:
    `loss = (1/B) sum_i (1/S_i) sum_k mean_{n in D_{i,k}} [-min(rho_n A_i, clip(rho_n, 1 +- 0.5) A_i) + 0.04 k3]`.
    """

    config_class = CJGRPOConfig
