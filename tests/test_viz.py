"""Pictures: the seed's heatmap API and the block-level mask picture.

Block classes are checked against a dense construction written here (the whole S x S mask, padded
with False to whole blocks, as FlexAttention's create_block_mask pads) and against FlexAttention's
own BlockMask; PNGs are read back and must be real, multi-coloured images.
"""

from __future__ import annotations

import inspect
import logging
import math

import pytest
import torch

from attngym import utils, variants, viz
from attngym.reference import dense_mask

# --------------------------------------------------------------------------------------------
# helpers


def seed_signature(fn) -> list[tuple[str, object]]:
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


EMPTY = inspect.Parameter.empty


def read_png(path):
    import matplotlib.image

    image = matplotlib.image.imread(str(path))
    assert image.ndim == 3 and image.shape[0] > 300 and image.shape[1] > 300
    colours = torch.from_numpy(image[..., :3].reshape(-1, 3).copy()).unique(dim=0)
    assert colours.shape[0] > 3, "a picture with a single colour (or almost)"
    return image


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def sliding_window(window):
    def mask(b, h, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx <= window)

    return mask


def prefix_lm(prefix):
    def mask(b, h, q_idx, kv_idx):
        return (kv_idx < prefix) | (q_idx >= kv_idx)

    return mask


def documents(lengths):
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))

    def mask(b, h, q_idx, kv_idx):
        return doc[q_idx] == doc[kv_idx]

    return mask


def dense_classes(mask_mod, seq_q, seq_kv, bq, bkv):
    """The S x S way: whole mask, pad with False to whole blocks, count kept entries per block."""
    q = torch.arange(seq_q).view(-1, 1)
    kv = torch.arange(seq_kv).view(1, -1)
    keep = torch.broadcast_to(mask_mod(0, 0, q, kv), (seq_q, seq_kv))
    nq, nkv = math.ceil(seq_q / bq), math.ceil(seq_kv / bkv)
    padded = torch.zeros(nq * bq, nkv * bkv, dtype=torch.bool)
    padded[:seq_q, :seq_kv] = keep
    kept = padded.view(nq, bq, nkv, bkv).sum(dim=(1, 3))
    classes = torch.ones(nq, nkv, dtype=torch.uint8)  # partial
    classes[kept == 0] = 0
    classes[kept == bq * bkv] = 2
    return classes


# --------------------------------------------------------------------------------------------
# seed API


def test_seed_signatures():
    assert seed_signature(utils.visualize_attention_scores) == [
        ("query", EMPTY),
        ("key", EMPTY),
        ("score_mod", None),
        ("mask_mod", None),
        ("device", "cuda"),
        ("name", "attention_scores"),
        ("path", None),
        ("batch_idx", 0),
        ("head_idx", 0),
        ("scale", None),
    ]
    assert seed_signature(utils.plot_attention_scores) == [
        ("query", EMPTY),
        ("key", EMPTY),
        ("score_mod", None),
        ("mask_mod", None),
        ("device", "cuda"),
        ("name", "attention_scores"),
        ("batch_idx", 0),
        ("head_idx", 0),
        ("scale", None),
        ("figsize", (12, 10)),
    ]
    assert seed_signature(utils.create_score_mod) == [
        ("query", EMPTY),
        ("key", EMPTY),
        ("score_mod", EMPTY),
        ("mask_mod", EMPTY),
        ("device", "cuda"),
        ("_compile", False),
        ("scale", None),
        ("batch_idx", 0),
        ("head_idx", 0),
    ]


