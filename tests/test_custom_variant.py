"""Your own variant: `attention=custom` with import paths of callbacks or their factories.

Each form builds what a dense construction of the same mask gives; each way a user's code can be
wrong is refused with a ConfigError naming the key (and each refusal has a matching accept).
"""

from __future__ import annotations

import re
import sys
import textwrap

import pytest
import torch

from attngym import variants
from attngym.errors import ConfigError
from attngym.reference import dense_mask
from attngym.variants.spec import build_variant

S = 64

MYMASKS = textwrap.dedent(
    """
    import torch

    def checkerboard(b, h, q_idx, kv_idx):
        return (q_idx // 16 + kv_idx // 16) % 2 == 0

    def strided(stride):
        def mask(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & ((q_idx - kv_idx) % stride == 0)
        return mask

    def cap(cap):
        def score_mod(score, b, h, q_idx, kv_idx):
            return cap * torch.tanh(score / cap)
        return score_mod

    def documents(lengths, device="cpu"):
        ids = torch.cat([torch.full((n,), i, device=device) for i, n in enumerate(lengths)])
        def same_document(b, h, q_idx, kv_idx):
            return ids[q_idx] == ids[kv_idx]
        return same_document

    IDS = torch.arange(64) // 8

    def reads_a_table(b, h, q_idx, kv_idx):
        return IDS[q_idx] == IDS[kv_idx]

    SHORT = torch.arange(10)

    def short_table(b, h, q_idx, kv_idx):
        return SHORT[q_idx] >= SHORT[kv_idx]

    def raises(b, h, q_idx, kv_idx):
        raise RuntimeError("boom")

    def floats(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).float()

    def branches(b, h, q_idx, kv_idx):
        return True if q_idx >= kv_idx else False

    def three(b, h, q_idx):
        return q_idx >= 0

    def one_row(b, h, q_idx, kv_idx):
        return torch.ones(3, dtype=torch.bool)

    NOT_A_FUNCTION = 3
    """
)


@pytest.fixture
def mymasks(user_module):
    """A researcher's mymasks.py in the working directory, not installed anywhere."""
    return user_module("mymasks", MYMASKS)


def custom(**entry):
    return build_variant({"name": "custom", **entry}, seq_len=S, heads=4)


def keep(variant, seq_len=S):
    pos = torch.arange(seq_len)
    return dense_mask(variant.mask_mod, 1, 1, pos, pos)[0, 0]


q_idx, kv_idx = torch.arange(S).view(-1, 1), torch.arange(S).view(1, -1)


