"""The lm-evaluation-harness model (`trl_diffusion.harness.DiffusionLM`), offline: two harness tasks defined by YAML
files over a local JSONL file (tests/data/), on the tiny LLaDA. Its generations equal `evaluate_task`'s decoding of
the same prompts with the same sampler, and its log-likelihoods equal the package's ELBO estimate under the same
masks."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import lm_eval
import pytest
import torch
from datasets import Dataset
from lm_eval.api.instance import Instance
from lm_eval.tasks import TaskManager
from peft import get_peft_model
from transformers import AutoModelForCausalLM

from trl_diffusion import DiffusionGenerationConfig, generate, harness
from trl_diffusion.cli import main, resolve_accelerate_config
from trl_diffusion.evaluation import evaluate_task
from trl_diffusion.harness import DiffusionLM
from trl_diffusion.likelihood import elbo_terms
from trl_diffusion.masking import sample_masks
from trl_diffusion.tasks import TASKS, Task

from helpers import lora_config

DATA = Path(__file__).parent / "data"
GENERATE_TASK, CHOICE_TASK = "trl_diffusion_tiny_generate", "trl_diffusion_tiny_choice"
STOP = "W"  # the `until` of tiny_generate.yaml
SAMPLER = dict(max_completion_length=16, block_length=8, diffusion_steps=8)
ROWS = [json.loads(line) for line in (DATA / "tiny_qa.jsonl").read_text().splitlines()]


@pytest.fixture
def in_data_dir(monkeypatch):
    """The YAML files name their JSONL file relative to the working directory."""
    monkeypatch.chdir(DATA)


def run_harness(lm, tasks):
    return lm_eval.simple_evaluate(
        model=lm,
        tasks=tasks,
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),  # only the two test tasks: fast
        log_samples=True,
        bootstrap_iters=0,
    )


def tiny_qa_task() -> Task:
    """tiny_qa.jsonl's questions as a package task with string prompts, scored by nothing (the completions are
    compared)."""
    return Task(
        name="tiny_qa",
        description="tests/data/tiny_qa.jsonl",
        loader=None,
        reward_funcs=(),
        accuracy_func=lambda completions, **kwargs: [0.0] * len(completions),
        metric_class=TASKS["countdown"].metric_class,
        reference_columns=(),
        max_completion_length=16,
        block_length=8,
    )


def test_generate_until_equals_evaluate_task(tiny_llada_dir, in_data_dir):
    """The harness task's generations are `evaluate_task`'s completions of the same prompts with the same sampler
    (another batch size), cut before the task's stop sequence."""
    lm = DiffusionLM(tiny_llada_dir, batch_size=4, device="cpu", **SAMPLER)
    samples = run_harness(lm, [GENERATE_TASK])["samples"][GENERATE_TASK]
    prompts = [row["question"] for row in ROWS]
    assert [sample["arguments"][0][0] for sample in samples] == prompts

    direct = evaluate_task(
        lm.model,
        lm.tokenizer,
        tiny_qa_task(),
        dataset=Dataset.from_dict({"prompt": prompts}),
        generation_config=DiffusionGenerationConfig(**SAMPLER),
        batch_size=5,
        progress_bar=False,
    )
    completions = [record["completion"] for record in direct["records"]]
    assert sum(STOP in completion for completion in completions) >= 2  # the cut is exercised
    assert len(set(completions)) > 2  # the prompts matter
    assert [sample["resps"][0][0] for sample in samples] == [completion.split(STOP)[0] for completion in completions]


