"""Every config file composes to the values it promises; every bad value is refused by its key.

Configs are composed with Hydra's compose API from the repository's conf/ (no subprocess), then
checked with attngym.runner.config. Each rejection has a matching accepted value next to it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from attngym import registry
from attngym.errors import ConfigError
from attngym.runner.config import check_config, from_config
from attngym.runner.overrides import expect_launcher_schema, register_resolvers

CONF = Path(__file__).resolve().parents[1] / "conf"
GROUPS = ("attention", "device", "block_size", "topology", "profiler", "logger")


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF / group).glob("*.yaml"))


@pytest.fixture(scope="module")
def hydra_ctx():
    register_resolvers()
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        yield


def make(overrides=(), hydra_cfg=False):
    """Compose conf/config.yaml; numeric group options are quoted as the CLI does."""
    fixed = []
    for o in overrides:
        key, _, value = o.partition("=")
        fixed.append(f"{key}='{value}'" if key in GROUPS and value.isdigit() else o)
    return compose("config", overrides=fixed, return_hydra_config=hydra_cfg)


def test_defaults_are_small_cpu_run(hydra_ctx):
    cfg = make()
    assert cfg.attention.name == "causal"
    assert cfg.device.name == "auto"
    assert cfg.topology.kind == "single" and cfg.topology.world_size == "auto"  # one rank
    assert cfg.logger.name == "wandb" and cfg.logger.mode == "offline"
    assert cfg.dtype == "auto" and cfg.validate is True
    assert list(cfg.passes) == ["fwd", "bwd"]
    assert cfg.shape.seq_len * cfg.shape.heads * cfg.shape.batch <= 8192  # CPU-sized
    data = check_config(cfg)
    assert data["block_size"] == {"q": 128, "kv": 128}


@pytest.mark.parametrize("group", GROUPS)
def test_every_option_composes_and_checks(hydra_ctx, group):
    found = options(group)
    assert len(found) >= 3, found
    for option in found:
        cfg = make([f"{group}={option}"])
        node = OmegaConf.to_container(cfg[group], resolve=True)
        assert isinstance(node, dict) and node, (group, option)
        if group == "attention":
            # A catalogue option names its variant; the others are your own callbacks (custom).
            assert node["name"] in (option, "custom"), (option, node["name"])
        if group in ("device", "profiler", "logger"):
            assert node["name"] == option
        if group == "topology" and option != "single" and option not in registry.names("task"):
            continue  # the context-parallel tasks register themselves when they exist
        if group == "attention" and option == "custom":  # it needs your callback's path
            with pytest.raises(ConfigError, match="needs mask_mod or score_mod"):
                check_config(cfg)
            continue
        if group == "topology" and option == "custom":  # it needs your scheme's path
            with pytest.raises(ConfigError, match="topology.scheme: .*set topology.scheme="):
                check_config(cfg)
            continue
        check_config(cfg)


def test_attention_params_follow_the_shape(hydra_ctx):
    cfg = make(["attention=alibi", "shape.heads=8"])
    assert cfg.attention.num_heads == 8
    cfg = make(["attention=document", "shape.seq_len=2048"])
    assert sum(cfg.attention.doc_lengths) == 2048 and len(cfg.attention.doc_lengths) == 4
    cfg = make(["attention=natten", "shape.seq_len=512"])
    assert (cfg.attention.canvas_w, cfg.attention.canvas_h) == (32, 16)
    cfg = make(["attention=prefix_lm", "shape.seq_len=2048"])
    assert cfg.attention.prefix_length == 512


def test_gemma2_is_a_catalogue_name_and_the_same_as_its_composition(hydra_ctx):
    cfg = make(["attention=gemma2"])
    assert (cfg.attention.window_size, cfg.attention.soft_cap) == (256, 50.0)
    from attngym.variants.spec import build_variant

    variant = build_variant(OmegaConf.to_container(cfg.attention), seq_len=1024)
    composed = build_variant(
        {
            "name": "gemma2",
            "compose": [
                {"name": "sliding_window", "window_size": 256},
                {"name": "softcap", "soft_cap": 50.0},
            ],
        }
    )
    assert variant.name == composed.name == "gemma2"
    pos = torch.arange(512)
    b = torch.zeros((), dtype=torch.int64)
    q, k = pos.view(-1, 1), pos.view(1, -1)
    assert torch.equal(variant.mask_mod(b, b, q, k), composed.mask_mod(b, b, q, k))
    score = torch.linspace(-200, 200, 41)
    torch.testing.assert_close(
        variant.score_mod(score, b, b, b, b), composed.score_mod(score, b, b, b, b)
    )


def test_attention_options_and_names_are_one_list():
    # Every catalogue name is an option (conf/attention/<name>.yaml) and every option that is
    # not your own (custom) nor attention-gym's (gym_*) is a catalogue name.
    from attngym.variants.spec import names

    catalogue = [o for o in options("attention") if not o.startswith("gym_")]
    assert catalogue == names()


def test_block_sizes(hydra_ctx):
    assert dict(make(["block_size=64"]).block_size) == {"q": 64, "kv": 64}
    assert dict(make(["block_size=128"]).block_size) == {"q": 128, "kv": 128}
    assert dict(make(["block_size=flash"]).block_size) == {"q": "flash", "kv": "flash"}
    settings = from_config(make(["block_size=flash", "device=cpu"]))
    assert all(b > 0 and b % 16 == 0 for b in settings.block_size)


@pytest.mark.parametrize("name", options("experiment"))
def test_every_experiment_composes(hydra_ctx, name):
    cfg = make([f"+experiment={name}"], hydra_cfg=True)
    params = cfg.hydra.sweeper.params
    if name in ("variant_gallery", "flex_vs_sdpa", "block_size_sweep", "bwd_options_sweep"):
        assert str(cfg.hydra.mode) == "RunMode.MULTIRUN"
        assert len(params) >= 1
    if name == "variant_gallery":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        pattern = OverridesParser.create().parse_override(f"attention={params.attention}")
        listed = pattern.value().filter(options("attention"))
        # Every catalogue option; your own (custom) and attention-gym's have gym_gallery.
        catalogue = [o for o in options("attention") if o != "custom" and not o.startswith("gym_")]
        assert sorted(listed) == catalogue
    if name == "flex_vs_sdpa":
        assert list(cfg.baselines) == [
            "sdpa",
            "sdpa_cudnn",
            "sdpa_flash",
            "sdpa_efficient",
            "sdpa_dense_mask",
            "varlen",
            "flash_varlen",
        ]
        listed = [v.strip() for v in params.attention.split(",")]
        assert listed == [
            "full", "causal", "sliding_window", "document", "prefix_lm", "alibi", "softcap",
            "gemma2",
        ]  # fmt: skip
        assert params["shape.seq_len"] == "2048,4096,8192,16384,32768"
        assert params["shape.head_dim"] == "64,128"
        assert cfg.shape.batch * cfg.shape.seq_len == 32768  # constant tokens per job
    if name == "block_size_sweep":
        assert "block_size" in params and "kernel_options" in params
    if name == "bwd_options_sweep":
        assert params.attention == "causal"
        assert all(_bwd_options_fit(o) for o in _swept("kernel_options", params.kernel_options))
    kind = cfg.topology.kind
    if kind != "single" and kind not in registry.names("task"):
        return  # composed; checked once its context-parallel task registers itself
    check_config(make([f"+experiment={name}"]))


def _swept(key: str, value: str) -> list:
    """The values a sweeper param expands to, as Hydra parses them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    (override,) = OverridesParser.create().parse_overrides([f"{key}={value}"])
    return list(override.sweep_iterator())


