"""PyTorch's own FlexAttention context parallelism, the contender attngym's CP is measured against.

The path is the one `torch.distributed.tensor.experimental` offers for flex (private names, the same
on torch 2.11 and 2.13): a module whose forward calls flex_attention is parallelised with
`_ContextParallel(seq_dim=2, attention_type=FLEX)`; its forward pre-hook all-gathers K/V along the
sequence with the `cplib::flex_cp_allgather` custom op (whose backward reduce-scatters dK/dV);
flex then runs once per rank, this rank's queries over the whole K/V, on the BlockMask that
`_create_cp_block_mask` builds from the variant's global mask_mod and the load balancer (built
here by attngym's block-mask builder, block for block the same). No DTensor is involved: q/k/v
stay plain local tensors.

Layouts: attngym `contiguous` is PyTorch without a load balancer, attngym `zigzag` is PyTorch's
`_HeadTailLoadBalancer` (rank r holds chunks r and 2P-1-r of 2P); both shard exactly as attngym
does, so the shards attngym's CP gets are passed unchanged. A layout with no PyTorch counterpart
runs in zigzag (PyTorch's default balancer), resharded by `reshard` outside the timed call.
`balancer=` takes one of PyTorch's balancers (BALANCERS: head-tail, per-document head-tail,
PTRR) whatever the caller's layout: its placement is a Layout (`balancer_layout`) to reshard to.

What PyTorch's CP requires: seq_len divisible by world_size x 128 (the BlockMask's block size is
flex's default, 128, fixed); a flex backward, so gradients need CUDA (flex has no CPU backward).
PyTorch rewrites only mask_mod to global positions; the score_mod is moved here the same way.

Contract: `TorchCP` does all setup at construction (mesh, block mask, compiled kernel handle), so a
timed `__call__` is the all-gather plus one flex call; the first call on CUDA compiles and belongs
outside any timing.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any

import torch

from attngym import kernels
from attngym.distributed.call.cp import CPOptions, check_shards, options_from
from attngym.distributed.placement import layout as layouts
from attngym.distributed.placement.positions import at_positions
from attngym.errors import choice_error
from attngym.variants.base import Variant

SEQ_DIM = 2
# The attngym layout PyTorch's CP runs for each attngym layout (same shards, same order).
TORCH_LAYOUTS = {"contiguous": "contiguous", "zigzag": "zigzag"}
DEFAULT_TORCH_LAYOUT = "zigzag"  # PyTorch's default balancer, head-tail
# PyTorch's load balancers for flex CP (torch.distributed.tensor.experimental._context_parallel):
# head-tail (attngym's zigzag), head-tail inside each document, and PTRR (processing-time
# round-robin over the block mask's blocks).
BALANCERS = ("head_tail", "per_document_head_tail", "ptrr")


def balancer_layout(
    name: str, variant: Variant, world_size: int, seq_len: int, device: torch.device | str
) -> layouts.Layout:
    """The placement PyTorch's load balancer `name` makes for this variant (its
    `_generate_indices`: rank r holds the r-th S/P of the reordered sequence), as a Layout.

    Raises:
        ValueError: the balancer cannot place this variant here (why, in words).
    """
    from torch.distributed.tensor.experimental._context_parallel import _load_balancer as lb

    if name == "head_tail":
        balancer = lb._HeadTailLoadBalancer(seq_len, world_size, device)
    elif name == "per_document_head_tail":
        cls = getattr(lb, "_PerDocumentHeadTailLoadBalancer", None)
        documents = None if variant.varlen is None else variant.varlen.documents
        if cls is None:
            raise ValueError(f"torch {torch.__version__} has no per-document head-tail balancer")
        if documents is None:
            raise ValueError(f"{variant.name} has no documents to balance one by one")
        if any(n % (2 * world_size) for n in documents):
            raise ValueError(
                f"it needs every document's length divisible by 2 x {world_size} ranks"
            )
        balancer = cls([list(documents)], world_size, device)
    elif name == "ptrr":
        cls = getattr(lb, "_PTRRLoadBalancer", None)
        if cls is None:
            raise ValueError(f"torch {torch.__version__} has no PTRR balancer")
        block = _api()["block_size"]
        block_mask = kernels.make_block_mask(variant, seq_len, seq_len, block_size=(block, block),
                                             device=device)  # fmt: skip
        if block_mask is None:
            raise ValueError(f"{variant.name} has no mask for PTRR to weigh")
        balancer = cls(block_mask, world_size)
    else:
        raise ValueError(choice_error("balancer", name, BALANCERS))
    order = balancer._generate_indices()[0].to("cpu", torch.long)
    return layouts.of_positions(f"torch_cp:{name}", list(order.chunk(world_size)))


def torch_cp_available() -> tuple[bool, str]:
    """(True, "") when this torch has flex context parallelism, else (False, why not)."""
    import torch.distributed as dist

    if not dist.is_available():
        return False, "torch.distributed is not available in this build"
    try:
        _api()
    except (ImportError, AttributeError) as e:
        return False, f"torch {torch.__version__} has no flex context parallelism ({e})"
    return True, ""


def _api() -> dict[str, Any]:
    """PyTorch's flex CP entry points (ImportError/AttributeError where this torch lacks one)."""
    from torch.distributed.tensor.experimental._context_parallel import _attention as cp
    from torch.distributed.tensor.experimental._context_parallel import _HeadTailLoadBalancer
    from torch.distributed.tensor.experimental._context_parallel._cp_custom_ops import (
        flex_cp_allgather,
    )
    from torch.distributed.tensor.parallel import parallelize_module
    from torch.nn.attention.flex_attention import _DEFAULT_SPARSE_BLOCK_SIZE

    return {
        "ContextParallel": cp._ContextParallel,
        "FLEX": cp._ContextParallel.AttentionType.FLEX,
        "HeadTailLoadBalancer": _HeadTailLoadBalancer,
        "flex_cp_allgather": flex_cp_allgather,
        "parallelize_module": parallelize_module,
        "block_size": _DEFAULT_SPARSE_BLOCK_SIZE,
    }


