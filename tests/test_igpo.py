"""IGPO: the hint canvas, the failed-group test, the entropy filter, the inpainted rollouts as training builds them,
and the loss and gradient against an independent computation (reference, old and current policies all different)."""

import pytest
import test_objective_oracles
import torch
from datasets import Dataset
from test_objective_oracles import (
    ADVANTAGES,
    PERTURBATION,
    assert_same_loss_and_gradients,
    mean_field_reference,
    moved_policy_loss_and_gradients,
    token_grpo_reference_loss,
)
from transformers import AutoModelForCausalLM

from trl_diffusion.trainer import IGPOConfig, IGPOTrainer
from trl_diffusion.trainer.igpo_trainer import failed_groups, hint_canvas, solution_chunks, top_fraction

from helpers import (
    assert_same_update,
    completion_texts,
    load_ddp_worker,
    perturb,
    run_ddp_worker,
    say_prompts,
    tiny_grpo_config,
    tiny_trainer,
)

# The oracles' tiny LLaDA with weights large enough for predictions to depend on the input.
sensitive_llada_dir = test_objective_oracles.sensitive_llada_dir
MASK = 99
# Solutions per prompt: the second is empty, so that every completion of its group is correct and it never fails.
SOLUTIONS = ("zqzqzqzq", "")


def solution_reward(completions, solution, **kwargs):
    """1 when the completion starts with the row's reference solution: the tiny random model never does alone."""
    return [float(text.startswith(gold)) for text, gold in zip(completion_texts(completions), solution)]


def test_hint_canvas_reveals_chunks_of_the_solution_at_their_offsets():
    solution = list(range(1000, 1023))  # 23 tokens
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        chunks = solution_chunks(len(solution), 3, 5, torch.Generator().manual_seed(seed))
        assert all(3 <= len(chunk) <= 5 for chunk in chunks)
        assert chunks[0].start == 0 and all(a.stop == b.start for a, b in zip(chunks, chunks[1:]))
        assert len(solution) - chunks[-1].stop < 3  # only a piece shorter than the minimum is left out
        canvas = hint_canvas(solution, 30, MASK, (0.2, 0.6), (3, 5), generator)
        # The same draws: the chunks first, then the ratio, then the chosen chunks.
        replay = torch.Generator().manual_seed(seed)
        solution_chunks(len(solution), 3, 5, replay)
        ratio = 0.2 + 0.4 * float(torch.rand((), generator=replay, dtype=torch.float64))
        revealed = [chunk for chunk in chunks if canvas[chunk.start] != MASK]
        assert len(revealed) == len(chunks) - int(len(chunks) * (1 - ratio))
        for chunk in chunks:
            values = canvas[chunk.start : chunk.stop]
            assert (values == MASK).all() or values.tolist() == solution[chunk.start : chunk.stop]
        assert (canvas[chunks[-1].stop :] == MASK).all()
    # A solution longer than the canvas is cut to it; ratio 1 reveals every chunk.
    canvas = hint_canvas(solution, 8, MASK, (1.0, 1.0), (4, 4), torch.Generator().manual_seed(0))
    assert canvas.tolist() == solution[:8]


def test_failed_groups_need_every_completion_scored_and_below_the_threshold():
    nan = float("nan")
    rewards = torch.tensor([0.0, 0.5, 0.9, 0.0, 1.0, 0.0, 0.0, 0.0, nan, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0])
    assert failed_groups(rewards, 4, 1.0).tolist() == [True, False, False, True]
    assert failed_groups(rewards, 4, 0.5).tolist() == [False, False, False, True]


def test_top_fraction_keeps_exactly_the_top_entropy_hint_tokens():
    generator = torch.Generator().manual_seed(0)
    values = torch.rand(50, 12, generator=generator)
    candidates = torch.rand(50, 12, generator=generator) < 0.6
    for fraction in (0.2, 0.5, 1.0):
        kept = top_fraction(values, candidates, fraction)
        for row in range(50):
            positions = candidates[row].nonzero().flatten().tolist()
            expected = sorted(positions, key=lambda i: -values[row, i].item())[
                : max(1, int(len(positions) * fraction))
            ]
            assert sorted(kept[row].nonzero().flatten().tolist()) == sorted(expected if positions else [])


