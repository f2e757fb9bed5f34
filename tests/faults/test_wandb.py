"""W&B against a server that accepts connections and never answers: bounded, nothing left."""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid

import pytest

from .procs import tagged, wait_gone

pytestmark = pytest.mark.faults

# One online W&B run in a fresh interpreter, the way a run's tracker logs after metrics.json.
# CHILD_START_S is shortened so that a stall shows.
RUN = """
import json, pathlib, sys, time
from attngym.runner.tracking import wandb_logger
from attngym.runner.tracking.files import RunRecord, write_metrics
wandb_logger.CHILD_START_S = 5.0
run_dir = pathlib.Path(sys.argv[1])
metrics = {"status": "ok", "fwd_ms": 1.25}
write_metrics(run_dir, metrics)
tracker = wandb_logger.WandbTracker(mode="online", init_timeout_s=1, finish_timeout_s=1)
start = time.time()
tracker.log_run(RunRecord(run_dir=run_dir, metrics=metrics, config={"seed": 0}, images={},
                          name="hang", group="faults", job_type="single"))
print(json.dumps({"start": start}), flush=True)
"""


@pytest.fixture
def silent_server():
    """A TCP server on 127.0.0.1 that accepts every connection and never sends a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    conns, stop = [], threading.Event()

    def accept():
        while not stop.is_set():
            try:
                conns.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for c in conns:
        c.close()
    server.close()


def test_hanging_wandb_endpoint_is_bounded_and_leaves_nothing(tmp_path, attngym_cli, silent_server):
    tag = uuid.uuid4().hex
    env = {
        "WANDB_BASE_URL": silent_server,
        "WANDB_API_KEY": "x" * 40,  # any well-formed key: the server never looks at it
        "WANDB_DIR": str(tmp_path),
        "ATTNGYM_FAULT_TAG": tag,
    }
    proc = attngym_cli([str(tmp_path / "run")], tmp_path, env=env, command=("-c", RUN))
    # From log_run to the process's end, its exit included (wandb's exit hooks made this 13-30 s):
    # init_timeout_s + finish_timeout_s + CHILD_START_S = 7 s at most, plus 3 s for the kill and
    # the exit on a loaded 2-core box.
    elapsed = time.time() - json.loads(proc.stdout.splitlines()[-1])["start"]
    assert proc.returncode == 0, proc.stderr
    assert elapsed < 7 + 3, (elapsed, proc.stderr)
    assert "wandb" in proc.stderr and "metrics.json is unaffected" in proc.stderr
    metrics = json.loads((tmp_path / "run" / "metrics.json").read_text())
    assert metrics == {"status": "ok", "fwd_ms": 1.25}  # written first, untouched
    assert wait_gone(tagged(tag)) == []  # the child and wandb's service are gone


def test_a_child_past_its_deadline_is_killed_with_everything_it_started(
    tmp_path, monkeypatch, caplog
):
    """Whatever hangs in the child (wandb's init, upload, exit hooks), the caller kills it and its
    process group at the deadline and goes on with a warning."""
    from attngym.runner.tracking import wandb_logger
    from attngym.runner.tracking.files import RunRecord

    tag = uuid.uuid4().hex
    hung = tmp_path / "python"  # stands in for the child's interpreter: it starts one more
    hung.write_text("#!/bin/sh\nsleep 300 &\nexec sleep 300\n")  # process and never reports
    hung.chmod(0o755)
    monkeypatch.setattr(wandb_logger.sys, "executable", str(hung))
    monkeypatch.setattr(wandb_logger, "CHILD_START_S", 0.0)
    monkeypatch.setenv("ATTNGYM_FAULT_TAG", tag)
    tracker = wandb_logger.WandbTracker(mode="online", init_timeout_s=0.5, finish_timeout_s=0.5)
    record = RunRecord(
        run_dir=tmp_path,
        metrics={"status": "ok"},
        config={},
        images={},
        name="n",
        group="g",
        job_type="single",
    )
    start = time.monotonic()
    tracker.log_run(record)
    assert time.monotonic() - start < 1.0 + 5  # the deadline, and the kill
    assert "wandb did not finish within 1 s" in caplog.text and "abandoned" in caplog.text
    assert wait_gone(tagged(tag)) == []
