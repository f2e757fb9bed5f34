"""Peers wait for rank 0's long local work, each wait bounded by `timeout_s`, not by the work.

Rank 0 alone computes the float64 reference and the one-device comparison of a context-parallel
run, which can take much longer than `topology.timeout_s`; its peers wait. A barrier on a group
with a longer timeout bounds nothing (a stopped rank 0 leaves them waiting for that long).
Instead, every rank enters `rank0_work(timeout_s)` around that work:

    with rank0_work(timeout_s):
        if rank == 0:
            reference()          # as long as it takes

Contract:
    * Group: a gloo group of every rank with timeout `timeout_s`, built once per default group
      and timeout and used by nothing else, so its collectives are always in this order.
    * Rank 0: while inside, a daemon thread broadcasts 1 ("still working") on that group every
      `timeout_s / 4`; on leaving it stops the thread and broadcasts 0 ("done").
    * Other ranks: on leaving they receive broadcasts until the 0. Each receive waits at most
      `timeout_s` (the group's timeout): a rank 0 that is stopped, dead or cannot run its thread
      makes that receive fail, and the peer raises RankFailure naming rank 0.
    * A peer that dies while rank 0 works: rank 0's thread records the failure and rank 0 raises
      RankFailure when it leaves (its main thread cannot be interrupted in native code; a spawned
      run's caller stops it earlier, see attngym.distributed.ranks.launch).
    * Nothing is waited on with a timeout longer than `timeout_s`; on CPU and CUDA alike (the
      broadcasts are one-element CPU tensors).
"""

from __future__ import annotations

import contextlib
import datetime
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from attngym.errors import RankFailure

# Default group -> {timeout_s: the keep-alive group}.
_GROUPS: weakref.WeakKeyDictionary[Any, dict[float, Any]] = weakref.WeakKeyDictionary()


def _group(timeout_s: float):
    import torch.distributed as dist

    groups = _GROUPS.setdefault(dist.group.WORLD, {})
    if timeout_s not in groups:
        groups[timeout_s] = dist.new_group(
            backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)
        )
    return groups[timeout_s]


@contextlib.contextmanager
def rank0_work(timeout_s: float) -> Iterator[None]:
    """Enter on every rank around work only rank 0 does; see the module docstring.

    Raises:
        RankFailure: on a peer, rank 0 made no sign of life for `timeout_s`; on rank 0, a peer
            stopped taking its signs of life.
    """
    import torch
    import torch.distributed as dist

    group = _group(float(timeout_s))
    if dist.get_rank() != 0:
        yield
        flag = torch.ones(1, dtype=torch.int32)
        while int(flag) != 0:
            try:
                dist.broadcast(flag, src=0, group=group)
            except RuntimeError as err:
                raise RankFailure(
                    f"rank 0 gave no sign of life for {timeout_s:g} s (topology.timeout_s) "
                    f"while rank {dist.get_rank()} waited for its work: {err}"
                ) from err
        return

    stop = threading.Event()
    failures: list[BaseException] = []

    def keep_alive() -> None:
        while not stop.wait(timeout_s / 4):
            try:
                dist.broadcast(torch.ones(1, dtype=torch.int32), src=0, group=group)
            except RuntimeError as err:
                failures.append(err)
                return

    thread = threading.Thread(target=keep_alive, name="attngym-rank0-work", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
    if failures:
        raise RankFailure(
            f"a peer stopped waiting for rank 0's work (topology.timeout_s={timeout_s:g}): "
            f"{failures[0]}"
        ) from failures[0]
    dist.broadcast(torch.zeros(1, dtype=torch.int32), src=0, group=group)
