"""The model card (`README.md`) the trainers write next to a saved model, at every checkpoint, `save_model` and
`push_to_hub`.

TRL's card is written for autoregressive models: its quick start runs `pipeline("text-generation")`, which cannot
decode a masked diffusion model, and a base model loaded from a local directory shows as "[None]". This card names
the base model (its Hub id, or the local directory's name), the algorithm and its paper, the sampler settings of the
training rollouts and the final logged metrics, and its quick start loads the model with the transformers Auto
classes after `import trl_diffusion` and decodes with [`~trl_diffusion.generate`] under those settings.
"""

from __future__ import annotations

import json
import os
from dataclasses import fields
from importlib.metadata import version

from huggingface_hub import ModelCard, ModelCardData
from transformers import is_wandb_available
from trl.trainer.utils import get_comet_experiment_url, get_config_model_id, get_trackio_space_url

from . import __version__
from .generation import DiffusionGenerationConfig
from .tasks import TASKS

if is_wandb_available():
    import wandb

# Metrics shown first in the card's table, when logged; every other metric follows in the order it was first logged.
HEADLINE_METRICS = ("reward", "reward_std", "kl", "loss", "grad_norm", "mean_token_accuracy", "train_loss")
# Log entries that are bookkeeping rather than metrics.
NON_METRICS = ("step", "epoch", "total_flos")
# The prompt of the quick start.
EXAMPLE_QUESTION = "What is 12 + 35?"

CARD_TEMPLATE = """---
{{ card_data }}
---

# Model Card for {{ model_name }}

This model is a fine-tuned version of {{ base_model_text }}{% if dataset_text %} on {{ dataset_text }}{% endif %}. \
It is a masked \
diffusion language model: it fills a canvas of masked tokens in a number of denoising steps instead of writing left \
to right. It was trained with trl_diffusion, built on [TRL](https://github.com/huggingface/trl).

## Quick start

`pipeline("text-generation")` and `model.generate` decode left to right and do not apply. Load the model with the \
transformers Auto classes after `import trl_diffusion` (which registers the native LLaDA and Dream architectures) \
and decode with `trl_diffusion.generate`{% if trained_sampler %}, here with the sampler settings of the training \
rollouts{% endif %}; trl_diffusion must be installed:

```python
{{ snippet }}
```

## Training procedure

{% if wandb_url %}[<img src="https://raw.githubusercontent.com/wandb/assets/main/wandb-github-badge-28.svg" \
alt="Visualize in Weights & Biases" width="150" height="24"/>]({{ wandb_url }})
{% endif %}{% if trackio_url %}[<img src="https://raw.githubusercontent.com/gradio-app/trackio/refs/heads/main/\
trackio/assets/badge.png" alt="Visualize in Trackio" title="Visualize in Trackio" width="150" height="24"/>]\
({{ trackio_url }})
{% endif %}{% if comet_url %}[<img src="https://raw.githubusercontent.com/comet-ml/comet-examples/master/logo/\
comet_badge.png" alt="Visualize in Comet" width="150" height="24"/>]({{ comet_url }})
{% endif %}
This model was trained with {{ trainer_name }}{% if paper_id %}, a method introduced in \
[{{ paper_title }}](https://huggingface.co/papers/{{ paper_id }}){% endif %}.

### Sampler settings

{% if trained_sampler %}The rollouts were decoded with these `DiffusionGenerationConfig` settings (`diffusion_steps` \
as resolved):

| setting | value |
|---|---|
{% for name, value in sampler_settings %}| `{{ name }}` | `{{ value }}` |
{% endfor %}{% else %}{{ trainer_name }} decodes nothing during training; the quick start uses the sampler's default \
settings{% if sft_canvas %} on the training canvas ({{ sft_canvas }} tokens, one block){% endif %}.
{% endif %}
### Final metrics

{% if metrics %}The last logged value of each metric, at its step:

| metric | value | step |
|---|---|---|
{% for name, value, step in metrics %}| `{{ name }}` | {{ value }} | {{ step }} |
{% endfor %}{% else %}No metrics were logged yet.
{% endif %}
### Framework versions

- trl_diffusion: {{ trl_diffusion_version }}
- TRL: {{ trl_version }}
- Transformers: {{ transformers_version }}
- Pytorch: {{ pytorch_version }}
- Datasets: {{ datasets_version }}
- Tokenizers: {{ tokenizers_version }}

## Citations

{% if trainer_citation %}Cite {{ trainer_name }} as:

```bibtex
{{ trainer_citation }}
```

{% endif %}Cite TRL as:

```bibtex
{% raw %}@software{vonwerra2020trl,
  title   = {{TRL: Transformers Reinforcement Learning}},
  author  = {von Werra, Leandro and Belkada, Younes and Tunstall, Lewis and Beeching, Edward and Thrush, Tristan \
and Lambert, Nathan and Huang, Shengyi and Rasul, Kashif and Gallouédec, Quentin},
  license = {Apache-2.0},
  url     = {https://github.com/huggingface/trl},
  year    = {2020}
}{% endraw %}
```
"""