def test_create_score_mod_matches_a_hand_computation(rng):
    q = torch.randn(2, 4, 24, 8, generator=rng)
    k = torch.randn(2, 2, 20, 8, generator=rng)  # GQA: query head 3 reads key head 1

    def bias(score, b, h, q_idx, kv_idx):
        return score + 10.0 * b + h + 0.01 * (q_idx - kv_idx)

    def band(b, h, q_idx, kv_idx):
        return (q_idx - kv_idx).abs() <= 3 + h

    scores = utils.create_score_mod(q, k, bias, band, device="cpu", batch_idx=1, head_idx=3)

    raw = (q[1, 3] @ k[1, 1].T) / math.sqrt(8)
    qi, ki = torch.arange(24).view(-1, 1), torch.arange(20).view(1, -1)
    expected = raw + 10.0 + 3 + 0.01 * (qi - ki)
    expected = expected.masked_fill((qi - ki).abs() > 6, float("-inf"))
    assert scores.shape == (24, 20)
    torch.testing.assert_close(scores, expected, rtol=1e-5, atol=1e-5)  # float32 matmul


def test_create_score_mod_scale_and_no_mods(rng):
    q = torch.randn(1, 1, 6, 4, generator=rng)
    k = torch.randn(1, 1, 7, 4, generator=rng)
    scores = utils.create_score_mod(q, k, None, None, device="cpu", scale=2.0)
    torch.testing.assert_close(scores, (q[0, 0] @ k[0, 0].T) * 2.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_cuda_without_cuda_is_an_error_that_suggests_cpu(rng, tmp_path):
    q = torch.randn(1, 1, 8, 4, generator=rng)
    with pytest.raises(ValueError, match="CUDA is not available.*device='cpu'"):
        utils.create_score_mod(q, q, None, causal)
    with pytest.raises(ValueError, match="device='cpu'"):
        utils.visualize_attention_scores(q, q, mask_mod=causal, path=tmp_path)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_idx": 2}, "batch_idx"),
        ({"head_idx": -1}, "head_idx"),
        ({"query": torch.ones(3, 4)}, "query"),
        ({"key": torch.ones(1, 3, 8, 4)}, "key shape"),
    ],
)
def test_create_score_mod_rejects_bad_input(rng, kwargs, match):
    args = {"query": torch.randn(2, 2, 8, 4, generator=rng), "key": torch.randn(2, 2, 8, 4)}
    args |= kwargs
    with pytest.raises(ValueError, match=match):
        utils.create_score_mod(args.pop("query"), args.pop("key"), None, None, device="cpu", **args)


def test_plot_attention_scores_builds_a_labelled_figure(rng):
    q = torch.randn(1, 2, 16, 8, generator=rng)
    fig = utils.plot_attention_scores(q, q, mask_mod=causal, device="cpu", head_idx=1)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "key position"
    assert ax.get_ylabel() == "query position"
    assert ax.get_title() == "attention scores"
    assert len(fig.axes) == 2  # the heatmap and its colorbar
    assert tuple(fig.get_size_inches()) == (12, 10)  # attention-gym's default figsize


def test_plot_attention_scores_takes_attention_gyms_positional_arguments(rng):
    # attention-gym's order: (query, key, score_mod, mask_mod, device, name, batch_idx, ...).
    q = torch.randn(2, 2, 8, 4, generator=rng)
    fig = utils.plot_attention_scores(q, q, None, causal, "cpu", "my_mask", 1, 1, None, (4, 3))
    assert fig.axes[0].get_title() == "my mask"
    assert tuple(fig.get_size_inches()) == (4, 3)


def test_visualize_attention_scores_path_rules(rng, tmp_path, monkeypatch, caplog):
    q = torch.randn(1, 1, 32, 8, generator=rng)
    k = torch.randn(1, 1, 32, 8, generator=rng)
    mask = sliding_window(6)

    (tmp_path / "out").mkdir()
    out = utils.visualize_attention_scores(q, k, mask_mod=mask, device="cpu", path=tmp_path / "out")
    assert out == tmp_path / "out.png"  # as attention-gym: <path>.png, beside a folder `out`
    read_png(out)

    utils.visualize_attention_scores(q, k, mask_mod=mask, device="cpu", path=tmp_path / "a.png")
    read_png(tmp_path / "a.png")  # a .png file

    utils.visualize_attention_scores(q, k, mask_mod=mask, device="cpu", path=tmp_path / "sub/b")
    read_png(tmp_path / "sub" / "b.png")  # a file without suffix, parent created

    monkeypatch.chdir(tmp_path)
    with caplog.at_level(logging.INFO, logger="attngym.viz"):
        out = utils.visualize_attention_scores(q, k, causal_score, None, device="cpu", name="b2")
    assert out == tmp_path / "b2.png" and out.is_absolute()  # None: ./<name>.png, said in full
    assert str(out) in caplog.text
    read_png(out)


