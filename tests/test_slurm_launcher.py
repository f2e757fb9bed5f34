"""What each SLURM job asks for, from its own run (attngym.runner.launchers.slurm): tasks, GPUs and
CPUs.

The sbatch scripts of real jobs are checked in tests/slurm; here every combination a user may
choose, on the composed config, without a cluster: `sinfo`'s answer about the partition's GPUs
is the one thing stood in for (this machine's test cluster has none).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attngym.errors import ConfigError
from attngym.runner.overrides import expect_launcher_schema, register_resolvers

pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra")
from attngym.runner.launchers import slurm  # noqa: E402  (needs the plugin)

CONF = Path(__file__).resolve().parents[1] / "conf"


def asked(overrides: list[str], partition_gpus: int = 0, monkeypatch=None) -> dict:
    """The sbatch parameters attngym's launcher asks for one job of `overrides`."""
    register_resolvers()
    expect_launcher_schema()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        cfg = compose(
            "config",
            overrides=["hydra/launcher=submitit_slurm", *overrides],
            return_hydra_config=True,
        )
    params = OmegaConf.to_container(cfg.hydra.launcher, resolve=True)
    params.pop("_target_")
    monkeypatch.setattr(slurm, "_sinfo_gpus", lambda partition: partition_gpus)
    resources = slurm.AttngymSlurmLauncher(**params)._resources(cfg)
    return {k: resources[k] for k in ("nodes", "tasks_per_node", "gpus_per_node", "cpus_per_task")}


@pytest.mark.parametrize(
    ("overrides", "partition_gpus", "expected"),
    [
        # One device: one task; a CPU run asks for no GPU, wherever it runs.
        (["device=cpu"], 8, (1, 1, None, 2)),
        (["device=auto"], 0, (1, 1, None, 2)),  # a CPU partition: no GPU asked
        (["device=auto"], 8, (1, 1, 1, 8)),  # a GPU partition: one GPU
        (["device=cuda"], 0, (1, 1, 1, 8)),
        # Context parallel: a task per rank, a GPU per rank, spread over the nodes.
        (["device=cpu", "topology=ring", "topology.world_size=2"], 0, (1, 2, None, 2)),
        (["device=cpu", "topology=ring"], 0, (1, 2, None, 2)),  # auto: 2 ranks on a CPU
        (["device=cuda", "topology=ring", "topology.world_size=4"], 8, (1, 4, 4, 8)),
        (["topology=ring", "hydra.launcher.nodes=2"], 8, (2, 8, 8, 8)),  # auto: every GPU
        (["topology=ring", "topology.world_size=16", "hydra.launcher.nodes=2"], 8, (2, 8, 8, 8)),
        # Simulated ranks run in one process on one device.
        (
            ["device=cuda", "topology=ring", "topology.world_size=8", "topology.simulate=true"],
            8,
            (1, 1, 1, 8),
        ),
        # One task that spawns the ranks: all of the node's GPUs and CPUs for it.
        (
            [
                "device=cuda",
                "topology=ring",
                "topology.world_size=4",
                "hydra.launcher.tasks_per_node=1",
            ],
            8,
            (1, 1, 4, 32),
        ),
        # What the user set is asked as set.
        (
            ["device=cuda", "hydra.launcher.gpus_per_node=8", "hydra.launcher.cpus_per_task=3"],
            8,
            (1, 1, 8, 3),
        ),
        (["device=cuda", "hydra.launcher.gres=gpu:h100:1"], 8, (1, 1, None, 8)),
    ],
)
def test_each_job_asks_for_what_its_run_needs(overrides, partition_gpus, expected, monkeypatch):
    got = asked(overrides, partition_gpus, monkeypatch)
    assert tuple(got.values()) == expected, got


@pytest.mark.parametrize(
    ("overrides", "key"),
    [
        (
            ["device=cpu", "topology=ring", "topology.world_size=3", "hydra.launcher.nodes=2"],
            "hydra.launcher.nodes",
        ),
        (
            [
                "device=cpu",
                "topology=ring",
                "topology.world_size=4",
                "hydra.launcher.tasks_per_node=3",
            ],
            "hydra.launcher.tasks_per_node",
        ),
        (
            [
                "device=cpu",
                "topology=ring",
                "topology.world_size=4",
                "hydra.launcher.tasks_per_node=1",
                "hydra.launcher.nodes=2",
            ],
            "hydra.launcher.tasks_per_node",
        ),
    ],
)
def test_resources_that_cannot_be_asked_name_the_key(overrides, key, monkeypatch):
    with pytest.raises(ConfigError) as err:
        asked(overrides, 0, monkeypatch)
    assert err.value.key == key


def test_sinfo_gres_is_read_for_gpus_per_node(monkeypatch):
    outputs = {
        None: "cpu* (null)\ngpu gpu:8\n",
        "gpu": "gpu gpu:h100:8(S:0-1)\ngpu gpu:h100:4(S:0)\n",
        "cpu": "cpu (null)\n",
    }

    class Done:
        def __init__(self, stdout):
            self.stdout = stdout

    def run(argv, **kwargs):
        partition = next((a.split("=", 1)[1] for a in argv if a.startswith("--partition=")), None)
        return Done(outputs[partition])

    monkeypatch.setattr(slurm.subprocess, "run", run)
    slurm._sinfo_gpus.cache_clear()
    assert slurm._sinfo_gpus(None) == 0  # the default (starred) partition has none
    assert slurm._sinfo_gpus("gpu") == 8
    assert slurm._sinfo_gpus("cpu") == 0
    slurm._sinfo_gpus.cache_clear()  # the stand-in's answers stay here
