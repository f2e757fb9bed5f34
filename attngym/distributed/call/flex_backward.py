"""One chunk pair's gradient from the merged (global) out and lse, through flex's backward op.

Context-parallel attention merges per-pair partials into the rank's (out, lse). The gradient of
the merged output with respect to one pair's q, k, v is flex's own backward of that pair evaluated
with the *global* statistics: P = exp(s - lse) is the pair's block of the global softmax, and
D = rowsum(dO * O) uses the global out. So the backward needs neither a forward re-run nor a
gradient through the pair's lse (ring-flash-attention and TransformerEngine do the same with
FlashAttention's backward).

PyTorch exposes that kernel as the higher-order op
`torch._higher_order_ops.flex_attention.flex_attention_backward`, the op compiled flex lowers to:

    flex_attention_backward(q, k, v, out, lse2, grad_out, grad_lse, fw_graph, joint_graph,
                            block_mask_tuple, scale, kernel_options,
                            score_mod_other_buffers, mask_mod_other_buffers) -> dq, dk, dv, grads

Facts it depends on (read in the torch 2.11.0 and 2.13.0 sources; the eager path run on 2.13):
    * lse2 is in base 2 for flex's Triton kernels (the public API multiplies the op's lse by ln 2),
      so the merged natural-base lse is divided by ln 2. FLASH's op returns a natural-base lse
      (2.13 skips the ln 2 for it; 2.11 multiplies it anyway, which attngym.kernels undoes), so for
      BACKEND=FLASH the lse is passed as it is. grad_lse is None: FLASH's backward refuses one.
    * block_mask_tuple is `BlockMask.as_tuple()` with the mask graph last; its length differs
      (13 entries on 2.11, 17 on 2.13), so it is always taken from the installed BlockMask.
    * fw_graph / joint_graph / mask graph: traced GraphModules. The score and mask callbacks take
      the chunk offsets and the variant's buffers as explicit inputs (`*_other_buffers`), so one
      compiled kernel serves every chunk pair (the offsets are 0-d tensors, as in kernels.py;
      under FLASH position tables, kernels.offsets_as_tables).
      The joint graph comes from torch's `create_fw_bw_graph`, as the autograd path makes it;
      2.11's eager op needs it (2.13 would derive it from None).
    * Eager (CPU, or compile=False): the op runs `sdpa_dense_backward`, a dense implementation in
      float64 for float64 inputs (so CPU tests check this path exactly).
    * Compiled (CUDA): a function calling the op under torch.compile. Dynamo on 2.11 accepts the
      op only with pre-traced graphs reached through a dict of dicts (the source of each graph
      must be `d[name][name]`); 2.13 accepts that too. Dynamo guards a GraphModule by its type,
      which is unique per instance, so each variant's graphs compile once and are reused; variants
      whose graphs trace to the same code share them (a workload's batches). Dynamo
      marks a graph it installs as static (`torchdynamo_force_dynamic = False`), which would make
      the next trace of the same graph fail; the flag is reset before each call.
"""

from __future__ import annotations

import functools
import logging
import math
import weakref

import torch

from attngym import kernels
from attngym.variants.base import Variant

log = logging.getLogger(__name__)

_FAILED: list[str] = []  # the reason flex's backward failed under backward=auto (then recompute)
_LOGGED: set[str] = set()


def available() -> tuple[bool, str]:
    """(True, "") when this PyTorch has the flex backward op and the helpers it needs."""
    try:
        from torch._higher_order_ops.flex_attention import (  # noqa: F401
            create_fw_bw_graph,
            flex_attention_backward,
        )
        from torch.nn.attention.flex_attention import _apply_kernel_options  # noqa: F401
    except ImportError as exc:
        return False, f"torch {torch.__version__} has no flex_attention_backward op ({exc})"
    return True, ""


def failed_before() -> bool:
    """Whether the flex backward failed earlier in this process under backward=auto."""
    return bool(_FAILED)


def log_once(message: str) -> None:
    if message not in _LOGGED:
        _LOGGED.add(message)
        log.info(message)


