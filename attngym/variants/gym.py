"""attention-gym's generators from config-friendly arguments, for conf/attention/gym_*.yaml.

attention-gym (`pip install attn-gym`) writes each variant as a generator returning a
FlexAttention callback. Most take numbers and lists, and their option names them directly
(`mask_mod: attn_gym.masks.generate_sliding_window`); the few that take tensors, objects or an
inner callback get a factory here that takes lists and integers, builds the tensors on the run's
`device` (attngym.variants.custom passes it) and calls attention-gym's generator, which does the
attention. `attn_gym` is imported inside each factory: importing attngym never imports it.

Which generators define attention over one sequence (q and kv the same tokens, the mask fixed by
the config), and so have an option:

=============================================  ====  ========================================
generator (attn_gym.masks / attn_gym.mods)     opt.  why, or what it needs
=============================================  ====  ========================================
causal_mask                                    yes   gym_causal
generate_sliding_window                        yes   gym_sliding_window
generate_dilated_sliding_window                yes   gym_dilated_sliding_window
generate_prefix_lm_mask                        yes   gym_prefix_lm
generate_global_sliding_window                 yes   gym_global_sliding_window: positions list
generate_doc_mask_mod                          yes   gym_document: doc lengths, inner mask path
generate_packed_causal_doc_mask_mod            yes   gym_packed_document: doc lengths
generate_shared_prefix_mask_mod                yes   gym_shared_prefix: lengths, prefix table
batchify_mask_mod                              yes   gym_batchify: inner mask path
generate_block_diffusion_mask                  yes   gym_block_diffusion: x_t ++ x_0
generate_natten / _tiled_natten / _morton_     yes   gym_natten, gym_tiled_natten,
  natten                                             gym_morton_natten: a canvas
generate_sta_mask_mod_2d / _3d                 yes   gym_sta_2d (a canvas), gym_sta_3d (frames)
generate_spatial_head_mask_mod /               yes   gym_svg_spatial, gym_svg_temporal:
  generate_temporal_head_mask_mod                    prompt + video frames
generate_jetspec_tree_causal_mask_mod          yes   gym_jetspec_tree: a tree, prefix_length 0
                                                     (with a prefix, queries are the tree only)
generate_jetspec_training_mask_mod             yes   gym_jetspec_training: prefix_length 0
                                                     (with a prefix, queries are the blocks only)
generate_vision_cross_attention_mask_mod       no    cross-attention: text queries over image
                                                     keys, two sequences of different lengths
generate_vsa_mask_mod (and the VSA helpers)    no    data-dependent: the top-k tiles come from
                                                     the queries and keys of each call
generate_alibi_bias                            yes   gym_alibi: H = shape.heads
generate_sandwich_bias                         yes   gym_sandwich: H, max_seq_len from shape
generate_tanh_softcap                          yes   gym_softcap
generate_activation_score_mod                  yes   gym_activation: activation by import path
                                                     (the kernel's part; undo_softmax is after)
generate_graphormer_spatial_bias               yes   gym_graphormer_spatial: a graph of
                                                     seq_len nodes (packed rings), a bias table
generate_graphormer_edge_bias                  yes   gym_graphormer_edge: the same graph with
                                                     typed edges, a bias table
generate_mla_rope_score_mod                    no    data-dependent: reads the RoPE parts of
                                                     each call's queries and keys (torch.dot,
                                                     which only FlexAttention's vmap runs)
=============================================  ====  ========================================

Not generators (helpers): build_tree_ancestor_matrix, shortest_path_distances,
shortest_path_edge_types, undo_softmax, and the VSA tiling, scoring and block-mask functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

CAUSAL = "attn_gym.masks.causal_mask"


def _function(path: str, name: str, what: str) -> Callable[..., torch.Tensor]:
    """The function an import path (`package.module.name`) names: a generator's inner mask_mod
    or activation; ValueError naming the argument otherwise."""
    module, _, attr = str(path).replace(":", ".").rpartition(".")
    try:
        fn = getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError, ValueError):
        raise ValueError(f"{name} must be the import path of {what}, got {path!r}") from None
    if not callable(fn):
        raise ValueError(f"{name} must name {what}, got {path!r} (a {type(fn).__name__})")
    return fn


def _offsets(doc_lengths: Sequence[int], device: Any) -> torch.Tensor:
    from attn_gym.masks.document_mask import length_to_offsets

    if isinstance(doc_lengths, str) or not doc_lengths or any(n < 1 for n in doc_lengths):
        raise ValueError(f"doc_lengths must be a list of positive integers, got {doc_lengths!r}")
    return length_to_offsets(list(doc_lengths), device)


def document(
    doc_lengths: Sequence[int], inner: str = CAUSAL, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`generate_doc_mask_mod(inner, offsets)`: `inner` applied inside each packed document, at
    positions counted from the document's start."""
    from attn_gym.masks import generate_doc_mask_mod

    return generate_doc_mask_mod(
        _function(inner, "inner", "a mask_mod"), _offsets(doc_lengths, device)
    )


