"""The model card written next to a saved model: the base model, the algorithm and its paper, the sampler settings,
the final metrics, and a quick start that runs (read from the written README.md, executed on the tiny model); its
metadata as the Hub reads it (parsed with `huggingface_hub.ModelCard`), for a full fine-tune and a LoRA adapter, on a
built-in task and a local dataset."""

import json
import re
import types

import pytest
from huggingface_hub import ModelCard

from trl_diffusion import BGPOConfig, BGPOTrainer, DiffusionSFTConfig, DiffusionSFTTrainer
from trl_diffusion import model_card as model_card_module
from trl_diffusion.model_card import (
    TASK_DATASETS,
    base_model_license,
    base_model_reference,
    dataset_reference,
    loading_route,
    quick_start_snippet,
    remote_code_loads,
)
from trl_diffusion.tasks import TASKS, hub

from helpers import tiny_config, tiny_grpo_config, tiny_trainer


def quick_start(card: str) -> str:
    """The card's Python block."""
    (snippet,) = re.findall(r"```python\n(.*?)```", card, flags=re.DOTALL)
    return snippet


def card_metadata(directory) -> dict:
    """The YAML front matter of `directory/README.md` as the Hub reads it (`ModelCardData`, `None` fields dropped)."""
    return ModelCard.load(directory / "README.md").data.to_dict()


def fake_hub_card(monkeypatch, tmp_path, front_matter: str):
    """The base model's card on the "Hub" (`hf_hub_download` of `model_card.py`) is `front_matter`; the license cache
    is cleared first (and after each test)."""
    readme = tmp_path / "hub-README.md"
    readme.write_text(f"---\n{front_matter}---\n\n# Base\n")
    monkeypatch.setattr(model_card_module, "hf_hub_download", lambda repo_id, filename: str(readme))
    base_model_license.cache_clear()
    return readme


@pytest.fixture(autouse=True)
def _clear_license_cache():
    yield
    base_model_license.cache_clear()


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

    # The Hub's metadata of a full fine-tune of a local base: no base_model nor license to name, and no `licence`.
    metadata = card_metadata(output_dir)
    assert metadata["library_name"] == "transformers" and metadata["pipeline_tag"] == "text-generation"
    assert not {"base_model", "base_model_relation", "license", "licence", "datasets"} & set(metadata)
    assert {"trl", "trl-diffusion", "generated_from_trainer"} <= set(metadata["tags"])
    assert "custom_code" not in metadata["tags"] and "trust_remote_code" not in card
    assert "is a trl_diffusion native class" in card and "after `import trl_diffusion`" in card


