"""`topology=auto`: the model picks the scheme, layout and transport, then that one runs.

Given the variant, shape, world size and fabric, every candidate (a built-in scheme and a layout
it takes; hybrid with each group size and across scheme where the fabric has no NVLink domains
to fix them; with and without CUDA graphs where they can run) whose rules accept the run is
simulated on the one device (its ranks' exact work, attngym.distributed.model.simulate) with a model
of its items' times fitted to a few of them, and priced on topology.fabric for each transport
(the measured ones on an H200 fabric); the few the model puts near its best are simulated again
with every item timed, and the fastest call (forward+backward where the run has a backward)
runs: its prediction is the run's with topology.simulate=true, else its real ranks start and the
pick is recorded beside their measurement. An answer is kept in the cache folder and given again
to the same question. attngym.runner.tasks.cp_auto does the choosing; this module states the
topology (its options and its spec, which `chooses`).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from attngym.distributed.placement.layout import LAYOUTS, is_user_layout
from attngym.distributed.schemes.spec import TopologySpec
from attngym.errors import ConfigError, choice_error

CandidateTransport = Literal["copy_engine", "nccl"]
PICK = "auto"  # topology.layout=auto: the layout is chosen too


def candidates() -> list[str]:
    """The schemes auto may pick: the registered topologies whose spec is `pickable`."""
    from attngym import registry

    return [name for name in registry.names("topology") if registry.get("topology", name).pickable]


@dataclasses.dataclass(frozen=True)
class AutoOptions:
    """auto's own options: topology.options.<field>; an empty list means every one."""

    candidates: tuple[str, ...] = ()
    """The schemes to simulate (default: every one auto may pick, `candidates()`). Checked by
    `_known_candidates`."""
    layouts: tuple[str, ...] = ()
    """The layouts to try, each with the schemes that take it: contiguous, zigzag,
    double_zigzag, balanced, documents or a balancer of yours (module.function) (default:
    PICKED_LAYOUTS, contiguous, zigzag, balanced and documents where the variant names
    documents; a topology.layout other than auto fixes it). Checked by `_known_layouts`."""
    transports: tuple[CandidateTransport, ...] = ()
    """The transports to price (default: on a fabric measured per transport,
    transfer_model.MEASURED_FABRICS, those while the ranks fit in one NVLink domain, NCCL
    beyond; the device's on real CPU ranks)."""
    cuda_graphs: tuple[bool, ...] = ()
    """Each candidate captured as CUDA graphs (true), not (false), or both (default) where
    graphs can run: on CUDA, with a transport on the device (topology.cuda_graph=true: graphs
    only). The pick says which (`/cuda_graph`) and the run takes it."""
    shortlist: int = dataclasses.field(default=3, metadata={"low": 0})
    """Ways of running a scheme (its options) whose best candidate the model prices within
    15 % of its best, timed item by item (that candidate, with the same call run the other
    way its scheme names), at most (0: every candidate is timed, the model only orders them)."""
    reuse: bool = True
    """Take the answer to the same question (variant and code, shape, P, fabric, transport,
    device) from the table in the cache folder where it was asked before (false: ask afresh,
    and keep the new answer)."""


def _known_candidates(*, options: dict[str, Any], **_: Any) -> None:
    """topology.options.candidates names schemes auto may pick."""
    for name in options["candidates"]:
        if name not in candidates():
            raise ConfigError(
                "topology.options.candidates", choice_error("candidates", name, candidates())
            )


def _known_layouts(*, options: dict[str, Any], **_: Any) -> None:
    """topology.options.layouts names layouts: attngym's, or a balancer's import path."""
    for layout in options["layouts"]:
        if layout not in LAYOUTS and not is_user_layout(layout):
            allowed = (*LAYOUTS, "module.function")
            raise ConfigError("topology.options.layouts", choice_error("layout", layout, allowed))


def _runs_the_pick(*_: Any, **__: Any) -> Any:
    raise RuntimeError("topology=auto runs the scheme it picks (attngym.runner.tasks.cp_auto)")


AUTO = TopologySpec(
    name="auto",
    attention=_runs_the_pick,
    layouts=(PICK, *LAYOUTS),
    user_layouts=True,
    options=AutoOptions,
    rules=(_known_candidates, _known_layouts),
    chooses=True,
)
