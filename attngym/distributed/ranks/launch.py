"""Run a function on every rank: spawn local ranks, or join the environment torchrun set up.

Contract:
    * Spawned (no RANK/WORLD_SIZE/LOCAL_RANK in the environment): `world_size` processes are
      started with torch.multiprocessing (start method "spawn"); each sets its environment
      (MASTER_ADDR/PORT on a free local port, RANK, WORLD_SIZE, LOCAL_RANK, and NCCL_NVLS_ENABLE=0,
      TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1), picks its GPU, creates the
      process group (gloo on CPU, "cpu:gloo,cuda:nccl" on CUDA, timeout `timeout_s`), runs
      `fn(rank, world_size, *args)`, waits for every rank (rank 0 hosts the group's store) and
      destroys the group. Rank 0's return value comes back to the
      caller (pickled through a private temporary directory).
    * Failure: the caller gets RankFailure saying which rank failed and how (exit code, signal,
      the exception and its traceback, or "made no progress"); a ConfigError raised on a rank is
      re-raised as itself. Once one rank has failed the others get GRACE_S to exit, then SIGTERM,
      GRACE_S more, then SIGKILL (not torch's default 30 s per step).
    * Every wait is bounded by `timeout_s`, enforced by the caller, not by the ranks: a rank whose
      peers wait on it may itself be unable to time out (stopped with SIGSTOP, wedged in native
      code holding the GIL), and its peers may legitimately wait longer than `timeout_s` (for
      rank 0's float64 reference; attngym.distributed.ranks.keepalive bounds each of those waits).
      So each rank runs a daemon heartbeat thread that touches `alive<rank>` in the private
      directory every HEARTBEAT_S; the caller polls the ranks and, as soon as one rank's heartbeat
      is older than `timeout_s` (or the rank never beat within `timeout_s` + STARTUP_S of the
      launch), it kills every rank and raises RankFailure naming that rank ("is stopped" when /proc
      says so, else "made no progress"). A run with a stopped or hung rank thus fails within
      `timeout_s` plus a few seconds. A rank that is alive but blocked in a collective fails on its
      own process-group timeout (`timeout_s`), and the caller then stops the others as above.
    * No orphans: each spawned rank leads its own process group (setpgid), so whenever `launch`
      returns or raises (a rank failure, a stalled rank, KeyboardInterrupt, an unreadable result),
      every rank still alive is terminated (SIGKILL at once for a stopped one), given GRACE_S, then
      killed, and the process group of every rank is killed too: the children a rank started
      (compile workers, probes) go with it. A rank also dies with its parent (Linux parent-death
      signal), and tears down its transports and process group in a `finally`, whatever `fn` did;
      a rank that finished then exits at once, without the interpreter's teardown.
      Being in its own process group, a rank does not get the terminal's Ctrl-C: the caller does,
      and stops the ranks. Until it leads its group (its interpreter's start, seconds) it is in
      the caller's, so the caller starts it with SIGINT blocked, and the rank drops one that came
      meanwhile: a Ctrl-C then printed a rank's half traceback.
    * SLURM tasks: in a job step of several tasks (`srun`, or submitit with tasks_per_node > 1),
      `join_slurm_step` gives each task torchrun's variables from SLURM's (SLURM_PROCID,
      SLURM_STEP_NUM_TASKS, SLURM_LOCALID, the first host of SLURM_STEP_NODELIST as the
      rendezvous host), so a task is one rank exactly as under torchrun; a step of one task spawns
      its ranks.
    * In this process (`in_process=True`, a world of one, no process group yet): `fn` runs here
      in a group of one on an in-memory store, destroyed after it with its transports; no
      heartbeat and no rank0.log (its records are this process's). Its interpreter, imports and
      CUDA context are the caller's: a CP job at world size 1 starts in a second, not several.
    * torchrun (RANK, WORLD_SIZE and LOCAL_RANK set, possibly several nodes): this process is one
      rank; it joins (or reuses) the default process group and returns its own `fn` result. A
      group it creates lives until the process exits (so a torchrun sweep runs every job in the
      same group). torchrun supervises the ranks; there is no heartbeat (torchrun's agent only
      sees ranks that exit, so a stopped rank there is bounded by the group timeouts alone).
    * Progress: rank 0 may call `report(measurements)` as it goes; a caller that passed a dict as
      `progress` finds the latest report there however `launch` ends (returns, raises, or is
      interrupted), so a run stopped part-way keeps what it measured.
    * Logs: with `run_dir`, every rank other than 0 writes `rank<N>.log` there, spawned or under
      torchrun; spawned rank 0 writes rank0.log too and speaks on stderr. A spawned rank is a fresh
      interpreter owned by this module, so it configures the root logger of that process. Under
      torchrun the process is the caller's: a rank other than 0 gets one extra root handler (its
      rank<N>.log) for the duration of `fn`, removed afterwards; nothing else of the caller's
      logging is touched.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import faulthandler
import logging
import os
import pathlib
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from attngym.errors import ConfigError, RankFailure
from attngym.fileio import log_file

log = logging.getLogger(__name__)

RANK_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}


# How often a spawned rank proves it runs; how long the caller polls between checks.
HEARTBEAT_S = 0.5
# Extra time a rank has to send its first heartbeat (interpreter start and `import torch`).
STARTUP_S = 60.0
# How long failing or stopping ranks get between SIGTERM and SIGKILL.
GRACE_S = 2.0


# Where `report` goes in this process: the private directory's progress file (spawned rank 0) or
# the caller's dict (torchrun rank 0); None elsewhere.
_REPORT_TO: str | dict | None = None
PROGRESS_FILE = "progress.pkl"


def report(measurements: Mapping[str, Any]) -> None:
    """Rank 0's measurements so far, for the caller's `progress` dict (module docstring); a no-op
    on other ranks and outside `launch`. Best effort: a failed write (a full disk) is logged and
    the run goes on."""
    if isinstance(_REPORT_TO, dict):
        _REPORT_TO.update(measurements)
    elif _REPORT_TO is not None:
        from attngym.fileio import atomic_write

        try:
            atomic_write(pathlib.Path(_REPORT_TO) / PROGRESS_FILE, pickle.dumps(dict(measurements)))
        except OSError as err:
            logging.getLogger(__name__).warning("could not keep the measurements so far: %s", err)


def _collect_progress(result_dir: str, progress: dict | None) -> None:
    path = pathlib.Path(result_dir) / PROGRESS_FILE
    if progress is not None and path.exists():
        with contextlib.suppress(OSError, pickle.UnpicklingError, EOFError):
            progress.update(pickle.loads(path.read_bytes()))


def under_torchrun() -> bool:
    """True when torchrun (or another elastic launcher, or `join_slurm_step`) set this process
    up as one rank."""
    return all(k in os.environ for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))


def join_slurm_step() -> bool:
    """In a SLURM job step of several tasks, set torchrun's rank variables from SLURM's.

    Each task of `srun -n N ...` (or of a submitit job with tasks_per_node > 1) is then one rank,
    read by everything that reads torchrun's: RANK = SLURM_PROCID, WORLD_SIZE =
    SLURM_STEP_NUM_TASKS, LOCAL_RANK = SLURM_LOCALID, LOCAL_WORLD_SIZE = this node's tasks,
    MASTER_ADDR = the step's first node, MASTER_PORT = a port derived from the job id (every task
    derives the same; a MASTER_PORT already set wins). Nothing happens under torchrun (RANK is
    set), outside a step (the batch script has no SLURM_STEP_NUM_TASKS) or in a step of one task,
    which spawns its ranks. Idempotent.

    Returns:
        True when this process is a rank of a SLURM step.

    Raises:
        RuntimeError: `scontrol show hostnames` cannot expand the step's node list.
    """
    env = os.environ
    tasks = slurm_step_tasks()
    if "RANK" in env or tasks < 2:
        return False
    hosts = _expand_nodelist(env.get("SLURM_STEP_NODELIST") or env["SLURM_JOB_NODELIST"])
    here = env.get("SLURMD_NODENAME", socket.gethostname())
    per_node = _tasks_per_node(env.get("SLURM_STEP_TASKS_PER_NODE", str(tasks)), len(hosts))
    env.update(
        RANK=env["SLURM_PROCID"],
        WORLD_SIZE=str(tasks),
        LOCAL_RANK=env["SLURM_LOCALID"],
        LOCAL_WORLD_SIZE=str(per_node[hosts.index(here)] if here in hosts else per_node[0]),
        MASTER_ADDR=hosts[0],
    )
    env.setdefault("MASTER_PORT", str(SLURM_PORTS[0] + int(env["SLURM_JOB_ID"]) % SLURM_PORTS[1]))
    return True


def slurm_step_tasks() -> int:
    """The number of tasks of the SLURM job step this process is in (1 outside a step: the batch
    script has no SLURM_STEP_NUM_TASKS)."""
    return int(os.environ.get("SLURM_STEP_NUM_TASKS", "1"))


def ask_slurm(*argv: str) -> str:
    """The output of a SLURM command (scontrol, squeue, sinfo); OSError or a SubprocessError
    when it fails or runs past a minute."""
    import subprocess

    return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=True).stdout


# MASTER_PORT of a SLURM step: the first port and how many follow it; the job id picks one.
SLURM_PORTS = (20000, 20000)


def _expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed node list (`gpu[01-04,07]`) as host names, by SLURM's own scontrol."""
    import subprocess

    try:
        out = ask_slurm("scontrol", "show", "hostnames", nodelist)
    except (OSError, subprocess.SubprocessError) as err:
        raise RuntimeError(
            f"could not expand the SLURM node list {nodelist!r} with `scontrol show hostnames` "
            f"for the rendezvous host: {err}"
        ) from None
    return out.split()


