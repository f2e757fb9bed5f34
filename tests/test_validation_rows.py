"""Validation reaches every row that matters and judges each on its own.

A sample of a long sequence misses the rows where schemes go wrong (a shard's first rows, a
piece's edge), one wrong row among hundreds is diluted below the norm's tolerance, and a kernel
that is right when validated may be wrong when timed. Each is planted here in the real paths: a
user's CP scheme run by the CLI on 2 CPU ranks, CPU flex in bfloat16.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from test_tasks_single import settings as single_settings

from attngym import kernels
from attngym.distributed import plan
from attngym.inputs import make_inputs
from attngym.runner.config import Benchmark, Shape
from attngym.runner.tasks import single
from attngym.validation import ROW_RTOL, RTOL, judge_errors, sample_rows, validate_rows
from attngym.variants.spec import build_variant


def test_every_ranks_first_and_last_query_blocks_and_every_pieces_edges_are_validated():
    layout = plan("zigzag", 2, 4096)  # rank 0: chunks 0 and 3 of 1024 rows, rank 1: 1 and 2
    rows = set(sample_rows(4096, 16, 0, "cpu", shards=layout.placement, block=128).tolist())
    for first, last in ((0, 1024), (3072, 4096), (1024, 2048), (2048, 3072)):
        assert {first, last - 1} <= rows  # both edges of every piece
    # Rank 0's shard is rows 0..1023 then 3072..4095: its first and last query blocks.
    assert set(range(128)) | set(range(3968, 4096)) <= rows
    assert set(range(1024, 1152)) | set(range(2944, 3072)) <= rows  # rank 1's
    # Rows a pieceless sample reaches alone: the sequence's edges, and the seeded sample.
    assert {0, 4095} <= set(sample_rows(4096, 16, 0, "cpu").tolist())
    assert sample_rows(64, 128, 0, "cpu").tolist() == list(range(64))  # all rows of a short one


def _flex(variant, q, k, v):
    """`attend` for validate_rows: CPU flex, the kernel a single-device CPU run validates."""
    block_mask = kernels.make_block_mask(variant, q.shape[2], k.shape[2], block_size=(128, 128),
                                         device=torch.device("cpu"))  # fmt: skip

    def attend(g_masked):
        out, lse = kernels.attend_chunk(q, k, v, variant, backend="flex", block_mask=block_mask)
        return out, lse, None

    return attend


def test_one_wrong_row_fails_although_the_norm_over_every_row_passes():
    # bf16 at S=4096: row 3001 copied over row 3000, which is validated. Over ~500 rows the norm
    # barely moves (a correct run is ~2.3e-3 of RTOL's 2e-2), while that row is wrong by ~1.4
    # of its scale.
    variant = build_variant({"name": "causal"})
    shape = Shape(batch=1, heads=2, seq_len=4096, head_dim=64)
    q, k, v, g = make_inputs(shape, 0, "cpu", torch.bfloat16)
    right = _flex(variant, q, k, v)
    rows = sample_rows(4096, 256, 0, "cpu", block=128)
    rows = torch.cat([rows, torch.tensor([3000])]).unique()

    def wrong(g_masked):
        out, lse, _ = right(g_masked)
        out[:, :, 3000] = out[:, :, 3001]
        return out, lse, None

    kw = {"do_bwd": False, "rows": rows, "rows_at_once": 256}
    ok, _ = validate_rows(variant, q, k, v, g, right, **kw)
    assert ok["validation"] == "ok" and ok["err_out_row_rel"] < ROW_RTOL["bfloat16"] / 5
    bad, _ = validate_rows(variant, q, k, v, g, wrong, **kw)
    assert bad["err_out_rel"] < RTOL["bfloat16"]  # the norm alone would pass it
    assert bad["validation"].startswith("failed: err_out_row_rel=")
    assert bad["err_out_row_rel"] > 0.5


def test_a_rows_scale_is_not_its_norm_so_small_head_dims_do_not_fail_a_right_kernel():
    # head_dim 1: a row's output is one number, near 0 by chance on many rows; over its own
    # norm a correct bf16 row's error reaches ~10, over its scale it stays the dtype's rounding.
    variant = build_variant({"name": "causal"})
    shape = Shape(batch=1, heads=4, seq_len=1024, head_dim=1)
    q, k, v, g = make_inputs(shape, 0, "cpu", torch.bfloat16)
    rows = sample_rows(1024, 512, 0, "cpu")
    m, _ = validate_rows(variant, q, k, v, g, _flex(variant, q, k, v), do_bwd=False, rows=rows,
                         rows_at_once=100)  # fmt: skip
    assert m["validation"] == "ok", m
    assert m["validated_rows"] == 512


def test_the_reference_rows_at_a_time_change_nothing_but_memory():
    variant = build_variant({"name": "sliding_window", "window_size": 32})
    shape = Shape(batch=1, heads=2, kv_heads=1, seq_len=256, head_dim=16)
    q, k, v, g = make_inputs(shape, 3, "cpu", torch.float32, requires_grad=True)

    def attend(g_masked):
        from attngym import reference

        out, lse = reference.attention(q, k, v, None, variant.mask_mod)
        return out, lse, torch.autograd.grad(out, (q, k, v), g_masked)

    rows = sample_rows(256, 40, 3, "cpu", block=16)
    one, _ = validate_rows(variant, q, k, v, g, attend, do_bwd=True, rows=rows, rows_at_once=1000)
    many, _ = validate_rows(variant, q, k, v, g, attend, do_bwd=True, rows=rows, rows_at_once=7)
    for name in ("err_out_rel", "err_out_row_rel", "err_dq_rel", "err_dk_rel", "err_dv_rel"):
        assert many[name] == pytest.approx(one[name], rel=1e-6, abs=1e-12), name
    assert one["validation"] == many["validation"] == "ok"


def test_row_errors_are_judged_at_their_own_tolerance():
    assert judge_errors({"err_out_row_rel": 0.04}, "bfloat16") == "ok"
    assert judge_errors({"err_out_row_rel": 0.06}, "bfloat16").startswith(
        "failed: err_out_row_rel=0.06 > 0.05"
    )
    assert judge_errors({"err_timed_out_rel": 2e-3}, "float32").startswith("failed")


def test_a_single_run_whose_later_calls_differ_fails(tmp_path, monkeypatch):
    # Flex itself takes no user state, so the stale buffer is planted in the kernel call: right on
    # the first call and the validated one, wrong on every later (timed) call.
    calls = []
    attend_chunk = kernels.attend_chunk

    def stale(*args, **kwargs):
        calls.append(1)
        out, lse = attend_chunk(*args, **kwargs)
        return (out if len(calls) <= 2 else out + 0.5), lse

    monkeypatch.setattr(kernels, "attend_chunk", stale)
    settings = single_settings({"name": "causal"}, baselines=(), benchmark=Benchmark(repeats=2))
    m = single.run(settings, tmp_path)
    assert m["validation"].startswith(
        "failed: a timed call's output is not the validated call's: err_timed_out_rel="
    ), m["validation"]
    assert m["err_out_rel"] < 1e-5  # the validated call itself was right
    monkeypatch.setattr(kernels, "attend_chunk", attend_chunk)
    assert single.run(settings, tmp_path)["err_timed_out_rel"] == 0.0  # a right kernel: equal


SCHEME = '''
import torch
import torch.distributed as dist
from attngym.distributed.schemes.ring import ring_attention

CALLS = []


def _at(layout, rank, out, lo, hi):
    """(1, 1, n, 1): which rows of this rank's shard lie at global positions lo..hi."""
    positions = layout.positions(rank)
    return ((positions >= lo) & (positions <= hi)).view(1, 1, -1, 1).to(out.dtype)


