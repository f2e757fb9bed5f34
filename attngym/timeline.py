"""Where a run's wall time goes: its phases on the host clock, and what torch.compile did in them.

A researcher waits for the whole run, not for the milliseconds it times, so every job records
where its seconds went. The run layer starts one `Timeline` per job (a spawned context-parallel
rank starts its own); the run layer and the tasks mark their phases with `phase(name)`, which does
nothing where no timeline runs (a script calling a task directly). Phases are exclusive: one
entered inside another pauses the outer one, so the phases and `other` add up to `wall_s`.

A job's metrics (attngym.metrics: the `Run time` rows):

    wall_s            the job, from its start (the first job of a process: from the process's
                      start, so the imports and Hydra's composition count) to its last file
    phase_<name>_s    the seconds of each phase (names: PHASES, plus baseline_<name>)
    compile_total_s   seconds torch.compile spent (Dynamo, AOTAutograd, Inductor; a backward
                      compiled lazily at its first call included), whatever phase it fell in
    compiles          graphs torch.compile built, recompiles included
    recompiles        graphs built again for a function compiled before in this process, each
                      logged with Dynamo's reason (a new shape, another grad mode, ...)
    compile_cache_hits, compile_cache_misses
                      Inductor's FX-graph and AOTAutograd cache lookups: a warm cache turns a
                      compile into a load (attngym.compile_cache)
    bytecode_kept     whether Python keeps torch's compiled bytecode for the next run: false
                      where PYTHONDONTWRITEBYTECODE is set and none is kept (common in container
                      images), so every run compiles torch's sources again, 5-9 s of its startup
                      on a GPU machine (experiments/run_time, "An eighth time")
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Mapping
from typing import Any

from attngym.metrics import shortened

log = logging.getLogger(__name__)

# The phases the run layer and the tasks mark, in run order; a contender's setup is
# baseline_<name>.
PHASES = (
    "startup",  # the process's imports and Hydra's composition (the first job of a process)
    "config",  # checks and resolution of the settings, the preset against this machine
    "inputs",  # seeded q, k, v and the output gradient
    "block_mask",  # the block masks the run attends with
    "first_call",  # the first flex call (and backward): first_call_s
    "validation",  # sampled rows against the float64 reference
    "timed",  # the timed passes and peak memory
    "profile",  # the profiler group's profile of one call
    "baselines",  # the contenders timed together (each one's setup: baseline_<name>)
    "ranks_start",  # context parallel: starting the rank processes and their process group
    "shard",  # context parallel: each rank's shards
    "instrument",  # context parallel: step compute and transfer timed apart
    "simulate",  # simulated ranks: each rank's plans and kernel calls timed on this device
    "torch_cp",  # context parallel: PyTorch's own flex CP on the same shards
    "one_device",  # context parallel: the whole problem on one device
    "pictures",  # heatmap.png and block_mask.png
    "tracker",  # the logger group's tracker
    "files",  # metrics.json and the other files of the run
    "other",  # what no phase covers
)

# How many phases the line at the end of a run names.
LARGEST = 3


class Timeline:
    """The phases of one job, each timed exclusively, and torch.compile's work during it."""

    def __init__(self, start: float | None = None) -> None:
        now = time.perf_counter()
        self.start = now if start is None else start
        self.seconds: dict[str, float] = collections.defaultdict(float)
        if now > self.start:  # from the process's start to the job's: startup
            self.seconds["startup"] = now - self.start
        self._stack: list[tuple[str, float]] = []
        self.compile_s = 0.0
        self.compiles = 0
        self.recompiles: list[str] = []
        self._hits_before, self._misses_before = _cache_counts()

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the block as phase `name`; an enclosing phase is paused meanwhile."""
        now = time.perf_counter()
        if self._stack:
            outer, since = self._stack[-1]
            self.seconds[outer] += now - since
        self._stack.append((name, now))
        try:
            yield
        finally:
            now = time.perf_counter()
            _, since = self._stack.pop()
            self.seconds[name] += now - since
            if self._stack:
                self._stack[-1] = (self._stack[-1][0], now)

    def add(self, measured: Mapping[str, Any]) -> None:
        """Take in what another process's timeline measured (a spawned rank's `metrics()`): its
        phases come out of the phase running here, which keeps only the rest of its seconds,
        and its compiles add to this job's."""
        inside = {
            key[len("phase_") : -len("_s")]: value
            for key, value in measured.items()
            if key.startswith("phase_") and key.endswith("_s") and key != "phase_other_s"
        }
        if self._stack:
            name, since = self._stack[-1]
            now = time.perf_counter()
            self.seconds[name] += max(0.0, now - since - sum(inside.values()))
            self._stack[-1] = (name, now)
        for name, seconds in inside.items():
            self.seconds[name] += seconds
        self.compile_s += measured.get("compile_total_s", 0.0)
        self.compiles += measured.get("compiles", 0)
        self.recompiles.extend(["in a rank"] * measured.get("recompiles", 0))
        self._hits_before -= measured.get("compile_cache_hits", 0)
        self._misses_before -= measured.get("compile_cache_misses", 0)

    def metrics(self) -> dict[str, Any]:
        """wall_s, phase_<name>_s (phases that took time; `other` the rest) and the compile
        counts, as of now."""
        wall = time.perf_counter() - self.start
        seconds = dict(self.seconds)
        for name, since in self._stack:  # phases still open count up to now
            seconds[name] = seconds.get(name, 0.0) + time.perf_counter() - since
        seconds["other"] = max(0.0, wall - sum(v for k, v in seconds.items() if k != "other"))
        hits, misses = _cache_counts()
        out: dict[str, Any] = {"wall_s": round(wall, 3)}
        out.update({f"phase_{k}_s": round(v, 3) for k, v in seconds.items() if v >= 0.0005})
        out.update(
            compile_total_s=round(self.compile_s, 3),
            compiles=self.compiles,
            recompiles=len(self.recompiles),
            compile_cache_hits=hits - self._hits_before,
            compile_cache_misses=misses - self._misses_before,
            bytecode_kept=bytecode_kept(sys.modules.get("torch")),
        )
        return out


