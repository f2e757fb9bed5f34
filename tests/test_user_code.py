"""Code a user names by import path: how a callback path is read (the mod itself or a factory,
by its parameter names), where an error in it was raised (the user's file and line, one line
naming the key), and the record of it a resumed sweep compares (the code fingerprint)."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap

import pytest
import torch

from attngym import user_code
from attngym.errors import ConfigError
from attngym.reference import dense_mask
from attngym.variants import custom
from attngym.variants.spec import build_variant

S = 256

# A researcher's module; the line numbers of `raise` below are asserted (FACTORY_RAISES, ...).
MYMASKS = textwrap.dedent(
    """\
    import torch


    def random_block(block=32, p=0.3, seed=0, seq_len=256, device="cpu"):
        g = torch.Generator().manual_seed(seed)
        n = seq_len // block
        keep = (torch.rand(n, n, generator=g) < p) | torch.eye(n, dtype=torch.bool)
        keep = keep.to(device)

        def mask_mod(b, h, q_idx, kv_idx):
            return keep[q_idx // block, kv_idx // block]

        return mask_mod


    def dilated_causal(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0)


    def fails_to_build(stride):
        raise ValueError("no stride " + str(stride))


    def raises(b, h, q_idx, kv_idx):
        return q_idx.no_such_method()


    def reads_an_item(b, h, q_idx, kv_idx):
        last = int(q_idx.max())
        return kv_idx <= last


    def noisy(score, b, h, q_idx, kv_idx):
        return score + torch.rand_like(score)


    def on_the_run_grid(b, h, q_idx, kv_idx):
        if kv_idx.numel() >= 1024:
            raise RuntimeError("too many keys")
        return q_idx >= kv_idx


    def star(*args):
        if not args:
            return dilated_causal
        return args[2] >= args[3]
    """
)
FACTORY_RAISES, METHOD_RAISES, ITEM_LINE, RAND_LINE, GRID_RAISES = 21, 25, 29, 34, 39


@pytest.fixture
def mymasks(user_module):
    return user_module("mymasks", MYMASKS)


def _keep(variant):
    pos = torch.arange(S)
    return dense_mask(variant.mask_mod, 1, 1, pos, pos)[0, 0]


def _random_block(block=32, p=0.3, seed=0, seq_len=S):
    """random_block's mask, built densely apart from it."""
    g = torch.Generator().manual_seed(seed)
    n = seq_len // block
    keep = (torch.rand(n, n, generator=g) < p) | torch.eye(n, dtype=torch.bool)
    return keep.repeat_interleave(block, 0).repeat_interleave(block, 1)


# 1. The parameter names decide how a path is read.


def test_a_factory_whose_arguments_all_have_defaults_is_read_as_a_factory(mymasks):
    # random_block takes four positional arguments too: by count it passed for the mask_mod
    variant = build_variant(
        {"name": "custom", "mask_mod": "mymasks.random_block"}, seq_len=S, heads=2
    )
    assert torch.equal(_keep(variant), _random_block())
    read = custom.reading("mymasks.random_block", None, kind="mask_mod", key="attention.mask_mod")
    assert read.factory
    assert str(read) == (
        "attention.mask_mod: mymasks.random_block as factory random_block(block=32, p=0.3, "
        "seed=0, seq_len=256, device='cpu')"
    )
    assert read.sentence() == (
        "attention.mask_mod: mymasks.random_block is a factory, by its parameter names: "
        "random_block(block=32, p=0.3, seed=0, seq_len=256, device='cpu')"
    )


@pytest.mark.parametrize(
    ("path", "factory", "why"),
    [
        ("mymasks.dilated_causal", False, "by its parameter names"),
        ("mymasks.random_block", True, "by its parameter names"),
        ("mymasks.star", False, "by its *args"),
        ("mymasks.fails_to_build", True, "by its parameter names"),
    ],
)
def test_how_each_path_is_read_and_why(mymasks, path, factory, why):
    obj = user_code.resolve(path, key="attention.mask_mod")
    assert custom._is_factory(obj, "mask_mod", None)[0] is factory
    assert custom._is_factory(obj, "mask_mod", None)[1] == why
    assert custom._is_factory(obj, "mask_mod", {}) == (True, "its arguments set")


def test_four_parameters_without_defaults_read_as_the_mod_whatever_their_names():
    def board(batch, head, q, kv):
        return (q // 16 + kv // 16) % 2 == 0

    factory, why = custom._is_factory(board, "mask_mod", None)
    assert not factory and why == "by its 4 parameters, none defaulted"
    variant = custom.build({"name": "custom", "mask_mod": board}, seq_len=S, heads=2)
    q_idx, kv_idx = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    assert torch.equal(_keep(variant), (q_idx // 16 + kv_idx // 16) % 2 == 0)


def test_attention_gyms_generators_with_default_arguments_are_factories():
    pytest.importorskip("attn_gym")
    path = "attn_gym.masks.generate_temporal_head_mask_mod"  # four parameters, all defaulted
    read = custom.reading(path, None, kind="mask_mod", key="attention.mask_mod")
    assert read.factory and read.call.startswith("generate_temporal_head_mask_mod(prompt_length=")


def test_empty_mask_args_call_the_path_as_a_factory_with_none(mymasks):
    def entry(args):
        return {"name": "custom", "mask_mod": "mymasks.star", "mask_args": args}

    star = build_variant(entry(None), seq_len=S, heads=2)  # *args: the mod itself
    q_idx, kv_idx = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)
    assert torch.equal(_keep(star), q_idx >= kv_idx)
    built = build_variant(entry({}), seq_len=S, heads=2)  # star() returns dilated_causal
    assert torch.equal(_keep(built), (q_idx >= kv_idx) & ((q_idx - kv_idx) % 2 == 0))
    assert built.name == "dilated_causal"
    with pytest.raises(ConfigError, match="needs argument 'b'") as err:
        build_variant(
            {"name": "custom", "mask_mod": "mymasks.dilated_causal", "mask_args": {}},
            seq_len=S,
            heads=2,
        )
    assert err.value.key == "attention.mask_args.b"


def test_the_run_says_how_it_read_a_path_in_its_log_and_metrics(mymasks, attngym_cli):
    common = ["attention=custom", "logger=none", f"shape.seq_len={S}", "benchmark.repeats=1"]
    for extra, said in [
        ([], "by its parameter names"),
        (["attention.mask_args={}"], "its arguments set"),
    ]:
        run = mymasks / f"run{len(extra)}"
        done = attngym_cli(
            [*common, "attention.mask_mod=mymasks.random_block", *extra, f"hydra.run.dir={run}"],
            mymasks,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        line = (
            f"attention.mask_mod: mymasks.random_block is a factory, {said}: "
            "random_block(block=32, p=0.3, seed=0, seq_len=256, device='cpu')"
        )
        assert line in (run / "attngym.log").read_text()
        metrics = json.loads((run / "metrics.json").read_text())
        assert metrics["status"] == "ok" and metrics["validation"] == "ok"
        assert metrics["callbacks_read"] == (
            "attention.mask_mod: mymasks.random_block as factory random_block(block=32, p=0.3, "
            "seed=0, seq_len=256, device='cpu')"
        )


# 2. Where the user's code raised: its file and line, one line naming the key.


@pytest.mark.parametrize(
    ("entry", "key", "where"),
    [
        (
            {"mask_mod": "mymasks.fails_to_build", "mask_args": {"stride": 2}},
            "attention.mask_args",
            f"ValueError: no stride 2, at mymasks.py:{FACTORY_RAISES} (in fails_to_build)",
        ),
        (
            {"mask_mod": "mymasks.raises"},
            "attention.mask_mod",
            f"on a probe grid (b < 2, h < 2, positions 0..255) at mymasks.py:{METHOD_RAISES} "
            "(in raises): 'Tensor' object has no attribute 'no_such_method'",
        ),
        (
            {"mask_mod": "mymasks.reads_an_item"},
            "attention.mask_mod",
            f"under torch.vmap, as create_block_mask and FlexAttention call it at "
            f"mymasks.py:{ITEM_LINE} (in reads_an_item)",
        ),
        (
            {"score_mod": "mymasks.noisy"},
            "attention.score_mod",
            f"under torch.vmap, as create_block_mask and FlexAttention call it at "
            f"mymasks.py:{RAND_LINE} (in noisy): vmap: called random operation",
        ),
    ],
)
def test_an_error_in_the_users_code_names_their_file_and_line(mymasks, entry, key, where):
    with pytest.raises(ConfigError) as err:
        build_variant({"name": "custom", **entry}, seq_len=S, heads=2)
    assert err.value.key == key and where in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    cause = err.value.__cause__  # the user's own error, its traceback through their file
    while isinstance(cause, ConfigError):
        cause = cause.__cause__
    assert cause is not None and "mymasks.py" in str(user_code.user_frame(cause).filename)


def test_an_import_that_raises_names_the_line(tmp_path, monkeypatch):
    (tmp_path / "broken.py").write_text("import os\n\nVALUE = 1 / 0\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delitem(sys.modules, "broken", raising=False)
    with pytest.raises(ConfigError, match=r"ZeroDivisionError: division by zero, at broken.py:3"):
        user_code.resolve("broken.mask", key="attention.mask_mod")


@pytest.mark.parametrize(
    ("mask", "line"),
    [
        ("mymasks.reads_an_item", ITEM_LINE),
        ("mymasks.raises", METHOD_RAISES),
    ],
)
def test_a_callback_error_is_one_line_and_the_full_error_shows_the_users_frame(
    mymasks, attngym_cli, mask, line
):
    args = ["attention=custom", f"attention.mask_mod={mask}", "logger=none", f"shape.seq_len={S}"]
    done = attngym_cli(args, mymasks)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    (error,) = [ln for ln in done.stderr.splitlines() if ln.startswith("attngym: error:")]
    assert error.startswith("attngym: error: attention.mask_mod: raised ")
    assert f"at mymasks.py:{line} (in " in error
    full = attngym_cli(args, mymasks, env={"HYDRA_FULL_ERROR": "1"})
    assert f'mymasks.py", line {line}' in full.stderr  # the user's frame, not hidden


def test_a_callback_that_fails_past_its_probe_is_one_line_naming_key_file_and_line(
    mymasks, attngym_cli
):
    run = mymasks / "run"
    args = [
        "attention=custom",
        "attention.mask_mod=mymasks.on_the_run_grid",
        "logger=none",
        "shape.seq_len=1024",
        f"hydra.run.dir={run}",
    ]
    done = attngym_cli(args, mymasks)
    assert done.returncode == 1, done.stderr[-2000:]
    assert "Traceback" not in done.stderr + done.stdout
    said = (
        "attention.mask_mod: mymasks.on_the_run_grid raised RuntimeError at "
        f"mymasks.py:{GRID_RAISES} (in on_the_run_grid) during the run"
    )
    (error,) = [ln for ln in done.stderr.splitlines() if ln.startswith("attngym: error:")]
    assert error.startswith(f"attngym: error: {said}")
    metrics = json.loads((run / "metrics.json").read_text())
    assert metrics["status"] == "failed" and metrics["error"].startswith(said)
    full = attngym_cli(
        [*args[:-1], f"hydra.run.dir={run}2"], mymasks, env={"HYDRA_FULL_ERROR": "1"}
    )
    assert f'mymasks.py", line {GRID_RAISES}' in full.stderr


@pytest.mark.parametrize(
    ("module", "source", "args", "line"),
    [
        (
            "mybal",
            "def bad(seq_len, world_size):\n    raise ValueError(f'cannot cut {seq_len}')\n",
            ["topology=ring", "topology.layout=mybal.bad", "topology.world_size=2"],
            "topology.layout: mybal.bad raised ValueError: cannot cut 1024, at mybal.py:2 (in bad)",
        ),
        (
            "badcp",
            "def scheme(q, k, v, variant, *, group, layout, **kwargs):\n"
            "    raise RuntimeError('my scheme is broken')\n",
            ["topology=custom", "topology.scheme=badcp.scheme"],
            "topology.scheme: badcp.scheme failed on a probe (one CPU rank, causal, S=64): "
            "RuntimeError: my scheme is broken, at badcp.py:2 (in scheme)",
        ),
    ],
)
def test_a_balancer_or_scheme_error_names_its_line_and_keeps_its_frame(
    user_module, attngym_cli, module, source, args, line
):
    folder = user_module(module, source)
    done = attngym_cli([*args, "logger=none"], folder)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == f"attngym: error: {line}"
    full = attngym_cli([*args, "logger=none"], folder, env={"HYDRA_FULL_ERROR": "1"})
    assert f'{module}.py", line 2, in ' in full.stderr


# 3. The record of the code a job ran, and resume.


def test_the_record_names_each_module_its_file_and_digest(mymasks):
    import hashlib

    user_code.resolve("mymasks.dilated_causal", key="attention.mask_mod")
    record = user_code.record(["mymasks.dilated_causal", "attngym.variants.gym.activation"])
    digest = hashlib.sha256((mymasks / "mymasks.py").read_bytes()).hexdigest()
    assert record["code_sources"] == {
        "mymasks": {"file": str(mymasks / "mymasks.py"), "sha256": digest}
    }  # attngym's own modules: its version stands for them
    assert re.fullmatch(r"[0-9a-f]{12}", record["code_fingerprint"])
    assert user_code.changed(record) is None
    assert user_code.changed({**record, "attngym_version": "0.0.1"}).startswith(
        "it ran on attngym 0.0.1"
    )
    assert "no code fingerprint" in user_code.changed({})
    (mymasks / "mymasks.py").write_text(MYMASKS + "\n# edited\n")
    assert user_code.changed(record) == (
        "its code changed: mymasks.py (mymasks) was edited since it ran"
    )


def test_resume_reruns_a_job_whose_mask_was_edited(mymasks, attngym_cli):
    common = ["-m", "attention=custom", "attention.mask_mod=mymasks.dilated_causal"]
    common += ["shape.seq_len=128,256", "logger=none", "benchmark.repeats=1"]
    first = attngym_cli([*common, "hydra.sweep.dir=sweep"], mymasks)
    assert first.returncode == 0, first.stderr[-2000:]
    said = first.stdout + first.stderr
    (again,) = re.findall(r"the same command resumes or re-runs this sweep .*?: (.*)", said)
    program, args = shlex.split(again)[:3], shlex.split(again)[3:]
    assert program == ["python", "-m", "attngym"]
    before = json.loads((mymasks / "sweep" / "0" / "metrics.json").read_text())

    (mymasks / "mymasks.py").write_text(MYMASKS.replace("% 2 == 0)", "% 2 == 1)"))
    resumed = attngym_cli(args, mymasks)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    why = "running it again: its code changed: mymasks.py (mymasks) was edited since it ran"
    assert len(re.findall(re.escape(why), resumed.stdout + resumed.stderr)) == 2
    after = json.loads((mymasks / "sweep" / "0" / "metrics.json").read_text())
    assert after["code_fingerprint"] != before["code_fingerprint"]
    assert after["mask_density"] != before["mask_density"]  # the edited mask ran

    unchanged = attngym_cli(args, mymasks)
    assert unchanged.returncode == 0
    assert len(re.findall(r"already ok in .*, skipping", unchanged.stdout + unchanged.stderr)) == 2


def test_the_record_covers_every_import_path_of_the_config():
    from attngym.runner import job
    from attngym.runner.config import Settings, Topology

    settings = Settings(
        attention={
            "name": "both",
            "compose": [
                {"name": "custom", "mask_mod": "mymasks.dilated_causal"},
                {"name": "custom", "score_mod": "mymods.cap", "score_args": {"cap": 2}},
            ],
        },
        topology=Topology(
            kind="custom",
            scheme="mycp.my_allgather",
            layout="mybal.striped",
            options={"layouts": ["zigzag", "mybal.other"]},
        ),
        variant=object(),  # not built: the paths are read from the config
    )
    assert job._user_paths(settings) == {
        "attention.compose.0.mask_mod": "mymasks.dilated_causal",
        "attention.compose.1.score_mod": "mymods.cap",
        "topology.scheme": "mycp.my_allgather",
        "topology.layout": "mybal.striped",
        "topology.options.layouts.1": "mybal.other",
    }


def test_a_module_beside_the_clone_is_the_users_code(tmp_path):
    """mymasks.py in the clone's own folder (as the Quick start writes it) is the user's: only
    the attngym package, torch and Python's own are never theirs."""
    import os
    from pathlib import Path

    never, _ = user_code._library_folders()
    package = Path(user_code.__file__).resolve().parent
    assert os.path.join(str(package), "") in never
    assert os.path.join(str(package.parent), "") not in never