def _tasks_per_node(spec: str, nodes: int) -> list[int]:
    """SLURM's tasks per node (`2(x3),1`: 2 on each of 3 nodes, then 1) as one count a node."""
    counts: list[int] = []
    for part in spec.split(","):
        count, _, times = part.partition("(x")
        counts += [int(count)] * int(times.rstrip(")") or 1)
    return counts + [counts[-1]] * (nodes - len(counts))


def free_port() -> int:
    """A TCP port free on localhost right now (for MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _backend(device: str, local_world_size: int) -> str:
    """gloo on CPU; NCCL for CUDA tensors when every local rank has its own GPU.

    Several ranks on one GPU (TORCH_SYMM_MEM_ALLOW_OVERLAPPING_DEVICES=1, for testing the
    copy-engine protocol on one device) take gloo for CUDA tensors too: NCCL refuses two ranks on
    one device ("Duplicate GPU detected"), while symmetric memory only needs the group for its
    rendezvous.
    """
    if device != "cuda":
        return "gloo"
    import torch

    if local_world_size > torch.cuda.device_count():
        return "gloo"
    return "cpu:gloo,cuda:nccl"


def _set_device(device: str, local_rank: int) -> None:
    if device == "cuda":
        import torch

        torch.cuda.set_device(local_rank % torch.cuda.device_count())


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent dies (no orphan ranks)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        return
    if os.getppid() == 1:  # the parent is already gone
        os._exit(1)


def _lead_process_group() -> None:
    """Make this rank the leader of its own process group, so that the caller can kill the rank
    and every process it started at once (os.killpg)."""
    # Already a group leader, or not permitted: the rank itself is still killed.
    with contextlib.suppress(OSError):
        os.setpgid(0, 0)


# Signals a terminal's Ctrl-C sends to the whole foreground group: blocked while ranks start.
GROUP_SIGNALS = {signal.SIGINT}


def _take_signals() -> None:
    """In a rank leading its own group: drop the Ctrl-C that came while it started in the
    caller's group (blocked by `launch`; an ignored signal is discarded), then take it again."""
    handlers = {signum: signal.signal(signum, signal.SIG_IGN) for signum in GROUP_SIGNALS}
    signal.pthread_sigmask(signal.SIG_UNBLOCK, GROUP_SIGNALS)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def _start_heartbeat(path: pathlib.Path) -> None:
    """Touch `path` every HEARTBEAT_S from a daemon thread: the caller's proof that this rank runs.

    A stopped process, or one whose interpreter is wedged, stops beating; the caller then fails
    the run (see the module docstring).
    """

    def beat() -> None:
        while True:
            try:
                path.touch()
            except OSError:  # the caller removed the directory: the run is over
                return
            time.sleep(HEARTBEAT_S)

    path.touch()
    threading.Thread(target=beat, name="attngym-heartbeat", daemon=True).start()


