"""What a tuning trial draws (`+experiment=tune`): only what can run where the study runs.

Hydra's Optuna sweeper calls `search_space` as its `custom_search_space` for every trial. It asks
the config's FLASH rules whether FLASH could run here (attngym.runner.config.flash_refusal_of) and
the tuner's tables which block sizes have a Triton backward kernel (attngym.tuning), so it lives
apart from both.
"""

from __future__ import annotations

import logging
from typing import Any

from attngym.tuning import FLASH, triton_block_sizes

log = logging.getLogger(__name__)

# Triton's tiles the tuner draws. Inductor's backward walks one tile inside another (BLOCK_N1 a
# multiple of BLOCK_M1, BLOCK_M2 of BLOCK_N2: config.NESTED_BACKWARD_TILES), so each pair draws
# its inner tile from SMALL_TILES and its outer one from LARGE_TILES: every small one divides every
# large one, and any draw nests. The forward's BLOCK_M is a large tile, its BLOCK_N a small one,
# as Inductor's own defaults are on Hopper (128 x 64). Tiles that do not divide every block size
# the study draws are left out, so a tile always divides its block.
SMALL_TILES = (32, 64)
LARGE_TILES = (64, 128)
TUNED_WARPS = (4, 8)
TUNED_STAGES = (1, 2, 3)
# The search space's version, in the study's name: a study kept from another space (other
# parameters, or other choices) is not continued, since Optuna refuses a changed distribution.
SEARCH_SPACE = 2


def search_space(cfg: Any, trial: Any) -> None:
    """Everything a tuning trial draws, from what can run where the study runs (Hydra's Optuna
    sweeper calls this as its `custom_search_space`, after the preset's own params, if any).

    - The backend: FLASH only where the run could take it (`tuner_backends`); else none is drawn.
    - A FLASH trial runs the one block size FLASH has on this GPU (`block_size=flash`).
    - A Triton trial draws `block_size.q` and `.kv` among TUNED_BLOCK_SIZES less those with no
      Triton backward kernel here (`triton_block_sizes`), and on CUDA Triton's tiles (nested as
      Inductor's backward asserts, dividing the block sizes), warps and stages, forward and
      backward. A CPU runs eager flex, which has no kernel options: block sizes only.
    Every choice list is the same for the whole study, as Optuna needs.
    """
    backends = tuner_backends(cfg)
    backend = "+kernel_options.BACKEND"
    if len(backends) > 1 and trial.suggest_categorical(backend, backends) == FLASH:
        trial.suggest_categorical("block_size", ["flash"])
        return
    blocks = triton_block_sizes(cfg)
    for side, sizes in blocks.items():
        trial.suggest_categorical(f"block_size.{side}", sizes)
    if not backends:  # a CPU
        return
    every = [size for sizes in blocks.values() for size in sizes]
    small, large = ([t for t in tiles if all(b % t == 0 for b in every)]
                    for tiles in (SMALL_TILES, LARGE_TILES))  # fmt: skip
    option = "+kernel_options."
    for name, tiles in (("fwd_BLOCK_M", large), ("fwd_BLOCK_N", small),
                        ("bwd_BLOCK_M1", small), ("bwd_BLOCK_N1", large),
                        ("bwd_BLOCK_N2", small), ("bwd_BLOCK_M2", large)):  # fmt: skip
        trial.suggest_categorical(option + name, tiles)
    for stage in ("fwd_", "bwd_"):
        trial.suggest_categorical(f"{option}{stage}num_warps", list(TUNED_WARPS))
        trial.suggest_categorical(f"{option}{stage}num_stages", list(TUNED_STAGES))


def tuner_backends(cfg: Any) -> list[str]:
    """The backends a tuning study may try here: none on a CPU (eager flex has one), Triton on
    CUDA, and FLASH beside it where no FLASH rule refuses this run
    (attngym.runner.config.flash_refusal: a 16-bit dtype, compiled, flash-attn-4 importable); one
    list for the whole study."""
    from attngym.device import auto_dtype, resolve_device
    from attngym.runner.config import flash_refusal_of

    device = resolve_device(cfg.device.name).type
    if device != "cuda":
        return []
    dtype = auto_dtype(device) if cfg.dtype == "auto" else cfg.dtype
    refused = flash_refusal_of(device, dtype, bool(cfg.compile), dict(cfg.kernel_options or {}))
    if refused:
        log.info("tuning: FLASH not searched: %s", refused)
        return ["TRITON"]
    return ["TRITON", FLASH]