def hinted_batch(trainer, inner_iteration=0):
    """One rollout batch built as training builds it, from two prompts with the [`SOLUTIONS`]."""
    trainer.model.train()
    rows = [
        {"prompt": prompt, "solution": solution}
        for prompt, solution in zip(say_prompts(2), SOLUTIONS)
        for _ in range(trainer.num_generations)
    ]
    inputs = {**trainer._generate_and_score_completions(rows), "inner_iteration": inner_iteration}
    trainer.current_gradient_accumulation_steps = trainer.args.gradient_accumulation_steps
    return inputs


def igpo_trainer(model_dir, output_dir, **settings):
    settings = {
        "hint_chunk_min_tokens": 2,
        "hint_chunk_max_tokens": 2,
        "hint_ratio_min": 0.5,
        "hint_ratio_max": 0.5,
        "max_hinted_replacements": 2,
        **settings,
    }
    args = tiny_grpo_config(IGPOConfig, output_dir, scale_rewards="none", **settings)
    dataset = Dataset.from_dict({"prompt": say_prompts(2), "solution": list(SOLUTIONS)})
    return tiny_trainer(IGPOTrainer, model_dir, args, reward_funcs=solution_reward, train_dataset=dataset)


def test_failed_group_gets_hinted_completions_that_keep_their_hints(sensitive_llada_dir, tmp_path, tiny_tokenizer):
    trainer = igpo_trainer(sensitive_llada_dir, tmp_path, hint_ratio_min=1.0, hint_ratio_max=1.0)
    inputs = hinted_batch(trainer)
    hints = inputs["commit_step"] < 0
    solution = tiny_tokenizer(SOLUTIONS[0], add_special_tokens=False)["input_ids"]
    # The failed group (rows 0-3): exactly `max_hinted_replacements` completions hinted, each keeping the whole
    # solution (ratio 1: every chunk) at its offsets and scored correct, so the group has an advantage again.
    assert hints[:4].any(dim=1).sum() == 2 and not hints[4:].any()
    for row in hints[:4].any(dim=1).nonzero().flatten().tolist():
        assert hints[row].nonzero().flatten().tolist() == list(range(len(solution)))
        assert inputs["completion_canvas"][row, : len(solution)].tolist() == solution
    hinted = hints.any(dim=1).float()
    expected = torch.cat([hinted[:4] - hinted[:4].mean(), torch.zeros(4)])  # scale_rewards="none"
    torch.testing.assert_close(inputs["advantages"], expected)
    metrics = trainer._metrics["train"]
    assert metrics["igpo/failed_groups"] == [0.5] and metrics["igpo/replaced"] == [2.0]
    assert metrics["igpo/hinted_correct"] == [1.0]


def test_missing_solution_column_is_refused(sensitive_llada_dir, tmp_path):
    args = tiny_grpo_config(IGPOConfig, tmp_path, max_hinted_replacements=2)
    with pytest.raises(ValueError, match="no 'solution' column.*solution_column"):
        tiny_trainer(IGPOTrainer, sensitive_llada_dir, args, reward_funcs=solution_reward)


