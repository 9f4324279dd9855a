"""trl_diffusion: reinforcement learning from verifiable rewards for masked diffusion language models.

Importing the package makes the native models (`model_type` "llada", "Dream", "sdar", "sdar_moe", "llada2_moe")
known to the transformers Auto classes, so their published checkpoints load without `trust_remote_code`: they are
registered when transformers' Auto modules are imported (at once if they already are), so that importing the package
itself imports neither torch nor transformers. Everything else is imported on first use (`trl_diffusion.BGPOTrainer`
imports TRL's trainer then), so that `trl-diffusion --help` and scripts that only need the models do not pay for
TRL, PEFT and bitsandbytes.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import logging
import sys
from typing import TYPE_CHECKING

# Whichever of them is imported first, the registration follows it (`trl_diffusion.models` registers on import).
_AUTO_MODULES = frozenset({"transformers.models.auto.configuration_auto", "transformers.models.auto.modeling_auto"})


def _register_models() -> None:
    """Imports `trl_diffusion.models`, which registers the native models with the Auto classes; nothing when it is
    imported or being imported (it then registers them at its end)."""
    sys.meta_path[:] = [finder for finder in sys.meta_path if not isinstance(finder, _RegisterOnAutoImport)]
    if f"{__name__}.models" not in sys.modules:
        importlib.import_module(".models", __name__)


# The Auto modules running now under a `_RegisteringLoader`: transformers' `modeling_auto` imports
# `configuration_auto` halfway through its own run, and the models can only be registered once neither is unfinished.
_RUNNING_AUTO_MODULES: set[str] = set()


class _RegisteringLoader(importlib.abc.Loader):
    """The loader of a transformers Auto module, which registers the native models once the module has run (and no
    other Auto module is still running: the last one to finish registers)."""

    def __init__(self, loader: importlib.abc.Loader):
        self.loader = loader

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module) -> None:
        _RUNNING_AUTO_MODULES.add(module.__name__)
        try:
            self.loader.exec_module(module)
        finally:
            _RUNNING_AUTO_MODULES.discard(module.__name__)
        if not _RUNNING_AUTO_MODULES:
            _register_models()

    def __getattr__(self, name: str):  # get_source, get_resource_reader, ... of the wrapped loader
        return getattr(self.loader, name)


class _RegisterOnAutoImport(importlib.abc.MetaPathFinder):
    """Finds the transformers Auto modules with the other finders and wraps their loaders in [`_RegisteringLoader`]."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _AUTO_MODULES:
            return None
        for finder in sys.meta_path:
            spec = None if finder is self else getattr(finder, "find_spec", lambda *_: None)(fullname, path, target)
            if spec is not None:
                spec.loader = _RegisteringLoader(spec.loader)
                return spec
        return None


if _AUTO_MODULES & sys.modules.keys():
    _register_models()
else:
    sys.meta_path.insert(0, _RegisterOnAutoImport())


