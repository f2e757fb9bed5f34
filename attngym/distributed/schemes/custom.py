"""Your own context-parallel scheme, by import path: the `custom` topology.

    attngym topology=custom topology.scheme=mycp.my_allgather
    attngym topology=custom topology.scheme=mycp.make_ring topology.scheme_args.hops=2

The contract (the README states it for users): `topology.scheme` names a function, called on
every rank as the built-in schemes are,

    scheme(q, k, v, variant, *, group, layout, **kwargs) -> this rank's output shard

with this rank's shards q (B, H, S/P, D) and k, v (B, G, S/P, D) in `layout` (an
attngym.distributed.placement.layout.Layout: `layout.chunks(rank)` are a rank's (global offset,
length) chunks), the run's Variant (evaluated at global positions) and the process group of the P
ranks; it returns (B, H, S/P, D) in q's dtype, and its backward is autograd's through what it
calls. It also gets, where it names them (or takes **kwargs): `transport` (the run's transport
name, for attngym.distributed's transports), `options` (the run's CPOptions: the kernel choices
to pass to `attend_chunk`) and `stats` (a CPStats it may fill). With `topology.scheme_args` the
path names a factory called with them, returning the function. A module-level
`TopologySpec` may be named instead: it then also states its layouts, rules, and how its ranks
are simulated and priced (`simulate`, `price`), which `topology.simulate=true` needs.

The path is resolved on every rank (attngym.user_code), so the scheme must be importable there:
an object that lives only in this process (attngym.run with a notebook's function) is refused
before any rank starts. Before the ranks start, the scheme also runs once on a probe (one CPU
rank of a gloo group, a small causal problem, forward and backward), so a wrong signature, output
shape or dtype, or an output without a backward fails in one line naming topology.scheme.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping
from typing import Any

from attngym import user_code
from attngym.distributed.placement.layout import LAYOUTS
from attngym.distributed.schemes.spec import TopologySpec
from attngym.errors import CODE_ERRORS, ConfigError, Interrupted

KEY = "topology.scheme"
ARGS_KEY = "topology.scheme_args"
# What attngym passes by keyword beside group and layout, to a scheme that names it.
OPTIONAL = ("transport", "options", "stats")
# The probe: a small causal problem on one CPU rank.
PROBE_SHAPE = dict(batch=1, heads=2, kv_heads=1, seq_len=64, head_dim=16)


def _unbound(*args: Any, **kwargs: Any) -> Any:
    raise RuntimeError("topology=custom runs the scheme named by topology.scheme (bind it first)")


def _keywords(fn: Callable[..., Any], path: str) -> tuple[str, ...]:
    """The optional keywords `fn` takes; ConfigError when it cannot take the contract's
    arguments (four positional, group and layout by keyword)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return OPTIONAL  # a builtin or extension: judged by the probe
    open_keywords = any(p.kind == p.VAR_KEYWORD for p in params)
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    varargs = any(p.kind == p.VAR_POSITIONAL for p in params)
    required = [p.name for p in positional if p.default is p.empty]
    if len(required) > 4 or (len(positional) < 4 and not varargs):
        raise ConfigError(
            KEY,
            f"{path} takes ({', '.join(p.name for p in positional)}) positionally; a scheme "
            "takes (q, k, v, variant, *, group, layout, **kwargs)",
        )
    names = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    for needed in ("group", "layout"):
        if needed not in names and not open_keywords:
            raise ConfigError(
                KEY,
                f"{path} takes no keyword {needed!r}; a scheme takes (q, k, v, variant, *, "
                "group, layout, **kwargs)",
            )
    unknown = [
        p.name
        for p in params
        if p.kind == p.KEYWORD_ONLY
        and p.default is p.empty
        and p.name not in (*OPTIONAL, "group", "layout")
    ]
    if unknown:
        raise ConfigError(
            KEY,
            f"{path} requires keyword {unknown[0]!r}, which attngym does not pass (it passes "
            f"group, layout, {', '.join(OPTIONAL[:-1])} and {OPTIONAL[-1]}); give it a default, "
            f"or bind it with a factory and {ARGS_KEY}",
        )
    return tuple(k for k in OPTIONAL if open_keywords or k in names)


