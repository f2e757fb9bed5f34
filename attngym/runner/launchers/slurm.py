"""Sweep jobs as SLURM jobs: hydra-submitit-launcher's SlurmLauncher, shaped for attngym's runs.

`hydra/launcher=submitit_slurm` (conf/hydra/launcher/submitit_slurm.yaml) selects this class
(as hydra_plugins.attngym_launcher.SlurmLauncher), which the released plugin's schema
(SlurmQueueConf) configures, as it does the plugin's own.
What it adds, and why:

* **Resources follow the run.** Each job's own config says how many ranks it starts
  (`config.ranks_asked`) and whether it runs on GPUs (`device`; `auto` asks for GPUs where the
  partition's nodes have them, from `sinfo`). With `tasks_per_node: 0` (the default) every rank
  is a SLURM task (`topology.world_size / nodes` per node, so a CP job may span nodes; each task
  joins the run through attngym.distributed.ranks.launch.join_slurm_step); `tasks_per_node: 1` runs
  one task that spawns the ranks (one node). `gpus_per_node: null` asks one GPU per rank on the
  node, none for a CPU run; `cpus_per_task: null` asks CPUS_PER_RANK. Jobs that ask for the
  same resources go in one job array; a job whose resources cannot be asked (world size not
  dividing over the nodes) is a failed row naming the key.
* **Resume without spending SLURM jobs.** A job whose folder already holds an ok, complete run
  (`job.why_rerun`, the rule a job itself applies) is not submitted.
* **Every job ends as a row.** The jobs are watched with `squeue` (so a cluster without
  accounting, where sacct answers nothing, still ends); a job that ends without a result
  (cancelled, timed out, preempted, out of memory, a failed node, a task killed) is a failed
  row whose error is SLURM's state and the last line of the job's log, written into its
  folder's metrics.json, the measurements kept; the sweep goes on and its summary exits 1.
  Ranks of a job are stopped together when one of them fails (`srun --kill-on-bad-exit=1`).
  A job SLURM ended (its time limit, scancel, a failed node) is reported with SLURM's own
  state; a job COMPLETING with its result written has ended (a node whose slurmd died after the
  job leaves it COMPLETING for good), and one COMPLETING without a result for RESULT_GRACE_S
  too: no state leaves the sweep waiting.
* **SLURM's clock.** The signal submitit asks SLURM to send before the time limit
  (`signal_delay_s`) is a tenth of `timeout_min`, at most 120 s (`${signal_delay:...}` in
  conf/hydra/launcher/submitit_slurm.yaml, overrides.signal_delay): SLURM may send it up to a
  minute early, and a fixed 120 s ended a 3-minute job at once. A delay as long as the limit is
  used as 0, with a warning.
  On the node the signal is only logged: submitit's handler would raise inside whatever the run
  was doing (an UncompletedJobError blamed on the user's mask), and attngym's jobs are never
  requeued; the run goes on, and SLURM's SIGTERM at the limit stops it keeping what it measured
  (its row: `SLURM job N TIMEOUT`).
* **Interrupted.** SIGINT/SIGTERM while jobs run cancels the sweep's unfinished SLURM jobs,
  writes the summary so far and prints the command that resumes the sweep (exit 130/143), as a
  sweep on the local launcher does. On a compute node a job turns SLURM's SIGTERM (scancel, its
  time limit) into errors.Interrupted, so its metrics.json keeps what it measured.

Everything of submitit's (its folder, logs `%j_<task>_log.out/err`, pickles, job arrays) is as
the plugin makes it; the job runs through the plugin's own `__call__` on the node.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hydra.core.utils import JobReturn, JobStatus
from hydra_plugins.hydra_submitit_launcher import submitit_launcher
from omegaconf import DictConfig, OmegaConf, open_dict

from attngym.distributed.ranks.launch import ask_slurm
from attngym.errors import ConfigError, Interrupted
from attngym.runner.overrides import SIGNAL_DELAY_S, as_typed, launch_lines

log = logging.getLogger(__name__)

# CPUs a task asks for per rank it runs, when hydra.launcher.cpus_per_task is null: a GPU rank
# compiles kernels (Inductor's workers), a CPU rank computes.
CPUS_PER_RANK = {"gpu": 8, "cpu": 2}
# Seconds between two looks at the jobs' states (one squeue for every job of the sweep).
POLL_S = 3.0
# Seconds a job that SLURM says ended may take to show its result file (a shared file system).
RESULT_GRACE_S = 30.0
# SLURM job states after which a job runs no more (squeue --states=all); others are waiting.
# COMPLETING (its node cleaning up) ends a job whose result is written, else after RESULT_GRACE_S.
ENDED = {
    "BOOT_FAIL": "its node failed to boot",
    "CANCELLED": "cancelled (scancel, or an administrator)",
    "COMPLETED": "ended without a result",
    "COMPLETING": "ended on its node, which never confirmed it (its slurmd gone?)",
    "DEADLINE": "reached its deadline",
    "FAILED": "failed",
    "NODE_FAIL": "its node failed",
    "OUT_OF_MEMORY": "ran out of memory (hydra.launcher.mem_gb)",
    "PREEMPTED": "preempted by another job",
    "TIMEOUT": "reached its time limit (hydra.launcher.timeout_min)",
    "SPECIAL_EXIT": "held after failing (SLURM's SPECIAL_EXIT)",
    "REVOKED": "revoked (it ran on another cluster of a federation)",
    "GONE": "is no longer known to SLURM",
}
# The states whose job may still be writing its result (ENDED's "without a result" waits).
RESULT_DUE = ("COMPLETED", "COMPLETING", "GONE")


@dataclasses.dataclass
class Planned:
    """One sweep job before it is submitted."""

    num: int
    overrides: list[str]  # as Hydra received them
    run_dir: Path
    resources: dict[str, Any] | None = None  # submitit's parameters; None: not submitted
    error: str | None = None  # why it cannot be submitted
    line: str = ""  # what its launch line shows of its overrides (overrides.launch_lines)


class AttngymSlurmLauncher(submitit_launcher.SlurmLauncher):
    """hydra-submitit-launcher's SlurmLauncher with the module docstring's additions; Hydra
    takes it as hydra_plugins.attngym_launcher.SlurmLauncher (plugins live in that namespace)."""

    def __call__(self, *args: Any, **kwargs: Any) -> JobReturn:
        """The job, on its compute node: attngym's resolvers and signals, then the plugin's."""
        from attngym.runner.job import catch_interrupts
        from attngym.runner.overrides import expect_launcher_schema, register_resolvers

        register_resolvers()
        expect_launcher_schema()
        catch_interrupts()  # SLURM's SIGTERM (scancel, time limit) stops the run keeping its data
        _log_time_signal()
        return super().__call__(*args, **kwargs)

    def launch(
        self, job_overrides: Sequence[Sequence[str]], initial_job_idx: int
    ) -> Sequence[JobReturn]:
        """Plan every job, submit those that must run, wait for all; a JobReturn per job."""
        from attngym.runner.job import why_rerun

        assert self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        planned = [
            self._plan(list(overrides), initial_job_idx + i)
            for i, overrides in enumerate(job_overrides)
        ]
        returns: dict[int, JobReturn] = {}
        todo: list[Planned] = []
        shared, lines = launch_lines([job.overrides for job in planned])
        if shared:
            log.info("%d jobs, each with:\n%s", len(planned), shared)
        for job, line in zip(planned, lines, strict=True):
            job.line = line
            if why_rerun(job.run_dir, [as_typed(o) for o in job.overrides]) is None:
                log.info("\t#%d : %s: already ok, not submitted", job.num, line)
                returns[job.num] = _returned(job)
            elif job.error is not None:
                log.error("\t#%d : %s: not submitted: %s", job.num, line, job.error)
                record_failure(job, job.error)
                returns[job.num] = _returned(job)
            else:
                todo.append(job)
        submitted = self._submit(todo, returns)
        try:
            returns.update(self._wait(submitted))
        except Interrupted as stop:
            self._stop(submitted, returns, stop, sweep_dir)
        return [returns[job.num] for job in planned]

    # ----------------------------------------------------------------------------------------
    # Planning

    def _plan(self, overrides: list[str], num: int) -> Planned:
        """The job's folder and resources, from its own config as Hydra composes it for the job."""
        assert self.hydra_context is not None and self.config is not None
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        job = Planned(num=num, overrides=overrides, run_dir=sweep_dir / str(num))
        try:
            config = self.hydra_context.config_loader.load_sweep_config(self.config, overrides)
            with open_dict(config.hydra.job):
                config.hydra.job.num = num
            job.run_dir = Path(str(config.hydra.sweep.dir)) / str(config.hydra.sweep.subdir)
            job.resources = self._resources(config)
        except ConfigError as err:
            job.error = str(err)
        except Exception as err:  # a job Hydra cannot compose fails alone, as it would on a node
            job.error = f"{type(err).__name__}: {_last_line(str(err))}"
        return job

    def _resources(self, config: DictConfig) -> dict[str, Any]:
        """submitit's parameters for one job: the launcher's, with the ranks' tasks, GPUs and
        CPUs filled in where they are left to the run (module docstring)."""
        from attngym.runner.config import ranks_asked

        params = dict(self.params)
        params["signal_delay_s"] = _usable_delay(params["signal_delay_s"], params["timeout_min"])
        nodes, per_node = int(params["nodes"]), int(params["tasks_per_node"])
        device = str(OmegaConf.select(config, "device.name", default="auto"))
        partition_gpus = _sinfo_gpus(params.get("partition"))
        asked = params.get("gpus_per_node")
        on_gpu = device == "cuda" or bool(asked) or (device == "auto" and partition_gpus > 0)
        topology = OmegaConf.to_container(config.topology, resolve=True)
        ranks = ranks_asked(topology, (asked or partition_gpus) * nodes if on_gpu else 0)
        if per_node == 0:  # one task per rank
            if ranks % nodes:
                raise ConfigError(
                    "hydra.launcher.nodes",
                    f"{nodes} nodes cannot share the run's {ranks} ranks evenly "
                    "(topology.world_size); choose a divisor of it",
                )
            per_node = ranks // nodes
        elif per_node * nodes != ranks and not (per_node == 1 and nodes == 1):
            raise ConfigError(
                "hydra.launcher.tasks_per_node",
                f"{per_node} tasks on each of {nodes} nodes for a run of {ranks} ranks; use 0 "
                "(one task per rank), or 1 on one node (one task that spawns the ranks)",
            )
        per_task = ranks // (per_node * nodes)  # ranks a task runs: 1, or all of them (spawned)
        if on_gpu and asked is None and params.get("gres") is None:
            params["gpus_per_node"] = per_node * per_task
        if params.get("cpus_per_task") is None:
            params["cpus_per_task"] = CPUS_PER_RANK["gpu" if on_gpu else "cpu"] * per_task
        params["tasks_per_node"] = per_node
        if per_node * nodes > 1:  # a rank that fails ends its peers at once
            params["srun_args"] = ["--kill-on-bad-exit=1"]
        return params

    # ----------------------------------------------------------------------------------------
    # Submitting and waiting

    def _submit(self, todo: list[Planned], returns: dict[int, JobReturn]) -> dict[int, Any]:
        """One job array per set of resources; {job num: submitit Job}. A refused submission
        (sbatch's error) makes each of its jobs a failed row."""
        import submitit
        from hydra.core.singleton import Singleton

        groups: dict[str, list[Planned]] = {}
        for job in todo:
            groups.setdefault(repr(sorted(job.resources.items())), []).append(job)
        submitted: dict[int, Any] = {}
        for jobs in groups.values():
            params = dict(jobs[0].resources)
            folder = params.pop("submitit_folder")
            executor = submitit.AutoExecutor(
                folder=folder,
                cluster="slurm",
                slurm_max_num_timeout=params.pop("max_num_timeout"),
            )
            base = set(OmegaConf.structured(submitit_launcher.BaseQueueConf).keys())
            executor.update_parameters(
                **{k if k in base else f"slurm_{k}": v for k, v in params.items()}
            )
            args = [
                (
                    j.overrides,
                    "hydra.sweep.dir",
                    j.num,
                    f"job_id_for_{j.num}",
                    Singleton.get_state(),
                )
                for j in jobs
            ]
            try:
                array = executor.map_array(self, *zip(*args, strict=True))
            except Exception as err:  # sbatch refused: its own words
                reason = f"sbatch refused the job: {_last_line(str(err))}"
                for job in jobs:
                    record_failure(job, reason)
                    returns[job.num] = _returned(job)
                log.error("%s", reason)
                continue
            for job, sjob in zip(jobs, array, strict=True):
                log.info("\t#%d : %s (SLURM job %s)", job.num, job.line, sjob.job_id)
                submitted[job.num] = (job, sjob)
            log.info(
                "submitted %d SLURM job(s): %s; logs in %s",
                len(jobs),
                ", ".join(f"{k}={params.get(k)}" for k in ASKED),
                Path(str(folder).replace("%j", "<job id>")),
            )
        return submitted

    def _wait(self, submitted: dict[int, Any]) -> dict[int, JobReturn]:
        """Each submitted job's JobReturn once SLURM says it ended (module docstring)."""
        returns: dict[int, JobReturn] = {}
        pending = dict(submitted)
        ended_at: dict[int, float] = {}
        while pending:
            states = _squeue([sjob.job_id for _, sjob in pending.values()])
            for num, (job, sjob) in list(pending.items()):
                state = None if states is None else states.get(sjob.job_id, "GONE")
                if state not in ENDED:
                    continue
                waited = time.monotonic() - ended_at.setdefault(num, time.monotonic())
                result_due = state in RESULT_DUE and not _has_results(sjob)
                if result_due and waited < RESULT_GRACE_S:
                    continue  # its result file may still be on its way (a shared file system)
                returns[num] = _outcome(job, sjob, state)
                del pending[num]
            if pending:
                time.sleep(POLL_S)
        return returns

    def _stop(
        self,
        submitted: dict[int, Any],
        returns: dict[int, JobReturn],
        stop: Interrupted,
        sweep_dir: Path,
    ) -> None:
        """SIGINT/SIGTERM while jobs run: cancel the unfinished ones, record them, write the
        summary so far, say how to resume; exit 128 + signal."""
        from attngym.runner.job import ignore_interrupts
        from attngym.runner.tracking.sweep import report_stopped

        ignore_interrupts()  # a second Ctrl-C must not cut the cancelling and the summary short
        cancelled = 0
        for num, (job, sjob) in submitted.items():
            if num in returns:
                continue
            if not _has_results(sjob):
                try:
                    sjob.cancel(check=False)
                except Exception as err:  # best effort: it may have ended meanwhile
                    log.warning("could not cancel SLURM job %s: %s", sjob.job_id, err)
                cancelled += 1
                record_failure(job, f"{stop}: the sweep cancelled its SLURM job", "interrupted")
        log.warning("cancelled %d unfinished SLURM job(s)", cancelled)
        report_stopped(sweep_dir, stop)


