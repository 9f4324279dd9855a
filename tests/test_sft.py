"""Tests of DiffusionSFTTrainer on a tiny native LLaDA (CPU): the loss against an independent hand computation and
against the exact ELBO, what is masked and scored, the noise keys, learning a tiny task well enough for greedy
generation to reproduce it, LoRA, both dataset formats, saving and reloading, and bad input."""

import copy
import random

import numpy as np
import pytest
import torch
from accelerate import Accelerator
from datasets import Dataset
from peft import PeftModel
from transformers import AutoModelForCausalLM
from trl import SFTConfig

from trl_diffusion import DiffusionGenerationConfig, DiffusionSFTConfig, DiffusionSFTTrainer, generate
from trl_diffusion.generation import cut_at_terminator
from trl_diffusion.likelihood import exact_elbo_eps
from trl_diffusion.models import build_tiny_bidirectional_llama, build_tiny_llada, build_tiny_tokenizer
from trl_diffusion.models.tiny import EOT_TOKEN
from trl_diffusion.trainer import sft_trainer
from trl_diffusion.trainer.sft_trainer import DataCollatorForDiffusionSFT, sample_completion_masks

from helpers import lora_config, tiny_config

PROMPTS = ["ab=", "hello=", "x="]
COMPLETIONS = ["ba", "o", "xyz"]


def make_args(output_dir, **overrides) -> DiffusionSFTConfig:
    settings = dict(per_device_train_batch_size=4, max_steps=1, learning_rate=1e-3)
    return tiny_config(DiffusionSFTConfig, output_dir, **{**settings, **overrides})


def standard_dataset(prompts=PROMPTS, completions=COMPLETIONS) -> Dataset:
    return Dataset.from_dict({"prompt": list(prompts), "completion": list(completions)})


def conversational_dataset(prompts=PROMPTS, completions=COMPLETIONS) -> Dataset:
    return Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": prompt}] for prompt in prompts],
            "completion": [[{"role": "assistant", "content": completion}] for completion in completions],
        }
    )


def make_trainer(model, tokenizer, output_dir, dataset=None, **overrides) -> DiffusionSFTTrainer:
    return DiffusionSFTTrainer(
        model=model,
        args=make_args(output_dir, **overrides),
        train_dataset=dataset if dataset is not None else standard_dataset(),
        processing_class=tokenizer,
    )


def first_batch(trainer, size=None) -> dict:
    dataset = trainer.train_dataset
    size = len(dataset) if size is None else size
    return trainer.data_collator([dataset[index] for index in range(size)])


@pytest.fixture
def recorded_noise(monkeypatch):
    """Records every (timesteps, masked) the trainer draws."""
    draws = []

    def recording(*args, **kwargs):
        draws.append(sample_completion_masks(*args, **kwargs))
        return draws[-1]

    monkeypatch.setattr(sft_trainer, "sample_completion_masks", recording)
    return draws


def ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ---------------------------------------------------------------------------------------------- the loss


@pytest.mark.parametrize("family", ["llada", "dream"])
def test_loss_equals_hand_computation(family, tiny_llada, tiny_dream, tiny_tokenizer, tmp_path, recorded_noise):
    """Oracle: each example alone (no padding, the model's own forward, a full log-softmax), the formula written out.
    Dream predicts token i at output i - 1."""
    model = copy.deepcopy(tiny_llada if family == "llada" else tiny_dream).double()
    shift = 1 if family == "dream" else 0
    trainer = make_trainer(model, tiny_tokenizer, tmp_path)
    batch = first_batch(trainer)
    loss = trainer.compute_loss(trainer.model, batch)
    (timesteps, masked), eps = recorded_noise[0], trainer.args.timestep_eps
    assert masked.any() and not masked.all()
    assert ((eps <= timesteps) & (timesteps <= 1)).all()

    eos, mask_id = tiny_tokenizer.eos_token_id, tiny_tokenizer.mask_token_id
    length = max(len(ids(tiny_tokenizer, completion)) + 1 for completion in COMPLETIONS)
    expected = 0.0
    for row, (prompt_text, completion_text) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        prompt = ids(tiny_tokenizer, prompt_text)
        completion = ids(tiny_tokenizer, completion_text) + [eos]
        completion += [eos] * (length - len(completion))  # the EOS fill is part of the canvas
        # The collator's layout: prompt left-padded, completion filled with EOS.
        real = batch["prompt_mask"][row].bool()
        assert batch["prompt_ids"][row][real].tolist() == prompt
        assert (batch["prompt_ids"][row][~real] == tiny_tokenizer.pad_token_id).all()
        assert batch["completion_ids"][row].tolist() == completion

        noisy = [mask_id if masked[row, i] else token for i, token in enumerate(completion)]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + noisy])).logits[0, len(prompt) - shift :][:length]
        log_probs = torch.log_softmax(logits, dim=-1)
        nll = sum(-log_probs[i, token] for i, token in enumerate(completion) if masked[row, i])
        expected += float(nll) / float(timesteps[row]) / length
    expected /= len(PROMPTS)
    torch.testing.assert_close(loss.item(), expected, rtol=1e-6, atol=1e-6)