SNIPPET_TEMPLATE = """\
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import trl_diffusion  # registers the LLaDA and Dream architectures with the Auto classes
from trl_diffusion import DiffusionAdapter, DiffusionGenerationConfig, cut_at_terminator, generate

model_id = "{model_id}"  # or the local directory that holds this card
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto", device_map="auto").eval()
adapter = DiffusionAdapter.from_model(model, tokenizer{mask_token_argument})  # mask token and terminators

{prompt_lines}
# temperature=0.0 decodes greedily
config = DiffusionGenerationConfig({sampler_arguments})
with torch.no_grad():
    output = generate(
        model, inputs["input_ids"], inputs["attention_mask"], generation_config=config, adapter=adapter
    )
completion = cut_at_terminator(output.completion_ids, adapter.terminator_ids)[0]
print(tokenizer.decode(completion, skip_special_tokens=True))"""

CHAT_PROMPT = """\
messages = [{{"role": "user", "content": {question}}}]
inputs = tokenizer.apply_chat_template(
    messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
).to(model.device)"""

TEXT_PROMPT = """\
inputs = tokenizer([{question}], return_tensors="pt").to(model.device)"""


def base_model_reference(model_config) -> tuple[str | None, str]:
    """The base model of a card: `(Hub id or None, text for the card)`.

    Args:
        model_config (`PretrainedConfig`):
            The trained model's config; its `_name_or_path` is the path or Hub id the model was loaded from.

    Returns:
        `tuple[str | None, str]`: the Hub id (`None` for a local directory or a model built in memory, which the
        Hub's `base_model` field cannot hold) and the card's text: a link to the Hub page, the local directory's
        name, or "a model built in memory".
    """
    name_or_path = get_config_model_id(model_config)
    if not name_or_path:
        return None, "a model built in memory"
    if os.path.isdir(name_or_path):
        return None, f"`{os.path.basename(os.path.normpath(name_or_path))}` (loaded from a local directory)"
    return name_or_path, f"[{name_or_path}](https://huggingface.co/{name_or_path})"


def dataset_reference(dataset_name: str | None) -> tuple[str | None, str | None]:
    """The training data of a card: `(Hub id or None, text for the card or None)`.

    Args:
        dataset_name (`str`, *optional*):
            A Hub id, a local directory, or the name of a built-in task (`trl-diffusion bgpo --dataset_name
            countdown`), which the Hub's `datasets` field cannot hold.
    """
    if dataset_name is None:
        return None, None
    if dataset_name in TASKS:
        return None, f"the built-in `{dataset_name}` task of trl_diffusion"
    if os.path.isdir(dataset_name):
        return None, f"the local dataset `{os.path.basename(os.path.normpath(dataset_name))}`"
    return dataset_name, f"the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset"


