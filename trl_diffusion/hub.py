"""Failed pushes to the Hugging Face Hub as one clear error: offline mode, no login, or no network, instead of the
80-line tracebacks of the HTTP client."""

from __future__ import annotations

import importlib
from contextlib import contextmanager

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


@contextmanager
def hub_errors_explained(action: str):
    """Turns the ways a Hub call fails before or while uploading into a [`HubPushError`] raised from `None`.

    Args:
        action (`str`):
            What was attempted, for the message (e.g. `"push the model to the Hub"`).
    """
    try:
        yield
    except OfflineModeIsEnabled:
        raise HubPushError(
            f"Cannot {action}: offline mode is on (HF_HUB_OFFLINE=1; `make` sets it). Run with HF_HUB_OFFLINE=0."
        ) from None
    except LocalTokenNotFoundError:
        raise HubPushError(f"Cannot {action}: not logged in to the Hugging Face Hub; {LOGIN_HINT}.") from None
    except HfHubHTTPError as error:
        status = getattr(error.response, "status_code", None)
        if status in (401, 403):
            raise HubPushError(
                f"Cannot {action}: the Hub refused the request (HTTP {status}: not logged in, or the token cannot "
                f"write there); {LOGIN_HINT}."
            ) from None
        raise
    except _network_errors() as error:
        raise HubPushError(
            f"Cannot {action}: the Hugging Face Hub is unreachable ({type(error).__name__}: {error}). Check the "
            "network connection (and HF_ENDPOINT or proxy settings), then retry."
        ) from None


class HubErrorsMixin:
    """For a `transformers.Trainer` subclass: `push_to_hub` and the repository creation that `push_to_hub=True`
    runs at construction fail with one [`HubPushError`] line saying how to log in or that the network is
    unreachable."""

    def init_hf_repo(self, *args, **kwargs):
        with hub_errors_explained("create the model repository on the Hub"):
            return super().init_hf_repo(*args, **kwargs)

    def push_to_hub(self, *args, **kwargs):
        with hub_errors_explained("push the model to the Hub"):
            return super().push_to_hub(*args, **kwargs)
