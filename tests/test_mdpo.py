"""MDPO (issue: MDPOTrainer / MDPOConfig).

- adv-v4 by hand (the first and last steps' edge cases, the no-op `+ 1`), the per-step group z-score, the top-k steps.
- The recorded per-step predictions are the rollout's: every committed token is its commit step's prediction, and
  a step's prediction is recomputed exactly from its recorded state and the row's counter-based noise key.
- The trainer's loss and gradient equal MDPO's objective written here from its formula, with direct model calls,
  the rewards of every step's prediction recomputed here, and reference, old and current policies all different.
- A reward function that returns NaN for some predictions, or raises on them, costs their advantages, not the run.
"""

import copy
import math

import pytest
import torch

from trl_diffusion import MDPOConfig, MDPOTrainer
from trl_diffusion.generation import DiffusionGenerationConfig, generate
from trl_diffusion.generation.noise import PROPOSAL, counter_uniform, row_keys, sample_categorical
from trl_diffusion.models import DiffusionAdapter
from trl_diffusion.trainer.mdpo_trainer import adv_v4, step_advantages, top_steps

from helpers import (
    assert_same_gradients,
    direct_logps,
    gradients,
    perturb,
    rollout_batch,
    save_checkpoint,
    sharpened,
    tiny_grpo_config,
    tiny_trainer,
)

STD = 1e-4


# ---------------------------------------------------------------------------------------------- advantages


def test_adv_v4_by_hand():
    rewards = torch.tensor([[1.0, 0.0, 2.0, 3.0], [0.0, 1.0, 1.0, 0.0]])
    # Step 1: r_1 + mean(r_2..r_4); steps 2, 3: the difference plus the mean of the later rewards; step 4 (= T): the
    # difference plus r_T itself. MDPO's code adds 1 to every step, which the group mean cancels.
    expected = torch.tensor(
        [
            [1 + (0 + 2 + 3) / 3, (0 - 1) + (2 + 3) / 2, (2 - 0) + 3, (3 - 2) + 3],
            [0 + (1 + 1 + 0) / 3, (1 - 0) + (1 + 0) / 2, (1 - 1) + 0, (0 - 1) + 0],
        ]
    )
    torch.testing.assert_close(adv_v4(rewards), expected)
    # T = 1: the one step's difference is r_1 and its future mean r_1.
    torch.testing.assert_close(adv_v4(torch.tensor([[2.0], [5.0]])), torch.tensor([[4.0], [10.0]]))
    # The + 1 of MDPO's code is a no-op under the group normalization.
    returns = adv_v4(rewards.repeat(2, 1) + torch.arange(4.0)[:, None])
    torch.testing.assert_close(step_advantages(returns + 1, 4), step_advantages(returns, 4))


def test_step_advantages_are_per_step_group_z_scores():
    returns = torch.tensor([[1.0, 4.0], [2.0, 4.0], [4.0, 4.0], [0.0, math.nan]])
    advantages = step_advantages(returns, group_size=4)
    first = torch.tensor([1.0, 2.0, 4.0, 0.0])
    expected_first = (first - first.mean()) / (first.std() + STD)  # Bessel's correction, as torch.std and MDPO
    torch.testing.assert_close(advantages[:, 0], expected_first)
    # Step 2: the NaN return is left out (advantage 0) and the others are equal (advantage 0, no division by 0).
    torch.testing.assert_close(advantages[:, 1], torch.zeros(4))
    torch.testing.assert_close(step_advantages(returns, 4, "none")[:, 0], first - first.mean())


def test_top_steps_by_summed_absolute_advantage():
    advantages = torch.tensor([[0.1, -2.0, 0.5, 0.0], [0.2, 1.0, -0.6, 3.0]])
    # Sums of |A|: 0.3, 3.0, 1.1, 3.0 -> the two largest, then the third.
    assert sorted(top_steps(advantages, 2).tolist()) == [1, 3]
    assert top_steps(advantages, 3).tolist()[2] == 2
    assert sorted(top_steps(advantages, 10).tolist()) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- recorded predictions


