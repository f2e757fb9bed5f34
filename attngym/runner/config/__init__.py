"""Typed run settings: the composed config, a plain mapping, checked into `Settings`.

Each setting is stated once, as a typed dataclass field (settings.py): its default, its allowed
values (a `Literal` type; `setting(choices=...)` where another module owns the list, as the
registry owns the task, transport, profiler and tracker names) and any check its type does not
say (`setting(check=..., low=...)`). One walker (`_check_section`) checks a section from its fields
and names the dotted key in every message; the rules between fields are named functions, listed
once in `VALUE_RULES` and `RESOLVED_RULES`; `Settings` is read back from the checked data field by
field (`_build`). The YAML files state only what a user edits, and tests/test_config.py holds
their values to the typed defaults. Fields are plain Python (no OmegaConf: the CLI hands over a
plain dict), so tasks and the library can be driven from a notebook too.

`auto` is a value of its own where it is one (device, dtype, topology.world_size), and a
`Settings` object holds it resolved: `from_config` resolves it together with the config's checks,
and Settings made directly resolve what they leave `auto` the same way when made.

What a context-parallel topology takes (its layouts, its own options under topology.options,
typed by its spec's dataclass and checked by the walker, its rules) is asked of its spec,
attngym.distributed's table read through attngym.registry ("topology"; `custom` bound to
topology.scheme first); no kind is matched by name here. A task kind without a spec runs on one
device.

Checking happens in two steps, so that configs stay pure:

- `check_config(data)` looks at values only (types, ranges, choices, the variant and its
  parameters, the tracker's parameters, the topology's rules): it never probes hardware, so it
  gives the same answer on a laptop and on a GPU node, and tests can run it anywhere.
- `from_config(data)` runs the same checks, then resolves the `auto` values against this machine
  (device, dtype, world_size, a `flash` or `tuned` block size) and checks what depends on them
  (device=cuda without CUDA, more ranks than GPUs, FLASH's block size, the memory the run needs).
  It still runs before any tensor is allocated. The transport is judged against the device by
  the context-parallel task, before it launches its ranks.

Every bad value raises `attngym.errors.ConfigError(key, message)` with the dotted key, the value
received and what is allowed, so the CLI can print one line.

One module per concern, each importing only those above it in this list:

    machine   `auto` as Settings resolves it when made (device, world size); which kinds spread
    settings  the types: Settings and its sections, their fields and field checks
    walker    checks a section from its fields, names the dotted key; check_key, plain
    topology  the rules of the shape and the topology (asked of its spec), simulation, CUDA graphs
    flash     the FLASH and Triton rules; flash_refusal
    resolve   check_config, from_config: the rule lists, `auto` resolved, the memory fit

This module re-exports what the rest of attngym imports from `attngym.runner.config`.
"""

from __future__ import annotations

from attngym.errors import ConfigError
from attngym.runner.config.flash import (
    FLASH_RULES,
    NESTED_BACKWARD_TILES,
    TRITON_TILES,
    backward_block_error,
    flash_refusal,
    flash_refusal_of,
)
from attngym.runner.config.machine import (
    AUTO,
    CPU_RANKS,
    Auto,
    ranks_asked,
)
from attngym.runner.config.resolve import (
    RESOLVED_RULES,
    VALUE_RULES,
    check_config,
    from_config,
    workload_batches,
)
from attngym.runner.config.settings import (
    BASELINES,
    BLOCK_SIZE_RESOLVERS,
    CP_BASELINES,
    DEFAULT_TRACKER,
    DEVICES,
    DTYPES,
    MAX_SIMULATED_RANKS,
    PASSES,
    SINGLE_BASELINES,
    TUNED,
    Baseline,
    Benchmark,
    CPBaseline,
    Device,
    Distribution,
    Dtype,
    Fabric,
    Pass,
    Settings,
    Shape,
    SingleBaseline,
    Topology,
    Workload,
    setting,
)
from attngym.runner.config.walker import (
    OPEN_MAPPINGS,
    check_key,
    known_keys,
    plain,
)

__all__ = [
    "AUTO",
    "Auto",
    "BASELINES",
    "BLOCK_SIZE_RESOLVERS",
    "Baseline",
    "Benchmark",
    "CPBaseline",
    "CPU_RANKS",
    "CP_BASELINES",
    "ConfigError",
    "DEFAULT_TRACKER",
    "DEVICES",
    "DTYPES",
    "Device",
    "Distribution",
    "Dtype",
    "FLASH_RULES",
    "Fabric",
    "MAX_SIMULATED_RANKS",
    "NESTED_BACKWARD_TILES",
    "OPEN_MAPPINGS",
    "PASSES",
    "Pass",
    "RESOLVED_RULES",
    "SINGLE_BASELINES",
    "Settings",
    "Shape",
    "SingleBaseline",
    "TRITON_TILES",
    "TUNED",
    "Topology",
    "VALUE_RULES",
    "Workload",
    "backward_block_error",
    "check_config",
    "check_key",
    "flash_refusal",
    "flash_refusal_of",
    "from_config",
    "known_keys",
    "plain",
    "ranks_asked",
    "setting",
    "workload_batches",
]