class _Graphs:
    """The traced score, joint and mask graphs of one variant for one dtype and device.

    shift: "offsets": the callbacks take the chunk offsets as inputs (every pair of a CP call);
    (Sq, Skv): they take position tables of these lengths instead, as the forward's do under
    FLASH (kernels.offsets_as_tables); None: the variant's own, as the forward's for a pair at
    offset 0 (an added 0 still costs a load and an add per score, in both loops of the backward).
    """

    def __init__(self, variant: Variant, dtype: torch.dtype, device: torch.device, shift):
        from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
        from torch._higher_order_ops.flex_attention import create_fw_bw_graph
        from torch.fx.experimental.proxy_tensor import make_fx

        names = sorted(variant.buffers)
        self.buffers = tuple(variant.buffers[n] for n in names)

        def mods(buffers):
            if not names:
                return variant.score_mod, variant.mask_mod
            return variant.bind(dict(zip(names, buffers, strict=True)))

        def moved(m, n, extra):
            """(global q, global kv, the variant's buffers) from the local indices."""
            if shift is None:
                return m, n, extra
            if shift == "offsets":
                return m + extra[0], n + extra[1], extra[2:]
            return extra[0][m], extra[1][n], extra[2:]

        def score_graph(score, b, h, m, n, *extra):
            m, n, buffers = moved(m, n, extra)
            score_mod, _ = mods(buffers)
            return score if score_mod is None else score_mod(score, b, h, m, n)

        def mask_graph(b, h, m, n, *extra):
            m, n, buffers = moved(m, n, extra)
            _, mask_mod = mods(buffers)
            if mask_mod is None:
                return b.new_ones((), dtype=torch.bool)
            return mask_mod(b, h, m, n)

        def idx():
            return torch.zeros((), dtype=torch.int32, device=device)

        # Distinct tensors for the two maps: make_fx maps one tensor object to one input. The
        # graphs only index the tables, so int64 examples serve the int32 tables the calls pass
        # (the op runs, or lowers, the graphs on the real inputs).
        sizes = [(), ()] if shift == "offsets" else [(n,) for n in shift or ()]
        maps = tuple(torch.zeros(size, dtype=torch.int64, device=device) for size in sizes)
        extra = (*maps, *self.buffers)
        with TransformGetItemToIndex():
            self.fw = make_fx(score_graph)(
                torch.zeros((), dtype=dtype, device=device), idx(), idx(), idx(), idx(), *extra
            )
            self.mask = make_fx(mask_graph)(idx(), idx(), idx(), idx(), *extra)
        example = (
            torch.zeros((), dtype=dtype, device=device, requires_grad=True),
            idx(),
            idx(),
            idx(),
            idx(),
        )
        with torch.enable_grad():  # a backward runs without grad mode: the joint needs it
            _, self.joint = create_fw_bw_graph(self.fw, example, extra)
        # The form Dynamo accepts for pre-traced graphs: each reached as d[name][name].
        self.nested = {
            n: {n: g}
            for n, g in (
                ("fw_graph", self.fw),
                ("joint_graph", self.joint),
                ("mask_graph", self.mask),
            )
        }

    def code(self) -> tuple[str, ...] | None:
        """The graphs' Python code, which says all they compute when every tensor they read is
        an input (the variant's buffers are); None when a graph holds a tensor of its own (a
        constant the code does not show), so it is shared with no other."""
        graphs = (self.fw, self.joint, self.mask)
        if any(node.op == "get_attr" for g in graphs for node in g.graph.nodes):
            return None
        return tuple(g.code for g in graphs)

    def share(self, alike: _Graphs) -> None:
        """Call `alike`'s graphs (the same code) with this variant's buffers."""
        self.fw, self.joint, self.mask = alike.fw, alike.joint, alike.mask
        self.nested = alike.nested

    def ready_for_dynamo(self) -> None:
        """Undo the static mark Dynamo puts on graphs it installed (see the module docstring)."""
        for g in (self.fw, self.joint, self.mask):
            g.torchdynamo_force_dynamic = True


# Variant -> {(dtype, device, shift): _Graphs}; weak keys, as the pair plans in pairs.py.
_GRAPHS: weakref.WeakKeyDictionary[Variant, dict[tuple, _Graphs]] = weakref.WeakKeyDictionary()


