"""The GPU check's time budget on one GPU, estimated without a GPU: every process, model build, trainer and job the
real check runs, each with a cost model.

The job lists are the stages' own (`trainer_smoke.planned_runs`, `memory.planned_points`, `throughput.planned_runs`,
`step_time.planned_runs` and `step_time.measured_steps`), called on the arguments the check passes each stage, so the
estimate counts what the check runs. Costs:

- fixed costs measured on the project's CPU machine (2 shared cores, busy: upper bounds for a GPU host's 16 cores):
  a new interpreter's imports of the check (`python -c "import torch, transformers, trl, trl_diffusion.trainer"`:
  8.5 s), building and saving the 318M-parameter model (`_common.build_model_dir`: 14.5 s), a command-line
  training run's own overhead at the smoke size (1.3-2 s after the first; the first 19.8 s, its one-time imports of
  peft, bitsandbytes and datasets);
- assumed fixed costs on the GPU host: CUDA initialization per process (3 s), a trainer built from the saved model
  (3 s: 1.27 GB read, copied to the GPU, the Trainer's set-up), a command-line run (4 s: the same, LoRA or the 4-bit
  quantization, +3 s for the latter), JSON and figure per stage (3 s);
- GPU work: counted FLOPs (2 x matmul parameters x tokens per forward, the output head at the positions it is
  evaluated at, attention 4 x query tokens x key tokens x d_model per block) at `UTILIZATION` (30%) of `PEAK_FLOPS`
  (750 TFLOP/s of bf16: below the 989 dense of the H100 SXM and H200 datasheets, about a PCIe H100's 756), plus a
  fixed 10 ms per forward pass of the 24 blocks (eager PyTorch: ~40 kernels per block at ~10 us of dispatch and
  launch each) and 3 ms per sampler step (token selection, host synchronizations). A training pass with activation
  checkpointing costs 4 forwards (forward, recomputation, backward at 2x), an optimizer step 0.1 s (AdamW over
  318M fp32 parameters, clipping, the Trainer's bookkeeping); the 4-bit runs' GPU work counts twice (dequantization).

Where a count depends on the run (a random model's threshold decoding stops within L steps; a point that runs out of
memory skips larger ones), the estimate takes the upper bound.
"""

from __future__ import annotations

import sys
from dataclasses import asdict, dataclass
from pathlib import Path

GPU_DIR = Path(__file__).resolve().parent
sys.path.insert(0, str(GPU_DIR.parent))

import memory  # noqa: E402
import step_time  # noqa: E402
import throughput  # noqa: E402
import trainer_smoke  # noqa: E402
from _common import MODEL_SIZES, TRAINERS, ModelSize, RolloutSize  # noqa: E402

PEAK_FLOPS = 750e12
UTILIZATION = 0.30
BUDGET_SECONDS = 300.0  # the 5 minutes: a 15-minute loan runs the check and reruns it once


@dataclass(frozen=True)
class Costs:
    """Seconds of the fixed costs (see the module's docstring: which were measured here, which assumed)."""

    interpreter_start: float = 8.5  # measured: imports of a new interpreter
    cuda_init: float = 3.0
    model_build: float = 15.0  # measured: 14.5 s
    cli_first_run_imports: float = 18.0  # measured: the first command-line run's one-time imports (19.8 - 1.5 s)
    cli_run: float = 4.0
    quantize: float = 3.0
    trainer_build: float = 3.0
    stage_outputs: float = 3.0
    forward_overhead: float = 0.010
    sampler_step_overhead: float = 0.003
    optimizer_step: float = 0.1


COSTS = Costs()


