"""Your own context-parallel scheme (topology=custom, attngym.distributed.schemes.custom) through
every part of attngym, editing no file of the package: the all-gather of docs/custom-cp.md, in a
file of its own, runs on 2 CPU ranks through the CLI, a sweep beside the built-ins (W&B offline,
resume) and attngym.run, validated forward and backward against float64 next to torch_cp; every user
error is one line naming the key before any rank starts; a scheme that lives only in the tests
is a whole topology (registered beside the built-ins, simulated and priced)."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from attngym import registry
from attngym.errors import ConfigError
from attngym.runner.config import Benchmark, Settings, Shape, Topology, check_config

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "ATTNGYM_PROGRESS": "0"}


def readme_scheme() -> str:
    """docs/custom-cp.md's mycp.py, exactly as a user copies it."""
    text = (ROOT / "docs" / "custom-cp.md").read_text()
    found = re.search(r"```python\n# mycp\.py\n(.*?)```", text, re.S)
    assert found, "docs/custom-cp.md shows mycp.py"
    return found.group(1)


@pytest.fixture
def user_dir(tmp_path, monkeypatch):
    """A folder of the user's, with the mycp.py of docs/custom-cp.md and a few wrong schemes."""
    (tmp_path / "mycp.py").write_text(readme_scheme())
    (tmp_path / "bad.py").write_text(BAD)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    for name in ("mycp", "bad"):
        sys.modules.pop(name, None)


BAD = """
import torch

NOT_CALLABLE = 3


def three(q, k, v):
    return q


def needs(q, k, v, variant, *, group, layout, hops):
    return q


def wrong_shape(q, k, v, variant, *, group, layout, **kwargs):
    return q[:, :, :-1]


def no_grad(q, k, v, variant, *, group, layout, **kwargs):
    return torch.zeros_like(q)


def raises(q, k, v, variant, *, group, layout, **kwargs):
    raise RuntimeError("boom")


def make(hops):
    def scheme(q, k, v, variant, *, group, layout, **kwargs):
        return q * 1.0
    return scheme
"""


def test_the_readme_scheme_is_25_to_40_lines():
    lines = readme_scheme().strip().splitlines()
    assert 25 <= len(lines) <= 40, len(lines)


def _attngym(*args: str, cwd: Path, timeout: int = 420) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "attngym", *args], cwd=cwd, capture_output=True, text=True,
        timeout=timeout, env=ENV,
    )  # fmt: skip


