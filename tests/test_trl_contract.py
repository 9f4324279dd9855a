"""The upstream contract (`trl_diffusion.trainer.contract.CONTRACT`): every private name of TRL, transformers,
accelerate, lm-eval, torch and argparse that the package overrides, calls or reads is listed, holds for the installed
versions, and every trainer class overrides exactly the upstream methods listed for it. These fail loudly when an
upstream library changes under the package (the pin is `trl==1.16.*`)."""

import ast
import copy
import functools
import importlib
import inspect
import re
import types
from pathlib import Path

import pytest
import torch
import transformers
from trl import GRPOTrainer

import trl_diffusion
import trl_diffusion.trainer
from trl_diffusion.trainer import BGPOConfig, BGPOTrainer
from trl_diffusion.trainer.contract import ATTRIBUTE, CALL, CONTRACT, OVERRIDE, contract_drift, resolve

from helpers import tiny_grpo_config, tiny_trainer

PACKAGE = Path(trl_diffusion.__file__).parent
TRAINER_CLASSES = [
    value
    for name in trl_diffusion.trainer.__all__
    if isinstance(value := getattr(trl_diffusion.trainer, name), type) and issubclass(value, transformers.Trainer)
]
# Where upstream private names are defined that the package could reach: the modules of every upstream class in
# the MRO of a package class or of a contract owner, and the objects the trainers handle (the accelerator's state).
EXTRA_UPSTREAM_MODULES = ("accelerate.accelerator", "accelerate.state", "trl.trainer.utils")


# Private names of the package's own objects that an upstream module happens to define too (or documented
# functions with a leading underscore): not upstream names the package depends on.
COINCIDENCES = {
    "_active": "utils.memory's own tracker state",
    "_hooks": "utils.memory's own hook handles",
    "_lock": "the reward workers' and the memory tracker's own locks",
    "_release": "utils.memory's own method",
    "_replace": "the reward worker pool's own method",
    "_state": "the harness's PartialState",
    "_exit": "os._exit, documented for child processes",
}


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


@functools.cache
def package_modules() -> dict[str, ast.Module]:
    modules = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = ast.parse(path.read_text())
    return modules


@functools.cache
def class_sources(owner: str) -> tuple[str, ...]:
    return tuple(inspect.getsource(base) for base in resolve(owner).__mro__ if base is not object)


def private_names_used(tree: ast.Module) -> set[str]:
    """Private attributes read, written or called (`x._name`), and private methods defined in classes."""
    used = {node.attr for node in ast.walk(tree) if isinstance(node, ast.Attribute) and is_private(node.attr)}
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            used |= {item.name for item in node.body if isinstance(item, ast.FunctionDef) and is_private(item.name)}
    return used


def private_names_defined(tree: ast.Module) -> set[str]:
    """Private names a module defines: functions and methods, class attributes, `self._name = ...` assignments."""
    defined = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        targets = (
            node.targets
            if isinstance(node, ast.Assign)
            else [node.target]
            if isinstance(node, (ast.AnnAssign, ast.AugAssign))
            else []
        )
        for target in targets:
            if isinstance(target, ast.Name):
                defined.add(target.id)
            elif (
                isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) and target.value.id == "self"
            ):
                defined.add(target.attr)
    return {name for name in defined if is_private(name)}


def upstream_modules() -> set[str]:
    classes = [resolve(entry.owner) for entry in CONTRACT]
    for tree_name in package_modules():
        if tree_name.endswith("__main__"):  # runs the command line
            continue
        module = importlib.import_module(tree_name)
        classes += [value for value in vars(module).values() if isinstance(value, type)]
    names = set(EXTRA_UPSTREAM_MODULES)
    for cls in classes:
        names |= {
            base.__module__ for base in cls.__mro__ if not base.__module__.startswith(("trl_diffusion", "builtins"))
        }
    return names


def test_every_listed_method_keeps_its_parameters():
    assert contract_drift() == {}


def test_a_changed_upstream_signature_is_reported(monkeypatch):
    def renamed_parameter(self, prompt_batch):  # TRL renaming `prompts`
        return prompt_batch

    monkeypatch.setattr(GRPOTrainer, "_tokenize_prompts", renamed_parameter)
    assert contract_drift() == {"GRPOTrainer._tokenize_prompts": (("self", "prompts"), ("self", "prompt_batch"))}