# attention-gym's form: one head's (M, D) query and (N, D) key, a (1, 1, M, N) result.


def head_bias(score, b, h, q_idx, kv_idx):
    return score * (1.0 + 0.5 * h) + 10.0 * b - 0.05 * (q_idx - kv_idx) ** 2


def head_band(b, h, q_idx, kv_idx):
    return (q_idx - kv_idx).abs() <= h + b


def dense_one_head(q, k, mod, scale, b, h, kind):
    """Entry by entry, each mod called on scalars as FlexAttention's vmap would call it."""
    m, n = q.shape[0], k.shape[0]
    out = torch.empty(1, 1, m, n, dtype=torch.bool if kind == "mask" else q.dtype)
    bt, ht = torch.tensor(b), torch.tensor(h)
    for i in range(m):
        for j in range(n):
            qi, kj = torch.tensor(i), torch.tensor(j)
            if kind == "mask":
                out[0, 0, i, j] = mod(bt, ht, qi, kj)
            else:
                out[0, 0, i, j] = mod(torch.dot(q[i], k[j]) * scale, bt, ht, qi, kj)
    return out


@pytest.mark.parametrize("scale", [None, 0.3])
def test_attention_gym_form_score_mod_matches_the_dense_construction(rng, scale):
    q = torch.randn(7, 8, generator=rng, dtype=torch.float64)
    k = torch.randn(9, 8, generator=rng, dtype=torch.float64)
    out = utils.create_score_mod(
        q, k, head_bias, head_band, device="cpu", scale=scale, batch_idx=1, head_idx=2
    )
    expected = dense_one_head(q, k, head_bias, scale or 8**-0.5, 1, 2, "score")
    assert out.shape == (1, 1, 7, 9) and out.dtype == torch.float64  # the inputs' dtype
    # float64 throughout; the only difference is the summation order of a length-8 dot product.
    # The score_mod wins over the mask_mod, as in attention-gym: nothing is masked here.
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_attention_gym_form_mask_mod_is_the_dense_boolean_mask(rng):
    q = torch.randn(10, 4, generator=rng)
    k = torch.randn(6, 4, generator=rng)
    out = utils.create_score_mod(q, k, None, head_band, device="cpu", batch_idx=2, head_idx=1)
    expected = dense_one_head(q, k, head_band, None, 2, 1, "mask")
    assert out.shape == (1, 1, 10, 6) and out.dtype == torch.bool
    assert torch.equal(out, expected)
    assert 0 < int(out.sum()) < out.numel()  # a real band, neither all nor nothing


def test_the_4d_form_is_the_2d_scores_with_the_2d_mask_as_minus_inf(rng):
    """attention-gym's visualize_attention_scores: scores where the mask keeps, -inf elsewhere."""
    q = torch.randn(2, 4, 12, 8, generator=rng)
    k = torch.randn(2, 2, 11, 8, generator=rng)  # GQA: query head 3 reads key head 1
    four_d = utils.create_score_mod(q, k, head_bias, head_band, "cpu", batch_idx=1, head_idx=3)
    args = (q[1, 3], k[1, 1])
    scores = utils.create_score_mod(*args, head_bias, None, "cpu", batch_idx=1, head_idx=3)
    keep = utils.create_score_mod(*args, None, head_band, "cpu", batch_idx=1, head_idx=3)
    torch.testing.assert_close(four_d, torch.where(keep, scores, float("-inf"))[0, 0])