def smoke_passes(command: str, diffusion_steps: int = 8) -> tuple[int, int]:
    """`(training passes, no-grad reference passes)` per optimizer step of a command-line smoke run, from the
    command's config defaults: its Monte Carlo samples (ESPO and SPG two passes each: coupled pairs, ELBO and EUBO),
    LFPO's states, the trajectory trainers' selected transitions (at most one per denoising step of the smoke's 8),
    coupled-GRPO's complementary pair, one for the rest and SFT; a reference pass per training pass when beta > 0."""
    from trl_diffusion.scripts.registry import config_class

    fields = {
        name: field.default
        for name, field in config_class(command).__dataclass_fields__.items()
        if isinstance(field.default, (int, float))
    }
    if "num_mc_samples" in fields:
        passes = fields["num_mc_samples"] * (2 if command in ("espo", "spg") else 1)
    elif "lfpo_num_states" in fields:
        passes = fields["lfpo_num_states"]
    elif "num_selected_transitions" in fields:
        passes = min(fields["num_selected_transitions"], diffusion_steps)
    else:
        passes = 2 if command == "coupled_grpo" else 1
    return passes, passes if fields.get("beta", 0.0) > 0 else 0


class Flops:
    """FLOPs of a LLaDA of `size` (d_model, blocks, SwiGLU width, vocabulary)."""

    def __init__(self, size: ModelSize):
        self.size = size
        self.block_params = size.n_layers * (4 * size.d_model**2 + 3 * size.d_model * size.mlp_hidden_size)
        self.head_params = size.d_model * (size.vocab_size or 108)

    def forward(self, rows: int, tokens: int, keys: int, head_positions: int) -> float:
        """One forward of `rows` sequences: `tokens` query tokens each attending to `keys` tokens, the output head
        at `head_positions`."""
        blocks = 2 * self.block_params * tokens + 4 * tokens * keys * self.size.d_model * self.size.n_layers
        return rows * (blocks + 2 * self.head_params * head_positions)


def gpu_seconds(flops: float) -> float:
    return flops / (PEAK_FLOPS * UTILIZATION)


def forward_seconds(model: Flops, rows: int, tokens: int, keys: int, head_positions: int) -> float:
    return gpu_seconds(model.forward(rows, tokens, keys, head_positions)) + COSTS.forward_overhead


def training_pass_seconds(model: Flops, rows: int, sequence: int, head_positions: int) -> float:
    """Forward and backward of one Monte Carlo pass with activation checkpointing: 4 forwards' work and overhead."""
    return 4 * forward_seconds(model, rows, sequence, sequence, head_positions)