@functools.cache  # one warning a sweep
def _usable_delay(delay_s: Any, timeout_min: Any) -> int:
    """signal_delay_s as asked, or 0 (a warning) when it is as long as the job's limit: SLURM
    would send the signal as the job starts."""
    delay_s, limit_s = int(delay_s), int(float(timeout_min) * 60)
    if delay_s < limit_s:
        return delay_s
    log.warning(
        "hydra.launcher.signal_delay_s=%d is not shorter than timeout_min=%s (%d s): using 0 "
        "(leave it out: a tenth of timeout_min, at most %d s)",
        delay_s, timeout_min, limit_s, SIGNAL_DELAY_S,
    )  # fmt: skip
    return 0


def _log_time_signal() -> None:
    """On the node: submitit's signal before the time limit is logged, nothing more (module
    docstring, SLURM's clock)."""
    import signal

    import submitit

    def near_limit(signum: int, frame: Any) -> None:
        log.warning(
            "SLURM sent %s: the job's time limit is near (hydra.launcher.signal_delay_s before "
            "timeout_min); the run goes on, and SLURM's SIGTERM at the limit stops it keeping "
            "what it measured",
            signal.Signals(signum).name,
        )

    signal.signal(submitit.JobEnvironment._usr_sig(), near_limit)


# submitit parameters a job's log line names.
ASKED = ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task", "partition")