def bytecode_kept(module: Any) -> bool:
    """Whether the next process finds `module`'s compiled bytecode: written where it is missing,
    or there (beside its source, or under PYTHONPYCACHEPREFIX, as importlib looks for it)."""
    cached = getattr(getattr(module, "__spec__", None), "cached", None)
    return not sys.dont_write_bytecode or not cached or os.path.exists(cached)


_current: Timeline | None = None


def begin(start: float | None = None) -> Timeline:
    """Start the timeline of a job (this process's current one from now on)."""
    global _current
    _watch_compiles()
    _current = Timeline(start)
    return _current


def current() -> Timeline | None:
    return _current


def end() -> None:
    global _current
    _current = None


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Time the block as phase `name` of the current job; nothing where no job runs."""
    if _current is None:
        yield
        return
    with _current.phase(name):
        yield


def process_start() -> float | None:
    """When this process started, on time.perf_counter's clock (None where /proc cannot say):
    the first job of a process counts its interpreter's start, imports and Hydra's composition."""
    try:
        with open("/proc/self/stat") as f:
            started_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    age = uptime - started_ticks / os.sysconf("SC_CLK_TCK")
    return time.perf_counter() - max(0.0, age)


def largest(metrics: Mapping[str, Any], n: int = LARGEST) -> str:
    """`wall 23.4 s, most in first_call 12.1 s, baseline_sdpa_cudnn 3.2 s, tracker 2.0 s`, or
    "" when the metrics have no wall time."""
    wall = metrics.get("wall_s")
    if not isinstance(wall, int | float):
        return ""
    phases = {
        k[len("phase_") : -len("_s")]: v
        for k, v in metrics.items()
        if k.startswith("phase_") and k.endswith("_s") and isinstance(v, int | float)
    }
    top = sorted(phases.items(), key=lambda kv: -kv[1])[:n]
    where = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in top)
    line = f"wall {wall:.1f} s" + (f", most in {where}" if where else "")
    if metrics.get("recompiles") and metrics.get("device") != "cpu":  # see _on_compile_start
        line += f"; {metrics['recompiles']} recompiles (see the log)"
    if metrics.get("bytecode_kept") is False:
        line += (
            "; Python keeps no bytecode here (PYTHONDONTWRITEBYTECODE), so every run compiles "
            "torch's sources again: unset it (PYTHONPYCACHEPREFIX=<a writable folder> where "
            "site-packages is read-only)"
        )
    return line


# torch.compile's callbacks, registered once per process; they feed the current timeline.
_watching = False
_compile_started: list[float] = []
_reasons_seen: dict[Any, int] = {}


def _watch_compiles() -> None:
    global _watching
    if _watching:
        return
    try:
        from torch._dynamo.callback import callback_handler
    except ImportError:  # no torch.compile here: nothing to count
        return
    callback_handler.register_start_callback(_on_compile_start)
    callback_handler.register_end_callback(_on_compile_end)
    _watching = True


def _on_compile_start(args: Any = None) -> None:
    _compile_started.append(time.perf_counter())
    compile_id = str(getattr(args, "compile_id", ""))
    frame_compile = compile_id.rsplit("/", 1)[-1]
    # Dynamo compiling a frame again is a recompile; a backward compiled lazily at its first
    # call (another trigger, the same compile id) is part of that frame's compile.
    by_dynamo = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO") == "DYNAMO"
    if _current is not None and by_dynamo and frame_compile.isdigit() and int(frame_compile) > 0:
        reason = _new_guard_failure() or "no reason recorded"
        _current.recompiles.append(reason)
        # Eager flex on a CPU is traced anew for each shape or variant, in a fraction of a
        # second: said where CUDA runs (Inductor's compiles cost seconds), in the debug log else.
        level = logging.INFO if _cuda_in_use() else logging.DEBUG
        log.log(level, "torch.compile recompiles (%s): %s", compile_id, shortened(reason, 45))
        log.debug("torch.compile recompiles (%s), in full: %s", compile_id, reason)


def _cuda_in_use() -> bool:
    import sys

    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_initialized()


def _on_compile_end(args: Any = None) -> None:
    started = _compile_started.pop() if _compile_started else time.perf_counter()
    if _current is not None:
        _current.compile_s += time.perf_counter() - started
        _current.compiles += 1


def _new_guard_failure() -> str | None:
    """The guard failure Dynamo recorded last (why it compiles a function again), one line."""
    from torch._dynamo.utils import guard_failures

    newest = None
    for code, reasons in guard_failures.items():
        if len(reasons) > _reasons_seen.get(code, 0):
            newest = f"{getattr(code, 'co_name', code)}: {reasons[-1]}"
            _reasons_seen[code] = len(reasons)
    return None if newest is None else " ".join(str(newest).split())[:300]


def _cache_counts() -> tuple[int, int]:
    """(hits, misses) of Inductor's FX-graph cache and the AOTAutograd cache, process-wide."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return 0, 0
    inductor, aot = counters["inductor"], counters["aot_autograd"]
    hits = inductor["fxgraph_cache_hit"] + aot["autograd_cache_hit"]
    misses = inductor["fxgraph_cache_miss"] + aot["autograd_cache_miss"]
    return hits, misses