@pytest.mark.parametrize(
    "entry", CONTRACT, ids=lambda entry: f"{entry.owner.partition(':')[2]}.{entry.name}-{entry.use}"
)
def test_every_entry_holds_for_the_installed_versions(entry):
    """The owner still defines the name (an instance attribute: some class of the owner's MRO assigns
    `self.NAME`), and its users use it: an override is defined by each listed class, a call or an attribute appears
    in each listed module (or package)."""
    owner = resolve(entry.owner)
    assert entry.use in (OVERRIDE, CALL, ATTRIBUTE)
    if entry.use == ATTRIBUTE and not hasattr(owner, entry.name):
        pattern = re.compile(rf"self\.{re.escape(entry.name)}\s*(:[^=\n]+)?=[^=]")
        assert any(pattern.search(source) for source in class_sources(entry.owner)), (
            f"{entry.owner} no longer sets {entry.name}"
        )
    else:
        assert hasattr(owner, entry.name), f"{entry.owner} has no {entry.name}"
    modules = package_modules()
    for user in entry.users:
        if entry.use == OVERRIDE:
            assert entry.name in vars(resolve(user)), f"{user} does not define {entry.name}"
        else:
            trees = [tree for name, tree in modules.items() if name == user or name.startswith(f"{user}.")]
            assert any(
                entry.name in private_names_used(tree)
                or any(isinstance(node, ast.Attribute) and node.attr == entry.name for node in ast.walk(tree))
                for tree in trees
            ), f"{user} does not use {entry.name}"


@pytest.mark.parametrize("trainer_class", TRAINER_CLASSES, ids=lambda cls: cls.__name__)
def test_every_trainer_overrides_exactly_the_listed_methods(trainer_class):
    """The upstream methods a trainer class (or a package class in its MRO) redefines are the contract's overrides
    for that class: a trainer that starts overriding another one must be listed, with its reason."""
    upstream = [base for base in trainer_class.__mro__ if not base.__module__.startswith("trl_diffusion")]
    upstream_methods = {name for base in upstream for name, value in vars(base).items() if callable(value)}
    own = [base for base in trainer_class.__mro__ if base.__module__.startswith("trl_diffusion")]
    overridden = {
        (f"{base.__module__}:{base.__qualname__}", name)
        for base in own
        for name, value in vars(base).items()
        if inspect.isfunction(value) and name in upstream_methods and (is_private(name) or name == "training_step")
    }
    listed = {
        (user, entry.name)
        for entry in CONTRACT
        if entry.use == OVERRIDE and any(base.__name__ == entry.owner.partition(":")[2] for base in upstream)
        for user in entry.users
        if resolve(user) in own
    }
    assert overridden == listed


def test_every_private_upstream_name_the_package_uses_is_listed():
    """A private name that the package's source uses (an attribute, or a method of one of its classes) and that an
    upstream module defines is in the contract, or is one of the package's own that shares the name
    (`COINCIDENCES`)."""
    modules = package_modules()
    used = set().union(*(private_names_used(tree) for tree in modules.values()))
    upstream = set()
    for name in upstream_modules():
        module = importlib.import_module(name)
        if getattr(module, "__file__", None) and module.__file__.endswith(".py"):  # built-in modules have no source
            upstream |= private_names_defined(ast.parse(inspect.getsource(module)))
    listed = {entry.name for entry in CONTRACT}
    unlisted = sorted((used & upstream) - listed - set(COINCIDENCES))
    assert unlisted == [], unlisted


def test_the_listed_attributes_exist_on_a_built_trainer(tiny_llada_dir, tmp_path):
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2))
    grpo_attributes = [entry.name for entry in CONTRACT if entry.use == ATTRIBUTE and "GRPOTrainer" in entry.owner]
    assert [name for name in grpo_attributes if not hasattr(trainer, name)] == []


@pytest.mark.parametrize("optim", ["lomo", "adalomo"])
def test_the_piecewise_step_refuses_lomo(optim, tiny_llada_dir, tmp_path):
    """LOMO updates the weights inside each backward, so BGPO's one backward per Monte Carlo sample would step the
    optimizer once per sample."""
    args = tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2, optim=optim)
    with pytest.raises(ValueError, match="LOMO / AdaLOMO.*not supported by the trainers that back-propagate"):
        tiny_trainer(BGPOTrainer, tiny_llada_dir, args)


def test_the_piecewise_step_refuses_context_parallelism(tiny_llada_dir, tmp_path, monkeypatch):
    args = tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2)
    monkeypatch.setattr(args, "parallelism_config", types.SimpleNamespace(cp_enabled=True), raising=False)
    with pytest.raises(ValueError, match="context parallelism"):
        tiny_trainer(BGPOTrainer, tiny_llada_dir, args)


@pytest.mark.parametrize("peft", [False, True], ids=["full", "lora"])
def test_the_callers_model_leaves_the_trainer_unpatched(peft, tiny_llada, tiny_tokenizer, tmp_path):
    """TRL's trainers patch the model's `forward` with their fused autoregressive LM head, a closure over the
    original: undone, so that the caller's model is a plain module again and a deep copy of it trains its own
    weights (with the patch, it ran the original's and its gradients were 0)."""
    model = copy.deepcopy(tiny_llada)
    tiny_trainer(
        BGPOTrainer,
        model,
        tiny_grpo_config(BGPOConfig, tmp_path, num_mc_samples=2),
        peft=peft,
        processing_class=tiny_tokenizer,
    )
    assert [name for name, module in model.named_modules() if "forward" in module.__dict__] == []
    duplicate = copy.deepcopy(model)
    duplicate(input_ids=torch.tensor([[5, 6, 7]])).logits.sum().backward()
    assert all(p.grad is None for p in model.parameters())