def _returned(job: Planned) -> JobReturn:
    """A JobReturn that Hydra's sweeper reads without raising: the job's outcome is in its
    folder, and the sweep summary judges it."""
    return JobReturn(overrides=job.overrides, status=JobStatus.COMPLETED)


def _outcome(job: Planned, sjob: Any, state: str) -> JobReturn:
    """The JobReturn of a job SLURM ended: its own when it left one (a failed one recorded as a
    row), else a failed row whose error is SLURM's state and the log's last line."""
    try:
        if not _has_results(sjob):  # never ask submitit to wait: without accounting it never ends
            raise RuntimeError("no result")
        ret = sjob.task(0).results()[0]  # rank 0's, which holds the run's metrics
    except Exception as err:  # no result (killed), or the job raised outside attngym's run
        reason = f"SLURM job {sjob.job_id} {state}: {ENDED[state]}"
        last = _last_line(_tail(sjob)) or _last_line(str(err))
        record_failure(job, f"{reason}; {last}" if last else reason)
        return _returned(job)
    if isinstance(ret, JobReturn) and ret.status == JobStatus.FAILED:
        record_failure(job, f"{type(ret._return_value).__name__}: {ret._return_value}")
        return _returned(job)
    return ret


def record_failure(job: Planned, reason: str, status: str = "failed") -> None:
    """files.record_failure for a planned job (its folder and overrides)."""
    from attngym.runner.tracking.files import record_failure as record

    record(job.run_dir, job.overrides, reason, status)