@pytest.mark.parametrize(
    ("query", "key", "mods", "kwargs", "match"),
    [
        (torch.ones(4, 8), torch.ones(5, 8), (None, None), {}, "needs a score_mod or a mask_mod"),
        (torch.ones(4, 8), torch.ones(5, 6), (None, causal), {}, "head_dim"),
        (torch.ones(4, 8), torch.ones(1, 1, 5, 8), (None, causal), {}, "query and key"),
        (torch.ones(4, 8), torch.ones(5, 8), (None, causal), {"head_idx": -1}, "head_idx"),
    ],
)
def test_attention_gym_form_rejects_bad_input(query, key, mods, kwargs, match):
    with pytest.raises(ValueError, match=match):
        utils.create_score_mod(query, key, *mods, device="cpu", **kwargs)


def test_attention_gym_form_accepts_any_index_the_mods_should_see(rng):
    q = torch.randn(5, 4, generator=rng)
    out = utils.create_score_mod(q, q, None, head_band, "cpu", batch_idx=9, head_idx=40)
    assert bool(out.all())  # |i - j| <= 4 < h + b for every pair of 5 positions


@pytest.mark.parametrize("form", ["2d", "4d"])
def test_heatmaps_draw_both_forms(rng, tmp_path, form):
    q = torch.randn(1, 2, 16, 8, generator=rng)
    k = torch.randn(1, 2, 16, 8, generator=rng)
    q_in, k_in = (q[0, 1], k[0, 1]) if form == "2d" else (q, k)
    fig = utils.plot_attention_scores(q_in, k_in, head_bias, causal, "cpu", head_idx=1)
    drawn = fig.axes[0].images[0].get_array()
    scale = 8**-0.5
    expected = dense_one_head(q[0, 1].double(), k[0, 1].double(), head_bias, scale, 0, 1, "score")
    keep = dense_one_head(q[0, 1], k[0, 1], causal, None, 0, 1, "mask")[0, 0]
    assert torch.equal(torch.from_numpy(~drawn.mask), keep)  # masked entries drawn grey
    # float32 scores against a float64 construction: D = 8 products, |scores| < ~20.
    torch.testing.assert_close(
        torch.from_numpy(drawn.filled(0.0)),
        expected[0, 0].masked_fill(~keep, 0.0),
        atol=1e-4,
        rtol=1e-5,
    )
    out = utils.visualize_attention_scores(
        q_in, k_in, mask_mod=causal, device="cpu", path=tmp_path / "scores"
    )
    read_png(out)


def causal_score(score, b, h, q_idx, kv_idx):
    return score - 0.1 * (q_idx - kv_idx).abs()


def test_save_heatmap_draws_a_variant(tmp_path):
    variant = variants.get("causal")
    out = viz.save_heatmap(variant, tmp_path / "heatmap.png", seq_len=4096, window=48)
    assert out == tmp_path / "heatmap.png"
    read_png(out)


def dense_share(mask_mod, seq_len, cell):
    """The pooled keep share built from the whole S x S mask, padded with False to whole cells."""
    idx = torch.arange(seq_len)
    keep = mask_mod(0, 0, idx.view(-1, 1), idx.view(1, -1)).float()
    cells = math.ceil(seq_len / cell)
    padded = torch.zeros(cells * cell, cells * cell)
    padded[:seq_len, :seq_len] = keep
    return padded.view(cells, cell, cells, cell).mean(dim=(1, 3))


@pytest.mark.parametrize("name", ["sliding_window_sinks", "document", "natten"])
def test_pooled_keep_matches_the_dense_mask(monkeypatch, name):
    params = {
        "sliding_window_sinks": {"window_size": 40, "num_sinks": 3},
        "document": {"doc_lengths": [100, 7, 193]},
        "natten": {"canvas_w": 20, "canvas_h": 15, "kernel_w": 3, "kernel_h": 5},
    }[name]
    mask_mod = variants.get(name, **params).mask_mod
    monkeypatch.setattr(viz, "_TILE_ELEMENTS", 7 * 7 * 5)  # 5 cells a tile: ragged tiles
    # 300 tokens in cells of 7: the last cell is cut by the end of the sequence.
    expected = dense_share(mask_mod, 300, 7)
    torch.testing.assert_close(viz.pooled_keep(mask_mod, 300, 7), expected, rtol=0, atol=1e-6)


