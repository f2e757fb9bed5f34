"""A real SLURM cluster on this machine, for the tests: munged, slurmctld and two slurmd.

Debian's `slurm-wlm` and `munge` (installed by .ci/run). Everything lives in one temporary
folder: a fresh munge key and socket, slurm.conf, state and spool folders, logs; the daemons run
in the foreground as children of the test process and are stopped by their PIDs. Two nodes, each
its own slurmd on its own port: this machine's host name and `localhost`, both names that resolve
here, so a job on two nodes has a rendezvous host its ranks can reach, as on a real cluster.
No accounting (slurmdbd): the cluster that the launcher must handle without sacct.

    python -m tests.slurm.cluster     # start one by hand; prints SLURM_CONF, Ctrl-C stops it
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
# What each node offers: jobs of the tests ask for 2 CPUs per rank
# (attngym.runner.launchers.slurm.CPUS_PER_RANK), a two-rank job on one node 4; slurmd trusts these
# numbers (config_overrides), so a 2-core machine runs them, its ranks sharing the cores.
NODE_CPUS = 4
NODE_MEMORY_MB = 8000


def missing() -> str | None:
    """Why no cluster can start here (None: it can)."""
    absent = [name for name in DAEMONS + CLIENTS if shutil.which(name) is None]
    if absent:
        return (
            f"SLURM is not installed ({', '.join(absent)} missing): apt-get install slurm-wlm munge"
        )
    if os.geteuid() != 0:
        return "slurmd runs jobs as their users only as root"
    return None


def _free_ports(count: int) -> list[int]:
    sockets = [socket.socket() for _ in range(count)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


class SlurmCluster:
    """Start with `start()`, use `env` for every SLURM command, `stop()` at the end."""

    def __init__(self, folder: str | Path | None = None):
        self.folder = Path(folder or tempfile.mkdtemp(prefix="attngym-slurm-"))
        self.nodes = (socket.gethostname().split(".")[0], "localhost")
        self.conf = self.folder / "slurm.conf"
        self._procs: list[subprocess.Popen] = []

    @property
    def env(self) -> dict[str, str]:
        """os.environ with SLURM_CONF pointing at this cluster."""
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def start(self, timeout_s: float = 60.0) -> SlurmCluster:
        f = self.folder
        for sub in ("munge", "state", *(f"spool/{n}" for n in self.nodes)):
            (f / sub).mkdir(parents=True, exist_ok=True)
        (f / "munge").chmod(0o755)
        key = f / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o600)
        socket_path = f / "munge" / "munge.sock"
        ctld_port, *node_ports = _free_ports(1 + len(self.nodes))
        user = pwd.getpwuid(os.geteuid()).pw_name
        nodes = "\n".join(
            f"NodeName={name} NodeHostname={self.nodes[0]} NodeAddr=127.0.0.1 Port={port} "
            f"CPUs={NODE_CPUS} RealMemory={NODE_MEMORY_MB} State=UNKNOWN"
            for name, port in zip(self.nodes, node_ports, strict=True)
        )
        self.conf.write_text(
            f"""ClusterName=attngym-test
SlurmctldHost={self.nodes[0]}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/munge
AuthInfo=socket={socket_path}
CredType=cred/munge
SlurmUser={user}
SlurmdUser=root
StateSaveLocation={f}/state
SlurmdSpoolDir={f}/spool/%n
SlurmctldPidFile={f}/slurmctld.pid
SlurmdPidFile={f}/slurmd-%n.pid
SlurmctldLogFile={f}/slurmctld.log
SlurmdLogFile={f}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=5
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""
        )
        self._spawn(
            "munged",
            ["munged", "-F", "-f", f"--socket={socket_path}", f"--key-file={key}"]
            + [f"--log-file={f}/munge/munged.log", f"--pid-file={f}/munge/munged.pid"]
            + [f"--seed-file={f}/munge/seed"],
        )
        self._wait(lambda: socket_path.exists(), timeout_s, "munged's socket")
        self._spawn("slurmctld", ["slurmctld", "-D", "-f", str(self.conf)])
        for name in self.nodes:
            self._spawn(f"slurmd-{name}", ["slurmd", "-D", "-N", name, "-f", str(self.conf)])
        self._wait(self._idle, timeout_s, "both nodes idle in sinfo")
        return self

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self.folder / f"{name}.out", "wb")  # noqa: SIM115 (closed with the process)
        self._procs.append(
            subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=self.env)
        )
        out.close()

    def _idle(self) -> bool:
        out = self.run("sinfo", "--noheader", "--format=%T %D", check=False).stdout.split()
        return out == ["idle", str(len(self.nodes))]

    def _wait(self, ready, timeout_s: float, what: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not ready():
            dead = [p.args[0] for p in self._procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(
                    p.name + ":\n" + p.read_text()[-1500:] for p in self.folder.glob("*.out")
                )
                self.stop()
                raise RuntimeError(f"the test cluster did not start ({what}); {dead}\n{logs}")
            time.sleep(0.2)

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60
    ) -> subprocess.CompletedProcess:
        """A SLURM command against this cluster."""
        return subprocess.run(
            argv, env=self.env, capture_output=True, text=True, check=check, timeout=timeout
        )

    def kill_slurmd(self, node: str) -> None:
        """SIGKILL the slurmd of `node` (its jobs' slurmstepd go on): a node whose daemon died."""
        proc = self._slurmd(node)
        proc.kill()
        proc.wait()

    def restart_slurmd(self, node: str, timeout_s: float = 120.0) -> None:
        """Start `node`'s slurmd again, and wait for both nodes to be idle."""
        self._procs.remove(self._slurmd(node))
        self._spawn(f"slurmd-{node}", ["slurmd", "-D", "-N", node, "-f", str(self.conf)])
        self._wait(self._idle, timeout_s, f"{node} idle again")

    def _slurmd(self, node: str) -> subprocess.Popen:
        (proc,) = [p for p in self._procs if p.args[0] == "slurmd" and node in p.args]
        return proc

    def jobs(self) -> list[tuple[str, str]]:
        """(job id, state) of every job the controller still knows, ended ones included."""
        out = self.run("squeue", "--noheader", "--array", "--states=all", "--format=%i %T").stdout
        return [tuple(line.split()) for line in out.splitlines() if line.strip()]

    def stop(self) -> None:
        """Cancel every job, then stop the daemons this object started (SIGTERM, then SIGKILL)."""
        if any(p.poll() is None for p in self._procs):
            self.run(
                "scancel", "--full", f"--user={pwd.getpwuid(os.geteuid()).pw_name}", check=False
            )
        for p in reversed(self._procs):
            if p.poll() is None:
                p.terminate()
        for p in self._procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        self._procs.clear()


if __name__ == "__main__":
    cluster = SlurmCluster().start()
    print(f"export SLURM_CONF={cluster.conf}", flush=True)
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        cluster.stop()
