"""Sweeps and context-parallel jobs on a real SLURM cluster, as docs/clusters.md runs them.

The cluster (tests/slurm/cluster.py) has two nodes on this machine and no accounting; its
partition is called `debug`, as in docs/clusters.md, whose commands run here as pasted. CPU runs,
float32: the CP jobs validate against the float64 reference like any run (metrics.json's
`validation`).
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time

import pytest

from .conftest import mask_module, readme_block

pytestmark = pytest.mark.slurm

SMALL = "shape.heads=2 logger=local"  # a few seconds a job on a 2-core machine


def metrics(folder) -> dict:
    return json.loads((folder / "metrics.json").read_text())


def rows(sweep) -> list[dict]:
    import csv

    with open(sweep / "summary.csv", newline="") as f:
        return list(csv.DictReader(f))


def submitted(slurm) -> int:
    return len(slurm.jobs())


def test_readme_sweep_runs_to_its_summary_and_resumes_without_submitting(slurm, user_shell):
    sweep_cmd, ring_cmd = [
        line for line in readme_block("# slurm:").splitlines() if line.startswith("attngym")
    ]
    sweep = user_shell.cwd / "multirun" / "readme"
    proc = user_shell(f"{sweep_cmd} {SMALL} hydra.sweep.dir={sweep}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert [r["status"] for r in rows(sweep)] == ["ok", "ok"]
    assert {r["seq_len"] for r in rows(sweep)} == {"512", "1024"}
    assert "2 jobs, 0 failed" in proc.stdout  # the summary, printed when the sweep ends
    assert "sweep jobs: 2/2 done" in out  # progress counted the jobs that ended on the nodes
    assert f"hydra.sweep.dir={sweep}" in out  # the command that resumes it
    # A CPU run asks for no GPU: the jobs' sbatch scripts say what they asked for.
    scripts = "".join(p.read_text() for p in sweep.glob(".submitit/*/*_submission.sh"))
    assert "--gpus-per-node" not in scripts and "--cpus-per-task=2" in scripts
    # Running it again resumes: both jobs are ok, so nothing is submitted.
    before = submitted(slurm)
    again = user_shell(f"{sweep_cmd} {SMALL} hydra.sweep.dir={sweep}")
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert submitted(slurm) == before
    assert (again.stdout + again.stderr).count("already ok, not submitted") == 2

    # docs/clusters.md's CP line: one job of two SLURM tasks, one rank each, validated.
    cp = user_shell.cwd / "multirun" / "ring"
    proc = user_shell(f"{ring_cmd} {SMALL} shape.seq_len=512 hydra.sweep.dir={cp}")
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    job = metrics(cp / "0")
    assert (job["status"], job["validation"], job["world_size"]) == ("ok", "ok", 2)
    assert job["bwd_status"] == "ok" and job["err_dq_rel"] < 1e-4  # float32 against float64
    assert "rank 1 of 2" in (cp / "0" / "rank1.log").read_text()
    (script,) = cp.glob(".submitit/*/*_submission.sh")
    assert "--ntasks-per-node=2" in script.read_text()
    assert "--kill-on-bad-exit=1" in script.read_text()
    logs = list(cp.glob(".submitit/*/*_1_log.err"))
    assert logs, "task 1 has a log of its own"


@pytest.mark.parametrize(
    ("overrides", "asked"),
    [
        # One task per rank, one rank on each of two nodes.
        ("hydra.launcher.nodes=2 topology=allgather", ("--nodes=2", "--ntasks-per-node=1")),
        # One task that spawns its two ranks, as before SLURM tasks were ranks.
        (
            "hydra.launcher.tasks_per_node=1 topology=ring",
            ("--ntasks-per-node=1", "--cpus-per-task=4"),
        ),
    ],
    ids=["two_nodes", "one_task_spawns"],
)
def test_cp_job_spans_nodes_or_spawns_from_one_task(user_shell, overrides, asked):
    sweep = user_shell.cwd / "multirun" / "cp"
    proc = user_shell(
        f"attngym -m hydra/launcher=submitit_slurm {overrides} topology.world_size=2 {SMALL} "
        f"shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    job = metrics(sweep / "0")
    assert (job["status"], job["validation"], job["world_size"]) == ("ok", "ok", 2)
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    assert all(flag in script.read_text() for flag in asked), script.read_text()


def test_cancelled_job_is_a_failed_row_with_slurms_state(slurm, user_shell):
    # At import: the job is cancelled while it waits there.
    mask_module(user_shell.cwd, "slowmask", "import time\ntime.sleep(600)")
    mask_module(user_shell.cwd, "fastmask")
    sweep = user_shell.cwd / "multirun" / "cancel"
    command = (
        "attngym -m hydra/launcher=submitit_slurm attention=custom "
        f"attention.mask_mod=slowmask.mask,fastmask.mask {SMALL} "
        f"shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    sweeping = user_shell.start(command)
    slow = _running_job(slurm, sweep, 0)  # slowmask.mask, first in the sweep
    started = time.monotonic()
    slurm.run("scancel", slow)
    out, _ = sweeping.communicate(timeout=120)
    assert time.monotonic() - started < 60  # noticed within a few polls, not after a timeout
    assert sweeping.returncode == 1, out[-3000:]
    by_job = {r["job"]: r for r in rows(sweep)}
    assert by_job["1"]["status"] == "ok"  # the other job is untouched
    assert by_job["0"]["status"] == "failed"
    assert by_job["0"]["error"].startswith(f"SLURM job {slow} CANCELLED")
    assert "1 of 2 sweep jobs failed" in out and f"hydra.sweep.dir={sweep}" in out


def test_interrupted_sweep_cancels_its_jobs_and_says_how_to_resume(slurm, user_shell):
    mask_module(user_shell.cwd, "slowmask", "import time\ntime.sleep(600)")
    sweep = user_shell.cwd / "multirun" / "interrupted"
    sweeping = subprocess.Popen(
        [
            "attngym",
            "-m",
            "hydra/launcher=submitit_slurm",
            "attention=custom",
            "attention.mask_mod=slowmask.mask",
            *SMALL.split(),
            f"hydra.sweep.dir={sweep}",
        ],
        cwd=user_shell.cwd,
        env=user_shell.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    job = _running_job(slurm, sweep, 0)
    sweeping.send_signal(signal.SIGINT)  # Ctrl-C
    out, _ = sweeping.communicate(timeout=60)
    assert sweeping.returncode == 130, out[-3000:]
    assert "cancelled 1 unfinished SLURM job" in out
    assert "resume with: attngym -m hydra/launcher=submitit_slurm" in out
    assert (sweep / "summary.csv").is_file()
    deadline = time.monotonic() + 30
    while dict(slurm.jobs()).get(job) not in ("CANCELLED", "COMPLETED", "FAILED"):
        assert time.monotonic() < deadline, slurm.jobs()
        time.sleep(0.5)


def test_a_killed_rank_ends_its_job_in_bounded_time(slurm, user_shell):
    mask_module(
        user_shell.cwd,
        "killrank",
        "import os, signal\n"
        "if os.environ.get('RANK') == '1':\n    os.kill(os.getpid(), signal.SIGKILL)",
    )
    sweep = user_shell.cwd / "multirun" / "killed"
    started = time.monotonic()
    proc = user_shell(
        "attngym -m hydra/launcher=submitit_slurm topology=ring topology.world_size=2 "
        f"attention=custom attention.mask_mod=killrank.mask topology.timeout_s=600 {SMALL} "
        f"shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    assert time.monotonic() - started < 120  # srun ends rank 0 at once, not after 600 s
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    (row,) = rows(sweep)
    assert row["status"] == "failed" and row["error"].startswith("SLURM job ")


def test_resources_slurm_refuses_are_a_failed_row_naming_sbatchs_error(user_shell):
    sweep = user_shell.cwd / "multirun" / "gpu"
    proc = user_shell(
        f"attngym -m hydra/launcher=submitit_slurm device=cuda {SMALL} hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-3000:]
    (row,) = rows(sweep)
    assert row["status"] == "failed" and row["error"].startswith("sbatch refused the job:")
    assert "gres" in row["error"].lower()  # this cluster has no GPUs to give


def test_readme_sbatch_script_runs_one_cp_run_as_slurm_tasks(slurm, user_shell):
    script = readme_block("# job.sh").replace(
        "--ntasks-per-node=8 --gpus-per-node=8 --cpus-per-task=8",
        "--ntasks-per-node=1 --cpus-per-task=2",  # what the script's comment says for CPU nodes
    )
    script = script.replace("shape.seq_len=131072", f"shape.seq_len=512 {SMALL}")
    (user_shell.cwd / "job.sh").write_text(script)
    proc = user_shell("sbatch --parsable --output=slurm-%j.out job.sh")
    job_id = proc.stdout.strip()
    deadline = time.monotonic() + 300  # sbatch --wait would look only every 30 s or so
    while (state := dict(slurm.jobs()).get(job_id)) in ("PENDING", "RUNNING", "COMPLETING"):
        assert time.monotonic() < deadline, slurm.jobs()
        time.sleep(0.5)
    log = (user_shell.cwd / f"slurm-{job_id}.out").read_text()
    assert state == "COMPLETED", proc.stdout + proc.stderr + log[-3000:]
    (run_dir,) = (user_shell.cwd / "outputs").glob(f"*/slurm-{job_id}.0")  # one folder, 2 tasks
    run = metrics(run_dir)
    assert (run["status"], run["validation"], run["world_size"]) == ("ok", "ok", 2)
    assert (run_dir / "rank1.log").is_file()


def test_readme_torchrun_two_nodes_runs_to_metrics(user_shell):
    (line,) = [
        line for line in readme_block("# torchrun:").splitlines() if line.startswith("torchrun")
    ]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = line.replace("HOST:29500", f"127.0.0.1:{port}").replace(
        "--nproc-per-node 8", "--nproc-per-node 1"
    )
    command += f" {SMALL} shape.seq_len=512"
    env = {k: v for k, v in user_shell.env.items() if not k.startswith("SLURM_")}
    nodes = [
        subprocess.Popen(
            ["bash", "-c", command],
            cwd=user_shell.cwd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for _ in range(2)  # two "nodes" on one machine
    ]
    outs = [node.communicate(timeout=300)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(o[-2000:] for o in outs)
    run = metrics(user_shell.cwd / "outputs" / "ring1")
    assert (run["status"], run["validation"], run["world_size"]) == ("ok", "ok", 2)


def test_a_launcher_config_of_your_own_extends_submitit_slurm(user_shell):
    """docs/clusters.md's way to type a cluster's settings once: a hydra/launcher option."""
    own = user_shell.cwd / "myconf" / "hydra" / "launcher"
    own.mkdir(parents=True)
    (own / "mycluster.yaml").write_text(
        "defaults:\n  - submitit_slurm\n\npartition: debug\ntimeout_min: 5\n"
    )
    sweep = user_shell.cwd / "multirun" / "own"
    proc = user_shell(
        f"attngym -m hydra/launcher=mycluster hydra.searchpath=[file://{own.parents[1]}] "
        f"{SMALL} shape.seq_len=256 hydra.sweep.dir={sweep}"
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (script,) = sweep.glob(".submitit/*/*_submission.sh")
    assert "--partition=debug" in script.read_text() and "--time=5" in script.read_text()


def _running_job(slurm, sweep, num: int, timeout_s: float = 120) -> str:
    """The SLURM id of the sweep's job `num` (its index in the job array), once it runs."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        jobs = [p.name.removesuffix("_submitted.pkl") for p in sweep.glob(".submitit/*/*.pkl")]
        for job_id in jobs:  # an array's elements end in _<num>; a sweep of one job is no array
            ours = job_id.endswith(f"_{num}") or jobs == [job_id.split("_")[0]]
            if ours and dict(slurm.jobs()).get(job_id) == "RUNNING":
                return job_id
        time.sleep(0.5)
    raise AssertionError(f"job {num} of {sweep} never ran: {slurm.jobs()}")


