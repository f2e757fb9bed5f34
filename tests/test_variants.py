"""The variant catalogue against independent definitions.

Every mask is evaluated the way the dense reference evaluates it (`dense_mask` on broadcast index
grids) and compared with `torch.equal` to a boolean matrix built here with plain Python loops from
the definition in words, never from the code under test. Score mods are compared with formulas
written out per element in float64.
"""

from __future__ import annotations

import math

import pytest
import torch

from attngym.reference import dense_mask
from attngym.variants import Variant, compose, get, names

S = 40  # long enough for every window, chunk and document boundary below; loops stay instant


def mask_of(variant: Variant, seq_len: int = S, heads: int = 1) -> torch.Tensor:
    """The variant's mask as (heads, seq_len, seq_len) booleans, from the code under test."""
    pos = torch.arange(seq_len)
    return dense_mask(variant.mask_mod, 1, heads, pos, pos)[0].expand(heads, -1, -1)


def loop_mask(pred, seq_len: int = S) -> torch.Tensor:
    """(1, seq_len, seq_len) booleans with [0, q, kv] = pred(q, kv), built element by element."""
    rows = [[bool(pred(q, kv)) for kv in range(seq_len)] for q in range(seq_len)]
    return torch.tensor(rows, dtype=torch.bool).unsqueeze(0)


def doc_of(lengths: list[int]) -> list[int]:
    """Document index of every position, by walking the lengths."""
    ids = []
    for d, n in enumerate(lengths):
        ids += [d] * n
    return ids