def rank_formatter(rank: int) -> logging.Formatter:
    """The run's console format (conf/hydra/default.yaml, job_logging `simple`) with the rank, so
    a context-parallel run prints one format: `[12:00:00][rank0][INFO] message`."""
    return logging.Formatter(f"[%(asctime)s][rank{rank}][%(levelname)s] %(message)s", "%H:%M:%S")


def _log_to_files(rank: int, run_dir: str | None) -> None:
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    fmt = rank_formatter(rank)
    handlers: list[logging.Handler] = []
    if run_dir is not None:
        handlers.append(log_file(pathlib.Path(run_dir) / f"rank{rank}.log"))
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stderr))
    for h in handlers:
        h.setFormatter(fmt)
        root.addHandler(h)


def _rank_main(
    rank: int,
    fn: Callable[..., Any],
    world_size: int,
    device: str,
    timeout_s: float,
    run_dir: str | None,
    port: int,
    result_dir: str,
    args: tuple,
) -> None:
    _die_with_parent()
    _lead_process_group()
    _take_signals()
    # A rank killed by a fatal signal (an abort in a native library, say) prints every thread's
    # Python stack to its stderr: the caller names the rank, this says where it was.
    faulthandler.enable(all_threads=True)
    _start_heartbeat(pathlib.Path(result_dir) / f"alive{rank}")
    os.environ.update(RANK_ENV)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    _log_to_files(rank, run_dir)
    global _REPORT_TO
    _REPORT_TO = result_dir if rank == 0 else None
    import torch.distributed as dist

    from attngym.device import settle_cpu_math
    from attngym.distributed.transport import clear_cache

    settle_cpu_math()  # before the rank's first parallel CPU op (see its docstring)
    try:
        _set_device(device, rank)
        dist.init_process_group(
            _backend(device, world_size),
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=timeout_s),
        )
        result = fn(rank, world_size, *args)
        if rank == 0:
            with open(pathlib.Path(result_dir) / "result.pkl", "wb") as f:
                pickle.dump(result, f)
        # Rank 0 hosts the group's store: a rank done first waits for the rest, so no rank loses
        # the store while it still talks to it (a subgroup made late, a last collective).
        dist.barrier()
    except BaseException as e:
        logging.getLogger(__name__).exception("rank %d failed", rank)
        if isinstance(e, ConfigError):  # (key, message): the caller re-raises it as itself
            message = str(e).removeprefix(f"{e.key}: ")
            with open(pathlib.Path(result_dir) / f"config_error{rank}.pkl", "wb") as f:
                pickle.dump((e.key, message), f)
        raise
    finally:
        clear_cache()
        if dist.is_initialized():
            dist.destroy_process_group()
    _exit_finished()


