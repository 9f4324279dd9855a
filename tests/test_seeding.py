"""The stream table of `trl_diffusion.seeding`: streams that are drawn from the same key never collide."""

from trl_diffusion import seeding
from trl_diffusion.seeding import derive_seed

# Streams derived from the same parent key (see the module docstring).
STREAM_GROUPS = {
    "rollout": ("ROLLOUT_TRAIN", "ROLLOUT_EVAL", "DYNAMIC_SAMPLING_PROMPTS"),
    "row": ("ROW_SAMPLING", "ROW_MASKS", "ROW_HINTS"),
    "mask seed": (
        "MASK_COMPLETION",
        "MASK_SAMPLE",
        "MASK_PROMPT",
        "LFPO_STATES",
        "MASK_PAIR",
        "MASK_BLOCKS",
        "TRAJECTORY_TRANSITIONS",
    ),
    # The streams of the run seed in the trainers on TRL's SFT and DPO trainers.
    "sft and dpo": ("SFT_TRAIN_NOISE", "SFT_EVAL_NOISE", "DPO_COMPLETION"),
}


def test_streams_of_one_key_are_distinct():
    for group, names in STREAM_GROUPS.items():
        values = [getattr(seeding, name) for name in names]
        assert len(set(values)) == len(values), group


def test_every_stream_constant_is_in_a_group():
    constants = {name for name in vars(seeding) if name.isupper() and not name.startswith("_")}
    assert constants == {name for names in STREAM_GROUPS.values() for name in names}


def test_derive_seed_tells_key_orders_apart():
    assert derive_seed(7, 1, 0) != derive_seed(7, 0, 1)
    assert derive_seed(7, 1) != derive_seed(7, 1, 0)
    assert 0 <= derive_seed(2**70, -1) < 2**64
