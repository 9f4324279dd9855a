"""The model card written next to a saved model: the base model, the algorithm and its paper, the sampler settings,
the final metrics, and a quick start that runs (read from the written README.md, executed on the tiny model)."""

import re
import types

import pytest

from trl_diffusion import BGPOConfig, BGPOTrainer, DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion.model_card import base_model_reference, dataset_reference

from helpers import tiny_config, tiny_grpo_config, tiny_trainer


def quick_start(card: str) -> str:
    """The card's Python block."""
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    return snippet


def run_quick_start(card: str, model_dir, capsys) -> str:
    """Executes the card's quick start on `model_dir` (its `model_id` substituted); returns what it printed."""
    snippet, substitutions = re.subn(
        r'^model_id = ".*"', f"model_id = {str(model_dir)!r}", quick_start(card), flags=re.M
    )
    assert substitutions == 1
    capsys.readouterr()
    exec(compile(snippet, "README.md", "exec"), {})
    return capsys.readouterr().out


def test_rl_card_names_base_algorithm_sampler_and_metrics_and_its_quick_start_runs(tiny_llada_dir, tmp_path, capsys):
    output_dir = tmp_path / "tiny-bgpo"
    args = tiny_grpo_config(BGPOConfig, output_dir, num_mc_samples=2, temperature=0.7, early_stop=True)
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, args)
    trainer.train()
    trainer.save_model()

    card = (output_dir / "README.md").read_text()
    assert "# Model Card for tiny-bgpo" in card
    base_name = tiny_llada_dir.rstrip("/").split("/")[-1]
    assert f"fine-tuned version of `{base_name}` (loaded from a local directory)" in card
    assert "[None]" not in card and "pipeline(" not in card.replace('`pipeline("text-generation")` and', "")
    assert "BGPO" in card and "https://huggingface.co/papers/2510.11683" in card and "@article{lin2025bgpo" in card
    for tag in ("trl", "trl-diffusion", "diffusion-lm", "generated_from_trainer"):
        assert f"- {tag}\n" in card
    for setting in ("| `max_completion_length` | `8` |", "| `temperature` | `0.7` |", "| `early_stop` | `True` |"):
        assert setting in card
    final = [entry for entry in trainer.state.log_history if "reward" in entry][-1]
    assert f"| `reward` | {final['reward']:.4g} | 2 |" in card
    assert "| `bound/gap_mean` |" in card

    snippet = quick_start(card)
    assert "import trl_diffusion" in snippet and "generate(" in snippet
    assert "max_completion_length=8, block_length=4, diffusion_steps=4, temperature=0.7, early_stop=True" in snippet
    printed = run_quick_start(card, output_dir, capsys)
    assert printed.endswith("\n") and len(printed) <= 9  # at most the 8 canvas tokens, terminator cut


def test_sft_card_and_quick_start(tiny_llada_dir, tmp_path, capsys):
    from datasets import Dataset

    output_dir = tmp_path / "tiny-sft"
    rows = {"prompt": ["ab=", "cd="], "completion": ["ba", "dc"]}
    args = tiny_config(DiffusionSFTConfig, output_dir, max_steps=1, max_completion_length=4)
    trainer = DiffusionSFTTrainer(model=tiny_llada_dir, args=args, train_dataset=Dataset.from_dict(rows))
    trainer.train()
    trainer.save_model()

    card = (output_dir / "README.md").read_text()
    assert "DiffusionSFT" in card and "2502.09992" in card
    assert "decodes nothing during training" in card and "training canvas (4 tokens, one block)" in card
    assert "| `loss` |" in card
    assert "max_completion_length=4, block_length=4" in quick_start(card)
    run_quick_start(card, output_dir, capsys)


def test_checkpoint_card_is_the_diffusion_card(tiny_llada_dir, tmp_path):
    args = tiny_grpo_config(BGPOConfig, tmp_path / "run", num_mc_samples=2, max_steps=1, save_strategy="steps")
    tiny_trainer(BGPOTrainer, tiny_llada_dir, args).train()
    card = (tmp_path / "run" / "checkpoint-1" / "README.md").read_text()
    assert "trl_diffusion.generate" in card and "| `reward` |" in card


@pytest.mark.parametrize(
    "name_or_path, hub_id, text",
    [
        ("GSAI-ML/LLaDA-8B-Instruct", "GSAI-ML/LLaDA-8B-Instruct", "[GSAI-ML/LLaDA-8B-Instruct](https://huggingface"),
        ("", None, "a model built in memory"),
    ],
)
def test_base_model_reference(name_or_path, hub_id, text):
    reference = base_model_reference(types.SimpleNamespace(_name_or_path=name_or_path))
    assert reference[0] == hub_id and reference[1].startswith(text)


def test_base_model_reference_of_a_local_directory(tmp_path):
    (tmp_path / "my-base").mkdir()
    hub_id, text = base_model_reference(types.SimpleNamespace(_name_or_path=str(tmp_path / "my-base") + "/"))
    assert hub_id is None and text == "`my-base` (loaded from a local directory)"


def test_dataset_reference(tmp_path):
    assert dataset_reference(None) == (None, None)
    assert dataset_reference("countdown") == (None, "the built-in `countdown` task of trl_diffusion")
    assert dataset_reference(str(tmp_path)) == (None, f"the local dataset `{tmp_path.name}`")
    hub_id, text = dataset_reference("openai/gsm8k")
    assert (
        hub_id == "openai/gsm8k" and text == "the [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset"
    )


def test_lora_adapter_card_keeps_peft_metadata_and_its_quick_start_runs(tiny_llada_dir, tmp_path, capsys):
    """PEFT adds its metadata to the card written before the adapter, and the Auto class loads the adapter on its
    base."""
    output_dir = tmp_path / "tiny-bgpo-lora"
    args = tiny_grpo_config(BGPOConfig, output_dir, num_mc_samples=2, max_steps=1)
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, args, peft=True)
    trainer.train()
    trainer.save_model()
    card = (output_dir / "README.md").read_text()
    assert "library_name: peft" in card and "- trl-diffusion\n" in card and "trl_diffusion.generate" in card
    run_quick_start(card, output_dir, capsys)
