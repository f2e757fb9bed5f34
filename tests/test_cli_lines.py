"""What attngym prints fits a terminal of 100 columns: --help (its config groups and the
attention options with their parameters wrapped), a refused option (the option meant first, the
options cut short), a sweep's launch lines (the shared overrides once, each job's as typed)."""

from __future__ import annotations

import re

from test_cli import SMALL

from attngym.runner.overrides import LINE_WIDTH, group_options, launch_lines, unknown_option


def _too_wide(text: str) -> list[str]:
    return [line for line in text.splitlines() if len(line) > LINE_WIDTH]


def test_help_fits_100_columns_and_still_lists_every_option(attngym_cli, tmp_path):
    proc = attngym_cli(["--help"], tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert _too_wide(proc.stdout) == []
    groups = proc.stdout.split("== Config groups ==")[1].split("Attention options")[0]
    listed = re.findall(r"[\w/]+", groups.split("\n", 1)[1].split("block_size:")[0])
    assert listed[1:] == group_options("attention")  # after "attention", every option in order
    for name in group_options("attention"):  # each with its parameters
        assert re.search(rf"^  {name} ", proc.stdout, re.M), name
    assert "svg_spatial" in proc.stdout and "prompt_length" in proc.stdout


def test_a_refused_option_names_the_meant_one_first_and_cuts_the_list(attngym_cli, tmp_path):
    proc = attngym_cli(["attention=causl"], tmp_path)
    assert proc.returncode == 2
    (line,) = proc.stderr.splitlines()
    assert line.startswith("attngym: error: attention: unknown option 'causl' (did you mean ")
    assert "'causal'?); options: alibi, " in line and "in all: attngym --help)" in line
    assert len(line) < 2 * LINE_WIDTH  # 43 options made 800 characters
    # A short list is given whole, a long one cut where cutting makes it shorter.
    assert unknown_option("device", "gpuu", ["auto", "cpu", "cuda"]).endswith("auto, cpu, cuda")
    many = [f"option_{i:02d}" for i in range(40)]
    assert unknown_option("g", "x", many).endswith("option_02, ... (40 in all: attngym --help)")


def test_a_sweeps_launch_lines_fit_and_show_what_was_typed(attngym_cli, tmp_path):
    (tmp_path / "longmods.py").write_text(
        "def a_rather_long_mask_function_name_for_a_test(b, h, q_idx, kv_idx):\n"
        "    return q_idx >= kv_idx\n"
    )
    long_path = "longmods.a_rather_long_mask_function_name_for_a_test"
    args = ["-m", *SMALL, "attention=custom", f"attention.mask_mod={long_path}"]
    args += ["shape.seq_len=64,128", "logger=none", f"hydra.sweep.dir={tmp_path / 'sweep'}"]
    proc = attngym_cli(args, tmp_path, env={"PYTHONPATH": "."})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    out = proc.stdout + proc.stderr
    launch = [ln for ln in out.splitlines() if "[HYDRA] \t#" in ln]
    assert [ln.split("\t")[1] for ln in launch] == [
        "#0 : shape.seq_len=64",
        "#1 : shape.seq_len=128",
    ]
    assert "Launching 2 jobs locally, each with:\n    device=cpu shape.heads=2 " in out
    head = out[out.index("Launching") : out.index("#0 :")]
    assert _too_wide(head) == [] and "++" not in head and long_path in head
    # One job's overrides too long for a line are cut, as typed.
    shared, (line,) = launch_lines([["++attention.mask_mod=" + "m." + "x" * 200]])
    assert shared == "" and line.startswith("attention.mask_mod=m.xxx") and line.endswith("...")
    assert len(f"[00:00:00][HYDRA] \t#0 : {line}") <= LINE_WIDTH