# (dtype, device, shift, the graphs' code) -> the graphs first traced so: variants whose graphs
# trace alike (a workload's batches: new documents, the same mask code) share one set of
# GraphModules, so Dynamo's guard on their type lets them reuse what the first one compiled.
_ALIKE: dict[tuple, _Graphs] = {}


def _graphs(variant: Variant, dtype: torch.dtype, device: torch.device, shift) -> _Graphs:
    per = _GRAPHS.setdefault(variant, {})
    key = (dtype, device, shift)
    if key not in per:
        made = _Graphs(variant, dtype, device, shift)
        code = made.code()
        if code is not None:
            made.share(_ALIKE.setdefault((*key, code), made))
        per[key] = made
    return per[key]


def _call_op(q, k, v, out, lse2, dout, graphs, block, scale, kernel_options, buffers):
    """The op itself (eager, or traced by torch.compile): (dq, dk, dv)."""
    from torch._higher_order_ops.flex_attention import flex_attention_backward

    dq, dk, dv, _ = flex_attention_backward(
        q,
        k,
        v,
        out,
        lse2,
        dout,
        None,
        graphs["fw_graph"]["fw_graph"],
        graphs["joint_graph"]["joint_graph"],
        (*block, graphs["mask_graph"]["mask_graph"]),
        scale,
        kernel_options,
        buffers,
        buffers,
    )
    return dq, dk, dv


@functools.cache
def _compiled(mode: str):
    kernels.raise_recompile_limits()
    return torch.compile(
        _call_op, dynamic=False, fullgraph=True, mode=None if mode == "default" else mode
    )