def test_prompt_and_padding_are_never_masked_or_scored(tiny_llada, tiny_tokenizer, tmp_path, recorded_noise):
    """The canvas the model sees keeps every prompt and padding token; the loss has gradient exactly at the masked
    completion positions (of the hidden states that reach the output head, which then runs at those only)."""
    model = copy.deepcopy(tiny_llada).train()
    prompts = ["a=", "long prompt=", "mid=", "q=", "zz=", "another one="]
    completions = ["abc", "d", "ef", "", "ghij", "k"]
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, standard_dataset(prompts, completions))
    batch = first_batch(trainer)
    seen = {}

    def capture(module, args, kwargs, output):
        seen["input_ids"], seen["attention_mask"] = kwargs["input_ids"], kwargs["attention_mask"]
        seen["head_rows"] = output.logits.shape[0]

    def capture_head_input(module, args):  # registered first: it sees the hidden states before the head's gather
        args[0].retain_grad()
        seen["hidden"] = args[0]

    handle = trainer.model.register_forward_hook(capture, with_kwargs=True)
    head_handle = trainer.model.get_output_embeddings().register_forward_pre_hook(capture_head_input)
    try:
        for _ in range(4):  # four micro-batches, four draws
            trainer.model.zero_grad()
            trainer.compute_loss(trainer.model, batch).backward()
            masked = recorded_noise[-1][1]
            prompt_length = batch["prompt_ids"].shape[1]
            canvas, attention = seen["input_ids"], seen["attention_mask"]
            assert torch.equal(canvas[:, :prompt_length], batch["prompt_ids"])
            assert torch.equal(attention, torch.cat([batch["prompt_mask"], torch.ones_like(masked, dtype=int)], 1))
            completion = canvas[:, prompt_length:]
            assert torch.equal(completion == tiny_tokenizer.mask_token_id, masked)
            assert torch.equal(completion[~masked], batch["completion_ids"][~masked])

            scored = seen["hidden"].grad.abs().sum(-1) != 0
            assert torch.equal(scored[:, -masked.shape[1] :], masked)
            assert not scored[:, : -masked.shape[1]].any()  # prompt positions, if the model kept them
            assert seen["head_rows"] == masked.sum()
    finally:
        handle.remove()
        head_handle.remove()


def test_expected_loss_is_the_negative_elbo(tiny_llada, tiny_tokenizer, tmp_path):
    """E_t E_M[loss] = -B_eps / L, exactly: every mask of a 4-token completion, weighted by its probability under
    t ~ U(eps, 1), against the package's exact ELBO by enumeration."""
    model = copy.deepcopy(tiny_llada).double()
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, standard_dataset(["ab="], ["abc"]))
    example = first_batch(trainer)
    length = example["completion_ids"].shape[1]
    assert length == 4
    masks = torch.tensor([[(m >> i) & 1 for i in range(length)] for m in range(1, 2**length)], dtype=torch.bool)
    batch = {key: value.expand(len(masks), -1) for key, value in example.items()}
    # With t = 1 the loss of a mask M is -S(M) / L.
    losses, _ = trainer.masked_diffusion_loss(trainer.model, batch, torch.ones(len(masks), dtype=torch.float64), masks)

    eps = trainer.args.timestep_eps
    nodes, weights = np.polynomial.legendre.leggauss(32)
    t = (1 - eps) / 2 * nodes + (1 + eps) / 2
    sizes = masks.sum(-1).tolist()
    # P(M) / t integrated over t ~ U(eps, 1): (1 / (1 - eps)) * int_eps^1 t^(|M| - 1) (1 - t)^(L - |M|) dt.
    probabilities = [float((weights * t ** (size - 1) * (1 - t) ** (length - size)).sum()) / 2 for size in sizes]
    expected_loss = float((losses.detach() * torch.tensor(probabilities, dtype=torch.float64)).sum())

    with torch.no_grad():
        elbo = exact_elbo_eps(
            trainer.model,
            trainer.adapter,
            example["prompt_ids"],
            example["prompt_mask"],
            example["completion_ids"],
            torch.ones_like(example["completion_ids"], dtype=torch.bool),
            eps,
        )
    # The package scores in float32, this test in float64.
    torch.testing.assert_close(expected_loss, -float(elbo[0]) / length, rtol=1e-6, atol=1e-6)