def block_size() -> int:
    """The block size (q and kv) of PyTorch's CP block mask: flex's default, fixed."""
    return _api()["block_size"]


def torch_layout(layout: str) -> str:
    """The attngym layout PyTorch's CP runs when attngym runs `layout` (itself where they agree)."""
    if layout not in layouts.LAYOUTS:
        raise ValueError(choice_error("layout", layout, layouts.LAYOUTS))
    return TORCH_LAYOUTS.get(layout, DEFAULT_TORCH_LAYOUT)


def check_shape(seq_len: int, world_size: int, layout: str) -> None:
    """ValueError unless PyTorch's CP can run `seq_len` over `world_size` ranks in `layout`."""
    block = _api()["block_size"]
    layouts.check_seq_len(seq_len, world_size, torch_layout(layout))
    if seq_len % (world_size * block):
        raise ValueError(
            f"seq_len={seq_len} must be divisible by world_size x {block} = "
            f"{world_size * block} for torch_cp (PyTorch's CP block mask has {block}-token blocks)"
        )


def reshard(x: torch.Tensor, src: str, dst: str, *, group=None, dim: int = SEQ_DIM, variant=None):
    """This rank's shard of the whole `x` moved from layout `src` to layout `dst` (collective;
    `variant` places a balanced layout).

    All-gathers the shards (differentiable), reassembles the sequence and cuts the `dst` shard;
    a copy of the whole tensor per rank, so it belongs outside timed code.
    """
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    if src == dst:
        return x
    # all_gather_single_autograd is the name from torch 2.13; 2.11 has only the older one.
    gather = (
        getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    )
    world_size = dist.get_world_size(group)
    gathered = gather(x.contiguous(), dim, group or dist.group.WORLD)
    if isinstance(gathered, funcol.AsyncCollectiveTensor):
        gathered = gathered.wait()
    whole = layouts.unshard(list(gathered.chunk(world_size, dim)), src, dim=dim, variant=variant)
    return layouts.shard(whole, dist.get_rank(group), world_size, dst, dim=dim, variant=variant)


