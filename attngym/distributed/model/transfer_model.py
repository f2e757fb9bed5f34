"""How long a context-parallel call takes on P ranks, from per-rank compute and a transfer model.

The simulated ranks (attngym.distributed.model.simulate) time each rank's compute on one device;
each scheme prices its ranks (its TopologySpec's `price`: how its transfers overlap its compute, a
rank-time function of its own module given to `predict`) on a `Fabric` from this module, which
names what limits the call. The call ends when its slowest rank ends: the prediction is the
largest rank time, each rank taking the longer of its device timeline and its host's time to
issue its kernels (a rank of small kernels is bound by its host). Ranks are modelled
independently (a rank never waits for a slower neighbour), which is exact for the
gather-then-compute schemes and optimistic for a ring whose ranks are unevenly loaded.

A `Fabric` turns bytes into milliseconds per transfer pattern (channel: one ring step,
point to point; allgather; alltoall), indexed by the bytes one rank receives. A two-level fabric
is a real cluster: NVLink domains of `domain_size` GPUs (8 on an HGX H100/H200 node, 72 on a
GB200 NVL72 rack) joined by `across` (InfiniBand or RoCE); a transfer whose bytes partly come
from another domain takes the longer of its two parts (`crossing`, the share from outside, is
each scheme's to say: `neighbour_crossing`, `collective_crossing`). `fabric` names the measured
one (two H200s, per transport), the stated assumptions and a user's numbers (custom).
Pure Python: no torch.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

Pattern = Literal["channel", "allgather", "alltoall"]
PATTERNS: tuple[Pattern, ...] = ("channel", "allgather", "alltoall")
Bottleneck = Literal["compute", "transfer", "imbalance", "host"]
# Below this share of the call, neither the exposed transfer nor the imbalance is the bottleneck.
BOTTLENECK_SHARE = 0.05
MIB = 2**20

# experiments/multi_gpu_cp/transfer_bandwidth_alltoall.json (scripts/transfer_bandwidth.py
# --sizes-mib 1 16 64 256 1024 --iters 10 --repeats 3, two H200s, NV18, torch 2.11, 2026-11-30):
# (MiB a rank sends, ms) per pattern and transport, the slower rank's median. "channel" is one
# ring step (CopyEngineChannel / P2PChannel), "allgather" the K/V all-gather, "alltoall" the
# all-to-all of a (P, n) tensor (CopyEngineAllToAll.exchange / all_to_all_single).
# tests/distributed/test_simulate.py holds these numbers to that file.
H200_MEASURED: dict[str, dict[str, tuple[tuple[int, float], ...]]] = {
    "copy_engine": {
        "channel": ((1, 0.1967), (16, 0.2318), (64, 0.2417), (256, 0.8188), (1024, 2.9347)),
        "allgather": ((1, 0.2715), (16, 0.2749), (64, 0.2957), (256, 0.9071), (1024, 3.4232)),
        "alltoall": ((1, 0.2948), (16, 0.3221), (64, 0.2610), (256, 0.6241), (1024, 2.0854)),
    },
    "nccl": {
        "channel": ((1, 0.1191), (16, 0.1384), (64, 0.2784), (256, 0.9951), (1024, 3.1207)),
        "allgather": ((1, 0.0409), (16, 0.1005), (64, 0.3687), (256, 1.0986), (1024, 3.9243)),
        "alltoall": ((1, 0.0604), (16, 0.0642), (64, 0.2246), (256, 0.5255), (1024, 1.6615)),
    },
}
H200_SOURCE = (
    "experiments/multi_gpu_cp/transfer_bandwidth_alltoall.json (two H200s, NV18, 2026-11-30)"
)
# What one rank receives when it sends `x` at P=2 in the measurement: the whole of it, except the
# all-to-all, which keeps its own half.
_RECEIVED_AT_2 = {"channel": 1.0, "allgather": 1.0, "alltoall": 0.5}


@dataclasses.dataclass(frozen=True)
class Fabric:
    """Milliseconds of one transfer of a pattern, by the bytes one rank receives in it.

    Attributes:
        name: how metrics and tables name it.
        source: where the numbers come from (a file and measurement, or a stated assumption).
        curves: per pattern, (bytes received, ms) points, increasing; linear between them, the
            first point's time below it, the last segment's slope above it. A fabric given by
            latency and bandwidth has two points on that line.
    """

    name: str
    source: str
    curves: Mapping[str, tuple[tuple[float, float], ...]]
    domain_size: int | None = None
    """GPUs per NVLink domain; None: every rank in one domain (a one-level fabric)."""
    across: Fabric | None = None
    """The links between domains (two-level fabrics)."""

    def ms(self, pattern: Pattern, received_bytes: float, crossing: float = 0.0) -> float:
        """The time of one transfer in which one rank receives `received_bytes` (0: none, 0 ms),
        `crossing` of them from another domain: the NVLink part and the part across run at once,
        the longer one counts (a one-level fabric ignores `crossing`)."""
        if self.across is None or crossing <= 0:
            return self._inside(pattern, received_bytes)
        outside = self.across.ms(pattern, received_bytes * crossing)
        return max(self._inside(pattern, received_bytes * (1 - crossing)), outside)

    def neighbour_crossing(self, world_size: int, stride: int = 1) -> float:
        """The share of a neighbour exchange (a ring step) that crosses domains, for ranks
        `stride` apart: 1 once the ring leaves one domain (a relay goes at its slowest hop)."""
        if self.domain_size is None or world_size * stride <= self.domain_size:
            return 0.0
        return 1.0

    def collective_crossing(self, world_size: int, stride: int = 1) -> float:
        """The share a rank receives from other domains in a collective (all-gather, all-to-all)
        over `world_size` ranks `stride` apart, NVLink domains of consecutive ranks."""
        if self.domain_size is None or world_size <= 1:
            return 0.0
        inside = min(world_size, max(1, self.domain_size // stride))
        return (world_size - inside) / (world_size - 1)

    def _inside(self, pattern: Pattern, received_bytes: float) -> float:
        if received_bytes <= 0:
            return 0.0
        points = self.curves[pattern]
        xs = [x for x, _ in points]
        i = bisect.bisect_left(xs, received_bytes)
        if i == 0:
            return points[0][1]
        (x0, y0), (x1, y1) = points[min(i, len(points) - 1) - 1], points[min(i, len(points) - 1)]
        return y0 + (y1 - y0) * (received_bytes - x0) / (x1 - x0)


def linear_fabric(name: str, source: str, gbps: float, latency_us: float) -> Fabric:
    """A fabric of one latency and one bandwidth (GB/s = 1e9 bytes/s received per rank) for
    every pattern."""
    line = ((0.0, latency_us / 1e3), (1e9, latency_us / 1e3 + 1e3 / gbps))
    return Fabric(name, source, dict.fromkeys(PATTERNS, line))


def measured_fabric(transport: str) -> Fabric:
    """The two-H200 measurement for `transport` (copy_engine | nccl), indexed by bytes received."""
    table = H200_MEASURED[transport]
    curves = {
        pattern: tuple((mib * MIB * _RECEIVED_AT_2[pattern], ms) for mib, ms in table[pattern])
        for pattern in PATTERNS
    }
    return Fabric(f"h200_nvlink/{transport}", f"{H200_SOURCE}, {transport}", curves)


# The fabric measured per transport (H200_MEASURED): two H200s, one NVLink domain.
H200_NVLINK = "h200_nvlink"
# The named fabrics besides the measured one: stated assumptions, not measurements.
NAMED_FABRICS: dict[str, tuple[float, float, str]] = {
    # GB/s received per GPU, latency in us, and why.
    "nvlink5": (
        730.0,
        20.0,
        "assumed: NVLink 5 at 900 GB/s each way per GPU (NVIDIA's GB200 datasheet) at the 81 % "
        "the two-H200 copy-engine channel reached of NVLink 4's 450 GB/s (366 GB/s at 1 GiB); "
        "20 us per transfer",
    ),
    "infiniband": (
        45.0,
        25.0,
        "assumed: one 400 Gb/s NDR InfiniBand (or RoCE) port per GPU (50 GB/s each way) at 90 %; "
        "25 us per transfer (NCCL over IB)",
    ),
}
# Real clusters: (the fabric inside a domain, GPUs per domain, the fabric between domains, why).
TWO_LEVEL: dict[str, tuple[str, int, str, str]] = {
    "hgx_h200": (
        H200_NVLINK,
        8,
        "infiniband",
        "HGX H200 nodes: 8 GPUs on NVLink 4 (measured, h200_nvlink), one NDR port per GPU "
        "between nodes (assumed, infiniband)",
    ),
    "nvl72": (
        "nvlink5",
        72,
        "infiniband",
        "GB200 NVL72 racks: 72 GPUs on NVLink 5 (assumed, nvlink5), one NDR port per GPU "
        "between racks (assumed, infiniband)",
    ),
}
FABRIC_NAMES = (H200_NVLINK, *TWO_LEVEL, *NAMED_FABRICS, "custom")
MEASURED_TRANSPORTS = tuple(H200_MEASURED)
# Fabric -> the transports it is measured for: the measured one, and the two-level fabrics whose
# domains are it.
MEASURED_FABRICS: dict[str, tuple[str, ...]] = {
    name: MEASURED_TRANSPORTS
    for name in (H200_NVLINK, *(n for n, level in TWO_LEVEL.items() if level[0] == H200_NVLINK))
}


def domain_size(name: str) -> int | None:
    """GPUs per NVLink domain of the fabric `name` (None: one domain, whatever the ranks)."""
    return TWO_LEVEL[name][1] if name in TWO_LEVEL else None


def spans_domains(name: str, world_size: int) -> bool:
    """Whether `world_size` ranks on fabric `name` span NVLink domains (a run's auto transport
    is NCCL then, as the copy engine stays inside one)."""
    size = domain_size(name)
    return size is not None and world_size > size


def fabric(
    name: str,
    transport: str = "copy_engine",
    gbps: float | None = None,
    latency_us: float | None = None,
) -> Fabric:
    """The Fabric `name` (FABRIC_NAMES): h200_nvlink is measured per `transport` (every rank in
    one NVLink domain); hgx_h200 and nvl72 are two-level (TWO_LEVEL: the run's transport inside a
    domain where measured); nvlink5 and infiniband one level, assumed; custom takes `gbps` and
    `latency_us`.

    Raises:
        ValueError: an unknown name, a transport with no measurement, or custom without both
            numbers (the message names the parameter).
    """
    if name == H200_NVLINK:
        if transport not in H200_MEASURED:
            raise ValueError(
                f"transport: h200_nvlink is measured for {', '.join(H200_MEASURED)}, got "
                f"{transport!r}"
            )
        return measured_fabric(transport)
    if name in TWO_LEVEL:
        inner_name, size, across_name, why = TWO_LEVEL[name]
        inner = fabric(inner_name, transport)
        across = fabric(across_name)
        source = f"{why}; inside: {inner.source}; across: {across.source}"
        return dataclasses.replace(
            inner, name=f"{name}/{inner.name}", source=source, domain_size=size, across=across
        )
    if name in NAMED_FABRICS:
        bw, lat, why = NAMED_FABRICS[name]
        return linear_fabric(name, why, bw, lat)
    if name == "custom":
        if gbps is None or latency_us is None or gbps <= 0 or latency_us < 0:
            raise ValueError(
                f"fabric_gbps, fabric_latency_us: custom needs a bandwidth > 0 GB/s and a "
                f"latency >= 0 us, got {gbps!r} and {latency_us!r}"
            )
        return linear_fabric("custom", f"given: {gbps:g} GB/s, {latency_us:g} us", gbps, latency_us)
    raise ValueError(f"fabric: expected one of {', '.join(FABRIC_NAMES)}, got {name!r}")


# ---------------------------------------------------------------------------------------------
# What a rank does, and the arithmetic of the overlap.


@dataclasses.dataclass(frozen=True)
class RankWork:
    """One rank's measured compute and the bytes its transfers move.

    Attributes:
        fwd_ms, bwd_ms: compute per step (ring: one per ring step; the one-call schemes: one).
        fwd_bytes: bytes this rank receives before each forward step (ring: step i's K/V, 0 at
            step 0; allgather: the gather; ulysses: the q/k/v exchange, then `out_bytes`).
        bwd_bytes: bytes of each backward step's transfers (ring: the K/V of step i + 1 and the
            dK/dV push of step i; allgather: the reduce-scatter; ulysses: the exchanges back).
        tail_bytes: bytes moved after the last step (ring: the dK/dV push home; ulysses: the
            output's exchange back, forward).
        host_fwd_ms, host_bwd_ms: the host's time to issue the rank's compute of each pass (0:
            not measured). The host issues ahead of the device, so the rank takes the longer of
            the two: its device timeline (compute against transfers) and its host time.
    """

    fwd_ms: tuple[float, ...]
    bwd_ms: tuple[float, ...] = ()
    fwd_bytes: tuple[float, ...] = ()
    bwd_bytes: tuple[float, ...] = ()
    tail_fwd_bytes: float = 0.0
    tail_bwd_bytes: float = 0.0
    host_fwd_ms: float = 0.0
    host_bwd_ms: float = 0.0

    def host_ms(self, backward: bool) -> float:
        """The host's time to issue the rank's compute, forward (and backward)."""
        return self.host_fwd_ms + (self.host_bwd_ms if backward else 0.0)

    @property
    def compute_fwd_ms(self) -> float:
        return sum(self.fwd_ms)

    @property
    def compute_fwd_bwd_ms(self) -> float:
        return sum(self.fwd_ms) + sum(self.bwd_ms)


# (a rank's work, the fabric, with a backward) -> that rank's time in ms.
RankTime = Callable[["RankWork", Fabric, bool], float]


@dataclasses.dataclass(frozen=True)
class Prediction:
    """The predicted call: the slowest rank, its parts, and what limits it.

    Attributes:
        fwd_ms, fwd_bwd_ms: the slowest rank's forward and forward+backward (fwd_bwd None
            without a backward).
        rank_ms: every rank's predicted fwd+bwd (fwd when forward only).
        rank_compute_ms: every rank's compute alone, same passes.
        rank_host_ms: every rank's host time to issue that compute, same passes.
        rank_device_ms: every rank's device timeline (compute against its transfers), same
            passes; rank_ms is the longer of it and rank_host_ms.
        bottleneck: host (the slowest rank's host issues its kernels more slowly than its device
            runs them and their transfers), else compute (balanced compute within
            BOTTLENECK_SHARE of the call), transfer (the exposed transfer is the larger loss) or
            imbalance (the slowest rank's extra compute over the mean is).
        contenders: predictions of other schemes with the same compute, by name (the
            all-gather's: PyTorch's own flex CP, `torch_cp`, whole K/V shards gathered).
    """

    fwd_ms: float
    fwd_bwd_ms: float | None
    rank_ms: tuple[float, ...]
    rank_compute_ms: tuple[float, ...]
    bottleneck: Bottleneck
    rank_host_ms: tuple[float, ...] = ()
    rank_device_ms: tuple[float, ...] = ()
    contenders: Mapping[str, Prediction] = dataclasses.field(default_factory=dict)

    @property
    def time_imbalance(self) -> float:
        """max over mean of the ranks' compute (1.0: even)."""
        mean = sum(self.rank_compute_ms) / len(self.rank_compute_ms)
        return max(self.rank_compute_ms) / mean if mean > 0 else 1.0


def bottleneck(
    total_ms: float, compute_ms: Sequence[float], device_ms: float | None = None
) -> Bottleneck:
    """What keeps `total_ms` (the slowest rank) above the mean compute: its host, when the
    slowest rank's device timeline `device_ms` is shorter than its host time (total_ms), else
    the imbalance (max - mean compute) or the exposed transfer (total - max compute); compute
    when both are under BOTTLENECK_SHARE."""
    if device_ms is not None and device_ms < (1 - BOTTLENECK_SHARE) * total_ms:
        return "host"
    total_ms = total_ms if device_ms is None else device_ms
    worst, mean = max(compute_ms), sum(compute_ms) / len(compute_ms)
    imbalance, exposed = worst - mean, max(total_ms - worst, 0.0)
    if max(imbalance, exposed) < BOTTLENECK_SHARE * total_ms:
        return "compute"
    return "transfer" if exposed >= imbalance else "imbalance"


def predict(
    rank_time: RankTime, ranks: Sequence[RankWork], fab: Fabric, backward: bool
) -> Prediction:
    """The call of `ranks` on `fab`: each rank takes the longer of its device timeline (its
    scheme's `rank_time`) and its host's time to issue its compute (RankWork.host_ms)."""
    fwd_device = [rank_time(w, fab, False) for w in ranks]
    fwd = [max(t, w.host_ms(False)) for t, w in zip(fwd_device, ranks, strict=True)]
    device = fwd_device
    both = None
    if backward:
        device = [rank_time(w, fab, True) for w in ranks]
        both = [max(t, w.host_ms(True)) for t, w in zip(device, ranks, strict=True)]
    compute = [w.compute_fwd_bwd_ms if backward else w.compute_fwd_ms for w in ranks]
    totals = both if both is not None else fwd
    slowest = max(range(len(totals)), key=totals.__getitem__)
    return Prediction(
        fwd_ms=max(fwd),
        fwd_bwd_ms=None if both is None else max(both),
        rank_ms=tuple(totals),
        rank_compute_ms=tuple(compute),
        bottleneck=bottleneck(totals[slowest], compute, device[slowest]),
        rank_host_ms=tuple(w.host_ms(backward) for w in ranks),
        rank_device_ms=tuple(device),
    )
