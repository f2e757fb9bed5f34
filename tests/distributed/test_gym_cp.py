"""attention-gym's options through ring and all-gather attention on 2 CPU ranks (gloo).

Each conf/attention/gym_* option is composed by Hydra in the test process (its entry is plain
data, so it crosses to the ranks), rebuilt on each rank (its factories called there again, as a
context-parallel run does) and run through both algorithms, each on a layout in turn, at 8-token
blocks over 16-row shards, against the whole-sequence float64 reference: output and dq, dk, dv.
The tolerance is test_cp_cpu's (float64 throughout, so only the order of a few sums differs).
"""

from __future__ import annotations

import pytest

pytest.importorskip("attn_gym", reason="attention-gym is not installed: pip install 'attngym[gym]'")

from attngym.distributed import allgather_attention, ring_attention  # noqa: E402
from attngym.distributed.ranks.launch import launch  # noqa: E402
from attngym.variants.spec import build_variant  # noqa: E402

from .gym_options import HEADS, S, compose_entries, options  # noqa: E402
from .test_cp_cpu import TOL, _parity  # noqa: E402

# Options that cannot run under context parallelism, and why: none. Every generator of one
# sequence reads global positions and tables covering the whole sequence, which is what ring and
# all-gather give each rank's callbacks.
NO_CP: dict[str, str] = {}


def _gym_worker(rank, world_size, entries):
    layouts = ("contiguous", "zigzag", "balanced")
    errors = {}
    for n, (option, entry) in enumerate(sorted(entries.items())):
        variant = build_variant(entry, seq_len=S, heads=HEADS)
        for fn, layout in (
            (ring_attention, layouts[n % 3]),
            (allgather_attention, layouts[(n + 1) % 3]),
        ):
            errors.update(
                _parity(
                    rank, world_size, option, variant, HEADS, (4, 2)[n % 2], (fn,), (layout,),
                    block_size=(8, 8),
                )
            )  # fmt: skip
    return errors


@pytest.mark.slow
def test_every_gym_option_through_ring_and_allgather_matches_reference():
    entries = {o: e for o, e in compose_entries().items() if o not in NO_CP}
    assert sorted(entries) + sorted(NO_CP) == sorted(options())
    errors = launch(_gym_worker, 2, args=(entries,), timeout_s=300)
    assert len(errors) == 2 * len(entries)
    bad = {case: errs for case, errs in errors.items() if max(errs) >= TOL}
    assert bad == {}, f"max |err| of out, dq, dk, dv: {bad}"
