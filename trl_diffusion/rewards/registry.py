"""Reward functions by name, as command lines and recipes name them (`--reward_funcs`)."""

from __future__ import annotations

import importlib
import os
import sys

# TRL's own reward functions that `resolve_reward_func` accepts by name (imported on use).
TRL_REWARD_FUNCS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


def resolve_reward_func(name: str):
    """A reward function from its name in `trl_diffusion.rewards` or TRL's rewards, or from a dotted import path.

    Args:
        name (`str`):
            A function of `trl_diffusion.rewards` (`countdown_reward`, `format_reward`, ...), one of TRL's
            `TRL_REWARD_FUNCS`, or a dotted import path (`my_rewards.my_reward`; the working directory is importable,
            as in TRL's scripts).
    """
    if "." in name:
        module_path, func_name = name.rsplit(".", 1)
        # As TRL's scripts: a module next to the command (`my_rewards.py`) is importable.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module_path), func_name)
    from .. import rewards

    if callable(getattr(rewards, name, None)):
        return getattr(rewards, name)
    if name in TRL_REWARD_FUNCS:
        import trl.rewards

        return getattr(trl.rewards, name)
    raise ValueError(
        f"Unknown reward function {name!r}: use a function of trl_diffusion.rewards, one of "
        f"{sorted(TRL_REWARD_FUNCS)}, or a dotted import path (my_module.my_reward)."
    )