def test_batch_without_masked_tokens_backpropagates(tiny_llada, tiny_tokenizer, tmp_path):
    """A batch whose draw masks nothing has loss 0 and still backpropagates through the model (as DDP needs)."""
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path)
    batch = first_batch(trainer)
    nothing = torch.zeros_like(batch["completion_ids"], dtype=torch.bool)
    losses, stats = trainer.masked_diffusion_loss(trainer.model, batch, torch.ones(len(nothing)), nothing)
    assert torch.equal(losses, torch.zeros(len(nothing))) and stats["num_masked"] == 0
    losses.mean().backward()
    assert all(parameter.grad is not None for parameter in trainer.model.parameters())


def test_masking_ratios_and_masks():
    generators = [torch.Generator().manual_seed(row) for row in range(20000)]
    timesteps, masked = sample_completion_masks(16, 1e-3, generators)
    assert timesteps.min() >= 1e-3 and timesteps.max() <= 1
    assert abs(timesteps.mean().item() - (1 + 1e-3) / 2) < 0.01
    rates = masked.float().mean(-1)
    assert abs((rates - timesteps).mean().item()) < 0.005  # E[fraction masked | t] = t
    assert rates[timesteps < 0.1].mean() < 0.1 and rates[timesteps > 0.9].mean() > 0.9


def test_noise_is_private_reproducible_and_keyed(tiny_llada, tiny_tokenizer, tmp_path, monkeypatch):
    def draw(trainer, rows=2):
        return torch.stack([torch.rand(8, generator=row) for row in trainer._noise_generators("train", rows)])

    first, again = (make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path / name) for name in "ab")
    draws = [draw(first), draw(first)]
    assert torch.equal(draws[0], draw(again))  # same seed, same step, same micro-batch: same noise
    assert not torch.equal(draws[0][0], draws[0][1])  # rows draw apart
    assert not torch.equal(draws[0], draws[1])  # the next micro-batch of the step draws afresh
    first.state.global_step += 1
    draws.append(draw(first))
    assert all(not torch.equal(draws[-1], previous) for previous in draws[:-1])
    other_seed = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path / "c", seed=1)
    assert not torch.equal(draws[0], draw(other_seed))

    # Keyed by the row's place in the step's global batch: rank 1 of 2 with 2 rows a micro-batch draws rows 2-3 of
    # one process's batch of 4, and the second micro-batch of 2 with accumulation draws them too.
    one_process = draw(make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path / "d"), rows=4)
    monkeypatch.setattr(Accelerator, "process_index", property(lambda self: 1))
    monkeypatch.setattr(Accelerator, "num_processes", property(lambda self: 2))
    rank_one = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path / "e", per_device_train_batch_size=2)
    assert torch.equal(draw(rank_one), one_process[2:])
    monkeypatch.undo()
    accumulating = make_trainer(
        copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path / "f", per_device_train_batch_size=2
    )
    draw(accumulating)
    assert torch.equal(draw(accumulating), one_process[2:])

    # The global RNG is left alone.
    state = torch.get_rng_state()
    first.model.eval()
    first.compute_loss(first.model, first_batch(first))
    assert torch.equal(state, torch.get_rng_state())

    # Every evaluation sees the same noise: at fixed weights the eval loss repeats exactly.
    trainer = DiffusionSFTTrainer(
        model=copy.deepcopy(tiny_llada),
        args=make_args(tmp_path / "g", per_device_eval_batch_size=2),
        train_dataset=standard_dataset(),
        eval_dataset=standard_dataset(),
        processing_class=tiny_tokenizer,
    )
    first_eval, second_eval = trainer.evaluate(), trainer.evaluate()
    assert first_eval["eval_loss"] == second_eval["eval_loss"]
    assert {"eval_mean_token_accuracy", "eval_entropy", "eval_masked_fraction"} <= set(first_eval)