def test_loglikelihood_equals_the_package_elbo(tiny_llada_dir, in_data_dir):
    """Each choice's log-likelihood is the mean of `elbo_terms` under `sample_masks`' stratified masks of its mask
    seed, computed alone; the harness batched requests of equal continuation length with left-padded contexts."""
    lm = DiffusionLM(tiny_llada_dir, batch_size=5, num_mc_samples=6, device="cpu", **SAMPLER)
    samples = run_harness(lm, [CHOICE_TASK])["samples"][CHOICE_TASK]
    assert len(samples) == len(ROWS)
    for sample in samples:
        for (context, continuation), response in zip(sample["arguments"], sample["resps"]):
            context_ids, continuation_ids = lm._encode_pair(context, continuation)
            prompt = torch.tensor([context_ids])
            completion = torch.tensor([continuation_ids])
            region = torch.ones_like(completion, dtype=torch.bool)
            seeds = torch.tensor([lm.mask_seed(context_ids, continuation_ids)])
            plan = sample_masks("stratified", region, seeds, 0, 6)
            expected = elbo_terms(lm.model, lm.adapter, prompt, torch.ones_like(prompt), completion, plan).mean()
            log_likelihood, is_greedy = response[0]
            assert log_likelihood == pytest.approx(expected.item(), rel=1e-5)
            assert log_likelihood < 0 and is_greedy is False
    # The harness puts a space before each choice: " 8" and " 1, not 8", continuations of 2 and 9 tokens.
    assert {len(lm._encode_pair(*arguments)[1]) for sample in samples for arguments in sample["arguments"]} == {2, 9}


def test_greedy_check_is_the_one_token_per_step_decoding(tiny_llada, tiny_tokenizer):
    lm = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, check_greedy=True, num_mc_samples=2, device="cpu")
    context = lm.tok_encode("Largest of 3 8 1 6 4?")
    config = DiffusionGenerationConfig(max_completion_length=3, block_length=3, diffusion_steps=3)
    greedy = generate(tiny_llada, torch.tensor([context]), generation_config=config, adapter=lm.adapter)
    decoded = greedy.completion_ids[0].tolist()
    other = [decoded[0], decoded[1], (decoded[2] + 1) % len(tiny_tokenizer)]
    results = lm._loglikelihood_tokens([(("", ""), context, decoded), (("", ""), context, other)])
    assert [is_greedy for _, is_greedy in results] == [True, False]


def test_sampling_does_not_depend_on_the_batch(tiny_llada, tiny_tokenizer):
    """At a positive temperature each row draws from its own generator, keyed by its context: the same texts at any
    batch size; a repeated request (`repeats`) samples afresh."""
    requests = [
        Instance("generate_until", {}, (row["question"], {"until": []}), index) for index, row in enumerate(ROWS)
    ]
    requests.append(Instance("generate_until", {}, requests[0].args, len(ROWS)))
    texts = []
    for batch_size in (1, 7):
        lm = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, batch_size=batch_size, temperature=1.0, **SAMPLER)
        texts.append(lm.generate_until(requests, disable_tqdm=True))
    assert texts[0] == texts[1]
    assert texts[0][0] != texts[0][-1]


def test_refusals(tiny_llada, tiny_tokenizer):
    model = dict(pretrained=tiny_llada, tokenizer=tiny_tokenizer)
    with pytest.raises(NotImplementedError, match="lower bound"):
        DiffusionLM(**model).loglikelihood_rolling([])
    with pytest.raises(TypeError, match="`mc_num` \\(LLaDA's eval_llada.py name\\) and `num_mc_samples` are the same"):
        DiffusionLM(**model, mc_num=4, num_mc_samples=8)
    with pytest.raises(TypeError, match="`steps` \\(LLaDA's eval_llada.py name\\) and `diffusion_steps`"):
        DiffusionLM(**model, steps=8, diffusion_steps=8)
    with pytest.raises(TypeError, match="'gen_lenght'.*the sampler's fields: max_completion_length"):
        DiffusionLM(**model, gen_lenght=16)
    with pytest.raises(ValueError, match="'auto:N'.*is not supported"):
        DiffusionLM(**model, batch_size="auto:4")
    with pytest.raises(ValueError, match="pass its `tokenizer`"):
        DiffusionLM(tiny_llada)
    with pytest.raises(ValueError, match="at most the model's context length \\(1024\\)"):
        DiffusionLM(**model, max_length=2048)
    with pytest.raises(ValueError, match="continuation has 8 tokens, no fewer than max_length \\(8\\)"):
        DiffusionLM(**model, max_length=8)._loglikelihood_tokens([(("", ""), [20] * 4, [21] * 8)])
    with pytest.raises(ValueError, match="leaves no room for a prompt in max_length \\(16\\)"):
        DiffusionLM(**model, max_length=16, **SAMPLER).generate_until([Instance("generate_until", {}, ("Hi", {}), 0)])


