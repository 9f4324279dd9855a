"""The TRL contract: every TRL (and transformers) private method the trainers override is listed in `TRL_CONTRACT`
with the signature it was checked against, and the TRL attributes they use exist. These fail loudly when TRL
changes under the package (the pin is `trl==1.16.*`)."""

import inspect
import types

import pytest
from trl import GRPOTrainer

from trl_diffusion.trainer import (
    BGPOConfig,
    BGPOTrainer,
    CoupledGRPOTrainer,
    DiffuGRPOTrainer,
    DiffusionRLTrainer,
    ESPOTrainer,
    JustGRPOTrainer,
    LFPOTrainer,
    TokenLossTrainer,
    VRPOTrainer,
    WD1Trainer,
    base_trainer,
)
from trl_diffusion.trainer.base_trainer import TRL_ATTRIBUTES, TRL_CONTRACT, TRLContractMixin, trl_contract_drift
from trl_diffusion.trainer.utils import FinishedRunMixin

from helpers import tiny_grpo_config, tiny_trainer

TRAINER_CLASSES = [
    TokenLossTrainer,
    DiffusionRLTrainer,
    DiffuGRPOTrainer,
    VRPOTrainer,
    BGPOTrainer,
    ESPOTrainer,
    LFPOTrainer,
    CoupledGRPOTrainer,
    WD1Trainer,
    JustGRPOTrainer,
]


def test_installed_trl_matches_the_recorded_signatures():
    assert trl_contract_drift() == {}


def test_a_changed_trl_signature_is_reported(monkeypatch):
    def renamed_parameter(self, prompt_batch):  # TRL renaming `prompts`
        return prompt_batch

    monkeypatch.setattr(GRPOTrainer, "_tokenize_prompts", renamed_parameter)
    assert trl_contract_drift() == {"_tokenize_prompts": (("self", "prompts"), ("self", "prompt_batch"))}


@pytest.mark.parametrize("trainer_class", TRAINER_CLASSES, ids=lambda cls: cls.__name__)
def test_every_override_of_a_trl_method_is_in_the_contract(trainer_class):
    """A trainer that starts overriding another private TRL method must record it (and its call order) in
    `TRL_CONTRACT` and `TRLContractMixin`'s docstring."""
    trl_methods = {name for cls in GRPOTrainer.__mro__ for name in vars(cls) if name.startswith("_")}
    overridden = {
        name
        for name, value in vars(trainer_class).items()
        if name in trl_methods and not name.startswith("__") and inspect.isfunction(value)
    }
    assert overridden <= set(TRL_CONTRACT), overridden - set(TRL_CONTRACT)


def test_the_mixin_overrides_exactly_the_recorded_methods():
    shared = {name for name in vars(TRLContractMixin) if name in TRL_CONTRACT}
    # `_compute_loss` is each algorithm's objective, not the mixin's; `_save_checkpoint` is LFPO's (its old policy);
    # `_run_epoch` is `FinishedRunMixin`'s, which the SFT trainer shares.
    assert shared == set(TRL_CONTRACT) - {"_compute_loss", "_save_checkpoint", "_run_epoch"}
    assert "_run_epoch" in vars(FinishedRunMixin)


def test_the_trl_attributes_the_trainers_use_exist(tiny_llada_dir, tmp_path):
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2))
    missing = [name for name in TRL_ATTRIBUTES if not hasattr(trainer, name)]
    assert missing == []


def test_the_contract_names_the_checked_versions():
    assert "TRL 1.16.0" in TRLContractMixin.__doc__ and "TRL 1.16.0" in inspect.getsource(base_trainer)


def test_the_old_names_of_the_base_still_resolve_with_a_warning():
    import trl_diffusion

    with pytest.warns(FutureWarning, match="`DiffusionGRPOTrainer` is renamed `DiffusionRLTrainer`"):
        assert trl_diffusion.DiffusionGRPOTrainer is DiffusionRLTrainer


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_the_piecewise_step_refuses_lomo(optim, tiny_llada_dir, tmp_path):
    """LOMO updates the weights inside each backward, so BGPO's one backward per Monte Carlo sample would step the
    optimiser once per sample."""
    args = tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2, optim=optim)
    with pytest.raises(ValueError, match="LOMO / AdaLOMO.*not supported by the trainers that back-propagate"):
        tiny_trainer(BGPOTrainer, tiny_llada_dir, args)


def test_the_piecewise_step_refuses_context_parallelism(tiny_llada_dir, tmp_path, monkeypatch):
    args = tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2)
    monkeypatch.setattr(args, "parallelism_config", types.SimpleNamespace(cp_enabled=True), raising=False)
    with pytest.raises(ValueError, match="context parallelism"):
        tiny_trainer(BGPOTrainer, tiny_llada_dir, args)