def _bwd_options_fit(options) -> bool:
    """The backward kernel's static asserts, and tiles that divide the 128 x 128 block mask."""
    m1, n1 = options.get("bwd_BLOCK_M1", 64), options.get("bwd_BLOCK_N1", 128)
    m2, n2 = options.get("bwd_BLOCK_M2", 128), options.get("bwd_BLOCK_N2", 64)
    return n1 % m1 == 0 and m2 % n2 == 0 and all(128 % b == 0 for b in (m1, n1, m2, n2))


def test_bwd_options_sweep_checks_its_options():
    assert _bwd_options_fit({"bwd_BLOCK_M1": 64, "bwd_BLOCK_N1": 128})
    assert not _bwd_options_fit({"bwd_BLOCK_M1": 128, "bwd_BLOCK_N1": 64})
    swept = _swept("kernel_options", "choice({},{USE_TMA:true,bwd_num_warps:8})")
    assert swept == [{}, {"USE_TMA": True, "bwd_num_warps": 8}]


def test_hydra_settings(hydra_ctx):
    cfg = make(hydra_cfg=True)
    assert cfg.hydra.job.chdir is False
    assert cfg.hydra.run.dir.startswith("outputs/")
    assert cfg.hydra.sweep.dir.startswith("multirun/")
    assert (
        cfg.hydra.callbacks.sweep_summary._target_ == "attngym.runner.tracking.sweep.SweepSummary"
    )


def test_slurm_launcher_config_composes_against_the_released_plugins_schema(hydra_ctx):
    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra")
    expect_launcher_schema()
    cfg = make(["hydra/launcher=submitit_slurm"], hydra_cfg=True)
    assert cfg.hydra.launcher._target_ == "hydra_plugins.attngym_launcher.SlurmLauncher"
    assert cfg.hydra.launcher.timeout_min == 60
    assert cfg.hydra.launcher.tasks_per_node == 0  # one task per rank
    assert cfg.hydra.launcher.gpus_per_node is None  # what each job's run needs
    # The plugin's schema checks the keys: one it does not have is refused, as users meet it.
    with pytest.raises(Exception, match="srun_args"):
        make(["hydra/launcher=submitit_slurm", "hydra.launcher.srun_args=[-K]"], hydra_cfg=True)


def test_a_launcher_whose_plugin_is_not_installed_is_refused_in_one_line(monkeypatch):
    from attngym.runner import overrides

    pytest.importorskip("hydra_plugins.hydra_submitit_launcher", reason="the slurm extra")
    assert overrides.prepare_overrides(["-m", "hydra/launcher=submitit_slurm"])  # installed
    monkeypatch.setitem(
        overrides.LAUNCHER_PLUGINS, "submitit_slurm", ("hydra_plugins.not_installed", "pip x")
    )
    with pytest.raises(ConfigError) as err:
        overrides.prepare_overrides(["-m", "hydra/launcher=submitit_slurm"])
    assert err.value.key == "hydra/launcher" and "not installed: pip x" in str(err.value)