def card_sampler(args) -> tuple[bool, DiffusionGenerationConfig]:
    """The sampler of the card: `(whether training decoded with it, its config)`.

    Args:
        args (`DiffusionRLConfig` or `DiffusionSFTConfig`):
            The trainer's config. An RL config's rollouts decode with `args.to_generation_config()`; an SFT config
            decodes nothing, and the card's sampler is the default one on its `max_completion_length` canvas (one
            block) when that is set.
    """
    if hasattr(args, "to_generation_config"):
        return True, args.to_generation_config()
    length = getattr(args, "max_completion_length", None)
    if length is None:
        return False, DiffusionGenerationConfig()
    return False, DiffusionGenerationConfig(max_completion_length=length, block_length=length)


def sampler_arguments(config: DiffusionGenerationConfig) -> dict:
    """The keyword arguments that rebuild `config`: the canvas, block, steps (resolved) and temperature, and every
    other field that differs from its default (`record_steps` and `seed` left out)."""
    defaults = DiffusionGenerationConfig()
    arguments = {
        "max_completion_length": config.max_completion_length,
        "block_length": config.block_length,
        "diffusion_steps": config.num_steps,
        "temperature": config.temperature,
    }
    for field in fields(DiffusionGenerationConfig):
        value = getattr(config, field.name)
        if field.name not in (*arguments, "record_steps", "seed") and value != getattr(defaults, field.name):
            arguments[field.name] = value
    return arguments


def final_metrics(log_history: list[dict]) -> list[tuple[str, str, int]]:
    """The last logged value of each numeric metric of `log_history` (`trainer.state.log_history`), as
    `(name, formatted value, step)`: [`HEADLINE_METRICS`] first, then every `eval/...` metric (the task accuracy of
    [`~trl_diffusion.TaskEvaluationCallback`]), then the others in the order they were first logged."""
    last = {}
    for entry in log_history:
        for name, value in entry.items():
            if name not in NON_METRICS and isinstance(value, (int, float)) and not isinstance(value, bool):
                last[name] = (f"{value:.4g}", entry.get("step", 0))
    headline = [name for name in HEADLINE_METRICS if name in last]
    evaluation = [name for name in last if name.startswith("eval/") and name not in headline]
    order = headline + evaluation + [name for name in last if name not in headline and name not in evaluation]
    return [(name, *last[name]) for name in order]


def quick_start_snippet(model_id: str, config: DiffusionGenerationConfig, tokenizer, mask_token_id=None) -> str:
    """The card's quick start: load `model_id`, decode one prompt with `config`, print the completion.

    Args:
        model_id (`str`):
            Hub id (or directory) the snippet loads.
        config ([`DiffusionGenerationConfig`]):
            The sampler settings written into the snippet.
        tokenizer (`PreTrainedTokenizerBase`, *optional*):
            The model's tokenizer: with a chat template, the prompt is one user message through it; else plain text.
        mask_token_id (`int`, *optional*):
            The training config's explicit mask token, passed on to `DiffusionAdapter.from_model`.
    """
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompt = (CHAT_PROMPT if chat else TEXT_PROMPT).format(question=json.dumps(EXAMPLE_QUESTION))
    arguments = ", ".join(f"{name}={value!r}" for name, value in sampler_arguments(config).items())
    return SNIPPET_TEMPLATE.format(
        model_id=model_id,
        mask_token_argument="" if mask_token_id is None else f", mask_token_id={mask_token_id}",
        prompt_lines=prompt,
        sampler_arguments=arguments,
    )


