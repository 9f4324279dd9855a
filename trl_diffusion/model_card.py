"""The model card (`README.md`) the trainers write next to a saved model, at every checkpoint, `save_model` and
`push_to_hub`.

TRL's card is written for autoregressive models: its quick start runs `pipeline("text-generation")`, which cannot
decode a masked diffusion model, and a base model loaded from a local directory shows as "[None]". This card names
the base model (its Hub id, or the local directory's name), the algorithm and its paper, the sampler settings of the
training rollouts and the final logged metrics, and its quick start loads the model with the transformers Auto
classes after `import trl_diffusion` and decodes with [`~trl_diffusion.generate`] under those settings.

Its metadata is the Hub's: `license` (the base model's, as its card declares it; TRL writes `licence`, which the Hub
ignores), `library_name` (`transformers`, or `peft` for an adapter), `pipeline_tag`, `base_model` with
`base_model_relation`, the Hub ids of the training data (a built-in task's too), and TRL's tags (`trackio:` URL,
`unsloth`, `hf_jobs`) beside the trainer's; `custom_code` when the published modeling code loads it.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import fields
from functools import cache
from importlib.metadata import version
from pathlib import Path

import yaml
from accelerate.utils import is_peft_model
from huggingface_hub import ModelCard, ModelCardData, hf_hub_download, metadata_load
from huggingface_hub.errors import EntryNotFoundError, HfHubHTTPError, HFValidationError
from transformers import CONFIG_MAPPING, is_wandb_available
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
# `DiffusionGenerationConfig` fields that belong to one call rather than to the sampler's settings: left out of the
# card's table and snippet.
PER_CALL_FIELDS = ("record_steps", "record_commit_logprobs", "seed")
# The Hub datasets each built-in Hub task trains on (its `train` split; HumanEval has only `test`), for the card's
# `datasets`; the procedural tasks generate their data and have none. tests/test_model_card.py checks it against
# the loaders in `tasks/hub.py`.
TASK_DATASETS = {
    "gsm8k": ("openai/gsm8k",),
    "math": ("ankner/math-500",),
    "mbpp": ("google-research-datasets/mbpp",),
    "humaneval": ("openai/openai_humaneval",),
}
# The base model's license keys the card carries over (`license_name` and `license_link` go with `license: other`).
LICENSE_KEYS = ("license", "license_name", "license_link")

CARD_TEMPLATE = """---
{{ card_data }}
---

# Model Card for {{ model_name }}

This model is {{ model_kind }} {{ base_model_text }}{% if dataset_text %} on {{ dataset_text }}{% endif %}. \
{% if encoder_decoder %}It is a DiffusionGemma block-diffusion model: an encoder reads the prompt and a decoder \
denoises canvases of uniformly noised tokens{% else %}It is a masked \
diffusion language model: it fills a canvas of masked tokens in a number of denoising steps instead of writing left \
to right{% endif %}. It was trained with trl_diffusion, built on [TRL](https://github.com/huggingface/trl).

## Quick start

{% if encoder_decoder %}{{ loading_text }} Decode with transformers' own `model.generate` (DiffusionGemma's \
sampler), or with `trl_diffusion.generation.generate_diffusion_gemma`, which draws the same tokens from \
a generator{% if adapter %}; PEFT must be installed{% endif %}:
{% else %}`pipeline("text-generation")` and `model.generate` decode left to right and do not apply. \
{{ loading_text }} Decode with `trl_diffusion.generate`{% if trained_sampler %}, here with the sampler settings of \
the training rollouts{% endif %}; trl_diffusion must be installed{% if adapter %}, and PEFT{% endif %}:
{% endif %}
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

