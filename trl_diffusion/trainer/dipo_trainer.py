from .dipo_config import DiPOConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .utils import trainer_example


@trainer_example('output_dir="sdar-dipo", max_completion_length=2048', model="JetLM/SDAR-8B-Chat")
class DiPOTrainer(TrajectoryRLTrainer, name="DiPO", tags=("dipo",), paper="2512.22234"):
    r"""DiPO (DiRL): GRPO on the sampler's own denoising steps with one ratio per step, and DAPO's dynamic sampling.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: only the defaults of [`DiPOConfig`]. With `tau_i(t)` the tokens
    step t of completion i committed, scored on the state `tau_i(1:t-1)` that went into the step (on a block-causal
    model, the block's state after the clean blocks before it), and the ratio of the whole step
    `rho_{i,t} = prod_{n in tau_i(t)} p_theta(y_n | tau_i(1:t-1)) / p_old(y_n | tau_i(1:t-1))`
    (the old log-probs recomputed by the training forward, the detached current policy on policy):
    `loss = -(1/sum_i |tau_i|) sum_{i,t} min(rho_{i,t} A_i, clip(rho_{i,t}, 1 - 0.2, 1 + 0.28) A_i)`,
    on batches of prompt groups whose rewards differ (dynamic sampling).
    """

    config_class = DiPOConfig