@contextlib.contextmanager
def _script_not_rerun(fn: Callable[..., Any], args: Sequence[Any]) -> Iterator[None]:
    """Start ranks without running the caller's script again in each of them.

    The start method "spawn" re-runs the main script (as `__mp_main__`) in every new process so
    that functions defined there can be unpickled: a script calling `attngym.run(...)` without
    `if __name__ == "__main__":` would run its whole self once more per rank. When neither `fn`
    nor an argument comes from `__main__` (attngym's own tasks: the variant travels by import
    path), the ranks need nothing of it, and the script's path is hidden from multiprocessing
    while they start. A notebook has no script: nothing to hide.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    from_main = [x for x in (fn, *args) if getattr(x, "__module__", None) == "__main__"]
    if main is None or path is None or from_main or getattr(main, "__spec__", None) is not None:
        yield  # `python -m pkg` (a __spec__): multiprocessing re-imports the module, not a script
        return
    del main.__file__
    try:
        yield
    finally:
        main.__file__ = path


def _exit_finished() -> None:
    """End a rank that finished, skipping the interpreter's teardown: a native thread of a
    library still joinable when the process tears down aborts it ("terminate called without an
    active exception", SIGABRT), which would fail a run whose every result is in."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def launch(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple = (),
    device: str = "cpu",
    timeout_s: float = 120.0,
    run_dir: str | os.PathLike | None = None,
    progress: dict | None = None,
    in_process: bool = False,
) -> Any:
    """Run `fn(rank, world_size, *args)` on `world_size` ranks and return rank 0's result.

    Args:
        fn: a module-level (picklable) function; it runs with the process group initialised.
        world_size: number of ranks (under torchrun it must equal WORLD_SIZE).
        args: extra picklable arguments.
        device: "cpu" (gloo) or "cuda" (NCCL, one GPU per local rank, modulo the GPU count).
        timeout_s: process-group timeout (a rank waiting longer on a peer fails), and the
            longest a spawned rank may go without a heartbeat before the caller stops the run.
        run_dir: where ranks write rank<N>.log (None: no files); see the module docstring.
        progress: updated with rank 0's latest `report`, however the launch ends.
        in_process: a world of one runs in this process (`_run_here`) where it has no process
            group yet: no interpreter to start, no imports or CUDA context again (seconds), no
            heartbeat (a hang is this process's, as a one-device run's); else spawned as usual.

    Returns:
        Rank 0's return value (spawned), or this rank's return value (torchrun).

    Raises:
        ConfigError: a ConfigError raised on a rank, or a world size torchrun disagrees with.
        RankFailure: a rank died (exit code or signal), raised, or made no progress for
            timeout_s (stopped or hung); the message names it.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ConfigError("topology.world_size", f"must be a positive integer, got {world_size!r}")
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device must be 'cpu' or 'cuda', got {device!r}")
    if join_slurm_step() or under_torchrun():
        return _join_torchrun(
            fn,
            world_size,
            args=args,
            device=device,
            timeout_s=timeout_s,
            run_dir=run_dir,
            progress=progress,
        )
    if in_process and world_size == 1 and not _has_group():
        return _run_here(fn, args=args, device=device, timeout_s=timeout_s, progress=progress)
    from multiprocessing import resource_tracker

    import torch.multiprocessing as mp

    result_dir = tempfile.mkdtemp(prefix="attngym-launch-")
    ctx = None
    try:
        started = time.monotonic()
        # Blocked in this thread while the ranks start, so they start with them blocked
        # (_take_signals); a Ctrl-C meanwhile is delivered here once they are unblocked. The
        # spawn's resource tracker first: starting it unblocks SIGINT and SIGTERM.
        resource_tracker.ensure_running()
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, GROUP_SIGNALS)
        try:
            with _script_not_rerun(fn, args):
                ctx = mp.start_processes(
                    _rank_main,
                    args=(
                        fn,
                        world_size,
                        device,
                        float(timeout_s),
                        None if run_dir is None else str(run_dir),
                        free_port(),
                        result_dir,
                        tuple(args),
                    ),
                    nprocs=world_size,
                    join=False,
                    start_method="spawn",
                )
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        try:
            while not ctx.join(timeout=HEARTBEAT_S, grace_period=GRACE_S):
                _check_heartbeats(ctx.processes, result_dir, timeout_s, started)
        except mp.ProcessRaisedException as e:
            raise _rank_error(e.error_index, result_dir, f"raised an exception:\n{e}") from None
        except mp.ProcessExitedException as e:
            how = (
                f"was killed by {e.signal_name}"
                if e.signal_name
                else f"exited with code {e.exit_code}"
            )
            raise RankFailure(f"rank {e.error_index} {how}") from None
        with open(pathlib.Path(result_dir) / "result.pkl", "rb") as f:
            return pickle.load(f)
    finally:
        if ctx is not None:
            _stop(ctx.processes)
        _collect_progress(result_dir, progress)
        shutil.rmtree(result_dir, ignore_errors=True)


def _check_heartbeats(processes, result_dir: str, timeout_s: float, started: float) -> None:
    """RankFailure for the first live rank whose heartbeat is older than timeout_s (or that has
    not beaten within timeout_s + STARTUP_S of the launch); see the module docstring."""
    now = time.time()
    for rank, p in enumerate(processes):
        if not p.is_alive():
            continue
        try:
            silent_s = now - (pathlib.Path(result_dir) / f"alive{rank}").stat().st_mtime
            limit_s = timeout_s
        except FileNotFoundError:
            silent_s = time.monotonic() - started
            limit_s = timeout_s + STARTUP_S
        if silent_s > limit_s:
            how = "is stopped (SIGSTOP)" if _state(p.pid) in ("T", "t") else "made no progress"
            raise RankFailure(
                f"rank {rank} {how} for {silent_s:.0f} s, more than topology.timeout_s="
                f"{timeout_s:g}; every rank was killed"
            )


def _state(pid: int) -> str:
    """The process state letter from /proc (R, S, T, Z, ...); "" when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stop(processes, grace_s: float = GRACE_S) -> None:
    """Stop every rank and whatever it started: SIGKILL at once for a stopped rank (it cannot
    handle SIGTERM), SIGTERM for the others, grace_s, then SIGKILL; then kill each rank's process
    group (its children)."""
    import signal

    alive = [p for p in processes if p.is_alive()]
    for p in alive:
        if _state(p.pid) in ("T", "t"):
            p.kill()
        else:
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in alive:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in alive:
        if p.is_alive():
            p.kill()
            p.join()
    for p in processes:
        if p.pid is None:
            continue
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, signal.SIGKILL)  # the rank led this group (_lead_process_group)


