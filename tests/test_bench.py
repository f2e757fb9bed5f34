"""FLOP accounting, block sparsity, the timer and the progress bar it can draw."""

from __future__ import annotations

import inspect
import io
import time

import pytest
import torch

from attngym import bench, progress, utils

EMPTY = inspect.Parameter.empty


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def test_seed_signatures():
    params = inspect.signature(utils.calculate_tflops).parameters.values()
    assert [(p.name, p.default) for p in params] == [
        ("batch", EMPTY),
        ("heads", EMPTY),
        ("seq_q", EMPTY),
        ("seq_kv", EMPTY),
        ("head_dim", EMPTY),
        ("time_ms", EMPTY),
        ("sparsity", 0.0),
    ]
    params = list(
        inspect.signature(utils.benchmark_cuda_function_in_microseconds).parameters.values()
    )
    assert [(p.name, p.kind) for p in params] == [
        ("func", inspect.Parameter.POSITIONAL_OR_KEYWORD),
        ("args", inspect.Parameter.VAR_POSITIONAL),
        ("kwargs", inspect.Parameter.VAR_KEYWORD),
    ]


def test_calculate_tflops_hand_example():
    # 4 * 2 * 4 * 1024 * 2048 * 64 = 4_294_967_296 FLOPs, 25% skipped: 3_221_225_472 in 2 ms.
    assert utils.calculate_tflops(2, 4, 1024, 2048, 64, 2.0, sparsity=0.25) == pytest.approx(
        1.610612736
    )
    assert utils.calculate_tflops(1, 1, 1000, 1000, 100, 1.0) == pytest.approx(0.4)


def test_calculate_tflops_takes_numpy_and_torch_integers_as_attention_gym_does():
    import numpy as np

    sizes = (2, 4, 1024, 2048, 64)
    expected = utils.calculate_tflops(*sizes, 2.0, sparsity=0.25)
    assert utils.calculate_tflops(*map(np.int64, sizes), 2.0, sparsity=0.25) == expected
    assert utils.calculate_tflops(*(torch.tensor(n) for n in sizes), 2.0, 0.25) == expected
    for bad in (2.0, True, "2"):  # not an integer: refused by name, not miscounted
        with pytest.raises(ValueError, match="batch must be a non-negative integer"):
            utils.calculate_tflops(bad, 4, 1024, 2048, 64, 2.0)