def test_recorded_predictions_are_the_rollouts(tiny_llama, tiny_tokenizer, chat_prompts):
    """Every committed token is its commit step's prediction, and each step's prediction and log-probs are
    recomputed exactly from the recorded state, one forward and the row's counter-based noise (running-confidence
    remasking, tempered confidence, two blocks)."""
    model = sharpened(tiny_llama)
    adapter = DiffusionAdapter.from_model(model, tiny_tokenizer)
    length, block, temperature, mask = 16, 8, 0.8, adapter.mask_token_id
    config = DiffusionGenerationConfig(
        max_completion_length=length,
        block_length=block,
        diffusion_steps=8,
        temperature=temperature,
        running_confidence=True,
        tempered_confidence=True,
        record_predictions=True,
    )
    remasked = []
    for row, (ids, attention) in enumerate(zip(chat_prompts["input_ids"], chat_prompts["attention_mask"])):
        prompt = ids[attention.bool()][None]
        output = generate(
            model, prompt, generation_config=config, adapter=adapter, generator=torch.Generator().manual_seed(row)
        )
        key = row_keys(torch.Generator().manual_seed(row), 1, prompt.device)
        states, predictions, logprobs = output.step_states[0], output.step_predictions[0], output.step_logprobs[0]
        final, commit = output.completion_ids[0], output.commit_step[0]
        assert torch.equal(predictions[commit, torch.arange(length)], final)
        for step in range(states.shape[0]):
            state = states[step]
            logits = adapter.logits(model, torch.cat([prompt[0], state])[None], num_logits=length)[0].float()
            logits[:, mask] = -math.inf
            masked = state == mask
            current = masked.nonzero()[0, 0] // block
            proposed = masked & (torch.arange(length) // block == current)
            positions = proposed.nonzero().squeeze(1)
            uniform = counter_uniform(key.expand(len(positions)), step, positions, length, PROPOSAL, torch.float64)
            tokens = sample_categorical(logits[positions], temperature, uniform)
            expected = state.clone()
            expected[positions] = tokens
            assert torch.equal(predictions[step], expected), (row, step)
            expected_logprobs = (logits[positions] / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
            torch.testing.assert_close(logprobs[step, positions], expected_logprobs, rtol=1e-5, atol=1e-5)
            assert (logprobs[step][~proposed] == 0).all()
        remasked.append(output.remasks_committed)
    assert any(remasked)  # RCR did put committed tokens back: the states are not the commit steps' rebuild


# ---------------------------------------------------------------------------------------------- MDPO's objective


def capture_rollouts(trainer) -> list:
    captured = []
    generate_rollout = trainer.generate_rollout

    def recording(prompt_ids):
        rollout, mask_seeds = generate_rollout(prompt_ids)
        captured.append(rollout)
        return rollout, mask_seeds

    trainer.generate_rollout = recording
    return captured


def distinct_chars_reward(tokenizer, ids, terminators) -> float:
    """The tests' distinct-character reward of a prediction, cut after its first terminator (kept) and decoded."""
    ids = ids.tolist()
    ends = [position for position, token in enumerate(ids) if token in terminators]
    text = tokenizer.decode(ids[: ends[0] + 1] if ends else ids, skip_special_tokens=True)
    return float(len(set(text)))


def mdpo_objective(trainer, batch, rollout, old_model, reference, num_kept):
    """MDPO's loss (autonomousvision/mdpo, `mdpo_trainer.py`) on the rollout, from its formula: every step's
    prediction rewarded, adv-v4 `(r_t - r_{t-1}) + 1 + mean_{s>t} r_s`, z-scored per step in each group, the
    `num_kept` steps of largest sum |A_t|, and per kept step
    `sum_{i,n} conf * [-min(rho A, clip(rho) A) * L / (#masked + 1e-4) + beta (ref - cur)^2 / 2] / sum_i #masked`, averaged over
    the kept steps. Returns the loss, the kept steps and their advantages `(rows, kept)`."""
    args, model, adapter, tokenizer = trainer.args, trainer.model, trainer.adapter, trainer.processing_class
    temperature, mask, group = args.temperature, adapter.mask_token_id, trainer.num_generations
    low, high = 1 - args.epsilon, 1 + args.epsilon
    states, predictions, sampler_logprobs = rollout.step_states, rollout.step_predictions, rollout.step_logprobs
    num_rows, num_steps, length = states.shape
    terminators = set(trainer.eos_token_ids)
    rewards = [
        [distinct_chars_reward(tokenizer, predictions[i, t], terminators) for t in range(num_steps)]
        for i in range(num_rows)
    ]
    returns = torch.zeros(num_rows, num_steps)
    for i in range(num_rows):
        for t in range(num_steps):
            difference = rewards[i][0] if t == 0 else rewards[i][t] - rewards[i][t - 1]
            future = rewards[i][-1] if t == num_steps - 1 else sum(rewards[i][t + 1 :]) / (num_steps - 1 - t)
            returns[i, t] = difference + 1 + future
    advantages = torch.zeros_like(returns)
    for start in range(0, num_rows, group):
        members = returns[start : start + group]
        advantages[start : start + group] = (members - members.mean(0)) / (members.std(0) + STD)
    kept = advantages.abs().sum(0).topk(num_kept).indices.tolist()
    total = 0.0
    for t in kept:
        divisor = sum(int((states[i, t] == mask).sum()) for i in range(num_rows))
        for i in range(num_rows):
            masked = states[i, t] == mask
            targets = masked & (predictions[i, t] != mask)
            prediction = predictions[i, t].masked_fill(~targets & masked, 0)  # a token to gather; weighted 0 below
            row = (batch["prompt_ids"][i], batch["prompt_mask"][i], prediction, masked, temperature)
            current = direct_logps(model, adapter, *row)
            with torch.no_grad():
                old = direct_logps(old_model, adapter, *row)
                ref = direct_logps(reference, adapter, *row)
            ratio = (current - old).exp()
            advantage = advantages[i, t]
            surrogate = torch.minimum(ratio * advantage, ratio.clamp(low, high) * advantage)
            losses = -surrogate * length / (int(masked.sum()) + 1e-4) + args.beta * 0.5 * (ref - current) ** 2
            confidence = sampler_logprobs[i, t].exp()
            total = total + (confidence * losses * targets).sum() / divisor
    return total / len(kept) / args.gradient_accumulation_steps, kept, advantages[:, kept]


def test_loss_and_gradient_equal_mdpos_objective(tiny_llada, tiny_tokenizer, tmp_path):
    checkpoint = save_checkpoint(sharpened(tiny_llada), tiny_tokenizer, tmp_path / "checkpoint")
    args = tiny_grpo_config(
        MDPOConfig,
        tmp_path / "run",
        beta=0.1,
        epsilon=0.1,
        temperature=0.7,
        num_iterations=2,  # rollouts reused: the old log-probs are stored once per rollout
        gradient_accumulation_steps=1,
        sample_train_steps=3,
        states_per_forward=3,
    )
    trainer = tiny_trainer(MDPOTrainer, checkpoint, args)
    captured = capture_rollouts(trainer)
    perturb(trainer.model, 0.02, seed=1)  # the rollout (old) policy is not the reference
    old_model = copy.deepcopy(trainer.model).eval()
    batch = rollout_batch(trainer)
    perturb(trainer.model, 0.02, seed=2)  # the current policy is not the old one
    trainer.model.eval()  # no dropout: the oracle's forwards must see the same model

    loss = trainer._compute_loss(trainer.model, batch)
    loss.backward()
    actual = gradients(trainer.model, clear=True)
    expected_loss, kept, advantages = mdpo_objective(trainer, batch, captured[0], old_model, trainer.ref_model, 3)
    expected_loss.backward()
    expected = gradients(trainer.model, clear=True)

    print(f"\n[MDPO oracle] loss {loss.item():.8f} vs {expected_loss.item():.8f}; kept steps {kept}")
    assert batch["mdpo_steps"][0].tolist() == kept
    torch.testing.assert_close(batch["mdpo_advantages"], advantages, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, expected_loss, rtol=1e-5, atol=1e-7)
    assert_same_gradients(actual, expected, rtol=1e-4, atol=1e-5, label="MDPO oracle")
    assert abs(loss.item()) > 1e-6
    # Both clip sides were reached, so the clip is exercised.
    metrics = trainer._metrics["eval"]
    assert metrics["mdpo/clip_ratio/low_mean"][-1] > 0 or metrics["mdpo/clip_ratio/high_mean"][-1] > 0


# ---------------------------------------------------------------------------------------------- guarded rewards


@pytest.mark.parametrize("failure", ["nan", "raises"])
def test_failing_step_rewards_cost_their_advantages_not_the_run(failure, tiny_llada_dir, tmp_path):
    """A NaN reward for one prediction makes 0 the advantages of the steps whose returns read it (and leaves it out
    of the group statistics); a reward function raising on the predictions makes every step's advantage 0. Either
    way the run trains on: finite loss and weights."""

    def flaky(completions, **kwargs):
        rewards = [float(len(set(c[0]["content"]))) for c in completions]
        if len(completions) > 4:  # the call on the 4 x 4 step predictions, not on the final completions
            if failure == "raises":
                raise RuntimeError("the grader crashed")
            rewards[1 * 4 + 2] = math.nan  # row 1, step 2
        return rewards

    args = tiny_grpo_config(
        MDPOConfig, tmp_path, beta=0.0, gradient_accumulation_steps=1, sample_train_steps=4, max_steps=1
    )
    trainer = tiny_trainer(MDPOTrainer, tiny_llada_dir, args, reward_funcs=flaky)
    batch = rollout_batch(trainer, num_prompts=1)
    order = batch["mdpo_steps"][0].argsort()
    advantages = batch["mdpo_advantages"][:, order]
    assert torch.isfinite(advantages).all()
    if failure == "raises":
        assert (advantages == 0).all()
    else:
        # Row 1's returns at steps 0, 1 (future means), 2 (itself) and 3 (the difference) read r_2.
        assert (advantages[1] == 0).all()
        assert advantages[[0, 2, 3]].abs().sum() > 0
    trainer.train()
    assert math.isfinite(trainer.state.log_history[0]["loss"])
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())
