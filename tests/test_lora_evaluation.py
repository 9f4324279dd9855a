"""LoRA adapters evaluated directly, without merging: `trl-diffusion eval` and the harness model load an adapter
directory on its base model (from `adapter_config.json`, or `--base_model` / `base_model=`), and score it exactly as
the merged model (`peft`'s `merge_and_unload`) is scored. The adapter's weights are perturbed so that it changes the
model's answers."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from lm_eval.api.instance import Instance
from peft import get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from trl_diffusion.cli import main
from trl_diffusion.harness import DiffusionLM

from helpers import lora_config, save_checkpoint

EVAL = ["--task", "largest_digit", "--num_examples", "8", "--batch_size", "3", "--use_cpu", "true"]
QUESTIONS = ["Largest of 3 8 1 6 4?", "Largest of 2 7 5 0 9?", "Largest of 1 4 6 3 2?", "Largest of 9 0 8 5 7?"]
SAMPLER = dict(max_completion_length=8, block_length=4, diffusion_steps=4)


@pytest.fixture(scope="module")
def lora_dirs(tiny_llada_dir, tmp_path_factory):
    """`(adapter, merged)`: a rank-4 LoRA on the tiny LLaDA checkpoint with random B matrices (PEFT starts them at
    zero, which would change nothing), saved without a tokenizer (it comes from the base model), and the same LoRA
    merged into the weights by `merge_and_unload`, saved as a full checkpoint."""
    root = tmp_path_factory.mktemp("lora")
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_llada_dir), lora_config())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_B" in name:
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    model.save_pretrained(root / "adapter")
    merged = model.merge_and_unload()
    save_checkpoint(merged, AutoTokenizer.from_pretrained(tiny_llada_dir), root / "merged")
    return str(root / "adapter"), str(root / "merged")


def completions(model, tmp_path, *extra) -> list[str]:
    """The completions of `trl-diffusion eval --model MODEL` on 8 `largest_digit` prompts."""
    output = tmp_path / f"results-{len(list(tmp_path.iterdir()))}.json"
    assert main(["eval", "--model", model, *EVAL, *extra, "--output", str(output)]) == 0
    return [record["completion"] for record in json.loads(output.read_text())["records"]]


def moved_base_adapter(adapter, tmp_path) -> str:
    """A copy of `adapter` whose `adapter_config.json` names a base model path that no longer exists."""
    copy = shutil.copytree(adapter, tmp_path / "moved")
    config_file = copy / "adapter_config.json"
    config = json.loads(config_file.read_text())
    config["base_model_name_or_path"] = str(tmp_path / "where-the-base-was")
    config_file.write_text(json.dumps(config))
    return str(copy)


def test_eval_command_on_an_adapter_equals_the_merged_model(lora_dirs, tiny_llada_dir, tmp_path):
    adapter, merged = lora_dirs
    from_adapter = completions(adapter, tmp_path)
    assert from_adapter == completions(merged, tmp_path)
    assert from_adapter != completions(tiny_llada_dir, tmp_path)  # the LoRA changes the answers


def test_eval_command_base_model_override(lora_dirs, tiny_llada_dir, tmp_path):
    adapter, merged = lora_dirs
    moved = moved_base_adapter(adapter, tmp_path)
    with pytest.raises(
        ValueError, match="`base_model_name_or_path` of .*adapter_config.json \\(--base_model overrides"
    ):
        completions(moved, tmp_path)
    assert completions(moved, tmp_path, "--base_model", tiny_llada_dir) == completions(merged, tmp_path)
    with pytest.raises(ValueError, match="is a full checkpoint .*drop --base_model"):
        completions(merged, tmp_path, "--base_model", tiny_llada_dir)


def test_harness_model_on_an_adapter_equals_the_merged_model(lora_dirs, tiny_llada_dir, tmp_path):
    adapter, merged = lora_dirs
    generations = [
        Instance("generate_until", {}, (question, {"until": []}), i) for i, question in enumerate(QUESTIONS)
    ]
    choices = [Instance("loglikelihood", {}, (question, " 9"), i) for i, question in enumerate(QUESTIONS)]
    results = {}
    for name, model_args in {
        "adapter": dict(pretrained=adapter),
        "moved adapter": dict(pretrained=moved_base_adapter(adapter, tmp_path), base_model=tiny_llada_dir),
        "merged": dict(pretrained=merged),
        "base": dict(pretrained=tiny_llada_dir),
    }.items():
        lm = DiffusionLM(**model_args, num_mc_samples=4, batch_size=3, device="cpu", **SAMPLER)
        texts = lm.generate_until(generations, disable_tqdm=True)
        log_likelihoods = [value for value, _ in lm.loglikelihood(choices, disable_tqdm=True)]
        results[name] = texts, log_likelihoods
    for name in ("adapter", "moved adapter"):
        assert results[name][0] == results["merged"][0]
        assert results[name][1] == pytest.approx(results["merged"][1], rel=1e-4)
    assert results["adapter"][0] != results["base"][0]
    assert results["adapter"][1] != pytest.approx(results["base"][1], rel=1e-2)
