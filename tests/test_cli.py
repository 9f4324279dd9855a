"""Tests of the `trl-diffusion` command line, task evaluation and the example recipes, on a tiny native LLaDA (CPU).

Training runs are 1-2 steps on built-in procedural tasks with prompts truncated to a few tokens. One test launches
the console script, and one launches it through the `multi_gpu` accelerate preset with two CPU processes, and checks
that the two processes train exactly what one process trains on the same global batch.
"""

import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import socket
import subprocess
import sys
from functools import partial
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer
from trl import ModelConfig

from trl_diffusion import BGPOConfig, BGPOTrainer, DiffusionGenerationConfig
from trl_diffusion import cli as cli_module
from trl_diffusion.cli import main
from trl_diffusion.evaluation import TaskEvaluationCallback, evaluate_task
from trl_diffusion.rewards import REWARD_FUNCS
from trl_diffusion.rewards.registry import TRL_REWARD_FUNCS, resolve_reward_func
from trl_diffusion.scripts import eval as eval_script
from trl_diffusion.scripts import train as train_script
from trl_diffusion.scripts.eval import EvalScriptArguments
from trl_diffusion.scripts.registry import TRAINING_COMMANDS, trainer_classes
from trl_diffusion.scripts.train import make_parser as make_training_parser
from trl_diffusion.scripts.train import run_recipe
from trl_diffusion.scripts.utils import DiffusionScriptArguments
from trl_diffusion.tasks import TASKS, Task
from trl_diffusion.trainer.base_config import SAMPLER_FIELDS

from helpers import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_SCRIPT = Path(sys.executable).with_name("trl-diffusion")

# A step in a few seconds: 4 completions of 16 tokens, prompts cut to their last 24 tokens.
TINY_TRAINING = [
    "--num_train_examples", "8",
    "--max_prompt_length", "24",
    "--num_generations", "4",
    "--max_completion_length", "16",
    "--block_length", "8",
    "--diffusion_steps", "8",
    "--use_cpu",
    "--bf16", "false",
    "--report_to", "none",
    "--save_strategy", "no",
    "--logging_steps", "1",
    "--gradient_checkpointing", "false",
    "--disable_tqdm", "true",
]  # fmt: skip
TINY_SAMPLER = DiffusionGenerationConfig(max_completion_length=16, block_length=8, diffusion_steps=8)


def parity_accuracy(completions, **kwargs):
    """1.0 when the completion's first character has an even code point: about half of a random model's answers."""
    return [float(bool(c[0]["content"]) and ord(c[0]["content"][0]) % 2 == 0) for c in completions]


def length_reward(completions, offset, **kwargs):
    return [len(c[0]["content"]) + offset for c, offset in zip(completions, offset)]


def load_parity(split="train", num_examples=None, seed=0):
    size = 10 if num_examples is None else num_examples
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": f"{split} {seed} {i} " * (1 + i % 3)}] for i in range(size)],
            "offset": [float(i) for i in range(size)],
        }
    )


# A stand-in task with a verifier a random model passes about half of the time (the built-in tasks' would give 0).
PARITY = Task(
    name="parity",
    description="Test task: does the answer start with an even code point?",
    loader=load_parity,
    reward_funcs=(length_reward,),
    accuracy_func=parity_accuracy,
    metric_class=TASKS["countdown"].metric_class,
    reference_columns=("offset",),
    max_completion_length=16,
    block_length=8,
)


@pytest.fixture
def parity_task(monkeypatch):
    monkeypatch.setitem(TASKS, "parity", PARITY)
    return PARITY


def weights(directory) -> dict[str, torch.Tensor]:
    name = "adapter_model.safetensors" if (Path(directory) / "adapter_config.json").exists() else "model.safetensors"
    return load_file(str(Path(directory) / name))


# A reward a random model's completions vary in (a built-in task's reward is 0 for all of them: no gradient).
DISTINCT_REWARD = """
def distinct_characters(completions, **kwargs):
    return [float(len(set(completion[0]["content"]))) for completion in completions]
"""


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    """`--reward_funcs my_rewards.distinct_characters`, importable from the working directory (as in TRL)."""
    (tmp_path / "my_rewards.py").write_text(DISTINCT_REWARD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "my_rewards", raising=False)
    return "my_rewards.distinct_characters"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def subprocess_env() -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}


# ---------------------------------------------------------------------------------------------------- --help