def test_each_task_of_a_step_gets_torchruns_variables_from_slurms(slurm, user_shell):
    """3 tasks over 2 nodes (2 + 1): every task is a rank of one world, its local rank and its
    node's task count from SLURM, and all agree on the rendezvous host and port."""
    code = (
        "import os; from attngym.distributed.ranks.launch import join_slurm_step; "
        "assert join_slurm_step(); "
        "print(*(os.environ[k] for k in ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
        "'LOCAL_WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')))"
    )
    proc = user_shell(f'srun --nodes=2 --ntasks=3 --distribution=block python -c "{code}"')
    assert proc.returncode == 0, proc.stdout + proc.stderr
    ranks = sorted(tuple(line.split()) for line in proc.stdout.splitlines())
    host, port = ranks[0][4], ranks[0][5]
    assert host in slurm.nodes and all(r[4:] == (host, port) for r in ranks)
    assert [r[:4] for r in ranks] == [
        ("0", "3", "0", "2"),
        ("1", "3", "1", "2"),
        ("2", "3", "0", "1"),
    ]
    # Outside a step of several tasks nothing is set: the batch script, or one task that spawns.
    alone = (
        "import os; from attngym.distributed.ranks.launch import join_slurm_step; "
        "assert not join_slurm_step() and 'RANK' not in os.environ"
    )
    proc = user_shell(f'srun --ntasks=1 python -c "{alone}"')
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_sweep_run_by_srun_tasks_runs_each_job_on_every_rank(slurm, user_shell):
    """`srun -n 2 attngym -m ...`, as docs/clusters.md says: one process group for every job, rank 0
    writes the summary into the sweep folder both tasks name alike (slurm-<job>.<step>)."""
    proc = user_shell(
        f"srun --ntasks=2 attngym -m topology=ring {SMALL} shape.seq_len=256,512", timeout=400
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    (sweep,) = (user_shell.cwd / "multirun").glob("*/slurm-*.0")
    assert [r["status"] for r in rows(sweep)] == ["ok", "ok"]
    assert (proc.stdout + proc.stderr).count("summary in") == 1  # rank 0's alone
    assert all((sweep / job / "rank1.log").is_file() for job in ("0", "1"))