# (bad overrides, the key the error must name, an accepted neighbour)
CASES = [
    (["attention.name=sliding_windw"], "attention.name", ["attention.name=causal"]),
    (
        ["attention=sliding_window", "+attention.window=8"],
        "attention.window",
        ["attention=sliding_window", "attention.window_size=8"],
    ),
    (
        ["attention=sliding_window", "attention.window_size=0"],
        "attention.window_size",
        ["attention=sliding_window", "attention.window_size=1"],
    ),
    (["shape.heads=0"], "shape.heads", ["shape.heads=1"]),
    (["shape.batch=-1"], "shape.batch", ["shape.batch=2"]),
    (["shape.seq_len=0"], "shape.seq_len", ["shape.seq_len=256"]),
    (["shape.head_dim=0"], "shape.head_dim", ["shape.head_dim=16"]),
    (["shape.kv_heads=3"], "shape.kv_heads", ["shape.kv_heads=2"]),
    (["block_size.q=24"], "block_size.q", ["block_size.q=32"]),
    (["block_size.kv=0"], "block_size.kv", ["block_size.kv=16"]),
    (["dtype=float8"], "dtype", ["dtype=bfloat16"]),
    (["device.name=tpu"], "device.name", ["device.name=cpu"]),
    (["topology.kind=mesh"], "topology.kind", ["topology.kind=single"]),
    (["topology.world_size=0"], "topology.world_size", ["topology.world_size=1"]),
    (["topology.transport=carrier_pigeon"], "topology.transport", ["topology.transport=gloo"]),
    (["topology.layout=spiral"], "topology.layout", ["topology.layout=zigzag"]),
    (["topology=ring", "topology.timeout_s=inf"], "topology.timeout_s", ["topology=ring"]),
    (["profiler.name=perf"], "profiler.name", ["profiler.name=kernels"]),
    (["logger.name=tensorboard"], "logger.name", ["logger=local"]),
    (["logger.mode=sometimes"], "logger.mode", ["logger.mode=online"]),
    (
        ["dtype=float32", "+kernel_options.BACKEND=FLASH"],
        "kernel_options.BACKEND",
        ["dtype=bfloat16", "+kernel_options.BACKEND=FLASH"],
    ),
    (
        ["compile=false", "dtype=bfloat16", "+kernel_options.BACKEND=FLASH"],
        "compile",
        ["compile=true", "dtype=bfloat16", "+kernel_options.BACKEND=FLASH"],
    ),
    (
        ["attention=document", "attention.doc_lengths=[100,100]"],
        "attention.doc_lengths",
        ["attention=document", "attention.doc_lengths=[1000,24]"],
    ),
    (
        ["attention=natten", "attention.canvas_w=30"],
        "attention.canvas_w",
        ["attention=natten", "attention.canvas_w=16"],
    ),
    (
        ["attention=gemma2", "attention.soft_cap=-1.0"],
        "attention.soft_cap",
        ["attention=gemma2", "attention.soft_cap=30.0"],
    ),
    (
        ["attention=alibi", "shape.heads=8", "attention.num_heads=4"],
        "attention.num_heads",  # one ALiBi slope per query head: tied to shape.heads
        ["attention=alibi", "shape.heads=4", "attention.num_heads=4"],
    ),
    (
        ["topology=hybrid", "topology.world_size=4", "topology.options.a2a_size=3"],
        "topology.options.a2a_size",  # groups of 3 cannot split 4 ranks
        ["topology=hybrid", "topology.world_size=4", "topology.options.a2a_size=2"],
    ),
    (
        [
            "topology=hybrid",
            "topology.world_size=4",
            "shape.heads=2",
            "topology.options.a2a_size=4",
        ],
        "topology.options.a2a_size",  # 2 heads cannot split over a group of 4
        [
            "topology=hybrid",
            "topology.world_size=4",
            "shape.heads=2",
            "topology.options.a2a_size=2",
        ],
    ),
    (
        ["topology=hybrid", "topology.options.a2a_size=0"],
        "topology.options.a2a_size",
        ["topology=hybrid", "topology.options.a2a_size=null"],
    ),
    (
        ["topology=hybrid", "topology.options.across=tree"],
        "topology.options.across",
        ["topology=hybrid", "topology.options.across=allgather"],
    ),
    (
        [
            "topology=hybrid",
            "topology.world_size=4",
            "topology.layout=zigzag",
            "shape.seq_len=1028",
        ],
        "shape.seq_len",  # zigzag over 4 ranks: 8 pieces, also what each group's layout needs
        [
            "topology=hybrid",
            "topology.world_size=4",
            "topology.layout=zigzag",
            "shape.seq_len=1032",
        ],
    ),
    (
        ["topology=ring", "topology.simulate=true", "topology.world_size=auto"],
        "topology.world_size",  # simulated ranks are counted, not found
        ["topology=ring", "topology.simulate=true", "topology.world_size=64"],
    ),
    (
        ["topology=ring", "topology.simulate=true", "topology.world_size=1024"],
        "topology.world_size",
        ["topology=ring", "topology.simulate=true", "topology.world_size=512"],
    ),
    (
        ["topology=ring", "topology.fabric=warp"],
        "topology.fabric",
        ["topology=ring", "topology.fabric=nvl72"],
    ),
    (
        ["topology=ring", "topology.fabric_gbps=100"],
        "topology.fabric_gbps",  # read only with fabric=custom
        ["topology=ring", "topology.fabric=custom", "topology.fabric_gbps=100"],
    ),
    (
        [
            "topology=ring",
            "topology.simulate=true",
            "topology.world_size=8",
            "topology.fabric=custom",
            "topology.fabric_latency_us=5",
        ],
        "topology.fabric_gbps",  # custom needs both numbers
        [
            "topology=ring",
            "topology.simulate=true",
            "topology.world_size=8",
            "topology.fabric=custom",
            "topology.fabric_latency_us=5",
            "topology.fabric_gbps=100",
        ],
    ),
    (
        [
            "topology=hybrid",
            "topology.world_size=8",
            "topology.simulate=true",
            "topology.options.a2a_size=null",
        ],
        "topology.options.a2a_size",  # no NVLink domains to take the group size from
        [
            "topology=hybrid",
            "topology.world_size=8",
            "topology.options.a2a_size=2",
            "topology.simulate=true",
        ],
    ),
    (["+logger.projct=demo"], "logger.projct", ["logger.project=demo"]),  # the tracker's keys
    (["topology.layout=[zigzag]"], "topology.layout", ["topology.layout=zigzag"]),  # a string
    (["passes=[fwd,sideways]"], "passes", ["passes=[fwd]"]),
    (["baselines=[cudnn]"], "baselines", ["baselines=[sdpa]"]),
    (["benchmark.repeats=0"], "benchmark.repeats", ["benchmark.repeats=1"]),
    (["benchmark.budget_ms=-5"], "benchmark.budget_ms", ["benchmark.budget_ms=0"]),
    (["benchmark.budget_ms=soon"], "benchmark.budget_ms", ["benchmark.budget_ms=null"]),
]


@pytest.mark.parametrize(("bad", "key", "good"), CASES, ids=[c[1] for c in CASES])
def test_bad_value_named_and_neighbour_accepted(hydra_ctx, bad, key, good):
    with pytest.raises(ConfigError) as info:
        check_config(make(bad))
    assert info.value.key == key
    value = bad[-1].split("=", 1)[1].strip("[]").split(",")[-1]
    assert value in str(info.value), f"the message should repeat the value: {info.value}"
    check_config(make(good))


def test_unknown_variant_suggests(hydra_ctx):
    with pytest.raises(ConfigError, match="did you mean 'sliding_window'"):
        check_config(make(["attention.name=sliding_windw"]))


def test_seq_len_must_split_over_ranks(hydra_ctx):
    if "ring" not in registry.names("task"):
        pytest.skip("the ring task is not registered yet")
    base = ["topology=ring", "topology.world_size=2"]
    with pytest.raises(ConfigError) as info:
        check_config(make([*base, "shape.seq_len=1023"]))
    assert info.value.key == "shape.seq_len"
    check_config(make([*base, "shape.seq_len=1026"]))
    with pytest.raises(ConfigError) as info:
        check_config(make([*base, "topology.layout=zigzag", "shape.seq_len=1026"]))
    assert info.value.key == "shape.seq_len" and "zigzag" in str(info.value)
    check_config(make([*base, "topology.layout=zigzag", "shape.seq_len=1024"]))
    settings = from_config(make(["topology=ring", "device=cpu"]))
    assert settings.topology.world_size == 2  # auto on CPU


