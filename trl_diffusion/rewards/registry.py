"""Reward functions by name, as command lines and recipes name them (`--reward_funcs`)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys

# TRL's own reward functions that `resolve_reward_func` accepts by name (imported on use).
TRL_REWARD_FUNCS = ("accuracy_reward", "reasoning_accuracy_reward", "think_format_reward")


def resolve_reward_func(name: str):
    """A reward function from its name in `trl_diffusion.rewards.REWARD_FUNCS` or TRL's rewards, or from a dotted
    import path.

    Args:
        name (`str`):
            A key of `trl_diffusion.rewards.REWARD_FUNCS` (`countdown_reward`, `format_reward`, ...), one of TRL's
            `TRL_REWARD_FUNCS`, or a dotted import path (`my_rewards.my_reward`; the working directory is importable,
            as in TRL's scripts).
    """
    if "." in name:
        module_path, func_name = name.rsplit(".", 1)
        # As TRL's scripts: a module next to the command (`my_rewards.py`) is importable.
        if os.getcwd() not in sys.path:
            sys.path.insert(0, os.getcwd())
        return getattr(importlib.import_module(module_path), func_name)
    from . import REWARD_FUNCS

    # By `REWARD_FUNCS`: the other exports of `trl_diffusion.rewards` are helpers with other signatures.
    if name in REWARD_FUNCS:
        return REWARD_FUNCS[name]
    if name in TRL_REWARD_FUNCS:
        import trl.rewards

        return getattr(trl.rewards, name)
    closest = difflib.get_close_matches(name, [*REWARD_FUNCS, *TRL_REWARD_FUNCS], n=1)
    suggestion = f"did you mean {closest[0]!r}? " if closest else ""
    raise ValueError(
        f"--reward_funcs {name!r} is not a reward function; {suggestion}Use one of trl_diffusion's "
        f"({', '.join(sorted(REWARD_FUNCS))}), one of TRL's ({', '.join(TRL_REWARD_FUNCS)}), or a dotted import path "
        "(my_module.my_reward)."
    )