# ---------------------------------------------------------------------------------------------- training


def test_sft_learns_the_format_and_greedy_generation_reproduces_it(tiny_tokenizer, tmp_path):
    """32 "repeat this string" pairs: the loss falls and greedy decoding of a canvas of `max_completion_length` returns
    the training completions, EOS fill and all (the property the demo relies on)."""
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefgh") for _ in range(rng.randint(2, 4))) for _ in range(32)]
    prompts = [f"{word}=" for word in words]
    model = build_tiny_llada(tiny_tokenizer, seed=0)
    trainer = DiffusionSFTTrainer(
        model=model,
        args=make_args(
            tmp_path,
            max_completion_length=6,
            per_device_train_batch_size=32,
            max_steps=300,
            learning_rate=3e-3,
            lr_scheduler_type="constant",
            logging_steps=25,
        ),
        train_dataset=standard_dataset(prompts, words),
        processing_class=tiny_tokenizer,
    )
    trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert losses[-1] < losses[0] / 5

    model.eval()
    encoded = tiny_tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    output = generate(
        model,
        encoded["input_ids"],
        encoded["attention_mask"],
        generation_config=DiffusionGenerationConfig(max_completion_length=6, block_length=6, diffusion_steps=6),
        adapter=trainer.adapter,
    )
    texts = tiny_tokenizer.batch_decode(
        cut_at_terminator(output.completion_ids, [tiny_tokenizer.eos_token_id]), skip_special_tokens=True
    )
    reproduced = sum(text == word for text, word in zip(texts, words, strict=True))
    print(f"\n[sft] loss {losses[0]:.3f} -> {losses[-1]:.3f}, {reproduced} of 32 reproduced")
    assert reproduced >= 24, list(zip(texts, words, strict=True))


def test_resuming_a_finished_run_trains_nothing(tiny_llada_dir, tmp_path):
    """Resumed at `max_steps` (its last checkpoint), SFT takes no step past it: global step 2, the checkpoint's
    weights unchanged."""
    args = make_args(tmp_path, max_steps=2, save_strategy="steps", save_steps=2, per_device_train_batch_size=1)
    finished = DiffusionSFTTrainer(model=tiny_llada_dir, args=args, train_dataset=standard_dataset())
    finished.train()
    resumed = DiffusionSFTTrainer(
        model=tiny_llada_dir,
        args=make_args(tmp_path, max_steps=2, per_device_train_batch_size=1),
        train_dataset=standard_dataset(),
    )
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.global_step == 2
    final = dict(finished.model.named_parameters())
    assert all(torch.equal(p, final[n]) for n, p in resumed.model.named_parameters())


def test_gradient_accumulation_matches_one_large_batch(tiny_llada, tiny_tokenizer, tmp_path):
    """The loss is the mean over completions and a row's noise is keyed by its place in the step's batch: two
    micro-batches of 2 accumulated take the same SGD step as one batch of 4 (tests/test_distributed.py checks two
    processes against one)."""
    prompts, completions = ["ab=", "hello=", "x=", "pq="], ["ba", "o", "xyz", "qp"]
    steps = {}
    for batch_size, accumulation in ((4, 1), (2, 2)):
        trainer = make_trainer(
            copy.deepcopy(tiny_llada).train(),
            tiny_tokenizer,
            tmp_path / str(batch_size),
            standard_dataset(prompts, completions),
            max_completion_length=4,
            per_device_train_batch_size=batch_size,
            gradient_accumulation_steps=accumulation,
            optim="sgd",
            learning_rate=1.0,
            max_grad_norm=0.0,
        )
        initial = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
        trainer.train()
        steps[batch_size] = {
            name: parameter.detach() - initial[name] for name, parameter in trainer.model.named_parameters()
        }
    for name, step in steps[4].items():
        torch.testing.assert_close(steps[2][name], step, rtol=1e-4, atol=1e-6)


