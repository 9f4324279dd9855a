import math

import torch

from .espo_config import ESPOConfig
from .utils import trainer_example
from .vrpo_trainer import VRPOTrainer


@trainer_example('output_dir="llada-espo", beta=1e-3', lora=True)
class ESPOTrainer(VRPOTrainer, name="ESPO", tags=("espo",), paper="2512.03759"):
    r"""ELBO-based Sequence-level Policy Optimization for masked diffusion language models.

    The whole completion is one action. With coupled (antithetic) Monte Carlo ELBOs `B` under masks shared by the
    current, old and reference policies, the loss of a completion is
    `-min(rho*A, clip(rho, 1-eps, 1+eps_high)*A) + beta * (B_theta - B_ref)^2 / (2L)`, `rho = exp((B_theta - B_old)/L)`,
    with leave-one-out advantages.

    This is [`VRPOTrainer`]'s sequence-ratio objective under ESPO's settings ([`ESPOConfig`]: coupled masks,
    clipping on, leave-one-out advantages, `num_iterations=8`): the only change w.r.t. `VRPOTrainer` is
    `sequence_kl`, which adds the k1 and k3 estimators for ablations (`kl_estimator`).
    """

    config_class = ESPOConfig

    def sequence_kl(self, elbo: torch.Tensor, ref_elbo: torch.Tensor) -> torch.Tensor:
        delta = elbo - ref_elbo
        length = self.args.max_completion_length
        if self.args.kl_estimator == "k1":
            return delta / length
        if self.args.kl_estimator == "k3":
            # exp(-delta) overflows its dtype beyond log(max) (about 88.7 nats in float32 and bfloat16), and an
            # infinite penalty has a NaN gradient: the exponent is capped just below, where the penalty keeps its
            # value there and only the linear part of its gradient. The hits are counted.
            max_exponent = math.floor(math.log(torch.finfo(delta.dtype).max))
            exponent = -delta
            hits = (exponent.detach() > max_exponent).float()
            mode = "train" if self.model.training else "eval"
            self._metrics[mode]["kl/k3_overflow_guard_hits"].append(self.accelerator.gather(hits).sum().item())
            return (torch.exp(exponent.clamp(max=max_exponent)) - 1 + delta) / length
        return super().sequence_kl(elbo, ref_elbo)
