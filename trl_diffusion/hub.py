"""Failed pushes to the Hugging Face Hub as one clear error: offline mode, no login, or no network, instead of the
80-line tracebacks of the HTTP client."""

from __future__ import annotations

import importlib

from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError, OfflineModeIsEnabled

LOGIN_HINT = (
    "log in with `hf auth login` (the `hf` command is in the virtual environment: `. .venv/bin/activate` first) or "
    "set the HF_TOKEN environment variable to a token with write access"
)


class HubPushError(OSError):
    """A push to the Hugging Face Hub that could not happen; the message says why and what to do."""


def _network_errors() -> tuple[type[BaseException], ...]:
    # huggingface_hub's HTTP client raises its own transport errors (httpx, or httpx2 in huggingface_hub 2).
    errors = [ConnectionError, TimeoutError]
    for module in ("httpx2", "httpx"):
        try:
            errors.append(importlib.import_module(module).TransportError)
        except ImportError:
            continue
    return tuple(errors)


def explain_hub_error(error: BaseException, action: str) -> HubPushError | None:
    """The [`HubPushError`] for a way a Hub call fails before or while uploading (offline mode, no login or a token
    that cannot write, no network), or `None` for any other error.

    Args:
        error (`BaseException`):
            What the Hub call raised.
        action (`str`):
            What was attempted, for the message (e.g. `"push the model to the Hub"`).
    """
    if isinstance(error, HubPushError):  # explained by an inner call already
        return HubPushError(str(error))
    if isinstance(error, OfflineModeIsEnabled):
        return HubPushError(
            f"Cannot {action}: offline mode is on (HF_HUB_OFFLINE=1; `make` sets it). Run with HF_HUB_OFFLINE=0."
        )
    if isinstance(error, LocalTokenNotFoundError):
        return HubPushError(f"Cannot {action}: not logged in to the Hugging Face Hub; {LOGIN_HINT}.")
    if isinstance(error, HfHubHTTPError):
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            return HubPushError(
                f"Cannot {action}: the Hub refused the request (HTTP {status}: not logged in, or the token cannot "
                f"write there); {LOGIN_HINT}."
            )
        return None
    if isinstance(error, _network_errors()):
        return HubPushError(
            f"Cannot {action}: the Hugging Face Hub is unreachable ({type(error).__name__}: {error}). Check the "
            "network connection (and HF_ENDPOINT or proxy settings), then retry."
        )
    return None


class HubErrorsMixin:
    """For a `transformers.Trainer` subclass: `push_to_hub` and the repository creation that `push_to_hub=True`
    runs at construction fail with one [`HubPushError`] line saying how to log in or that the network is
    unreachable, raised from the method itself so that the traceback stays a few lines long."""

    def init_hf_repo(self, *args, **kwargs):
        try:
            return super().init_hf_repo(*args, **kwargs)
        except Exception as error:
            explained = explain_hub_error(error, "create the model repository on the Hub")
            if explained is None:
                raise
        raise explained

    def push_to_hub(self, *args, **kwargs):
        try:
            return super().push_to_hub(*args, **kwargs)
        except Exception as error:
            explained = explain_hub_error(error, "push the model to the Hub")
            if explained is None:
                raise
        raise explained