def test_a_callback_by_path_in_both_spellings(mymasks):
    expected = (q_idx // 16 + kv_idx // 16) % 2 == 0
    for path in ("mymasks.checkerboard", "mymasks:checkerboard"):
        variant = custom(mask_mod=path)
        assert torch.equal(keep(variant), expected)
        assert variant.name == "checkerboard"


def test_a_factory_with_its_arguments(mymasks):
    variant = custom(mask_mod="mymasks.strided", mask_args={"stride": 3})
    assert torch.equal(keep(variant), (q_idx >= kv_idx) & ((q_idx - kv_idx) % 3 == 0))
    assert variant.params == {"mask_mod": "mymasks.strided", "mask_args": {"stride": 3}}


def test_a_score_mod_factory_beside_a_mask(mymasks):
    variant = custom(
        mask_mod="mymasks.checkerboard", score_mod="mymasks.cap", score_args={"cap": 2.0}
    )
    score = torch.tensor([10.0, -10.0, 0.5])
    zero = torch.zeros((), dtype=torch.int32)
    torch.testing.assert_close(
        variant.score_mod(score, zero, zero, zero, zero), 2.0 * torch.tanh(score / 2.0)
    )
    assert variant.name == "checkerboard+cap"


def test_attention_gyms_generator_matches_the_catalogue():
    pytest.importorskip("attn_gym")
    gym = custom(mask_mod="attn_gym.masks.generate_sliding_window", mask_args={"window_size": 8})
    native = variants.get("sliding_window", window_size=8)
    assert torch.equal(keep(gym), keep(native))
    assert gym.name == "sliding_window_8"  # attention-gym's closure names its parameter


def test_a_factory_taking_device_is_called_with_the_runs(mymasks):
    variant = custom(mask_mod="mymasks.documents", mask_args={"lengths": [20, 44]})
    ids = (torch.arange(S) >= 20).long()
    assert torch.equal(keep(variant), ids.view(-1, 1) == ids.view(1, -1))
    moved = variant.to("meta")  # rebuilt by its factory on the new device
    index = torch.zeros(1, dtype=torch.int64, device="meta")
    assert moved.mask_mod(index, index, index, index).is_meta


def test_a_callback_reading_a_tensor_elsewhere_is_refused_naming_it(mymasks):
    variant = custom(mask_mod="mymasks.reads_a_table")  # its table is on the CPU
    assert torch.equal(keep(variant), (q_idx // 8) == (kv_idx // 8))
    with pytest.raises(ConfigError, match="'reads_a_table' reads IDS, a cpu tensor") as err:
        variant.to("meta")
    assert err.value.key == "attention.mask_mod"


@pytest.mark.parametrize(
    ("entry", "key", "match"),
    [
        ({"mask_mod": "nope.checkerboard"}, "attention.mask_mod", "no module 'nope'"),
        ({"mask_mod": "mymasks.checkerbord"}, "attention.mask_mod", "did you mean 'checkerboard'"),
        ({"mask_mod": "mymasks"}, "attention.mask_mod", "names a module only"),
        ({"mask_mod": "mymasks.NOT_A_FUNCTION"}, "attention.mask_mod", "not a function"),
        ({"mask_mod": "mymasks.three"}, "attention.mask_mod", "a mask_mod takes 4"),
        ({"score_mod": "mymasks.checkerboard"}, "attention.score_mod", "a score_mod takes 5"),
        (
            {"mask_mod": "mymasks.strided"},
            "attention.mask_mod",
            r"takes \(stride\); .* give its arguments: attention.mask_args.stride=...",
        ),
        (
            {"mask_mod": "mymasks.checkerboard", "mask_args": {"stride": 2}},
            "attention.mask_args.stride",
            "is a mask_mod itself .*not a factory",
        ),
        (
            {"mask_mod": "mymasks.strided", "mask_args": {"stride": "abc"}},
            "attention.mask_args.stride",
            "'abc' is text, and the mask_mod built with it raised TypeError",
        ),
        ({"mask_mod": "attn_gym_missing_here.masks.x"}, "attention.mask_mod", "no module"),
        (
            {"mask_mod": "mymasks.strided", "mask_args": {"strid": 2}},
            "attention.mask_args.strid",
            "did you mean 'stride'",
        ),
        (
            {"mask_mod": "mymasks.documents", "mask_args": {"device": "cpu"}},
            "attention.mask_args.lengths",
            "needs argument 'lengths'",
        ),
        ({"mask_mod": "mymasks.raises"}, "attention.mask_mod", "raised RuntimeError.*boom"),
        ({"mask_mod": "mymasks.floats"}, "attention.mask_mod", "returns a bool tensor"),
        ({"mask_mod": "mymasks.branches"}, "attention.mask_mod", "tensor ops only"),
        ({"mask_mod": "mymasks.short_table"}, "attention.mask_mod", "must cover shape.seq_len"),
        ({"mask_mod": "mymasks.one_row"}, "attention.mask_mod", "must broadcast to the grid"),
        ({"maskmod": "mymasks.checkerboard"}, "attention.maskmod", "did you mean"),
        ({}, "attention.mask_mod", "needs mask_mod or score_mod"),
    ],
)
def test_a_users_mistake_is_one_line_naming_the_key(mymasks, entry, key, match):
    with pytest.raises(ConfigError, match=match) as err:
        custom(**entry)
    assert err.value.key == key and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "entry",
    [
        {"mask_mod": "mymasks.checkerboard"},
        {"score_mod": "mymasks.cap", "score_args": {"cap": 5.0}},
        {"mask_mod": "mymasks.strided", "mask_args": {"stride": 2}},
        {"mask_mod": "mymasks.documents", "mask_args": {"lengths": [32, 32]}},
        {"mask_mod": "mymasks.reads_a_table"},
        {"mask_mod": "mymasks.checkerboard", "label": "board"},
    ],
)
def test_the_same_keys_spelled_right_are_accepted(mymasks, entry):
    variant = custom(**entry)
    assert variant.name == entry.get("label", variant.name)


def test_a_custom_entry_composes_with_catalogue_variants(mymasks):
    entry = {
        "name": "board_window",
        "compose": [
            {"name": "custom", "mask_mod": "mymasks.checkerboard"},
            {"name": "sliding_window", "window_size": 8},
        ],
    }
    variant = build_variant(entry, seq_len=S, heads=4)
    window = (q_idx >= kv_idx) & (q_idx - kv_idx <= 8)
    assert torch.equal(keep(variant), window & ((q_idx // 16 + kv_idx // 16) % 2 == 0))


def _console_script(args, cwd):
    """The `attngym` console script, which (unlike `python -m`) does not put the working
    directory on sys.path: attngym finds mymasks.py there itself."""
    import os
    import subprocess
    from pathlib import Path

    script = Path(sys.executable).parent / "attngym"
    if not script.exists():
        pytest.skip("the attngym console script is not installed beside this Python")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "HYDRA_"))}
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [str(script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.slow
def test_a_users_own_mask_through_a_sweep(mymasks):
    # (Ring on 2 CPU ranks with a user's own mask: tests/test_api.py, through attngym.run.)
    common = ["attention=custom", "logger=none", "shape.seq_len=256", "benchmark.repeats=2"]
    sweep = _console_script(
        ["-m", *common, "attention.mask_mod=mymasks.strided", "attention.mask_args.stride=2,3"],
        mymasks,
    )
    assert sweep.returncode == 0, sweep.stderr[-2000:]
    assert "strided" in sweep.stdout and "2 jobs, 0 failed" in sweep.stderr + sweep.stdout
    assert len(re.findall(r"\| ok +\| +strided", sweep.stdout)) == 2, sweep.stdout


def test_a_mistake_on_the_command_line_is_one_line_and_exit_2(mymasks):
    done = _console_script(["attention=custom", "attention.mask_mod=mymasks.checkerbord"], mymasks)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "attngym: error: attention.mask_mod: 'mymasks.checkerbord': mymasks has no "
        "'checkerbord'; did you mean 'checkerboard'?"
    ]


def test_a_config_folder_of_your_own_makes_its_attention_files_options(tmp_path):
    from attngym.runner.overrides import prepare_overrides

    (tmp_path / "attention").mkdir()
    (tmp_path / "attention" / "board.yaml").write_text("name: custom\nmask_mod: m.board\n")
    searchpath = f"hydra.searchpath=[file://{tmp_path}]"
    assert prepare_overrides(["attention=board", searchpath])[0] == "attention=board"
    with pytest.raises(ConfigError, match="unknown option 'board'"):
        prepare_overrides(["attention=board"])


def test_attention_gym_missing_names_its_install(mymasks, monkeypatch):
    for name in [n for n in sys.modules if n.startswith("attn_gym")]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    monkeypatch.setitem(sys.modules, "attn_gym", None)
    with pytest.raises(ConfigError, match="needs attn_gym, not installed: pip install attn-gym"):
        custom(mask_mod="attn_gym.masks.causal_mask")