def test_lora_trains_only_the_adapter(tiny_llada, tiny_tokenizer, tmp_path):
    trainer = DiffusionSFTTrainer(
        model=copy.deepcopy(tiny_llada),
        args=make_args(tmp_path, max_steps=2, gradient_checkpointing=True, learning_rate=1e-2),
        train_dataset=conversational_dataset(),
        processing_class=tiny_tokenizer,
        peft_config=lora_config(),
    )
    assert isinstance(trainer.model, PeftModel)
    initial = {name: parameter.detach().clone() for name, parameter in trainer.model.named_parameters()}
    trainable = {name for name, parameter in trainer.model.named_parameters() if parameter.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    trainer.train()
    after = dict(trainer.model.named_parameters())
    assert all(not torch.equal(initial[name], after[name]) for name in trainable)
    assert all(torch.equal(initial[name], after[name]) for name in set(initial) - trainable)
    trainer.save_model(tmp_path / "adapter")
    assert (tmp_path / "adapter" / "adapter_config.json").is_file()


@pytest.mark.parametrize("kind", ["standard", "conversational"])
def test_dataset_formats(kind, tiny_llada, tiny_tokenizer, tmp_path):
    """A plain-text completion ends with EOS; a conversational prompt gets the chat template's generation prompt and
    its completion is the assistant content followed by the end-of-turn token. Either way the canvas is filled with
    EOS up to `max_completion_length`."""
    dataset = standard_dataset() if kind == "standard" else conversational_dataset()
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path, dataset, max_completion_length=5)
    eos = tiny_tokenizer.eos_token_id
    for row, (prompt, completion) in enumerate(zip(PROMPTS, COMPLETIONS, strict=True)):
        example = trainer.train_dataset[row]
        if kind == "standard":
            assert example["prompt_ids"] == ids(tiny_tokenizer, prompt)
            assert example["completion_ids"] == ids(tiny_tokenizer, completion) + [eos]
        else:
            rendered = tiny_tokenizer.apply_chat_template(
                [{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False
            )
            assert example["prompt_ids"] == ids(tiny_tokenizer, rendered)
            assert example["completion_ids"] == ids(tiny_tokenizer, completion + EOT_TOKEN)
    batch = first_batch(trainer)
    assert batch["completion_ids"].shape == (len(PROMPTS), 5)
    for row, example in enumerate(trainer.train_dataset):
        fill = batch["completion_ids"][row, len(example["completion_ids"]) :]
        assert (fill == eos).all()
    trainer.train()
    assert trainer.state.global_step == 1


def test_pretokenized_dataset(tiny_llada, tiny_tokenizer, tmp_path):
    eos = tiny_tokenizer.eos_token_id
    dataset = Dataset.from_dict(
        {
            "prompt_ids": [ids(tiny_tokenizer, prompt) for prompt in PROMPTS],
            "completion_ids": [ids(tiny_tokenizer, completion) + [eos] for completion in COMPLETIONS],
        }
    )
    trainer = make_trainer(copy.deepcopy(tiny_llada), tiny_tokenizer, tmp_path, dataset)
    assert trainer.train_dataset[0] == dataset[0]
    trainer.train()


def test_model_from_path_saves_and_reloads(tiny_llada_dir, tiny_tokenizer, tmp_path):
    """The model and tokenizer load from a path; the trained model reloads with `AutoModelForCausalLM` and computes
    the same logits; the model card names the method and cites LLaDA."""
    trainer = DiffusionSFTTrainer(
        model=tiny_llada_dir, args=make_args(tmp_path / "out", max_steps=2), train_dataset=standard_dataset()
    )
    trainer.train()
    saved = tmp_path / "saved"
    trainer.save_model(saved)
    reloaded = AutoModelForCausalLM.from_pretrained(saved).eval()
    trainer.model.eval()
    canvas = torch.tensor([ids(tiny_tokenizer, "ab=") + [tiny_tokenizer.mask_token_id] * 3])
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=canvas).logits, trainer.model(input_ids=canvas).logits)
    trainer.create_model_card(model_name="tiny-sft")
    card = (tmp_path / "out" / "README.md").read_text()
    assert "DiffusionSFT" in card and "2502.09992" in card