def test_llada_argument_names_with_one_notice(tiny_llada_dir, caplog):
    """LLaDA's published `--model_args` string (eval_llada_lm_eval.sh's names) builds the model unchanged: each name
    is read as the one here, with one warning for all of them, and none from the sampler's deprecated names."""
    model_args = f"model_path={tiny_llada_dir},cfg=0.5,is_check_greedy=True,mc_num=4,gen_length=16,steps=8"
    model_args += ",block_length=8,remasking=low_confidence"
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        with caplog.at_level("WARNING", logger="trl_diffusion.harness"):
            lm = DiffusionLM.create_from_arg_string(model_args, {"batch_size": 8, "device": "cpu"})
    notices = [record.getMessage() for record in caplog.records if record.name == "trl_diffusion.harness"]
    assert notices == [
        "model_args `model_path`, `cfg`, `is_check_greedy`, `mc_num`, `gen_length`, `steps` are LLaDA's eval_llada.py "
        "names: read as `pretrained`, `cfg_scale`, `check_greedy`, `num_mc_samples`, `max_completion_length`, "
        "`diffusion_steps`."
    ]
    config = lm.generation_config
    assert (config.max_completion_length, config.diffusion_steps, config.block_length, config.cfg_scale) == (
        16,
        8,
        8,
        0.5,
    )
    assert (lm.num_mc_samples, lm.check_greedy, lm.batch_size) == (4, True, 8)


def independent_guided_elbo(model, context_ids, continuation_ids, mask_seed, num_mc_samples, cfg) -> float:
    """LLaDA's `get_logits` with `cfg > 0`, written out on the raw model: the conditional canvas and the same canvas
    with every context token masked, logits `un + (cfg + 1) * (cond - un)`, cross-entropy of the masked positions
    weighted by n / l, under the harness's masks."""
    n, mask_token_id = len(continuation_ids), model.config.mask_token_id
    continuation = torch.tensor(continuation_ids)
    plan = sample_masks("stratified", torch.ones(1, n, dtype=torch.bool), torch.tensor([mask_seed]), 0, num_mc_samples)
    terms = []
    for j in range(num_mc_samples):
        masked = plan.masks[0, j]
        noisy = continuation.masked_fill(masked, mask_token_id)
        conditional = torch.cat([torch.tensor(context_ids), noisy])
        unconditional = torch.cat([torch.full((len(context_ids),), mask_token_id), noisy])
        with torch.no_grad():
            cond, un = model(input_ids=torch.stack([conditional, unconditional])).logits[:, -n:].double()
        logprobs = (un + (cfg + 1) * (cond - un)).log_softmax(-1)[torch.arange(n), continuation]
        terms.append(plan.weights[0, j].item() * logprobs[masked].sum().item())
    return sum(terms) / num_mc_samples