def rollout_seconds(model: Flops, rows: int, prompt: int, canvas: int, block: int, steps: int, cache="none") -> float:
    """A sampler run of `steps` forwards over `canvas` tokens in blocks of `block` (the head at the block's
    positions): with `cache` none every forward reads the whole sequence; prefix, from the block on; dual, the block
    only (each block's first step reads the whole sequence to fill the cache)."""
    blocks = max(1, canvas // block)
    per_block = [steps // blocks + (1 if index < steps % blocks else 0) for index in range(blocks)]
    sequence = prompt + canvas
    seconds = 0.0
    for index, count in enumerate(per_block):
        if count == 0:
            continue
        rest = {"none": sequence, "prefix": canvas - index * block, "dual": block}[cache]
        seconds += forward_seconds(model, rows, sequence, sequence, block)
        seconds += (count - 1) * forward_seconds(model, rows, rest, sequence, block)
        seconds += count * COSTS.sampler_step_overhead
    return seconds


# ------------------------------------------------------------------------------------------------- stages


def estimate_trainers(argv: list[str], size: ModelSize) -> dict:
    """`trainer_smoke.py`, in the check's process: one command-line run per planned (command, variant)."""
    args = trainer_smoke.parse_args(argv)
    runs = trainer_smoke.planned_runs(args)
    model = Flops(size)
    rollout = dict(rows=4, prompt=64, canvas=32, block=8)
    seconds = COSTS.cli_first_run_imports + COSTS.stage_outputs
    for command, variant in runs:
        run = COSTS.cli_run + (COSTS.quantize if variant == "qlora_4bit" else 0.0)
        if command == "sft":
            work = training_pass_seconds(model, 4, 64 + 8, 8)
        else:
            steps = 32 if command in trainer_smoke.LEFT_TO_RIGHT else 8
            passes, reference = smoke_passes(command)
            work = rollout_seconds(model, **rollout, steps=steps)
            work += passes * training_pass_seconds(model, 4, 96, 32) + reference * forward_seconds(
                model, 4, 96, 96, 32
            )
        work = 2 * (work + COSTS.optimizer_step)  # two optimizer steps
        seconds += run + (2 if variant == "qlora_4bit" else 1) * work
    return {"jobs": len(runs), "processes": 0, "seconds": seconds}


def estimate_memory(argv: list[str], size: ModelSize) -> dict:
    """`memory.py`: one rollout job, then one job per planned point, in the spawned process."""
    args = memory.parse_args(argv)
    preset = memory.PRESETS["smoke" if args.smoke else ("gpu" if args.device == "cuda" else "cpu")]
    planned, _ = memory.planned_points(args.trainers, *memory.sweep(args, preset))
    model, shape = Flops(size), preset.rollout
    sequence = shape.max_prompt_length + shape.max_completion_length
    seconds = COSTS.stage_outputs + COSTS.trainer_build
    seconds += rollout_seconds(
        model,
        shape.rows,
        shape.max_prompt_length,
        shape.max_completion_length,
        shape.block_length,
        shape.diffusion_steps,
    )
    for name, n in planned:
        passes = 2 * n if name == "espo" else n  # ESPO: coupled pairs, two passes each
        step = passes * training_pass_seconds(model, shape.rows, sequence, shape.max_completion_length // 2)
        seconds += COSTS.trainer_build + memory.STEPS * (step + COSTS.optimizer_step)
    return {"jobs": 1 + len(planned), "processes": 1, "seconds": seconds}


def estimate_throughput(argv: list[str], size: ModelSize, prompt_length: int = 32) -> dict:
    """`throughput.py`, in the check's process: the model loaded once, then every planned `generate` call (threshold
    decoding at its upper bound of L steps; prompts of about `prompt_length` tokens: 25 measured for the task's
    test prompts with the character tokenizer)."""
    args = throughput.parse_args(argv)
    preset = throughput.PRESETS["smoke" if args.smoke else ("gpu" if args.device == "cuda" else "cpu")]
    runs = throughput.planned_runs(args)
    model = Flops(size)
    seconds = COSTS.stage_outputs + COSTS.trainer_build
    forwards = 0
    for length, decoding, _, cache, _ in runs:
        steps = length // 2 if decoding == "fixed" else length
        forwards += steps
        seconds += rollout_seconds(model, preset.rows, prompt_length, length, preset.block_length, steps, cache)
    return {"jobs": len(runs), "processes": 0, "forward_passes": forwards, "seconds": seconds}


def update_passes(name: str, overrides: dict) -> tuple[int, int]:
    """`(training passes per optimizer step, no-grad forwards per rollout)` of a trainer at its defaults: its Monte
    Carlo passes (ESPO: two per coupled pair; LFPO: K states; DiffuGRPO: one), and the reference passes (beta > 0)
    and old-policy passes (num_iterations > 1) of its scoring."""
    fields = {field: value.default for field, value in TRAINERS[name][0].__dataclass_fields__.items()}
    fields.update(overrides)
    passes = {"diffu_grpo": 1, "espo": 2 * fields.get("num_mc_samples", 1), "lfpo": fields.get("lfpo_num_states", 1)}
    count = passes.get(name, fields.get("num_mc_samples", 1))
    scoring = count * ((fields.get("beta", 0.0) > 0) + (fields.get("num_iterations", 1) > 1))
    return count, scoring


def estimate_step_time(argv: list[str], size: ModelSize) -> dict:
    """`step_time.py`: one job per planned run and round (a trainer trained for a warm-up step and its measured
    steps), in the spawned process."""
    args = step_time.parse_args(argv)
    preset = step_time.PRESETS["smoke" if args.smoke else ("gpu" if args.device == "cuda" else "cpu")]
    rollout = RolloutSize(
        **{
            **asdict(preset.rollout),
            "max_completion_length": args.max_completion_length or preset.rollout.max_completion_length,
            "diffusion_steps": args.diffusion_steps or preset.rollout.diffusion_steps,
        }
    )
    plan = step_time.planned_runs(args)
    rounds = args.rounds or preset.rounds
    model = Flops(size)
    sequence = rollout.max_prompt_length + rollout.max_completion_length
    cache = args.generation_cache or "none"
    sample = rollout_seconds(
        model,
        rollout.rows,
        rollout.max_prompt_length,
        rollout.max_completion_length,
        rollout.block_length,
        rollout.diffusion_steps,
        cache,
    )
    seconds, steps_total = COSTS.stage_outputs, 0
    for _, name, own in plan:
        overrides = {**step_time.common_overrides(args), **own}
        steps, rollouts = step_time.measured_steps(name, args.steps or preset.steps, overrides)
        steps, rollouts = steps + 1, rollouts + 1  # the warm-up step and its rollout
        passes, scoring = update_passes(name, overrides)
        pass_seconds = training_pass_seconds(model, rollout.rows, sequence, rollout.max_completion_length // 2)
        no_grad = forward_seconds(model, rollout.rows, sequence, sequence, rollout.max_completion_length // 2)
        run = COSTS.trainer_build + rollouts * (sample + scoring * no_grad)
        run += steps * (passes * pass_seconds + COSTS.optimizer_step)
        seconds += rounds * run
        steps_total += rounds * steps
    return {"jobs": rounds * len(plan), "processes": 1, "optimizer_steps": steps_total, "seconds": seconds}


ESTIMATORS = {
    "trainers": estimate_trainers,
    "memory": estimate_memory,
    "throughput": estimate_throughput,
    "step_time": estimate_step_time,
}


def estimate(stages: list[tuple[str, list[str]]], size: ModelSize = MODEL_SIZES["gpu"], shared: tuple = ()) -> dict:
    """The estimate of a check that runs `stages` (`(name, the stage's argv)`, in order) on one GPU: the check's own
    start (interpreter, CUDA, the model's build) and each stage's jobs; the stages named in `shared` run their jobs
    in one spawned process (counted once). Per stage `jobs`, `processes`, `seconds`; and the total."""
    per_stage = {"startup": {"jobs": 1, "processes": 1, "seconds": COSTS.interpreter_start + COSTS.cuda_init}}
    per_stage["startup"]["seconds"] += COSTS.model_build
    shared_started = False
    for name, argv in stages:
        entry = ESTIMATORS[name](argv, size)
        if entry["processes"] and not (name in shared and shared_started):
            entry["seconds"] += COSTS.interpreter_start + COSTS.cuda_init
        elif entry["processes"]:
            entry["processes"] = 0  # the shared process, counted with the first stage that used it
        shared_started = shared_started or name in shared
        per_stage[name] = entry
    for entry in per_stage.values():
        entry["seconds"] = round(entry["seconds"], 1)
    total = round(sum(entry["seconds"] for entry in per_stage.values()), 1)
    return {
        "stages": per_stage,
        "total_seconds": total,
        "budget_seconds": BUDGET_SECONDS,
        "within_budget": total <= BUDGET_SECONDS,
        "assumptions": {
            "peak_bf16_flops": PEAK_FLOPS,
            "utilization": UTILIZATION,
            "costs_seconds": asdict(COSTS),
            "model_parameters_in_matmuls": Flops(size).block_params + Flops(size).head_params,
        },
    }


def format_estimate(result: dict) -> str:
    lines = [
        f"estimated GPU time on one GPU ({PEAK_FLOPS / 1e12:.0f} TFLOP/s bf16 peak at {UTILIZATION:.0%}, fixed "
        "costs in benchmarks/gpu/budget.py):"
    ]
    for name, entry in result["stages"].items():
        detail = ", ".join(f"{key} {value}" for key, value in entry.items() if key != "seconds")
        lines.append(f"  {name:<11} {entry['seconds']:6.1f} s  ({detail})")
    within = "within" if result["within_budget"] else "OVER"
    lines.append(f"  total       {result['total_seconds']:6.1f} s  ({within} the {BUDGET_SECONDS:.0f} s budget)")
    return "\n".join(lines)


if __name__ == "__main__":
    import check

    print(format_estimate(estimate(check.gpu_stage_arguments(), shared=check.SHARED_PROCESS)))