class _Flex(torch.nn.Module):
    """flex_attention with everything but q, k, v bound: the module _ContextParallel hooks."""

    def __init__(self, fn, **options):
        super().__init__()
        self.fn, self.options = fn, options

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            # Eager flex on CPU is chosen on purpose (as in attngym.kernels).
            warnings.filterwarnings(
                "ignore",
                message="flex_attention called without torch.compile",
                category=UserWarning,
            )
            return self.fn(q, k, v, **self.options)


class TorchCP:
    """PyTorch's flex CP for one variant, shape, group and layout: built once, called per step.

    Collective at construction and at every call: every rank of `group` does the same.

    Args:
        variant: the attention variant, at global positions (moved to `device`).
        batch, heads, kv_heads, seq_len: B, H, G and the whole sequence S.
        group: process group of the P ranks (default: the world).
        layout: attngym layout of the caller's shards; `self.layout` is the one `__call__` takes
            (the same for contiguous and zigzag, else zigzag: see `reshard`).
        device: where the shards live.
        block_size: must be (128, 128), the block size PyTorch's CP block mask uses.
        balancer: one of BALANCERS: the shards are in its placement (`self.layout`, a Layout:
            reshard to it); None: the one `layout` names (none for contiguous, else head-tail).
        kernel_options: passed to flex_attention.
        scale: score scale, default 1 / sqrt(D).
        compile: compile flex_attention on CUDA (attngym.kernels.compiled_flex_attention); CPU
            always runs it eagerly.
        compile_mode: torch.compile mode when compiling.

    Tensors: `__call__(q_BHSD, k_BGSD, v_BGSD)` with S/P rows each in `self.layout` returns
    out_BHSD (S/P rows, q's dtype), differentiable w.r.t. q, k, v on CUDA.
    """

    def __init__(
        self,
        variant: Variant,
        *,
        batch: int,
        heads: int,
        kv_heads: int,
        seq_len: int,
        group=None,
        layout: str = "contiguous",
        device: torch.device | str = "cpu",
        block_size: tuple[int, int] = (128, 128),
        kernel_options: Mapping[str, Any] | None = None,
        scale: float | None = None,
        compile: bool = True,
        compile_mode: str = "default",
        balancer: str | None = None,
    ):
        import torch.distributed as dist
        from torch.distributed.device_mesh import DeviceMesh

        ok, why = torch_cp_available()
        if not ok:
            raise RuntimeError(f"torch_cp unavailable: {why}")
        api = _api()
        for name, value in (("batch", batch), ("heads", heads), ("kv_heads", kv_heads)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if heads % kv_heads:
            raise ValueError(f"kv_heads ({kv_heads}) must divide heads ({heads})")
        if tuple(block_size) != (api["block_size"],) * 2:
            raise ValueError(
                f"block_size must be ({api['block_size']}, {api['block_size']}) for torch_cp "
                f"(PyTorch's CP block mask uses flex's default block size), got {block_size!r}"
            )
        if not dist.is_initialized():
            raise RuntimeError("torch_cp needs an initialised process group")
        world_size = dist.get_world_size(group)
        check_shape(seq_len, world_size, layout if balancer is None else DEFAULT_TORCH_LAYOUT)
        variant.check_seq_len(seq_len)
        device = torch.device(device)
        self.layout = torch_layout(layout) if balancer is None else balancer_layout(
            balancer, variant, world_size, seq_len, device
        )  # fmt: skip
        self.group, self.world_size, self.seq_len = group, world_size, seq_len
        self.rank = dist.get_rank(group)
        self.kv_heads, self.heads = kv_heads, heads
        if variant.device is not None and variant.device != device:
            variant = variant.to(device)

        self.mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
        # Global position of every row of the all-gathered K/V (every rank's shard in rank
        # order), and of this rank's q rows.
        placed = layouts.resolve(self.layout, world_size, seq_len, variant, device)
        self.kv_positions = torch.cat([placed.positions(r, device) for r in range(world_size)]).to(
            torch.long
        )
        rows = seq_len // world_size
        self.q_positions = self.kv_positions[self.rank * rows : (self.rank + 1) * rows]

        compiled = kernels.compiled_flex_attention(compile_mode)  # also raises recompile limits
        # PyTorch's rewrite: local rows and gathered keys read through position tables.
        at = at_positions(
            variant, self.q_positions, self.kv_positions, device, f"{variant.name}@torch_cp",
            tables=True,
        )  # fmt: skip
        # The BlockMask _create_cp_block_mask builds (the same blocks: tests), by attngym's
        # builder: PyTorch's compiles create_block_mask per shape (over 70 s in Triton's ptxas at
        # S = 16K on an H200, for a mask built in milliseconds from the variant's block rule).
        block_mask = None
        if variant.mask_mod is not None:
            block_mask = kernels.make_block_mask(
                at, rows, seq_len, block_size=(api["block_size"],) * 2, device=device
            )
        self.block_mask = block_mask

        from torch.nn.attention.flex_attention import flex_attention

        fn = compiled if compile and device.type == "cuda" else flex_attention
        module = _Flex(
            fn,
            score_mod=at.score_mod,
            block_mask=block_mask,
            scale=scale,
            enable_gqa=kv_heads != heads,
            kernel_options=dict(kernel_options) if kernel_options else None,
        )
        self.module = api["parallelize_module"](
            module, self.mesh, api["ContextParallel"](seq_dim=SEQ_DIM, attention_type=api["FLEX"])
        )

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """This rank's output shard: K/V all-gathered, one flex call (shards in self.layout)."""
        return self.module(q, k, v)


def torch_cp_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    variant: Variant,
    *,
    group=None,
    layout: str = "contiguous",
    options: CPOptions | None = None,
    **overrides: Any,
) -> torch.Tensor:
    """PyTorch's flex CP of this rank's shards, built and run once (ring_attention's arguments).

    For repeated (timed) calls build a `TorchCP` once instead. Shards in a layout PyTorch lacks
    are resharded to zigzag and the output back (differentiably). Of `options` (or its fields as
    keywords) the kernel's apply: block_size, kernel_options, scale, compile, compile_mode;
    PyTorch's CP has its own transfers and backward (backend and backward must stay auto).

    Returns:
        (B, H, S/P, D) this rank's output shard in `layout`.
    """
    import torch.distributed as dist

    check_shards(q, k, v)
    opts = options_from(options, **overrides)
    if opts.backward != "auto" or opts.backend not in ("auto", "flex"):
        raise ValueError(
            "backward, backend: PyTorch's CP runs compiled flex and its own backward; leave them "
            f"auto (got backward={opts.backward!r}, backend={opts.backend!r})"
        )
    b, h, rows, _ = q.shape
    cp = TorchCP(
        variant,
        batch=b,
        heads=h,
        kv_heads=k.shape[1],
        seq_len=rows * dist.get_world_size(group),
        group=group,
        layout=layout,
        device=q.device,
        block_size=opts.block_size,
        kernel_options=opts.kernel_options,
        scale=opts.scale,
        compile=opts.compile,
        compile_mode=opts.compile_mode,
    )
    q, k, v = (reshard(t, layout, cp.layout, group=group, variant=variant) for t in (q, k, v))
    return reshard(cp(q, k, v), cp.layout, layout, group=group, variant=variant)
