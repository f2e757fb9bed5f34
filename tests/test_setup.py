"""`make setup`'s choice of torch: PyTorch's CPU build on a machine with no CUDA device where its
CPU wheel index answers, else pip's configured index, and it says which and why (`make
torch-source` prints the choice setup makes; nothing is installed)."""

from __future__ import annotations

import http.server
import os
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.skipif(
    shutil.which("make") is None or any(Path("/dev").glob("nvidia[0-9]*")),
    reason="needs make, on a machine without a CUDA device node",
)


def _choice(tmp_path: Path, index: str, *, gpu: bool) -> str:
    """What `make torch-source` says, with an `nvidia-smi` on PATH that lists a GPU or none."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    listed = "GPU 0: NVIDIA H200 (UUID: GPU-0)" if gpu else ""
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{listed}'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["make", "-s", "--no-print-directory", "torch-source", f"TORCH_CPU_INDEX={index}",
         f"PYTHON={sys.executable}"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


@pytest.fixture
def cpu_index(tmp_path):
    """A wheel index that answers: a folder with torch/ served over HTTP on localhost."""
    (tmp_path / "index" / "torch").mkdir(parents=True)
    (tmp_path / "index" / "torch" / "index.html").write_text("<html></html>")

    class Quiet(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(tmp_path / "index"), **kwargs)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()


def test_no_cuda_device_and_the_cpu_index_answers_takes_the_cpu_build(tmp_path, cpu_index):
    assert _choice(tmp_path, cpu_index, gpu=False) == "cpu: no CUDA device here"


def test_the_cpu_index_out_of_reach_falls_back_to_the_configured_index_and_says_so(tmp_path):
    closed = "http://127.0.0.1:9/whl/cpu"  # the discard port: nothing listens
    assert _choice(tmp_path, closed, gpu=False) == (
        f"configured: no CUDA device here, but {closed} cannot be reached"
    )


def test_a_cuda_device_keeps_the_configured_index(tmp_path, cpu_index):
    assert _choice(tmp_path, cpu_index, gpu=True) == "configured: a CUDA device is here"


def test_setup_installs_from_the_index_it_chose():
    """The recipe asks for the CPU index only on the `cpu` choice and prints the torch it took."""
    recipe = subprocess.run(
        ["make", "-n", "--no-print-directory", "/nonexistent/.installed", "VENV=/nonexistent"],
        cwd=REPO, capture_output=True, text=True, timeout=60,
    ).stdout  # fmt: skip
    assert 'cpu:*) echo "setup 3/4: torch:' in recipe
    assert "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu" in recipe
    assert "from pip's configured index" in recipe and "torch.version.cuda" in recipe
