"""Compiled kernels kept across runs, processes and sweeps, in a folder attngym owns and reports.

torch.compile's caches (Inductor's FX-graph cache, the AOTAutograd cache and Triton's kernels)
already turn a second compile of the same graph into a load, but PyTorch keeps them in a folder of
/tmp that a reboot or a fresh machine empties. attngym points them at `compile_cache` (default
$XDG_CACHE_HOME/attngym/compile), before anything compiles, so a run's second time and every
spawned rank (which inherits the environment) load what an earlier run compiled; the folder can
be copied to another machine with the same GPU, PyTorch and Triton. metrics.json reports the
folder and the cache's hits and misses (attngym.timeline).

compile_threads=1 (the default) compiles in the run's process: a flex run compiles a few kernels,
and Inductor's pool of compile workers takes seconds to start and to stop at the process's exit,
longer than those kernels take to compile in the process.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

AUTO = "auto"


def root() -> Path:
    """attngym's cache folder: $XDG_CACHE_HOME/attngym (~/.cache/attngym); what the runs keep
    between them (compiled kernels, the peak probe) lies under it."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "attngym"


def folder(setting: str | None) -> Path | None:
    """The cache folder `compile_cache` names (None: PyTorch's own)."""
    if setting is None:
        return None
    if setting == AUTO:
        return root() / "compile"
    return Path(setting).expanduser()


def use(compile_cache: str | None, compile_threads: int | None) -> dict[str, Any]:
    """Point torch.compile's caches at the folder and set the compile workers, for this process
    and the ranks it starts; a TORCHINDUCTOR_CACHE_DIR the user set wins. Returns the metric
    `compile_cache` (the folder in use)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    where = folder(compile_cache)
    # PyTorch writes its default into the environment when it first looks: that is no choice.
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR") not in (None, default_cache_dir())
    if where is not None and not chosen:
        where.mkdir(parents=True, exist_ok=True)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(where)
    if compile_threads is not None:
        os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = str(compile_threads)
        import torch._inductor.config as inductor_config  # read when its module was imported

        inductor_config.compile_threads = compile_threads
    return {"compile_cache": os.environ.get("TORCHINDUCTOR_CACHE_DIR", "PyTorch's default")}