def _squeue(job_ids: list[str]) -> dict[str, str] | None:
    """{job id: state} for these jobs, from one `squeue` (ended ones too, while slurmctld keeps
    them); None when squeue itself failed (nothing is concluded from that)."""
    parents = sorted({jid.split("_")[0] for jid in job_ids})
    try:
        out = ask_slurm(
            "squeue", "--noheader", "--array", "--states=all", "--format=%i %T",
            "--jobs", ",".join(parents),
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("squeue failed (%s); looking again in %g s", _last_line(str(err)), POLL_S)
        return None
    states = {}
    for line in out.splitlines():
        jid, _, state = line.strip().partition(" ")
        states[jid] = state.split()[0] if state else "UNKNOWN"
    return states


@functools.cache  # one sinfo a partition
def _sinfo_gpus(partition: str | None) -> int:
    """GPUs per node of `partition` (None: the default one), as `sinfo` states its nodes' gres
    (`gpu:8`, `gpu:h100:8(S:0-1)`); 0 when it has none or sinfo cannot tell (a warning)."""
    try:
        out = ask_slurm(
            "sinfo",
            "--noheader",
            "--format=%P %G",
            *([f"--partition={partition}"] * bool(partition)),
        )
    except (OSError, subprocess.SubprocessError) as err:
        log.warning("sinfo could not say whether the partition has GPUs (%s): asking none", err)
        return 0
    counts = [0]
    for line in out.splitlines():
        name, _, gres = line.strip().partition(" ")
        if partition is None and not name.endswith("*"):  # the default partition is starred
            continue
        for item in gres.split(","):
            fields = item.split("(")[0].split(":")
            if fields[0] == "gpu" and fields[-1].isdigit():
                counts.append(int(fields[-1]))
    return max(counts)


def _has_results(sjob: Any) -> bool:
    """Whether the job's task 0 (rank 0) left its result file."""
    return Path(sjob.task(0).paths.result_pickle).exists()


def _tail(sjob: Any) -> str:
    """The end of the job's stderr log (task 0), where attngym prints its one-line errors."""
    try:
        with open(sjob.paths.stderr, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - 8192))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""