def attend_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    variant: Variant,
    *,
    q_offset: int,
    kv_offset: int,
    block_mask,
    scale: float | None = None,
    kernel_options=None,
    compile: bool = True,
    compile_mode: str = "default",
    lse2: torch.Tensor | None = None,
    q_positions: torch.Tensor | None = None,
    kv_positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients of one (q chunk, kv chunk) pair given the merged statistics of its q rows.

    Args:
        q: (B, H, Sq, D) query chunk, tokens q_offset ..; k, v: (B, G, Skv, D), tokens kv_offset ..
        out, dout: (B, H, Sq, D) merged output of these rows and its gradient (q's dtype).
        lse: (B, H, Sq) merged log-sum-exp, natural base (any float dtype).
        variant: evaluated at global positions; its buffers on q's device.
        block_mask: the pair's BlockMask (attngym.kernels.make_block_mask, full when unmasked).
        compile: compile the op on CUDA (False, or CPU: the op's dense eager implementation).
        lse2: `kernel_lse(lse, kernel_options, q.dtype)` when the caller has it already (one
            conversion for every pair of a backward), any strides; computed from lse when None.
        q_positions, kv_positions: the global position of each query row and key (int32, as
            position_table's) where they are not one run at an offset: the rows of several
            chunks (a ring step over a rank's whole shard, the all-gather's keys); the other
            side, if None, is its offset's run. The graphs then read both through tables.

    Returns:
        dq (B, H, Sq, D), dk, dv (B, G, Skv, D), in q's dtype: this pair's share of the gradient.
    """
    graphs, args = op_args(
        q, k, v, out, lse, dout, variant, q_offset=q_offset, kv_offset=kv_offset,
        block_mask=block_mask, scale=scale, kernel_options=kernel_options, lse2=lse2,
        q_positions=q_positions, kv_positions=kv_positions,
    )  # fmt: skip
    if compile and q.device.type == "cuda":
        graphs.ready_for_dynamo()
        return _compiled(compile_mode)(*args)
    return _call_op(*args)


def kernel_lse(lse: torch.Tensor, kernel_options, dtype: torch.dtype) -> torch.Tensor:
    """The merged natural-base lse in the base and dtype the op reads for inputs of `dtype`:
    base 2 for flex's Triton kernels, as is for FLASH (module docstring)."""
    work = torch.float64 if dtype == torch.float64 else torch.float32
    return lse.to(work) if kernels.is_flash(kernel_options) else lse.to(work) * (1 / math.log(2))


def op_args(
    q,
    k,
    v,
    out,
    lse,
    dout,
    variant,
    *,
    q_offset,
    kv_offset,
    block_mask,
    scale,
    kernel_options,
    lse2=None,
    q_positions=None,
    kv_positions=None,
) -> tuple[_Graphs, tuple]:
    """The variant's graphs and the arguments of `_call_op` for one pair (see attend_backward)."""
    from torch.nn.attention.flex_attention import _apply_kernel_options

    given = q_positions is not None or kv_positions is not None
    shift = None  # as the pair's forward moves its indices (kernels.shifted_mods)
    if given or not kernels.at_origin(q_offset, kv_offset):
        tables = given or kernels.offsets_as_tables(kernel_options)
        shift = (q.shape[2], k.shape[2]) if tables else "offsets"
    graphs = _graphs(variant, q.dtype, q.device, shift)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    options = _apply_kernel_options(q, k, v, True, dict(kernel_options) if kernel_options else None)
    if lse2 is None:
        lse2 = kernel_lse(lse, kernel_options, q.dtype)
    buffers = graphs.buffers
    if shift == "offsets":
        maps = kernels.position(q_offset, q.device), kernels.position(kv_offset, q.device, "kv")
        buffers = (*maps, *buffers)
    elif shift is not None:
        maps = (
            kernels.position_table(q_offset, shift[0], q.device, "q")
            if q_positions is None
            else q_positions,
            kernels.position_table(kv_offset, shift[1], q.device, "kv")
            if kv_positions is None
            else kv_positions,
        )
        buffers = (*maps, *buffers)
    block = block_mask.as_tuple()[:-1]
    # The op has no autograd of its own: inputs that require grad would dispatch it wrongly.
    q, k, v, out, dout = (t.detach() for t in (q, k, v, out.to(q.dtype), dout.to(q.dtype)))
    return graphs, (
        q,
        k,
        v,
        out,
        # flex's Triton kernels read the lse as (B·H, rows) whatever its strides: a row slice of
        # a longer lse (a call over some of a shard's rows) gave them other rows' values
        lse2.detach().contiguous(),
        dout,
        graphs.nested,
        block,
        scale,
        options,
        buffers,
    )


def grads(
    call, q, k, v, out, lse, dout, block_mask, *, q_offset=0, kv_offset=0, lse2=None,
    q_positions=None, kv_positions=None, variant=None,
) -> tuple | None:  # fmt: skip
    """(dq, dk, dv) of one call of a CP scheme (cp.CPCall `call`, its options; `variant` where
    the call's is read otherwise, a folded call's) from its merged out and lse (attend_backward's
    arguments); None when flex failed under backward=auto.

    An explicit backward='flex', or any FLASH backward, never falls back: its failure propagates.
    """
    opts = call.options
    fallback = opts.backward == "auto" and not kernels.is_flash(opts.kernel_options)
    if _FAILED and fallback:
        return None
    try:
        return attend_backward(
            q, k, v, out, lse, dout, call.variant if variant is None else variant,
            q_offset=q_offset, kv_offset=kv_offset,
            block_mask=block_mask, scale=opts.scale, kernel_options=opts.kernel_options,
            compile=opts.compile, compile_mode=opts.compile_mode, lse2=lse2,
            q_positions=q_positions, kv_positions=kv_positions,
        )  # fmt: skip
    except Exception as exc:  # noqa: BLE001  (auto only: any failure of the op means recompute)
        if not fallback:
            raise
        _FAILED.append(f"{type(exc).__name__}: {exc}")
        log.warning(
            "backward=auto: flex's backward op failed (%s); re-running forwards instead for "
            "the rest of this process",
            _FAILED[0][:300],
        )
        return None


def pair_grads(call, saved, q_rows, k_i, v_i, qc, kc, block_mask) -> tuple | None:
    """One pair's (dq, dk, dv) for pairs.backward_pairs: `grads` over the pair's rows of `saved`."""
    return grads(
        call, saved.q[:, :, q_rows], k_i, v_i, saved.out[:, :, q_rows], saved.lse[:, :, q_rows],
        saved.dout[:, :, q_rows], block_mask, q_offset=qc[0], kv_offset=kc[0],
        lse2=None if saved.lse2 is None else saved.lse2.get((q_rows.start, q_rows.stop)),
    )  # fmt: skip