def test_classifier_free_guidance_of_the_loglikelihood(tiny_llada, tiny_tokenizer):
    """With `cfg_scale` (LLaDA's `cfg`), each log-likelihood is LLaDA's guided estimate computed independently on
    the raw model; contexts of different lengths share a left-padded batch."""
    requests = [
        Instance("loglikelihood", {}, (row["question"], continuation), index)
        for index, (row, continuation) in enumerate(zip(ROWS[:3], [" 8", " 9", " 7"]))
    ]
    requests.append(Instance("loglikelihood", {}, ("Largest of 1?", " 1"), 3))  # a shorter context
    lm = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, cfg_scale=0.5, num_mc_samples=3, batch_size=5)
    guided = [value for value, _ in lm.loglikelihood(requests, disable_tqdm=True)]
    for request, value in zip(requests, guided):
        context_ids, continuation_ids = lm._encode_pair(*request.args)
        seed = lm.mask_seed(context_ids, continuation_ids)
        expected = independent_guided_elbo(tiny_llada, context_ids, continuation_ids, seed, 3, 0.5)
        assert value == pytest.approx(expected, rel=1e-5)
    unguided = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, num_mc_samples=3, batch_size=5)
    assert all(abs(a - b) > 1e-3 for a, (b, _) in zip(guided, unguided.loglikelihood(requests, disable_tqdm=True)))


def test_long_contexts_are_cut_on_the_left(tiny_llada, tiny_tokenizer, caplog):
    """Past `max_length`, a context keeps its last `max_length - len(continuation)` tokens (loglikelihood) or its last
    `max_length - max_completion_length` (generate_until), with a warning: the same numbers as the cut context
    given whole (the tiny tokenizer has one token per character and adds no BOS)."""
    question = ROWS[0]["question"] + " " + ROWS[1]["question"]
    cut = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, max_length=24, num_mc_samples=2, **SAMPLER)
    whole = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, num_mc_samples=2, **SAMPLER)
    assert len(cut.tok_encode(question)) > 24
    with caplog.at_level("WARNING", logger="trl_diffusion.harness"):
        (cut_value, _), (short_value, _) = cut.loglikelihood(
            [Instance("loglikelihood", {}, (question, " 8, not 1"), 0), Instance("loglikelihood", {}, ("Hi", " 8"), 1)]
        )
        texts = cut.generate_until([Instance("generate_until", {}, (question, {"until": []}), 0)])
    assert [record.getMessage().split(" (")[0] for record in caplog.records] == [
        "1 loglikelihood request(s) were longer than max_length",
        "1 generate_until request(s) were longer than max_length",
    ]
    # " 8, not 1" is 9 tokens: 15 context tokens stay; the canvas is 16 tokens: 8 prompt tokens stay.
    ((expected, _),) = whole.loglikelihood([Instance("loglikelihood", {}, (question[-15:], " 8, not 1"), 0)])
    assert cut_value == pytest.approx(expected, rel=1e-6)
    assert short_value == whole.loglikelihood([Instance("loglikelihood", {}, ("Hi", " 8"), 1)])[0][0]
    assert texts == whole.generate_until([Instance("generate_until", {}, (question[-8:], {"until": []}), 0)])
    assert texts != whole.generate_until([Instance("generate_until", {}, (question[:8], {"until": []}), 0)])