@pytest.mark.parametrize("command", list(TRAINING_COMMANDS))
def test_help_lists_every_field(command, capsys):
    config_class, _ = trainer_classes(command)
    with pytest.raises(SystemExit) as exit_info:
        main([command, "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    # The fields a dataclass refuses, and the `reward_funcs` of SFT and DPO (they take no reward functions), have no
    # flag.
    no_rewards = {} if train_script.takes_rewards(command) else {"reward_funcs": None}
    refused = {**make_training_parser(command).refused_fields, **no_rewards}
    for dataclass in (DiffusionScriptArguments, config_class, ModelConfig):
        fields = [f.name for f in dataclasses.fields(dataclass) if f.init]
        missing = [name for name in fields if name not in refused and f"  --{name} " not in help_text]
        assert not missing, f"`trl-diffusion {command} --help` misses {dataclass.__name__} fields {missing}"
    offered = [name for name in refused if re.search(rf"--{name}(?![\w-])", help_text)]
    assert not offered, f"`trl-diffusion {command} --help` offers the refused fields {offered}"
    # The package's own flags first, in groups; TRL's and transformers' after them.
    titles = [line for line in help_text.splitlines() if line and not line.startswith(" ") and line.endswith(":")]
    assert titles[0] == "options:" and titles[1].startswith("DiffusionScriptArguments")
    trl_class = next(cls for cls in config_class.__mro__ if cls.__module__.startswith("trl.trainer."))
    assert titles[-2:] == [f"TRL ({trl_class.__name__}):", "transformers (TrainingArguments):"]
    assert help_text.index("--model_name_or_path") < help_text.index("--learning_rate")
    if train_script.takes_rewards(command):
        assert titles[2] == "diffusion sampler and rollouts (DiffusionRLConfig):"
        sampler = help_text[help_text.index(titles[2]) : help_text.index(titles[3])]
        # (JustGRPO fixes `block_length` and `diffusion_steps`: one position per step, left to right.)
        sampler_flags = [
            name for name in ("max_completion_length", "block_length", "diffusion_steps") if name not in refused
        ]
        assert "max_completion_length" in sampler_flags and all(f"--{name} " in sampler for name in sampler_flags)


def test_refused_fields_are_rejected_by_the_command_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bgpo", "--model_name_or_path", "m", "--dataset_name", "countdown", "--use_vllm", "true"])
    assert exit_info.value.code == 2
    assert (
        "--use_vllm is not supported by trl_diffusion (vLLM has no masked-diffusion sampler" in capsys.readouterr().err
    )


def test_eval_help_lists_every_field(capsys):
    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    help_text = capsys.readouterr().out
    assert all(f"--{f.name} " in help_text for f in dataclasses.fields(EvalScriptArguments))
    sampler = [f.name for f in dataclasses.fields(DiffusionGenerationConfig)]
    assert all(f"--{name} " in help_text for name in sampler if name not in eval_script.OMITTED_SAMPLER_FIELDS)
    # No flag for what eval does not read (the canvas history); one `--seed`, eval's own.
    assert "--record_steps" not in help_text and len(re.findall(r"^  --seed ", help_text, re.MULTILINE)) == 1


# ------------------------------------------------------------------------------------- flags the command reads

# The script arguments each training command reads (`trl_diffusion.scripts.train`, `tasks.loading`, the relaunch).
SCRIPT_FLAGS = {
    "dataset_name",
    "dataset_config",
    "dataset_train_split",
    "dataset_test_split",
    "dataset_streaming",
    "reward_funcs",
    "num_train_examples",
    "eval_every_steps",
    "eval_task",
    "eval_split",
    "eval_num_examples",
    "eval_generation_batch_size",
    "eval_max_completion_length",
    "eval_block_length",
    "eval_diffusion_steps",
    "accelerate_config",
}
ESTIMATOR_FIELDS = {"num_mc_samples", "mask_sampler", "length_norm", "timestep_eps"}


def _sources(*modules) -> str:
    return "".join(Path(importlib.import_module(module).__file__).read_text() for module in modules)


@pytest.mark.parametrize("command", list(TRAINING_COMMANDS))
def test_training_flags_are_fields_the_command_reads(command):
    """Every flag of a training command is a field its code reads: the script arguments that the training script
    reads, `trl.ModelConfig`, TRL's own fields (less those the config refuses), and each field a trl_diffusion config
    adds is a sampler field or read by the trainer's code."""
    config_class, trainer_class = trainer_classes(command)
    flags = set(make_training_parser(command).flags)
    script_flags = SCRIPT_FLAGS - (set() if train_script.takes_rewards(command) else {"reward_funcs"})
    config_flags = {f.name for f in dataclasses.fields(config_class) if f.init} - set(config_class.unsupported_fields)
    assert flags == script_flags | config_flags | {f.name for f in dataclasses.fields(ModelConfig)}
    assert "ignore_bias_buffers" not in flags  # TRL's DPO switch, read by no command
    # No sequence ELBO: no Monte Carlo estimator.
    if command in ("diffu_grpo", "lfpo", "coupled_grpo", "just_grpo", "wd1"):
        assert not ESTIMATOR_FIELDS & flags
    # Token scores over the whole canvas (JustGRPO: exact ones, on TRL's completion mask; wd1: summed over the
    # answer): no completion region.
    if command in ("diffu_grpo", "coupled_grpo", "just_grpo", "wd1"):
        assert "elbo_region" not in flags

    script_source = _sources("trl_diffusion.scripts.train", "trl_diffusion.tasks.loading", "trl_diffusion.cli")
    unread = [name for name in script_flags if not re.search(rf"(script_args|namespace)\.{name}\b", script_source)]
    assert not unread, f"`trl-diffusion {command}` offers script arguments its code does not read: {unread}"
    trl_base = next(cls for cls in config_class.__mro__ if cls.__module__.startswith("trl.trainer."))
    trl_fields = {f.name for f in dataclasses.fields(trl_base)}
    own = config_flags - trl_fields - set(SAMPLER_FIELDS)
    trainer_source = _sources(
        *{cls.__module__ for cls in trainer_class.__mro__ if cls.__module__.startswith("trl_diffusion.")}
    )
    unread = sorted(name for name in own if not re.search(rf"\.{name}\b", trainer_source))
    assert not unread, (
        f"`trl-diffusion {command}` offers {config_class.__name__} fields its trainer does not read: {unread}"
    )


def test_eval_flags_are_its_arguments_and_the_sampler_fields():
    flags = set(eval_script.make_parser().flags)
    own = {f.name for f in dataclasses.fields(EvalScriptArguments)}
    sampler = {f.name for f in dataclasses.fields(DiffusionGenerationConfig)} - set(eval_script.OMITTED_SAMPLER_FIELDS)
    assert flags == own | sampler
    source = _sources("trl_diffusion.scripts.eval")
    assert all(re.search(rf"args\.{name}\b", source) for name in own)  # the sampler goes whole to evaluate_task


def test_eval_sampler_defaults_to_the_task_and_greedy(tmp_path):
    countdown = TASKS["countdown"]
    args, sampler, task = eval_script.parse_args(["--model", "m", "--task", "countdown"])
    assert task is countdown and args.seed == 0 and sampler.temperature == 0.0
    assert (sampler.max_completion_length, sampler.block_length) == (
        countdown.max_completion_length,
        countdown.block_length,
    )
    recipe = tmp_path / "eval.yaml"
    recipe.write_text("task: sudoku\nblock_length: 16\ntemperature: 0.5\n")
    args, sampler, task = eval_script.parse_args(["--config", str(recipe), "--model", "m", "--block_length", "8"])
    assert task is TASKS["sudoku"] and sampler.temperature == 0.5 and sampler.seed is None
    assert (sampler.max_completion_length, sampler.block_length) == (TASKS["sudoku"].max_completion_length, 8)


@pytest.mark.parametrize("model_type", ["llada", "Dream", "llama"])
def test_lora_rules_by_model_family(model_type):
    from trl_diffusion.models.lora import LORA_RULES, lora_config_for

    config = lora_config_for(model_type, ModelConfig(use_peft=True, lora_r=4))
    rule = LORA_RULES.get(model_type)
    if rule is None:  # TRL's config unchanged
        assert config.task_type == "CAUSAL_LM" and config.exclude_modules is None
        return
    assert set(config.target_modules) == set(rule.target_modules)
    assert config.task_type == ("CAUSAL_LM" if rule.causal_lm_task else None)
    assert config.exclude_modules == (set(rule.exclude_modules) if rule.exclude_modules else None)
    # Own target modules: no exclusion meant for the defaults.
    config = lora_config_for(model_type, ModelConfig(use_peft=True, lora_target_modules=["q_proj", "v_proj"]))
    assert config.target_modules == {"q_proj", "v_proj"} and config.exclude_modules is None
    assert lora_config_for(model_type, ModelConfig(use_peft=False)) is None


@pytest.mark.parametrize("script, argv", [(train_script, ["bgpo", "--help"]), (eval_script, ["--help"])])
def test_scripts_run_on_their_own(script, argv, capsys):
    """`python -m trl_diffusion.scripts.train bgpo ...` and `python -m trl_diffusion.scripts.eval ...`."""
    with pytest.raises(SystemExit) as exit_info:
        script.main(argv)
    assert exit_info.value.code == 0 and "--temperature" in capsys.readouterr().out


def test_top_level_help_lists_subcommands(capsys):
    assert main([]) == 0
    help_text = capsys.readouterr().out
    assert all(name in help_text for name in [*TRAINING_COMMANDS, "eval", "demo"])
    with pytest.raises(SystemExit) as exit_info:  # `demo` hands its arguments to trl_diffusion.demo.main
        main(["demo", "--help"])
    assert exit_info.value.code == 0 and "--output_dir" in capsys.readouterr().out


def test_top_level_help_imports_no_torch():
    """`trl-diffusion --help` lists the subcommands (`scripts.registry`, which imports nothing): no torch."""
    code = (
        "import contextlib, sys\nfrom trl_diffusion.cli import main\nwith contextlib.suppress(SystemExit):\n"
        "    main(['--help'])\nassert 'torch' not in sys.modules, 'torch imported'"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=subprocess_env())
    assert result.returncode == 0, result.stderr
    assert "diffu_grpo" in result.stdout


def test_training_help_imports_no_trainer(monkeypatch):
    """A training subcommand's parser (its `--help`) is built from the config classes alone."""
    config_path, _, help_text = TRAINING_COMMANDS["bgpo"]
    monkeypatch.setitem(TRAINING_COMMANDS, "bgpo", (config_path, "no_such_trainer_module.BGPOTrainer", help_text))
    assert "reward_funcs" in make_training_parser("bgpo").flags


def test_bad_arguments_fail_clearly(tiny_llada_dir, tmp_path):
    with pytest.raises(SystemExit):  # an accelerate flag without --accelerate_config
        main(["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "countdown", "--num_processes", "2"])
    with pytest.raises(ValueError, match="neither a file nor a preset"):
        cli_module.resolve_accelerate_config("zero7")
    with pytest.raises(ValueError, match="--reward_funcs"):  # a dataset that is not a task needs reward functions
        Dataset.from_dict({"prompt": ["hi"]}).save_to_disk(tmp_path / "data")
        main(
            ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", str(tmp_path / "data"), *TINY_TRAINING]
        )


def test_unknown_reward_name_lists_every_reward_and_the_closest(tiny_llada_dir):
    """A misspelt `--reward_funcs` names the package's rewards and TRL's, and suggests the closest name."""
    argv = ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "countdown", *TINY_TRAINING]
    with pytest.raises(ValueError, match="--reward_funcs 'largest_digit'") as error:
        main([*argv, "--reward_funcs", "largest_digit"])
    message = str(error.value)
    assert "did you mean 'largest_digit_reward'" in message
    assert all(name in message for name in [*REWARD_FUNCS, *TRL_REWARD_FUNCS])
    # A helper of `trl_diffusion.rewards` is no reward function (another signature): refused by name too.
    with pytest.raises(ValueError, match="'completion_text' is not a reward function"):
        resolve_reward_func("completion_text")


def test_just_grpo_refuses_a_block_causal_model_naming_the_trainers_that_train_it(tiny_tokenizer, tmp_path):
    """JustGRPO decodes one position per block, a block-causal model one of its own blocks at a time: the error says
    JustGRPO cannot train it and names the trainers that can, instead of a `--block_length` JustGRPO refuses."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    argv = ["just_grpo", "--model_name_or_path", model_dir, "--dataset_name", "countdown"]
    argv += ["--output_dir", str(tmp_path / "run"), "--max_completion_length", "16", "--num_generations", "4"]
    argv += ["--num_train_examples", "8", "--use_cpu", "--bf16", "false", "--report_to", "none"]
    with pytest.raises(ValueError, match="JustGRPO cannot train a block-causal model") as error:
        main(argv)
    message = str(error.value)
    assert "set `block_length`" not in message and "`config.block_size` = 4" in message
    assert all(f"trl-diffusion {name}" in message for name in ("bgpo", "vrpo", "trace_rl"))


def test_presets_are_trls():
    """`--accelerate_config NAME` resolves TRL's presets, the files `trl grpo --accelerate_config NAME` launches."""
    from trl.cli.accelerate_config import resolve_accelerate_config_argument

    presets = ["fsdp1", "fsdp2", "multi_gpu", "single_gpu", "zero1", "zero2", "zero3"]
    assert cli_module.accelerate_presets() == presets
    for name in presets:
        assert (
            cli_module.resolve_accelerate_config(name)
            == resolve_accelerate_config_argument(["--accelerate_config", name])[1]
        )


def test_deepspeed_presets_get_the_trainings_gradient_accumulation(tiny_llada_dir, monkeypatch):
    """TRL's `zero1` preset fixes DeepSpeed's `gradient_accumulation_steps: 1`, which transformers refuses against
    any other Trainer value: the relaunch passes the training's value to `accelerate launch` (whose flag overrides
    the file), and only for DeepSpeed configs that fix one."""
    launches = []
    monkeypatch.setattr(cli_module, "launch_with_accelerate", lambda *args: launches.append(args))
    argv = ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "countdown", "--num_processes", "2"]
    for preset in ("zero1", "zero2", "multi_gpu"):
        main([*argv, "--gradient_accumulation_steps", "4", "--accelerate_config", preset])
    assert [launch[3] for launch in launches] == [
        ["--gradient_accumulation_steps", "4", "--num_processes", "2"],
        ["--num_processes", "2"],
        ["--num_processes", "2"],
    ]
    assert all("--gradient_accumulation_steps" in launch[1] for launch in launches)  # the Trainer gets it too


# ---------------------------------------------------------------------------------------------------- training


def test_bgpo_lora_in_process_then_eval_the_adapter(tiny_llada_dir, tmp_path, reward_module):
    """`trl-diffusion bgpo` on a built-in task's prompts with LoRA (LLaDA's target modules by default) and a reward
    function named by import path, then `trl-diffusion eval` on the saved adapter directory."""
    output_dir = tmp_path / "bgpo"
    argv = [
        "bgpo",
        "--model_name_or_path",
        tiny_llada_dir,
        "--dataset_name",
        "countdown",
        "--output_dir",
        str(output_dir),
    ]
    argv += [*TINY_TRAINING, "--max_steps", "2", "--per_device_train_batch_size", "4", "--num_mc_samples", "2"]
    argv += ["--use_peft", "--lora_r", "4", "--lora_alpha", "8", "--learning_rate", "1e-2"]
    assert main([*argv, "--reward_funcs", reward_module]) == 0
    adapter_config = json.loads((output_dir / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "attn_out",
        "ff_proj",
        "up_proj",
        "ff_out",
    }
    assert adapter_config["exclude_modules"] == ["transformer.ff_out"]
    assert any(tensor.abs().sum() > 0 for name, tensor in weights(output_dir).items() if "lora_B" in name)

    results_path = tmp_path / "results.json"
    argv = ["eval", "--model", str(output_dir), "--task", "countdown", "--num_examples", "3", "--batch_size", "2"]
    assert main([*argv, "--max_completion_length", "16", "--block_length", "8", "--output", str(results_path)]) == 0
    results = json.loads(results_path.read_text())
    assert results["num_examples"] == 3 and results["accuracy"] == 0.0  # a random model solves no Countdown
    assert [record["index"] for record in results["records"]] == [0, 1, 2]


def test_sft_in_process(tiny_llada_dir, tmp_path):
    """`trl-diffusion sft` on a local prompt / completion dataset."""
    data = Dataset.from_dict({"prompt": ["ab=", "cd=", "ef=", "gh="], "completion": ["ba", "dc", "fe", "hg"]})
    data.save_to_disk(tmp_path / "data")
    argv = ["sft", "--model_name_or_path", tiny_llada_dir, "--dataset_name", str(tmp_path / "data")]
    argv += ["--output_dir", str(tmp_path / "sft"), "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--use_cpu", "--bf16", "false", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    assert main(argv) == 0
    assert (tmp_path / "sft" / "model.safetensors").is_file()


def test_console_script_and_multi_gpu_preset_with_two_cpu_processes(tiny_llada_dir, tmp_path, reward_module):
    """The `trl-diffusion` entry point with one process and 4 rows, and `--accelerate_config multi_gpu` with two
    processes of 2 rows each: the same global batch, so the same rollouts and (up to float reduction order) the same
    update. Two rows per process are only valid for 4 generations per prompt with two processes, so this also shows
    that the preset really ran two. The evaluation callback runs in both, split across the two processes."""
    assert CONSOLE_SCRIPT.is_file(), "reinstall the package (`pip install -e .`) to get the console script"
    common = ["bgpo", "--model_name_or_path", tiny_llada_dir, "--dataset_name", "sudoku", *TINY_TRAINING]
    common += ["--max_steps", "1", "--num_mc_samples", "2", "--learning_rate", "1e-2", "--optim", "sgd"]
    common += ["--reward_funcs", reward_module, "--save_strategy", "steps", "--save_steps", "1"]
    common += ["--eval_every_steps", "1", "--eval_num_examples", "3", "--eval_max_completion_length", "16"]
    common += ["--eval_block_length", "8", "--eval_diffusion_steps", "8", "--eval_generation_batch_size", "1"]
    one = [*common, "--output_dir", str(tmp_path / "one"), "--per_device_train_batch_size", "4"]
    two = [*common, "--output_dir", str(tmp_path / "two"), "--per_device_train_batch_size", "2"]
    two += ["--accelerate_config", "multi_gpu", "--num_processes", "2", "--mixed_precision", "no"]
    two += ["--main_process_port", str(free_port())]
    for argv in (one, two):
        process = subprocess.run(
            [str(CONSOLE_SCRIPT), *argv],
            env=subprocess_env(),
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert process.returncode == 0, f"{argv}\n{process.stdout[-2000:]}\n{process.stderr[-4000:]}"
    initial = load_file(str(Path(tiny_llada_dir) / "model.safetensors"))
    one_process, two_processes = weights(tmp_path / "one"), weights(tmp_path / "two")
    assert any(not torch.equal(initial[name], one_process[name]) for name in initial)
    for name, tensor in one_process.items():
        torch.testing.assert_close(two_processes[name], tensor, rtol=1e-5, atol=1e-6)
    # The evaluation callback split 3 examples over two processes (2 + 2, one padded) and gathered them.
    evaluations = []
    for run in ("one", "two"):
        history = json.loads((tmp_path / run / "checkpoint-1" / "trainer_state.json").read_text())["log_history"]
        evaluations.append([entry for entry in history if "eval/sudoku/accuracy" in entry])
    assert evaluations[0] == evaluations[1]
    assert [entry["eval/sudoku/num_examples"] for entry in evaluations[1]] == [3]


# ---------------------------------------------------------------------------------------------------- evaluation


def test_eval_command_matches_evaluate_task(tiny_llada_dir, tmp_path, parity_task):
    results_path = tmp_path / "results.json"
    argv = ["eval", "--model", tiny_llada_dir, "--task", "parity", "--num_examples", "7", "--batch_size", "3"]
    assert main([*argv, "--output", str(results_path)]) == 0
    from_cli = json.loads(results_path.read_text())

    model = AutoModelForCausalLM.from_pretrained(tiny_llada_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llada_dir)
    direct = evaluate_task(model, tokenizer, parity_task, num_examples=7, batch_size=5, progress_bar=False)
    assert 0.0 < direct["accuracy"] < 1.0  # the check below compares something
    assert from_cli["accuracy"] == direct["accuracy"]
    assert from_cli["mean_reward"] == pytest.approx(direct["mean_reward"])
    assert [r["completion"] for r in from_cli["records"]] == [r["completion"] for r in direct["records"]]
    assert from_cli["generation_config"]["max_completion_length"] == 16  # the task's suggestion
    # The reward adds the `offset` column to the completion length: columns reach the reward functions.
    assert [r["reward"] for r in direct["records"]] == [len(r["completion"]) + r["index"] for r in direct["records"]]
    assert direct["accuracy"] == sum(r["correct"] for r in direct["records"]) / 7


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_sharded_evaluation_equals_one_process(tiny_llada_dir, parity_task, monkeypatch, temperature):
    """Each process evaluates its slice (the last one padded); the union of the slices is the one-process result,
    at any batch size, also when sampling (per-row generators)."""
    monkeypatch.setattr("trl_diffusion.evaluation.gather_object", lambda records: records)
    model = AutoModelForCausalLM.from_pretrained(tiny_llada_dir)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llada_dir)
    config = dataclasses.replace(TINY_SAMPLER, temperature=temperature)
    evaluate = partial(evaluate_task, model, tokenizer, parity_task, generation_config=config, progress_bar=False)
    whole = evaluate(num_examples=7, batch_size=7)
    shards = [
        evaluate(num_examples=7, batch_size=2, accelerator=SimpleNamespace(process_index=i, num_processes=2))
        for i in range(2)
    ]
    assert [r["index"] for r in shards[0]["records"]] == [0, 1, 2, 3]
    assert [r["index"] for r in shards[1]["records"]] == [4, 5, 6]  # padding (a repeated 6) dropped
    assert shards[0]["records"] + shards[1]["records"] == whole["records"]


def test_callback_logs_accuracy_into_log_history(tiny_llada_dir, tiny_tokenizer, parity_task, tmp_path):
    args = BGPOConfig(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=16,
        block_length=8,
        diffusion_steps=8,
        num_mc_samples=2,
        max_steps=2,
        learning_rate=1e-2,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        disable_tqdm=True,
    )
    trainer = BGPOTrainer(
        model=tiny_llada_dir,
        reward_funcs=list(parity_task.reward_funcs),
        args=args,
        train_dataset=parity_task.load(num_examples=8),
        processing_class=tiny_tokenizer,
    )
    callback = TaskEvaluationCallback(trainer, "parity", eval_every_steps=1, num_examples=6, batch_size=4)
    trainer.add_callback(callback)
    trainer.train()

    history = trainer.state.log_history
    evaluations = [entry for entry in history if "eval/parity/accuracy" in entry]
    assert [entry["step"] for entry in evaluations] == [1, 2]
    assert all(entry["eval/parity/num_examples"] == 6 for entry in evaluations)
    assert [entry["step"] for entry in history if "reward" in entry] == [1, 2]  # the steps' own logs survive
    assert trainer.model.training  # train mode restored
    final = evaluate_task(trainer.model, tiny_tokenizer, parity_task, num_examples=6, progress_bar=False)
    assert evaluations[-1]["eval/parity/accuracy"] == final["accuracy"]
    assert evaluations[-1]["eval/parity/reward"] == pytest.approx(final["mean_reward"])


def test_callback_takes_evaluate_tasks_defaults_and_refuses_other_arguments(parity_task):
    trainer = SimpleNamespace()
    callback = TaskEvaluationCallback(trainer, parity_task, eval_every_steps=2, batch_size=4)
    defaults = inspect.signature(evaluate_task).parameters
    assert callback.evaluate_kwargs["batch_size"] == 4
    for name in ("split", "num_examples", "seed"):
        assert callback.evaluate_kwargs[name] == defaults[name].default
    assert callback.evaluate_kwargs["generation_config"] is not None  # the task's greedy sampler
    with pytest.raises(TypeError, match="num_exemples.*split, num_examples"):
        TaskEvaluationCallback(trainer, parity_task, eval_every_steps=2, num_exemples=6)


# ---------------------------------------------------------------------------------------------------- examples


def load_example(name: str):
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


EXAMPLES = {
    "bgpo_countdown": "bgpo",
    "diffu_grpo_gsm8k": "diffu_grpo",
    "vrpo_gsm8k": "vrpo",
    "espo_sudoku": "espo",
    "lfpo_gsm8k": "lfpo",
    "coupled_grpo_code": "coupled_grpo",
    "wd1_sudoku": "wd1",
    "just_grpo_gsm8k": "just_grpo",
    "spg_countdown": "spg",
    "bgpo_sdar_countdown": "bgpo",
    "ebpo_sdar_countdown": "ebpo",
    "dipo_sdar_math": "dipo",
    "trace_rl_gsm8k": "trace_rl",
    "cj_grpo_sudoku": "cj_grpo",
    "agrpo_sudoku": "agrpo",
    "mdpo_math": "mdpo",
    "igpo_gsm8k": "igpo",
    "tree_rpo_countdown": "tree_rpo",
}
# The examples with preset switches (`--block_model`, `--egspo`, ...): flag -> the fields it sets.
EXAMPLE_PRESETS = {
    "trace_rl_gsm8k": {
        "--block_model": {"transition_grouping": 1, "transition_reduction": "response"},
        "--with_value": {"value_model": True, "value_learning_rate": 5e-6},
    },
    "agrpo_sudoku": {
        "--egspo": {
            "transition_selection": "top_entropy",
            "ratio_level": "transition",
            "lookahead_return_weight": 0.0,
        },
        "--egspo_sa": {"transition_selection": "top_entropy", "lookahead_return_weight": 0.5},
    },
}


@pytest.mark.parametrize("name", list(EXAMPLES))
def test_example_parses_help_with_the_recipe_as_defaults(name, capsys):
    module = load_example(name)
    with pytest.raises(SystemExit) as exit_info:
        run_recipe(EXAMPLES[name], module.RECIPE, ["--help"], prog=name, description=module.__doc__)
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "accelerate launch --config_file" in help_text
    # argparse wraps the help at the terminal's width: compare with the whitespace collapsed.
    assert f"(default: {module.RECIPE['learning_rate']})" in " ".join(help_text.split())


def test_bgpo_example_runs_one_step_with_its_evaluation(tiny_llada_dir, tmp_path):
    """The BGPO recipe on a tiny model: full fine-tuning, and the recipe's evaluation callback (made small)."""
    module = load_example("bgpo_countdown")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_mc_samples", "2"]
    argv += ["--gradient_accumulation_steps", "1", "--eval_num_examples", "2", "--eval_max_completion_length", "16"]
    argv += ["--eval_block_length", "8", "--eval_diffusion_steps", "8"]
    assert run_recipe("bgpo", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_espo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """The ESPO recipe (LoRA, mu = 8, coupled ELBO, KL) on a tiny model."""
    module = load_example("espo_sudoku")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--num_mc_samples", "1"]
    argv += ["--gradient_accumulation_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]
    assert run_recipe("espo", module.RECIPE, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_coupled_grpo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """DiffuCoder's recipe (full fine-tuning, mu = 2, a reference model synced every 64 steps) on a tiny model, on
    Countdown (one reward function) instead of MBPP (a download)."""
    module = load_example("coupled_grpo_code")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += ["--dataset_name", "countdown", "--reward_weights", "1.0", *TINY_TRAINING, "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
    assert run_recipe("coupled_grpo", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_wd1_example_runs_one_step(tiny_llada_dir, tmp_path):
    """wd1's recipe (LoRA, mu = 8, no KL) on a tiny model, its base in float32 instead of 4-bit."""
    module = load_example("wd1_sudoku")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--load_in_4bit", "false"]
    argv += ["--gradient_accumulation_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]
    assert run_recipe("wd1", module.RECIPE, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_spg_example_runs_one_step(tiny_llada_dir, tmp_path):
    """SPG's recipe (LoRA, mu = 4, block-wise views, no KL) on a tiny model, its base in float32 instead of 4-bit."""
    module = load_example("spg_countdown")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--load_in_4bit", "false"]
    argv += ["--gradient_accumulation_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]
    assert run_recipe("spg", module.RECIPE, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_mdpo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """MDPO's recipe (full fine-tuning, RCR rollouts, every step rewarded, k2 KL) on a tiny model, on Countdown (a
    procedural task) instead of MATH (a download)."""
    module = load_example("mdpo_math")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += ["--dataset_name", "countdown", *TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--gradient_accumulation_steps", "1", "--num_generations", "4", "--sample_train_steps", "2"]
    assert run_recipe("mdpo", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_igpo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """IGPO's recipe without QLoRA on a tiny model, on Sudoku (procedural, with a `solution` column: the grid) instead
    of GSM8K (a download); the random model fails every group, so the step inpaints."""
    module = load_example("igpo_gsm8k")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += ["--dataset_name", "sudoku", *TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--gradient_accumulation_steps", "1", "--num_generations", "4", "--num_iterations", "1"]
    argv += ["--load_in_4bit", "false", "--use_peft", "false", "--max_prompt_length", "64"]
    argv += ["--hint_chunk_min_tokens", "2", "--hint_chunk_max_tokens", "3"]
    assert run_recipe("igpo", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_tree_rpo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """d-TreeRPO's recipe (LoRA, a tree of the completions, mu = 12, self-distillation) on a tiny model, its base in
    float32 instead of 4-bit, a 2 x 2 tree of 4 completions."""
    module = load_example("tree_rpo_countdown")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--load_in_4bit", "false"]
    argv += ["--gradient_accumulation_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]
    argv += ["--num_tree_samples", "2", "--tree_branch_factor", "2", "--num_iterations", "2"]
    assert run_recipe("tree_rpo", module.RECIPE, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize(
    ("name", "flag"), [(name, flag) for name, presets in EXAMPLE_PRESETS.items() for flag in presets]
)
def test_example_preset_switch_sets_its_fields(name, flag, tmp_path):
    """An example's preset switch is taken off the command line and its fields reach the trainer's config; without
    it the recipe is unchanged."""
    module = load_example(name)
    recipe, arguments = module.recipe_and_arguments(["--max_steps", "3", flag])
    assert arguments == ["--max_steps", "3"]
    assert module.recipe_and_arguments(["--max_steps", "3"]) == (module.RECIPE, ["--max_steps", "3"])
    parser = make_training_parser(EXAMPLES[name])
    assert not parser.set_defaults_with_config(**recipe)
    # One process: a batch the recipes' groups (8, 16) divide (EGSPO's 6 x 2 and G = 8 need several GPUs).
    one_process = ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "1"]
    _, config, _ = parser.parse_args_and_config(
        ["--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false", *one_process, *arguments]
    )
    assert config.max_steps == 3
    assert {field: getattr(config, field) for field in EXAMPLE_PRESETS[name][flag]} == EXAMPLE_PRESETS[name][flag]


def test_trace_rl_example_runs_one_step(tiny_llada_dir, tmp_path):
    """TraceRL's recipe (full fine-tuning, shrinkage 8, k3 towards the old policy) on a tiny model, on Countdown
    instead of GSM8K (a download); every prompt kept (a random model passes none, and the filter would leave the loss
    empty)."""
    module = load_example("trace_rl_gsm8k")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += ["--dataset_name", "countdown", *TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--gradient_accumulation_steps", "1", "--pass_rate_range", "0", "1", "--transition_grouping", "4"]
    assert run_recipe("trace_rl", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_trace_rl_block_model_example_runs_one_step(tiny_tokenizer, tmp_path):
    """TraceRL's block-model recipe (`--block_model`: every step a transition, the response-length reduction,
    threshold decoding) on a tiny SDAR in blocks of 4."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    module = load_example("trace_rl_gsm8k")
    recipe, _ = module.recipe_and_arguments(["--block_model"])
    argv = ["--model_name_or_path", model_dir, "--dtype", "float32", "--output_dir", str(tmp_path / "run")]
    argv += ["--dataset_name", "countdown", *TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16"]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
    argv += ["--pass_rate_range", "0", "1"]
    assert run_recipe("trace_rl", recipe, argv) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_trace_rl_value_model_example_runs_one_step(tiny_tokenizer, tmp_path):
    """TraceRL's block-model recipe with its value model (`--block_model --with_value`) on a tiny SDAR, LoRA: the
    value model is saved next to the policy's adapter."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    module = load_example("trace_rl_gsm8k")
    recipe, _ = module.recipe_and_arguments(["--block_model", "--with_value"])
    argv = ["--model_name_or_path", model_dir, "--dtype", "float32", "--output_dir", str(tmp_path / "run")]
    argv += ["--dataset_name", "countdown", *TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16"]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
    argv += ["--pass_rate_range", "0", "1", "--use_peft", "--lora_r", "4", "--lora_alpha", "8"]
    assert run_recipe("trace_rl", recipe, argv) == 0
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
    assert (tmp_path / "run" / "value_model" / "value_model.safetensors").is_file()


def test_cj_grpo_example_runs_one_step(tiny_llada_dir, tmp_path):
    """CJ-GRPO's recipe (LoRA, mu = 8, ascending step sizes with EOS early rejection, k3 to the reference) on a tiny
    model: one block of 16 tokens in its 4 ascending steps (1, 2, 4, 9 tokens)."""
    module = load_example("cj_grpo_sudoku")
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--block_length", "16", "--diffusion_steps", "4", "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--lora_r", "4"]
    argv += ["--lora_alpha", "8"]
    assert run_recipe("cj_grpo", module.RECIPE, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


@pytest.mark.parametrize("preset", [None, "--egspo_sa"])
def test_agrpo_example_runs_one_step(preset, tiny_llada_dir, tmp_path):
    """AGRPO's recipe (LoRA, entropy-proportional Monte Carlo over steps, ratios against the sampler, random
    unmasking) on a tiny model, and EGSPO-SA's (top-entropy steps, step-level ratios, look-ahead returns; its base in
    float32 instead of 4-bit)."""
    module = load_example("agrpo_sudoku")
    recipe, _ = module.recipe_and_arguments([preset] if preset else [])
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += [*TINY_TRAINING, "--max_steps", "1", "--per_device_train_batch_size", "4", "--load_in_4bit", "false"]
    argv += ["--gradient_accumulation_steps", "1", "--lora_r", "4", "--lora_alpha", "8"]
    argv += ["--num_selected_transitions", "4", "--warmup_steps", "0"]
    assert run_recipe("agrpo", recipe, argv) == 0
    assert (tmp_path / "adapter_model.safetensors").is_file()


def test_sdar_example_runs_one_step(tiny_tokenizer, tmp_path):
    """The SDAR BGPO recipe on a tiny SDAR (blocks of 4: the canvas's blocks set to the model's)."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    module = load_example("bgpo_sdar_countdown")
    argv = ["--model_name_or_path", model_dir, "--dtype", "float32", "--output_dir", str(tmp_path / "run")]
    argv += [*TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16", "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_mc_samples", "2"]
    assert run_recipe("bgpo", module.RECIPE, argv) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_dipo_example_runs_one_step(tiny_tokenizer, tmp_path):
    """DiRL's DAPO recipe on a tiny SDAR (blocks of 4), on Countdown (a procedural task) instead of MATH (a
    download)."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    module = load_example("dipo_sdar_math")
    argv = ["--model_name_or_path", model_dir, "--dtype", "float32", "--output_dir", str(tmp_path / "run")]
    argv += ["--dataset_name", "countdown", *TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16"]
    argv += ["--max_steps", "1", "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1"]
    assert run_recipe("dipo", module.RECIPE, argv) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_ebpo_example_runs_one_step(tiny_tokenizer, tmp_path):
    """DARE's SDAR EBPO recipe on a tiny SDAR (blocks of 4: the canvas's blocks set to the model's)."""
    from trl_diffusion.models import build_tiny_sdar

    model_dir = save_checkpoint(build_tiny_sdar(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-sdar")
    module = load_example("ebpo_sdar_countdown")
    argv = ["--model_name_or_path", model_dir, "--dtype", "float32", "--output_dir", str(tmp_path / "run")]
    argv += [*TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16", "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--num_mc_samples", "2"]
    assert run_recipe("ebpo", module.RECIPE, argv) == 0
    assert (tmp_path / "run" / "model.safetensors").is_file()


def test_bgpo_command_trains_a_llada2_with_its_lora_rule(tiny_tokenizer, tmp_path):
    """`trl-diffusion bgpo --model_name_or_path <LLaDA2> --use_peft`: the family's LoRA targets (attention, the dense
    layer and the shared experts) without `--lora_target_modules`, blocks of the model's size."""
    from trl_diffusion.models import build_tiny_llada2

    model_dir = save_checkpoint(build_tiny_llada2(tiny_tokenizer), tiny_tokenizer, tmp_path / "tiny-llada2")
    argv = [
        "bgpo",
        "--model_name_or_path",
        model_dir,
        "--dataset_name",
        "countdown",
        "--output_dir",
        str(tmp_path / "o"),
    ]
    argv += [*TINY_TRAINING, "--block_length", "4", "--diffusion_steps", "16", "--max_steps", "1"]
    argv += ["--per_device_train_batch_size", "4", "--num_mc_samples", "2", "--use_peft", "--lora_r", "4"]
    argv += ["--use_cpu", "--bf16", "false", "--report_to", "none", "--save_strategy", "no", "--disable_tqdm", "true"]
    assert main(argv) == 0
    adapter_config = json.loads((tmp_path / "o" / "adapter_config.json").read_text())
    assert set(adapter_config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }


def test_just_grpo_example_runs_one_step_with_a_parallel_evaluation(tiny_llada_dir, tmp_path):
    """JustGRPO's recipe (full fine-tuning, left-to-right rollouts: no --block_length / --diffusion_steps flags) on a
    tiny model, on Countdown instead of GSM8K (a download), 2 positions per pass; its evaluation decodes with the
    ordinary parallel sampler (one block of 16 tokens in 8 steps), not the left-to-right one."""
    module = load_example("just_grpo_gsm8k")
    fixed = {TINY_TRAINING.index(flag) + shift for flag in ("--block_length", "--diffusion_steps") for shift in (0, 1)}
    tiny = [arg for index, arg in enumerate(TINY_TRAINING) if index not in fixed]
    argv = ["--model_name_or_path", tiny_llada_dir, "--dtype", "float32", "--output_dir", str(tmp_path)]
    argv += ["--dataset_name", "countdown", *tiny, "--max_steps", "1", "--per_device_train_batch_size", "4"]
    argv += ["--gradient_accumulation_steps", "1", "--just_grpo_positions_per_forward", "2"]
    argv += ["--eval_num_examples", "2", "--eval_max_completion_length", "16", "--eval_block_length", "16"]
    argv += ["--eval_diffusion_steps", "8"]
    assert run_recipe("just_grpo", module.RECIPE, argv) == 0
    assert (tmp_path / "model.safetensors").is_file()


def test_config_file_may_spell_out_a_refused_field_at_its_accepted_value(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("use_vllm: false\ntop_p: 1.0\nnum_mc_samples: 3\n")
    parser = make_training_parser("bgpo")
    _, config, _ = parser.parse_args_and_config(
        ["--config", str(recipe), "--output_dir", str(tmp_path), "--use_cpu", "--bf16", "false"]
    )
    assert config.num_mc_samples == 3 and config.use_vllm is False and config.top_p == 1.0
    recipe.write_text("use_vllm: true\n")
    with pytest.raises(SystemExit):
        cli_module.run_training("bgpo", ["--config", str(recipe), "--model_name_or_path", "m"])
