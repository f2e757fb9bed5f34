"""attngym.timeline: phases that add up to the wall time, compile counts, the closing line."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from attngym import timeline


@pytest.fixture
def clock():
    tl = timeline.begin()
    yield tl
    timeline.end()


def test_phases_are_exclusive_and_add_up_to_the_wall_time(clock):
    with timeline.phase("first_call"):
        time.sleep(0.05)
        with timeline.phase("validation"):  # pauses first_call
            time.sleep(0.1)
        time.sleep(0.05)
    time.sleep(0.02)
    m = clock.metrics()
    assert m["phase_validation_s"] == pytest.approx(0.1, abs=0.04)
    assert m["phase_first_call_s"] == pytest.approx(0.1, abs=0.04)
    phases = sum(v for k, v in m.items() if k.startswith("phase_"))
    assert phases == pytest.approx(m["wall_s"], abs=0.005)


def test_a_rank_process_phases_come_out_of_the_phase_that_waited_for_it(clock):
    with timeline.phase("ranks_start"):
        time.sleep(0.1)
        clock.add({"phase_first_call_s": 0.06, "phase_timed_s": 0.02, "compiles": 3})
    m = clock.metrics()
    assert m["phase_ranks_start_s"] == pytest.approx(0.02, abs=0.03)
    assert (m["phase_first_call_s"], m["phase_timed_s"], m["compiles"]) == (0.06, 0.02, 3)


def test_the_startup_before_the_job_counts_from_the_process_start():
    tl = timeline.begin(time.perf_counter() - 1.5)
    try:
        m = tl.metrics()
    finally:
        timeline.end()
    assert m["phase_startup_s"] == pytest.approx(1.5, abs=0.05)
    assert m["wall_s"] >= 1.5
    assert timeline.process_start() < time.perf_counter()


def test_no_timeline_no_cost():
    assert timeline.current() is None
    with timeline.phase("validation"):  # a task called outside a job: nothing recorded
        pass


def test_recompiles_count_dynamo_frames_compiled_again_not_a_lazy_backward(clock):
    from torch._dynamo.callback import CallbackArgs, CallbackTrigger

    for trigger, compile_id in [
        (CallbackTrigger.DYNAMO, "0/0"),  # first compile of a frame
        (CallbackTrigger.LAZY_BACKWARD, "0/0"),  # its backward, compiled at first call
        (CallbackTrigger.DYNAMO, "0/1"),  # the frame again: a recompile
    ]:
        timeline._on_compile_start(CallbackArgs(trigger, compile_id))
        timeline._on_compile_end(CallbackArgs(trigger, compile_id))
    m = clock.metrics()
    assert (m["compiles"], m["recompiles"]) == (3, 1)


def test_a_real_recompile_is_counted_with_dynamos_reason(clock, caplog):
    import logging

    import torch

    fn = torch.compile(lambda x: x * 2, backend="eager")
    fn(torch.ones(3))
    with torch.no_grad():  # another grad mode: Dynamo compiles the frame again
        fn(torch.ones(3))
    with caplog.at_level(logging.DEBUG, logger="attngym.timeline"):
        fn(torch.ones(3, 4))
    m = clock.metrics()
    assert m["recompiles"] >= 2
    levels = {r.levelno for r in caplog.records if "recompiles" in r.getMessage()}
    # said where CUDA runs; a CPU's cheap traces go to the debug log only
    assert levels == ({logging.INFO, logging.DEBUG} if cuda_used() else {logging.DEBUG})


def cuda_used() -> bool:
    import torch

    return torch.cuda.is_initialized()


def test_the_closing_line_names_the_largest_three():
    metrics = {
        "wall_s": 23.4,
        "phase_first_call_s": 12.1,
        "phase_tracker_s": 2.0,
        "phase_baseline_sdpa_cudnn_s": 3.2,
        "phase_files_s": 0.01,
        "recompiles": 2,
    }
    assert timeline.largest(metrics) == (
        "wall 23.4 s, most in first_call 12.1 s, baseline_sdpa_cudnn 3.2 s, tracker 2.0 s; "
        "2 recompiles (see the log)"
    )
    assert timeline.largest({}) == ""
    assert "recompiles" not in timeline.largest({**metrics, "device": "cpu"})
    assert "PYTHONDONTWRITEBYTECODE" in timeline.largest({**metrics, "bytecode_kept": False})
    assert "PYTHONDONTWRITEBYTECODE" not in timeline.largest({**metrics, "bytecode_kept": True})


def test_bytecode_is_kept_unless_writing_is_off_and_none_is_there(tmp_path, monkeypatch):
    """A container's PYTHONDONTWRITEBYTECODE=1 with no bytecode shipped makes every run compile
    torch's sources again; kept where writing is on, or where the bytecode is there to read."""
    import importlib
    import py_compile

    source = tmp_path / "a_module_for_bytecode.py"
    source.write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    module = importlib.import_module("a_module_for_bytecode")
    monkeypatch.delitem(sys.modules, "a_module_for_bytecode")
    assert not Path(module.__spec__.cached).exists()
    assert timeline.bytecode_kept(module) is False
    monkeypatch.setattr(sys, "dont_write_bytecode", False)
    assert timeline.bytecode_kept(module) is True  # the next process writes it
    monkeypatch.setattr(sys, "dont_write_bytecode", True)
    py_compile.compile(str(source), cfile=module.__spec__.cached)
    assert timeline.bytecode_kept(module) is True  # shipped: read, not compiled
    assert timeline.bytecode_kept(None) is True  # torch not imported: nothing to say
    assert "bytecode_kept" in timeline.Timeline().metrics()
