"""An [lm-evaluation-harness](https://github.com/EleutherAI/lm-evaluation-harness) model for masked diffusion
language models: `DiffusionLM`, registered with the harness as `trl_diffusion`.

- `generate_until` decodes with the package's sampler ([`~trl_diffusion.generate`]): batched, left-padded, the
  sampler settings being [`~trl_diffusion.DiffusionGenerationConfig`] fields given as `model_args`; a completion
  is cut after its first terminator, decoded without special tokens, then cut at the task's first stop sequence.
- `loglikelihood` is the Monte Carlo ELBO of the continuation given the context, as LLaDA's evaluation
  (`get_log_likelihood`) computes it: only the continuation is masked, at stratified random counts, each sample
  weighted by the inverse of its masked fraction, averaged over `num_mc_samples` samples
  ([`~masking.sample_masks`], [`~likelihood.elbo_terms`]).
- `loglikelihood_rolling` (perplexity) is refused: the ELBO is a bound on a whole sequence's likelihood, not a sum
  of per-token conditionals that can be chunked and rolled.

    lm_eval.simple_evaluate(model=DiffusionLM("GSAI-ML/LLaDA-8B-Instruct", max_completion_length=256), tasks=[...])
    trl-diffusion lm-eval --model_args pretrained=PATH,max_completion_length=256,block_length=32 --tasks gsm8k

Under `accelerate launch` every process evaluates its share of the requests (the harness splits them by `rank` and
`world_size`, and gathers the results). Random draws never depend on the batch, the order or the process: the masks
of a request come from its token ids and `seed`, and so does the sampler's noise (see `trl_diffusion.seeding`).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections import Counter, defaultdict
from dataclasses import fields

import torch
from tqdm.auto import tqdm

try:
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as error:  # pragma: no cover - depends on the environment
    raise ImportError(
        "trl_diffusion.harness needs EleutherAI's lm-evaluation-harness: pip install 'trl_diffusion[lm_eval]' (or "
        "pip install 'lm-eval>=0.4.13,<0.5')."
    ) from error

from .evaluation import _left_pad, evaluation_adapter, load_for_evaluation
from .generation import DiffusionGenerationConfig, cut_at_terminator, generate
from .likelihood import elbo_terms
from .masking import SAMPLERS, MaskPlan, sample_masks
from .seeding import derive_seed

logger = logging.getLogger(__name__)

HARNESS_MODEL_NAME = "trl_diffusion"
# Sampler fields that are not `model_args`: the canvas history and the commits' log-probabilities (the harness keeps
# text only) and the sampler's own seed (each row draws from a generator seeded by `seed` and its context).
OMITTED_SAMPLER_FIELDS = ("record_steps", "record_commit_logprobs", "seed")
# The arguments of LLaDA's `eval_llada.py` that are named otherwise here.
LLADA_ARGUMENT_NAMES = {
    "model_path": "pretrained",
    "mc_num": "num_mc_samples",
    "cfg": "cfg_scale",
    "is_check_greedy": "check_greedy",
}


def _digest(*parts) -> int:
    """A 64-bit integer that depends only on `parts` (token id lists), not on the process or the Python hash seed."""
    return int.from_bytes(hashlib.sha256(json.dumps(parts).encode()).digest()[:8], "little")


@register_model(HARNESS_MODEL_NAME)
class DiffusionLM(TemplateLM):
    """A masked diffusion language model (LLaDA, Dream, any model the package's adapter drives) as an
    lm-evaluation-harness model.

    Every argument can be given as a `model_args` entry (`pretrained=PATH,max_completion_length=256,...`).

    Args:
        pretrained (`str` or `torch.nn.Module`):
            Path or Hub id of a checkpoint or of a PEFT adapter (evaluated on its base model, unmerged; see
            [`~evaluation.load_for_evaluation`]), or a model object (then pass `tokenizer`).
        base_model (`str`, *optional*):
            Base model of a PEFT adapter, overriding its `adapter_config.json`'s `base_model_name_or_path`.
        tokenizer (`str` or `PreTrainedTokenizerBase`, *optional*):
            The tokenizer (default: the checkpoint's, or the adapter's, else its base model's).
        dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype the model is loaded in.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow custom model code from the Hub (native LLaDA and Dream need none).
        device (`str`, *optional*):
            Device of the model (the harness's `--device`). Default: an accelerator when there is one, else the CPU;
            under `accelerate launch` with several processes, each process's own device.
        batch_size (`int`, *optional*, defaults to `16`):
            Prompts per `generate` call; for `loglikelihood`, rows (one Monte Carlo sample of one request) per
            forward pass, as LLaDA's `batch_size`.
        num_mc_samples (`int`, *optional*, defaults to `128`):
            Monte Carlo samples of each log-likelihood (LLaDA's `mc_num` and its default; LLaDA advises 1 for
            single-token continuations such as multiple-choice letters).
        mask_sampler (`str`, *optional*, defaults to `"stratified"`):
            The mask sampler of the estimate, one of `trl_diffusion.masking.SAMPLERS`; `"stratified"` is LLaDA's
            (mask sizes spread evenly over 1..n from one random offset, weight n / l).
        check_greedy (`bool`, *optional*, defaults to `False`):
            Compute `is_greedy` of `loglikelihood` (whether decoding the continuation one most confident token per
            step, LLaDA's `suffix_greedy_prediction`, gives it back). Off: `is_greedy` is `False` (LLaDA's advice:
            no metric of its paper needs it, and it costs one forward pass per continuation token).
        seed (`int`, *optional*, defaults to `0`):
            Seed of the Monte Carlo masks and of sampling at a positive temperature.
        max_batch_size (`int`, *optional*):
            Accepted because the harness passes it; automatic batch sizes are not supported.
        **sampler_settings:
            [`~trl_diffusion.DiffusionGenerationConfig`] fields of `generate_until`: `max_completion_length`,
            `block_length`, `diffusion_steps`, `temperature`, `remasking`, `cfg_scale`, `threshold`, ... (greedy by
            default). The deprecated `gen_length` and `steps` still work, with a `FutureWarning`.
    """

    def __init__(
        self,
        pretrained,
        *,
        base_model: str | None = None,
        tokenizer=None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        device: str | None = None,
        batch_size: int | str = 16,
        num_mc_samples: int = 128,
        mask_sampler: str = "stratified",
        check_greedy: bool = False,
        seed: int = 0,
        max_batch_size: int | None = None,
        **sampler_settings,
    ):
        super().__init__()
        for name in sampler_settings:
            if name in LLADA_ARGUMENT_NAMES:
                raise TypeError(
                    f"`{name}` is LLaDA's eval_llada.py name: pass `{LLADA_ARGUMENT_NAMES[name]}` to "
                    f"{type(self).__name__}."
                )
            if name in OMITTED_SAMPLER_FIELDS:
                raise TypeError(
                    f"`{name}` is not a model_args entry of {type(self).__name__}: the harness keeps the text of the "
                    "completions only, and `seed` seeds every row's generator."
                )
        try:
            self.generation_config = DiffusionGenerationConfig(**sampler_settings)
        except TypeError as error:
            accepted = [f.name for f in fields(DiffusionGenerationConfig) if f.name not in OMITTED_SAMPLER_FIELDS]
            raise TypeError(
                f"{error}. The model_args of `{HARNESS_MODEL_NAME}` are its own arguments (pretrained, base_model, "
                "tokenizer, dtype, trust_remote_code, device, batch_size, num_mc_samples, mask_sampler, "
                f"check_greedy, seed) and the sampler's fields: {', '.join(accepted)}."
            ) from None
        if isinstance(batch_size, str) and not batch_size.isdigit():
            raise ValueError(
                f"batch_size={batch_size!r}: {type(self).__name__} takes a fixed batch size (an integer), not the "
                "harness's automatic one."
            )
        self.batch_size = int(batch_size)
        if self.batch_size < 1 or num_mc_samples < 1:
            raise ValueError(
                f"`batch_size` ({batch_size}) and `num_mc_samples` ({num_mc_samples}) must be positive integers."
            )
        if mask_sampler not in SAMPLERS:
            raise ValueError(f"Unknown `mask_sampler` {mask_sampler!r}: choose one of {SAMPLERS}.")
        self.num_mc_samples, self.mask_sampler = int(num_mc_samples), mask_sampler
        self.check_greedy, self.seed = bool(check_greedy), int(seed)

        from accelerate import PartialState

        # On the CPU, processes launched together join one gloo group only when the state is told so.
        on_cpu = not torch.cuda.is_available() or (device is not None and torch.device(device).type == "cpu")
        self._state = PartialState(cpu=on_cpu)
        if self._state.num_processes > 1:
            self._rank, self._world_size = self._state.process_index, self._state.num_processes
            self._device = self._state.device
        elif device is None:
            self._device = self._state.device
        elif torch.device(device).type == "cuda" and not torch.cuda.is_available():
            logger.warning("device=%r is not available: evaluating on the CPU.", device)
            self._device = torch.device("cpu")
        else:
            self._device = torch.device(device)

        if isinstance(pretrained, str):
            model, loaded_tokenizer = load_for_evaluation(
                pretrained,
                base_model=base_model,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                argument="pretrained",
                base_argument="base_model",
            )
            tokenizer = loaded_tokenizer if tokenizer is None else tokenizer
        else:
            if base_model is not None:
                raise ValueError("`base_model` is for a `pretrained` path of a PEFT adapter, not a model object.")
            if tokenizer is None:
                raise ValueError(f"`pretrained` is a model object: pass its `tokenizer` to {type(self).__name__}.")
            model = pretrained
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
        self.model = model.to(self._device).eval()
        self.tokenizer = tokenizer
        self.adapter = evaluation_adapter(self.model, tokenizer)
        self.pad_token_id = self.adapter.pad_token_id if self.adapter.pad_token_id is not None else self.eot_token_id
        self._ignored_gen_kwargs: set[str] = set()

    # ------------------------------------------------------------------------------------------------ harness API

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        # An empty context is scored after BOS (what a tokenizer that prepends it gives any context), else after EOS.
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.eot_token_id

    @property
    def max_length(self) -> int | None:
        return self.adapter.context_length

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        from accelerate.utils import gather

        return gather(tensor)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj, result, dst=dst)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            self._state.wait_for_everyone()

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        """Token ids of `string`. By default the tokenizer adds its special tokens (as the harness's Hugging Face
        model and LLaDA's evaluation tokenize contexts), unless `string` already starts with BOS (a prompt rendered
        with the chat template)."""
        if add_special_tokens is None:
            bos = self.tokenizer.bos_token
            add_special_tokens = not (bos and string.startswith(bos))
        return self.tokenizer.encode(string, add_special_tokens=add_special_tokens)

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt of `chat_history` rendered with the tokenizer's chat template (the harness's
        `--apply_chat_template`)."""
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False):
        raise NotImplementedError(
            f"{type(self).__name__} has no `loglikelihood_rolling` (perplexity tasks such as wikitext): a masked "
            "diffusion model gives a lower bound (the ELBO) on a whole sequence's log-likelihood, not per-token "
            "conditionals that can be chunked and rolled over a long document. Use `loglikelihood` tasks "
            "(multiple choice) or `generate_until` tasks."
        )

    # ------------------------------------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decodes each request's context with [`~trl_diffusion.generate`] and the `model_args` sampler.

        A completion is cut after its first terminator and decoded without special tokens (as
        [`~evaluation.evaluate_task`] does), then cut before the first of the request's `until` strings. Of the
        task's `generation_kwargs`, only `until` is read: the sampler comes from `model_args`.
        """
        contexts = [self.tok_encode(request.args[0]) for request in requests]
        seeds, occurrences = [], Counter()
        for context in contexts:  # a repeated request (`repeats`) samples afresh each time
            occurrences[tuple(context)] += 1
            seeds.append(derive_seed(self.seed, _digest(context), occurrences[tuple(context)]))
        # Longest first, so that a batch holds prompts of similar lengths; the results go back in request order.
        order = sorted(range(len(requests)), key=lambda index: -len(contexts[index]))
        texts = [None] * len(requests)
        bar = tqdm(total=len(requests), desc="Generating", disable=disable_tqdm or self.rank != 0)
        for start in range(0, len(order), self.batch_size):
            batch = order[start : start + self.batch_size]
            input_ids, attention_mask = _left_pad([contexts[i] for i in batch], self.pad_token_id, self.device)
            generators = [torch.Generator(device=self.device).manual_seed(seeds[i]) for i in batch]
            output = generate(
                self.model,
                input_ids,
                attention_mask,
                generation_config=self.generation_config,
                adapter=self.adapter,
                generator=generators,
            )
            cut = cut_at_terminator(output.completion_ids, self.adapter.terminator_ids)
            for index, text in zip(batch, self.tokenizer.batch_decode(cut, skip_special_tokens=True)):
                texts[index] = self._cut_at_stop_sequences(text, requests[index].args[1])
                self.cache_hook.add_partial("generate_until", requests[index].args, texts[index])
            bar.update(len(batch))
        bar.close()
        return texts

    def _cut_at_stop_sequences(self, text: str, gen_kwargs: dict) -> str:
        ignored = set(gen_kwargs) - {"until"} - self._ignored_gen_kwargs
        if ignored:
            logger.warning(
                "generate_until reads only `until` of the task's generation_kwargs; %s are ignored (the sampler's "
                "settings are model_args: max_completion_length, block_length, diffusion_steps, temperature, ...).",
                sorted(ignored),
            )
            self._ignored_gen_kwargs |= ignored
        until = gen_kwargs.get("until") or []
        if isinstance(until, str):
            until = [until]
        ends = [text.find(stop) for stop in until if stop and stop in text]
        return text[: min(ends)] if ends else text

    # ------------------------------------------------------------------------------------------------ likelihood

    def mask_seed(self, context_ids: list[int], continuation_ids: list[int]) -> int:
        """The mask seed of a request (see [`~masking.sample_masks`]): a function of `seed` and the token ids only."""
        return derive_seed(self.seed, _digest(context_ids, continuation_ids)) >> 2

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """`(ELBO, is_greedy)` of each `((context, continuation), context_ids, continuation_ids)` request.

        Requests whose continuations have the same length are estimated together: their rows (one Monte Carlo
        sample of one request each) are batched `batch_size` at a time, contexts left-padded.
        """
        if self.generation_config.cfg_scale > 0:
            logger.warning("cfg_scale applies to generate_until only: the log-likelihoods are computed unguided.")
        results = [None] * len(requests)
        by_length = defaultdict(list)
        for index, (_, context_ids, continuation_ids) in enumerate(requests):
            length = len(context_ids) + len(continuation_ids)
            if self.max_length is not None and length > self.max_length:
                raise ValueError(
                    f"A loglikelihood request has {len(context_ids)} context + {len(continuation_ids)} continuation "
                    f"tokens = {length}, more than the model's context ({self.max_length}): shorten the task's "
                    "contexts (fewer `--num_fewshot` examples)."
                )
            if continuation_ids:
                by_length[len(continuation_ids)].append(index)
            else:
                results[index] = (0.0, True)  # the empty continuation: log 1
        bar = tqdm(total=len(requests), desc="Log-likelihoods", disable=disable_tqdm or self.rank != 0)
        for indices in by_length.values():
            contexts = [requests[index][1] for index in indices]
            continuations = torch.tensor([requests[index][2] for index in indices], dtype=torch.long)
            elbos = self._elbos(contexts, continuations, [self.mask_seed(*requests[index][1:]) for index in indices])
            greedy = self._greedy(contexts, continuations) if self.check_greedy else [False] * len(indices)
            for index, elbo, is_greedy in zip(indices, elbos.tolist(), greedy):
                results[index] = (elbo, is_greedy)
                self.cache_hook.add_partial("loglikelihood", requests[index][0], results[index])
            bar.update(len(indices))
        bar.close()
        return results

    @torch.no_grad()
    def _elbos(self, contexts: list[list[int]], continuations: torch.LongTensor, seeds: list[int]) -> torch.Tensor:
        """The Monte Carlo ELBO of each continuation (float64): the mean of its `num_mc_samples` terms."""
        plan = sample_masks(
            self.mask_sampler,
            torch.ones_like(continuations, dtype=torch.bool),
            torch.tensor(seeds, dtype=torch.long),
            0,
            self.num_mc_samples,
        )
        rows = [(request, sample) for request in range(len(contexts)) for sample in range(self.num_mc_samples)]
        totals = torch.zeros(len(contexts), dtype=torch.float64)
        for start in range(0, len(rows), self.batch_size):
            requests, samples = (torch.tensor(column) for column in zip(*rows[start : start + self.batch_size]))
            # Each row of the chunk is one Monte Carlo term of one request: a plan of one sample per row.
            chunk_plan = MaskPlan(
                *(
                    None if value is None else value[requests, samples].unsqueeze(1)
                    for value in (plan.masks, plan.weights, plan.complement_masks, plan.complement_weights)
                )
            )
            prompt_ids, prompt_mask = _left_pad([contexts[i] for i in requests], self.pad_token_id, self.device)
            terms = elbo_terms(
                self.model, self.adapter, prompt_ids, prompt_mask, continuations[requests].to(self.device), chunk_plan
            )
            totals.index_add_(0, requests, terms[:, 0].double().cpu())
        return totals / self.num_mc_samples

    @torch.no_grad()
    def _greedy(self, contexts: list[list[int]], continuations: torch.LongTensor) -> list[bool]:
        """Whether decoding one most confident token per step, the continuation's length in one block, gives the
        continuation back (LLaDA's `suffix_greedy_prediction`)."""
        length = continuations.shape[1]
        config = DiffusionGenerationConfig(max_completion_length=length, block_length=length, diffusion_steps=length)
        greedy = []
        for start in range(0, len(contexts), self.batch_size):
            input_ids, attention_mask = _left_pad(
                contexts[start : start + self.batch_size], self.pad_token_id, self.device
            )
            output = generate(self.model, input_ids, attention_mask, generation_config=config, adapter=self.adapter)
            target = continuations[start : start + self.batch_size].to(self.device)
            greedy.extend((output.completion_ids == target).all(dim=1).tolist())
        return greedy
