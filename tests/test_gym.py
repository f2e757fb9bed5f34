"""attention-gym's catalogue through attngym: every conf/attention/gym_* option composed by Hydra
and checked by attngym.runner.config at 32 tokens, its forward through FlexAttention (eager, on CPU)
against the float64 reference, its backward through the reference in float32 against float64,
and every generator attention-gym exports accounted for (an option, or why there is none).

The context-parallel runs of the same options are tests/distributed/test_gym_cp.py.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pytest
import torch
import yaml

attn_gym = pytest.importorskip(
    "attn_gym", reason="attention-gym is not installed: pip install 'attngym[gym]'"
)

from distributed.gym_options import CONF, HEADS, S, compose_entries, options  # noqa: E402

from attngym import reference  # noqa: E402
from attngym.errors import ConfigError  # noqa: E402
from attngym.kernels import attend_chunk  # noqa: E402
from attngym.validation import (  # noqa: E402
    grad_errors,
    judge_errors,
    output_errors,
    row_scales,
)
from attngym.variants.spec import build_variant  # noqa: E402

# Every generator attn_gym.masks and attn_gym.mods export: the option that runs it.
OPTIONS = {
    "causal_mask": "gym_causal",
    "generate_sliding_window": "gym_sliding_window",
    "generate_dilated_sliding_window": "gym_dilated_sliding_window",
    "generate_prefix_lm_mask": "gym_prefix_lm",
    "generate_global_sliding_window": "gym_global_sliding_window",
    "generate_doc_mask_mod": "gym_document",
    "generate_packed_causal_doc_mask_mod": "gym_packed_document",
    "generate_shared_prefix_mask_mod": "gym_shared_prefix",
    "batchify_mask_mod": "gym_batchify",
    "generate_block_diffusion_mask": "gym_block_diffusion",
    "generate_natten": "gym_natten",
    "generate_tiled_natten": "gym_tiled_natten",
    "generate_morton_natten": "gym_morton_natten",
    "generate_sta_mask_mod_2d": "gym_sta_2d",
    "generate_sta_mask_mod_3d": "gym_sta_3d",
    "generate_spatial_head_mask_mod": "gym_svg_spatial",
    "generate_temporal_head_mask_mod": "gym_svg_temporal",
    "generate_jetspec_tree_causal_mask_mod": "gym_jetspec_tree",
    "generate_jetspec_training_mask_mod": "gym_jetspec_training",
    "generate_alibi_bias": "gym_alibi",
    "generate_sandwich_bias": "gym_sandwich",
    "generate_tanh_softcap": "gym_softcap",
    "generate_activation_score_mod": "gym_activation",
    "generate_graphormer_spatial_bias": "gym_graphormer_spatial",
    "generate_graphormer_edge_bias": "gym_graphormer_edge",
}
# Generators that define no attention over one sequence, and why.
NO_OPTION = {
    "generate_vision_cross_attention_mask_mod": "cross-attention: text queries over image keys",
    "generate_vsa_mask_mod": "data-dependent: its top-k tiles come from each call's q and k",
    "generate_mla_rope_score_mod": "data-dependent: reads the RoPE parts of each call's q and k",
}
# Exports that build tensors or post-process outputs for a generator: no attention of their own.
HELPERS = {
    "build_tree_ancestor_matrix",
    "shortest_path_distances",
    "shortest_path_edge_types",
    "undo_softmax",
    "VSACoarseResult",
    "VSATileMetadata",
    "compute_vsa_coarse_attention",
    "compute_vsa_tile_scores",
    "compute_vsa_topk_indices",
    "create_vsa_block_mask",
    "create_vsa_flash_block_mask",
    "create_vsa_tile_metadata",
    "lift_vsa_tile_output",
    "pool_to_vsa_tiles",
    "tile_vsa_sequence",
    "untile_vsa_sequence",
    "validate_vsa_block_mask_inputs",
    "vsa_additive_combine",
    "vsa_gated_mix",
    "vsa_topk_from_sparsity",
}


@pytest.fixture(scope="module")
def entries():
    return compose_entries()


def test_every_generator_is_an_option_or_says_why_not():
    exported = {
        name
        for module in (attn_gym.masks, attn_gym.mods)
        for name in dir(module)
        if not name.startswith("_")
        and callable(getattr(module, name))
        and not inspect.ismodule(getattr(module, name))
    }
    assert exported == set(OPTIONS) | set(NO_OPTION) | HELPERS
    assert sorted(OPTIONS.values()) == options(), "one gym_* option a generator, and no other"


def test_every_option_says_what_it_is_and_needs():
    for option in options():
        text = (CONF / "attention" / f"{option}.yaml").read_text()
        header = " ".join(line for line in text.splitlines() if line.startswith("#"))
        assert "attention-gym's" in header and "Needs:" in header, option
        entry = yaml.safe_load(text)
        assert entry["name"] == "custom" and entry["label"] == option


def inputs(dtype, *, requires_grad=False):
    gen = torch.Generator().manual_seed(0)
    q, k, v, dout = (
        torch.randn(2, HEADS, S, 16, generator=gen, dtype=torch.float64) for _ in range(4)
    )
    q, k, v = (t.to(dtype).requires_grad_(requires_grad) for t in (q, k, v))
    return q, k, v, dout.to(dtype)


@pytest.mark.parametrize("option", options())
def test_forward_through_flex_matches_the_float64_reference(entries, option):
    variant = build_variant(entries[option], seq_len=S, heads=HEADS)
    q, k, v, _ = inputs(torch.float32)
    # 8-token blocks over 32 tokens: the block mask skips and splits blocks for local masks.
    out, lse = attend_chunk(q, k, v, variant, backend="flex", block_size=(8, 8), compile=False)
    q64, k64, v64 = q.double(), k.double(), v.double()
    ref_out, ref_lse = reference.attention(q64, k64, v64, variant.score_mod, variant.mask_mod)
    scale = row_scales(variant, q64, k64, v64, torch.arange(S), ref_lse)
    assert judge_errors(output_errors(out, lse, ref_out, ref_lse, scale), "float32") == "ok"


@pytest.mark.parametrize("option", options())
def test_backward_through_the_reference_in_float32_matches_float64(entries, option):
    # The callbacks run inside autograd (a score_mod's own derivative included); float32 and
    # float64 differ only by rounding, far below RTOL["float32"] = 1e-4 at 32 tokens.
    variant = build_variant(entries[option], seq_len=S, heads=HEADS)
    grads = {}
    for dtype in (torch.float32, torch.float64):
        q, k, v, dout = inputs(dtype, requires_grad=True)
        out, _ = reference.attention(q, k, v, variant.score_mod, variant.mask_mod, dtype=dtype)
        out.backward(dout)
        grads[dtype] = [q.grad, k.grad, v.grad]
    assert all(torch.isfinite(g).all() for g in grads[torch.float32])
    assert judge_errors(grad_errors(grads[torch.float32], grads[torch.float64]), "float32") == "ok"


def test_the_masks_are_the_shapes_their_options_describe(entries):
    # A few spot checks that the derived arguments reach the generator: documents split the
    # sequence, the tree is breadth-first, x_t sees no later noised block.
    def keep(option):
        variant = build_variant(entries[option], seq_len=S, heads=HEADS)
        pos = torch.arange(S)
        return variant.mask_mod(0, 0, pos.view(-1, 1), pos.view(1, -1))

    document = keep("gym_document")  # lengths split 40/10/30/20 %: [12, 3, 9, 8]
    assert document[11, 0] and not document[12, 11] and document[14, 12]
    tree = keep("gym_jetspec_tree")  # node 5's ancestors: 2, 0
    assert tree[5].nonzero().flatten().tolist() == [0, 2, 5]
    diffusion = keep("gym_block_diffusion")  # clean length 16, blocks of 4
    assert diffusion[0, 3] and not diffusion[0, 4] and diffusion[4, 16] and not diffusion[16, 0]


def _with(entry, kind, **args):
    changed = dict(entry)
    changed[kind] = {**entry[kind], **args}
    return changed


@pytest.mark.parametrize(
    "option, kind, args, match",
    [
        ("gym_global_sliding_window", "mask_args", {"global_tokens": [0, 40]}, r"\[40\]"),
        ("gym_shared_prefix", "mask_args", {"prefix_of": [0, 0]}, "one prefix document"),
        ("gym_document", "mask_args", {"inner": "attn_gym.masks.no_such"}, "inner"),
        ("gym_activation", "score_args", {"activation": "torch.no_such"}, "activation"),
        ("gym_jetspec_tree", "mask_args", {"branching": 0}, "branching"),
    ],
)
def test_an_adapters_bad_argument_is_one_line_naming_the_key(entries, option, kind, args, match):
    with pytest.raises(ConfigError, match=match) as err:
        build_variant(_with(entries[option], kind, **args), seq_len=S, heads=HEADS)
    assert str(err.value).startswith(f"attention.{kind}") and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "option, kind, args",
    [
        ("gym_global_sliding_window", "mask_args", {"global_tokens": [0, 31]}),
        ("gym_document", "mask_args", {"inner": "torch.nn.attention.flex_attention.noop_mask"}),
        ("gym_activation", "score_args", {"activation": "torch.sigmoid"}),
        ("gym_jetspec_tree", "mask_args", {"branching": 1}),
    ],
)
def test_the_same_arguments_in_range_are_accepted(entries, option, kind, args):
    build_variant(_with(entries[option], kind, **args), seq_len=S, heads=HEADS)


def test_importing_attngym_and_the_adapters_imports_no_attention_gym():
    code = "import sys, json, attngym, attngym.variants.gym; print(json.dumps(sorted(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    assert "attn_gym" not in json.loads(out.stdout.strip().splitlines()[-1])


def test_the_gallery_sweeps_every_option_once():
    preset = yaml.safe_load((CONF / "experiment" / "gym_gallery.yaml").read_text())
    swept = preset["hydra"]["sweeper"]["params"]["attention"].replace(" ", "").split(",")
    assert sorted(swept) == options()