def packed_document(doc_lengths: Sequence[int], device: Any = "cpu") -> Callable[..., torch.Tensor]:
    """`generate_packed_causal_doc_mask_mod(offsets)`: causal inside each packed document."""
    from attn_gym.masks import generate_packed_causal_doc_mask_mod

    return generate_packed_causal_doc_mask_mod(_offsets(doc_lengths, device))


def shared_prefix(
    doc_lengths: Sequence[int], prefix_of: Sequence[int], device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`generate_shared_prefix_mask_mod(offsets, prefix_document_id)`; prefix_of[d] is d's
    prefix document (itself for a prefix)."""
    from attn_gym.masks import generate_shared_prefix_mask_mod

    if len(prefix_of) != len(doc_lengths):
        raise ValueError(
            f"prefix_of must give one prefix document per document ({len(doc_lengths)}), "
            f"got {list(prefix_of)!r}"
        )
    prefix = torch.tensor(list(prefix_of), dtype=torch.int32, device=device)
    return generate_shared_prefix_mask_mod(_offsets(doc_lengths, device), prefix)


def batchify(
    batchify_size: int, inner: str = CAUSAL, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`batchify_mask_mod(inner, batchify_size)`: groups of batchify_size tokens, `inner` inside
    each at positions counted from the group's start."""
    from attn_gym.masks import batchify_mask_mod

    return batchify_mask_mod(_function(inner, "inner", "a mask_mod"), batchify_size)


def global_sliding_window(
    window_size: int, global_tokens: Sequence[int], seq_len: int, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`generate_global_sliding_window(window_size, is_global)`, is_global marking the
    positions in global_tokens (each < seq_len)."""
    from attn_gym.masks import generate_global_sliding_window

    bad = [p for p in global_tokens if not 0 <= p < seq_len]
    if bad:
        raise ValueError(f"global_tokens must lie in [0, seq_len={seq_len}), got {bad!r}")
    is_global = torch.zeros(seq_len, dtype=torch.bool, device=device)
    is_global[list(global_tokens)] = True
    return generate_global_sliding_window(window_size, is_global)


def jetspec_tree(
    num_nodes: int, branching: int = 2, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`generate_jetspec_tree_causal_mask_mod(0, ancestors)` over a complete tree of num_nodes
    nodes in breadth-first order (node i's parent is (i - 1) // branching): each node attends to
    itself and its ancestors."""
    from attn_gym.masks import build_tree_ancestor_matrix, generate_jetspec_tree_causal_mask_mod

    if num_nodes < 1 or branching < 1:
        raise ValueError(
            f"num_nodes and branching must be positive, got {num_nodes!r}, {branching!r}"
        )
    parents = [-1, *((i - 1) // branching for i in range(1, num_nodes))]
    ancestors = build_tree_ancestor_matrix(parents, device=device)
    return generate_jetspec_tree_causal_mask_mod(0, ancestors)


def activation(
    activation: str = "torch.nn.functional.gelu", offset: float = 1.0
) -> Callable[..., torch.Tensor]:
    """`generate_activation_score_mod(fn, offset)`, fn the pointwise function an import path
    names (activation(s) + offset must stay positive)."""
    from attn_gym.mods import generate_activation_score_mod

    fn = _function(activation, "activation", "a pointwise function")
    return generate_activation_score_mod(fn, offset)


def _packed_rings(
    num_nodes: int, graph_size: int, device: Any
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One graph of num_nodes nodes made of rings of graph_size nodes (disconnected, as packed
    molecules are): the (1, n, n) adjacency of one ring (node i joined to i +- 1 mod n), and the
    (N, N) index grids that place a ring's (n, n) table on the diagonal blocks, with `same`, the
    (N, N) pairs inside one ring. attention-gym's shortest paths then run on one small ring."""
    if num_nodes % graph_size:
        raise ValueError(
            f"graph_size must divide num_nodes={num_nodes} (rings of graph_size nodes fill the "
            f"sequence), got {graph_size!r}"
        )
    nodes = torch.arange(graph_size, device=device)
    ring = torch.zeros(1, graph_size, graph_size, dtype=torch.bool, device=device)
    ring[:, nodes, (nodes + 1) % graph_size] = True
    ring[:, (nodes + 1) % graph_size, nodes] = True
    pos = torch.arange(num_nodes, device=device)
    same = (pos[:, None] // graph_size) == (pos[None, :] // graph_size)
    local = pos % graph_size
    return ring, same, (local[:, None], local[None, :])


def _one_graph(score_mod: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """The score_mod with the graph of batch row 0 for every batch row."""

    def same_graph_every_row(score, b, h, q_idx, kv_idx):
        return score_mod(score, torch.zeros_like(b), h, q_idx, kv_idx)

    same_graph_every_row.__name__ = score_mod.__name__
    return same_graph_every_row


def graphormer_spatial(
    num_nodes: int, heads: int, graph_size: int = 32, max_distance: int = 4, device: Any = "cpu"
) -> Callable[..., torch.Tensor]:
    """`generate_graphormer_spatial_bias(table, distances)` on num_nodes nodes packed as rings
    of graph_size nodes (nodes of different rings are unreachable: the last bucket), one graph
    for every batch row; the bias of distance d at head h is `-d * (h + 1) / heads` (a fixed
    table where a model would learn one)."""
    from attn_gym.mods import generate_graphormer_spatial_bias, shortest_path_distances

    ring, same, (q_local, kv_local) = _packed_rings(num_nodes, graph_size, device)
    ring_distances = shortest_path_distances(ring, max_distance)[0]  # (n, n)
    distances = torch.where(same, ring_distances[q_local, kv_local], max_distance + 1)
    buckets = torch.arange(max_distance + 2, dtype=torch.float32, device=device)
    slopes = torch.arange(1, heads + 1, dtype=torch.float32, device=device) / heads
    table = -slopes[:, None] * buckets[None, :]  # (H, max_distance + 2)
    return _one_graph(generate_graphormer_spatial_bias(table, distances.unsqueeze(0)))


def graphormer_edge(
    num_nodes: int,
    heads: int,
    graph_size: int = 32,
    max_path_len: int = 3,
    num_edge_types: int = 3,
    device: Any = "cpu",
) -> Callable[..., torch.Tensor]:
    """`generate_graphormer_edge_bias(table, path_types, path_lengths)` on num_nodes nodes
    packed as rings of graph_size nodes whose edge (i, i + 1) has type i % num_edge_types
    (nodes of different rings have no path: no edge bias), one graph for every batch row; the
    table seeded (a fixed table where a model would learn one)."""
    from attn_gym.mods import generate_graphormer_edge_bias, shortest_path_edge_types

    ring, same, (q_local, kv_local) = _packed_rings(num_nodes, graph_size, device)
    nodes = torch.arange(graph_size, device=device)
    edge_types = torch.minimum(nodes[:, None], nodes[None, :]) % num_edge_types
    ring_types, ring_lengths = shortest_path_edge_types(
        ring, edge_types.unsqueeze(0), max_path_len
    )  # (1, n, n, K), (1, n, n)
    path_types = torch.where(same[..., None], ring_types[0][q_local, kv_local], 0)
    path_lengths = torch.where(same, ring_lengths[0][q_local, kv_local], 0)
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(heads, max_path_len, num_edge_types, generator=gen).to(device)
    return _one_graph(
        generate_graphormer_edge_bias(table, path_types.unsqueeze(0), path_lengths.unsqueeze(0))
    )