{% if encoder_decoder %}The rollouts (if any) were decoded with DiffusionGemma's own sampler \
(`generate_diffusion_gemma`, the released generation settings, the trainer's `diffusion_steps` shared by the \
canvases as `max_denoising_steps`).
{% elif trained_sampler %}The rollouts were decoded with these `DiffusionGenerationConfig` settings (`diffusion_steps` \
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
{% if peft_version %}- PEFT: {{ peft_version }}
{% endif %}- TRL: {{ trl_version }}
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

{trl_diffusion_import}from trl_diffusion import DiffusionAdapter, DiffusionGenerationConfig, cut_at_terminator, generate

model_id = "{model_id}"  # or the local directory that holds this card
tokenizer = AutoTokenizer.from_pretrained(model_id{remote_code_argument})
model = AutoModelForCausalLM.from_pretrained(model_id, dtype="auto", device_map="auto"{remote_code_argument}).eval()
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

ENCODER_DECODER_SNIPPET = """\
from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

model_id = "{model_id}"  # or the local directory that holds this card
tokenizer = AutoTokenizer.from_pretrained(model_id)
model = DiffusionGemmaForBlockDiffusion.from_pretrained(model_id, dtype="auto", device_map="auto").eval()

{prompt_lines}
output = model.generate(inputs["input_ids"], max_new_tokens=model.config.canvas_length)
print(tokenizer.decode(output.sequences[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True))"""

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


# The trainers' papers, one BibTeX entry each (package data, next to this module).
PAPERS_FILE = Path(__file__).with_name("papers.bib")
BIBTEX_ENTRY = re.compile(r"^@\w+\{[^,\n]+,\n.*?^\}", re.MULTILINE | re.DOTALL)


def bibtex_field(entry: str, name: str) -> str | None:
    """The value of field `name` of a BibTeX `entry` written one field a line, its braces stripped; None if absent."""
    match = re.search(rf"^\s*{name}\s*=\s*\{{+(.*?)\}}+,?\s*$", entry, re.MULTILINE)
    return match.group(1) if match else None


@cache
def papers() -> dict[str, dict[str, str]]:
    """arXiv id -> the paper of `papers.bib` with that `eprint`, as a trainer's `_paper` (TRL's layout, which its
    model card reads): `title`, `id` and, when the entry names its authors, `citation` (the entry's text)."""
    table = {}
    for match in BIBTEX_ENTRY.finditer(PAPERS_FILE.read_text()):
        entry = match.group(0)
        arxiv_id = bibtex_field(entry, "eprint").removeprefix("arXiv:")
        table[arxiv_id] = {"title": bibtex_field(entry, "title"), "id": arxiv_id}
        if bibtex_field(entry, "author") is not None:
            table[arxiv_id]["citation"] = entry
    return table


def paper_entry(arxiv_id: str) -> dict[str, str]:
    """A trainer's `_paper` (its class keyword `paper=arxiv_id`): the entry of `papers.bib` for `arxiv_id`, a copy."""
    return dict(papers()[arxiv_id])


def dataset_reference(dataset_name: str | None) -> tuple[list[str] | None, str | None]:
    """The training data of a card: `(Hub dataset ids or None, text for the card or None)`.

    Args:
        dataset_name (`str`, *optional*):
            A Hub id, a local path, or the name of a built-in task (`trl-diffusion bgpo --dataset_name countdown`):
            a Hub task gives the Hub datasets it loads ([`TASK_DATASETS`]), a procedural task or a local path none
            (the Hub's `datasets` field holds Hub ids only).
    """
    if dataset_name is None:
        return None, None
    if dataset_name in TASKS:
        hub_ids = TASK_DATASETS.get(dataset_name)
        text = f"the built-in `{dataset_name}` task of trl_diffusion"
        if hub_ids is None:
            return None, text
        links = ", ".join(f"[{hub_id}](https://huggingface.co/datasets/{hub_id})" for hub_id in hub_ids)
        return list(hub_ids), f"{text} ({links})"
    if os.path.exists(dataset_name):
        return None, f"the local dataset `{os.path.basename(os.path.normpath(dataset_name))}`"
    return [dataset_name], f"the [{dataset_name}](https://huggingface.co/datasets/{dataset_name}) dataset"


@cache
def base_model_license(name_or_path: str) -> tuple[tuple[str, str], ...]:
    """The license metadata of the base model's card, as `(key, value)` pairs of [`LICENSE_KEYS`]: from the
    `README.md` of its local directory, or of its Hub repository (the cache, else the Hub; once per process). Empty
    when there is no card, it declares no license, or it cannot be read: the card then has no `license`.

    Args:
        name_or_path (`str`):
            The base model's local directory or Hub id.
    """
    if os.path.isdir(name_or_path):
        path = os.path.join(name_or_path, "README.md")
        if not os.path.isfile(path):
            return ()
    else:
        try:
            path = hf_hub_download(name_or_path, "README.md")
        except (EntryNotFoundError, HfHubHTTPError, HFValidationError, OSError):
            return ()  # offline and not cached, no such repository, gated, or no card
    try:
        metadata = metadata_load(path) or {}
    except yaml.YAMLError:
        return ()
    return tuple((key, metadata[key]) for key in LICENSE_KEYS if metadata.get(key))


def loading_route(model_config) -> str:
    """How the transformers Auto classes find the architecture of `model_config`: `"trl_diffusion"` (a native class,
    registered by `import trl_diffusion`), `"transformers"` (one of transformers' own) or `"remote_code"` (neither: only
    the published modeling code loads it, with `trust_remote_code=True`)."""
    model_type = getattr(model_config, "model_type", None)
    if model_type not in CONFIG_MAPPING:
        return "remote_code"
    return "trl_diffusion" if CONFIG_MAPPING[model_type].__module__.startswith("trl_diffusion.") else "transformers"


def remote_code_loads(auto_map, directory: str | None) -> bool:
    """Whether `trust_remote_code=True` loads a checkpoint whose config has `auto_map`: it names modeling code and
    every module it names is in `directory` (or in another repository, `repo--module.Class`). `directory=None`: a
    published Hub repository, which holds the code its `auto_map` names."""
    references = [
        reference
        for value in (auto_map or {}).values()
        for reference in (value if isinstance(value, (list, tuple)) else [value])
        if reference
    ]
    if not references:
        return False
    return directory is None or all(
        "--" in reference or os.path.isfile(os.path.join(directory, reference.rsplit(".", 1)[0] + ".py"))
        for reference in references
    )


def saved_auto_map(directory: str | None):
    """The `auto_map` of the `config.json` saved in `directory`, or `None` (no saved config, or no `auto_map`)."""
    path = os.path.join(directory, "config.json") if directory else None
    if path is None or not os.path.isfile(path):
        return None
    with open(path) as file:
        return json.load(file).get("auto_map")


def loading_text(route: str, model_type: str, remote_code: bool, adapter: str | None) -> str:
    """The card's sentences on how the model loads: its architecture's route ([`loading_route`]), whether the
    published modeling code loads it too, and, for an adapter (`adapter`: its PEFT method), that it loads on its
    base."""
    architecture = f"The architecture (`{model_type}`)"
    if route == "trl_diffusion":
        text = (
            f"{architecture} is a trl_diffusion native class: load the model with the transformers Auto classes "
            "after `import trl_diffusion`, which registers it."
        )
    elif route == "transformers":
        text = f"{architecture} is one of transformers' own: the transformers Auto classes load the model."
    else:
        text = (
            f"{architecture} is neither transformers' nor trl_diffusion's: its published modeling code loads the "
            "model, with `trust_remote_code=True`."
        )
    if remote_code and route != "remote_code":
        text += (
            " The published modeling code (`auto_map`) loads it too, on transformers alone: `trust_remote_code=True`."
        )
    if adapter:
        text = f"The Auto classes load the adapter on its base model. {text}"
    return text


def card_sampler(trainer) -> tuple[bool, DiffusionGenerationConfig]:
    """The sampler of the card: `(whether training decoded with it, its config)`.

    Args:
        trainer (`DiffusionRLTrainer` or `DiffusionSFTTrainer`):
            The trainer. An RL trainer's rollouts decode with its `diffusion_generation_config` (the settings resolved
            for its model, `generation_cache` included); an SFT trainer decodes nothing, and the card's sampler is the
            default one on its config's `max_completion_length` canvas (one block) when that is set.
    """
    if getattr(trainer, "diffusion_generation_config", None) is not None:
        return True, trainer.diffusion_generation_config
    args = trainer.args
    length = getattr(args, "max_completion_length", None)
    if length is None:
        return False, DiffusionGenerationConfig()
    return False, DiffusionGenerationConfig(max_completion_length=length, block_length=length)


def sampler_arguments(config: DiffusionGenerationConfig) -> dict:
    """The keyword arguments that rebuild `config`: the canvas, block, steps (resolved) and temperature, and every
    other field that differs from its default ([`PER_CALL_FIELDS`] left out)."""
    defaults = DiffusionGenerationConfig()
    arguments = {
        "max_completion_length": config.max_completion_length,
        "block_length": config.block_length,
        "diffusion_steps": config.num_steps,
        "temperature": config.temperature,
    }
    for field in fields(DiffusionGenerationConfig):
        value = getattr(config, field.name)
        if field.name not in (*arguments, *PER_CALL_FIELDS) and value != getattr(defaults, field.name):
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


def quick_start_snippet(
    model_id: str, config: DiffusionGenerationConfig, tokenizer, mask_token_id=None, route: str = "trl_diffusion"
) -> str:
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
        route (`str`, *optional*, defaults to `"trl_diffusion"`):
            How the Auto classes find the architecture ([`loading_route`]): `"trl_diffusion"` imports the package
            first, `"remote_code"` passes `trust_remote_code=True`.
    """
    chat = getattr(tokenizer, "chat_template", None) is not None
    prompt = (CHAT_PROMPT if chat else TEXT_PROMPT).format(question=json.dumps(EXAMPLE_QUESTION))
    arguments = ", ".join(f"{name}={value!r}" for name, value in sampler_arguments(config).items())
    return SNIPPET_TEMPLATE.format(
        model_id=model_id,
        trl_diffusion_import=(
            "import trl_diffusion  # registers the architecture with the transformers Auto classes\n"
            if route == "trl_diffusion"
            else ""
        ),
        remote_code_argument=", trust_remote_code=True" if route == "remote_code" else "",
        mask_token_argument="" if mask_token_id is None else f", mask_token_id={mask_token_id}",
        prompt_lines=prompt,
        sampler_arguments=arguments,
    )


def generate_model_card(
    trainer, model_name: str | None, dataset_name: str | None, tags: list[str], directory: str | None = None
) -> ModelCard:
    """The model card of `trainer`'s model.

    Args:
        trainer (`DiffusionRLTrainer` or `DiffusionSFTTrainer`):
            The trainer: its model (the base model, whether it is a PEFT adapter, how it loads), `args` (the
            sampler), `state.log_history` (the metrics), `_name` and `_paper` (the algorithm), `processing_class`
            (the snippet's prompt).
        model_name (`str`, *optional*):
            Name of the trained model.
        dataset_name (`str`, *optional*):
            The training dataset: a Hub id, a local path or a built-in task ([`dataset_reference`]).
        tags (`list[str]`):
            The card's tags, besides `generated_from_trainer` and those of the model (`custom_code`, the PEFT
            method).
        directory (`str`, *optional*):
            Where the card goes: a full model saved there loads with its modeling code only if its `config.json`'s
            `auto_map` names files there ([`remote_code_loads`]).
    """
    model_config = trainer.model.config
    base_model, base_model_text = base_model_reference(model_config)
    base_path = get_config_model_id(model_config)
    datasets, dataset_text = dataset_reference(dataset_name)
    trained_sampler, config = card_sampler(trainer)
    # The sampler's own fields, not the trainer config's: this module sits below the trainer layer.
    settings = [
        (field.name, config.num_steps if field.name == "diffusion_steps" else getattr(config, field.name))
        for field in fields(DiffusionGenerationConfig)
        if field.name not in PER_CALL_FIELDS
    ]
    adapter = str(trainer.model.active_peft_config.peft_type.value) if is_peft_model(trainer.model) else None
    route = loading_route(model_config)
    if adapter:
        # The adapter loads on its base: a Hub base holds the code its `auto_map` names, a local one is checked.
        remote_code = remote_code_loads(
            getattr(model_config, "auto_map", None), base_path if os.path.isdir(base_path or "") else None
        )
    else:
        remote_code = remote_code_loads(saved_auto_map(directory), directory)
    tokenizer = getattr(trainer.processing_class, "tokenizer", trainer.processing_class)
    encoder_decoder = model_config.model_type == "diffusion_gemma"
    if encoder_decoder:
        chat = getattr(tokenizer, "chat_template", None) is not None
        snippet = ENCODER_DECODER_SNIPPET.format(
            model_id=trainer.hub_model_id or model_name,
            prompt_lines=(CHAT_PROMPT if chat else TEXT_PROMPT).format(question=json.dumps(EXAMPLE_QUESTION)),
        )
    else:
        snippet = quick_start_snippet(
            trainer.hub_model_id or model_name, config, tokenizer, getattr(trainer.args, "mask_token_id", None), route
        )
    model_tags = (["custom_code"] if remote_code else []) + (["transformers", adapter.lower()] if adapter else [])
    card_data = ModelCardData(
        base_model=base_model,
        # The Hub's relations: adapter, finetune, merge, quantized. A local base has no Hub id to relate to.
        base_model_relation=("adapter" if adapter else "finetune") if base_model else None,
        datasets=datasets,
        library_name="peft" if adapter else "transformers",
        pipeline_tag="text-generation",
        model_name=model_name,
        tags=["generated_from_trainer", *tags, *model_tags],
        **dict(base_model_license(base_path) if base_path else ()),
    )
    trackio_url = get_trackio_space_url()
    return ModelCard.from_template(
        card_data,
        template_str=CARD_TEMPLATE,
        model_name=model_name,
        model_kind=f"a PEFT adapter (`{adapter}`) for" if adapter else "a fine-tuned version of",
        base_model_text=base_model_text,
        dataset_text=dataset_text,
        loading_text=loading_text(route, model_config.model_type, remote_code, adapter),
        adapter=adapter,
        encoder_decoder=encoder_decoder,
        trained_sampler=trained_sampler,
        sampler_settings=settings,
        sft_canvas=getattr(trainer.args, "max_completion_length", None),
        snippet=snippet,
        metrics=final_metrics(trainer.state.log_history),
        wandb_url=wandb.run.url if is_wandb_available() and wandb.run is not None else None,
        trackio_url=trackio_url,
        comet_url=get_comet_experiment_url(),
        trainer_name=trainer._name,
        trainer_citation=trainer._paper.get("citation"),
        paper_title=trainer._paper.get("title"),
        paper_id=trainer._paper.get("id"),
        trl_diffusion_version=__version__,
        peft_version=version("peft") if adapter else None,
        trl_version=version("trl"),
        transformers_version=version("transformers"),
        pytorch_version=version("torch"),
        datasets_version=version("datasets"),
        tokenizers_version=version("tokenizers"),
    )


class DiffusionModelCardMixin:
    """For the trainers (a TRL trainer subclass): the diffusion model card ([`generate_model_card`]) instead of
    TRL's, written to `args.output_dir` by `create_model_card` (at each checkpoint and push, as TRL does) and to the
    saved directory by `save_model`, after the weights: it replaces the metadata PEFT writes with an adapter (PEFT
    would set a local base's path as `base_model` and drop the card's tags) and carries PEFT's own (`library_name:
    peft`, `pipeline_tag`, the method's tag, its version), since `push_to_hub` rewrites it with `create_model_card`
    anyway.

    A trainer class names its method in its class statement, `class CJGRPOTrainer(TrajectoryRLTrainer,
    name="CJGRPO", tags=("cj-grpo",), paper="2509.23924")`, and gets the attributes TRL's card code reads: `_name`,
    `_tag_names` (the package's tags, then `tags`) and `_paper` ([`paper_entry`] of the arXiv id, from `papers.bib`). A
    keyword left out keeps the parent's value."""

    _tag_names = ["trl", "trl-diffusion", "diffusion-lm"]

    def __init_subclass__(cls, *, name: str | None = None, tags=None, paper: str | None = None, **kwargs):
        super().__init_subclass__(**kwargs)
        if name is not None:
            cls._name = name
        if tags is not None:
            cls._tag_names = [*DiffusionModelCardMixin._tag_names, *tags]
        if paper is not None:
            cls._paper = paper_entry(paper)

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
        """Saves the model as `Trainer.save_model` does, then writes the model card to the directory."""
        super().save_model(output_dir, _internal_call)
        self._write_model_card(output_dir or self.args.output_dir)

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
        # TRL's tags (its `create_model_card`): the trainer's, `unsloth`, `hf_jobs`, and one `trackio:` tag with the
        # current run's URL in place of any earlier one.
        tags = {tags} if isinstance(tags, str) else set(tags or ())
        tags.update(self._tag_names)
        if hasattr(self.model.config, "unsloth_version"):
            tags.add("unsloth")
        if "JOB_ID" in os.environ:
            tags.add("hf_jobs")
        trackio_url = get_trackio_space_url()
        if trackio_url is not None:
            tags = {tag for tag in tags if not tag.startswith("trackio:")}
            tags.add(f"trackio:{trackio_url}")
        card = generate_model_card(self, model_name, dataset_name, sorted(tags), directory)
        os.makedirs(directory, exist_ok=True)
        card.save(os.path.join(directory, "README.md"))
