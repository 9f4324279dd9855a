"""Per-GPU memory plan for the published recipes, as code, checked against measured peaks on the CPU.

The plan: for LLaDA-8B, SDAR-8B and LLaDA2.0-mini (architectures from the package's own configs, parameters counted
on the meta device through the package: no Hub), for each trainer family (VRPO: sequence ELBO, one backward; BGPO:
one backward per Monte Carlo sample; DiffuGRPO: token level; TraceRL: trajectory chunks; LFPO: (row, state) groups;
JustGRPO: one pass of positions at a time; SFT), each engine (DDP, the unsharded baseline; DeepSpeed ZeRO-2 and
ZeRO-3; FSDP2) and each mode (full fine-tuning, LoRA, QLoRA on a 4-bit NF4 base), on 8 GPUs: the bytes per GPU of

- weights, the fp32 master copy where the engine keeps one (ZeRO-2 / ZeRO-3: a separate sharded fp32 copy; FSDP2:
  accelerate upcasts the trainable parameters to fp32 and shards them, so the sharded parameter is the master and
  bf16 is only the gathered compute copy; DDP: none, the recipes load bf16 weights and AdamW updates them in bf16),
- gradients (and the engine's gradient buffers: DDP's buckets, DeepSpeed's reduce bucket),
- AdamW's two moments (fp32 on the master copy, bf16 under DDP),
- the engine's gathered parameters (ZeRO-3 and FSDP2 all-gather a unit at a time; FSDP2 keeps its root unit, the
  embedding and the output head, gathered from forward to backward),
- activations with gradient checkpointing on (TRL's default), following what each trainer's training step holds:
  VRPO keeps its n_t Monte Carlo graphs for one backward, BGPO one group of `mc_samples_per_backward` at a time, LFPO
  one (row, state) group plus its EMA policy's logits, the trajectory trainers one chunk of `transitions_per_forward`
  states, JustGRPO one pass of `just_grpo_positions_per_forward` copies; the logits at the scored positions in fp32,

at each recipe's micro-batch, canvas (prompt + completion; the composite `[noisy | clean]` input of a block-causal
model) and Monte Carlo count. The formula counts tensors: per transformer block it lists what autograd saves for the
backward pass (a linear layer saves its input only when its weight trains, an RMSNorm its fp32 input, SDPA its q, k,
v, output and log-sum-exp, ...), what a checkpointed block keeps (its input), what the recomputation and the backward
of one block add, and the logits tensors of each trainer's scoring code, each read from the code it models.

The check: the same formula at CPU scale (fp32, and bf16 weights without autocast) against the measured process peak of
two optimizer steps of two micro-batches each (`benchmarks/memory.py`'s probe: the resident set's high-water mark above
the memory held before the steps, reset through `/proc/self/clear_refs`, glibc's mmap threshold pinned so that the
resident set follows the live tensors), on two model sizes (the 0.9M-parameter tiny LLaDA of `memory.py` and a
20M-parameter LLaDA with a 32,000-token vocabulary), for VRPO, BGPO, DiffuGRPO and LFPO, each in a fresh process with
one torch thread; it passes when every point is within 15%. TraceRL, JustGRPO and the SFT trainer are not measured
(their blocks are the checked ones; their head terms are read from their scoring code). A structural check compares the
per-block saved bytes of the formula with the unique bytes autograd saves in one block of a tiny LLaDA, SDAR and LLaDA2
(fp32 and bf16, full fine-tuning and LoRA): exact for the dense blocks, within 3% for the MoE block (its index tensors
follow the routing). The sharding divisors and engine buffers are not measured here (no GPU, no NCCL): they follow the
engines' documented behavior (see `ENGINE_NOTES`).

    python benchmarks/memory_plan.py            # the plan and the CPU check (~5 minutes on 2 cores)
    python benchmarks/memory_plan.py --smoke    # seconds: the plan and one small check point (CI)
    python benchmarks/memory_plan.py --no-measure   # the plan only (seconds)

Writes `<output-dir>/<name>.json` and `<name>.png` (default `benchmarks/results/memory_plan.*`) and prints the tables
and the validation figures.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
from _common import (
    ModelSize,
    RolloutSize,
    benchmark_parser,
    build_model_dir,
    format_table,
    fresh_process_context,
    machine_info,
    make_trainer,
    run_in_fresh_process,
    save_results,
    select_preset,
    set_threads,
)
from memory import (
    PeakMemory,
    _fix_mmap_threshold,
    enable_checkpointing_as_train,
    generate_batch,
    optimizer_state_bytes,
)

GIB = 2**30
MIB = 2**20
NUM_GPUS = 8
# The acceptance of the CPU check: every point's prediction within this fraction of the measured peak.
TOLERANCE = 0.15
FP32, BF16 = 4, 2

# ================================================================================================ architectures


@dataclass(frozen=True)
class MoE:
    """The mixture of experts of a model's MoE layers (GLM-4-MoE's layout, as LLaDA2 has it)."""

    experts: int
    per_token: int
    intermediate: int
    shared_intermediate: int
    dense_layers: int  # the first `dense_layers` layers have a dense MLP of the model's `intermediate`
    groups: int  # the router's expert groups (`n_group`) and how many of them a token may use (`topk_group`)
    groups_per_token: int


@dataclass(frozen=True)
class Architecture:
    """What the memory formula reads from a model: sizes from its config, parameter counts from the model built on
    the meta device (through the package's own classes), the linear layers LoRA adapts and 4-bit quantizes."""

    name: str
    kind: str  # "llada" (full attention, fp32 RoPE), "sdar" (Qwen3, block-causal), "llada2" (GLM-4-MoE, block-causal)
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    rotary_dim: int
    qk_norm: bool
    block_size: int | None
    moe: MoE | None
    parameters: int  # trainable parameters (the state dict's floating tensors that train)
    embedding: int
    head: int
    quantizable: int  # nn.Linear weights outside the output head: what bitsandbytes replaces by 4-bit
    largest_linear: int  # elements of the largest quantizable weight (dequantized one at a time under QLoRA)
    largest_unit: int  # parameters of the largest transformer block (the FSDP2 / ZeRO-3 gather unit)
    root_unit: int  # parameters outside the blocks (FSDP2's root unit: embedding, norm, head)
    lora_widths: tuple[tuple[str, int, int], ...]  # per block: (name, in, out) of every LoRA-adapted linear layer
    lora_layers_adapted: int  # blocks whose linear layers LoRA adapts (all of them)

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def block_causal(self) -> bool:
        return self.block_size is not None

    def lora_parameters(self, rank: int) -> int:
        return (
            rank * self.lora_layers_adapted * sum(width_in + width_out for _, width_in, width_out in self.lora_widths)
        )

    def as_json(self) -> dict:
        data = asdict(self)
        data["lora_widths"] = [list(entry) for entry in self.lora_widths]
        return data


def _lora_rule(model_type: str):
    from trl_diffusion.models.lora import LORA_RULES

    return LORA_RULES[model_type]


def _excluded(name: str, excludes: list[str] | None) -> bool:
    return any(name == pattern or name.endswith("." + pattern) for pattern in excludes or [])


def architecture_of(name: str, model: torch.nn.Module) -> Architecture:
    """Reads an [`Architecture`] from a model built on the meta device (no weights)."""
    config = model.config
    model_type = config.model_type
    rule = _lora_rule(model_type)
    head = model.get_output_embeddings()
    embedding = model.get_input_embeddings()
    if model_type == "llada":
        kind, blocks = "llada", model.model.transformer.blocks
        heads, kv_heads, head_dim = config.n_heads, config.num_key_value_heads, config.head_dim
        rotary_dim, qk_norm, block_size = head_dim, False, None
    else:
        kind = "sdar" if model_type.startswith("sdar") else "llada2"
        blocks = model.model.layers
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        factor = (config.rope_parameters or {}).get("partial_rotary_factor", 1.0)
        rotary_dim, qk_norm, block_size = int(head_dim * factor), True, config.block_size
    moe = None
    if kind == "llada2":
        moe = MoE(
            experts=config.n_routed_experts,
            per_token=config.num_experts_per_tok,
            intermediate=config.moe_intermediate_size,
            shared_intermediate=config.moe_intermediate_size * config.n_shared_experts,
            dense_layers=config.first_k_dense_replace,
            groups=config.n_group,
            groups_per_token=config.topk_group,
        )
    trainable = sum(p.numel() for p in model.parameters())
    linears = [
        (module_name, module)
        for module_name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and module is not head
    ]
    quantizable = sum(module.weight.numel() for _, module in linears)
    # LoRA: the rule's target names (the last component of a module's name), less its exclusions, per block (the
    # first block that has them all: LLaDA2's dense layer 0 and MoE layers adapt the same names, shared experts).
    widths: dict[int, list[tuple[str, int, int]]] = {}
    for module_name, module in linears:
        last = module_name.split(".")[-1]
        if last in rule.target_modules and not _excluded(module_name, rule.exclude_modules):
            index = next((int(part) for part in module_name.split(".") if part.isdigit()), -1)
            widths.setdefault(index, []).append((last, module.in_features, module.out_features))
    lora_total = sum(w_in + w_out for entries in widths.values() for _, w_in, w_out in entries)
    per_block = widths[max(widths)]  # a representative (the last) block's adapted layers
    per_block_total = sum(w_in + w_out for _, w_in, w_out in per_block)
    if lora_total % per_block_total:  # the blocks differ (LLaDA2: the dense layer 0): count exactly per block
        per_block = tuple((f"{n}@{i}", w_in, w_out) for i, entries in widths.items() for n, w_in, w_out in entries)
        adapted = 1
    else:
        adapted = lora_total // per_block_total
    block_params = max(sum(p.numel() for p in block.parameters()) for block in blocks)
    in_blocks = sum(p.numel() for block in blocks for p in block.parameters())
    return Architecture(
        name=name,
        kind=kind,
        hidden=config.hidden_size,
        layers=config.num_hidden_layers,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        intermediate=config.intermediate_size,
        vocab=embedding.weight.shape[0],
        rotary_dim=rotary_dim,
        qk_norm=qk_norm,
        block_size=block_size,
        moe=moe,
        parameters=trainable,
        embedding=embedding.weight.numel(),
        head=head.weight.numel(),
        quantizable=quantizable,
        largest_linear=max(module.weight.numel() for _, module in linears),
        largest_unit=block_params,
        root_unit=trainable - in_blocks,
        lora_widths=tuple(per_block),
        lora_layers_adapted=adapted,
    )


def published_architectures() -> dict[str, Architecture]:
    """LLaDA-8B, SDAR-8B and LLaDA2.0-mini from the package's configs, whose defaults are the published values
    (`tests/test_models.py`, `tests/test_sdar.py`, `tests/test_llada2.py` check the counts)."""
    from trl_diffusion.models import (
        LLaDA2MoeConfig,
        LLaDA2MoeModelLM,
        LLaDAConfig,
        LLaDAModelLM,
        SDARConfig,
        SDARForCausalLM,
    )

    built = {}
    with torch.device("meta"):
        built["LLaDA-8B"] = LLaDAModelLM(LLaDAConfig())
        built["SDAR-8B"] = SDARForCausalLM(SDARConfig())
        built["LLaDA2.0-mini"] = LLaDA2MoeModelLM(LLaDA2MoeConfig())
    return {name: architecture_of(name, model) for name, model in built.items()}


def llada_architecture(name: str, size: ModelSize) -> Architecture:
    """A benchmark LLaDA of `size` (`_common.ModelSize`), read on the meta device as the published ones are."""
    from trl_diffusion.models import LLaDAConfig, LLaDAModelLM

    vocab = size.vocab_size or 108  # the tiny tokenizer's vocabulary
    config = LLaDAConfig(
        d_model=size.d_model,
        n_layers=size.n_layers,
        n_heads=size.n_heads,
        n_kv_heads=size.n_heads,
        mlp_hidden_size=size.mlp_hidden_size,
        vocab_size=vocab,
        embedding_size=vocab,
        max_sequence_length=4096,
    )
    with torch.device("meta"):
        model = LLaDAModelLM(config)
    return architecture_of(name, model)


# ================================================================================================ activations


@dataclass(frozen=True)
class Lora:
    """LoRA as the recipes set it (PEFT's LoRA layers: `lora_B(lora_A(dropout(x))) * scaling` beside a frozen base)."""

    rank: int = 128
    dropout: float = 0.05
    # Bytes per element of dropout's saved mask: 1 on a GPU (`native_dropout`'s boolean mask); None for the
    # activation dtype (the CPU's dropout multiplies by a noise tensor of the input's dtype and saves that).
    mask_bytes: int | None = 1
    # Bytes per element of the adapter's weights, and so of its path's activations (PEFT casts the input to the
    # adapter's dtype): fp32 when PEFT upcasts the adapter on a bf16 base (its default), bf16 where TRL or DeepSpeed
    # casts it (ZeRO-3, QLoRA; DeepSpeed casts every parameter under bf16); None for the activation dtype.
    adapter_bytes: int | None = None


@dataclass(frozen=True)
class Forward:
    """One forward pass with gradients, as a trainer's scoring code runs it.

    Args:
        rows: canvases in the pass.
        tokens: model input length of each (prompt + completion; the composite length for a block-causal model).
        logit_tokens: positions per canvas the output head computes (the completion, or the composite's kept ones).
        head_input_tokens: positions per canvas of the head's saved input (the whole final hidden state when the
            model slices `logits_to_keep` as a view, as LLaDA and transformers' models do for an int; the kept ones
            for a tensor of positions).
        scored: positions, over all rows, whose logits go through the fp32 softmax.
        masked: whether an attention mask is passed (left-padded prompts; always for a block-causal model).
        head: the family's copies of the scored fp32 logits (see [`HeadCopies`]).
    """

    rows: int
    tokens: int
    logit_tokens: int
    head_input_tokens: int
    scored: int
    masked: bool
    head: HeadCopies


@dataclass(frozen=True)
class HeadCopies:
    """(scored, vocab) fp32 tensors of a scoring function, counted from its code.

    Args:
        resident: held from the forward to the head's backward (saved by logsumexp / log_softmax, or kept by a frame).
        forward: alive at the end of the forward, `resident` included (temporaries of the loss).
        backward: alive at the head's backward, `resident` included (the softmax gradient's temporaries).
        through_blocks: still held while the blocks back-propagate (a generator frame's locals: LFPO).
    """

    resident: int = 1
    forward: int = 2
    backward: int = 4
    through_blocks: int = 0


# `_scored_logprobs` (ELBO terms, trajectory states): the fp32 copy saved by logsumexp; logsumexp's temporary in the
# forward; in the backward the gather's gradient (scattered into zeros), `x - lse`, its `exp` and their product.
ELBO_HEAD = HeadCopies(resident=1, forward=2, backward=5)
# d1's mean-field pass asks for the entropy too: `log_probs_all`, its `exp`, `nan_to_num` and their product are alive
# at once beside the saved copy before the function returns (its graph is detached and freed then).
DIFFU_GRPO_HEAD = HeadCopies(resident=1, forward=5, backward=5)
# LFPO's group: the current and EMA logits and the contrastive `z+` / `z-` are locals of the generator, suspended at
# its `yield` through the whole backward; two temporaries each while z+ and z- are formed; in the backward of the
# second softmax (z+, autograd runs z- first) its four temporaries and the gradient z- left for the current logits.
LFPO_HEAD = HeadCopies(resident=4, forward=6, backward=9, through_blocks=4)
# The SFT loss: the fp32 masked logits and `log_softmax`'s saved output, `exp` and the product of the no-grad entropy
# statistic; after the loss returns, the saved output only.
SFT_HEAD = HeadCopies(resident=1, forward=4, backward=5)
# JustGRPO reads one position per copy: its (copies, vocab) fp32 tensors are negligible; the head's bf16 logits over
# the positions after the pass's start are not (counted through `logit_tokens`).
JUST_GRPO_HEAD = HeadCopies(resident=1, forward=3, backward=5)


def _norm_saved(width: int, vectors: int, a: int, trainable: bool, input_is_fp32_saved_elsewhere: bool) -> int:
    """Bytes per token an RMSNorm (`LlamaRMSNorm`) saves: its input in fp32 (a copy unless the input already is fp32
    and counted elsewhere), the rsqrt of each normalized vector, and, when its weight trains, the normalized tensor in
    the activation dtype (saved by `weight * h`)."""
    fp32_input = 0 if (a == FP32 and input_is_fp32_saved_elsewhere) else FP32 * width
    return fp32_input + FP32 * vectors + (a * width if trainable else 0)


def _linear_inputs(widths: list[int], a: int, lora: Lora | None, adapted: bool) -> int:
    """Bytes per token the linear layers reading one input tensor save: the input once if some consumer saves it (a
    trainable base weight, or LoRA without dropout), and for LoRA with dropout each adapted consumer's dropout mask
    (1 byte) and dropped-out copy; plus each adapted consumer's rank-r intermediate. `widths` lists the consumers'
    input width (all equal)."""
    width = widths[0]
    if lora is None:
        return a * width
    if not adapted:
        return 0
    adapter = a if lora.adapter_bytes is None else lora.adapter_bytes
    per_consumer = adapter * lora.rank
    if lora.dropout > 0:
        mask = adapter if lora.mask_bytes is None else lora.mask_bytes
        return len(widths) * (per_consumer + width * (mask + adapter))
    # no dropout: lora_A saves its input, the block's tensor itself or its copy in the adapter's dtype
    return adapter * width + len(widths) * per_consumer


@dataclass(frozen=True)
class BlockBytes:
    """Per token of one transformer block: what its backward needs (the recompute set under checkpointing, its input
    excluded), what its backward adds on top, and the working set of its forward when nothing is saved."""

    saved: int
    backward_extra: int
    forward_transient: int
    constant: int = 0  # bytes per block and pass, not per token (the MoE router's fp32 weight copy)


def block_bytes(arch: Architecture, layer: int, a: int, kv_tokens: int, masked: bool, lora: Lora | None) -> BlockBytes:
    """The tensors one block saves for its backward, per token, read from its forward:

    - norm 1 (see `_norm_saved`; with a=4 its fp32 input is the block input, kept by the checkpoint);
    - q, k, v projections: their input once (trainable base) or LoRA's per-layer terms;
    - q / k RMSNorm per head (SDAR, LLaDA2): each saves its fp32 input and rsqrt (and its normalized tensor when it
      trains); RoPE saves only cos and sin (shared by the blocks, counted once per pass);
    - SDPA (q, k, v after RoPE, the output, the log-sum-exp per head; with a mask the float copy of it that SDPA makes
      from transformers' boolean mask; k and v repeated to the query heads when grouped-query attention runs with a
      mask, which transformers' `use_gqa_in_sdpa` sends to `repeat_kv`). The output is laid out (batch, tokens,
      heads, dim), so the output projection's contiguous input is the same storage;
    - the output projection (LoRA terms only: its input is SDPA's saved output);
    - norm 2: saves the residual sum in fp32;
    - dense MLP: the gate's output (SiLU), SiLU's output and the up projection's output (their product), the
      product (the down projection, when it trains), the norm's output (gate and up, when they train);
    - MoE MLP (LLaDA2): the router's fp32 input (a copy when a=2, saved when the router trains) and sigmoid scores,
      per routed (token, expert) pair the gathered input (when experts train), the fused gate-up output, SiLU's
      output, the product (when experts train) and the down output (multiplied by its routing weight), and the
      shared expert as a dense MLP.
    """
    full = lora is None
    d, q_w, kv_w, heads = arch.hidden, arch.q_width, arch.kv_width, arch.heads
    attn_targets = [entry for entry in arch.lora_widths if entry[0].split("@")[0] in ("q_proj", "k_proj", "v_proj")]
    is_moe = arch.moe is not None and layer >= arch.moe.dense_layers

    saved = _norm_saved(d, 1, a, full, input_is_fp32_saved_elsewhere=True)
    saved += _linear_inputs([d] * 3, a, lora, adapted=bool(attn_targets))
    if arch.qk_norm:
        saved += _norm_saved(q_w, heads, a, full, input_is_fp32_saved_elsewhere=False)
        saved += _norm_saved(kv_w, arch.kv_heads, a, full, input_is_fp32_saved_elsewhere=False)
    repeated = masked and arch.kv_heads < heads
    saved += a * (q_w + 2 * (q_w if repeated else kv_w))  # q, k, v as SDPA saves them
    saved += a * q_w + FP32 * heads  # output, log-sum-exp
    partial_rope = arch.rotary_dim < arch.head_dim
    if partial_rope and full:
        # partial RoPE concatenates the rotated and passed halves: q is (batch, heads, tokens, dim)-contiguous, so
        # is SDPA's output, and the output projection's input (saved when it trains) is a transposed copy
        saved += a * q_w
    if masked:
        saved += a * kv_tokens  # SDPA's float copy of the boolean mask
    if lora is not None:
        # the output projection's adapter: its input is SDPA's saved output, unless copied to the adapter's dtype
        same = lora.dropout == 0 and (lora.adapter_bytes is None or lora.adapter_bytes == a) and not partial_rope
        saved += _linear_inputs([q_w], a, lora, adapted=True) - (a * q_w if same else 0)
    saved += _norm_saved(d, 1, a, full, input_is_fp32_saved_elsewhere=False)
    if not is_moe:
        f = arch.intermediate
        saved += _linear_inputs([d] * 2, a, lora, adapted=True) + 3 * a * f
        saved += _linear_inputs([f], a, lora, adapted=True)
        backward_extra = a * (2 * f + 2 * d)
        forward_transient = a * (2 * d + 3 * f)
    else:
        moe = arch.moe
        f_e, f_s, k = moe.intermediate, moe.shared_intermediate, moe.per_token
        # the router and the shared expert read the norm's output; the shared expert's gate / up save it
        saved += _linear_inputs([d] * 2, a, lora, adapted=True)
        saved += (FP32 * d if (full and a != FP32) else 0) + FP32 * moe.experts
        # per pair: fused gate-up output, SiLU output, down output, its weighted product (in the activation
        # dtype), the routing weight, the pair's token and slot indices; when the experts train, their input rows and
        # the SiLU-up product
        per_pair = a * (2 * f_e + f_e + 2 * d) + FP32 + 2 * 8 + (a * (d + f_e) if full else 0)
        saved += k * per_pair
        # the router's choices: top-k indices, the top-2 per group and the chosen groups' indices, the group and
        # expert masks, the clone of the chosen weights
        saved += 8 * (k + 2 * moe.groups + moe.groups_per_token + 2) + moe.experts + FP32 * (moe.groups + k)
        saved += 3 * a * f_s + _linear_inputs([f_s], a, lora, adapted=True)
        backward_extra = a * (2 * f_s + 2 * d) + FP32 * d
        forward_transient = a * (3 * d + 3 * f_s) + FP32 * (d + moe.experts)
    attention_transient = a * (2 * d + q_w + 2 * kv_w) + (FP32 * 3 * q_w if arch.kind == "llada" else a * q_w)
    forward_transient = max(forward_transient, attention_transient) + (a * kv_tokens if masked else 0)
    # the router casts its weight to fp32 (a copy when the model is bf16), saved by its linear while its input trains
    constant = FP32 * arch.moe.experts * d if (is_moe and a != FP32) else 0
    return BlockBytes(
        saved=saved, backward_extra=backward_extra, forward_transient=forward_transient, constant=constant
    )


@dataclass(frozen=True)
class GraphBytes:
    """One forward pass's activation bytes: what it holds until its backward, and the peaks on top of that."""

    resident: int  # held from the forward to the backward (checkpointed block inputs, or every block's saves)
    head_resident: int  # of which the scored fp32 logits (freed when the head back-propagates)
    forward_peak: int  # the largest extra while the forward runs (the head's logits, or a block's working set)
    head_backward_peak: int  # the largest extra while the head back-propagates (beyond `resident`)
    block_backward_peak: int  # the largest extra while a block recomputes and back-propagates (beyond `resident`)
    through_blocks: int  # head copies a frame keeps while the blocks back-propagate


def graph_bytes(
    arch: Architecture, fwd: Forward, a: int, checkpointing: bool, lora: Lora | None, grad_dtype: int
) -> GraphBytes:
    """Bytes of one forward pass with gradients (see [`block_bytes`] for the blocks). Outside the blocks: the RoPE
    tables (fp32 for LLaDA, the activation dtype otherwise), the boolean 4-D attention mask (materialized by
    transformers' mask functions when there is padding or block-causality), the final norm (its fp32 input, and its
    normalized tensor when it trains), the head's input (when the head trains: LoRA leaves it frozen), and the scored
    logits in fp32. Transients: the head's logits over the kept positions in the activation dtype (alive in the
    forward until the scored rows are copied out, and again as the zero-filled gradient of that indexing in the
    backward), the family's extra fp32 copies, and the head weight's gradient (its size in the gradient dtype)."""
    rows, tokens = fwd.rows, fwd.tokens
    full = lora is None
    blocks = [block_bytes(arch, layer, a, tokens, fwd.masked, lora) for layer in range(arch.layers)]
    per_token = 0
    if checkpointing:
        per_token += arch.layers * a * arch.hidden  # the checkpoint keeps each block's input
    else:
        per_token += sum(block.saved for block in blocks) + (arch.layers * FP32 * arch.hidden if a == FP32 else 0)
    rope = 2 * (FP32 * arch.head_dim if arch.kind == "llada" else a * arch.rotary_dim)
    per_token += rope + (tokens if fwd.masked else 0)
    # final norm: its fp32 input is the last block's output (a=4: saved by pow) or a copy
    per_token += _norm_saved(arch.hidden, 1, a, full, input_is_fp32_saved_elsewhere=False)
    resident = rows * tokens * per_token
    if full:
        resident += rows * fwd.head_input_tokens * a * arch.hidden
    logits_row = fwd.scored * arch.vocab
    head_resident = fwd.head.resident * FP32 * logits_row
    resident += head_resident

    logits = rows * fwd.logit_tokens * arch.vocab * a
    head_forward = (
        max(
            logits + (a * logits_row if a != FP32 else 0) + FP32 * logits_row,
            fwd.head.forward * FP32 * logits_row,
        )
        - head_resident
    )
    # a block's working set runs before the head exists
    block_forward = rows * tokens * max(block.forward_transient for block in blocks) - head_resident
    forward_peak = max(head_forward, block_forward)
    weight_grad = arch.head * grad_dtype if full else 0
    # the softmax's backward; then the indexing's backward (the scored rows' fp32 gradient and one more copy, the
    # bf16 cast back, scattered into zeros over every kept position); then the head's matmuls (input and weight).
    head_backward = max(
        (fwd.head.backward - fwd.head.resident) * FP32 * logits_row,
        2 * FP32 * logits_row + (a * logits_row if a != FP32 else 0) + logits,
        logits + rows * fwd.logit_tokens * a * arch.hidden + weight_grad - head_resident,
    )
    through = fwd.head.through_blocks * FP32 * logits_row
    if checkpointing:
        block_backward = rows * tokens * max(block.saved + block.backward_extra for block in blocks)
    else:
        block_backward = rows * tokens * max(block.backward_extra for block in blocks)
    block_backward += through - head_resident
    return GraphBytes(
        resident=resident,
        head_resident=head_resident,
        forward_peak=forward_peak,
        head_backward_peak=head_backward,
        block_backward_peak=block_backward,
        through_blocks=through,
    )


def no_grad_forward_bytes(arch: Architecture, fwd: Forward, a: int) -> int:
    """The working set of a forward pass without gradients (LFPO's EMA policy, a rollout step): one block's
    transient, or the head's logits and their scored fp32 copy (kept: the loss reads them)."""
    block = block_bytes(arch, arch.layers - 1, a, fwd.tokens, fwd.masked, None)
    logits = fwd.rows * fwd.logit_tokens * arch.vocab * a
    scored = FP32 * fwd.scored * arch.vocab
    return max(fwd.rows * fwd.tokens * block.forward_transient, logits + scored + (a * fwd.scored * arch.vocab))


@dataclass(frozen=True)
class Piece:
    """What one backward of a training step holds: the graphs alive at once (VRPO: the n_t Monte Carlo passes;
    the piecewise trainers: one), and a forward without gradients run in the piece (LFPO's EMA policy) whose scored
    logits it keeps (counted in its `HeadCopies`)."""

    graphs: tuple[Forward, ...]
    no_grad: Forward | None = None


def piece_peak(
    arch: Architecture,
    piece: Piece,
    a: int,
    checkpointing: bool,
    lora: Lora | None,
    grad_dtype: int,
    gradient_buffer: int,
) -> dict:
    """Peak activation bytes of one piece: its graphs are built one after the other and back-propagated last graph
    first (autograd runs the most recent nodes first), so the peak is every graph's resident bytes plus the largest
    transient of the last one (its forward, its head's backward, a block's recomputation and backward). With several
    graphs (VRPO), every parameter is used once per graph, and autograd sums the per-graph gradients of a parameter
    in its `AccumulateGrad` node's input buffer until the last graph has contributed: from the end of the first
    graph's backward on, a whole gradient (`gradient_buffer` bytes: every trainable parameter, unsharded, in the
    gradient dtype; the engines' hooks run after `AccumulateGrad`) is held beside the remaining graphs."""
    terms = [graph_bytes(arch, fwd, a, checkpointing, lora, grad_dtype) for fwd in piece.graphs]
    resident = sum(term.resident for term in terms)
    last = terms[-1]
    before_last = resident - last.resident
    no_grad = no_grad_forward_bytes(arch, piece.no_grad, a) if piece.no_grad is not None else 0
    phases = {
        "forward": resident + last.forward_peak,
        "no_grad_forward": before_last + last.resident - last.head_resident + no_grad if piece.no_grad else 0,
        "head_backward": resident + last.head_backward_peak,
        "block_backward": resident + last.block_backward_peak,
    }
    if len(terms) > 1:
        earlier = terms[-2]
        phases["buffered_backward"] = (
            before_last + gradient_buffer + max(earlier.head_backward_peak, earlier.block_backward_peak)
        )
    phase = max(phases, key=phases.get)
    return {"peak": phases[phase], "phase": phase, "resident": resident, "phases": phases}


def step_activation_peak(
    arch: Architecture,
    pieces: list[Piece],
    a: int,
    checkpointing: bool,
    lora: Lora | None,
    grad_dtype: int,
    gradient_buffer: int,
) -> dict:
    """The largest piece of a training step (pieces run one after the other, each freeing its graphs)."""
    results = [piece_peak(arch, piece, a, checkpointing, lora, grad_dtype, gradient_buffer) for piece in pieces]
    best = max(range(len(results)), key=lambda index: results[index]["peak"])
    return {**results[best], "piece": best, "pieces": len(pieces)}


# ================================================================================================ engines

ENGINES = ("DDP", "ZeRO-2", "ZeRO-3", "FSDP2")
MODES = ("full", "LoRA", "QLoRA")
# DeepSpeed's defaults, which accelerate's config (the package's zero2 / zero3 presets) leaves in place.
DS_REDUCE_BUCKET = int(5e8)  # elements (`reduce_bucket_size`)
DS_PREFETCH_BUCKET = int(5e7)  # elements (`stage3_prefetch_bucket_size`)
# bitsandbytes NF4 with double quantization (d1's `--use_bnb_nested_quant`): 4 bits per weight, an 8-bit absmax per
# block of 64, an fp32 absmax per 256 of those.
NF4_BYTES_PER_WEIGHT = 0.5 + 1 / 64 + 4 / (64 * 256)
ENGINE_NOTES = {
    "DDP": "accelerate's DDP with bf16 autocast on bf16 weights (the recipes' `dtype=bfloat16`): weights, "
    "gradients and AdamW's moments in bf16, no master copy; DDP's gradient buckets (`gradient_as_bucket_view=False`, "
    "accelerate's default) are a second copy of the gradients",
    "ZeRO-2": "DeepSpeed ZeRO-2 (bf16): bf16 weights replicated, an fp32 master copy and AdamW's fp32 moments "
    "sharded 1/8, the bf16 gradient partition 1/8, one reduce bucket of 5e8 elements (DeepSpeed's default; "
    "accelerate's config sets no size); the step converts the partition to fp32",
    "ZeRO-3": "DeepSpeed ZeRO-3 (bf16): weights, master copy, moments and gradients sharded 1/8; the reduce bucket; "
    "gathered during forward and backward: the largest module's bf16 weights and the prefetch bucket (5e7 "
    "elements); the rollout gathers the whole bf16 model (`ds3_gather_for_generation`, TRL's default)",
    "FSDP2": "FSDP2 through accelerate (bf16 `MixedPrecisionPolicy`): accelerate upcasts the trainable parameters "
    "to fp32 before sharding, so the sharded fp32 parameter is the master copy (1/8), with fp32 gradients and "
    "moments (1/8); the root unit (embedding, final norm, head) stays gathered in bf16 from forward to backward, "
    "two blocks gathered at a time (the current and the prefetched one) and one block's unsharded bf16 gradient "
    "before its reduce-scatter; frozen weights stay bf16 (sharded)",
}


@dataclass(frozen=True)
class Setup:
    """An engine, a mode and the LoRA settings (ignored for full fine-tuning)."""

    engine: str
    mode: str
    lora: Lora = Lora()
    gpus: int = NUM_GPUS


def adapter_dtype_bytes(setup: Setup) -> int:
    """The LoRA adapter's dtype: PEFT upcasts it to fp32 on a bf16 base (`autocast_adapter_dtype=True`), except
    where TRL passes `autocast_adapter_dtype=False` (ZeRO-3) or casts it to bf16 (QLoRA); DeepSpeed casts every
    parameter to bf16 under bf16 (ZeRO-2, ZeRO-3); accelerate's FSDP2 upcasts trainable parameters to fp32 unless
    the model has 4-bit parameters."""
    if setup.mode == "QLoRA":
        return BF16
    if setup.engine in ("ZeRO-2", "ZeRO-3"):
        return BF16
    return FP32


def static_bytes(arch: Architecture, setup: Setup) -> dict:
    """Per GPU, bytes held through the training step whatever the trainer: weights, the fp32 master copy, the
    accumulated gradients and the engine's gradient buffers, AdamW's two moments, and the engine's gathered
    parameters during a forward or backward pass (see `ENGINE_NOTES`). `trainable` and `gradient_buffer` (the
    unsharded gradient autograd holds while several graphs share parameters) are returned for the activations."""
    n = setup.gpus
    total = arch.parameters
    if setup.mode == "full":
        trainable, train_dtype = total, BF16
        base = 0
    else:
        trainable, train_dtype = arch.lora_parameters(setup.lora.rank), adapter_dtype_bytes(setup)
        if setup.mode == "LoRA":
            base = BF16 * total
        else:
            base = NF4_BYTES_PER_WEIGHT * arch.quantizable + BF16 * (total - arch.quantizable)
    engine = setup.engine
    shard = n if engine in ("ZeRO-3", "FSDP2") else 1
    if engine == "FSDP2" and setup.mode != "QLoRA":
        train_dtype = FP32  # accelerate's upcast of trainable parameters
    weights = base / shard + trainable * (BF16 if engine.startswith("ZeRO") else train_dtype) / shard
    master = FP32 * trainable / n if engine.startswith("ZeRO") else 0
    moments = (2 * train_dtype * trainable) if engine == "DDP" else 2 * FP32 * trainable / n
    if engine == "FSDP2":
        moments = 2 * train_dtype * trainable / n
    if engine == "DDP":
        gradients = train_dtype * trainable
        buffers = train_dtype * trainable  # DDP's buckets
    elif engine == "FSDP2":
        gradients, buffers = train_dtype * trainable / n, 0
    else:
        gradients = BF16 * trainable / n
        buffers = BF16 * min(DS_REDUCE_BUCKET, trainable)
    # what a forward or backward pass gathers (bf16, or the 4-bit storage of QLoRA's blocks)
    block_bytes_per_param = NF4_BYTES_PER_WEIGHT if setup.mode == "QLoRA" else BF16
    largest_module = max(arch.head, arch.embedding, arch.largest_unit)
    if engine == "ZeRO-3":
        gathered = BF16 * (max(arch.head, arch.embedding)) + block_bytes_per_param * arch.largest_unit
        gathered = max(gathered, BF16 * largest_module) + BF16 * DS_PREFETCH_BUCKET
    elif engine == "FSDP2":
        unsharded_grad = BF16 * arch.largest_unit if setup.mode == "full" else 0
        gathered = BF16 * arch.root_unit + 2 * block_bytes_per_param * arch.largest_unit + unsharded_grad
    else:
        gathered = 0
    step = FP32 * trainable / n if engine == "ZeRO-2" else 0  # the fp32 copy of the gradient partition
    gradient_dtype = BF16 if setup.mode == "full" else (BF16 if engine.startswith("ZeRO") else train_dtype)
    return {
        "weights": weights,
        "master": master,
        "gradients": gradients,
        "gradient_buffers": buffers,
        "optimizer": moments,
        "gathered": gathered,
        "step_transient": step,
        "trainable": trainable,
        "gradient_dtype": gradient_dtype,
        "gradient_buffer": gradient_dtype * trainable,
        # the whole model in its storage dtypes: what ZeRO-3 gathers for a rollout
        "whole_model": BF16 * total if setup.mode == "full" else base + BF16 * trainable,
    }


# ================================================================================================ recipes


@dataclass(frozen=True)
class Recipe:
    """A trainer family's published recipe, as the plan reads it (per device; the rest of the recipe, learning rates
    and steps, does not change memory).

    Args:
        family: VRPO, BGPO, DiffuGRPO, TraceRL, LFPO, JustGRPO or SFT.
        rows: `per_device_train_batch_size` (the micro-batch).
        prompt: prompt tokens per canvas (`max_prompt_length`: the recipe's cap, the worst case).
        completion: `max_completion_length` L.
        mc: Monte Carlo samples n_t (VRPO, BGPO), states K (LFPO).
        per_backward: BGPO's `mc_samples_per_backward`, LFPO's `lfpo_group_size`, the trajectory trainers'
            `transitions_per_forward`, JustGRPO's `just_grpo_positions_per_forward`.
        targets: TraceRL: target tokens per scored state.
        block_length: the sampler's block (the rollout's head width).
        ema_copy: LFPO with full fine-tuning keeps a bf16 copy of the weights as its EMA policy.
        recipe_checkpointing: the recipe's own `gradient_checkpointing` (the plan uses TRL's default, on).
        source: where the numbers come from.
    """

    family: str
    rows: int
    prompt: int
    completion: int
    source: str
    mc: int = 1
    per_backward: int = 1
    targets: int = 0
    block_length: int = 32
    ema_copy: bool = False
    recipe_checkpointing: bool = True
    refused: dict = field(default_factory=dict)


FAMILIES = ("VRPO", "BGPO", "DiffuGRPO", "TraceRL", "LFPO", "JustGRPO", "SFT")
FAMILY_TRAINERS = {
    "VRPO": "vrpo",
    "BGPO": "bgpo",
    "DiffuGRPO": "diffu_grpo",
    "TraceRL": "trace_rl",
    "LFPO": "lfpo",
    "JustGRPO": "just_grpo",
    "SFT": "sft",
}
LLADA_RECIPES = {
    "VRPO": Recipe(
        "VRPO",
        2,
        512,
        512,
        "docs/trainers/vrpo.md (BGPO paper §4, Table 4: VRPO-OL, math)",
        mc=4,
        recipe_checkpointing=False,
    ),
    "BGPO": Recipe(
        "BGPO",
        2,
        512,
        512,
        "docs/trainers/bgpo.md (BGPO paper Table 4, math)",
        mc=16,
        per_backward=1,
        recipe_checkpointing=False,
    ),
    "DiffuGRPO": Recipe("DiffuGRPO", 6, 200, 256, "docs/trainers/diffu_grpo.md (d1 train.yaml, GSM8K)"),
    "TraceRL": Recipe(
        "TraceRL",
        4,
        512,
        512,
        "docs/trainers/trace_rl.md (TraceRL rl_llada.yaml: L 512 in 512 steps, s = 8)",
        per_backward=8,
        targets=8,
    ),
    "LFPO": Recipe(
        "LFPO",
        10,
        512,
        512,
        "docs/trainers/lfpo.md (LFPO paper Table 7: K 8, groups of 8)",
        mc=8,
        per_backward=8,
        ema_copy=True,
        refused={("ZeRO-3", "full"): "refused: the EMA copy needs whole weights"},
    ),
    "JustGRPO": Recipe(
        "JustGRPO",
        8,
        512,
        256,
        "docs/trainers/just_grpo.md (JustGRPO train.py: L 256, one position per pass)",
        per_backward=1,
        block_length=1,
    ),
    "SFT": Recipe(
        "SFT", 8, 512, 1024, "docs/sft.md (d1's s1K SFT: L 1024; batch: the config's default 8; prompt: assumed 512)"
    ),
}
SDAR_RECIPES = {
    "BGPO": Recipe(
        "BGPO",
        2,
        512,
        512,
        "examples/bgpo_sdar_countdown.py (DARE's SDAR BGPO: L 512, blocks of 4, n_t 16)",
        mc=16,
        block_length=4,
    ),
    "TraceRL": Recipe(
        "TraceRL",
        8,
        512,
        2000,
        "docs/trainers/trace_rl.md (TraceRL rl_sdar.yaml: L 2000, blocks of 4 in 4 steps)",
        per_backward=8,
        targets=500,
        block_length=4,
    ),
}
BLOCK_CAUSAL_REFUSED = {"JustGRPO": "n/a: JustGRPO refuses block-causal models (one position per block)"}


def recipes_for(arch: Architecture) -> dict[str, Recipe]:
    """Each family's recipe on `arch`: the model's own published recipe where there is one (SDAR: BGPO, TraceRL),
    else the LLaDA-8B recipe's batch, canvas and Monte Carlo count with the model's block length (for a block-causal
    model the sampler decodes its own blocks)."""
    recipes = {}
    for family, recipe in LLADA_RECIPES.items():
        if arch.kind == "sdar" and family in SDAR_RECIPES:
            recipes[family] = SDAR_RECIPES[family]
        elif arch.block_causal:
            recipes[family] = replace(recipe, block_length=arch.block_size, source=f"{recipe.source}, on {arch.name}")
            if family == "TraceRL":
                # block models: s = 1, one composite state per round of blocks; the targets of a round are one
                # token per block (blocks decoded in block_size steps)
                recipes[family] = replace(recipes[family], targets=recipe.completion // arch.block_size)
        else:
            recipes[family] = recipe
    return recipes


TRACE_HEAD = HeadCopies(resident=1, forward=3, backward=5)  # the tempered copy and the mask-token fill


def recipe_pieces(arch: Architecture, recipe: Recipe) -> list[Piece]:
    """The pieces of one micro-batch of `recipe`'s training step with the masks' expected sizes: the stratified
    sampler's view j masks a share (j + 1/2) / n_t of the canvas (VRPO, BGPO); LFPO's state k a share
    1 - (k + 1/2) / K; d1's pass and the SFT loss score the whole completion (the worst case: W = L, t = 1)."""
    rows, length = recipe.rows, recipe.completion
    if arch.block_causal:
        tail = arch.block_size - 1  # the prompt's last columns that complete its first block (the worst case)
        tokens, head_tokens = (tail + length) + (recipe.prompt + length), length
    else:
        tokens, head_tokens = recipe.prompt + length, recipe.prompt + length

    def forward(num_rows, scored, head, logit_tokens=length, num_tokens=tokens, head_input=head_tokens):
        return Forward(num_rows, num_tokens, logit_tokens, head_input, int(scored), True, head)

    family = recipe.family
    if family == "VRPO":
        shares = [(j + 0.5) / recipe.mc for j in range(recipe.mc)]
        return [Piece(tuple(forward(rows, rows * length * share, ELBO_HEAD) for share in shares))]
    if family == "BGPO":
        k = recipe.per_backward
        shares = [(j + 0.5) / recipe.mc for j in range(recipe.mc)]
        groups = [shares[i : i + k] for i in range(0, recipe.mc, k)]
        return [Piece((forward(rows * len(g), rows * length * sum(g), ELBO_HEAD),)) for g in groups]
    if family == "DiffuGRPO":
        return [Piece((forward(rows, rows * length, DIFFU_GRPO_HEAD),))]
    if family == "LFPO":
        group = recipe.per_backward
        scored = sum(length * (1 - (k + 0.5) / recipe.mc) for k in range(recipe.mc)) * group / recipe.mc
        fwd = forward(group, scored, LFPO_HEAD)
        if arch.block_causal:  # LFPO scores states with a plain forward (the model's own block-causal mask)
            fwd = replace(fwd, tokens=recipe.prompt + length, head_input_tokens=recipe.prompt + length)
        return [Piece((fwd,), no_grad=replace(fwd, head=ELBO_HEAD))]
    if family == "TraceRL":
        units = recipe.per_backward
        return [Piece((forward(units, units * recipe.targets, TRACE_HEAD),))]
    if family == "JustGRPO":
        copies = rows * recipe.per_backward
        return [Piece((forward(copies, copies, JUST_GRPO_HEAD),))]
    if family == "SFT":
        return [Piece((forward(rows, rows * length, SFT_HEAD),))]
    raise ValueError(family)


def rollout_forward(arch: Architecture, recipe: Recipe) -> Forward:
    """One denoising step of the rollout (no gradients): the micro-batch's canvases (prompt + completion, every step
    runs the whole sequence without a cache, the package's training default), the head at the current block only,
    softmax in fp32 there."""
    rows = recipe.rows
    tokens = recipe.prompt + recipe.completion
    block = recipe.block_length
    return Forward(rows, tokens, block, block, rows * block, True, ELBO_HEAD)


def plan_cell(arch: Architecture, recipe: Recipe, setup: Setup, checkpointing: bool = True) -> dict:
    """Per-GPU bytes of one (model, recipe, engine, mode): the static terms, the activation peak of the training
    step (with the engine's gathered parameters and QLoRA's dequantized weight beside it), the rollout's peak, and
    the GPU's peak (the larger)."""
    refusal = recipe.refused.get((setup.engine, setup.mode))
    if arch.block_causal and recipe.family in BLOCK_CAUSAL_REFUSED:
        refusal = BLOCK_CAUSAL_REFUSED[recipe.family]
    if refusal:
        return {"refused": refusal}
    static = static_bytes(arch, setup)
    lora = None
    if setup.mode != "full":
        lora = replace(setup.lora, adapter_bytes=adapter_dtype_bytes(setup))
    pieces = recipe_pieces(arch, recipe)
    activations = step_activation_peak(
        arch, pieces, BF16, checkpointing, lora, static["gradient_dtype"], static["gradient_buffer"]
    )
    dequantized = BF16 * arch.largest_linear if setup.mode == "QLoRA" else 0
    ema = BF16 * arch.parameters if (recipe.ema_copy and setup.mode == "full") else 0
    held = static["weights"] + static["master"] + static["optimizer"] + static["gradient_buffers"] + ema
    train = held + static["gradients"] + static["gathered"] + activations["peak"] + dequantized
    step = held + static["gradients"] + static["step_transient"]
    rollout_gathered = static["whole_model"] if setup.engine == "ZeRO-3" else static["gathered"]
    rollout = held + rollout_gathered + no_grad_forward_bytes(arch, rollout_forward(arch, recipe), BF16) + dequantized
    peak = max(train, step, rollout)
    return {
        **{key: static[key] for key in ("weights", "master", "gradients", "gradient_buffers", "optimizer")},
        "gathered": static["gathered"],
        "ema_copy": ema,
        "activations": activations["peak"],
        "activation_phase": activations["phase"],
        "dequantized": dequantized,
        "train_peak": train,
        "step_peak": step,
        "rollout_peak": rollout,
        "peak": peak,
        "peak_phase": "rollout" if peak == rollout and rollout > train else "train",
    }


def build_plan(archs: dict[str, Architecture]) -> list[dict]:
    """Every cell of the plan: model x family x mode x engine, with checkpointing on, and the activations with it off
    (the BGPO and VRPO recipes' own setting) for the full fine-tuning row."""
    rows = []
    for arch in archs.values():
        for family, recipe in recipes_for(arch).items():
            for mode in MODES:
                for engine in ENGINES:
                    cell = plan_cell(arch, recipe, Setup(engine, mode))
                    entry = {"model": arch.name, "family": family, "mode": mode, "engine": engine, **cell}
                    if mode == "full" and engine == "FSDP2" and "refused" not in cell:
                        off = plan_cell(arch, recipe, Setup(engine, mode), checkpointing=False)
                        entry["activations_checkpointing_off"] = off["activations"]
                    rows.append(entry)
    return rows


# ================================================================================================ the CPU check

# The two model sizes of the check: the tiny LLaDA of `memory.py` (0.9M parameters, 108-token vocabulary) and a 20M
# one whose 32,000-token vocabulary puts most parameters in the embedding and the head and makes the scored logits
# a large share of the activations, as an 8B model's 126k vocabulary does.
CHECK_SIZES = {
    "smoke": ModelSize(d_model=32, n_layers=1, n_heads=2, mlp_hidden_size=64),
    "tiny": ModelSize(d_model=128, n_layers=4, n_heads=4, mlp_hidden_size=384),
    "20m": ModelSize(d_model=256, n_layers=4, n_heads=4, mlp_hidden_size=768, vocab_size=32000),
}
CHECK_ROLLOUTS = {
    "smoke": RolloutSize(2, 2, 16, 16, 8, 4),
    "tiny": RolloutSize(8, 4, 32, 256, 32, 32),
    "20m": RolloutSize(4, 4, 32, 128, 32, 32),
}
# (trainer, overrides) of the check points; each runs at both sizes (the smoke preset runs the first two).
CHECK_POINTS = [
    ("vrpo", {"num_mc_samples": 1}),
    ("vrpo", {"num_mc_samples": 4}),
    ("bgpo", {"num_mc_samples": 4}),
    ("diffu_grpo", {}),
    ("lfpo", {"lfpo_num_states": 4}),
]
MICRO_BATCHES = 2  # gradient accumulation steps per optimizer step: the gradients are held through a micro-batch
OPTIMIZER_STEPS = 2  # the second runs with AdamW's state allocated


def check_pieces(trainer, name: str, batch: dict) -> tuple[list[Piece], dict]:
    """The pieces of `name`'s training step on `batch`, with the exact scored counts of its masks (the plan uses
    their expectations)."""
    prompt = batch["prompt_ids"].shape[1]
    length = batch["completion_canvas"].shape[1]
    rows = batch["completion_canvas"].shape[0]
    masked = bool((batch["prompt_mask"] == 0).any())
    tokens = prompt + length

    def forward(num_rows: int, scored: int, head: HeadCopies) -> Forward:
        return Forward(num_rows, tokens, length, tokens, int(scored), masked, head)

    if name in ("vrpo", "bgpo"):
        plan = trainer.mask_plan(batch, 0)
        per_view = plan.masks.sum(dim=(0, 2)).tolist()
        if name == "vrpo":
            pieces = [Piece(tuple(forward(rows, s, ELBO_HEAD) for s in per_view))]
        else:
            k = trainer.args.mc_samples_per_backward
            groups = [per_view[i : i + k] for i in range(0, len(per_view), k)]
            pieces = [Piece((forward(rows * len(g), sum(g), ELBO_HEAD),)) for g in groups]
        info = {"scored_per_view": per_view}
    elif name == "diffu_grpo":
        width = min(batch["completion_ids"].shape[1], length)
        pieces = [Piece((forward(rows, rows * width, DIFFU_GRPO_HEAD),))]
        info = {"scored": rows * width}
    elif name == "lfpo":
        scored_masks = batch["lfpo_scored_masks"]
        pairs = torch.cartesian_prod(torch.arange(scored_masks.shape[0]), torch.arange(scored_masks.shape[1]))
        pieces, per_group = [], []
        for group in pairs.split(trainer.args.lfpo_group_size):
            scored = int(scored_masks[group[:, 0], group[:, 1]].sum())
            per_group.append(scored)
            fwd = forward(len(group), scored, LFPO_HEAD)
            pieces.append(Piece((fwd,), no_grad=replace(fwd, head=ELBO_HEAD)))
        info = {"scored_per_group": per_group}
    else:
        raise ValueError(name)
    return pieces, {**info, "tokens": tokens, "rows": rows, "masked": masked}


def predicted_cpu_peak(arch: Architecture, pieces: list[Piece], dtype_bytes: int) -> dict:
    """The formula for the check's setting: one process, no engine, weights of `dtype_bytes` already resident (the
    baseline), gradients and AdamW's two moments in the weights' dtype (held through the second optimizer step's
    micro-batches), activations with checkpointing on in the weights' dtype (no autocast on the CPU)."""
    gradients = arch.parameters * dtype_bytes
    optimizer = 2 * arch.parameters * dtype_bytes
    activations = step_activation_peak(arch, pieces, dtype_bytes, True, None, dtype_bytes, gradients)
    return {
        "gradients": gradients,
        "optimizer": optimizer,
        "activations": activations["peak"],
        "activation_phase": activations["phase"],
        "total": gradients + optimizer + activations["peak"],
    }


def measure_check_point(job: dict) -> dict:
    """Worker: `OPTIMIZER_STEPS` optimizer steps of `MICRO_BATCHES` micro-batches each (`training_step`, then
    clipping, AdamW's step, `zero_grad`) of `job["trainer"]` on the saved rollout batch, checkpointing on as
    `Trainer.train` enables it, glibc's mmap threshold pinned; the process peak above the memory held before, and the
    formula's prediction from the batch's own masks."""
    set_threads(job["threads"])
    _fix_mmap_threshold()
    name, overrides = job["trainer"], dict(job["overrides"])
    rollout = RolloutSize(**job["rollout"])
    settings = {"beta": 0.0, "num_iterations": 1, "gradient_checkpointing": True, **overrides}
    if job["dtype"] == "bfloat16":
        settings["model_init_kwargs"] = {"dtype": "bfloat16"}
    if name == "lfpo":
        settings["lfpo_group_size"] = rollout.rows
    trainer = make_trainer(name, Path(job["model_dir"]), rollout, "cpu", Path(job["output_dir"]), **settings)
    trainer.model.train()
    trainer.current_gradient_accumulation_steps = MICRO_BATCHES
    batch = torch.load(job["batch_path"], weights_only=False)
    if job.get("pad"):
        # Every other row left-padded by `pad` positions (as TRL pads prompts of unequal length): the forward passes
        # then take transformers' boolean 4-D mask and SDPA its float copy, which the plan assumes for LLaDA.
        batch["prompt_mask"][::2, : job["pad"]] = 0
        batch["prompt_ids"][::2, : job["pad"]] = trainer.processing_class.pad_token_id
    with torch.no_grad():
        batch.update(trainer._score_rollouts(batch, "train"))
    pieces, info = check_pieces(trainer, name, batch)
    enable_checkpointing_as_train(trainer)
    trainer._prepare_inputs = lambda inputs: inputs
    # One micro-batch first, unmeasured: the code paths of the forward and backward are paged in (the resident set
    # counts the library pages a process first executes), and the allocator has seen the step once.
    trainer.training_step(trainer.model, batch)
    trainer.model.zero_grad()
    optimizer = trainer.create_optimizer()
    with PeakMemory("cpu") as process:
        for _ in range(OPTIMIZER_STEPS):
            for _ in range(MICRO_BATCHES):
                trainer.training_step(trainer.model, batch)
            trainer.accelerator.clip_grad_norm_(trainer.model.parameters(), trainer.args.max_grad_norm)
            optimizer.step()
            trainer.model.zero_grad()
    dtype_bytes = next(trainer.model.parameters()).element_size()
    return {
        "trainer": name,
        "overrides": overrides,
        "dtype": job["dtype"],
        "measured_bytes": process.peak_bytes,
        "optimizer_state_bytes": optimizer_state_bytes(optimizer),
        "gradient_dtype_bytes": dtype_bytes,
        "parameters": sum(p.numel() for p in trainer.model.parameters() if p.requires_grad),
        "info": info,
        "pieces": [[asdict(fwd) for fwd in piece.graphs] for piece in pieces],
        "_pieces": pieces,
    }


# ================================================================================================ the structural check


class UniqueSavedBytes:
    """Bytes of the distinct storages autograd saves for backward while active (a storage saved by several
    operations, or through several views, counts once), less the storages that existed before (parameters, the
    inputs): the memory the saves hold, which is what the formula's per-block tensor lists count.
    (`trl_diffusion.utils.SavedTensorsMeter` counts every save at its own size instead: for ratios, not bytes.)"""

    def __init__(self, existing: list[torch.Tensor]):
        self.excluded = {tensor.untyped_storage().data_ptr() for tensor in existing}
        self.sizes: dict[int, int] = {}

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.excluded:
            self.sizes[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> UniqueSavedBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._hooks.__exit__(*exc_info)

    @property
    def bytes(self) -> int:
        return sum(self.sizes.values())


# Exact for the dense blocks; an MoE block's small index tensors (one set per expert that receives tokens) move with
# the routing (0.3-1.9% over the runs made here, always above the measured bytes).
STRUCTURE_TOLERANCE = 0.03
STRUCTURE_LORA = Lora(rank=8, dropout=0.05, mask_bytes=None, adapter_bytes=FP32)  # PEFT's fp32 adapter


def _tiny_models() -> dict:
    from trl_diffusion.models import build_tiny_llada, build_tiny_llada2, build_tiny_sdar, build_tiny_tokenizer

    tokenizer = build_tiny_tokenizer()
    return {
        "LLaDA": lambda: build_tiny_llada(tokenizer, d_model=64, n_layers=2, n_heads=4, mlp_hidden_size=128),
        "SDAR": lambda: build_tiny_sdar(tokenizer),
        "LLaDA2": lambda: build_tiny_llada2(tokenizer),
    }


def structural_check(**kwargs) -> list[dict]:
    """[`_structural_check`] with the global generator seeded (PEFT draws LoRA's initial A matrices from it) and
    restored afterwards."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        return _structural_check(**kwargs)


def _structural_check(
    rows: int = 2,
    tokens: int = 24,
    pad: int = 3,
    families: tuple[str, ...] = ("LLaDA", "SDAR", "LLaDA2"),
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    modes: tuple[str, ...] = ("full", "lora"),
) -> list[dict]:
    """Per-block saved bytes of the formula against the distinct storages one block of a tiny LLaDA, SDAR and
    LLaDA2 (its dense first layer and an MoE layer) saves, in fp32 and bf16, with full fine-tuning and with LoRA
    (rank 8, dropout 0.05, the package's target modules), on a left-padded batch (an attention mask)."""
    from peft import LoraConfig, get_peft_model
    from transformers.masking_utils import create_bidirectional_mask

    from trl_diffusion.models.sdar import block_causal_mask

    results = []
    for family, build in _tiny_models().items():
        if family not in families:
            continue
        for dtype in dtypes:
            for mode in modes:
                model = build().to(dtype).train()
                arch = architecture_of(family, model)
                lora = STRUCTURE_LORA if mode == "lora" else None
                if lora is not None:
                    rule = _lora_rule(model.config.model_type)
                    model = get_peft_model(
                        model,
                        LoraConfig(
                            r=lora.rank,
                            lora_alpha=16,
                            lora_dropout=lora.dropout,
                            target_modules=rule.target_modules,
                            exclude_modules=rule.exclude_modules,
                        ),
                    )
                base = model.get_base_model() if lora is not None else model
                generator = torch.Generator().manual_seed(0)
                hidden = torch.randn(rows, tokens, arch.hidden, generator=generator).to(dtype).requires_grad_()
                attention_mask = torch.ones(rows, tokens, dtype=torch.long)
                attention_mask[0, :pad] = 0
                positions = (attention_mask.cumsum(-1) - 1).clamp(min=0)
                layers = [0] if arch.moe is None else [0, arch.moe.dense_layers]
                for layer in layers:
                    if arch.kind == "llada":
                        block = base.model.transformer.blocks[layer]
                        mask = create_bidirectional_mask(
                            config=base.config, inputs_embeds=hidden, attention_mask=attention_mask
                        )
                        cos, sin = base.model.rotary_emb(positions)
                        args, kwargs = (hidden, (cos, sin)), {"attention_mask": mask}
                    else:
                        block = base.model.layers[layer]
                        mask = block_causal_mask(base.config, hidden, attention_mask, positions, arch.block_size)
                        cos, sin = base.model.rotary_emb(hidden, positions)
                        args = (hidden,)
                        kwargs = {"attention_mask": mask, "position_ids": positions, "position_embeddings": (cos, sin)}
                    existing = [hidden, cos, sin, *model.parameters(), *model.buffers()]
                    existing += [mask] if isinstance(mask, torch.Tensor) else []
                    with UniqueSavedBytes(existing) as meter:
                        block(*args, **kwargs)
                    a = hidden.element_size()
                    formula = block_bytes(arch, layer, a, tokens, True, lora)
                    predicted = rows * tokens * formula.saved + formula.constant
                    results.append(
                        {
                            "model": family,
                            "layer": "MoE" if arch.moe is not None and layer >= arch.moe.dense_layers else "dense",
                            "dtype": str(dtype).removeprefix("torch."),
                            "mode": mode,
                            "measured_bytes": meter.bytes,
                            "predicted_bytes": predicted,
                        }
                    )
    return results


# ================================================================================================ the run


@dataclass(frozen=True)
class CheckSet:
    """Check points of one model size and dtype (every other row left-padded by `pad` positions)."""

    size: str
    dtype: str
    pad: int
    points: tuple


CHECK_SETS = {
    # the smoke size runs the machinery only: its peaks (under a MiB) are the allocator's, not the tensors'
    "smoke": (CheckSet("smoke", "float32", 2, (("vrpo", {"num_mc_samples": 2}),)),),
    "cpu": (
        CheckSet("tiny", "float32", 0, tuple(CHECK_POINTS)),
        CheckSet("20m", "float32", 8, tuple(CHECK_POINTS)),
        CheckSet("20m", "bfloat16", 8, tuple(CHECK_POINTS)),
    ),
}


def run_checks(args, sets: tuple[CheckSet, ...], context) -> list[dict]:
    """The CPU check: per set, one rollout batch (generated once, in a fresh process), then each point in a fresh
    process; the prediction from the formula with the batch's own masks."""
    results = []
    with tempfile.TemporaryDirectory(prefix="trl-diffusion-memory-plan-") as scratch:
        scratch = Path(scratch)
        batches = {}
        for check in sets:
            size = CHECK_SIZES[check.size]
            arch = llada_architecture(check.size, size)
            model_dir = scratch / f"model-{check.size}"
            if not (model_dir / "config.json").is_file():
                build_model_dir(model_dir, size)
            job = {
                "model_dir": str(model_dir),
                "output_dir": str(scratch / "trainer"),
                "batch_path": str(scratch / f"batch-{check.size}.pt"),
                "rollout": asdict(CHECK_ROLLOUTS[check.size]),
                "device": "cpu",
                "threads": args.threads,
                "dtype": check.dtype,
                "pad": check.pad,
            }
            if check.size not in batches:
                batches[check.size] = run_in_fresh_process(context, generate_batch, job)
            for trainer, overrides in check.points:
                started = time.perf_counter()
                point = run_in_fresh_process(
                    context, measure_check_point, {**job, "trainer": trainer, "overrides": overrides}
                )
                pieces = point.pop("_pieces")
                predicted = predicted_cpu_peak(arch, pieces, point["gradient_dtype_bytes"])
                point.update(
                    size=check.size,
                    model_parameters=arch.parameters,
                    padded=check.pad > 0,
                    predicted=predicted,
                    predicted_bytes=predicted["total"],
                    error=predicted["total"] / point["measured_bytes"] - 1,
                    seconds=round(time.perf_counter() - started, 1),
                )
                print(
                    f"check {check.size:>5} {check.dtype:8} {trainer:10} {overrides}: measured "
                    f"{point['measured_bytes'] / MIB:7.1f} MiB, predicted {predicted['total'] / MIB:7.1f} MiB "
                    f"({point['error']:+.1%}, peak in the {predicted['activation_phase'].replace('_', ' ')})"
                )
                results.append(point)
    return results


def gib(value: float) -> str:
    return f"{value / GIB:.1f}"


def plan_tables(plan: list[dict], archs: dict[str, Architecture]) -> dict[str, str]:
    """The plan's Markdown tables: the per-GPU peaks, the static terms, the activations and recipes."""
    cells = {(r["model"], r["family"], r["mode"], r["engine"]): r for r in plan}
    columns = [(mode, engine) for mode in MODES for engine in ENGINES]
    peak_rows = []
    for arch in archs.values():
        for family in FAMILIES:
            row = [arch.name, family]
            for mode, engine in columns:
                cell = cells[(arch.name, family, mode, engine)]
                row.append("-" if "refused" in cell else gib(cell["peak"]))
            peak_rows.append(row)
    headers = ["model", "family", *[f"{mode} {engine}" for mode, engine in columns]]
    peaks = format_table(headers, peak_rows)

    static_rows = []
    for arch in archs.values():
        for mode in MODES:
            for engine in ENGINES:
                static = static_bytes(arch, Setup(engine, mode))
                rollout = static["whole_model"] if engine == "ZeRO-3" else static["gathered"]
                static_rows.append(
                    [
                        arch.name,
                        mode,
                        engine,
                        gib(static["weights"]),
                        gib(static["master"]),
                        gib(static["gradients"] + static["gradient_buffers"]),
                        gib(static["optimizer"]),
                        gib(static["gathered"]),
                        gib(rollout),
                    ]
                )
    static_table = format_table(
        [
            "model",
            "mode",
            "engine",
            "weights",
            "fp32 master",
            "gradients + buffers",
            "AdamW moments",
            "gathered (train)",
            "gathered (rollout)",
        ],
        static_rows,
    )

    activation_rows = []
    for arch in archs.values():
        for family, recipe in recipes_for(arch).items():
            full = cells[(arch.name, family, "full", "FSDP2")]
            lora = cells[(arch.name, family, "LoRA", "DDP")]
            if "refused" in lora:
                activation_rows.append([arch.name, family, "n/a", "", "", "", "", "", BLOCK_CAUSAL_REFUSED[family]])
                continue
            count = {
                "VRPO": f"n_t {recipe.mc}",
                "BGPO": f"n_t {recipe.mc}, k {recipe.per_backward}",
                "LFPO": f"K {recipe.mc}, groups of {recipe.per_backward}",
                "TraceRL": f"chunks of {recipe.per_backward} states, {recipe.targets} targets each",
                "JustGRPO": f"{recipe.per_backward} position per pass",
            }.get(family, "one pass")
            activation_rows.append(
                [
                    arch.name,
                    family,
                    str(recipe.rows),
                    f"{recipe.prompt} + {recipe.completion}",
                    count,
                    gib(full["activations"]),
                    gib(full["activations_checkpointing_off"]),
                    gib(lora["activations"]),
                    recipe.source,
                ]
            )
    activations = format_table(
        [
            "model",
            "family",
            "micro-batch",
            "prompt + L",
            "Monte Carlo / pieces",
            "activations, full (ckpt on)",
            "full (ckpt off)",
            "LoRA (ckpt on)",
            "recipe source",
        ],
        activation_rows,
    )
    return {"peaks": peaks, "static": static_table, "activations": activations}


def check_tables(checks: list[dict], structure: list[dict]) -> dict[str, str]:
    check_rows = [
        [
            point["size"],
            f"{point['model_parameters']:,}",
            point["dtype"],
            "yes" if point["padded"] else "no",
            point["trainer"],
            ", ".join(f"{k} {v}" for k, v in point["overrides"].items()) or "-",
            f"{point['measured_bytes'] / MIB:.1f}",
            f"{point['predicted_bytes'] / MIB:.1f}",
            f"{point['error']:+.1%}",
        ]
        for point in checks
    ]
    table = format_table(
        ["size", "parameters", "dtype", "padded", "trainer", "setting", "measured (MiB)", "predicted (MiB)", "error"],
        check_rows or [["-"] * 9],
    )
    structure_rows = [
        [
            entry["model"],
            entry["layer"],
            entry["dtype"],
            entry["mode"],
            f"{entry['measured_bytes']:,}",
            f"{entry['predicted_bytes']:,}",
            f"{entry['predicted_bytes'] / entry['measured_bytes'] - 1:+.2%}",
        ]
        for entry in structure
    ]
    structure_table = format_table(
        ["model", "block", "dtype", "mode", "saved bytes (measured)", "formula", "error"],
        structure_rows or [["-"] * 7],
    )
    return {"check": table, "structure": structure_table}


def plot(plan: list[dict], checks: list[dict], archs: dict[str, Architecture], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, 2, figsize=(15, 5.5), gridspec_kw={"width_ratios": [1, 2]})
    axis = axes[0]
    if checks:
        measured = [p["measured_bytes"] / MIB for p in checks]
        predicted = [p["predicted_bytes"] / MIB for p in checks]
        for dtype, marker in (("float32", "o"), ("bfloat16", "s")):
            chosen = [i for i, p in enumerate(checks) if p["dtype"] == dtype]
            axis.scatter([measured[i] for i in chosen], [predicted[i] for i in chosen], marker=marker, label=dtype)
        top, bottom = max(measured + predicted) * 1.2, min(measured + predicted) / 1.2
        line = [bottom, top]
        axis.plot(line, line, "k-", lw=0.8)
        axis.fill_between(
            line,
            [v * (1 - TOLERANCE) for v in line],
            [v * (1 + TOLERANCE) for v in line],
            color="gray",
            alpha=0.2,
            label="±15%",
        )
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlim(bottom, top)
        axis.set_ylim(bottom, top)
        axis.legend()
    axis.set_xlabel("measured process peak (MiB, CPU)")
    axis.set_ylabel("predicted (MiB)")
    axis.set_title("CPU check: two optimizer steps of two micro-batches")

    axis = axes[1]
    terms = [
        ("weights", "weights"),
        ("master", "fp32 master"),
        ("optimizer", "AdamW moments"),
        ("gradients", "gradients"),
        ("gathered", "gathered"),
        ("ema_copy", "EMA copy"),
        ("activations", "activations"),
    ]
    chosen = [r for r in plan if r["mode"] == "full" and r["engine"] == "FSDP2" and "refused" not in r]
    labels = [f"{r['model']}\n{r['family']}" for r in chosen]
    bottom = [0.0] * len(chosen)
    for key, label in terms:
        values = [r[key] / GIB for r in chosen]
        axis.bar(range(len(chosen)), values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    axis.axhline(79, color="red", lw=0.8, ls="--", label="an 80 GB GPU (79 GiB)")
    axis.set_xticks(range(len(chosen)), labels, rotation=90, fontsize=7)
    axis.set_ylabel("GiB per GPU")
    axis.set_title("Full fine-tuning under FSDP2 on 8 GPUs, checkpointing on: the training step's terms")
    axis.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    print(f"wrote {path}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = benchmark_parser(__doc__.split("\n\n")[0], "memory_plan", model_dir_help=None)
    parser.add_argument("--no-measure", action="store_true", help="The plan only: no CPU check (seconds).")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, preset_name, _ = select_preset(args, {"smoke": None, "cpu": None, "gpu": None})
    if device != "cpu":
        raise SystemExit("The plan's check runs on the CPU (the plan itself needs no device): drop --device.")
    started = time.perf_counter()
    archs = published_architectures()
    plan = build_plan(archs)
    checks, structure = [], []
    if not args.no_measure:
        structure = structural_check(families=("LLaDA",), modes=("full",)) if args.smoke else structural_check()
        checks = run_checks(args, CHECK_SETS[preset_name], fresh_process_context("cpu"))
    tables = {**plan_tables(plan, archs), **check_tables(checks, structure)}
    for name in ("peaks", "static", "activations", "structure", "check"):
        print(f"\n{name}:\n{tables[name]}")
    passed = all(abs(point["error"]) <= TOLERANCE for point in checks)
    exact = all(abs(e["predicted_bytes"] / e["measured_bytes"] - 1) <= STRUCTURE_TOLERANCE for e in structure)
    if checks and args.smoke:
        passed = None
        print("\nsmoke: the check's machinery ran; its sizes are too small to judge the formula")
    elif checks:
        worst = max(abs(point["error"]) for point in checks)
        print(
            f"\n{'PASS' if passed else 'FAIL'} CPU check: {len(checks)} points, largest error {worst:.1%} "
            f"(tolerance {TOLERANCE:.0%})"
        )
    if structure:
        print(
            f"{'PASS' if exact else 'FAIL'} structural check: {len(structure)} blocks within {STRUCTURE_TOLERANCE:.0%}"
        )
    elapsed = time.perf_counter() - started
    print(f"total {elapsed:.0f} s")
    payload = {
        "benchmark": "memory_plan",
        "preset": preset_name,
        "machine": machine_info("cpu", args.threads),
        "model": {**model_description_of(archs["LLaDA-8B"]), "plan_models": [a.as_json() for a in archs.values()]},
        "gpus": NUM_GPUS,
        "engines": ENGINE_NOTES,
        "recipes": {
            arch.name: {
                f: asdict(r) | {"refused": {f"{k[0]} {k[1]}": v for k, v in r.refused.items()}}
                for f, r in recipes_for(arch).items()
            }
            for arch in archs.values()
        },
        "plan": plan,
        "check": {
            "points": checks,
            "tolerance": TOLERANCE,
            "passed": passed if checks else None,
            "micro_batches": MICRO_BATCHES,
            "optimizer_steps": OPTIMIZER_STEPS,
        },
        "structure": {"blocks": structure, "passed": exact if structure else None},
        "table": tables["peaks"],
        "tables": tables,
        "seconds": round(elapsed, 1),
    }
    return save_results(args, payload, plot, plan, checks, archs)


def model_description_of(arch: Architecture) -> dict:
    """The keys the benchmarks' JSON carries for their model (`d_model`, ..., `parameters`), for one plan model."""
    return {
        "d_model": arch.hidden,
        "n_layers": arch.layers,
        "n_heads": arch.heads,
        "mlp_hidden_size": arch.intermediate,
        "vocab_size": arch.vocab,
        "parameters": arch.parameters,
    }


if __name__ == "__main__":
    main()