def _rank_error(rank: int, result_dir: str, text: str) -> Exception:
    path = pathlib.Path(result_dir) / f"config_error{rank}.pkl"
    if path.exists():
        with open(path, "rb") as f:
            key, message = pickle.load(f)
        return ConfigError(key, message)
    return RankFailure(f"rank {rank} {text}")


def _join_torchrun(
    fn: Callable[..., Any],
    world_size: int,
    *,
    args: tuple,
    device: str,
    timeout_s: float,
    run_dir: str | os.PathLike | None = None,
    progress: dict | None = None,
) -> Any:
    import torch.distributed as dist

    global _REPORT_TO
    env_world = int(os.environ["WORLD_SIZE"])
    if env_world != world_size:
        raise ConfigError(
            "topology.world_size",
            f"{world_size} does not match torchrun's WORLD_SIZE={env_world}; set them equal",
        )
    os.environ.update(RANK_ENV)  # before NCCL or symmetric memory initialise in this process
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    _set_device(device, local_rank)
    if not dist.is_initialized():
        # Kept for the life of the process: a torchrun sweep runs its jobs in the same ranks, and
        # re-creating groups between jobs races with peers still finishing the previous job.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        dist.init_process_group(
            _backend(device, local), timeout=datetime.timedelta(seconds=timeout_s)
        )
        atexit.register(_destroy_group)
    handler = None
    path = None if run_dir is None else pathlib.Path(run_dir) / f"rank{rank}.log"
    if path is not None and rank != 0 and not _logs_to(path):  # rank 0's log is the caller's
        handler = log_file(path)
        handler.setFormatter(rank_formatter(rank))
        logging.getLogger().addHandler(handler)
    before, _REPORT_TO = _REPORT_TO, (progress if rank == 0 else None)
    try:
        return fn(rank, world_size, *args)
    finally:
        _REPORT_TO = before
        if handler is not None:
            logging.getLogger().removeHandler(handler)
            handler.close()