def test_zoom_goes_where_documents_meet_on_the_diagonal():
    # Documents [0, 300) and [300, 512): the zoom must hold the boundary where it cuts the
    # diagonal, not a stretch of one document's edge far from it.
    mask_mod = variants.get("document", doc_lengths=[300, 212]).mask_mod
    kept = viz.pooled_keep(mask_mod, 512, 4)
    q0, k0 = viz.zoom_origin(kept, 4, 64, 512)
    assert q0 < 300 < q0 + 64 and k0 < 300 < k0 + 64


def test_zoom_of_a_shift_invariant_mask_starts_at_its_first_edges():
    kept = viz.pooled_keep(variants.get("causal").mask_mod, 512, 4)
    assert viz.zoom_origin(kept, 4, 64, 512) == (0, 0)
    assert viz.zoom_origin(torch.ones(128, 128), 4, 64, 512) == (0, 0)  # no mask at all


def test_save_heatmap_of_a_score_mod_draws_its_transfer_panel(tmp_path):
    out = viz.save_heatmap(variants.get("softcap", soft_cap=5.0), tmp_path, seq_len=256)
    read_png(out)
    assert out == tmp_path / "softcap.png"


def test_save_heatmap_rejects_a_bad_window(tmp_path):
    with pytest.raises(ValueError, match="window"):
        viz.save_heatmap(variants.get("full"), tmp_path, seq_len=64, window=0)


# --------------------------------------------------------------------------------------------
# block classes


@pytest.mark.parametrize(
    ("mask_mod", "seq_q", "seq_kv", "block"),
    [
        (causal, 1024, 1024, (128, 128)),
        (sliding_window(200), 1024, 1024, (128, 128)),
        (prefix_lm(300), 1024, 1024, (128, 128)),  # prefix ends inside a block
        (documents([100, 500, 300, 124]), 1024, 1024, (128, 128)),
        (causal, 1000, 1000, (128, 128)),  # S not a multiple of the block
        (sliding_window(50), 640, 1000, (64, 128)),  # Sq != Skv, unequal blocks
        (prefix_lm(70), 1000, 1000, (16, 16)),  # small blocks: several tiles per row
    ],
)
def test_block_classes_equal_the_dense_construction(mask_mod, seq_q, seq_kv, block):
    classes = viz.block_mask_classes(mask_mod, seq_q, seq_kv, block)
    expected = dense_classes(mask_mod, seq_q, seq_kv, *block)
    assert classes.dtype == torch.uint8
    assert torch.equal(classes, expected)
    assert 0 < (classes == 1).sum() < classes.numel()  # these masks all have partial blocks


@pytest.mark.parametrize(
    "mask_mod, seq_q, seq_kv, block",
    [
        (documents([100, 500, 300, 124]), 1024, 1024, (128, 128)),
        (causal, 1000, 1000, (128, 128)),  # a block cut by the end of the sequence
        (sliding_window(50), 640, 1000, (64, 128)),
    ],
)
def test_block_classes_of_a_block_mask_equal_the_mask_mods(mask_mod, seq_q, seq_kv, block):
    """The pictures read the run's BlockMask instead of evaluating the mask_mod again."""
    from torch.nn.attention.flex_attention import create_block_mask

    bm = create_block_mask(mask_mod, None, None, seq_q, seq_kv, device="cpu", BLOCK_SIZE=block)
    expected = dense_classes(mask_mod, seq_q, seq_kv, *block)
    assert torch.equal(viz.block_classes(bm), expected)


