"""Ctrl-C while a run starts: the job's slow start (torch._dynamo's import) and the ranks' (their
interpreters importing torch, still in the terminal's process group) are held open by an import
hook of the test's (a sitecustomize on PYTHONPATH that waits there and says so), and the whole
process group gets SIGINT, as a terminal's Ctrl-C does."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from .procs import wait_gone

pytestmark = pytest.mark.faults

# Waits when `module` is imported in the run's process ("job") or in a rank it spawned ("rank"),
# after touching MARK: the test sends its signal then.
HOOK = """import importlib.abc, os, sys, time

MODULE, WHERE, MARK = os.environ["HOLD_MODULE"], os.environ["HOLD_WHERE"], os.environ["HOLD_MARK"]


class Hold(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        spawned = "--multiprocessing-fork" in sys.orig_argv  # a spawned process's real argv
        if name == MODULE and WHERE == ("rank" if spawned else "job"):
            sys.meta_path.remove(self)
            open(MARK, "a").close()
            time.sleep(3)
        return None


sys.meta_path.insert(0, Hold())
"""


@pytest.mark.parametrize(
    ("module", "where"),
    [
        ("torch._dynamo", "job"),  # the job's timeline starting, before it ran anything
        ("attngym.distributed.ranks.launch", "rank"),  # a rank's interpreter starting
    ],
    ids=["job", "rank"],
)
def test_ctrl_c_while_a_run_starts_leaves_metrics_json_and_no_rank_traceback(
    tmp_path, no_new_children, module, where
):
    (tmp_path / "hook").mkdir()
    (tmp_path / "hook" / "sitecustomize.py").write_text(HOOK)
    mark, run = tmp_path / "held", tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env |= {"PYTHONPATH": str(tmp_path / "hook"), "HOLD_MODULE": module}
    env |= {"HOLD_WHERE": where, "HOLD_MARK": str(mark), "ATTNGYM_PROGRESS": "0"}
    args = ["topology=ring", "topology.world_size=2", "shape.seq_len=256", "shape.heads=1"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "attngym", *args, "logger=none", f"hydra.run.dir={run}"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its own process group, the terminal's foreground one
    )
    deadline = time.monotonic() + 120
    while not mark.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert out.strip().splitlines()[-1] == (
        f"attngym: interrupted by SIGINT; what was measured is in {run}"
    ), out[-3000:]
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "interrupted" and metrics["error"] == "interrupted by SIGINT"
    assert wait_gone([proc.pid]) == []
