"""A forward-only CPU run says what concerns it only: no FLASH refusal (FLASH is a CUDA kernel),
no note meant for context-parallel runs, no `torch.compile recompiles` of eager flex's traces."""

from __future__ import annotations


def test_a_forward_only_cpu_run_and_sweep_print_no_noise(tmp_path, attngym_cli):
    common = ["device=cpu", "logger=none", "benchmark.repeats=1"]
    run = attngym_cli([*common, "shape.seq_len=256", f"hydra.run.dir={tmp_path / 'run'}"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    said = run.stdout + run.stderr
    assert "attngym: ok" in said and "not available: FlexAttention has no CPU backward" in said
    assert "FLASH" not in said and "context-parallel" not in said
    sweep = attngym_cli(
        ["-m", *common, "shape.seq_len=128,256", "attention=causal,sliding_window",
         f"hydra.sweep.dir={tmp_path / 'sweep'}"],
        tmp_path,
    )  # fmt: skip
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    said = sweep.stdout + sweep.stderr
    assert "4 jobs, 0 failed" in said
    assert "recompiles" not in said  # eager flex traced anew per shape: in the debug log only