@dataclasses.dataclass(frozen=True)
class UserScheme:
    """A user's scheme function as a TopologySpec's `attention`: the contract's arguments in,
    its output's shape and dtype checked on the way out."""

    fn: Callable[..., Any]
    path: str
    keywords: tuple[str, ...]

    def __call__(self, q, k, v, variant, *, group=None, layout="contiguous", **given: Any):
        import torch
        import torch.distributed as dist

        from attngym.distributed.placement import layout as layouts

        group = dist.group.WORLD if group is None else group
        world_size = dist.get_world_size(group)
        placed = layouts.resolve(layout, world_size, q.shape[2] * world_size, variant, q.device)
        extra = {name: given[name] for name in self.keywords if name in given}
        out = self.fn(q, k, v, variant, group=group, layout=placed, **extra)
        want = (*q.shape[:3], v.shape[-1])
        if not isinstance(out, torch.Tensor) or tuple(out.shape) != want or out.dtype != q.dtype:
            got = (
                f"{tuple(out.shape)} {out.dtype}"
                if isinstance(out, torch.Tensor)
                else type(out).__name__
            )
            raise ConfigError(
                KEY,
                f"{self.path} returned {got}; a scheme returns this rank's output shard "
                f"{want} {q.dtype}",
            )
        return out


def bind_scheme(scheme: Any, scheme_args: Mapping[str, Any]) -> TopologySpec:
    """The TopologySpec of the scheme `scheme` names (a function, a factory called with
    `scheme_args`, or a TopologySpec); ConfigError naming topology.scheme(_args) otherwise."""
    if scheme is None:
        raise ConfigError(
            KEY, "topology=custom runs your scheme: set topology.scheme=module.function"
        )
    key = (scheme, repr(sorted(scheme_args.items())))
    if key not in _BOUND:
        _BOUND[key] = _bound(scheme, scheme_args)
    return _BOUND[key]


# (path, its arguments) -> TopologySpec: a path is imported and a factory called once a process.
_BOUND: dict[tuple[str, str], TopologySpec] = {}


def _bound(path: str, args: Mapping[str, Any]) -> TopologySpec:
    obj = user_code.resolve(path, key=KEY)
    if args:
        user_code.check_factory(obj, kind="scheme", path=path, key=KEY)
        obj = user_code.call_factory(obj, args, path=path, key=ARGS_KEY, device=None)
    if isinstance(obj, TopologySpec):
        if obj.binder is not None:
            raise ConfigError(KEY, f"{path} is the custom topology itself; name your scheme")
        return obj
    if not callable(obj):
        raise ConfigError(
            KEY,
            f"{path} is not callable ({type(obj).__name__}): name a scheme function or a "
            "TopologySpec",
        )
    return TopologySpec(
        name="custom",
        attention=UserScheme(obj, path, _keywords(obj, path)),
        layouts=LAYOUTS,
        user_layouts=True,
        fills_stats=False,
    )


def probe(spec: TopologySpec, path: str) -> None:
    """Run the scheme once, forward and backward, on one CPU rank of a gloo group with a small
    causal problem; ConfigError naming topology.scheme for what it raises or returns wrong.
    Skipped where this process already is a rank (torchrun, a SLURM step): the ranks judge it."""
    import torch
    import torch.distributed as dist

    from attngym import variants
    from attngym.distributed.call.cp import CPOptions, CPStats

    if dist.is_initialized():
        return
    shape = PROBE_SHAPE
    generator = torch.Generator().manual_seed(0)
    q, k, v = (
        torch.randn(shape["batch"], heads, shape["seq_len"], shape["head_dim"],
                    generator=generator).requires_grad_()
        for heads in (shape["heads"], shape["kv_heads"], shape["kv_heads"])
    )  # fmt: skip
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        out = spec.attention(
            q, k, v, variants.get("causal"), group=dist.group.WORLD, layout="contiguous",
            transport="gloo", options=CPOptions(block_size=(16, 16)), stats=CPStats(),
        )  # fmt: skip
        if not out.requires_grad:
            raise ConfigError(
                KEY, f"{path} returned an output with no backward (autograd reaches no q, k, v)"
            )
        out.sum().backward()
    except (ConfigError, Interrupted):
        raise
    except CODE_ERRORS as err:
        raise ConfigError(
            KEY, f"{path} failed on a probe (one CPU rank, causal, S=64): {user_code.raised(err)}"
        ) from err
    finally:
        dist.destroy_process_group()


CUSTOM = TopologySpec(
    name="custom", attention=_unbound, layouts=LAYOUTS, user_layouts=True, binder=bind_scheme
)