@pytest.mark.parametrize("seq_len", [1024, 1000])
def test_pooled_keep_from_block_classes_evaluates_only_partial_blocks(seq_len, monkeypatch):
    mask = documents([100, 300, 376, seq_len - 776])
    expected = viz.pooled_keep(mask, seq_len, 128)
    classes = dense_classes(mask, seq_len, seq_len, 64, 64)
    evaluated = []

    def counting(b, h, q_idx, kv_idx):
        evaluated.append(torch.broadcast_shapes(q_idx.shape, kv_idx.shape).numel())
        return mask(b, h, q_idx, kv_idx)

    kept = viz.pooled_keep(counting, seq_len, 128, classes=classes, block_size=(64, 64))
    torch.testing.assert_close(kept, expected, rtol=0, atol=1e-6)
    assert sum(evaluated) == int((classes == 1).sum()) * 64 * 64


def test_block_classes_tile_across_many_columns(monkeypatch):
    monkeypatch.setattr(viz, "_TILE_ELEMENTS", 128 * 128 * 3)  # 3 kv blocks per tile, ragged end
    mask = documents([100, 500, 300, 100])
    expected = dense_classes(mask, 1000, 1000, 128, 128)
    assert torch.equal(viz.block_mask_classes(mask, 1000, 1000, (128, 128)), expected)


def test_block_classes_agree_with_flex_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    mask = sliding_window(200)
    classes = viz.block_mask_classes(mask, 1000, 1000, (128, 128))
    bm = create_block_mask(mask, None, None, 1000, 1000, device="cpu", BLOCK_SIZE=(128, 128))
    assert torch.equal((classes == 1).sum(-1), bm.kv_num_blocks[0, 0].to(torch.int64))
    assert torch.equal((classes == 2).sum(-1), bm.full_kv_num_blocks[0, 0].to(torch.int64))
    assert torch.equal(classes > 0, bm.to_dense()[0, 0, :, : classes.shape[1]].bool())


def test_no_mask_is_all_full():
    classes = viz.block_mask_classes(None, 300, 500, (128, 128))
    assert classes.shape == (3, 4)
    assert bool((classes == 2).all())


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seq_q": 0}, "seq_q"),
        ({"seq_kv": 1.5}, "seq_kv"),
        ({"block_size": (128,)}, "block_size"),
        ({"block_size": (0, 128)}, "block_size"),
        ({"device": "tpu"}, "device"),
    ],
)
def test_block_classes_reject_bad_input(kwargs, match):
    args = {"mask_mod": causal, "seq_q": 256, "seq_kv": 256} | kwargs
    with pytest.raises(ValueError, match=match):
        viz.block_mask_classes(**args)


def test_small_block_picture_is_a_real_image(tmp_path):
    out = viz.save_block_mask_picture(
        prefix_lm(300), 1000, 1000, tmp_path, block_size=(64, 64), title="prefix"
    )
    assert out == tmp_path / "block_mask.png"
    read_png(out)


def test_64k_block_picture(tmp_path):
    """The full-length picture runs without an S x S tensor (4 G entries would be 4 GB of bools)."""
    seq, block, window = 65536, 128, 4096
    out = viz.save_block_mask_picture(causal, seq, seq, tmp_path / "causal_64k.png")
    read_png(out)

    classes = viz.block_mask_classes(sliding_window(window), seq, seq, (block, block))
    n = seq // block
    assert classes.shape == (n, n)
    # Closed form: the diagonal and the blocks at distance window/block are partial, the ones
    # strictly between are full (except where they would fall before position 0).
    w = window // block
    i = torch.arange(n).view(-1, 1)
    j = torch.arange(n).view(1, -1)
    expected = torch.zeros(n, n, dtype=torch.uint8)
    expected[(i - j > 0) & (i - j < w)] = 2
    expected[(i == j) | (i - j == w)] = 1
    assert torch.equal(classes, expected)