# ---------------------------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "columns, match",
    [
        ({"text": ["hello"]}, "prompt-completion"),
        ({"messages": [[{"role": "user", "content": "hi"}]]}, "split each conversation"),
        ({"prompt": ["hi"]}, "needs `prompt` and `completion`"),
    ],
)
def test_dataset_without_prompt_and_completion_is_refused(columns, match, tiny_llada, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_trainer(tiny_llada, tiny_tokenizer, tmp_path, Dataset.from_dict(columns))


def test_model_without_mask_token_is_refused(tmp_path):
    tokenizer = build_tiny_tokenizer()
    tokenizer.mask_token = None
    model = build_tiny_bidirectional_llama(tokenizer)
    with pytest.raises(ValueError, match="mask token"):
        make_trainer(model, tokenizer, tmp_path)


def test_examples_longer_than_the_context(tiny_tokenizer, tmp_path):
    model = build_tiny_llada(tiny_tokenizer, max_sequence_length=12)
    long_prompt = standard_dataset(["a long prompt of many characters="], ["ok"])
    with pytest.raises(ValueError, match="does not fit the model"):
        make_trainer(model, tiny_tokenizer, tmp_path, long_prompt)
    with pytest.raises(ValueError, match="does not fit the model"):
        make_trainer(model, tiny_tokenizer, tmp_path, standard_dataset(["a="], ["ok"]), max_completion_length=11)
    with pytest.raises(ValueError, match="does not fit the model"):
        make_trainer(model, tiny_tokenizer, tmp_path, standard_dataset(), max_length=5)
    # Truncating prompts from the left makes it fit; the end of the prompt is kept.
    trainer = make_trainer(model, tiny_tokenizer, tmp_path, long_prompt, max_prompt_length=9)
    assert trainer.train_dataset[0]["prompt_ids"] == ids(tiny_tokenizer, "aracters=")
    trainer.train()


def test_completion_longer_than_the_canvas(tiny_llada, tiny_tokenizer, tmp_path):
    with pytest.raises(ValueError, match="longer than `max_completion_length=3`"):
        make_trainer(tiny_llada, tiny_tokenizer, tmp_path, max_completion_length=3)  # "xyz" + EOS is 4 tokens
    collator = DataCollatorForDiffusionSFT(pad_token_id=0, eos_token_id=2, max_completion_length=2)
    with pytest.raises(ValueError, match="longer than `max_completion_length=2`"):
        collator([{"prompt_ids": [5], "completion_ids": [6, 7, 2]}])


def test_collator_checks_each_batch_canvas():
    """Without `max_completion_length` a row's canvas is its prompt plus the batch's longest completion: two examples
    that fit alone can overflow together (streamed datasets are only checked here)."""
    collator = DataCollatorForDiffusionSFT(pad_token_id=0, eos_token_id=2, max_length=5)
    long_prompt, long_completion = (
        {"prompt_ids": [5, 6, 7, 8], "completion_ids": [2]},
        {"prompt_ids": [5], "completion_ids": [6, 7, 2]},
    )
    assert collator([long_prompt])["prompt_ids"].shape == (1, 4)
    assert collator([long_completion])["completion_ids"].shape == (1, 3)
    with pytest.raises(ValueError, match="Row 0 of a batch does not fit the model"):
        collator([long_prompt, long_completion])


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"packing": True}, "packing"),
        ({"padding_free": True}, "padding_free"),
        ({"assistant_only_loss": True}, "assistant_only_loss"),
        ({"completion_only_loss": False}, "completion_only_loss"),
        ({"loss_type": "dft"}, "loss_type"),
        ({"timestep_eps": 0.0}, "timestep_eps"),
        ({"max_completion_length": 0}, "max_completion_length"),
        ({"dataset_kwargs": {"skip_prepare_dataset": True}}, "skip_prepare_dataset"),
    ],
)
def test_invalid_config_is_refused(overrides, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        make_args(tmp_path, **overrides)


def test_plain_sft_config_is_refused(tiny_llada, tiny_tokenizer, tmp_path):
    with pytest.raises(TypeError, match="DiffusionSFTConfig"):
        DiffusionSFTTrainer(
            model=tiny_llada,
            args=SFTConfig(str(tmp_path), use_cpu=True, bf16=False, report_to="none"),
            train_dataset=standard_dataset(),
            processing_class=tiny_tokenizer,
        )
