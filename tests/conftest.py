import os

# Tests never reach the Hub: every model and tokenizer is built locally.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import gc  # noqa: E402

import peft  # noqa: E402, F401
import pytest  # noqa: E402
import torch  # noqa: E402
import trl  # noqa: E402, F401
import trl.trainer.grpo_trainer  # noqa: E402, F401

from trl_diffusion.models import DiffusionAdapter, build_tiny_bidirectional_llama, build_tiny_tokenizer  # noqa: E402

# accelerate's `free_memory` runs a full `gc.collect()` at every `Trainer.train()` (0.5 to 1 s over a heap of
# imported modules): the objects alive now (the libraries) are left out of every later collection.
gc.freeze()


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_llama(tiny_tokenizer):
    """A tiny bidirectional Llama in eval mode; tests must not change its weights (copy it first)."""
    return build_tiny_bidirectional_llama(tiny_tokenizer, seed=0).eval()


@pytest.fixture(scope="session")
def tiny_llama_adapter(tiny_llama, tiny_tokenizer):
    return DiffusionAdapter.from_model(tiny_llama, tiny_tokenizer)


@pytest.fixture(scope="session")
def context_llama(tiny_tokenizer):
    """The tiny bidirectional Llama trained until context matters, shipped as `tests/fixtures/context_llama/` (made by
    `tests/fixtures/make_context_llama.py`, so the same weights on every CPU), in eval mode, and its prompt ids:
    `(model, prompt_ids)`. Tests must not change its weights."""
    from transformers import LlamaForCausalLM

    from fixtures.make_context_llama import FIXTURE_DIR, context_prompt

    model = LlamaForCausalLM.from_pretrained(FIXTURE_DIR, attn_implementation="sdpa")
    return model.eval().requires_grad_(False), context_prompt(tiny_tokenizer)


# Session models that tests share read-only: a test that trains one in place changes every later test's model.
SHARED_MODELS = ("tiny_llama", "tiny_llada", "tiny_dream", "context_llama")


@pytest.fixture(autouse=True)
def _shared_models_unchanged(request):
    """Fails the test that changed the weights of a shared session model (train a copy instead)."""
    shared = {name: request.getfixturevalue(name) for name in SHARED_MODELS if name in request.fixturenames}
    models = {name: value[0] if isinstance(value, tuple) else value for name, value in shared.items()}
    before = {
        name: [(p.detach().clone(), p.requires_grad) for p in model.parameters()] for name, model in models.items()
    }
    patched = {name: patched_forwards(model) for name, model in models.items()}
    yield
    for name, model in models.items():
        changed = any(
            not torch.equal(p, q) or p.requires_grad != grad for p, (q, grad) in zip(model.parameters(), before[name])
        )
        assert not changed, f"the test changed the weights (or what trains) of the shared `{name}` fixture: use a copy"
        assert patched_forwards(model) == patched[name], (
            f"the test left a patched `forward` on the shared `{name}` fixture (a trainer patches the model it is "
            "given and does not undo it)"
        )


def patched_forwards(model) -> list[str]:
    """The modules of `model` whose `forward` is an instance attribute (a patch) instead of their class's."""
    return [name for name, module in model.named_modules() if "forward" in module.__dict__]


@pytest.fixture(autouse=True)
def _deterministic_threads():
    """One torch thread per test; `TRL_DIFFUSION_TEST_THREADS=2` runs the suite with another reduction order (a result
    that holds only at one thread count fails there)."""
    torch.set_num_threads(int(os.environ.get("TRL_DIFFUSION_TEST_THREADS", "1")))
    yield


@pytest.fixture(scope="session")
def tiny_llada(tiny_tokenizer):
    """A tiny native LLaDA in eval mode; tests must not change its weights (copy it first)."""
    from trl_diffusion.models import build_tiny_llada

    return build_tiny_llada(tiny_tokenizer, seed=0).eval()


@pytest.fixture(scope="session")
def tiny_dream(tiny_tokenizer):
    """A tiny native Dream in eval mode; tests must not change its weights (copy it first)."""
    from trl_diffusion.models import build_tiny_dream

    return build_tiny_dream(tiny_tokenizer, seed=0).eval()


@pytest.fixture(scope="session")
def tiny_llada_dir(tmp_path_factory, tiny_llada, tiny_tokenizer):
    """`tiny_llada` and its tokenizer saved as a checkpoint, once per session: trainers (and their reference or old
    models) load it by path. Read-only for the tests: write elsewhere (e.g. to `tmp_path`)."""
    from helpers import save_checkpoint

    return save_checkpoint(tiny_llada, tiny_tokenizer, tmp_path_factory.mktemp("tiny-llada"))


@pytest.fixture(scope="module")
def chat_prompts(tiny_tokenizer):
    """`helpers.CHAT_PROMPTS` as single user messages through the chat template with the generation prompt,
    left-padded: `input_ids` and `attention_mask`."""
    from helpers import CHAT_PROMPTS

    messages = [[{"role": "user", "content": prompt}] for prompt in CHAT_PROMPTS]
    return tiny_tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, padding=True, return_tensors="pt", return_dict=True
    )
