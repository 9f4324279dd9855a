r"""SPG on Countdown with LLaDA-8B-Instruct: SPG's recipe without SFT (Wang et al. 2025, arXiv 2510.09541).

QLoRA: a 4-bit NF4 base (bf16 compute) with LoRA r=128, alpha=64 on the attention and MLP projections; 8 GPUs;
6 completions per device x 2 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6 per optimizer step, each
rollout batch reused for mu = 4 inner iterations without an importance ratio (SPG's REINFORCE). The objective has no
ratio, no KL and no reference model: per answer token, the ELBO for A >= 0 and the mixture 0.5 * EUBO + 0.5 * ELBO
(EUBO order beta = 1.5) for A < 0, both from 2 block-wise views (one block of 32 scored, earlier blocks clean, later
ones masked), A = r - mean(r). The numbers are SPG's `spg/slurm_scripts/train.yaml` and `spg_mix/*.sbatch`
(facebookresearch/SPG, commit a1c71209, as read in shared/research/algorithms-wave2.md section 2); see
docs/trainers/spg.md. SPG gives no step count, so `max_steps=4000` here is our choice, not the paper's. The 4-bit
base needs bitsandbytes (`pip install "trl_diffusion[quantization]"`).

Launch (8 GPUs, ZeRO-2):

    TRL_CONFIGS=$(python -c "import pathlib, trl; print(pathlib.Path(trl.__file__).parent / 'accelerate_configs')")
    accelerate launch --config_file $TRL_CONFIGS/zero2.yaml --num_processes 8 \
        examples/spg_countdown.py

Every field of `trl-diffusion spg --help` is a flag here too: `--negative_bound eubo --eubo_beta 2.0` is SPG's
EUBO-only Countdown run, `--mask_sampler stratified` its random-masking ablation, `--load_in_4bit false` trains LoRA
on a bf16 base. A tiny CPU run: `--model_name_or_path TINY_DIR --use_cpu --bf16 false --dtype float32
--load_in_4bit false --max_steps 1 ...`.
"""

from trl_diffusion.scripts.train import run_recipe

RECIPE = {
    "model_name_or_path": "GSAI-ML/LLaDA-8B-Instruct",
    "dtype": "bfloat16",  # also the 4-bit compute dtype
    "dataset_name": "countdown",
    "output_dir": "llada-8b-instruct-spg-countdown",
    # QLoRA (LoRA target modules: LLaDA's q, k, v, o, gate, up and down projections, the default for LLaDA)
    "load_in_4bit": True,
    "bnb_4bit_quant_type": "nf4",
    "use_peft": True,
    "lora_r": 128,
    "lora_alpha": 64,
    # rollouts: 6 per device x 2 accumulation steps x 8 GPUs = 96 completions = 16 prompts x 6
    "per_device_train_batch_size": 6,
    "gradient_accumulation_steps": 2,
    "num_generations": 6,
    "max_completion_length": 256,
    "block_length": 32,
    "diffusion_steps": 128,
    "temperature": 0.9,
    # objective (SPG's defaults of SPGConfig, spelled out; Countdown's beta for the mix)
    "num_iterations": 4,
    "mask_sampler": "block",
    "num_mc_samples": 2,
    "negative_bound": "mix",
    "eubo_beta": 1.5,
    "eubo_mix_weight": 0.5,
    "scale_rewards": "none",
    # optimization
    "learning_rate": 3e-6,
    "lr_scheduler_type": "constant",
    "weight_decay": 0.1,
    "max_grad_norm": 0.2,
    "max_steps": 4000,
    "bf16": True,
    "logging_steps": 1,
}

if __name__ == "__main__":
    raise SystemExit(run_recipe("spg", RECIPE, prog="examples/spg_countdown.py", description=__doc__))
