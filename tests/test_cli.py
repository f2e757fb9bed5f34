"""The command line end to end on CPU: a run's files, one-line errors, --help and --cfg.

Runs go through a subprocess (`python -m attngym`), as a user would, with outputs in tmp_path;
the run is shared by the tests of this module (one Hydra subprocess costs several seconds).
"""

from __future__ import annotations

import json
import logging
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attngym.errors import ConfigError
from attngym.runner.overrides import prepare_overrides

REPO = Path(__file__).resolve().parents[1]
SMALL = [
    "device=cpu",
    "shape.seq_len=128",
    "shape.heads=2",
    "shape.head_dim=16",
    "benchmark.warmup=0",
    "benchmark.repeats=1",
    "validate_rows=64",
    "baselines=[sdpa]",
    "block_size=64",
]


@pytest.fixture(scope="module")
def run(tmp_path_factory, attngym_cli):
    tmp = tmp_path_factory.mktemp("cli")
    run_dir = tmp / "run"
    proc = attngym_cli(
        [
            *SMALL,
            "attention=sliding_window",
            "attention.window_size=32",
            "logger=local",
            f"hydra.run.dir={run_dir}",
        ],
        tmp,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, run_dir


def test_run_writes_metrics(run):
    _, run_dir = run
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["status"] == "ok" and m["error"] is None
    assert m["variant"] == "sliding_window" and m["seq_len"] == 128 and m["block_q"] == 64
    assert m["err_out_max_abs"] < 1e-4 and m["err_lse_max_abs"] < 1e-4  # float32 vs float64
    assert m["validated_rows"] == 128 and m["fwd_ms"] > 0  # 64 sampled; 2 edge blocks: all
    assert m["sdpa_status"].startswith("skipped")
    assert not list(run_dir.glob(".metrics.json.*"))  # the atomic write left no temporary


def test_run_writes_pictures_and_hydra_files(run):
    import matplotlib.image as mpimg

    _, run_dir = run
    for name in ("heatmap.png", "block_mask.png"):
        path = run_dir / name
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        image = mpimg.imread(path)
        assert image.shape[0] > 100 and image.shape[1] > 100
        assert image[..., :3].std() > 0.05  # not a blank canvas
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    assert "sliding_window" in (run_dir / ".hydra" / "overrides.yaml").read_text()
    assert "| fwd_ms |" in (run_dir / "results.md").read_text()
    assert (run_dir / "attngym.log").is_file()


def test_run_prints_results_table(run):
    proc, run_dir = run
    assert "attngym: ok" in proc.stdout
    assert "max |out - ref|" in proc.stdout
    assert any(line.split() == ["validation", "ok"] for line in proc.stdout.splitlines())
    assert f"run folder: {run_dir}" in proc.stdout


@pytest.mark.parametrize(
    ("args", "key"),
    [(["attention=sliding_windw"], "attention"), (["shape.heads=0"], "shape.heads")],
)
def test_bad_override_is_one_line(tmp_path, attngym_cli, args, key):
    proc = attngym_cli([*SMALL, *args, "logger=none", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"attngym: error: {key}:")
    assert "Traceback" not in proc.stdout + proc.stderr


def test_help_lists_groups_and_cfg_prints_config(tmp_path, attngym_cli):
    proc = attngym_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for text in ("== Config groups ==", "attention:", "gemma2", "topology:", "+experiment"):
        assert text in proc.stdout, text
    # Every attention option with its parameters and their defaults, as its file states them.
    assert re.search(r"^  sliding_window +window_size=256$", proc.stdout, re.M)
    assert re.search(r"^  custom +mask_mod=null, mask_args=null, score_mod=null", proc.stdout, re.M)
    assert "prefix_length=${div:${shape.seq_len},4}" in proc.stdout
    proc = attngym_cli(["--cfg", "job", "attention=alibi", "shape.heads=8"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "num_heads: 8" in proc.stdout or "num_heads: ${shape.heads}" in proc.stdout
    assert "name: alibi" in proc.stdout


def test_prepare_overrides_quotes_and_checks():
    assert prepare_overrides(["block_size=64", "shape.seq_len=64"]) == [
        "block_size='64'",
        "shape.seq_len=64",
    ]
    assert prepare_overrides(["block_size=64,flash"]) == ["block_size='64',flash"]
    assert prepare_overrides(["+experiment=ring_attention"]) == ["+experiment=ring_attention"]
    with pytest.raises(ConfigError, match="did you mean 'flex_vs_sdpa'") as info:
        prepare_overrides(["+experiment=flex_vs_sdp"])
    assert info.value.key == "experiment"
    with pytest.raises(ConfigError) as info:
        prepare_overrides(["-m", "attention=causal,documnt"])
    assert info.value.key == "attention" and "'documnt'" in str(info.value)


@pytest.mark.parametrize(
    ("arg", "key", "meant"),
    [
        ("shape.seqlen=512", "shape.seqlen", "shape.seq_len"),
        ("+shape.seqlen=512", "shape.seqlen", "shape.seq_len"),
        ("++shape.seqlen=512", "shape.seqlen", "shape.seq_len"),
        ("seq_len=512", "seq_len", "shape.seq_len"),
        ("validate_row=8", "validate_row", "validate_rows"),
    ],
)
def test_unknown_keys_refused_with_the_key_meant(arg, key, meant):
    with pytest.raises(ConfigError) as info:
        prepare_overrides([arg])
    assert info.value.key == key and f"did you mean {meant}?" in str(info.value)
    assert "\n" not in str(info.value)


def test_keys_that_take_new_entries_still_take_plus():
    kept = ["+hydra.callbacks.x._target_=a.B", "+attention.extra=1", "++logger.tags=[a]"]
    assert prepare_overrides(kept) == kept


def test_an_unknown_key_in_a_config_file_is_refused():
    from attngym.runner.config import check_config

    with pytest.raises(ConfigError) as info:
        check_config({"shape": {"seq_len": 64, "seqlen": 512}})
    assert info.value.key == "shape.seqlen" and "shape.seq_len" in str(info.value)


def test_a_gpu_sized_preset_is_refused_before_its_sweep_starts():
    with pytest.raises(ConfigError, match="add .*shape.seq_len=512") as info:
        prepare_overrides(["+experiment=flex_vs_sdpa", "device=cpu"])
    assert info.value.key == "experiment"


def test_import_is_light():
    code = (
        "import sys, attngym, attngym.runner.config, attngym.runner.tracking; "
        "bad = [m for m in ('wandb', 'matplotlib', 'hydra') if m in sys.modules]; print(bad)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["attention=sliding_window", "attention.window_siz=3"],
            "attngym: error: attention.window_siz: 'sliding_window' has no parameter "
            "'window_siz' (value 3); its parameters: window_size (did you mean 'window_size'?)",
        ),
        (
            ["kernel_options.BACKEND=FLASH", "dtype=float32"],
            "attngym: error: kernel_options.BACKEND: FLASH needs a 16-bit dtype "
            "(bfloat16 or float16), but dtype=float32",
        ),
    ],
    ids=["unknown_parameter", "flash_float32"],
)
def test_open_keys_reach_attngym_checks(tmp_path, attngym_cli, args, message):
    proc = attngym_cli([*SMALL, *args, "logger=none", f"hydra.run.dir={tmp_path / 'r'}"], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [message]
    assert "Traceback" not in proc.stdout + proc.stderr


def test_prepare_overrides_forces_open_keys():
    out = prepare_overrides(["attention.window_size=3", "kernel_options.BACKEND=FLASH"])
    assert out == ["++attention.window_size=3", "++kernel_options.BACKEND=FLASH"]
    kept = ["+attention.x=1", "~kernel_options.A", "kernel_options={A:1}", "attention=causal"]
    assert prepare_overrides(kept) == kept


def test_forced_kernel_option_composes_from_null_and_sweeps_keep_mappings():
    from hydra import compose, initialize_config_dir

    from attngym.runner.overrides import CONF_DIR

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=prepare_overrides(["kernel_options.BACKEND=FLASH"]))
        assert dict(cfg.kernel_options) == {"BACKEND": "FLASH"}
        cfg = compose("config", overrides=["kernel_options={USE_TMA:true}"])
        assert dict(cfg.kernel_options) == {"USE_TMA": True}
        cfg = compose(
            "config", overrides=["+experiment=block_size_sweep"], return_hydra_config=True
        )
        assert "choice({}" in cfg.hydra.sweeper.params.kernel_options.replace(" ", "")


def test_failed_validation_fails_the_run_and_keeps_the_numbers(tmp_path, attngym_cli):
    run_dir = tmp_path / "r"
    args = [*SMALL, "logger=none", f"hydra.run.dir={run_dir}"]
    code = (  # a float32 tolerance no kernel meets: the verdict, not the numbers, must change
        "import sys; from attngym import validation; validation.RTOL['float32'] = 1e-15; "
        f"from attngym.runner.cli import entry; entry({args!r})"
    )
    proc = attngym_cli([], REPO, command=("-c", code))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    m = json.loads((run_dir / "metrics.json").read_text())
    assert m["status"] == "failed" and m["validation"].startswith("failed: err_out_rel=")
    assert m["error"] == f"validation {m['validation']}" and "(float32)" in m["error"]
    assert 0 < m["err_out_rel"] < 1e-4 and m["fwd_ms"] > 0  # every number still recorded
    assert "attngym: failed" in proc.stdout and "Traceback" not in proc.stderr


def test_rank_other_than_zero_runs_and_only_logs(tmp_path, attngym_cli):
    run_dir = tmp_path / "r"
    args = [*SMALL, "logger=local", f"hydra.run.dir={run_dir}"]
    proc = attngym_cli(args, tmp_path, env={"RANK": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert not (run_dir / "metrics.json").exists() and not (run_dir / "heatmap.png").exists()
    assert not (run_dir / "results.md").exists()  # no tracker
    assert "attngym: ok" not in proc.stdout  # no results table
    text = (run_dir / "rank1.log").read_text()
    assert "validated 128 rows" in text and "rank 1 done: validation ok" in text
    assert (run_dir / "attngym.log").read_text() == ""  # rank 0's file: rank 1 stays out of it


@pytest.mark.parametrize(
    ("args", "key"),
    [
        (["topology=ring", "topology.transport=copy_engine", "logger=wandb"], "topology.transport"),
        (["+experiment=flex_vs_sdpa", "hydra.mode=RUN", "logger=wandb"], "experiment"),
        (["shape.seq_len=10000000", "logger=wandb"], "shape.seq_len"),
    ],
    ids=["copy_engine_on_cpu", "gpu_preset_on_cpu", "too_large_for_memory"],
)
def test_a_refused_run_draws_and_tracks_nothing(tmp_path, attngym_cli, args, key):
    run_dir = tmp_path / "r"
    proc = attngym_cli(["device=cpu", *args, f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"attngym: error: {key}:"), lines
    assert not (run_dir / "heatmap.png").exists() and not (run_dir / "block_mask.png").exists()
    assert not (run_dir / "wandb").exists()


def test_pictures_of_a_very_long_sequence_are_skipped_with_the_reason(tmp_path, caplog):
    import logging

    from attngym.runner.config import Settings, Shape
    from attngym.runner.pictures import PICTURE_MAX_PAIRS, draw_pictures

    seq_len = 2 * int(PICTURE_MAX_PAIRS["cpu"] ** 0.5)  # 4x the pairs allowed on a CPU
    settings = Settings(attention={"name": "causal"}, device="cpu", shape=Shape(seq_len=seq_len))
    with caplog.at_level(logging.INFO, logger="attngym"):
        assert draw_pictures(settings, tmp_path) == {}
    assert list(tmp_path.iterdir()) == []
    (line,) = [r.getMessage() for r in caplog.records if "not drawn" in r.getMessage()]
    assert "heatmap.png" in line and "block_mask.png" in line and "above" in line


def test_cp_efficiency_on_a_cpu_is_labelled_as_not_scaling(tmp_path):
    from attngym.results import CPU_EFFICIENCY_NOTE, format_results

    cp = {"status": "ok", "topology": "ring", "world_size": 2, "efficiency": 3.15}
    assert CPU_EFFICIENCY_NOTE in format_results({**cp, "device": "cpu"}, tmp_path)
    assert CPU_EFFICIENCY_NOTE not in format_results({**cp, "device": "cuda"}, tmp_path)


# --- Hydra's own flags pass through, with their arguments ------------------------------------


@pytest.mark.parametrize("flag", ["-sc", "--shell-completion"])
def test_shell_completion_install_prints_the_script(tmp_path, attngym_cli, flag):
    proc = attngym_cli([flag, "install=bash"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "hydra_bash_completion()" in proc.stdout and "complete -o nospace" in proc.stdout
    assert proc.stderr == ""


def test_shell_completion_query_completes_options(tmp_path, attngym_cli):
    line = "attngym attention=sliding_w"
    env = {"COMP_LINE": line, "COMP_POINT": str(len(line))}
    proc = attngym_cli(["-sc", "query=bash"], tmp_path, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention=sliding_window" in proc.stdout.split()


def test_the_console_script_installs_completion_for_itself(tmp_path, attngym_cli):
    script = Path(sys.executable).parent / "attngym"
    if not script.is_file():
        pytest.skip("the attngym console script is not installed beside this interpreter")
    proc = attngym_cli(["-sc", "install=bash"], tmp_path, command=(str(script),))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.rstrip().endswith("-F hydra_bash_completion attngym")


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--info"], "Installed Hydra Plugins"),
        (["-i", "defaults"], "Defaults List"),
        (["--info", "searchpath", "attention=alibi"], "Config search path"),
        (["--cfg", "hydra"], "sweep:"),
        (["-c", "all", "attention=alibi"], "hydra:"),
        (["--cfg=job", "attention=alibi"], "name: alibi"),
        (["--cfg", "job", "--resolve", "attention=alibi", "shape.heads=8"], "num_heads: 8"),
        (["--cfg", "job", "--package", "shape", "shape.heads=8"], "# @package shape"),
        (["-p", "shape", "--cfg", "job"], "head_dim:"),
        (["--hydra-help"], "== Flags =="),
        (["--version"], "Hydra 1."),
        (["-h"], "== Config groups =="),
        (["-cn", "config", "--cfg", "job", "attention=alibi"], "name: alibi"),
        (["--config-name=config", "--cfg", "job"], "shape:"),
        (["-cp", "pkg://attngym.conf", "--cfg", "job", "attention=alibi"], "name: alibi"),
    ],
    ids=lambda a: " ".join(a) if isinstance(a, list) else None,
)
def test_hydra_flags_pass_through_with_their_arguments(tmp_path, attngym_cli, args, expected):
    proc = attngym_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert expected in proc.stdout, proc.stdout[-2000:]
    assert "attngym: error" not in proc.stderr


def test_a_config_dir_adds_its_options(tmp_path, attngym_cli):
    """`-cd DIR`: DIR's group options are options (`attention=mine`); a typo is still one line."""
    (tmp_path / "mine" / "attention").mkdir(parents=True)
    (tmp_path / "mine" / "attention" / "mine.yaml").write_text(
        "name: sliding_window\nwindow_size: 7\n"
    )
    proc = attngym_cli(["-cd", str(tmp_path / "mine"), "--cfg", "job", "attention=mine"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "window_size: 7" in proc.stdout
    proc = attngym_cli(
        [f"--config-dir={tmp_path / 'mine'}", "--cfg", "job", "attention=mien"], tmp_path
    )
    assert proc.returncode == 2
    assert proc.stderr.startswith("attngym: error: attention:") and "'mine'" in proc.stderr


@pytest.mark.parametrize("flag", ["--run", "--multirun"])  # -r is --run's short form
def test_run_and_multirun_flags_run(tmp_path, attngym_cli, flag):
    folder = "hydra.sweep.dir" if flag == "--multirun" else "hydra.run.dir"
    args = [flag, *SMALL, "baselines=[]", "logger=none", f"{folder}={tmp_path / 'out'}"]
    proc = attngym_cli(args, tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "out" / ("0" if flag == "--multirun" else "")
    assert json.loads((run_dir / "metrics.json").read_text())["status"] == "ok"
    assert (flag == "--multirun") == (tmp_path / "out" / "summary.md").is_file()


def test_split_flags_keeps_flag_arguments_apart_from_overrides():
    from attngym.runner.overrides import split_flags

    argv = ["--cfg", "job", "attention=alibi", "-cd", "d", "--info", "x=1", "-m", "--resolve"]
    flags, overrides = split_flags(argv)
    assert [a for _, a in flags] == ["--cfg", "job", "-cd", "d", "--info", "-m", "--resolve"]
    assert [argv[i] for i in overrides] == ["attention=alibi", "x=1"]


def test_prepare_overrides_leaves_flag_arguments_and_completion_alone():
    assert prepare_overrides(["-sc", "install=bash"]) == ["-sc", "install=bash"]
    argv = ["--cfg", "job", "-p", "shape", "block_size=64"]
    assert prepare_overrides(argv) == ["--cfg", "job", "-p", "shape", "block_size='64'"]


# --- what the user typed, not what Hydra received -------------------------------------------


@pytest.mark.parametrize(
    ("hydra_form", "typed"),
    [
        ("++attention.window_size=128", "attention.window_size=128"),
        ("++kernel_options.BACKEND=FLASH", "kernel_options.BACKEND=FLASH"),
        ("block_size='64'", "block_size=64"),
        ("block_size='64',flash", "block_size=64,flash"),
        ("++logger.tags=[a]", "++logger.tags=[a]"),  # typed so: not attngym's rewriting
        ("+attention.extra=1", "+attention.extra=1"),
        ("shape.seq_len=512", "shape.seq_len=512"),
        ("+experiment=variant_gallery", "+experiment=variant_gallery"),
    ],
)
def test_as_typed_undoes_what_prepare_overrides_did(hydra_form, typed):
    from attngym.runner.overrides import as_typed

    assert as_typed(hydra_form) == typed
    assert as_typed(typed) == typed  # idempotent: typed records compare equal
    assert as_typed(prepare_overrides([typed])[0]) == typed


def test_run_name_is_the_typed_overrides_as_hydra_joins_them():
    from attngym.runner.overrides import run_name

    typed = ["attention=sliding_window", "attention.window_size=128", "logger=none", "seed=1"]
    name = run_name(typed, exclude_keys=["logger", "seed"], item_sep=",", kv_sep="=")
    assert name == "attention.window_size=128,attention=sliding_window"
    assert run_name([], exclude_keys=[]) == "defaults"


def test_run_records_the_overrides_as_typed(run):
    """The run fixture typed `attention.window_size=32` and `block_size=64`; Hydra received
    `++attention.window_size=32` and `block_size='64'`."""
    _, run_dir = run
    typed = json.loads((run_dir / "metrics.json").read_text())["overrides"]
    assert "attention.window_size=32" in typed and "block_size=64" in typed
    title = (run_dir / "results.md").read_text().splitlines()[0]  # the run's name, as W&B's
    assert "attention.window_size=32,attention=sliding_window" in title
    assert "++" not in title and "'" not in title and not any("++" in o for o in typed)


def test_every_key_of_a_run_s_metrics_json_is_in_the_metric_table(run):
    from attngym.metrics import unknown_keys

    _, run_dir = run
    metrics = json.loads((run_dir / "metrics.json").read_text())
    assert {"status", "error", "overrides", "complete"} <= set(metrics)
    assert unknown_keys(metrics) == []


def test_the_results_table_says_what_a_cpu_speedup_compares(tmp_path):
    from attngym.results import CPU_SPEEDUP_NOTE, format_results

    run = {"status": "ok", "flex_over_best_sdpa_fwd": 0.5, "best_sdpa_fwd": "sdpa"}
    assert CPU_SPEEDUP_NOTE in format_results({**run, "device": "cpu"}, tmp_path)
    assert CPU_SPEEDUP_NOTE not in format_results({**run, "device": "cuda"}, tmp_path)


def test_a_ratio_to_the_dense_mask_prints_once_when_it_is_the_best_sdpa(tmp_path):
    from attngym.results import format_results

    run = {"status": "ok", "device": "cuda", "best_sdpa_fwd": "sdpa_dense_mask"}
    run |= {"flex_over_best_sdpa_fwd": 15.3, "flex_over_sdpa_dense_mask_fwd": 15.3}
    table = format_results(run, tmp_path)
    assert table.count("15.3") == 1 and "best SDPA (sdpa_dense_mask) fwd" in table
    run |= {"best_sdpa_fwd": "sdpa_cudnn", "flex_over_best_sdpa_fwd": 0.7}
    assert format_results(run, tmp_path).count("15.3") == 1  # another best: both rows shown
    assert "0.700" in format_results(run, tmp_path)


def test_timings_of_a_busy_machine_are_flagged(tmp_path):
    from attngym.results import format_results

    calm = {"status": "ok", "fwd_ms": 10.0, "fwd_ms_min": 9.5, "fwd_ms_max": 11.0}
    assert "warning" not in format_results(calm, tmp_path)
    busy = {**calm, "fwd_ms_max": 25.0}
    assert "warning: timed forwards spread 9.50-25.0 ms (2.6x)" in format_results(busy, tmp_path)


def test_the_results_table_fits_a_terminal_and_says_slower_below_1(tmp_path):
    from attngym.results import format_results

    run = {
        "status": "ok",
        "variant": "causal",
        "device": "cpu",
        "seq_len": 1024,
        "flex_over_best_sdpa_fwd": 0.096,
        "best_sdpa_fwd": "sdpa",
        "flex_over_sdpa_dense_mask_fwd": 2.5,
        "bwd_status": "not available: FlexAttention has no CPU backward",
    }
    text = format_results(run, tmp_path)
    assert max(len(line) for line in text.splitlines() if str(tmp_path) not in line) <= 100
    assert "0.0960 (10.4x slower)" in text and "2.50\n" in text + "\n"
    assert "context-parallel" not in text  # a single run's table carries no CP note


def test_torchrun_ranks_tag_their_terminal_lines():
    from attngym.runner import job

    handler = logging.StreamHandler()
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        job._tag_console(3)
        record = logging.LogRecord("x", logging.INFO, __file__, 1, "hello", None, None)
        assert "[rank3][INFO] hello" in handler.format(record)
    finally:
        root.removeHandler(handler)


def test_profile_run_writes_a_profile_pstats_loads(tmp_path, attngym_cli):
    import pstats

    run_dir = tmp_path / "run"
    proc = attngym_cli([*SMALL, "profile_run=true", f"hydra.run.dir={run_dir}"], tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    functions = {name for _, _, name in pstats.Stats(str(run_dir / "run_profile.prof")).stats}
    assert "_run_locked" in functions, len(functions)
    assert "_run_locked" in (run_dir / "run_profile.txt").read_text()
