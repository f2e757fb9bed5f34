"""`import attngym` and its library modules pull in no heavy or optional dependency.

Checked in a fresh interpreter, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = (
    "wandb",
    "matplotlib",
    "triton",
    "pynvml",
    "hydra",
    "omegaconf",
    "torch.distributed._symmetric_memory",
    "attn_gym",  # named by path in a config (gym_* options), imported by the run that uses it
)
LIBRARY = (
    "attngym",
    "attngym.utils",
    "attngym.variants",
    "attngym.reference",
    "attngym.kernels",
    "attngym.runner.config",
    "attngym.registry",
    "attngym.viz",
    "attngym.bench",
    "attngym.profiling",
    "attngym.device",
    "attngym.progress",
    "attngym.validation",
    "attngym.metrics",
    "attngym.results",
    "attngym.inputs",
    "attngym.estimate",
    "attngym.fileio",
    "attngym.distributed",
    "attngym.distributed.schemes.ulysses",
    "attngym.distributed.schemes.hybrid",
    "attngym.distributed.schemes.torch_cp",
    "attngym.distributed.ranks.launch",
    "attngym.distributed.ranks.keepalive",
)


def loaded_after(imports: str) -> set[str]:
    code = f"import sys, json\n{imports}\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


def test_library_imports_pull_in_nothing_heavy():
    # torch itself may import some of these (torch.cuda tries `import pynvml` when it is
    # installed): those are not attngym's doing, so only modules torch leaves out are checked.
    by_torch = {m for m in loaded_after("import torch") if m in HEAVY}
    modules = loaded_after("import " + ", ".join(LIBRARY))
    pulled = {m for m in modules if m in HEAVY} - by_torch
    assert not pulled, f"importing attngym pulled in {sorted(pulled)}"
    submodules = {m for m in modules if m.split(".")[0] in {"wandb", "matplotlib", "hydra"}}
    assert not submodules, sorted(submodules)[:10]