def test_attention_flops_pass_ratios():
    fwd = bench.attention_flops(2, 8, 4096, 4096, 128)
    assert fwd == 4.0 * 2 * 8 * 4096 * 4096 * 128
    assert bench.attention_flops(2, 8, 4096, 4096, 128, passes=("bwd",)) == pytest.approx(2.5 * fwd)
    both = bench.attention_flops(2, 8, 4096, 4096, 128, passes=("fwd", "bwd"))
    assert both == pytest.approx(3.5 * fwd)
    half = bench.attention_flops(2, 8, 4096, 4096, 128, sparsity=0.5, passes=("fwd", "bwd"))
    assert half == pytest.approx(both / 2)
    assert bench.tflops(2e12, 1000.0) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: bench.attention_flops(1, 1, 8, 8, 8, sparsity=1.5), "sparsity"),
        (lambda: bench.attention_flops(1, 1, 8, 8, 8, passes=("fwd", "back")), "passes"),
        (lambda: bench.attention_flops(1, -1, 8, 8, 8), "heads"),
        (lambda: bench.tflops(1e9, 0.0), "time_ms"),
        (lambda: bench.time_fn(lambda: None, repeats=0), "repeats"),
        (lambda: bench.time_fn(lambda: None, warmup=-1), "warmup"),
        (lambda: bench.time_fn(lambda: None, device="gpu"), "device"),
    ],
)
def test_bad_input_is_rejected_by_name(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_sparsity_of_a_causal_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(causal, None, None, 1024, 1024, device="cpu", BLOCK_SIZE=(128, 128))
    # 8 x 8 blocks, the 36 on or below the diagonal are computed.
    assert bench.block_sparsity(bm) == pytest.approx(28 / 64)
    assert bench.block_sparsity(None) == 0.0


def test_block_sparsity_with_a_ragged_end_and_heads():
    from torch.nn.attention.flex_attention import create_block_mask

    def window(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 64 * (h + 1)

    bm = create_block_mask(window, 1, 2, 1000, 1000, device="cpu", BLOCK_SIZE=(128, 128))
    computed = bm.kv_num_blocks.sum() + bm.full_kv_num_blocks.sum()
    assert bench.block_sparsity(bm) == pytest.approx(1 - float(computed) / (2 * 8 * 8))


def test_time_fn_on_cpu(rng):
    a = torch.randn(128, 128, generator=rng)
    calls = []

    def work():
        calls.append(1)
        return a @ a

    timing = bench.time_fn(work, warmup=3, repeats=4, device="cpu")
    assert len(calls) == 7  # warm-up calls run, untimed
    assert isinstance(timing, bench.Timing)
    assert timing.repeats == 4 and len(timing.all_ms) == 4
    assert all(t > 0 for t in timing.all_ms)
    assert timing.min_ms <= timing.median_ms <= timing.max_ms
    assert timing.min_ms == min(timing.all_ms) and timing.max_ms == max(timing.all_ms)


def test_time_fn_draws_progress_on_a_terminal(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("ATTNGYM_PROGRESS", raising=False)
    timing = bench.time_fn(lambda: None, warmup=0, repeats=3, device="cpu", progress="fwd")
    assert timing.repeats == 3
    assert "fwd:" in err.getvalue() and "0/3" in err.getvalue()


def test_benchmark_function_in_microseconds_runs(rng):
    a = torch.randn(64, 64, generator=rng)
    us = utils.benchmark_cuda_function_in_microseconds(torch.matmul, a, a)
    assert isinstance(us, float) and us > 0


@pytest.mark.gpu
def test_time_fn_on_cuda():
    a = torch.randn(1024, 1024, device="cuda")
    timing = bench.time_fn(lambda: a @ a, warmup=1, repeats=3, device="cuda")
    assert timing.repeats == 3 and all(t > 0 for t in timing.all_ms)
    assert utils.benchmark_cuda_function_in_microseconds(torch.matmul, a, a) > 0


@pytest.mark.gpu
def test_stream_time_on_cuda_parts_the_host_from_the_device():
    """Many tiny kernels: the host takes longer to issue them than the device to run them (the
    case time_fn cannot part); one large matmul: the device's time, the host's small."""
    x = torch.randn(64, device="cuda")

    def tiny():
        for _ in range(200):
            x.add_(1.0)

    small = bench.stream_time(tiny, warmup=1, repeats=3, device="cuda")
    assert small.host_ms > small.gpu_ms > 0
    a = torch.randn(8192, 8192, device="cuda")
    big = bench.stream_time(lambda: a @ a, warmup=1, repeats=3, device="cuda")
    assert big.gpu_ms > 10 * big.host_ms
    timed = bench.time_fn(lambda: a @ a, warmup=1, repeats=3, device="cuda").median_ms
    assert big.gpu_ms == pytest.approx(timed, rel=0.2)  # device-bound: the two timers agree


# --------------------------------------------------------------------------------------------
# progress bar


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_draws_a_bar_on_a_terminal(monkeypatch):
    err = _Terminal()
    monkeypatch.setattr("sys.stderr", err)
    monkeypatch.delenv("ATTNGYM_PROGRESS", raising=False)
    assert list(progress.progress(iter("abc"), total=3, label="x")) == ["a", "b", "c"]
    assert "x:" in err.getvalue() and "0/3" in err.getvalue()  # tqdm redraws at most 10/s


def test_progress_reports_in_lines_when_redirected(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.delenv("ATTNGYM_PROGRESS", raising=False)
    caplog.set_level("INFO", logger="attngym.progress")
    with progress.Progress(4, "sweep jobs", interval=0.01) as bar:
        bar.running("attention=causal")
        bar.update()
        assert bar.line().startswith("sweep jobs: 1/4 done, running attention=causal, 0:00:0")
        assert "ETA" in bar.line()
        time.sleep(0.2)  # the timer thread reports a running phase every interval
    lines = [r.getMessage() for r in caplog.records]
    # The timer may tick before the update (a loaded machine): 0/4 then, 1/4 after it.
    assert any(line.startswith("sweep jobs: 1/4 done, running attention=causal") for line in lines)
    assert all(line.startswith(("sweep jobs: 0/4 done", "sweep jobs: 1/4 done")) for line in lines)


@pytest.mark.parametrize("env", ["0", None])
def test_progress_is_silent_when_disabled_or_short(monkeypatch, caplog, env):
    err = _Terminal() if env == "0" else io.StringIO()
    monkeypatch.setattr("sys.stderr", err)
    if env is None:
        monkeypatch.delenv("ATTNGYM_PROGRESS", raising=False)
    else:
        monkeypatch.setenv("ATTNGYM_PROGRESS", env)
    caplog.set_level("INFO", logger="attngym.progress")
    assert list(progress.progress(range(5), label="x")) == [0, 1, 2, 3, 4]
    assert err.getvalue() == "" and not caplog.records  # a phase under 10 s says nothing


def test_counted_progress_polls_its_count_and_says_each_change(monkeypatch, caplog):
    """A sweep whose jobs run elsewhere counts finished job folders: the count is polled, and
    redirected output gets a line whenever it changes, as for a job that ends here."""
    monkeypatch.setattr("sys.stderr", io.StringIO())
    monkeypatch.delenv("ATTNGYM_PROGRESS", raising=False)
    caplog.set_level("INFO", logger="attngym.progress")
    finished = [0]
    with progress.Progress(3, "sweep jobs", interval=0.01, counted=lambda: finished[0]) as bar:
        finished[0] = 2
        deadline = time.monotonic() + 5
        while bar.done != 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        finished[0] = 3
    assert bar.done == 3  # closing counts once more
    lines = [r.getMessage() for r in caplog.records]
    assert "sweep jobs: 2/3 done" in " ".join(lines) and lines[-1].startswith("sweep jobs: 3/3")


def test_progress_rejects_a_bad_total():
    with pytest.raises(ValueError, match="total"):
        progress.progress(range(3), total=-1)


def test_time_fn_setup_feeds_each_call_outside_the_timed_region():
    made, consumed = [], []

    def setup():
        made.append(torch.randn(3))
        return made[-1]

    timing = bench.time_fn(consumed.append, warmup=2, repeats=4, device="cpu", setup=setup)
    assert timing.repeats == 4
    assert len(made) == 6  # one fresh input per call, warm-up included
    assert all(a is b for a, b in zip(made, consumed, strict=True))


def test_a_budget_sizes_the_count_between_the_minimum_and_the_cap():
    assert bench.budget_repeats(1.0, 100.0, 5) == 100  # fills the budget
    assert bench.budget_repeats(50.0, 100.0, 5) == 5  # a slow call: the minimum
    assert bench.budget_repeats(1e-4, 100.0, 5) == bench.MAX_REPEATS  # a cheap one: the cap
    assert bench.budget_repeats(1.0, 100.0, 2000) == 2000  # the minimum wins over the cap
    assert bench.budget_repeats(1.0, None, 7) == bench.budget_repeats(1.0, 0.0, 7) == 7


def test_a_cheap_callable_fills_the_budget_and_a_slow_one_gets_the_minimum():
    cheap: list[int] = []
    timing = bench.time_fn(lambda: cheap.append(1), warmup=1, repeats=5, budget_ms=20.0,
                           device="cpu")  # fmt: skip
    assert 5 < timing.repeats <= bench.MAX_REPEATS and len(cheap) == timing.repeats + 1
    slow: list[int] = []

    def nap() -> None:
        slow.append(1)
        time.sleep(0.03)  # 30 ms a call: over the 20 ms budget alone

    timing = bench.time_fn(nap, warmup=0, repeats=5, budget_ms=20.0, device="cpu")
    assert timing.repeats == 5 and len(slow) == 6  # with no warm-up one untimed call sizes it


def test_without_a_budget_the_count_is_exactly_repeats_and_agree_can_raise_it():
    calls: list[int] = []
    timing = bench.time_fn(lambda: calls.append(1), warmup=0, repeats=3, device="cpu")
    assert timing.repeats == 3 and len(calls) == 3  # no sizing call without a budget
    agreed = bench.time_fn(lambda: None, warmup=0, repeats=3, device="cpu", agree=lambda n: n + 4)
    assert agreed.repeats == 7  # another rank's larger count


def test_time_together_interleaves_its_callables_and_leaves_out_a_failing_one():
    order: list[str] = []

    def refuses() -> None:
        raise RuntimeError("No available kernel.\nmore")

    calls = {
        "a": (lambda: order.append("a"), None),
        "b": (lambda x: order.append(x), lambda: "b"),
        "c": (refuses, None),
    }
    failures: dict[str, str] = {}
    timed = bench.time_together(calls, warmup=2, repeats=4, device="cpu", failures=failures)
    assert set(timed) == {"a", "b"} and failures == {"c": "No available kernel."}
    assert timed["a"].repeats == timed["b"].repeats == 4
    assert order == ["a", "a", "b", "b"] + ["a", "b"] * 4  # warm-ups, then rounds of one each
    with pytest.raises(RuntimeError, match="No available kernel"):
        bench.time_together({"c": (refuses, None)}, warmup=1, repeats=1, device="cpu")


def test_time_together_fills_one_budget_per_callable():
    timed = bench.time_together(
        {"a": (lambda: None, None), "b": (lambda: None, None)},
        warmup=1,
        repeats=5,
        budget_ms=10.0,
        device="cpu",
    )
    assert timed["a"].repeats == timed["b"].repeats > 5  # no-op calls: far more than 5 rounds