def generate_model_card(trainer, model_name: str | None, dataset_name: str | None, tags: list[str]) -> ModelCard:
    """The model card of `trainer`'s model.

    Args:
        trainer (`DiffusionRLTrainer` or `DiffusionSFTTrainer`):
            The trainer: its model's config (the base model), `args` (the sampler), `state.log_history` (the
            metrics), `_name` and `_paper` (the algorithm), `processing_class` (the snippet's prompt).
        model_name (`str`, *optional*):
            Name of the trained model.
        dataset_name (`str`, *optional*):
            The training dataset: a Hub id, a local directory or a built-in task ([`dataset_reference`]).
        tags (`list[str]`):
            The card's tags, besides `generated_from_trainer`.
    """
    from .trainer.base_config import SAMPLER_FIELDS  # here: the trainers import this module

    base_model, base_model_text = base_model_reference(trainer.model.config)
    dataset, dataset_text = dataset_reference(dataset_name)
    trained_sampler, config = card_sampler(trainer.args)
    settings = [
        (name, config.num_steps if name == "diffusion_steps" else getattr(config, name)) for name in SAMPLER_FIELDS
    ]
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    snippet = quick_start_snippet(
        trainer.hub_model_id or model_name, config, tokenizer, getattr(trainer.args, "mask_token_id", None)
    )
    card_data = ModelCardData(
        base_model=base_model,
        datasets=dataset,
        library_name="transformers",
        licence="license",
        model_name=model_name,
        tags=["generated_from_trainer", *tags],
    )
    return ModelCard.from_template(
        card_data,
        template_str=CARD_TEMPLATE,
        model_name=model_name,
        base_model_text=base_model_text,
        dataset_text=dataset_text,
        trained_sampler=trained_sampler,
        sampler_settings=settings,
        sft_canvas=getattr(trainer.args, "max_completion_length", None),
        snippet=snippet,
        metrics=final_metrics(trainer.state.log_history),
        wandb_url=wandb.run.url if is_wandb_available() and wandb.run is not None else None,
        trackio_url=get_trackio_space_url(),
        comet_url=get_comet_experiment_url(),
        trainer_name=trainer._name,
        trainer_citation=trainer._paper.get("citation"),
        paper_title=trainer._paper.get("title"),
        paper_id=trainer._paper.get("id"),
        trl_diffusion_version=__version__,
        trl_version=version("trl"),
        transformers_version=version("transformers"),
        pytorch_version=version("torch"),
        datasets_version=version("datasets"),
        tokenizers_version=version("tokenizers"),
    )


class DiffusionModelCardMixin:
    """For the trainers (a TRL trainer subclass): the diffusion model card ([`generate_model_card`]) instead of
    TRL's, written to `args.output_dir` by `create_model_card` (at each checkpoint and push, as TRL does) and to the
    saved directory by `save_model`, before the weights, so that PEFT adds its adapter metadata to it."""

    def create_model_card(
        self,
        model_name: str | None = None,
        dataset_name: str | None = None,
        tags: str | list[str] | None = None,
    ):
        """Writes the diffusion model card to `args.output_dir/README.md`.

        Args:
            model_name (`str`, *optional*):
                Name of the model.
            dataset_name (`str`, *optional*):
                Name of the dataset used for training.
            tags (`str` or `list[str]`, *optional*):
                Tags to be associated with the model card, besides the trainer's own (`_tag_names`).
        """
        self._write_model_card(self.args.output_dir, model_name, dataset_name, tags)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False):
        """Writes the model card to the directory, then saves the model there as `Trainer.save_model` does."""
        self._write_model_card(output_dir or self.args.output_dir)
        super().save_model(output_dir, _internal_call)

    def _write_model_card(self, directory, model_name=None, dataset_name=None, tags=None) -> None:
        if not self.is_world_process_zero():
            return
        if model_name is None:
            hub_model_id = self.args.hub_model_id
            model_name = (
                hub_model_id.split("/")[-1]
                if hub_model_id
                else os.path.basename(os.path.normpath(self.args.output_dir))
            )
        tags = {tags} if isinstance(tags, str) else set(tags or ())
        tags.update(self._tag_names)
        if "JOB_ID" in os.environ:
            tags.add("hf_jobs")
        card = generate_model_card(self, model_name, dataset_name, sorted(tags))
        os.makedirs(directory, exist_ok=True)
        card.save(os.path.join(directory, "README.md"))
