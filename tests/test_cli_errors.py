"""Odd command lines and code that fails only where flex runs it: each ends in one line that
names the key, the exit code of its kind, and a metrics.json, as a bad value does.

Hydra refuses some of these itself (its override grammar, its own config groups, interpolations
it resolves), with a traceback or a page of text and no record; attngym refuses them first.
"""

from __future__ import annotations

import json

import pytest
from test_cli import REPO, SMALL

from attngym.errors import ConfigError
from attngym.runner.overrides import HydraRefused, prepare_overrides


@pytest.mark.parametrize(
    ("override", "line"),
    [
        ("shape.seq_len=${nope}", "shape.seq_len: Interpolation key 'nope' not found"),
        ("shape.seq_len=${oc.env:ATTNGYM_NOPE}", "shape.seq_len: KeyError raised while resolving"),
        ("attention.window_size=[1,2", "attention.window_size: Hydra's override grammar cannot"),
        ("shape.seq_len=((", "shape.seq_len: Hydra's override grammar cannot read '(('"),
        ("hydra/launcher=nosuch", "hydra/launcher: unknown option 'nosuch'; options: attngym, "),
        ("attention.label=🚀", "attention.label: Hydra's override grammar cannot read '🚀'"),
    ],
)
def test_a_config_error_hydra_would_raise_is_one_line_exit_2_and_a_record(
    tmp_path, attngym_cli, override, line
):
    run_dir = tmp_path / "run"
    proc = attngym_cli([*SMALL, override, "logger=none", f"hydra.run.dir={run_dir}"], REPO)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith(f"attngym: error: {line}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and "Traceback" not in proc.stdout + proc.stderr
    assert "++" not in proc.stderr  # what the user typed, not what Hydra was handed
    m = json.loads((run_dir / "metrics.json").read_text())
    assert (
        m["status"] == "failed" and m["error"] == proc.stderr.removeprefix("attngym: error: ")[:-1]
    )
    assert override in m["overrides"]  # as typed


@pytest.mark.parametrize("override", ["shape.seq_len=((,256", "hydra/launcher=nosuch"])
def test_a_sweep_hydra_cannot_read_is_refused_in_one_line_before_any_job(
    tmp_path, attngym_cli, override
):
    sweep = tmp_path / "sweep"
    proc = attngym_cli(["-m", *SMALL, override, f"hydra.sweep.dir={sweep}"], REPO)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stderr.startswith("attngym: error: ") and proc.stderr.count("\n") == 1
    assert not sweep.exists()


def test_a_jobs_interpolation_error_fails_its_row_and_the_sweep_goes_on(tmp_path, attngym_cli):
    sweep = tmp_path / "sweep"
    args = ["-m", *SMALL, "shape.seq_len=${nope},128", "logger=none", f"hydra.sweep.dir={sweep}"]
    proc = attngym_cli(args, REPO)
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    bad, good = (json.loads((sweep / n / "metrics.json").read_text()) for n in ("0", "1"))
    assert bad["status"] == "failed" and bad["error"].startswith("shape.seq_len: Interpolation")
    assert any("nope" in o for o in bad["overrides"])  # as the sweeper split it
    assert good["status"] == "ok"
    assert "1 of 2 sweep jobs failed" in proc.stderr


def test_overrides_hydra_cannot_take_are_left_out_for_a_single_run_and_refused_in_a_sweep():
    left_out: list = []
    argv = ["shape.seq_len=((", "attention=causal", "hydra/launcher=nosuch"]
    assert prepare_overrides(argv, left_out) == ["attention=causal"]
    assert [o for o, _ in left_out] == ["shape.seq_len=((", "hydra/launcher=nosuch"]
    assert all(isinstance(err, HydraRefused) for _, err in left_out)
    with pytest.raises(ConfigError, match="^shape.seq_len: Hydra's override grammar"):
        prepare_overrides(argv)
    # What Hydra reads stays Hydra's: sweeps, functions, interpolations, its launchers.
    fine = ["shape.seq_len=1,2", "shape.seq_len=choice(1,2)", "seed=${div:4,2}"]
    assert prepare_overrides([*fine, "hydra/launcher=basic", "hydra/sweeper=basic"]) == [
        *fine,
        "hydra/launcher=basic",
        "hydra/sweeper=basic",
    ]


MODS = """import torch


def noisy(score, b, h, q_idx, kv_idx):
    return score + torch.rand_like(score)  # fine on a probe grid, refused by vmap inside flex
"""


def test_a_callback_that_fails_only_inside_flex_is_one_line_naming_its_key(tmp_path, attngym_cli):
    """torch.rand_like is fine on a plain grid and refused by vmap, as flex runs a callback: the
    probe runs it under vmap too, so the run is refused before any tensor work, in one line
    naming the key and the user's file and line; HYDRA_FULL_ERROR=1 shows the traceback."""
    (tmp_path / "vmods.py").write_text(MODS)
    run_dir = tmp_path / "run"
    args = [*SMALL, "attention=custom", "attention.score_mod=vmods.noisy", "logger=none"]
    proc = attngym_cli([*args, f"hydra.run.dir={run_dir}"], tmp_path, env={"PYTHONPATH": "."})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("attngym: error: attention.score_mod: raised RuntimeError under "
                           "torch.vmap"), line  # fmt: skip
    assert "at vmods.py:5 (in noisy): vmap: called random operation" in line
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["status"] == "failed" and m["error"] == line.removeprefix("attngym: error: ")
    full = attngym_cli(
        [*args, f"hydra.run.dir={tmp_path / 'full'}"],
        tmp_path,
        env={"PYTHONPATH": ".", "HYDRA_FULL_ERROR": "1"},
    )
    assert full.returncode != 0 and "Traceback" in full.stderr  # the whole story on request


def test_an_error_raised_under_flexs_vmap_with_no_user_frame_names_the_callbacks():
    """Past the probe, an error whose frames are all torch's but pass through vmap (as flex runs
    the callbacks) is one line naming the callbacks' keys, not two tracebacks."""
    import types

    import torch

    from attngym.errors import UserCodeError
    from attngym.runner.job import _inside_flex

    settings = types.SimpleNamespace(attention={"name": "custom", "score_mod": "vmods.noisy"})
    try:
        torch.vmap(lambda x: torch.rand_like(x))(torch.ones(2, 3))
    except RuntimeError as err:
        blamed = _inside_flex(err, settings)
    assert isinstance(blamed, UserCodeError) and blamed.key == "attention.score_mod"
    assert "inside flex_attention, which runs it under torch.vmap" in str(blamed)
    assert _inside_flex(ValueError("no vmap here"), settings) is None


@pytest.mark.parametrize("where", ["conf", "conf/attention/causal_run"])
def test_a_run_folder_inside_the_config_folder_is_refused(tmp_path, attngym_cli, where):
    import shutil

    from attngym.runner.overrides import CONF_DIR

    before = sorted(p.relative_to(CONF_DIR) for p in CONF_DIR.rglob("*"))
    target = CONF_DIR.parent / where
    try:
        proc = attngym_cli([*SMALL, "logger=none", f"hydra.run.dir={where}"], CONF_DIR.parent)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert proc.stderr.startswith(f"attngym: error: hydra.run.dir: {where} is inside ")
        assert sorted(p.relative_to(CONF_DIR) for p in CONF_DIR.rglob("*")) == before
    finally:  # a build without the check writes a run there: take it out again
        if target != CONF_DIR and target.exists():
            shutil.rmtree(target)
        shutil.rmtree(CONF_DIR / ".hydra", ignore_errors=True)
        for name in ("attngym.log", "metrics.json", ".attngym.lock"):
            (CONF_DIR / name).unlink(missing_ok=True)