def test_card_metadata_of_a_hub_base_on_a_built_in_task(tiny_llada_dir, tmp_path, monkeypatch):
    """A base with a Hub id: `base_model` and `base_model_relation`, the license its card declares (with `other`'s
    name and link), the built-in task's Hub dataset, TRL's trackio tag replacing an old one; and `custom_code` once
    the saved `config.json`'s `auto_map` names a modeling file that is there."""
    output_dir = tmp_path / "tiny-bgpo"
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, tiny_grpo_config(BGPOConfig, output_dir, max_steps=1))
    trainer.train()
    trainer.save_model()
    trainer.model.config._name_or_path = "org/llada-base"
    fake_hub_card(monkeypatch, tmp_path, "license: other\nlicense_name: base-license\nlicense_link: LICENSE\n")
    trackio_url = "https://org-space.hf.space?project=p&runs=r&sidebar=collapsed"
    monkeypatch.setattr(model_card_module, "get_trackio_space_url", lambda: trackio_url)
    trainer.create_model_card(dataset_name="gsm8k", tags=["trackio:https://old", "mine"])

    metadata = card_metadata(output_dir)
    assert metadata["base_model"] == "org/llada-base" and metadata["base_model_relation"] == "finetune"
    assert (metadata["license"], metadata["license_name"], metadata["license_link"]) == (
        "other",
        "base-license",
        "LICENSE",
    )
    assert metadata["datasets"] == ["openai/gsm8k"] and metadata["library_name"] == "transformers"
    assert [tag for tag in metadata["tags"] if tag.startswith("trackio:")] == [f"trackio:{trackio_url}"]
    assert "mine" in metadata["tags"] and "custom_code" not in metadata["tags"]
    card = (output_dir / "README.md").read_text()
    assert (
        "built-in `gsm8k` task of trl_diffusion ([openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k))" in card
    )

    config = json.loads((output_dir / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_llada.LLaDAModelLM"}
    (output_dir / "config.json").write_text(json.dumps(config))
    trainer.create_model_card()
    assert "custom_code" not in card_metadata(output_dir)["tags"]  # the auto_map names a file the folder lacks
    (output_dir / "modeling_llada.py").write_text("")
    trainer.create_model_card()
    assert "custom_code" in card_metadata(output_dir)["tags"]
    assert "loads it too, on transformers alone: `trust_remote_code=True`" in (output_dir / "README.md").read_text()


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


def test_trainer_class_keywords_give_trls_card_attributes():
    """`name`, `tags` and `paper` of a trainer's class statement become the `_name`, `_tag_names` and `_paper` that
    TRL's card code reads, the paper read from `papers.bib` (an entry without authors gives no citation); a subclass
    that names none keeps its parent's."""
    from trl_diffusion import AGRPOTrainer, CJGRPOTrainer, DiffuGRPOTrainer
    from trl_diffusion.model_card import papers

    assert CJGRPOTrainer._name == "CJGRPO"
    assert CJGRPOTrainer._tag_names == ["trl", "trl-diffusion", "diffusion-lm", "cj-grpo"]
    assert DiffuGRPOTrainer._tag_names == ["trl", "trl-diffusion", "diffusion-lm", "d1", "diffu-grpo"]
    paper = CJGRPOTrainer._paper
    assert paper["id"] == "2509.23924" and paper["title"].startswith("Taming Masked Diffusion Language Models")
    assert paper["citation"].startswith("@article{yang2025cjgrpo,\n    title        = {{Taming")
    assert paper["citation"].endswith("    eprint       = {arXiv:2509.23924},\n}")
    assert AGRPOTrainer._paper == {
        "title": "Simple Policy Gradients for Reasoning with Diffusion Language Models",
        "id": "2510.04019",
    }
    assert len(papers()) == 18 and all(
        entry["id"] in entry.get("citation", entry["id"]) for entry in papers().values()
    )

    class Renamed(CJGRPOTrainer, name="Renamed"):
        pass

    assert Renamed._name == "Renamed" and Renamed._paper == paper and Renamed._tag_names == CJGRPOTrainer._tag_names


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
    assert dataset_reference("math")[0] == ["ankner/math-500"]
    hub_ids, text = dataset_reference("openai/gsm8k")
    assert (
        hub_ids == ["openai/gsm8k"]
        and text == "the [openai/gsm8k](https://huggingface.co/datasets/openai/gsm8k) dataset"
    )


class _Loaded(Exception):
    pass


def test_task_datasets_are_the_ones_the_loaders_read(monkeypatch):
    """`TASK_DATASETS` names the Hub dataset each Hub task's training split loads (HumanEval: its only split), and
    no procedural task."""
    read = []

    def record(repo_id, config, split, path=None):
        read.append(repo_id)
        raise _Loaded

    monkeypatch.setattr(hub, "load_hub_dataset", record)
    for name, task in TASKS.items():
        read.clear()
        if not task.procedural:
            with pytest.raises(_Loaded):
                task.load(split="train" if "train" in task.splits else task.splits[0])
        assert tuple(read) == TASK_DATASETS.get(name, ()), name
    assert set(TASK_DATASETS) <= set(TASKS)


def test_base_model_license(tmp_path, monkeypatch):
    """From a local base's card or the Hub's; none when the card declares none or cannot be had."""
    (tmp_path / "base").mkdir()
    assert base_model_license(str(tmp_path / "base")) == ()  # no card
    (tmp_path / "base" / "README.md").write_text("---\nlicense: mit\nlicence: license\n---\n")
    base_model_license.cache_clear()
    assert base_model_license(str(tmp_path / "base")) == (("license", "mit"),)
    fake_hub_card(monkeypatch, tmp_path, "licence: license\n")  # TRL's key: not a license
    assert base_model_license("org/base") == ()

    def offline(repo_id, filename):
        raise model_card_module.EntryNotFoundError("not cached")

    monkeypatch.setattr(model_card_module, "hf_hub_download", offline)
    base_model_license.cache_clear()
    assert base_model_license("org/base") == ()


def test_loading_route_and_remote_code(tmp_path):
    assert loading_route(types.SimpleNamespace(model_type="llada")) == "trl_diffusion"
    assert loading_route(types.SimpleNamespace(model_type="llama")) == "transformers"
    assert loading_route(types.SimpleNamespace(model_type="some_new_dllm")) == "remote_code"
    auto_map = {"AutoConfig": "configuration_x.XConfig", "AutoModel": "modeling_x.XModel"}
    assert not remote_code_loads({}, None) and remote_code_loads(auto_map, None)  # a Hub base holds its code
    (tmp_path / "modeling_x.py").write_text("")
    assert not remote_code_loads(auto_map, str(tmp_path))  # configuration_x.py missing
    (tmp_path / "configuration_x.py").write_text("")
    assert remote_code_loads(auto_map, str(tmp_path))
    assert remote_code_loads({"AutoModel": "org/code--modeling_x.XModel"}, str(tmp_path / "elsewhere"))
    from trl_diffusion import DiffusionGenerationConfig

    snippet = quick_start_snippet("org/model", DiffusionGenerationConfig(), None, route="remote_code")
    assert snippet.count("trust_remote_code=True") == 2 and "import trl_diffusion  #" not in snippet


def test_lora_adapter_card_keeps_peft_metadata_and_its_quick_start_runs(tiny_llada_dir, tmp_path, capsys):
    """The card written after the adapter carries PEFT's metadata (not PEFT's local path as `base_model`, and the
    card's tags kept), and the Auto class loads the adapter on its base; on a local dataset, with a local base whose
    card declares a license."""
    output_dir = tmp_path / "tiny-bgpo-lora"
    args = tiny_grpo_config(BGPOConfig, output_dir, num_mc_samples=2, max_steps=1)
    trainer = tiny_trainer(BGPOTrainer, tiny_llada_dir, args, peft=True)
    trainer.train()
    trainer.save_model()
    card = (output_dir / "README.md").read_text()
    assert "library_name: peft" in card and "- trl-diffusion\n" in card and "trl_diffusion.generate" in card
    assert "a PEFT adapter (`LORA`) for `tiny-llada" in card and "- PEFT: " in card
    assert "load the adapter on its base model. The architecture (`llada`) is a trl_diffusion native" in card
    metadata = card_metadata(output_dir)
    assert metadata["pipeline_tag"] == "text-generation" and {"lora", "generated_from_trainer"} <= set(
        metadata["tags"]
    )
    assert not {"base_model", "base_model_relation", "license", "datasets"} & set(metadata)
    run_quick_start(card, output_dir, capsys)

    base = tmp_path / "published-base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: apache-2.0\n---\n")
    (tmp_path / "my-data").mkdir()
    trainer.model.config._name_or_path = str(base)
    trainer.create_model_card(dataset_name=str(tmp_path / "my-data"))
    metadata = card_metadata(output_dir)
    assert metadata["license"] == "apache-2.0" and metadata["library_name"] == "peft"
    assert not {"base_model", "datasets"} & set(metadata)
    assert "on the local dataset `my-data`" in (output_dir / "README.md").read_text()
