from __future__ import annotations

import torch

from ..generation import cut_at_terminator
from ..seeding import ROW_HINTS, derive_seed
from .diffu_grpo_trainer import DiffuGRPOTrainer
from .igpo_config import IGPOConfig
from .utils import trainer_example


def solution_chunks(num_tokens: int, min_tokens: int, max_tokens: int, generator: torch.Generator) -> list[range]:
    """Cuts `num_tokens` solution tokens into consecutive chunks of U{min_tokens..max_tokens} tokens (IGPO's code);
    a last piece shorter than `min_tokens` is left out (too short for the model to inpaint around)."""
    chunks, start = [], 0
    while num_tokens - start >= min_tokens:
        size = int(torch.randint(min_tokens, max_tokens + 1, (1,), generator=generator))
        chunks.append(range(start, min(start + size, num_tokens)))
        start = chunks[-1].stop
    return chunks


def hint_canvas(
    solution_ids: list[int],
    length: int,
    mask_token_id: int,
    ratio_range: tuple[float, float],
    chunk_tokens: tuple[int, int],
    generator: torch.Generator,
) -> torch.LongTensor:
    """A completion canvas `(length,)` of mask tokens with chunks of the reference solution filled in.

    The solution (cut to the canvas) is split into chunks ([`solution_chunks`]); the injection ratio is drawn as
    eta ~ U[ratio_range]; `n - floor(n (1 - eta))` of the n chunks, chosen uniformly, are revealed, each at its own
    offset in the solution (the solution's token i at canvas position i)."""
    tokens = solution_ids[:length]
    canvas = torch.full((length,), mask_token_id, dtype=torch.long)
    chunks = solution_chunks(len(tokens), *chunk_tokens, generator)
    low, high = ratio_range
    ratio = low + (high - low) * float(torch.rand((), generator=generator, dtype=torch.float64))
    num_revealed = len(chunks) - int(len(chunks) * (1 - ratio))
    for index in torch.randperm(len(chunks), generator=generator)[:num_revealed].tolist():
        chunk = chunks[index]
        canvas[chunk.start : chunk.stop] = torch.tensor(tokens[chunk.start : chunk.stop])
    return canvas


def failed_groups(rewards: torch.Tensor, group_size: int, threshold: float) -> torch.BoolTensor:
    """Per group of `group_size` consecutive rewards: every completion scored (not NaN) and below `threshold`."""
    grouped = rewards.view(-1, group_size)
    return (grouped < threshold).all(dim=1)


def top_fraction(values: torch.Tensor, candidates: torch.BoolTensor, fraction: float) -> torch.BoolTensor:
    """Per row, the `max(1, floor(fraction * c))` candidates with the largest `values` (c: the row's candidates; ties
    to the lower position); False elsewhere and on rows without candidates."""
    count = candidates.sum(dim=1, keepdim=True)
    keep = (count.double() * fraction).floor().long().clamp(min=1)
    order = values.masked_fill(~candidates, float("-inf")).sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(
        1, order, torch.arange(order.shape[1], device=order.device).expand_as(order)
    )
    return candidates & (rank < keep)


