"""A failed push to the Hub is one clear error (offline mode, no login, no network), from the trainers and the command
line; and a model object built in memory without `processing_class` (or with `beta != 0`, whose reference model TRL
loads from a path) gets a clear error, not TRL's repo-id OSError."""

import re
import traceback

import httpx2
import pytest
from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

from trl_diffusion import (
    BGPOConfig,
    BGPOTrainer,
    DiffuGRPOConfig,
    DiffuGRPOTrainer,
    DiffusionSFTConfig,
    DiffusionSFTTrainer,
)
from trl_diffusion.cli import main
from trl_diffusion.hub import HubPushError, explain_hub_error
from trl_diffusion.models import build_tiny_llada

from helpers import distinct_chars, say_dataset, tiny_config, tiny_grpo_config


def _raise(error):
    def raiser(*args, **kwargs):
        raise error

    return raiser


def test_offline_push_is_one_clear_error(tmp_path, tiny_llada_dir):
    # conftest sets HF_HUB_OFFLINE=1, as `make` does.
    trainer = BGPOTrainer(
        model=tiny_llada_dir,
        reward_funcs=distinct_chars,
        args=tiny_grpo_config(BGPOConfig, tmp_path),
        train_dataset=say_dataset(),
    )
    with pytest.raises(HubPushError, match=r"offline mode is on \(HF_HUB_OFFLINE=1") as error_info:
        trainer.push_to_hub()
    # Raised outside the handler: the HTTP client's frames are not printed under it.
    error = error_info.value
    assert error.__cause__ is None and error.__context__ is None
    assert isinstance(error, OSError)
    # The user's call, the trainer's method, the error: not the HTTP client's 80 lines.
    assert len(traceback.format_exception(error)) <= 4


def test_push_to_hub_at_construction_fails_clearly(tmp_path, tiny_llada_dir):
    with pytest.raises(HubPushError, match="create the model repository"):
        DiffusionSFTTrainer(
            model=tiny_llada_dir,
            args=tiny_config(DiffusionSFTConfig, tmp_path, push_to_hub=True),
            train_dataset=say_dataset().map(lambda row: {"completion": [{"role": "assistant", "content": "0"}]}),
        )


@pytest.mark.parametrize(
    "error, message",
    [
        (OfflineModeIsEnabled("offline"), "HF_HUB_OFFLINE=0"),
        (LocalTokenNotFoundError("no token"), "`hf auth login`"),
        (
            HfHubHTTPError(
                "401 Unauthorized",
                response=httpx2.Response(
                    401, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create")
                ),
            ),
            r"HTTP 401.*`hf auth login`.*\. \.venv/bin/activate.*HF_TOKEN",
        ),
        (httpx2.ConnectError("[Errno -2] Name or service not known"), "unreachable .*Name or service not known"),
        (TimeoutError("timed out"), "unreachable"),
    ],
)
def test_hub_failures_say_what_to_do(error, message):
    explained = explain_hub_error(error, "push the model to the Hub")
    assert isinstance(explained, HubPushError) and re.search(message, str(explained))


def test_other_hub_errors_pass_unchanged():
    error = HfHubHTTPError(
        "500", response=httpx2.Response(500, request=httpx2.Request("POST", "https://huggingface.co/api/repos/create"))
    )
    assert explain_hub_error(error, "push the model to the Hub") is None
    assert explain_hub_error(ValueError("a bug"), "push the model to the Hub") is None


def test_command_line_prints_one_line(monkeypatch, capsys):
    monkeypatch.setattr(
        "trl_diffusion.cli.run_training", _raise(HubPushError("Cannot push the model to the Hub: offline mode is on."))
    )
    assert main(["bgpo", "--push_to_hub"]) == 1
    assert (
        capsys.readouterr().err == "trl-diffusion bgpo: error: Cannot push the model to the Hub: offline mode is on.\n"
    )


def test_model_object_without_processing_class(tmp_path, tiny_tokenizer):
    model = build_tiny_llada(tiny_tokenizer)
    with pytest.raises(ValueError, match="pass the tokenizer too, as `processing_class=tokenizer`"):
        BGPOTrainer(
            model=model,
            reward_funcs=distinct_chars,
            args=tiny_grpo_config(BGPOConfig, tmp_path),
            train_dataset=say_dataset(),
        )
    # A reference model is loaded from the policy's path.
    with pytest.raises(ValueError, match=r"`beta=0.04` needs a reference model.*save it first"):
        DiffuGRPOTrainer(
            model=model,
            reward_funcs=distinct_chars,
            args=tiny_grpo_config(DiffuGRPOConfig, tmp_path),
            train_dataset=say_dataset(),
            processing_class=tiny_tokenizer,
        )
    with pytest.raises(ValueError, match="DiffusionSFTTrainer got a model object"):
        DiffusionSFTTrainer(model=model, args=tiny_config(DiffusionSFTConfig, tmp_path), train_dataset=None)
