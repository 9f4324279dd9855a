from .trace_rl_config import TraceRLConfig
from .trajectory_trainer import TrajectoryRLTrainer
from .utils import trainer_example


@trainer_example('output_dir="llada-trace-rl", max_completion_length=256, block_length=32')
class TraceRLTrainer(TrajectoryRLTrainer, name="TraceRL", tags=("trace-rl",), paper="2509.06949"):
    r"""TraceRL: PPO on the sampler's own trace, steps merged `transition_grouping` at a time.

    What it changes w.r.t. [`TrajectoryRLTrainer`]: only the defaults of [`TraceRLConfig`] (shrinkage 8, k3 towards
    the old policy, per-transition token means, the pass-rate filter). Transition g, the steps `s*g .. s*g + s - 1`
    of a completion's trajectory, is scored on the canvas before its first step, its targets every token those steps
    committed:
    `loss = (1/#transitions) sum_(i, g) mean_{n in D_g} [-min(rho_n A_i, clip(rho_n, 1 +- 0.2) A_i) + 0.01 k3]`.
    """

    config_class = TraceRLConfig