@trainer_example('output_dir="llada-igpo", num_iterations=4, num_generations=8, solution_column="solution"', lora=True)
class IGPOTrainer(DiffuGRPOTrainer, name="IGPO", tags=("igpo", "inpainting"), paper="2509.10396"):
    r"""IGPO: d1's token-level GRPO on mean-field log-probs, with hint-guided inpainting on groups that all fail.

    What it changes relative to [`DiffuGRPOTrainer`]:

    - Rollouts. After each training rollout, the completions are scored; in every group whose completions are all
      scored below `success_threshold`, each completion is regenerated once from a partly filled canvas: chunks of
      the row's reference solution (`solution_column`) at their own offsets, the rest masked ([`hint_canvas`]),
      decoded by the sampler without ever changing the given tokens. Up to `max_hinted_replacements` of the group's
      completions are replaced by correct hinted ones (in row order), and TRL then rewards and normalizes the mixed
      group as usual. The given tokens are the rows' `commit_step == -1` positions.
    - Loss. The hint tokens are scored like generated ones (the same one-pass mean-field log-probs, old and
      reference included), but of each completion's hint tokens only the `hint_entropy_ratio` fraction with the
      highest entropy under the rollout policy (per inner iteration, at generation time) stays in TRL's completion
      mask; generated tokens are all kept.

    The dataset needs the `solution_column` column (text). Evaluation rollouts get no hints.
    """

    config_class = IGPOConfig
    # The batch entries the mean-field pass reads (the entropy pass runs it on chunks of them).
    SCORED_KEYS = ("prompt_ids", "prompt_mask", "completion_canvas", "mask_seeds")

    def __init__(self, model, reward_funcs, args: IGPOConfig | None = None, train_dataset=None, **kwargs):
        column = args.solution_column if args is not None else IGPOConfig.solution_column
        column_names = getattr(train_dataset, "column_names", None)
        if isinstance(column_names, list) and column not in column_names:
            raise ValueError(
                f"`train_dataset` has no {column!r} column (its columns: {column_names}): IGPO injects chunks of each "
                "prompt's reference solution into the canvas of groups that all fail. Add the column, or name the "
                "one that holds the solutions with `solution_column`."
            )
        super().__init__(model, reward_funcs, args=args, train_dataset=train_dataset, **kwargs)
        # Whether the rollout round in progress has hinted completions on any process (the same on every process).
        self._round_has_hints = False

    # ------------------------------------------------------------------ rollouts

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        super()._generate_single_turn(prompt_ids, images, multimodal_fields, num_generations, has_tool_images)
        self._round_has_hints = False
        if self.model.training:
            self.inpaint_failed_groups(prompt_ids)
        return cut_at_terminator(self._handoff.rollout.completion_ids, self.eos_token_ids), None

    def solution_ids(self, row: int) -> list[int]:
        """The token ids of the reference solution of the round's row `row`."""
        column = self.args.solution_column
        example = self._handoff.examples[row]
        if column not in example or not isinstance(example[column], str):
            raise ValueError(
                f"IGPO needs each training row's reference solution as text in the {column!r} column "
                f"(`solution_column`); this row has {type(example.get(column)).__name__}."
            )
        return self.processing_class(text=example[column], add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def inpaint_failed_groups(self, prompt_ids: list[list[int]]) -> None:
        """Regenerates the completions of failed groups from hint canvases and swaps correct ones into the rollout.

        Every process regenerates the same number of rows (the most failed rows any process has; padded with
        repeats whose results are dropped), so that the lockstep sampler and the reward gather stay collective."""
        args, rollout = self.args, self._handoff.rollout
        metrics = self._metrics["train"]
        num_rows, group_size = len(prompt_ids), self.num_generations
        rewards = self.extra_completion_rewards(rollout.completion_ids, list(range(num_rows)))
        failed = failed_groups(rewards, group_size, args.success_threshold)
        metrics["igpo/failed_groups"].append(failed.float().mean().item())
        failed_rows = failed.repeat_interleave(group_size).view(-1, num_rows)  # (processes, rows)
        width = int(failed_rows.sum(dim=1).max())
        if width == 0:
            for name in ("hinted_rollouts", "hinted_correct", "replaced"):
                metrics[f"igpo/{name}"].append(0.0)
            return
        self._round_has_hints = True
        process = self.accelerator.process_index
        local = failed_rows[process].nonzero().flatten().tolist()
        rows = (local + [local[0] if local else 0] * width)[:width]
        row_keys = self._rollout_row_keys(num_rows)
        # Keyed by the row alone (not its slot here), so a row's hints do not depend on how rows split over processes.
        keys = [derive_seed(row_keys[row], ROW_HINTS) for row in rows]
        canvases = [
            hint_canvas(
                self.solution_ids(row),
                args.max_completion_length,
                self.adapter.mask_token_id,
                (args.hint_ratio_min, args.hint_ratio_max),
                (args.hint_chunk_min_tokens, args.hint_chunk_max_tokens),
                torch.Generator().manual_seed(key),
            )
            for row, key in zip(rows, keys)
        ]
        device = rollout.completion_ids.device
        hinted, _ = self.generate_rollout(
            [prompt_ids[row] for row in rows], initial_completion=torch.stack(canvases).to(device), row_keys=keys
        )
        correct = (self.extra_completion_rewards(hinted.completion_ids, rows) >= args.success_threshold).view(
            -1, width
        )

        # Which rows take their hinted completion: per group, the first `max_hinted_replacements` correct ones in
        # global row order (decided from gathered values, so every process decides the same).
        # Never the whole group: all correct, it would have no advantage again.
        budget = min(args.max_hinted_replacements, group_size - 1)
        replaced_per_group: dict[int, int] = {}
        replace_local = []
        for owner in range(failed_rows.shape[0]):
            for slot, row in enumerate(failed_rows[owner].nonzero().flatten().tolist()):
                group = (owner * num_rows + row) // group_size
                if correct[owner, slot] and replaced_per_group.get(group, 0) < budget:
                    replaced_per_group[group] = replaced_per_group.get(group, 0) + 1
                    if owner == process:
                        replace_local.append((slot, row))
        length = rollout.completion_ids.shape[1]
        for slot, row in replace_local:
            rollout.completion_ids[row] = hinted.completion_ids[slot]
            rollout.sequences[row, -length:] = hinted.completion_ids[slot]
            rollout.commit_step[row] = hinted.commit_step[slot]
            rollout.steps_per_row[row] = hinted.steps_per_row[slot]
            for name in ("commit_logprob", "commit_entropy", "commit_sampled"):
                if getattr(rollout, name) is not None:
                    getattr(rollout, name)[row] = getattr(hinted, name)[slot]
        real_slots = torch.arange(width, device=correct.device) < failed_rows.sum(dim=1, keepdim=True).to(
            correct.device
        )
        metrics["igpo/hinted_rollouts"].append(float(real_slots.sum()))
        metrics["igpo/hinted_correct"].append(float((correct & real_slots).sum() / real_slots.sum()))
        metrics["igpo/replaced"].append(float(sum(replaced_per_group.values())))

    # ------------------------------------------------------------------ loss

    def _score_rollouts(self, inputs: dict, mode: str) -> dict:
        scored = super()._score_rollouts(inputs, mode)
        if mode == "train" and self._round_has_hints:
            scored["hint_keep"] = self.hint_keep_mask(inputs)
        return scored

    @torch.no_grad()
    def hint_keep_mask(self, inputs: dict) -> torch.Tensor:
        """`(batch, num_iterations, width)`, 1 where TRL's completion mask keeps a token in inner iteration k: every
        generated token, and of the hint tokens (`commit_step == -1`) the `hint_entropy_ratio` top fraction by the
        rollout policy's entropy under iteration k's mean-field pass ([`top_fraction`])."""
        completion_mask = inputs["completion_mask"].bool()
        width = completion_mask.shape[1]
        hints = torch.nn.functional.pad(inputs["commit_step"] < 0, (0, max(width - inputs["commit_step"].shape[1], 0)))
        candidates = hints[:, :width] & completion_mask
        chunk_size = self.args.per_device_train_batch_size
        keep = []
        for iteration in range(self.num_iterations):
            # Every row is scored (not only hinted ones): every process must make the same forwards (FSDP, ZeRO-3).
            entropies = [
                self.scores_for_trl(
                    self.model,
                    {key: inputs[key][start : start + chunk_size] for key in self.SCORED_KEYS},
                    iteration,
                    width,
                    return_entropy=True,
                )[1]
                for start in range(0, completion_mask.shape[0], chunk_size)
            ]
            kept_hints = top_fraction(torch.cat(entropies).float(), candidates, self.args.hint_entropy_ratio)
            keep.append(~candidates | kept_hints)
        return torch.stack(keep, dim=1).to(inputs["completion_mask"].dtype)

    def _compute_loss(self, model, inputs):
        if "hint_keep" in inputs:
            keep = inputs["hint_keep"][:, inputs["inner_iteration"]]
            inputs = {**inputs, "completion_mask": inputs["completion_mask"] * keep}
        return super()._compute_loss(model, inputs)