def test_peft_adapter_on_pretrained(tiny_llada_dir, tmp_path):
    """`peft=ADAPTER` (the harness's Hugging Face model's argument) evaluates the adapter on `pretrained`, unmerged:
    the numbers of the adapter given as `pretrained`, of `peft` on a model object, and not the base model's."""
    base = AutoModelForCausalLM.from_pretrained(tiny_llada_dir)
    trained = get_peft_model(base, lora_config())
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, parameter in trained.named_parameters():
            if "lora_B" in name:  # PEFT starts B at zero, which would change nothing
                parameter.copy_(0.5 * torch.randn(parameter.shape, generator=generator))
    trained.save_pretrained(tmp_path / "adapter")
    adapter = str(tmp_path / "adapter")
    generations = [
        Instance("generate_until", {}, (row["question"], {"until": []}), i) for i, row in enumerate(ROWS[:3])
    ]
    choices = [Instance("loglikelihood", {}, (row["question"], " 9"), i) for i, row in enumerate(ROWS[:3])]
    results = {}
    for name, model_args in {
        "peft": dict(pretrained=tiny_llada_dir, peft=adapter),
        "adapter as pretrained": dict(pretrained=adapter),
        "peft on a model object": dict(
            pretrained=AutoModelForCausalLM.from_pretrained(tiny_llada_dir),
            tokenizer=tiny_llada_dir,
            peft=adapter,
        ),
        "base": dict(pretrained=tiny_llada_dir),
    }.items():
        lm = DiffusionLM(**model_args, num_mc_samples=2, batch_size=4, device="cpu", **SAMPLER)
        results[name] = (
            lm.generate_until(generations, disable_tqdm=True),
            [value for value, _ in lm.loglikelihood(choices, disable_tqdm=True)],
        )
    for name in ("adapter as pretrained", "peft on a model object"):
        assert results[name][0] == results["peft"][0]
        assert results[name][1] == pytest.approx(results["peft"][1], rel=1e-6)
    assert results["peft"][1] != pytest.approx(results["base"][1], rel=1e-2)
    with pytest.raises(ValueError, match="is itself a PEFT adapter: with `peft`, pass its base model"):
        DiffusionLM(adapter, peft=adapter)
    with pytest.raises(ValueError, match="has no adapter_config.json"):
        DiffusionLM(tiny_llada_dir, peft=tiny_llada_dir)


def test_add_bos_token(tiny_llada, tiny_tokenizer):
    """`add_bos_token=True` starts every context with BOS (the tiny tokenizer adds none itself), once, also for a
    chat-templated string that already starts with it: the numbers of the context written with BOS."""
    bos = tiny_tokenizer.bos_token_id
    plain = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, num_mc_samples=2, **SAMPLER)
    with_bos = DiffusionLM(tiny_llada, tokenizer=tiny_tokenizer, add_bos_token=True, num_mc_samples=2, **SAMPLER)
    question = ROWS[0]["question"]
    assert plain.tok_encode(question)[0] != bos
    assert with_bos.tok_encode(question) == [bos, *plain.tok_encode(question)]
    assert with_bos.tok_encode(tiny_tokenizer.bos_token + question) == with_bos.tok_encode(question)
    assert with_bos.tok_encode(question, add_special_tokens=False) == plain.tok_encode(question)
    request = Instance("loglikelihood", {}, (question, " 8"), 0)
    written = Instance("loglikelihood", {}, (tiny_tokenizer.bos_token + question, " 8"), 0)
    assert with_bos.loglikelihood([request]) == plain.loglikelihood([written])
    assert with_bos.loglikelihood([request]) != plain.loglikelihood([request])


def test_automatic_batch_size(tiny_llada, tiny_tokenizer, monkeypatch):
    """`batch_size="auto"`: on the CPU, `max_batch_size`; where the memory is probed (here the CPU, with a model that
    runs out of memory past 5 rows of the longest request per call, twice for the guidance), the largest halving of
    64 that fits the longest request. Either way the numbers are the fixed batch size's."""
    questions = [row["question"] for row in ROWS] + [" ".join(row["question"] for row in ROWS[:4])]  # one long
    requests = [
        Instance("loglikelihood", {}, (question, f" {index}"), index) for index, question in enumerate(questions)
    ]
    generations = [Instance("generate_until", {}, (q, {"until": []}), i) for i, q in enumerate(questions)]
    settings = dict(tokenizer=tiny_tokenizer, num_mc_samples=3, cfg_scale=0.5, **SAMPLER)
    fixed = DiffusionLM(tiny_llada, batch_size=4, **settings)
    expected = fixed.loglikelihood(requests, disable_tqdm=True), fixed.generate_until(generations, disable_tqdm=True)
    on_cpu = DiffusionLM(tiny_llada, batch_size="auto", max_batch_size=4, **settings)
    assert on_cpu.loglikelihood(requests, disable_tqdm=True) == expected[0]
    assert (on_cpu.likelihood_batch_size, on_cpu.generate_until(generations, disable_tqdm=True)) == (4, expected[1])

    probed = DiffusionLM(tiny_llada, batch_size="auto", **settings)  # probing starts at 64
    budget = {"tokens": 2 * 5 * max(sum(map(len, probed._encode_pair(*request.args))) for request in requests)}
    forward = tiny_llada.forward

    def limited_forward(*args, **kwargs):
        if kwargs["input_ids"].numel() > budget["tokens"]:
            raise torch.OutOfMemoryError("CUDA out of memory. (simulated)")
        return forward(*args, **kwargs)

    monkeypatch.setattr(harness, "PROBED_DEVICE_TYPES", ("cpu",))
    monkeypatch.setattr(tiny_llada, "forward", limited_forward)
    assert probed.loglikelihood(requests, disable_tqdm=True) == expected[0]
    assert probed.likelihood_batch_size == 4  # 64, 32, 16 and 8 rows ran out of memory
    budget["tokens"] = 2 * 5 * (max(len(probed.tok_encode(question)) for question in questions) + 16)
    assert probed.generate_until(generations, disable_tqdm=True) == expected[1]