def test_loss_and_gradient_with_entropy_filtered_hints(sensitive_llada_dir, tmp_path):
    """d1's bnpo loss on the mean-field log-probs with TRL's mask narrowed, per inner iteration, to the generated
    tokens and the top `hint_entropy_ratio` of each completion's hint tokens by the old (rollout) policy's entropy
    under that iteration's prompt mask; old != reference at rollout, current != old at every iteration."""
    num_iterations, beta, epsilon, p_mask_prompt, ratio = 2, 0.2, 0.2, 0.4, 0.5
    trainer = igpo_trainer(
        sensitive_llada_dir,
        tmp_path,
        num_iterations=num_iterations,
        beta=beta,
        epsilon=epsilon,
        p_mask_prompt=p_mask_prompt,
        hint_entropy_ratio=ratio,
        max_completion_length=12,
        block_length=4,
        diffusion_steps=6,
        hint_ratio_min=1.0,
        hint_ratio_max=1.0,
    )
    reference = AutoModelForCausalLM.from_pretrained(sensitive_llada_dir).eval()
    perturb(trainer.model, PERTURBATION, seed=1)
    old = AutoModelForCausalLM.from_pretrained(sensitive_llada_dir).eval()
    old.load_state_dict(trainer.model.state_dict())
    inputs = hinted_batch(trainer)
    inputs["advantages"] = ADVANTAGES.clone()
    model, completion_mask = trainer.model, inputs["completion_mask"].bool()
    width = completion_mask.shape[1]
    hints = (inputs["commit_step"][:, :width] < 0) & completion_mask
    assert hints.sum(dim=1).max() >= 4  # enough hint tokens for the filter to drop some
    mask_id = model.config.mask_token_id
    from trl_diffusion.masking import sample_prompt_masks

    with torch.no_grad():
        old_logps = [mean_field_reference(old, inputs, p_mask_prompt, k) for k in range(num_iterations)]
        ref_logps = [mean_field_reference(reference, inputs, p_mask_prompt, k) for k in range(num_iterations)]
        masks = []
        for k in range(num_iterations):
            prompt_masked = sample_prompt_masks(inputs["prompt_mask"], p_mask_prompt, inputs["mask_seeds"], k)
            canvas = inputs["completion_canvas"]
            input_ids = torch.cat(
                [inputs["prompt_ids"].masked_fill(prompt_masked, mask_id), torch.full_like(canvas, mask_id)], 1
            )
            attention = torch.cat([inputs["prompt_mask"], torch.ones_like(canvas)], dim=1)
            positions = (attention.cumsum(-1) - 1).clamp(min=0)
            logits = old(input_ids=input_ids, attention_mask=attention, position_ids=positions).logits
            logprobs = logits[:, -canvas.shape[1] :][:, :width].float().log_softmax(-1)
            entropy = -(logprobs.exp() * logprobs).sum(-1)
            keep = completion_mask & ~hints
            for row in range(canvas.shape[0]):
                hinted = hints[row].nonzero().flatten().tolist()
                top = sorted(hinted, key=lambda i: -entropy[row, i].item())[: max(1, int(len(hinted) * ratio))]
                keep[row, top if hinted else []] = True
            masks.append(keep.float())
    assert (masks[0] < completion_mask.float()).any()  # the filter drops hint tokens

    for iteration in range(num_iterations):
        loss, actual = moved_policy_loss_and_gradients(trainer, model, inputs, iteration)
        logps = mean_field_reference(model, inputs, p_mask_prompt, iteration)
        expected_loss, _ = token_grpo_reference_loss(
            logps,
            old_logps[iteration],
            ref_logps[iteration],
            ADVANTAGES.unsqueeze(1),
            masks[iteration],
            epsilon,
            beta,
            trainer,
        )
        assert_same_loss_and_gradients(model, loss, actual, expected_loss)


@pytest.mark.slow
def test_two_processes_inpaint_and_train_like_one_process(tiny_llada_dir, tmp_path):
    """torchrun, 2 processes (gloo, CPU), 6 rows each in 2 micro-batches of 3, groups of 4 (the middle one split
    between the ranks): the rollouts (hinted ones included), advantages and the update equal one process's over the
    same 12 rows. The first and last groups fail; the last one's rows are the first failed rows of rank 1 but the
    fifth to eighth of the one-process batch, so hints keyed by anything but the row would differ."""
    one = load_ddp_worker().train_one_step(
        tiny_llada_dir, str(tmp_path / "one"), 12, num_generations=4, trainer="igpo"
    )
    arguments = ["--model-dir", tiny_llada_dir, "--trainer", "igpo", "--num-generations", "4"]
    arguments += ["--per-device-train-batch-size", "3", "--gradient-accumulation-steps", "2"]
    ranks = run_ddp_worker(tmp_path / "ddp", 2, *arguments)
    reference = one["rollouts"][0]
    hinted_rows = (reference["commit_step"] < 0).any(dim=1)
    assert hinted_rows.tolist() == [True, True, False, False] + [False] * 4 + [True, True, False, False]
    for key in ("completion_canvas", "commit_step", "mask_seeds", "advantages"):
        merged = torch.cat([run["rollouts"][0][key] for run in ranks])
        assert torch.equal(merged, reference[key]), key
    assert_same_update(ranks, one, "two processes vs one")