def test_single_topology_needs_one_rank(hydra_ctx):
    with pytest.raises(ConfigError) as info:
        check_config(make(["topology.world_size=2"]))
    assert info.value.key == "topology.world_size"
    check_config(make(["topology.world_size=auto"]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA refusal")
def test_cuda_without_cuda_refused_at_build(hydra_ctx):
    cfg = make(["device=cuda"])
    check_config(cfg)  # pure: no hardware probing
    with pytest.raises(ConfigError) as info:
        from_config(cfg)
    assert info.value.key == "device.name"
    assert from_config(make(["device=auto"])).device == "cpu"


def test_from_config_resolves_auto(hydra_ctx):
    settings = from_config(make(["device=cpu", "shape.kv_heads=2"]))
    assert settings.device == "cpu" and settings.dtype == "float32"
    assert settings.shape.kv_heads == 2 and settings.topology.world_size == 1
    assert settings.passes == ("fwd", "bwd") and settings.logger["mode"] == "offline"


def test_resolvers():
    from attngym.runner.overrides import _div, _split

    assert _split(1000, [0.4, 0.1, 0.3, 0.2]) == [400, 100, 300, 200]
    assert sum(_split(1021, [1, 1, 1])) == 1021
    assert _div(1024, 32) == 32
    with pytest.raises(ValueError, match="non-zero"):
        _div(4, 0)


def test_block_size_message_lists_the_named_options(hydra_ctx):
    with pytest.raises(ConfigError, match=r"multiple of 16 or one of \['flash', 'tuned'\], got 24"):
        check_config(make(["block_size.q=24"]))
    with pytest.raises(ConfigError, match=r"one of \['flash', 'tuned'\], got 'flsh'"):
        check_config(make(["block_size.kv=flsh"]))
    check_config(make(["block_size.q=flash", "block_size.kv=32"]))


def test_flash_backend_refused_on_cpu(hydra_ctx):
    flash = ["device=cpu", "dtype=bfloat16", "+kernel_options.BACKEND=FLASH", "block_size=flash"]
    check_config(make(flash))  # pure: the device is not probed yet
    with pytest.raises(ConfigError, match="FLASH is a CUDA backend") as info:
        from_config(make(flash))
    assert info.value.key == "kernel_options.BACKEND"
    assert from_config(make(flash[:2])).dtype == "bfloat16"  # without FLASH: accepted


@pytest.mark.parametrize(
    ("overrides", "key", "says"),
    [
        (["topology=ring", "device=cpu"], "topology.cuda_graph", "device=cpu"),
        (["topology=single", "device=cpu"], "topology.cuda_graph", "topology=single"),
    ],
)
def test_cuda_graph_refused_where_nothing_can_be_captured(hydra_ctx, overrides, key, says):
    cfg = make([*overrides, "++topology.cuda_graph=true"])
    with pytest.raises(ConfigError, match=says) as info:
        from_config(cfg)
    assert info.value.key == key
    assert not from_config(make(overrides)).topology.cuda_graph  # the default: accepted


def test_cuda_graph_refuses_gloo_on_cuda(hydra_ctx):
    from attngym.runner import config

    data = {"topology": {"kind": "ring", "cuda_graph": True, "transport": "gloo",
                         "simulate": False}, "device": {"name": "cuda"}}  # fmt: skip
    with pytest.raises(ConfigError, match="cannot capture") as info:
        config.topology._cuda_graph(data)
    assert info.value.key == "topology.transport"
    for transport in ("copy_engine", "nccl", "auto"):  # what a graph can capture
        config.topology._cuda_graph(
            {**data, "topology": {**data["topology"], "transport": transport}}
        )


def test_flash_backend_needs_the_flash_block_size(monkeypatch):
    from attngym.runner import config

    sm100 = lambda device: (256, 128)  # an SM100 GPU's FLASH block size
    monkeypatch.setattr(config.flash, "_flash_block_size", sm100)

    def resolved(backend, q):
        return {
            "kernel_options": {"BACKEND": backend},
            "device": {"name": "cuda"},
            "block_size": {"q": q, "kv": 128},
        }

    with pytest.raises(
        ConfigError, match=r"\(256, 128\) .* got \(128, 128\); use block_size=flash"
    ):
        config.flash._flash_on_this_device(resolved("FLASH", 128))
    config.flash._flash_on_this_device(resolved("FLASH", 256))
    config.flash._flash_on_this_device(resolved("TRITON", 128))


def test_flash_backend_needs_flash_attn_and_its_cute_dsl(monkeypatch):
    """Without flash-attn-4 or the CuTe DSL (cutlass) FLASH is refused before any tensor work,
    naming the module, instead of failing inside Inductor's first compile."""
    import importlib.util

    from attngym import tuning
    from attngym.runner import config

    here = {"flash_attn.cute"}  # flash-attn-4 found, its DSL not (a --target install, say)
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: object() if name in here else None
    )
    assert tuning.flash_missing() == "cutlass (nvidia-cutlass-dsl) is not importable"
    flash = {"kernel_options": {"BACKEND": "FLASH"}}
    with pytest.raises(ConfigError, match="FLASH runs flash-attn-4's kernels, but cutlass") as info:
        config.flash._flash_is_installed(flash)
    assert info.value.key == "kernel_options.BACKEND"
    config.flash._flash_is_installed({"kernel_options": {"BACKEND": "TRITON"}})
    here.add("cutlass")
    assert tuning.flash_missing() is None and tuning.flash_importable()
    config.flash._flash_is_installed(flash)


def test_device_resolved_by_the_device_module(hydra_ctx, monkeypatch):
    from attngym import device

    def refuse(name):
        raise ValueError(f"device={name!r} was requested but CUDA is not available")

    monkeypatch.setattr(device, "resolve_device", refuse)
    with pytest.raises(ConfigError, match="CUDA is not available") as info:
        from_config(make(["device=cuda"]))
    assert info.value.key == "device.name"
    monkeypatch.undo()
    assert from_config(make(["device=cpu"])).device == "cpu"


def test_choices_are_the_library_tuples(hydra_ctx):
    from attngym.distributed.placement.layout import LAYOUTS
    from attngym.distributed.transport import TRANSPORTS
    from attngym.inputs import TORCH_DTYPES
    from attngym.runner.tracking.wandb_logger import MODES

    for choices, key in ((TRANSPORTS, "topology.transport"), (LAYOUTS, "topology.layout")):
        with pytest.raises(ConfigError, match=", ".join(sorted(choices))):
            check_config(make([f"{key}=nope"]))
    with pytest.raises(ConfigError, match=", ".join(sorted(MODES))):
        check_config(make(["logger.mode=nope"]))
    import attngym.runner.config as config

    assert set(TORCH_DTYPES) == set(config.DTYPES) - {"auto"}
    assert not hasattr(config, "TRANSPORTS") and not hasattr(config, "WANDB_MODES")


def test_defaults_come_from_the_dataclasses():
    """A mapping that names only the variant is a whole config: every other value is the default
    of its Settings field, so the dataclasses are the one source of defaults."""
    from attngym.runner.config import Settings

    settings = from_config({"attention": {"name": "causal"}, "device": {"name": "cpu"}})
    default = Settings(attention={"name": "causal"}, device="cpu")
    for field in ("shape", "topology", "benchmark", "block_size", "kernel_options", "compile"):
        assert getattr(settings, field) == getattr(default, field), field
    for field in ("compile_mode", "passes", "baselines", "validate", "validate_rows", "seed"):
        assert getattr(settings, field) == getattr(default, field), field
    assert settings.baseline_max_mask_bytes == default.baseline_max_mask_bytes == 256 * 2**20
    assert (settings.device, settings.dtype, settings.profiler) == ("cpu", "float32", "none")
    assert settings.logger == default.logger == {"name": "wandb"}  # as conf/config.yaml
    with pytest.raises(ConfigError, match="attention: missing; it has no default"):
        from_config({"device": {"name": "cpu"}})


def test_auto_is_a_typed_default_resolved_in_settings():
    """device, dtype and topology.world_size default to `auto` in the types; Settings hold them
    resolved (from_config resolves them, Settings made directly alike)."""
    from attngym.runner.config import AUTO, Settings, Topology

    defaults = {f.name: f.default for f in dataclasses.fields(Settings)}
    assert defaults["device"] == defaults["dtype"] == AUTO
    assert {f.name: f.default for f in dataclasses.fields(Topology)}["world_size"] == AUTO
    made = Settings(attention={"name": "causal"})
    assert made.device in ("cpu", "cuda") and made.topology.world_size == 1
    assert made.dtype == ("bfloat16" if made.device == "cuda" else "float32")
    assert Settings(attention={"name": "causal"}, device="cpu").dtype == "float32"
    assert Settings(attention={"name": "causal"}, device="cpu", dtype="float16").dtype == "float16"


def _yaml(path: Path) -> dict:
    return OmegaConf.to_container(OmegaConf.load(path))


def _leaves(node: dict, prefix: str = "") -> dict:
    """{dotted key: value} of a YAML mapping's leaves."""
    out = {}
    for name, value in node.items():
        if isinstance(value, dict) and value:
            out.update(_leaves(value, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = value
    return out


def _at(data: dict, key: str):
    for part in key.split("."):
        data = data[part]
    return data


def _default_files() -> dict[str, dict]:
    """conf/config.yaml (its defaults list left out) and the default option of each group, by
    the config node each one fills ("" for the root)."""
    root = _yaml(CONF / "config.yaml")
    files = {"": root}
    for entry in root.pop("defaults"):
        if isinstance(entry, dict):
            ((group, option),) = entry.items()
            if group in GROUPS:
                files[group] = _yaml(CONF / group / f"{option}.yaml")
    assert set(files) == {"", *GROUPS}
    return files


def test_yaml_defaults_agree_with_the_typed_defaults():
    """Wherever conf/config.yaml or a group's default option states a key, it states the typed
    default: the same value once checked (null kernel options are none, 120 seconds 120.0).
    The variant has no typed default (the config names it); a tracker's parameters default in
    its factory's signature."""
    import inspect

    files = _default_files()
    stated = check_config({**files[""], **{group: files[group] for group in GROUPS}})
    typed = check_config({"attention": stated["attention"]})  # every other key: its default
    tracker = registry.get("tracker", typed["logger"]["name"])
    params = inspect.signature(tracker).parameters
    compared = 0
    for group, node in files.items():
        for key in _leaves(node, f"{group}." if group else ""):
            if key.startswith("attention"):
                continue
            if key.startswith("logger.") and key != "logger.name":
                default = params[key.removeprefix("logger.")].default
                got = _at(stated, key)
                assert (list(got) if isinstance(got, list) else got) == (
                    list(default) if isinstance(default, tuple) else default
                ), key
                continue
            assert _at(stated, key) == _at(typed, key), key
            compared += 1
    assert compared >= 20


def test_every_yaml_key_is_a_known_key():
    from attngym.runner.config import check_key

    for key in _leaves(_default_files()[""]):
        check_key(key)
    for group in GROUPS:
        for path in (CONF / group).glob("*.yaml"):
            own = {k: v for k, v in _yaml(path).items() if k != "defaults"}  # Hydra's list
            for key in _leaves(own, f"{group}."):
                check_key(key)
    for path in (CONF / "_shared").glob("*.yaml"):  # a group's shared keys, extended by it
        for key in _leaves(_yaml(path), f"{path.stem}."):
            check_key(key)
    with pytest.raises(ConfigError, match="did you mean shape.seq_len"):
        check_key("shape.seqlen")


def test_choice_tuples_come_from_the_literal_types():
    from typing import get_args

    from attngym.runner import config

    assert get_args(config.Dtype) == config.DTYPES[1:] and config.DTYPES[0] == "auto"
    assert config.DEVICES == ("auto", "cpu", "cuda")
    assert config.PASSES == ("fwd", "bwd") and "sdpa_dense_mask" in config.BASELINES


def test_settings_carry_the_variant_built_once(hydra_ctx, monkeypatch):
    import pickle

    from attngym.variants import spec

    built = []
    build = spec.build_variant
    monkeypatch.setattr(spec, "build_variant", lambda *a, **kw: built.append(a) or build(*a, **kw))
    settings = from_config(make(["attention=sliding_window", "device=cpu"]))
    assert settings.variant.name == "sliding_window" and len(built) == 1
    assert settings.variant.params == {"window_size": 256}
    # A spawned rank gets the settings pickled: the closures stay behind, the rank rebuilds them.
    copy = pickle.loads(pickle.dumps(settings))
    assert copy.variant.name == "sliding_window" and copy.variant is not settings.variant
    assert copy.shape == settings.shape and copy.attention == settings.attention


def test_kv_heads_resolved_once():
    from attngym.runner.config import Shape

    assert Shape(heads=8).kv_heads == 8 and Shape(heads=8, kv_heads=2).kv_heads == 2


def test_describe_names_the_device_not_the_architecture(hydra_ctx):
    from attngym.device import cpu_model
    from attngym.metrics import table_columns

    described = from_config(make(["device=cpu"])).describe()
    assert "gpu" not in described and described["device_name"] == cpu_model()
    assert set(described) - {"capability", "torch"} <= set(table_columns())


def test_a_run_too_large_for_this_machine_is_refused_before_any_tensor(hydra_ctx):
    with pytest.raises(ConfigError) as info:
        from_config(make(["device=cpu", "shape.seq_len=10000000"]))
    assert info.value.key == "shape.seq_len" and "\n" not in str(info.value)
    assert "available RAM" in str(info.value) and str(info.value).count("iB") >= 2  # both numbers


def test_a_baseline_that_alone_would_not_fit_is_skipped(hydra_ctx, monkeypatch):
    # S=8192 on a CPU: the process and tensors ~764 MiB, eager flex 2 x 4 heads x 8192^2 float32
    # = 2 GiB, SDPA's math backend as much, the dense-mask baseline its 256 MiB float32 bias more
    # (3068 MiB in all); with 2940 MiB available only that one is left out.
    from attngym import estimate

    monkeypatch.setattr(estimate, "available_memory", lambda device: 2940 * 2**20)
    settings = from_config(make(["device=cpu", "shape.seq_len=8192"]))
    assert set(settings.skipped_baselines) == {"sdpa_dense_mask"}
    assert "available" in settings.skipped_baselines["sdpa_dense_mask"]


def test_more_ranks_than_cpu_cores_refused(hydra_ctx, monkeypatch):
    from attngym import estimate

    monkeypatch.setattr(estimate, "_cpu_cores", lambda: 2)
    with pytest.raises(ConfigError) as info:
        from_config(make(["device=cpu", "topology=ring", "topology.world_size=64"]))
    assert info.value.key == "topology.world_size" and "2 core" in str(info.value)


def test_hybrid_groups_checked_against_the_resolved_world_size(hydra_ctx):
    """topology.world_size=auto is 2 on CPU: a2a_size is judged once the ranks are known, and
    the composed hybrid topology reaches Settings typed."""
    with pytest.raises(ConfigError) as info:
        from_config(make(["topology=hybrid", "device=cpu", "topology.options.a2a_size=4"]))
    assert info.value.key == "topology.options.a2a_size" and "world_size=2" in str(info.value)
    settings = from_config(
        make(
            [
                "topology=hybrid",
                "device=cpu",
                "topology.options.a2a_size=2",
                "topology.options.across=allgather",
            ]
        )
    )
    topo = settings.topology
    assert (topo.kind, topo.world_size, topo.options["a2a_size"], topo.options["across"]) == (
        "hybrid",
        2,
        2,
        "allgather",
    )


def _with(key: str, value) -> dict:
    """A config naming the variant, with `value` at dotted `key`."""
    data: dict = {"attention": {"name": "causal"}}
    node = data
    *parents, leaf = key.split(".")
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return data


def test_the_walker_names_the_dotted_key_of_every_setting():
    """A value of the wrong type anywhere is refused by its own dotted key, in every section."""
    from attngym.runner.config import known_keys

    keys = known_keys()
    sections = {key.split(".")[0] for key in keys if "." in key}
    assert sections == {"shape", "topology", "benchmark", "workload", "device", "block_size",
                        "profiler"}  # fmt: skip
    for key in keys:
        with pytest.raises(ConfigError) as info:
            check_config(_with(key, ["?"]))
        assert info.value.key == key, (key, str(info.value))
        assert "'?'" in str(info.value), str(info.value)
    for key in ("shape", "topology", "benchmark", "workload", "device", "block_size"):  # no map
        with pytest.raises(ConfigError, match=rf"^{key}: must be a mapping, got 3$"):
            check_config({"attention": {"name": "causal"}, key: 3})
        check_config({"attention": {"name": "causal"}, key: None})  # null: every default


def test_open_mappings_are_mappings():
    with pytest.raises(ConfigError, match="^attention: must be a mapping, got 'causal'$"):
        check_config({"attention": "causal"})
    with pytest.raises(ConfigError, match="^kernel_options: must be a mapping, got 4$"):
        check_config(_with("kernel_options", 4))
    check_config(_with("kernel_options", None))  # null: none
    with pytest.raises(ConfigError, match="^logger: must be a mapping, got 'wandb'$"):
        check_config(_with("logger", "wandb"))
    assert check_config(_with("logger", None))["logger"] == {"name": "wandb"}


def test_a_tracker_parameter_is_checked_by_its_factory():
    """The tracker's keyword arguments are the logger.* keys: a misspelt one is refused before
    the run (with the parameters it has), and its defaults are the factory's."""
    with pytest.raises(ConfigError, match="did you mean 'project'") as info:
        check_config(_with("logger", {"name": "wandb", "projct": "demo"}))
    assert info.value.key == "logger.projct"
    with pytest.raises(ConfigError, match="'local' has no parameter 'mode'") as info:
        check_config(_with("logger", {"name": "local", "mode": "offline"}))
    assert info.value.key == "logger.mode"
    assert check_config(_with("logger", {"name": "local"}))["logger"] == {"name": "local"}
    assert check_config(_with("logger.project", "demo"))["logger"] == {
        "name": "wandb",
        "project": "demo",
    }


@dataclasses.dataclass(frozen=True)
class FakeOptions:
    """The fake topology's own options, typed as a spec states them."""

    stripes: int | None = None


@dataclasses.dataclass
class FakeSpec:
    """A topology as attngym.distributed's table states one: layouts, typed options, rules."""

    layouts: tuple = ("contiguous", "stripes")
    options: type = FakeOptions
    binder: None = None
    seen: list = dataclasses.field(default_factory=list)

    def bind(self, scheme=None, scheme_args=None):
        return self

    def takes_layout(self, layout):
        return layout in self.layouts

    def option_values(self, given):
        return dataclasses.asdict(FakeOptions(**(given or {})))

    def check(self, topology, shape):
        from attngym.errors import choice_error

        world_size = topology["world_size"]  # `auto` until resolved, as TopologySpec.check reads
        world_size = world_size if isinstance(world_size, int) else None
        layout, seq_len = topology["layout"], shape["seq_len"]
        mine = self.option_values(topology["options"])
        self.seen.append({"world_size": world_size, "layout": layout, "options": mine})
        if layout not in self.layouts:
            raise ConfigError(
                "topology.layout", choice_error("layout for fake", layout, self.layouts)
            )
        if world_size is not None and seq_len % world_size:
            raise ConfigError("shape.seq_len", f"{seq_len} does not split over {world_size}")


@pytest.fixture
def fake_topology(monkeypatch):
    """A topology `fake` (a task and a spec) in the registry, beside the real ones."""
    spec = FakeSpec()
    names, get = registry.names, registry.get

    def fake_names(kind):
        if kind == "topology":
            try:
                return sorted([*names(kind), "fake"])
            except ValueError:  # no table of real topologies
                return ["fake"]
        return sorted([*names(kind), "fake"]) if kind == "task" else names(kind)

    def fake_get(kind, name):
        return spec if (kind, name) == ("topology", "fake") else get(kind, name)

    monkeypatch.setattr(registry, "names", fake_names)
    monkeypatch.setattr(registry, "get", fake_get)
    return spec


def test_a_topology_is_judged_by_its_spec(fake_topology):
    """The spec gets the shape and the topology section (its layout and own options, world_size
    `auto` and the resolved count after); its refusals reach the user with their key."""
    topo = {"kind": "fake", "layout": "stripes", "options": {"stripes": 2}}
    check_config(_with("topology", topo))
    assert fake_topology.seen[-1] == {
        "world_size": None,
        "layout": "stripes",
        "options": {"stripes": 2},
    }
    with pytest.raises(ConfigError, match="must be a positive integer") as info:
        check_config(_with("topology", {**topo, "options": {"stripes": "two"}}))
    assert info.value.key == "topology.options.stripes"
    with pytest.raises(
        ConfigError, match="unknown topology option 'strips'.*did you mean 'stripes'"
    ) as info:
        check_config(_with("topology", {**topo, "options": {"strips": 2}}))
    assert info.value.key == "topology.options.strips"
    settings = from_config({**_with("topology", topo), "device": {"name": "cpu"}})
    assert fake_topology.seen[-1]["world_size"] == 2 == settings.topology.world_size  # CPU
    assert settings.describe()["layout"] == "stripes"
    with pytest.raises(ConfigError, match="layout for fake 'spiral'") as info:
        check_config(_with("topology", {**topo, "layout": "spiral"}))
    assert info.value.key == "topology.layout"
    with pytest.raises(ConfigError) as info:
        check_config({**_with("topology", {**topo, "world_size": 2}), "shape": {"seq_len": 1023}})
    assert info.value.key == "shape.seq_len"
    check_config({**_with("topology", {**topo, "world_size": 2}), "shape": {"seq_len": 1024}})


def test_flash_takes_a_cp_backward(fake_topology):
    """A CP backward takes no lse gradient (flex's backward op with the merged lse; one kernel
    call's output elsewhere), which is all FLASH's backward refuses: no topology refuses it."""
    flash = {
        "attention": {"name": "causal"},
        "topology": {"kind": "fake"},
        "dtype": "bfloat16",
        "kernel_options": {"BACKEND": "FLASH"},
    }
    assert "bwd" in check_config(flash)["passes"]


def test_one_device_takes_one_rank_and_any_topologys_layout(fake_topology):
    single = {"kind": "single"}
    check_config(_with("topology", {**single, "layout": "stripes"}))  # a sweep may set it
    with pytest.raises(ConfigError, match="unknown layout 'spiral'.*stripes") as info:
        check_config(_with("topology", {**single, "layout": "spiral"}))
    assert info.value.key == "topology.layout"
    with pytest.raises(ConfigError, match="must be 1 \\(or auto\\) for topology single, got 2"):
        check_config(_with("topology", {**single, "world_size": 2}))
    settings = from_config({**_with("topology", single), "device": {"name": "cpu"}})
    assert settings.topology.world_size == 1 and settings.describe()["layout"] is None


def test_every_topology_spec_fits_the_typed_topology():
    """Each context-parallel task has a spec, whose options are a dataclass of its own (the
    keys topology.options.* a config writes, none a Topology field) and whose layouts take the
    typed default."""
    from attngym.runner import config

    fields = {f.name: f for f in dataclasses.fields(config.Topology)}
    specs = config.machine._topology_specs()
    assert set(specs) == set(registry.names("task")) - {"single"}
    for kind, spec in specs.items():
        if spec.options is not None:
            assert dataclasses.is_dataclass(spec.options), kind
            assert not {f.name for f in dataclasses.fields(spec.options)} & set(fields), kind
        assert fields["layout"].default in spec.layouts, kind


def test_device_gpu_suggests_cuda_not_cpu():
    from attngym.runner.overrides import prepare_overrides

    with pytest.raises(ConfigError, match=r"did you mean 'cuda'\?"):
        prepare_overrides(["device=gpu"])
    with pytest.raises(ConfigError, match=r"did you mean 'cuda'\?"):
        check_config({"attention": {"name": "causal"}, "device": {"name": "gpu"}})


def test_a_triton_tile_that_does_not_divide_its_block_is_refused_before_any_compile():
    """What a tuning trial met on the H200 only inside Inductor, seconds into a compile."""
    from attngym.runner import config

    def resolved(device, q, **options):
        return {"kernel_options": options, "device": {"name": device},
                "block_size": {"q": q, "kv": 128}}  # fmt: skip

    refuse = config.flash._triton_tiles_divide_blocks
    with pytest.raises(ConfigError, match=r"128 must divide block_size.q \(64\)") as info:
        refuse(resolved("cuda", 64, fwd_BLOCK_M=128))
    assert info.value.key == "kernel_options.fwd_BLOCK_M"
    with pytest.raises(ConfigError, match=r"96 must divide block_size.kv \(128\)") as info:
        refuse(resolved("cuda", 128, BLOCK_N=96))
    assert info.value.key == "kernel_options.BLOCK_N"
    # the backward's tiles too: Inductor has no backward kernel otherwise (NoValidChoicesError)
    with pytest.raises(ConfigError, match=r"128 must divide block_size.q \(64\)") as info:
        refuse(resolved("cuda", 64, bwd_BLOCK_M1=32, bwd_BLOCK_M2=128))
    assert info.value.key == "kernel_options.bwd_BLOCK_M2"
    with pytest.raises(ConfigError, match=r"256 must divide block_size.kv \(128\)") as info:
        refuse(resolved("cuda", 128, BLOCK_N1=256))
    assert info.value.key == "kernel_options.BLOCK_N1"
    refuse(resolved("cuda", 64, fwd_BLOCK_M=32, fwd_BLOCK_N=64))  # divisors: accepted
    refuse(resolved("cuda", 64, bwd_BLOCK_M1=64, bwd_BLOCK_N1=128, bwd_BLOCK_N2=32))
    refuse(resolved("cuda", 64, fwd_BLOCK_M=128, BACKEND="FLASH"))  # FLASH's own tiles
    refuse(resolved("cpu", 64, fwd_BLOCK_M=128))  # eager flex on a CPU: no tiles


def test_backward_tiles_that_do_not_nest_are_refused_before_the_compile():
    """Inductor's backward template asserts BLOCK_N1 % BLOCK_M1 == 0 and BLOCK_M2 % BLOCK_N2 ==
    0: a tuning trial on the H200 drew M1 64 with N1 32 and failed in bwd_dkdv_inner, compiling."""
    from attngym.runner import config

    def resolved(device="cuda", passes=("fwd", "bwd"), **options):
        return {"kernel_options": options, "device": {"name": device}, "passes": list(passes)}

    refuse = config.flash._triton_backward_tiles_nest
    with pytest.raises(
        ConfigError, match=r"32 must be a multiple of kernel_options.bwd_BLOCK_M1 \(64\)"
    ) as info:  # noqa: E501
        refuse(resolved(bwd_BLOCK_M1=64, bwd_BLOCK_N1=32))
    assert info.value.key == "kernel_options.bwd_BLOCK_N1"
    with pytest.raises(ConfigError, match=r"BLOCK_M2") as info:
        refuse(resolved(BLOCK_N2=64, bwd_BLOCK_M2=32))  # with or without the bwd_ prefix
    assert info.value.key == "kernel_options.bwd_BLOCK_M2"
    refuse(resolved(bwd_BLOCK_M1=32, bwd_BLOCK_N1=64, bwd_BLOCK_N2=32, bwd_BLOCK_M2=64))  # nested
    refuse(resolved(bwd_BLOCK_M1=64, bwd_BLOCK_N1=64))  # equal tiles nest
    refuse(resolved(bwd_BLOCK_M1=64, bwd_BLOCK_N1=32, BACKEND="FLASH"))  # FLASH's own tiles
    refuse(resolved("cpu", bwd_BLOCK_M1=64, bwd_BLOCK_N1=32))  # eager flex: no tiles
    refuse(resolved(passes=("fwd",), bwd_BLOCK_M1=64, bwd_BLOCK_N1=32))  # no backward compiled


def _trial(seed=0):
    """A real Optuna trial of an in-memory study, as the tuner's sweeper hands one over."""
    optuna = pytest.importorskip("optuna")
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=seed)).ask()


def _tune_cfg(device="cpu", dtype="auto"):
    from omegaconf import OmegaConf

    return OmegaConf.create({"passes": ["fwd", "bwd"], "dtype": dtype, "compile": True,
                             "compile_mode": "default", "kernel_options": {},
                             "device": {"name": device}, "shape": {"head_dim": 128}})  # fmt: skip


def test_the_tuner_draws_block_sizes_alone_on_a_cpu():
    """Eager flex on a CPU has no kernel options and one backend: a trial draws block sizes."""
    from attngym.runner import tune_search

    trial = _trial()
    tune_search.search_space(_tune_cfg(), trial)
    assert set(trial.params) == {"block_size.q", "block_size.kv"}


def test_the_tuner_draws_flash_only_where_it_can_run_and_tiles_that_nest(monkeypatch):
    """On CUDA (faked: the capability and device, Inductor's tiles as on an H200): FLASH is drawn
    only where flash-attn-4 imports and the dtype is 16-bit; Triton trials draw tiles that divide
    the block sizes and nest, so every drawn configuration passes the config's own rules."""
    import torch

    from attngym import device, tuning
    from attngym.runner import config, tune_search

    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device(name))
    monkeypatch.setattr(device, "triton_backward_tiles", lambda *a, **k: H200_D128_BACKWARD)
    monkeypatch.setattr(device, "get_flash_block_size", lambda *a: (256, 128))
    monkeypatch.setattr(tuning, "flash_missing", lambda: "flash_attn.cute is not importable")
    assert tune_search.tuner_backends(_tune_cfg("cuda")) == ["TRITON"]
    monkeypatch.setattr(tuning, "flash_missing", lambda: None)
    assert tune_search.tuner_backends(_tune_cfg("cuda", "float32")) == ["TRITON"]
    assert tune_search.tuner_backends(_tune_cfg("cuda")) == ["TRITON", "FLASH"]
    seen = set()
    for seed in range(40):
        trial = _trial(seed)
        tune_search.search_space(_tune_cfg("cuda"), trial)
        params = {k.lstrip("+"): v for k, v in trial.params.items()}
        backend = params.pop("kernel_options.BACKEND")
        seen.add(backend)
        if backend == "FLASH":
            assert params == {"block_size": "flash"}
            continue
        assert (params["block_size.q"], params["block_size.kv"]) == (128, 128)
        options = {k.split(".", 1)[1]: v for k, v in params.items() if k.startswith("kernel_")}
        assert len(options) == 10
        data = {"kernel_options": options, "device": {"name": "cuda"}, "passes": ["fwd", "bwd"],
                "block_size": {"q": 128, "kv": 128}}  # fmt: skip
        config.flash._triton_tiles_divide_blocks(data)
        config.flash._triton_backward_tiles_nest(data)
    assert seen == {"TRITON", "FLASH"}