def test_command_line_registers_the_model(tiny_llada_dir, in_data_dir, tmp_path):
    """`trl-diffusion lm-eval` is the harness's command line with `--model trl_diffusion`: the same numbers as
    `simple_evaluate` in Python."""
    model_args = f"pretrained={tiny_llada_dir},max_completion_length=16,block_length=8,diffusion_steps=8"
    model_args += ",num_mc_samples=4"
    argv = ["lm-eval", "--model_args", model_args, "--tasks", GENERATE_TASK, CHOICE_TASK, "--include_path", "."]
    argv += ["--device", "cpu", "--batch_size", "3", "--output_path", str(tmp_path)]
    assert main(argv) == 0
    (results_file,) = tmp_path.rglob("results_*.json")
    from_cli = json.loads(results_file.read_text())["results"]

    lm = DiffusionLM(tiny_llada_dir, batch_size=3, num_mc_samples=4, device="cpu", **SAMPLER)
    direct = run_harness(lm, [GENERATE_TASK, CHOICE_TASK])["results"]
    for task, metric in ((GENERATE_TASK, "exact_match,none"), (CHOICE_TASK, "acc,none")):
        assert from_cli[task][metric] == direct[task][metric]


@pytest.mark.slow  # two processes that each import torch, transformers and the harness: about 25 s on 2 cores
def test_two_processes_under_accelerate_launch_equal_one(tiny_llada_dir, tmp_path):
    """`accelerate launch` with two CPU processes: the harness splits the requests by `rank` / `world_size` (3 of
    the 6 documents each) and gathers the samples, which equal one process's, sampling at temperature 1 included
    (each row's generator is keyed by its context, not by its process or batch)."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    model_args = f"pretrained={tiny_llada_dir},max_completion_length=16,block_length=8,diffusion_steps=8"
    model_args += ",num_mc_samples=4,temperature=1.0"
    harness = ["lm-eval", "--model_args", model_args, "--tasks", GENERATE_TASK, CHOICE_TASK, "--include_path", "."]
    harness += ["--device", "cpu", "--batch_size", "2", "--log_samples"]
    accelerate = [str(Path(sys.executable).with_name("accelerate")), "launch", "--config_file"]
    accelerate += [resolve_accelerate_config("multi_gpu")]
    accelerate += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", str(port)]
    commands = {
        "one": [sys.executable, "-m", "trl_diffusion", *harness],
        "two": [*accelerate, "-m", "trl_diffusion", *harness],
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    samples = {}
    for name, command in commands.items():
        output = tmp_path / name
        process = subprocess.run(
            [*command, "--output_path", str(output)], cwd=DATA, env=env, capture_output=True, text=True, timeout=300
        )
        assert process.returncode == 0, process.stderr[-4000:]
        samples[name] = {
            path.name.removeprefix("samples_").rsplit("_", 1)[0]: sorted(
                (record["doc_id"], record["resps"]) for record in map(json.loads, path.read_text().splitlines())
            )
            for path in output.rglob("samples_*.jsonl")
        }
        if name == "two":
            assert "Generating: 100%|██████████| 3/3" in process.stderr  # each process generated 3 of the 6
    assert len(samples["one"]) == 2 and all(len(records) == len(ROWS) for records in samples["one"].values())
    assert samples["two"] == samples["one"]


def test_command_line_help_is_the_harness_run_help(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["lm-eval", "--help"])
    assert exit_info.value.code == 0
    help_text = capsys.readouterr().out
    assert "--model_args" in help_text and "--tasks" in help_text and "--include_path" in help_text


def test_chat_template_prompts_decode_as_conversational_prompts(tiny_llada_dir, in_data_dir):
    """With `apply_chat_template`, the harness renders each question as one user turn through the tokenizer's chat
    template: the generations equal `evaluate_task`'s on the same questions as conversational prompts."""
    lm = DiffusionLM(tiny_llada_dir, batch_size=4, device="cpu", **SAMPLER)
    results = lm_eval.simple_evaluate(
        model=lm,
        tasks=[GENERATE_TASK],
        task_manager=TaskManager(include_path=str(DATA), include_defaults=False),
        apply_chat_template=True,
        log_samples=True,
        bootstrap_iters=0,
    )
    samples = results["samples"][GENERATE_TASK]
    assert all(sample["arguments"][0][0].startswith(lm.tokenizer.bos_token) for sample in samples)
    prompts = [[{"role": "user", "content": row["question"]}] for row in ROWS]
    direct = evaluate_task(
        lm.model,
        lm.tokenizer,
        tiny_qa_task(),
        dataset=Dataset.from_dict({"prompt": prompts}),
        generation_config=DiffusionGenerationConfig(**SAMPLER),
        progress_bar=False,
    )
    expected = [record["completion"].split(STOP)[0] for record in direct["records"]]
    assert [sample["resps"][0][0] for sample in samples] == expected


