"""An [lm-evaluation-harness](https://github.com/EleutherAI/lm-evaluation-harness) model for masked diffusion
language models: `DiffusionLM`, registered with the harness as `trl_diffusion`.

- `generate_until` decodes with the package's sampler ([`~trl_diffusion.generate`]): batched, left-padded, the
  sampler settings being [`~trl_diffusion.DiffusionGenerationConfig`] fields given as `model_args`; a completion
  is cut after its first terminator, decoded without special tokens, then cut at the task's first stop sequence.
- `loglikelihood` is the Monte Carlo ELBO of the continuation given the context, as LLaDA's evaluation
  (`get_log_likelihood`) computes it: only the continuation is masked, at stratified random counts, each sample
  weighted by the inverse of its masked fraction, averaged over `num_mc_samples` samples
  ([`~masking.sample_masks`], [`~likelihood.elbo_terms`]); with `cfg_scale > 0`, under LLaDA's classifier-free
  guidance.
- A context too long for the model is cut on the left, as the harness's Hugging Face model does.
- `loglikelihood_rolling` (perplexity) is refused: the ELBO is a bound on a whole sequence's likelihood, not a sum
  of per-token conditionals that can be chunked and rolled.

    lm_eval.simple_evaluate(model=DiffusionLM("GSAI-ML/LLaDA-8B-Instruct", max_completion_length=256), tasks=[...])
    trl-diffusion lm-eval --model_args pretrained=PATH,max_completion_length=256,block_length=32 --tasks gsm8k
    trl-diffusion lm-eval --model_args model_path=GSAI-ML/LLaDA-8B-Base,cfg=0.5,mc_num=128 --tasks arc_challenge

Under `accelerate launch` every process evaluates its share of the requests (the harness splits them by `rank` and
`world_size`, and gathers the results). Random draws never depend on the batch, the order or the process: the masks
of a request come from its token ids and `seed`, and so does the sampler's noise (see `trl_diffusion.seeding`).
"""

from __future__ import annotations

import gc
import logging
from collections import Counter, defaultdict
from dataclasses import fields, replace

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
from .seeding import content_digest, derive_seed

logger = logging.getLogger(__name__)

HARNESS_MODEL_NAME = "trl_diffusion"
# Sampler fields that are not `model_args`: the canvas history and the commits' log-probabilities (the harness keeps
# text only) and the sampler's own seed (each row draws from a generator seeded by `seed` and its context).
OMITTED_SAMPLER_FIELDS = ("record_steps", "record_commit_logprobs", "seed")
# The arguments of LLaDA's `eval_llada.py` that are named otherwise here, read as their names here (with one notice)
# so that its published commands run unchanged. Its `block_length`, `remasking`, `batch_size`, `max_length` and
# `device` have the same names here.
LLADA_ARGUMENT_NAMES = {
    "model_path": "pretrained",
    "mc_num": "num_mc_samples",
    "cfg": "cfg_scale",
    "is_check_greedy": "check_greedy",
    "gen_length": "max_completion_length",
    "steps": "diffusion_steps",
}
# The starting point of `batch_size="auto"` when `max_batch_size` is not given (the harness's Hugging Face model's).
DEFAULT_MAX_BATCH_SIZE = 64
# Devices on which `batch_size="auto"` probes the memory; elsewhere (the CPU) it takes `max_batch_size`.
PROBED_DEVICE_TYPES = ("cuda", "xpu", "npu", "mps")