def wrong_rows(q, k, v, variant, *, group, layout, **kwargs):
    """The ring, with rows 510..515 (around rank 1's first row) shifted by 0.5."""
    out = ring_attention(q, k, v, variant, group=group, layout=layout, **kwargs)
    return out + 0.5 * _at(layout, dist.get_rank(group), out, 510, 515)


def wrong_grads(q, k, v, variant, *, group, layout, **kwargs):
    """The ring, its output right, its gradients 1.5 times too large on rows 510..515."""
    out = ring_attention(q, k, v, variant, group=group, layout=layout, **kwargs)
    at = _at(layout, dist.get_rank(group), out, 510, 515)
    return out + 0.5 * at * (out - out.detach())


def stale_later(q, k, v, variant, *, group, layout, **kwargs):
    """Right on a rank's first two calls (the first call, the validated one), then wrong."""
    CALLS.append(1)
    out = ring_attention(q, k, v, variant, group=group, layout=layout, **kwargs)
    return out if len(CALLS) <= 2 else out * 1.01
'''


SMALL_CP = (
    "topology=custom topology.world_size=2 shape.seq_len=1024 shape.heads=1 shape.head_dim=16 "
    "benchmark.warmup=1 benchmark.repeats=1 baselines=[] logger=none"
)


@pytest.mark.parametrize(
    ("scheme", "failed"),
    [
        ("wrong_rows", "failed: err_out_rel="),
        ("wrong_grads", "failed: err_dq_rel="),
        ("stale_later", "failed: a timed call's output is not the validated call's"),
    ],
)
def test_a_schemes_wrong_rows_at_a_shard_boundary_or_on_later_calls_fail(tmp_path, scheme, failed):
    (tmp_path / "badcp.py").write_text(SCHEME)
    run_dir = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "attngym", f"topology.scheme=badcp.{scheme}", *SMALL_CP.split()]
        + [f"hydra.run.dir={run_dir}"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
        env={**os.environ, "ATTNGYM_PROGRESS": "0", "PYTHONPATH": str(tmp_path)},
    )
    m = json.loads((run_dir / "metrics.json").read_text())
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert m["status"] == "failed" and m["validation"].startswith(failed), m["validation"]