@pytest.mark.parametrize("family", ["tiny_dream", "tiny_llama"])
def test_other_model_families(family, tiny_tokenizer, request):
    """Dream (shifted logits) and a bidirectional Llama: generations are `generate`'s, log-likelihoods the ELBO."""
    model = request.getfixturevalue(family)
    lm = DiffusionLM(model, tokenizer=tiny_tokenizer, num_mc_samples=3, batch_size=2, device="cpu", **SAMPLER)
    questions = [row["question"] for row in ROWS[:3]]
    texts = lm.generate_until([Instance("generate_until", {}, (q, {"until": []}), i) for i, q in enumerate(questions)])
    direct = evaluate_task(
        model,
        tiny_tokenizer,
        tiny_qa_task(),
        dataset=Dataset.from_dict({"prompt": questions}),
        generation_config=DiffusionGenerationConfig(**SAMPLER),
        progress_bar=False,
    )
    assert texts == [record["completion"] for record in direct["records"]]
    ((log_likelihood, _),) = lm.loglikelihood([Instance("loglikelihood", {}, (questions[0], " 8, not 1"), 0)])
    context_ids, continuation_ids = lm._encode_pair(questions[0], " 8, not 1")
    completion = torch.tensor([continuation_ids])
    seeds = torch.tensor([lm.mask_seed(context_ids, continuation_ids)])
    plan = sample_masks("stratified", torch.ones_like(completion, dtype=torch.bool), seeds, 0, 3)
    prompt = torch.tensor([context_ids])
    expected = elbo_terms(model, lm.adapter, prompt, torch.ones_like(prompt), completion, plan).mean()
    assert log_likelihood == pytest.approx(expected.item(), rel=1e-5)
