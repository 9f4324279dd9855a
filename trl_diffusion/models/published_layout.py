"""The `config.json` layout each family publishes, written beside transformers 5's own fields.

The published checkpoints load with their own configuration classes on transformers 4.x (`trust_remote_code`), which
read top-level fields transformers 5 no longer writes (`rope_theta`, `rope_scaling`; SDAR-MoE's `num_experts`, which
transformers 5 renames `num_local_experts`) and fall back to defaults that are not the published models' (RoPE base
10000, LLaDA2's `use_bias=True`). The native config classes write those fields too, with the values the model runs
with, so a saved checkpoint reads to the same model on both. transformers 5 reads its own fields first
(`rope_parameters` wins over a top-level `rope_theta`), so the reload path is unchanged.

`auto_map`: a config loaded from a published checkpoint keeps the checkpoint's `auto_map`, whose modeling files the
package does not write. `save_pretrained` writes it only when every file it names is in the saved directory (or it
names another repository, `repo--module.Class`); otherwise it is dropped, and the checkpoint loads through
`import trl_diffusion` (transformers 5) or after copying the published modeling files next to it.
"""

from __future__ import annotations

import os
from typing import Any


def rope_fields(config) -> dict[str, Any]:
    """The transformers 4.x RoPE fields (`rope_theta`, `rope_scaling`) of a config's `rope_parameters`."""
    parameters = dict(config.rope_parameters)
    theta = parameters.pop("rope_theta")
    parameters.pop("partial_rotary_factor", None)
    scaling = None if parameters.get("rope_type", "default") == "default" else parameters
    return {"rope_theta": theta, "rope_scaling": scaling}


def dangling_auto_map(auto_map, save_directory) -> bool:
    """Whether an `auto_map` names a module file missing from `save_directory` (a `repo--module.Class` entry names
    another repository and never dangles)."""
    for reference in auto_map.values():
        for target in reference if isinstance(reference, (list, tuple)) else [reference]:
            if target is None or "--" in target:
                continue
            module = target.rsplit(".", 1)[0]
            if not os.path.isfile(os.path.join(save_directory, f"{module}.py")):
                return True
    return False


class PublishedLayoutMixin:
    """Writes a native config in its family's published `config.json` layout (see the module docstring).

    Subclasses override `published_fields` with the top-level fields their published configuration class reads and
    transformers 5 does not write (or writes under another name).
    """

    def published_fields(self, output: dict[str, Any]) -> None:
        """Adds (or renames) the published fields in `output`, the dict transformers 5 serializes, in place."""

    def to_dict(self) -> dict[str, Any]:
        output = super().to_dict()
        self.published_fields(output)
        return output

    def save_pretrained(self, save_directory, push_to_hub: bool = False, **kwargs):
        # A published config's `auto_map` is an instance attribute; hide it while saving when its files are missing.
        auto_map = self.__dict__.get("auto_map")
        if not auto_map or not dangling_auto_map(auto_map, save_directory):
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        del self.__dict__["auto_map"]
        try:
            return super().save_pretrained(save_directory, push_to_hub=push_to_hub, **kwargs)
        finally:
            self.__dict__["auto_map"] = auto_map
