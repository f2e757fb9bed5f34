"""`attngym.run(...)`: the command line's experiment from a notebook, returning its metrics."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import attngym
from attngym import variants
from attngym.errors import ConfigError

SMALL = ["shape.seq_len=128", "logger=none", "benchmark.repeats=2", "validate_rows=32"]


def diagonal_band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= 16


@pytest.mark.slow
def test_a_notebook_callback_runs_the_whole_experiment(tmp_path):
    metrics = attngym.run(mask_mod=diagonal_band, overrides=SMALL, run_dir=tmp_path / "run")
    assert metrics["status"] == "ok" and metrics["validation"] == "ok"
    assert metrics["variant"] == "diagonal_band" and metrics["fwd_ms"] > 0
    assert metrics["sdpa_dense_mask_status"] == "ok"  # the dense-mask contender ran
    for picture in ("metrics.json", "heatmap.png", "block_mask.png"):
        assert (tmp_path / "run" / picture).stat().st_size > 0


@pytest.mark.slow
def test_a_lambda_and_a_variant_run_on_one_device(tmp_path):
    lam = attngym.run(mask_mod=lambda b, h, q, k: q >= k, overrides=SMALL, run_dir=tmp_path / "a")
    assert lam["status"] == "ok" and lam["variant"] == "lambda"
    doc = variants.get("document", doc_lengths=[50, 78])
    built = attngym.run(variant=doc, overrides=SMALL, run_dir=tmp_path / "b")
    assert built["status"] == "ok" and built["variant"] == "document"


def strided_band(stride, width):
    """A factory, as a notebook's cell writes one: its closure's name says nothing."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % stride == 0) & (q_idx - kv_idx <= width)

    return mask_mod


def test_a_closure_is_named_by_the_factory_that_made_it_and_a_quiet_run_prints_nothing(
    tmp_path, capfd
):
    quiet = attngym.run(
        mask_mod=strided_band(2, 64), overrides=SMALL, run_dir=tmp_path / "q", quiet=True
    )
    assert quiet["status"] == "ok" and quiet["variant"] == "strided_band"  # not mask_mod_5
    printed = capfd.readouterr()
    assert printed.out == "" and printed.err == ""
    assert "validated" in (tmp_path / "q" / "attngym.log").read_text()  # the log is whole
    loud = attngym.run(mask_mod=strided_band(3, 64), overrides=SMALL, run_dir=tmp_path / "l")
    assert loud["status"] == "ok" and "attngym: ok" in capfd.readouterr().out


def test_run_folders_are_named_as_the_readme_says(tmp_path, monkeypatch):
    import re
    from pathlib import Path

    monkeypatch.chdir(tmp_path)
    metrics = attngym.run(mask_mod=diagonal_band, overrides=SMALL, quiet=True)
    run = Path(metrics["run_dir"])
    assert re.fullmatch(r"outputs/\d{4}-\d\d-\d\d/\d\d-\d\d-\d\d-\d{6}-\d+", str(run)), run
    root = Path(__file__).resolve().parents[1]
    docs = "".join(p.read_text() for p in [root / "README.md", *sorted(root.glob("docs/*.md"))])
    named = set(re.findall(r"(?:outputs|multirun)/<date>/<[^>]+>[^/` ]*", docs))
    assert named == {"outputs/<date>/<time>-<pid>", "multirun/<date>/<time>-<pid>"}, named


def test_a_callable_that_cannot_reach_new_processes_is_refused_for_context_parallelism():
    with pytest.raises(ConfigError, match="lives only in this process") as err:
        attngym.run(mask_mod=lambda b, h, q, k: q >= k, overrides=["topology=ring"])
    assert err.value.key == "attention.mask_mod"


def test_a_bad_path_is_a_config_error_before_any_tensor_work(tmp_path):
    with pytest.raises(ConfigError, match="no module 'nope'"):
        attngym.run(mask_mod="nope.mask", overrides=["logger=none"], run_dir=tmp_path / "run")


def test_a_sweep_is_the_command_lines():
    with pytest.raises(ConfigError, match="sweep with attngym -m"):
        attngym.run(overrides=["-m", "shape.seq_len=128,256"])


@pytest.mark.slow
def test_a_module_level_function_reaches_the_ranks_of_a_ring(tmp_path):
    metrics = attngym.run(
        mask_mod=diagonal_band,
        overrides=[*SMALL, "topology=ring", "baselines=[]"],
        run_dir=tmp_path / "ring",
    )
    assert metrics["status"] == "ok" and metrics["validation"] == "ok"
    assert metrics["world_size"] == 2


def test_a_script_without_a_main_guard_runs_context_parallel_once(tmp_path):
    """Ranks start with "spawn", which re-runs the main script in each: attngym's ranks need
    nothing of it, so a script without `if __name__ == "__main__":` runs once."""
    (tmp_path / "diag.py").write_text(
        "def band(b, h, q_idx, kv_idx):\n    return (q_idx - kv_idx).abs() <= 8\n"
    )
    (tmp_path / "script.py").write_text(
        "import attngym\n"
        "from diag import band\n"
        "print('script body', flush=True)\n"
        "m = attngym.run(mask_mod=band, overrides=['topology=ring', 'topology.world_size=2',\n"
        "    'device=cpu', 'shape.seq_len=128', 'shape.heads=2', 'shape.head_dim=16',\n"
        "    'logger=none', 'baselines=[]', 'benchmark.warmup=0', 'benchmark.repeats=1'])\n"
        "print('status', m['status'], flush=True)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    proc = subprocess.run(
        [sys.executable, "script.py"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("script body") == 1 and "status ok" in proc.stdout


def test_help_shows_runs_own_signature():
    import inspect

    assert "mask_mod" in inspect.signature(attngym.run).parameters
    assert "Run one experiment" in (attngym.run.__doc__ or "")