def natten_keys(q: int, canvas_w: int, canvas_h: int, kernel_w: int, kernel_h: int) -> set[int]:
    """NATTEN neighbourhood by search.

    Per axis, of all windows [s, s + k) inside the canvas, the one whose anchor slot s + k // 2 is
    closest to the query (the anchor is the centre for odd k, the slot after it for even k).
    """

    def window(x: int, k: int, length: int) -> range:
        s = min(range(length - k + 1), key=lambda s: abs(s + k // 2 - x))
        return range(s, s + k)

    rows = window(q // canvas_w, kernel_h, canvas_h)
    cols = window(q % canvas_w, kernel_w, canvas_w)
    return {r * canvas_w + c for r in rows for c in cols}


def shared_prefix_sees(q: int, kv: int, lengths: list[int], prefix_of: list[int]) -> bool:
    """Causal inside q's own document; in a continuation, also every token of its prefix."""
    docs = doc_of(lengths)
    if docs[q] == docs[kv] and kv <= q:
        return True
    return prefix_of[docs[q]] != docs[q] and docs[kv] == prefix_of[docs[q]]


def block_diffusion_sees(q: int, kv: int, clean: int, block: int) -> bool:
    """BD3-LM: x_t = [0, clean), x_0 = [clean, 2 clean), blocks counted inside each half."""
    q_noised, kv_noised = q < clean, kv < clean
    q_block, kv_block = (q % clean) // block, (kv % clean) // block
    if q_noised and kv_noised:
        return q_block == kv_block  # its own noised block, both ways
    if q_noised:
        return kv_block < q_block  # clean tokens of earlier blocks only
    if kv_noised:
        return False  # clean tokens never see noised ones
    return kv_block <= q_block  # block causal over x_0


# name, params, definition in words as a predicate on (q, kv)
MASK_CASES = [
    ("full", {}, lambda q, kv: True),
    ("causal", {}, lambda q, kv: q >= kv),
    ("sliding_window", {"window_size": 5}, lambda q, kv: 0 <= q - kv <= 5),
    ("sliding_window", {"window_size": 1}, lambda q, kv: q - kv in (0, 1)),
    ("bidirectional_sliding_window", {"window_size": 3}, lambda q, kv: -3 <= q - kv <= 3),
    (
        "dilated_sliding_window",
        {"window_size": 8, "dilation": 3},
        lambda q, kv: abs(q - kv) <= 8 and (q - kv) % 3 == 0,
    ),
    ("dilated_sliding_window", {"window_size": 4, "dilation": 1}, lambda q, kv: abs(q - kv) <= 4),
    (
        "sliding_window_sinks",
        {"window_size": 6, "num_sinks": 4},
        lambda q, kv: kv <= q and (q - kv <= 6 or kv < 4),
    ),
    ("prefix_lm", {"prefix_length": 9}, lambda q, kv: kv < 9 or q >= kv),
    ("prefix_lm", {"prefix_length": 0}, lambda q, kv: q >= kv),
    ("chunked_causal", {"chunk_size": 7}, lambda q, kv: kv <= q and q // 7 == kv // 7),
    (
        "document",
        {"doc_lengths": [11, 1, 20, 8]},
        lambda q, kv: doc_of([11, 1, 20, 8])[q] == doc_of([11, 1, 20, 8])[kv] and kv <= q,
    ),
    (
        "document",
        {"doc_lengths": [15, 25], "causal": False},
        lambda q, kv: (q < 15) == (kv < 15),
    ),
    (
        "natten",
        {"canvas_w": 8, "canvas_h": 5, "kernel_w": 3, "kernel_h": 3},
        lambda q, kv: kv in natten_keys(q, 8, 5, 3, 3),
    ),
    (
        "natten",
        {"canvas_w": 8, "canvas_h": 5, "kernel_w": 4, "kernel_h": 2},
        lambda q, kv: kv in natten_keys(q, 8, 5, 4, 2),
    ),
    (
        "natten",
        {"canvas_w": 5, "canvas_h": 8, "kernel_w": 5, "kernel_h": 1},
        lambda q, kv: q // 5 == kv // 5,
    ),
    (
        "global_sliding_window",
        {"window_size": 3, "global_tokens": [0, 21]},
        lambda q, kv: abs(q - kv) <= 3 or q in (0, 21) or kv in (0, 21),
    ),
    (
        "shared_prefix",
        {"doc_lengths": [10, 4, 6, 8, 5, 7], "prefix_of": [0, 0, 0, 3, 3, 3]},
        lambda q, kv: shared_prefix_sees(q, kv, [10, 4, 6, 8, 5, 7], [0, 0, 0, 3, 3, 3]),
    ),
    (
        "shared_prefix",
        {"doc_lengths": [15, 25], "prefix_of": [0, 1]},
        lambda q, kv: doc_of([15, 25])[q] == doc_of([15, 25])[kv] and kv <= q,
    ),
    (
        "block_diffusion",
        {"clean_length": 20, "block_size": 6},
        lambda q, kv: block_diffusion_sees(q, kv, 20, 6),
    ),
]


@pytest.mark.parametrize(
    "name, params, pred", MASK_CASES, ids=[f"{n}-{p}" for n, p, _ in MASK_CASES]
)
def test_mask_matches_definition(name, params, pred):
    variant = get(name, **params)
    assert torch.equal(mask_of(variant), loop_mask(pred))


def test_required_names_are_registered():
    required = {
        "full",
        "causal",
        "sliding_window",
        "dilated_sliding_window",
        "sliding_window_sinks",
        "prefix_lm",
        "document",
        "chunked_causal",
        "natten",
        "alibi",
        "softcap",
        "relative_position",
        "global_sliding_window",
        "shared_prefix",
        "block_diffusion",
        "gemma2",
    }
    assert required <= set(names())
    assert names() == sorted(names())


def test_natten_non_square_canvas_by_hand():
    # 8 wide, 4 high; token t is row t // 8, column t % 8.
    v = get("natten", canvas_w=8, canvas_h=4, kernel_w=3, kernel_h=3)
    assert v.seq_len == 32
    m = mask_of(v, 32)[0]

    def keys(row, col):
        return {t for t in range(32) if m[row * 8 + col, t]}

    def box(rows, cols):
        return {r * 8 + c for r in rows for c in cols}

    assert keys(0, 0) == box(range(0, 3), range(0, 3))  # corner: window shifted inwards
    assert keys(1, 4) == box(range(0, 3), range(3, 6))  # interior: centred
    assert keys(3, 7) == box(range(1, 4), range(5, 8))  # opposite corner
    assert keys(2, 0) == box(range(1, 4), range(0, 3))
    # every query sees exactly kernel_w * kernel_h keys
    assert torch.equal(m.sum(-1), torch.full((32,), 9))


def test_natten_even_kernel_leans_to_earlier_positions():
    v = get("natten", canvas_w=8, canvas_h=4, kernel_w=4, kernel_h=2)
    m = mask_of(v, 32)[0]

    def keys(row, col):
        return {t for t in range(32) if m[row * 8 + col, t]}

    def box(rows, cols):
        return {r * 8 + c for r in rows for c in cols}

    # interior: kernel // 2 before the query, kernel // 2 - 1 after it
    assert keys(2, 4) == box(range(1, 3), range(2, 6))
    assert keys(1, 5) == box(range(0, 2), range(3, 7))
    # borders: shifted inwards, size kept
    assert keys(0, 0) == box(range(0, 2), range(0, 4))
    assert keys(3, 7) == box(range(2, 4), range(4, 8))
    assert torch.equal(m.sum(-1), torch.full((32,), 8))


def test_natten_agrees_with_search_on_many_canvases():
    for cw, ch, kw, kh in [(6, 3, 5, 2), (3, 7, 2, 7), (7, 7, 6, 3), (1, 9, 1, 4)]:
        v = get("natten", canvas_w=cw, canvas_h=ch, kernel_w=kw, kernel_h=kh)
        n = cw * ch
        want = loop_mask(lambda q, kv: kv in natten_keys(q, cw, ch, kw, kh), n)  # noqa: B023
        assert torch.equal(mask_of(v, n), want), (cw, ch, kw, kh)


# ---- score mods --------------------------------------------------------------------------------

H = 4
SS = 12


def apply_score_mod(variant: Variant, score: torch.Tensor) -> torch.Tensor:
    """score_mod of the code under test on broadcast grids, like the reference evaluates it."""
    b = torch.arange(score.shape[0]).view(-1, 1, 1, 1)
    h = torch.arange(score.shape[1]).view(1, -1, 1, 1)
    q = torch.arange(score.shape[2]).view(1, 1, -1, 1)
    kv = torch.arange(score.shape[3]).view(1, 1, 1, -1)
    return torch.broadcast_to(variant.score_mod(score, b, h, q, kv), score.shape)


def loop_scores(score: torch.Tensor, fn) -> torch.Tensor:
    """Element-wise fn(s, h, q, kv) in Python floats."""
    out = torch.empty_like(score)
    B, Hn, Sq, Skv = score.shape
    for b in range(B):
        for h in range(Hn):
            for q in range(Sq):
                for kv in range(Skv):
                    out[b, h, q, kv] = fn(score[b, h, q, kv].item(), h, q, kv)
    return out


@pytest.fixture
def score(rng):
    return torch.randn(2, H, SS, SS, generator=rng, dtype=torch.float64) * 4


def test_alibi_matches_formula(score):
    v = get("alibi", num_heads=H)
    assert v.mask_mod is None
    want = loop_scores(score, lambda s, h, q, kv: s + (kv - q) * 2.0 ** (-8.0 * (h + 1) / H))
    # exp2 in float64 against Python's pow: equal up to a few ulps
    torch.testing.assert_close(apply_score_mod(v, score), want, rtol=1e-14, atol=1e-14)


def test_softcap_matches_formula(score):
    v = get("softcap", soft_cap=3.0)
    want = loop_scores(score, lambda s, h, q, kv: 3.0 * math.tanh(s / 3.0))
    torch.testing.assert_close(apply_score_mod(v, score), want, rtol=1e-14, atol=1e-14)
    assert apply_score_mod(v, score * 100).abs().max() <= 3.0


def test_gemma2_is_a_window_with_capped_scores(score):
    v = get("gemma2", window_size=5, soft_cap=3.0)
    assert torch.equal(mask_of(v), loop_mask(lambda q, kv: 0 <= q - kv <= 5))
    want = loop_scores(score, lambda s, h, q, kv: 3.0 * math.tanh(s / 3.0))
    torch.testing.assert_close(apply_score_mod(v, score), want, rtol=1e-14, atol=1e-14)
    assert v.params == {"window_size": 5, "soft_cap": 3.0}


def test_relative_position_matches_formula(score):
    v = get("relative_position")
    want = loop_scores(score, lambda s, h, q, kv: s + (q - kv))
    assert torch.equal(apply_score_mod(v, score), want)


def test_score_mod_keeps_float32(rng):
    """In the kernel scores are float32: the mods must not promote them to float64."""
    score = torch.randn(1, H, SS, SS, generator=rng)
    for v in (get("alibi", num_heads=H), get("softcap", soft_cap=2), get("relative_position")):
        assert apply_score_mod(v, score).dtype == torch.float32, v


# ---- composition and buffers -------------------------------------------------------------------


def test_compose_ands_masks_and_chains_score_mods(score):
    window, cap = get("sliding_window", window_size=3), get("softcap", soft_cap=2.0)
    both = compose(window, cap)
    assert both.name == "sliding_window+softcap"
    assert both.params == {"sliding_window": {"window_size": 3}, "softcap": {"soft_cap": 2.0}}
    assert torch.equal(mask_of(both), loop_mask(lambda q, kv: 0 <= q - kv <= 3))
    want = loop_scores(score, lambda s, h, q, kv: 2.0 * math.tanh(s / 2.0))
    torch.testing.assert_close(apply_score_mod(both, score), want, rtol=1e-14, atol=1e-14)

    # order matters: alibi then softcap caps the biased score
    chained = compose(get("alibi", num_heads=H), cap)
    want = loop_scores(
        score, lambda s, h, q, kv: 2.0 * math.tanh((s + (kv - q) * 2.0 ** (-8 * (h + 1) / H)) / 2)
    )
    torch.testing.assert_close(apply_score_mod(chained, score), want, rtol=1e-13, atol=1e-13)

    two_masks = compose(get("prefix_lm", prefix_length=6), get("chunked_causal", chunk_size=10))
    want = loop_mask(lambda q, kv: (kv < 6 or q >= kv) and q // 10 == kv // 10 and q >= kv)
    assert torch.equal(mask_of(two_masks), want)


def test_compose_with_document_buffers_and_to():
    lengths = [10, 18, 12]
    doc = get("document", doc_lengths=lengths)
    both = compose(doc, get("sliding_window", window_size=4))
    assert both.seq_len == S
    assert set(both.buffers) == {"0.doc_ids"}
    ids = doc_of(lengths)
    want = loop_mask(lambda q, kv: ids[q] == ids[kv] and 0 <= q - kv <= 4)
    assert torch.equal(mask_of(both), want)

    assert both.to("cpu") is both  # already there: itself (its block masks are found again)

    # the meta device proves the callbacks read the moved buffer, not the original one
    on_meta = both.to("meta")
    assert on_meta.device == torch.device("meta")
    pos = torch.arange(S, device="meta")
    assert dense_mask(on_meta.mask_mod, 1, 1, pos, pos).device == torch.device("meta")
    assert doc.to("meta").buffers["doc_ids"].device == torch.device("meta")
    assert doc.buffers["doc_ids"].device == torch.device("cpu")  # the original is untouched
    assert both.to("meta") is on_meta  # moved once per device: the same callbacks each time


def test_compose_rejects_different_seq_lens():
    with pytest.raises(ValueError, match="seq_len"):
        compose(get("document", doc_lengths=[4, 4]), get("document", doc_lengths=[5]))


def test_compose_accepts_same_seq_len():
    v = compose(get("document", doc_lengths=[4, 4]), get("natten", **_canvas(4, 2, 3, 1)))
    assert v.seq_len == 8


def _canvas(w, h, kw, kh):
    return {"canvas_w": w, "canvas_h": h, "kernel_w": kw, "kernel_h": kh}


def test_document_seq_len_and_check_seq_len():
    v = get("document", doc_lengths=[3, 5, 2])
    assert v.seq_len == 10
    v.check_seq_len(10)
    with pytest.raises(ValueError, match=r"seq_len=10.*got seq_len=12"):
        v.check_seq_len(12)
    get("natten", **_canvas(4, 3, 3, 3)).check_seq_len(12)
    with pytest.raises(ValueError, match="seq_len=12"):
        get("natten", **_canvas(4, 3, 3, 3)).check_seq_len(16)
    get("sliding_window", window_size=4).check_seq_len(12345)  # no fixed length: anything goes


@pytest.mark.parametrize(
    "name, params, pred", MASK_CASES, ids=[f"{n}-{p}" for n, p, _ in MASK_CASES]
)
def test_sdpa_flag_only_when_sdpa_is_exact(name, params, pred):
    v = get(name, **params)
    if v.sdpa is None:
        return
    assert v.score_mod is None
    want = loop_mask(lambda q, kv: True if v.sdpa == "full" else q >= kv)
    assert torch.equal(mask_of(v), want)


def test_sdpa_flags():
    assert get("full").sdpa == "full"
    assert get("causal").sdpa == "causal"
    assert get("prefix_lm", prefix_length=1).sdpa == "causal"
    assert get("prefix_lm", prefix_length=2).sdpa is None
    assert get("document", doc_lengths=[7]).sdpa == "causal"
    assert get("document", doc_lengths=[7], causal=False).sdpa == "full"
    assert get("document", doc_lengths=[3, 4]).sdpa is None
    assert get("sliding_window", window_size=4).sdpa is None
    assert get("alibi", num_heads=2).sdpa is None
    assert compose(get("causal"), get("full")).sdpa == "causal"
    assert compose(get("causal"), get("softcap", soft_cap=5)).sdpa is None
    assert get("shared_prefix", doc_lengths=[7], prefix_of=[0]).sdpa == "causal"
    assert get("shared_prefix", doc_lengths=[3, 4], prefix_of=[0, 0]).sdpa is None
    assert get("global_sliding_window", window_size=3, global_tokens=[0]).sdpa is None
    assert get("block_diffusion", clean_length=8, block_size=4).sdpa is None


def test_native_variants_know_their_length_and_move_their_buffers():
    assert get("block_diffusion", clean_length=12, block_size=4).seq_len == 24
    v = get("shared_prefix", doc_lengths=[3, 5, 2], prefix_of=[0, 0, 2])
    assert v.seq_len == 10 and v.to("meta").device == torch.device("meta")
    g = get("global_sliding_window", window_size=3, global_tokens=[0])
    assert g.seq_len is None and g.to("meta").buffers["global_positions"].is_meta


# attention-gym's generator of each native variant, called as attention-gym documents it.
GYM_PARITY = [
    (
        "global_sliding_window",
        {"window_size": 3, "global_tokens": [0, 21]},
        lambda m, S: m.generate_global_sliding_window(
            3, torch.isin(torch.arange(S), torch.tensor([0, 21]))
        ),
    ),
    (
        "shared_prefix",
        {"doc_lengths": [10, 4, 6, 8, 5, 7], "prefix_of": [0, 0, 0, 3, 3, 3]},
        lambda m, S: m.generate_shared_prefix_mask_mod(
            torch.tensor([0, 10, 14, 20, 28, 33, 40]), torch.tensor([0, 0, 0, 3, 3, 3])
        ),
    ),
    (
        "block_diffusion",
        {"clean_length": 20, "block_size": 6},
        lambda m, S: m.generate_block_diffusion_mask(20, 6),
    ),
]


@pytest.mark.parametrize("name, params, gym", GYM_PARITY, ids=[n for n, _, _ in GYM_PARITY])
def test_native_variant_equals_attention_gyms_generator(name, params, gym):
    masks = pytest.importorskip("attn_gym.masks", reason="attention-gym is not installed")
    pos = torch.arange(S)
    theirs = dense_mask(gym(masks, S), 1, 1, pos, pos)[0]
    assert torch.equal(mask_of(get(name, **params)), theirs)


def test_callback_names_encode_parameters():
    a = get("sliding_window", window_size=3).mask_mod.__name__
    b = get("sliding_window", window_size=4).mask_mod.__name__
    assert a != b and "3" in a and "4" in b
    n1 = get("natten", **_canvas(8, 4, 3, 3)).mask_mod.__name__
    n2 = get("natten", **_canvas(4, 8, 3, 3)).mask_mod.__name__
    assert n1 != n2
    assert "50" in get("softcap", soft_cap=50).score_mod.__name__
    assert "12" in get("alibi", num_heads=12).score_mod.__name__
    d1 = get("document", doc_lengths=[3, 5]).mask_mod.__name__
    d2 = get("document", doc_lengths=[3, 5], causal=False).mask_mod.__name__
    assert d1 != d2


# ---- parameter checking ------------------------------------------------------------------------

REJECT = [
    ("sliding_window", {"window_size": 0}, "window_size"),
    ("sliding_window", {"window_size": -2}, "window_size"),
    ("sliding_window", {"window_size": 2.5}, "window_size"),
    ("sliding_window", {"window_size": "8"}, "window_size"),
    ("sliding_window", {"window_size": True}, "window_size"),
    ("bidirectional_sliding_window", {"window_size": 0}, "window_size"),
    ("dilated_sliding_window", {"window_size": 0, "dilation": 2}, "window_size"),
    ("dilated_sliding_window", {"window_size": 4, "dilation": 0}, "dilation"),
    ("dilated_sliding_window", {"window_size": 4, "dilation": -1}, "dilation"),
    ("sliding_window_sinks", {"window_size": 0, "num_sinks": 2}, "window_size"),
    ("sliding_window_sinks", {"window_size": 4, "num_sinks": 0}, "num_sinks"),
    ("sliding_window_sinks", {"window_size": 4, "num_sinks": 1.0}, "num_sinks"),
    ("prefix_lm", {"prefix_length": -1}, "prefix_length"),
    ("prefix_lm", {"prefix_length": 3.0}, "prefix_length"),
    ("chunked_causal", {"chunk_size": 0}, "chunk_size"),
    ("document", {"doc_lengths": []}, "doc_lengths"),
    ("document", {"doc_lengths": [4, -1]}, r"doc_lengths\[1\]"),
    ("document", {"doc_lengths": [0, 4]}, r"doc_lengths\[0\]"),
    ("document", {"doc_lengths": [4, 2.0]}, r"doc_lengths\[1\]"),
    ("document", {"doc_lengths": 8}, "doc_lengths"),
    ("document", {"doc_lengths": "44"}, "doc_lengths"),
    ("document", {"doc_lengths": [4], "causal": "yes"}, "causal"),
    ("natten", _canvas(0, 4, 1, 1), "canvas_w"),
    ("natten", _canvas(4, -4, 1, 1), "canvas_h"),
    ("natten", _canvas(4, 4, 0, 1), "kernel_w"),
    ("natten", _canvas(4, 4, 1, 0), "kernel_h"),
    ("natten", _canvas(4, 8, 5, 3), "kernel_w"),
    ("natten", _canvas(8, 4, 3, 5), "kernel_h"),
    ("alibi", {"num_heads": 0}, "num_heads"),
    ("alibi", {"num_heads": 8.0}, "num_heads"),
    ("softcap", {"soft_cap": 0}, "soft_cap"),
    ("softcap", {"soft_cap": -30.0}, "soft_cap"),
    ("softcap", {"soft_cap": float("inf")}, "soft_cap"),
    ("softcap", {"soft_cap": float("nan")}, "soft_cap"),
    ("softcap", {"soft_cap": "50"}, "soft_cap"),
    ("global_sliding_window", {"window_size": 0, "global_tokens": [0]}, "window_size"),
    ("global_sliding_window", {"window_size": 4, "global_tokens": []}, "global_tokens"),
    ("global_sliding_window", {"window_size": 4, "global_tokens": [0, -3]}, r"global_tokens\[1\]"),
    ("global_sliding_window", {"window_size": 4, "global_tokens": [2, 2]}, "distinct"),
    ("global_sliding_window", {"window_size": 4, "global_tokens": 0}, "global_tokens"),
    ("shared_prefix", {"doc_lengths": [4, 0], "prefix_of": [0, 0]}, r"doc_lengths\[1\]"),
    ("shared_prefix", {"doc_lengths": [4, 4], "prefix_of": [0]}, "prefix_of"),
    ("shared_prefix", {"doc_lengths": [4, 4], "prefix_of": [1, 1]}, r"prefix_of\[0\]"),
    ("shared_prefix", {"doc_lengths": [4, 4, 4], "prefix_of": [0, 0, 1]}, r"prefix_of\[2\]"),
    ("shared_prefix", {"doc_lengths": [4], "prefix_of": "0"}, "prefix_of"),
    ("block_diffusion", {"clean_length": 0, "block_size": 1}, "clean_length"),
    ("block_diffusion", {"clean_length": 8, "block_size": 0}, "block_size"),
    ("block_diffusion", {"clean_length": 8, "block_size": 9}, "block_size"),
]

ACCEPT = [
    ("sliding_window", {"window_size": 1}),
    ("bidirectional_sliding_window", {"window_size": 1}),
    ("dilated_sliding_window", {"window_size": 1, "dilation": 1}),
    ("dilated_sliding_window", {"window_size": 2, "dilation": 5}),
    ("sliding_window_sinks", {"window_size": 1, "num_sinks": 1}),
    ("prefix_lm", {"prefix_length": 0}),
    ("prefix_lm", {"prefix_length": 100}),
    ("chunked_causal", {"chunk_size": 1}),
    ("document", {"doc_lengths": [1]}),
    ("document", {"doc_lengths": (4, 2), "causal": False}),
    ("natten", _canvas(1, 1, 1, 1)),
    ("natten", _canvas(4, 8, 4, 8)),
    ("alibi", {"num_heads": 1}),
    ("softcap", {"soft_cap": 50}),
    ("softcap", {"soft_cap": 0.25}),
    ("global_sliding_window", {"window_size": 1, "global_tokens": [0]}),
    ("global_sliding_window", {"window_size": 4, "global_tokens": (7, 2)}),
    ("shared_prefix", {"doc_lengths": [4], "prefix_of": [0]}),
    ("shared_prefix", {"doc_lengths": [4, 4, 4], "prefix_of": [0, 0, 0]}),
    ("block_diffusion", {"clean_length": 8, "block_size": 8}),
    ("block_diffusion", {"clean_length": 1, "block_size": 1}),
]


@pytest.mark.parametrize("name, params, key", REJECT, ids=[f"{n}-{p}" for n, p, _ in REJECT])
def test_rejects_bad_parameter(name, params, key):
    with pytest.raises(ValueError, match=key) as err:
        get(name, **params)
    # the message also shows what was received
    bad = [v for v in params.values()]
    assert any(repr(x) in str(err.value) or str(x) in str(err.value) for x in bad)


@pytest.mark.parametrize("name, params", ACCEPT, ids=[f"{n}-{p}" for n, p in ACCEPT])
def test_accepts_boundary_parameter(name, params):
    v = get(name, **params)
    assert v.name == name
    assert v.mask_mod is not None or v.score_mod is not None


def test_document_params_are_plain_lists():
    v = get("document", doc_lengths=(4, 2))
    assert v.params == {"doc_lengths": [4, 2], "causal": True}


def test_unknown_name_lists_names_and_suggests_closest():
    with pytest.raises(ValueError, match="did you mean 'sliding_window'") as err:
        get("slidingwindow", window_size=3)
    assert "prefix_lm" in str(err.value) and "natten" in str(err.value)


def test_known_name_is_found():
    assert get("sliding_window", window_size=3).name == "sliding_window"


def test_unknown_parameter_lists_the_parameters():
    with pytest.raises(ValueError, match="no parameter 'window'.*window_size"):
        get("sliding_window", window=3)


def test_missing_parameter_is_named():
    with pytest.raises(ValueError, match="needs parameter 'dilation'"):
        get("dilated_sliding_window", window_size=3)


def test_optional_parameter_may_be_left_out():
    assert get("document", doc_lengths=[2, 3]).params["causal"] is True


def test_a_variant_with_buffers_needs_bind():
    import torch

    from attngym.variants import Variant

    with pytest.raises(ValueError, match="no bind"):
        Variant(name="broken", buffers={"ids": torch.arange(4)})
    rebound = Variant(
        name="ok", buffers={"ids": torch.arange(4)}, bind=lambda buffers: (None, None)
    ).to("cpu")
    assert rebound.buffers["ids"].tolist() == [0, 1, 2, 3]