class _OptionalKernelsNotice(logging.Filter):
    """bitsandbytes (imported by PEFT, itself imported by transformers' Trainer) warns at import that the optional
    `kernels` package is missing, on every run; it then uses its own CPU kernels, so the line is noise."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "from kernels-community" not in record.getMessage()


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_OptionalKernelsNotice())

__version__ = "0.1.0.dev0"

# submodule -> the public names it defines (as TRL's and transformers' `_import_structure`)
_import_structure = {
    "evaluation": ["TaskEvaluationCallback", "evaluate_task"],
    "generation": ["DiffusionGenerationConfig", "DiffusionGenerationOutput", "cut_at_terminator", "generate"],
    "harness": ["DiffusionLM"],
    "likelihood": [
        "autoregressive_logprobs",
        "coupled_token_scores",
        "elbo_term",
        "elbo_terms",
        "eubo_token_mean",
        "exact_elbo",
        "exact_elbo_eps",
        "masked_token_logprobs",
        "mean_field_logprobs",
        "stacked_elbo_terms",
        "view_logprobs",
    ],
    "masking": [
        "MaskPlan",
        "completion_region",
        "length_normalizer",
        "new_mask_seeds",
        "sample_complementary_masks",
        "sample_masks",
    ],
    "models": ["DiffusionAdapter", "DreamConfig", "DreamModel", "LLaDAConfig", "LLaDAModelLM"],
    "plotting": ["load_log_history", "plot_log_history", "plot_training_curves"],
    "tasks": ["TASKS", "Task", "get_task"],
    "trainer": [
        "AGRPOConfig",
        "AGRPOTrainer",
        "BGPOConfig",
        "BGPOTrainer",
        "CJGRPOConfig",
        "CJGRPOTrainer",
        "CoupledGRPOConfig",
        "CoupledGRPOTrainer",
        "DiffuGRPOConfig",
        "DiffuGRPOTrainer",
        "DiffusionDPOConfig",
        "DiffusionDPOTrainer",
        "DiffusionRLConfig",
        "DiffusionRLTrainer",
        "DiffusionSFTConfig",
        "DiffusionSFTTrainer",
        "DiPOConfig",
        "DiPOTrainer",
        "EBPOConfig",
        "EBPOTrainer",
        "ESPOConfig",
        "ESPOTrainer",
        "IGPOConfig",
        "IGPOTrainer",
        "JustGRPOConfig",
        "JustGRPOTrainer",
        "LFPOConfig",
        "LFPOTrainer",
        "MDPOConfig",
        "MDPOTrainer",
        "SPGConfig",
        "SPGTrainer",
        "TraceRLConfig",
        "TraceRLTrainer",
        "TrajectoryRLConfig",
        "TrajectoryRLTrainer",
        "TreeRPOConfig",
        "TreeRPOTrainer",
        "VRPOConfig",
        "VRPOTrainer",
        "WD1Config",
        "WD1Trainer",
        "lfpo_inference_config",
    ],
}
_LAZY_IMPORTS = {name: module for module, names in _import_structure.items() for name in names}
__all__ = list(_LAZY_IMPORTS)


def __getattr__(name: str):
    if name in _LAZY_IMPORTS:
        value = getattr(importlib.import_module(f".{_LAZY_IMPORTS[name]}", __name__), name)
        globals()[name] = value  # later look-ups skip this function
        return value
    if importlib.util.find_spec(f"{__name__}.{name}") is not None:  # a submodule, as `trl_diffusion.trainer`
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


if TYPE_CHECKING:
    from .evaluation import TaskEvaluationCallback, evaluate_task
    from .generation import DiffusionGenerationConfig, DiffusionGenerationOutput, cut_at_terminator, generate
    from .harness import DiffusionLM
    from .likelihood import (
        autoregressive_logprobs,
        coupled_token_scores,
        elbo_term,
        elbo_terms,
        eubo_token_mean,
        exact_elbo,
        exact_elbo_eps,
        masked_token_logprobs,
        mean_field_logprobs,
        stacked_elbo_terms,
        view_logprobs,
    )
    from .masking import (
        MaskPlan,
        completion_region,
        length_normalizer,
        new_mask_seeds,
        sample_complementary_masks,
        sample_masks,
    )
    from .models import DiffusionAdapter, DreamConfig, DreamModel, LLaDAConfig, LLaDAModelLM
    from .plotting import load_log_history, plot_log_history, plot_training_curves
    from .tasks import TASKS, Task, get_task
    from .trainer import (
        AGRPOConfig,
        AGRPOTrainer,
        BGPOConfig,
        BGPOTrainer,
        CJGRPOConfig,
        CJGRPOTrainer,
        CoupledGRPOConfig,
        CoupledGRPOTrainer,
        DiffuGRPOConfig,
        DiffuGRPOTrainer,
        DiffusionDPOConfig,
        DiffusionDPOTrainer,
        DiffusionRLConfig,
        DiffusionRLTrainer,
        DiffusionSFTConfig,
        DiffusionSFTTrainer,
        DiPOConfig,
        DiPOTrainer,
        EBPOConfig,
        EBPOTrainer,
        ESPOConfig,
        ESPOTrainer,
        IGPOConfig,
        IGPOTrainer,
        JustGRPOConfig,
        JustGRPOTrainer,
        LFPOConfig,
        LFPOTrainer,
        MDPOConfig,
        MDPOTrainer,
        SPGConfig,
        SPGTrainer,
        TraceRLConfig,
        TraceRLTrainer,
        TrajectoryRLConfig,
        TrajectoryRLTrainer,
        TreeRPOConfig,
        TreeRPOTrainer,
        VRPOConfig,
        VRPOTrainer,
        WD1Config,
        WD1Trainer,
        lfpo_inference_config,
    )