def _has_group() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized()


def _run_here(
    fn: Callable[..., Any], *, args: tuple, device: str, timeout_s: float, progress: dict | None
) -> Any:
    """A world of one in this process: its group (on an in-memory store) made for `fn` and
    destroyed after it, with its transports; rank 0's reports go to `progress`."""
    import torch.distributed as dist

    from attngym.distributed.transport import clear_cache

    global _REPORT_TO
    os.environ.update(RANK_ENV)  # before NCCL or symmetric memory initialise in this process
    _set_device(device, 0)
    dist.init_process_group(
        _backend(device, 1), store=dist.HashStore(), rank=0, world_size=1,
        timeout=datetime.timedelta(seconds=timeout_s),
    )  # fmt: skip
    before, _REPORT_TO = _REPORT_TO, progress
    try:
        return fn(0, 1, *args)
    finally:
        _REPORT_TO = before
        clear_cache()
        dist.destroy_process_group()


def _logs_to(path: pathlib.Path) -> bool:
    """Whether the root or the attngym logger already writes to `path` (the CLI's rank log)."""
    handlers = logging.getLogger().handlers + logging.getLogger("attngym").handlers
    target = str(path.resolve())
    return any(getattr(h, "baseFilename", None) == target for h in handlers)


def _destroy_group() -> None:
    """At exit of a torchrun rank: drop the cached transports, then the groups."""
    import torch.distributed as dist

    from attngym.distributed.transport import clear_cache

    clear_cache()
    if dist.is_initialized():
        dist.destroy_process_group()