# Inductor's backward tiles (M1, N1, M2, N2) for flex on an H200 at head_dim 128, bfloat16
H200_D128_BACKWARD = [(64, 128, 128, 64)]


def test_a_block_size_with_no_triton_backward_kernel_is_refused_in_one_line(monkeypatch):
    """What the tuner met on the H200: every Triton trial with a 64-block failed seconds into
    its compile (NoValidChoicesError, pages of IR): Inductor filters its own backward tiles by
    the block sizes before a user's bwd_ options apply."""
    from attngym import device
    from attngym.runner import config

    assert config.backward_block_error({"q": 128, "kv": 128}, H200_D128_BACKWARD) is None
    key, why = config.backward_block_error({"q": 128, "kv": 64}, H200_D128_BACKWARD)
    assert key == "block_size.kv" and why.startswith("64 has no Triton backward kernel")
    assert config.backward_block_error({"q": 64, "kv": 64}, H200_D128_BACKWARD)[0] == (
        "block_size.q"
    )
    monkeypatch.setattr(device, "triton_backward_tiles", lambda *a, **k: H200_D128_BACKWARD)
    data = {"kernel_options": {"bwd_BLOCK_N1": 64}, "passes": ["fwd", "bwd"], "compile": True,
            "compile_mode": "default", "device": {"name": "cuda"}, "dtype": "bfloat16",
            "shape": {"head_dim": 128}, "block_size": {"q": 128, "kv": 64}}  # fmt: skip
    with pytest.raises(ConfigError, match=r"^block_size.kv: 64 has no Triton backward") as info:
        config.flash._triton_backward_has_a_kernel(data)
    assert "\n" not in str(info.value)
    for fine in ({"passes": ["fwd"]}, {"compile": False}, {"kernel_options": {"BACKEND": "FLASH"}},
                 {"device": {"name": "cpu"}}):  # fmt: skip
        config.flash._triton_backward_has_a_kernel({**data, **fine})
    monkeypatch.setattr(device, "triton_backward_tiles", lambda *a, **k: None)  # cannot say
    config.flash._triton_backward_has_a_kernel(data)