# Parameters at S = 1024 for every catalogue variant, each feature longer than the 128-token
# zoom where it has a length (the case where a zoom at the start looks like causal).
ZOOM_PARAMS = {
    "alibi": {"num_heads": 4},
    "bidirectional_sliding_window": {"window_size": 160},
    "block_diffusion": {"clean_length": 512, "block_size": 64},
    "causal": {},
    "chunked_causal": {"chunk_size": 256},
    "dilated_sliding_window": {"window_size": 256, "dilation": 2},
    "document": {"doc_lengths": [400, 300, 324]},
    "full": {},
    "gemma2": {"window_size": 128, "soft_cap": 50.0},
    "global_sliding_window": {"window_size": 64, "global_tokens": [0, 500]},
    "natten": {"canvas_w": 32, "canvas_h": 32, "kernel_w": 7, "kernel_h": 7},
    "prefix_lm": {"prefix_length": 300},
    "relative_position": {},
    "shared_prefix": {
        "doc_lengths": [256, 128, 128, 256, 128, 128],
        "prefix_of": [0, 0, 0, 3, 3, 3],
    },
    "sliding_window": {"window_size": 128},
    "sliding_window_sinks": {"window_size": 256, "num_sinks": 4},
    "softcap": {"soft_cap": 20.0},
}


def test_zoom_params_cover_the_catalogue():
    assert sorted(ZOOM_PARAMS) == variants.names()


@pytest.mark.parametrize("name", sorted(ZOOM_PARAMS))
def test_zoom_shows_where_the_variant_differs_from_causal_and_full(name):
    # The zoom square of the heatmap holds entries the variant masks unlike causal attention
    # and entries it masks unlike no mask, wherever the whole mask has such entries.
    seq_len, window, cell = 1024, 128, 4
    mask_mod = variants.get(name, **ZOOM_PARAMS[name]).mask_mod
    q0, k0 = viz.zoom_origin(viz.pooled_keep(mask_mod, seq_len, cell), cell, window, seq_len)
    pos = torch.arange(seq_len)
    keep = (
        torch.ones(seq_len, seq_len, dtype=torch.bool)
        if mask_mod is None
        else dense_mask(mask_mod, 1, 1, pos, pos)[0, 0]
    )
    causal = pos.view(-1, 1) >= pos.view(1, -1)
    square = (slice(q0, q0 + window), slice(k0, k0 + window))
    for reference in (causal, torch.ones_like(causal)):
        if not torch.equal(keep, reference):
            assert not torch.equal(keep[square], reference[square]), (name, q0, k0)


def test_zoom_of_a_window_at_one_token_a_cell_shows_its_far_edge():
    # S = 256 pools to one token a cell: no cell is kept in part, edges come from neighbours.
    mask_mod = variants.get("sliding_window", window_size=64).mask_mod
    q0, k0 = viz.zoom_origin(viz.pooled_keep(mask_mod, 256, 1), 1, 64, 256)
    assert q0 - (k0 + 63) < 64 < (q0 + 63) - k0  # the square holds q - kv = 64, the far edge
    assert q0 <= k0 + 63  # and the diagonal


def test_the_colour_bar_says_score_mod_only_when_there_is_one(rng):
    q = torch.randn(1, 1, 16, 8, generator=rng)
    plain = utils.plot_attention_scores(q, q, mask_mod=causal, device="cpu")
    capped = utils.plot_attention_scores(
        q, q, score_mod=lambda s, b, h, qi, ki: s / 2, device="cpu"
    )
    assert plain.axes[1].get_ylabel() == "score (q·k, scaled)"
    assert capped.axes[1].get_ylabel() == "score (after score_mod)"


def test_a_picture_title_fits_however_long_the_variants_arguments():
    title = viz.short_title(
        "gym_generate_doc_mask_mod",
        {
            "mask_mod": "attn_gym.masks.causal_mask",
            "mask_args": {"offsets": list(range(0, 900, 9))},
        },
    )
    assert len(title) <= viz.TITLE_WIDTH and title.startswith("gym_generate_doc_mask_mod(")
    assert "causal_mask" in title and "attn_gym.masks" not in title
    assert (
        viz.short_title("sliding_window", {"window_size": 128}) == "sliding_window(window_size=128)"
    )
    assert viz.short_title("custom", {"mask_args": {"stride": 2}}) == "custom(stride=2)"