def test_a_users_scheme_sweeps_beside_the_builtins_validated_and_resumes(user_dir):
    """-m topology=allgather,custom: both jobs on 2 gloo ranks, validated forward and backward
    against float64, torch_cp beside them, W&B offline runs; the same command again skips them."""
    command = [
        "-m", "topology=allgather,custom", "topology.scheme=mycp.my_allgather",
        "topology.layout=zigzag", "attention=document", "shape.seq_len=512", "shape.heads=2",
        "hydra.sweep.dir=sweep",
    ]  # fmt: skip
    proc = _attngym(*command, cwd=user_dir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    jobs = {}
    for job in ("0", "1"):
        metrics = json.loads((user_dir / "sweep" / job / "metrics.json").read_text())
        jobs[metrics["topology"]] = metrics
        assert list((user_dir / "sweep" / job / "wandb").glob("offline-run-*"))
    mine, builtin = jobs["custom"], jobs["allgather"]
    assert mine["scheme"] == "mycp.my_allgather" and "scheme" not in builtin
    for metrics in (mine, builtin):
        assert metrics["status"] == "ok" and metrics["validation"] == "ok", metrics
        placed = (metrics["world_size"], metrics["transport"], metrics["layout"])
        assert placed == (2, "gloo", "zigzag")
        assert metrics["err_out_rel"] < 1e-4 and metrics["err_dk_rel"] < 1e-4
        assert metrics["torch_cp_status"] == "ok" and metrics["torch_cp_validation"] == "ok"
        assert metrics["efficiency"] > 0 and metrics["load_time_imbalance"] >= 1.0
    rows = (user_dir / "sweep" / "summary.csv").read_text().splitlines()
    assert len(rows) == 3 and all(",ok," in row for row in rows[1:]), rows
    again = _attngym(*command, cwd=user_dir)
    assert again.returncode == 0, again.stderr[-2000:]
    assert (again.stdout + again.stderr).count("skipped") >= 1


def test_attngym_run_takes_a_scheme_object_and_refuses_one_ranks_cannot_import(user_dir):
    from mycp import my_allgather

    import attngym

    metrics = attngym.run(
        scheme=my_allgather,
        overrides=["shape.seq_len=256", "shape.heads=2", "logger=none", "baselines=[]"],
        run_dir=user_dir / "run",
    )
    assert metrics["status"] == "ok" and metrics["validation"] == "ok"
    assert metrics["scheme"] == "mycp:my_allgather" and metrics["world_size"] == 2
    # my_allgather counts nothing into CPStats: not reported, not measured zeros
    assert metrics["pairs_computed"] is metrics["bytes_moved"] is metrics["pairs_skipped"] is None

    def in_the_notebook(q, k, v, variant, *, group, layout, **kwargs):
        return my_allgather(q, k, v, variant, group=group, layout=layout, **kwargs)

    with pytest.raises(ConfigError, match="lives only in this process") as info:
        attngym.run(scheme=in_the_notebook, overrides=["logger=none"], run_dir=user_dir / "nb")
    assert info.value.key == "topology.scheme"


def _settings(scheme: str, **topology) -> Settings:
    return Settings(
        attention={"name": "causal"},
        device="cpu",
        shape=Shape(batch=1, heads=2, seq_len=256, head_dim=8),
        topology=Topology(kind="custom", world_size=2, scheme=scheme, **topology),
        benchmark=Benchmark(warmup=0, repeats=1),
        baselines=(),
        passes=("fwd",),
    )


@pytest.mark.parametrize(
    ("scheme", "key", "message"),
    [
        ("mycp.my_allgathr", "topology.scheme", "mycp has no 'my_allgathr'; did you mean 'my_all"),
        ("nomod.x", "topology.scheme", "no module 'nomod'"),
        ("bad.NOT_CALLABLE", "topology.scheme", "is not callable"),
        ("bad.three", "topology.scheme", r"takes \(q, k, v\) positionally"),
        ("bad.needs", "topology.scheme", "requires keyword 'hops'"),
        (None, "topology.scheme", "set topology.scheme=module.function"),
    ],
)
def test_a_scheme_that_cannot_be_called_is_one_line_before_any_rank(user_dir, scheme, key, message):
    topology = {"kind": "custom", "scheme": scheme}
    with pytest.raises(ConfigError, match=message) as info:
        check_config({"attention": {"name": "causal"}, "topology": topology})
    assert info.value.key == key and "\n" not in str(info.value)


def test_a_factory_takes_its_arguments_and_names_a_wrong_one(user_dir):
    data = {"attention": {"name": "causal"}, "topology": {"kind": "custom", "scheme": "bad.make"}}
    check_config({**data, "topology": {**data["topology"], "scheme_args": {"hops": 2}}})
    with pytest.raises(ConfigError, match="did you mean 'hops'") as info:
        check_config({**data, "topology": {**data["topology"], "scheme_args": {"hopz": 2}}})
    assert info.value.key == "topology.scheme_args.hopz"


@pytest.mark.parametrize(
    ("scheme", "message"),
    [
        ("bad.wrong_shape", r"returned \(1, 2, 63, 16\) torch.float32; a scheme returns"),
        ("bad.no_grad", "returned an output with no backward"),
        ("bad.raises", r"failed on a probe \(one CPU rank, causal, S=64\): RuntimeError: boom"),
    ],
)
def test_the_probe_refuses_a_wrong_output_before_any_rank(user_dir, scheme, message):
    from attngym.runner.tasks.context_parallel import check_hardware
    from attngym.runner.tasks.cp_setup import CPRun

    with pytest.raises(ConfigError, match=message) as info:
        check_hardware(CPRun.of(_settings(scheme)))
    assert info.value.key == "topology.scheme"
    check_hardware(CPRun.of(_settings("mycp.my_allgather")))


def test_a_function_is_refused_by_the_simulation_and_a_spec_that_declares_it_is_simulated(
    user_dir, tmp_path, monkeypatch
):
    monkeypatch.syspath_prepend(str(ROOT))  # tests.distributed.schemes, by path
    data = {
        "attention": {"name": "causal"},
        "topology": {"kind": "custom", "scheme": "mycp.my_allgather", "simulate": True,
                     "world_size": 4},
    }  # fmt: skip
    with pytest.raises(ConfigError, match="declares no simulate and price") as info:
        check_config(data)
    assert info.value.key == "topology.simulate"
    settings = _settings("tests.distributed.schemes.PAIRWISE", simulate=True)
    settings.topology.world_size = 4
    metrics = registry.get("task", "custom")(settings, tmp_path)
    assert metrics["predicted_fwd_ms"] > 0 and metrics["single_fwd_ms"] > 0
    # K and V of 2 heads x 64 rows x 8 dims in float32, from each of 3 peers
    assert metrics["bytes_moved"] == 2 * 2 * 64 * 8 * 4 * 3
    assert metrics["sim_timed"] <= metrics["sim_items"] == 4


def test_a_topology_living_only_in_the_tests_registers_beside_the_builtins(monkeypatch, tmp_path):
    """What a new built-in needs, from outside the package: its TopologySpec (function, layouts,
    simulation, pricing), one registry entry and its task; the config takes it by name."""
    from attngym.runner.tasks.context_parallel import register_task
    from tests.distributed.schemes import PAIRWISE

    for kind in ("topology", "task"):
        monkeypatch.setitem(registry._REGISTRY, kind, dict(registry._REGISTRY[kind]))
    registry.register("topology", "pairwise")(PAIRWISE)
    register_task("pairwise")
    data = {"attention": {"name": "causal"}, "topology": {"kind": "pairwise", "layout": "zigzag"}}
    assert check_config(data)["topology"]["kind"] == "pairwise"
    settings = _settings(None, simulate=True)
    settings.topology.kind, settings.topology.world_size = "pairwise", 4
    metrics = registry.get("task", "pairwise")(settings, tmp_path)
    assert metrics["topology"] == "pairwise" and metrics["predicted_fwd_ms"] > 0


def test_no_module_of_distributed_imports_anothers_private_names():
    """Schemes share machinery through public names (cp, simulate, layout, transfer_model); a
    module's own underscored names stay its own."""
    package = ROOT / "attngym" / "distributed"
    offences = []
    for path in sorted(package.glob("*.py")):
        tree = ast.parse(path.read_text())
        modules = {}  # local name -> attngym module it names
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("attngym"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        offences.append(f"{path.name}: from {node.module} import {alias.name}")
                    modules[alias.asname or alias.name] = f"{node.module}.{alias.name}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("attngym"):
                        modules[alias.asname or alias.name.split(".")[0]] = alias.name
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in modules
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
            ):
                offences.append(f"{path.name}: {node.value.id}.{node.attr}")
    assert offences == []


def test_a_balancers_wrong_placement_is_one_line_before_any_rank(monkeypatch):
    """check_hardware calls a user's balancer once and names topology.layout for what is wrong."""
    from attngym.runner.tasks.context_parallel import check_hardware
    from attngym.runner.tasks.cp_setup import CPRun

    monkeypatch.syspath_prepend(str(ROOT))
    settings = _settings(
        "mycp.unused", layout="tests.distributed.balancers.drops_the_last_position"
    )
    settings.topology.kind = "ring"  # the built-ins ignore topology.scheme
    with pytest.raises(ConfigError, match="puts position 255 in no chunk") as info:
        check_hardware(CPRun.of(settings))
    assert info.value.key == "topology.layout" and "\n" not in str(info.value)
    settings.topology.layout = "tests.distributed.balancers.by_document_work"
    settings.attention = {"name": "document", "doc_lengths": [100, 60, 96]}
    settings.variant = None
    settings.__post_init__()
    check_hardware(CPRun.of(settings))