def test_inductors_own_backward_tiles_are_read_for_the_gpu(monkeypatch):
    """Inductor's real heuristics, only the GPU's capability faked (9.0, an H100/H200)."""
    import torch

    from attngym import device
    from attngym.runner import config

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (9, 0))
    monkeypatch.setattr(device, "resolve_device", lambda name: torch.device("cuda"))
    assert device.triton_backward_tiles(128, "bfloat16") == H200_D128_BACKWARD
    searched = device.triton_backward_tiles(128, "bfloat16", autotune=True)
    assert config.backward_block_error({"q": 64, "kv": 64}, searched) is None  # autotune's own


def test_the_tuner_searches_only_block_sizes_with_a_triton_backward(monkeypatch):
    from omegaconf import OmegaConf

    from attngym import device, tuning

    cfg = OmegaConf.create({"passes": ["fwd", "bwd"], "dtype": "auto", "compile_mode": "default",
                            "device": {"name": "cpu"}, "shape": {"head_dim": 128}})  # fmt: skip
    every = list(tuning.TUNED_BLOCK_SIZES)
    assert tuning.triton_block_sizes(cfg) == {"q": every, "kv": every}  # a CPU: eager flex
    monkeypatch.setattr(device, "triton_backward_tiles", lambda *a, **k: H200_D128_BACKWARD)
    assert tuning.triton_block_sizes(cfg) == {"q": [128], "kv": [128]}
    cfg.passes = ["fwd"]  # no backward: every size
    assert tuning.triton_block_sizes(cfg) == {"q": every, "kv": every}