@register_model(HARNESS_MODEL_NAME)
class DiffusionLM(TemplateLM):
    """A masked diffusion language model (LLaDA, Dream, any model the package's adapter drives) as an
    lm-evaluation-harness model.

    Every argument can be given as a `model_args` entry (`pretrained=PATH,max_completion_length=256,...`). LLaDA's
    `eval_llada.py` names (`model_path`, `mc_num`, `cfg`, `is_check_greedy`, `gen_length`, `steps`; see
    `LLADA_ARGUMENT_NAMES`) are read as the names here, with one warning, so that its published commands run
    unchanged.

    Args:
        pretrained (`str` or `torch.nn.Module`):
            Path or Hub id of a checkpoint or of a PEFT adapter (evaluated on its base model, unmerged; see
            [`~evaluation.load_for_evaluation`]), or a model object (then pass `tokenizer`).
        peft (`str`, *optional*):
            Path or Hub id of a PEFT (LoRA) adapter to evaluate on `pretrained`, unmerged (the harness's Hugging Face
            model's `peft`). The tokenizer is the adapter directory's when it holds one, else `pretrained`'s.
        base_model (`str`, *optional*):
            Base model of a PEFT adapter given as `pretrained`, overriding its `adapter_config.json`'s
            `base_model_name_or_path`.
        tokenizer (`str` or `PreTrainedTokenizerBase`, *optional*):
            The tokenizer (default: the checkpoint's, or the adapter's, else its base model's).
        dtype (`str`, *optional*, defaults to `"auto"`):
            Dtype the model is loaded in.
        trust_remote_code (`bool`, *optional*, defaults to `False`):
            Allow custom model code from the Hub (native LLaDA and Dream need none).
        device (`str`, *optional*):
            Device of the model (the harness's `--device`). Default: an accelerator when there is one, else the CPU;
            under `accelerate launch` with several processes, each process's own device.
        batch_size (`int` or `"auto"`, *optional*, defaults to `16`):
            Prompts per `generate` call; for `loglikelihood`, rows (one Monte Carlo sample of one request) per
            forward pass, as LLaDA's `batch_size`. `"auto"`: on an accelerator, the largest size from
            `max_batch_size` down (halving) whose pass over the longest request of each `loglikelihood` /
            `generate_until` call fits in memory (the smallest over the processes); on the CPU, `max_batch_size`.
        max_batch_size (`int`, *optional*):
            Where `batch_size="auto"` starts (default 64, as the harness's Hugging Face model).
        max_length (`int`, *optional*):
            Longest sequence (context and continuation, or prompt and canvas) the model is given (default: the
            model's context length). Longer contexts are cut on the left, keeping their last tokens, as the harness's
            Hugging Face model and Dream's evaluation do.
        add_bos_token (`bool`, *optional*):
            As the harness's Hugging Face model's: `None` tokenizes contexts with the tokenizer's special tokens;
            `True` also starts every context with BOS (Dream's `add_bos_token=true`); `False` adds no special token.
            A string that already starts with BOS (a chat-templated prompt) gets no second one.
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
        **sampler_settings:
            [`~trl_diffusion.DiffusionGenerationConfig`] fields of `generate_until`: `max_completion_length`,
            `block_length`, `diffusion_steps`, `temperature`, `remasking`, `cfg_scale`, `threshold`, ... (greedy by
            default). `cfg_scale` guides the log-likelihoods too, as LLaDA's `cfg`: the unconditional pass masks
            the whole context, and the logits are `uncond + (cfg_scale + 1) * (cond - uncond)`.
    """

    def __init__(
        self,
        pretrained=None,
        *,
        peft: str | None = None,
        base_model: str | None = None,
        tokenizer=None,
        dtype: str = "auto",
        trust_remote_code: bool = False,
        device: str | None = None,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        max_length: int | None = None,
        add_bos_token: bool | None = None,
        num_mc_samples: int = 128,
        mask_sampler: str = "stratified",
        check_greedy: bool = False,
        seed: int = 0,
        **sampler_settings,
    ):
        super().__init__()
        own = {"pretrained": pretrained, "num_mc_samples": num_mc_samples, "check_greedy": check_greedy}
        defaults = {"pretrained": None, "num_mc_samples": 128, "check_greedy": False}
        renamed = {name: sampler_settings.pop(name) for name in list(sampler_settings) if name in LLADA_ARGUMENT_NAMES}
        for name, value in renamed.items():
            target = LLADA_ARGUMENT_NAMES[name]
            # Both names given: the own one was set when it is a sampler field present, or differs from its default.
            if target in sampler_settings or (target in own and own[target] != defaults[target]):
                raise TypeError(
                    f"`{name}` (LLaDA's eval_llada.py name) and `{target}` are the same argument: pass one."
                )
            if target in own:
                own[target] = value
            else:
                sampler_settings[target] = value
        if renamed:
            logger.warning(
                "model_args %s are LLaDA's eval_llada.py names: read as %s.",
                ", ".join(f"`{name}`" for name in renamed),
                ", ".join(f"`{LLADA_ARGUMENT_NAMES[name]}`" for name in renamed),
            )
        pretrained, num_mc_samples, check_greedy = own["pretrained"], own["num_mc_samples"], own["check_greedy"]
        if pretrained is None:
            raise TypeError(
                f"{type(self).__name__} needs `pretrained` (LLaDA's `model_path`): a checkpoint or a model."
            )
        for name in sampler_settings:
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
                f"{error}. The model_args of `{HARNESS_MODEL_NAME}` are its own arguments (pretrained, peft, "
                "base_model, tokenizer, dtype, trust_remote_code, device, batch_size, max_batch_size, max_length, "
                "add_bos_token, num_mc_samples, mask_sampler, check_greedy, seed), LLaDA's names of some of them "
                f"({', '.join(LLADA_ARGUMENT_NAMES)}) and the sampler's fields: {', '.join(accepted)}."
            ) from None
        self.automatic_batch_size = str(batch_size) == "auto"
        if not self.automatic_batch_size and not (isinstance(batch_size, int) or str(batch_size).isdigit()):
            raise ValueError(
                f"batch_size={batch_size!r}: pass an integer or 'auto' (the harness's 'auto:N', which detects the "
                f"size N times over the run, is not supported: {type(self).__name__} detects it at each call)."
            )
        self.max_batch_size = DEFAULT_MAX_BATCH_SIZE if max_batch_size is None else int(max_batch_size)
        self.batch_size = self.max_batch_size if self.automatic_batch_size else int(batch_size)
        if self.batch_size < 1 or num_mc_samples < 1:
            raise ValueError(
                f"`batch_size` ({batch_size}), `max_batch_size` ({max_batch_size}) and `num_mc_samples` "
                f"({num_mc_samples}) must be positive integers."
            )
        if mask_sampler not in SAMPLERS:
            raise ValueError(f"Unknown `mask_sampler` {mask_sampler!r}: choose one of {SAMPLERS}.")
        self.num_mc_samples, self.mask_sampler = int(num_mc_samples), mask_sampler
        self.check_greedy, self.seed = bool(check_greedy), int(seed)
        self.add_bos_token = add_bos_token
        self.likelihood_batch_size = self.batch_size  # `batch_size="auto"` sets it at each loglikelihood call

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

        model, tokenizer = self._load(pretrained, peft, base_model, tokenizer, dtype, trust_remote_code)
        self.model = model.to(self._device).eval()
        self.tokenizer = tokenizer
        self.adapter = evaluation_adapter(self.model, tokenizer)
        self.pad_token_id = self.adapter.pad_token_id if self.adapter.pad_token_id is not None else self.eot_token_id
        if add_bos_token and tokenizer.bos_token_id is None:
            raise ValueError("add_bos_token=True: the tokenizer has no BOS token. Drop add_bos_token.")
        context = self.adapter.context_length
        if max_length is not None and (max_length < 2 or (context is not None and max_length > context)):
            raise ValueError(
                f"max_length={max_length}: it must be at least 2 and at most the model's context length ({context})."
            )
        self.context_limit = context if max_length is None else int(max_length)
        self._ignored_gen_kwargs: set[str] = set()

    @staticmethod
    def _load(pretrained, peft, base_model, tokenizer, dtype, trust_remote_code):
        """The model (a `PeftModel` with `peft`, or for an adapter `pretrained`) and its tokenizer."""
        if peft is not None:
            from transformers.utils import find_adapter_config_file

            if base_model is not None:
                raise ValueError(
                    "`base_model` is the base of an adapter given as `pretrained`; with `peft`, the base is "
                    "`pretrained`: drop `base_model`."
                )
            if find_adapter_config_file(peft) is None:
                raise ValueError(f"peft={peft!r} has no adapter_config.json: it is not a PEFT adapter.")
        if isinstance(pretrained, str):
            if peft is not None:
                if find_adapter_config_file(pretrained) is not None:
                    raise ValueError(
                        f"pretrained={pretrained!r} is itself a PEFT adapter: with `peft`, pass its base model as "
                        "`pretrained` (or drop `peft`)."
                    )
                # The adapter is the checkpoint and `pretrained` its base, under lm-eval's own argument names.
                checkpoint, base, names = peft, pretrained, ("peft", "pretrained")
            else:
                checkpoint, base, names = pretrained, base_model, ("pretrained", "base_model")
            model, loaded_tokenizer = load_for_evaluation(
                checkpoint,
                base_model=base,
                dtype=dtype,
                trust_remote_code=trust_remote_code,
                argument=names[0],
                base_argument=names[1],
            )
            tokenizer = loaded_tokenizer if tokenizer is None else tokenizer
        else:
            if base_model is not None:
                raise ValueError("`base_model` is for a `pretrained` path of a PEFT adapter, not a model object.")
            if tokenizer is None:
                raise ValueError("`pretrained` is a model object: pass its `tokenizer` to DiffusionLM.")
            model = pretrained
            if peft is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, peft)
        if isinstance(tokenizer, str):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer, trust_remote_code=trust_remote_code)
        return model, tokenizer

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
        return self.context_limit

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
        model and LLaDA's evaluation tokenize contexts), `add_bos_token=False` adds none and `add_bos_token=True`
        makes the ids start with BOS; none of them when `string` already starts with BOS (a prompt rendered with the
        chat template). An explicit `add_special_tokens` is obeyed."""
        bos = self.tokenizer.bos_token
        if add_special_tokens is not None or (bos and string.startswith(bos)):
            return self.tokenizer.encode(string, add_special_tokens=bool(add_special_tokens))
        ids = self.tokenizer.encode(string, add_special_tokens=self.add_bos_token is not False)
        if self.add_bos_token and ids[:1] != [self.tokenizer.bos_token_id]:
            ids = [self.tokenizer.bos_token_id, *ids]  # a tokenizer that adds no BOS itself (Qwen's, Dream's)
        return ids

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

    def _cut_on_the_left(self, contexts: list[list[int]], rooms: list[int], kind: str) -> list[list[int]]:
        """Each context cut to its last `room` tokens, with one warning per call that says how many were cut."""
        cut = [context[-room:] if len(context) > room else context for context, room in zip(contexts, rooms)]
        count = sum(len(before) != len(after) for before, after in zip(contexts, cut))
        if count:
            logger.warning(
                "%d %s request(s) were longer than max_length (%d): their contexts were cut on the left, keeping their "
                "last tokens (as the harness's Hugging Face model does).",
                count,
                kind,
                self.max_length,
            )
        return cut

    def _batch_size(self, kind: str, probe) -> int:
        """The batch size of a `kind` call: the fixed one, or for `batch_size="auto"` on an accelerator the largest
        from `max_batch_size` down (halving) for which `probe(rows)` runs without running out of memory (the
        smallest over the processes); on the CPU, where a failed allocation is not recoverable, `max_batch_size`."""
        if not self.automatic_batch_size:
            return self.batch_size
        size = self.max_batch_size
        if self.device.type in PROBED_DEVICE_TYPES:
            while True:
                try:
                    with torch.no_grad():
                        probe(size)
                    break
                except torch.OutOfMemoryError:
                    if size == 1:
                        raise
                size //= 2  # outside the `except`: its traceback holds the failed pass's tensors
                gc.collect()
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
            if self.world_size > 1:
                size = int(self.all_gather(torch.tensor([size], device=self.device)).min())
        logger.info("batch_size='auto': %d for %s.", size, kind)
        return size

    # ------------------------------------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Decodes each request's context with [`~trl_diffusion.generate`] and the `model_args` sampler.

        A completion is cut after its first terminator and decoded without special tokens (as
        [`~evaluation.evaluate_task`] does), then cut before the first of the request's `until` strings. Of the
        task's `generation_kwargs`, only `until` is read: the sampler comes from `model_args`.
        """
        contexts = [self.tok_encode(request.args[0]) for request in requests]
        if self.max_length is not None:
            # The harness's Hugging Face model keeps a context's last `max_length - max_gen_toks` tokens.
            room = self.max_length - self.generation_config.max_completion_length
            if room < 1:
                raise ValueError(
                    f"max_completion_length ({self.generation_config.max_completion_length}) leaves no room for a "
                    f"prompt in max_length ({self.max_length}): lower max_completion_length."
                )
            contexts = self._cut_on_the_left(contexts, [room] * len(contexts), "generate_until")
        seeds, occurrences = [], Counter()
        for context in contexts:  # a repeated request (`repeats`) samples afresh each time
            occurrences[tuple(context)] += 1
            seeds.append(derive_seed(self.seed, content_digest(context), occurrences[tuple(context)]))
        # Longest first, so that a batch holds prompts of similar lengths; the results go back in request order.
        order = sorted(range(len(requests)), key=lambda index: -len(contexts[index]))
        texts = [None] * len(requests)

        def probe(rows: int) -> None:  # the longest prompt, one step per block
            config = self.generation_config
            steps = config.max_completion_length // config.block_length
            input_ids, attention_mask = _left_pad([contexts[order[0]]] * rows, self.pad_token_id, self.device)
            generate(
                self.model,
                input_ids,
                attention_mask,
                generation_config=replace(config, diffusion_steps=steps),
                adapter=self.adapter,
            )

        batch_size = self._batch_size("generate_until", probe) if requests else self.batch_size
        bar = tqdm(total=len(requests), desc="Generating", disable=disable_tqdm or self.rank != 0)
        for start in range(0, len(order), batch_size):
            batch = order[start : start + batch_size]
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

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        """`(ELBO, is_greedy)` of each `((context, continuation), context_ids, continuation_ids)` request.

        A context too long for `max_length` with its continuation keeps its last `max_length - len(continuation)`
        tokens (Dream's evaluation's rule). Requests whose continuations have the same length are estimated together:
        their rows (one Monte Carlo sample of one request each) are batched `batch_size` at a time, contexts
        left-padded.
        """
        requests = list(requests)
        if self.max_length is not None:
            for _, _, continuation_ids in requests:
                if len(continuation_ids) >= self.max_length:
                    raise ValueError(
                        f"A loglikelihood continuation has {len(continuation_ids)} tokens, no fewer than max_length "
                        f"({self.max_length}): there is no room left for its context."
                    )
            rooms = [self.max_length - len(continuation_ids) for _, _, continuation_ids in requests]
            contexts = self._cut_on_the_left([request[1] for request in requests], rooms, "loglikelihood")
            requests = [
                (strings, context, continuation) for (strings, _, continuation), context in zip(requests, contexts)
            ]
        results = [None] * len(requests)
        by_length = defaultdict(list)
        for index, (_, _, continuation_ids) in enumerate(requests):
            if continuation_ids:
                by_length[len(continuation_ids)].append(index)
            else:
                results[index] = (0.0, True)  # the empty continuation: log 1
        if by_length:
            longest = max(range(len(requests)), key=lambda index: len(requests[index][1]) + len(requests[index][2]))

            def probe(rows: int) -> None:  # the longest request, its whole continuation masked
                _, context_ids, continuation_ids = requests[longest]
                completion = torch.tensor([continuation_ids] * rows, device=self.device)
                plan = MaskPlan(torch.ones_like(completion, dtype=torch.bool).unsqueeze(1), torch.ones(rows, 1))
                prompt_ids, prompt_mask = _left_pad([context_ids] * rows, self.pad_token_id, self.device)
                self._terms(prompt_ids, prompt_mask, completion, plan)

            self.likelihood_batch_size = self._batch_size("loglikelihood", probe)
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

    def mask_seed(self, context_ids: list[int], continuation_ids: list[int]) -> int:
        """The mask seed of a request (see [`~masking.sample_masks`]): a function of `seed` and the token ids only."""
        return derive_seed(self.seed, content_digest(context_ids, continuation_ids)) >> 2

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
        batch_size = self.likelihood_batch_size
        for start in range(0, len(rows), batch_size):
            requests, samples = (torch.tensor(column) for column in zip(*rows[start : start + batch_size]))
            # Each row of the chunk is one Monte Carlo term of one request: a plan of one sample per row.
            chunk_plan = MaskPlan(
                **{
                    name: None if value is None else value[requests, samples].unsqueeze(1)
                    for name, value in vars(plan).items()
                }
            )
            prompt_ids, prompt_mask = _left_pad([contexts[i] for i in requests], self.pad_token_id, self.device)
            terms = self._terms(prompt_ids, prompt_mask, continuations[requests].to(self.device), chunk_plan)
            totals.index_add_(0, requests, terms[:, 0].double().cpu())
        return totals / self.num_mc_samples

    def _terms(self, prompt_ids, prompt_mask, completion_ids, plan: MaskPlan) -> torch.Tensor:
        """The plan's ELBO terms of the rows, `(rows, num_mc_samples)`: the package's `elbo_terms`, or with
        `cfg_scale > 0` the same terms under LLaDA's classifier-free guidance (`get_logits` of its `eval_llada.py`):
        each canvas is also run with its whole context masked, in the same forward pass, and the masked positions are
        scored by `log_softmax(uncond + (cfg_scale + 1) * (cond - uncond))`."""
        scale = self.generation_config.cfg_scale
        if scale == 0:
            return elbo_terms(self.model, self.adapter, prompt_ids, prompt_mask, completion_ids, plan)
        terms = []
        for mc_index in range(plan.num_mc_samples):
            passes = [(plan.masks, plan.weights)]
            if plan.complement_masks is not None:
                passes.append((plan.complement_masks, plan.complement_weights))
            term = 0
            for masks, weights in passes:
                scored = masks[:, mc_index].to(completion_ids.device)
                hidden = scored if plan.context_masks is None else scored | plan.context_masks[:, mc_index].to(scored)
                logprobs = self._guided_logprobs(prompt_ids, prompt_mask, completion_ids, scored, hidden, scale)
                term = term + MaskPlan(masks, weights).weighted_sums(logprobs.unsqueeze(1), [mc_index])[:, 0]
            terms.append(term)
        return torch.stack(terms, dim=1)

    def _guided_logprobs(self, prompt_ids, prompt_mask, completion_ids, scored, hidden, scale: float) -> torch.Tensor:
        """`log p(y_i)` at the `scored` positions (0 elsewhere) of the canvases whose `hidden` positions are masked,
        under classifier-free guidance of scale `scale`."""
        model, adapter, mask_token_id = self.model, self.adapter, self.adapter.mask_token_id
        noisy = completion_ids.masked_fill(hidden, mask_token_id).repeat(2, 1)
        # The unconditional rows: every real context token masked, the padding left as it is (LLaDA's `un_batch`).
        prompts = torch.cat([prompt_ids, prompt_ids.masked_fill(prompt_mask.bool(), mask_token_id)])
        prompt_masks, targets, rows = prompt_mask.repeat(2, 1), completion_ids.repeat(2, 1), scored.repeat(2, 1)
        # The output head at the scored positions only.
        if adapter.block_causal:
            logits = adapter.composite_logits(model, prompts, prompt_masks, noisy, targets, head_rows=rows)
        else:
            input_ids = torch.cat([prompts, noisy], dim=1)
            attention_mask = torch.cat([prompt_masks, torch.ones_like(targets, dtype=prompt_masks.dtype)], dim=1)
            logits = adapter.logits(model, input_ids, attention_mask, num_logits=targets.shape[1], head_rows=rows)
        conditional, unconditional = logits.float().chunk(2)
        guided = (unconditional + (scale + 1) * (conditional - unconditional)).log_softmax(-1)
        logprobs = guided.gather(-1, completion_ids[scored].unsqueeze(-1)).squeeze(-1)
        return torch.zeros(scored.shape, dtype=torch.float32, device=logprobs.device).masked_scatter(scored, logprobs)

    @torch.no_grad()
    def _greedy(self, contexts: list[list[int]], continuations: torch.LongTensor) -> list[bool]:
        """Whether decoding one most confident token per step, the continuation's length in one block, gives the
        continuation back (LLaDA's `suffix_greedy_prediction`)."""
        length = continuations.shape[1]
        config = DiffusionGenerationConfig(max_completion_length=length, block_length=length, diffusion_steps=length)
        greedy = []
        batch_size = self.likelihood_batch_size
        for start in range(0, len(contexts), batch_size):
            input_ids, attention_mask = _left_pad(contexts[start : start + batch_size], self.pad_token_id, self.device)
            output = generate(self.model, input_ids, attention_mask, generation_config=config, adapter=self.adapter)
            target = continuations[start : start + batch_size].to(self.device)
            greedy.extend((output.completion_ids == target).all(dim=1).tolist())
        return greedy
