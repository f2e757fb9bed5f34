"""attention-gym's options (conf/attention/gym_*.yaml) composed through the real config at 32
tokens, for the CPU tests: tests/test_gym.py (single device) and test_gym_cp.py (ring and
all-gather on 2 ranks).

The defaults of each option derive what it needs (a canvas, documents, frames) from shape.seq_len
at the sizes presets use; at 32 tokens some need smaller kernels, windows or tiles, given here as
the CLI's override strings.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

CONF = Path(__file__).resolve().parents[2] / "conf"
S = 32
HEADS = 4

# Per option, the overrides that fit 32 tokens (options left out fit as they are).
SMALL = {
    "gym_sliding_window": ["attention.mask_args.window_size=6"],
    "gym_dilated_sliding_window": ["attention.mask_args.window_size=8"],
    "gym_global_sliding_window": [
        "attention.mask_args.window_size=3",
        "attention.mask_args.global_tokens=[0,17]",
    ],
    "gym_block_diffusion": ["attention.mask_args.block_size=4"],
    "gym_natten": ["attention.mask_args.canvas_w=8"]
    + [f"attention.mask_args.kernel_{a}=3" for a in "wh"],
    "gym_tiled_natten": [
        f"attention.mask_args.{k}={v}"
        for k, v in (("W", 8), ("K_W", 3), ("K_H", 3), ("T_W", 2), ("T_H", 2))
    ],
    # 32 Z-order codes cover x < 8 (bits 0, 2, 4) and y < 4 (bits 1, 3).
    "gym_morton_natten": ["attention.mask_args.canvas_w=8"]
    + [f"attention.mask_args.kernel_{a}=3" for a in "wh"],
    # A 4 x 6 image (2 x 2 tiles) and 8 text tokens after it.
    "gym_sta_2d": [
        "attention.mask_args.canvas_hw=[4,6]",
        "attention.mask_args.kernel_hw=[2,4]",
        "attention.mask_args.tile_hw=[2,2]",
        "attention.mask_args.text_seq_len=8",
    ],
    "gym_sta_3d": [
        "attention.mask_args.canvas_twh=[2,4,4]",
        "attention.mask_args.kernel_twh=[2,4,2]",
        "attention.mask_args.tile_twh=[1,2,2]",
    ],
    "gym_svg_spatial": ["attention.mask_args.round_width=2"],
    "gym_jetspec_training": ["attention.mask_args.block_size=8"],
    "gym_softcap": ["attention.score_args.soft_cap=1"],  # a cap that bites on O(1) scores
}


def options() -> list[str]:
    """Every gym_* option of conf/attention."""
    return sorted(p.stem for p in (CONF / "attention").glob("gym_*.yaml"))


@functools.cache
def compose_entries(seq_len: int = S, heads: int = HEADS) -> dict[str, dict[str, Any]]:
    """option -> its `attention` entry, composed by Hydra and checked by attngym.runner.config
    (which builds and probes the variant), at `seq_len` tokens and `heads` heads (SMALL's overrides
    at 32 tokens). Cached: composing costs about half a second an option on a 2-core CPU."""
    from hydra import compose, initialize_config_dir

    from attngym.runner.config import check_config
    from attngym.runner.overrides import register_resolvers

    register_resolvers()
    entries = {}
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        for option in options():
            overrides = [f"attention={option}", f"shape.seq_len={seq_len}", f"shape.heads={heads}"]
            small = SMALL.get(option, []) if seq_len == S else []
            cfg = compose("config", overrides=overrides + small)
            entries[option] = check_config(cfg)["attention"]
    return entries
