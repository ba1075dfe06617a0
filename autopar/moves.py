"""Moving shards between placements: the collectives under emitted programs.

The lowest layer of the run time (autopar.spmd's vocabulary and
autopar.local_ops's op implementations both stand on it): the mesh an
emitted program runs on (``use_mesh``); moving a local shard from one
placement to another (``_redistribute``: local slices where nothing is sent,
then one collective of ours per mesh axis where a step is one, DTensor's
redistribute for what is left); the bucketed all-gathers and reduce-scatters
of parameters (``_gather``, ``_scatter``); sums over mesh axes with autograd;
and the process groups of several mesh axes at once (``_group_over``).
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading

import torch
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.errors import ShardingError
from autopar.cost_models.resharding import nested_inside
from autopar.passes.strategy import parse_spec


# torch 2.13 renamed these two and warns on the old names (FutureWarning, once per rank)
_all_gather = getattr(torch.distributed, "all_gather_single", None) or torch.distributed.all_gather_into_tensor
_backend_reduce_scatter = getattr(torch.distributed, "reduce_scatter_single", None) \
    or torch.distributed.reduce_scatter_tensor


def _reduce_scatter(out: torch.Tensor, flat: torch.Tensor, group, async_op: bool = False):
    """``out`` = this rank's 1/n of ``flat`` summed over ``group``. On gloo
    as one pairwise exchange (each rank sends rank j its j-th piece:
    all_to_all) and a local sum of the n pieces received: gloo's own
    reduce-scatter clones the whole buffer and all-reduces it
    (ProcessGroupGloo::reduce_scatter_tensor_coalesced, torch 2.13), twice
    the bytes and 2(n - 1) ring latencies. The cost model prices it so
    (``AxisLinks.pairwise_reduce_scatter``). ``async_op``: started; returns
    the call that finishes it."""
    if torch.distributed.get_backend(group) != "gloo":
        work = _backend_reduce_scatter(out, flat, group=group, async_op=async_op)
        return work.wait if async_op else None
    n = torch.distributed.get_world_size(group)
    pieces = torch.empty_like(flat, memory_format=torch.contiguous_format)
    work = torch.distributed.all_to_all_single(pieces, flat.contiguous(), group=group, async_op=async_op)

    def finish() -> None:
        if work is not None:
            work.wait()
        torch.sum(pieces.view(n, -1), dim=0, out=out.view(-1))
    return finish if async_op else finish()


_state = threading.local()


class _PlannedPerAxis(logging.Filter):
    """DTensor warns, on every rank, when a redistribute over several mesh axes
    runs one collective per axis. In an emitted program that is the plan: the
    cost model prices a collective per mesh axis, on that axis's link
    (cost_models/resharding.py), so the hint is dropped."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("While redistributing from")


logging.getLogger("torch.distributed.tensor._redistribute").addFilter(_PlannedPerAxis())


@contextlib.contextmanager
def _scoped(name: str, value):
    """Set ``_state.<name>`` for the duration of a ``with`` block (then restore it)."""
    prev = getattr(_state, name, None)
    setattr(_state, name, value)
    try:
        yield
    finally:
        setattr(_state, name, prev)


def use_mesh(mesh):
    """Run emitted code on ``mesh`` (a torch DeviceMesh)."""
    return _scoped("mesh", mesh)


def _mesh():
    mesh = getattr(_state, "mesh", None)
    if mesh is None:
        raise RuntimeError("autopar program called outside autopar.spmd.use_mesh(mesh)")
    return mesh


@functools.lru_cache(maxsize=None)
def _spec(text: str, ndim: int) -> tuple:
    return parse_spec(text, ndim)


@functools.lru_cache(maxsize=None)
def _move(text: str, ndim: int) -> tuple:
    """'S(0)R->RR' -> ((Shard(0), Replicate()), (Replicate(), Replicate()))."""
    src, _, dst = text.partition("->")
    return parse_spec(src.strip(), ndim), parse_spec(dst.strip(), ndim)


def _off_first(mesh, axes) -> bool:
    """Whether this rank is off coordinate 0 on any of mesh ``axes``."""
    coord = mesh.get_coordinate()
    return any(coord[a] != 0 for a in axes)


def _redistribute(local: torch.Tensor, mesh, src: tuple, dst: tuple, even: bool = False) -> torch.Tensor:
    """This rank's piece of a value placed ``src`` when it is placed ``dst``:
    local slices for R -> S, then one axis at a time, innermost first, the
    collective each step is (``_one_axis``), and DTensor's redistribute for
    what is left (S -> S, S -> P, pieces that nest otherwise: the same
    pieces, more Python per call). A gather is one collective of ours only
    where the caller knows that the pieces are ``even`` (a rank's own piece
    cannot tell: every rank must choose the same way). A Partial (sum) made from a value
    that was not one keeps the value on coordinate 0 of that axis and zeros
    elsewhere (DTensor makes Partials only inside its own ops)."""
    if src == dst:
        return local
    zero = [a for a, (s, d) in enumerate(zip(src, dst)) if isinstance(d, Partial) and not isinstance(s, Partial)]
    via = tuple(Replicate() if a in zero else d for a, d in enumerate(dst))
    local, src = _slice(local, mesh, src, via)
    while via != src:  # one axis at a time, the last (innermost) first, where that is one collective
        for a in reversed(range(len(src))):
            step = tuple(via[b] if b == a else p for b, p in enumerate(src))
            direct = _one_axis(local, mesh, src, step, even) if step != src else None
            if direct is not None:
                local, src = direct, step
                break
        else:
            dt = DTensor.from_local(local, mesh, src, run_check=False)
            local, src = _waited(dt.redistribute(mesh, via).to_local()), via
    if zero and _off_first(mesh, zero):
        local = torch.zeros_like(local)
    return local


def _slice(local: torch.Tensor, mesh, src: tuple, dst: tuple) -> tuple:
    """The R -> S(d) steps of a move done here, as views of ``local`` (no
    communication), where they give DTensor's pieces: a dim split over
    several axes is cut with the first axis outermost, so a step is taken
    only where every other axis that splits the dim comes first and keeps
    it. Returns the local value and its placements after them."""
    coord = mesh.get_coordinate()
    if any(type(c) is not int for c in coord):  # simulated ranks (LocalTensorMode): DTensor's own split
        return local, src
    src = list(src)
    for a, (s, d) in enumerate(zip(src, dst)):
        if isinstance(s, Replicate) and isinstance(d, Shard) and all(
                b < a and dst[b] == p for b, p in enumerate(src) if isinstance(p, Shard) and p.dim == d.dim):
            local = local.chunk(mesh.size(a), dim=d.dim)[coord[a]]
            src[a] = d
    return local, tuple(src)


def _one_axis(local: torch.Tensor, mesh, src: tuple, dst: tuple, even: bool = False) -> torch.Tensor | None:
    """A move on one mesh axis as the one collective it is, called directly
    (DTensor's redistribute costs more in Python than a small collective
    on the wire): S(d) -> R an all-gather (pieces ``even``), P -> R an
    all-reduce, P -> S(d) a reduce-scatter (dim d divides). The pieces are
    DTensor's where every other axis that splits dim d comes first (it cuts
    the dim outside this one; ``_nested`` where one comes after). None: not
    such a move."""
    changed = [a for a, (s, d) in enumerate(zip(src, dst)) if s != d]
    if len(changed) != 1 or any(type(c) is not int for c in mesh.get_coordinate()):
        return None
    a = changed[0]
    s, d = src[a], dst[a]
    if isinstance(s, Partial) and s.reduce_op != "sum":
        return None
    if (isinstance(s, Shard) and not even) or (isinstance(d, Shard) and local.shape[d.dim] % mesh.size(a)):
        return None
    shard = s if isinstance(s, Shard) else d if isinstance(d, Shard) else None
    if shard is not None and any(isinstance(p, Shard) and p.dim == shard.dim and b > a for b, p in enumerate(src)):
        # the dim is cut inside this axis's pieces too: they nest
        b = nested_inside(src, a, shard.dim, mesh.shape)
        return None if b is None else _nested(local, mesh, a, b, s, d)
    if isinstance(s, Shard) and isinstance(d, Replicate):
        return _gather((local,), mesh, a, (s.dim,))[0]
    if isinstance(s, Partial) and isinstance(d, Replicate):
        out = local.clone(memory_format=torch.contiguous_format)
        torch.distributed.all_reduce(out, group=mesh.get_group(a))
        return out
    if isinstance(s, Partial) and isinstance(d, Shard):
        piece = local.chunk(mesh.size(a), dim=d.dim)[0]
        return _scatter((local,), mesh, a, (d.dim,), [piece.shape])[0]
    return None


def _nested(local: torch.Tensor, mesh, a: int, b: int, s, d) -> torch.Tensor | None:
    """S(d) -> R, or P -> S(d), on axis ``a`` of a dim that a later axis
    ``b`` splits too, of the same size n. With a outermost, rank (i, j) of
    (a, b) holds piece i*n + j of the dim (DTensor's order); R on a and S(d)
    on b is chunk j, pieces j*n .. j*n + n-1. So an all-gather over a
    (pieces k*n + j, k < n) and an all-to-all over b that sends the k-th to
    rank k of b; in backward, the all-to-all first, then a reduce-scatter
    over a (``resharding.nested_inside`` names b and prices the all-to-all).
    None where that is not the move (DTensor's redistribute)."""
    n = mesh.size(a)
    if isinstance(s, Shard) and isinstance(d, Replicate):
        gathered = local.new_empty(n * local.numel())
        _all_gather(gathered, local.reshape(-1), group=mesh.get_group(a))
        mine = torch.empty_like(gathered)
        torch.distributed.all_to_all_single(mine, gathered, group=mesh.get_group(b))
        return torch.cat(mine.view(n, *local.shape).unbind(0), dim=s.dim)
    if isinstance(s, Partial) and isinstance(d, Shard):
        rows = torch.stack(local.chunk(n, dim=d.dim)).contiguous()
        routed = torch.empty_like(rows, memory_format=torch.contiguous_format)
        torch.distributed.all_to_all_single(routed.view(-1), rows.view(-1), group=mesh.get_group(b))
        out = rows.new_empty(rows[0].numel())
        _reduce_scatter(out, routed.view(-1), group=mesh.get_group(a))
        return out.view(rows.shape[1:])
    return None


def _all_reduce(t: torch.Tensor, mesh, axes) -> torch.Tensor:
    """Sum ``t`` in place over mesh ``axes`` (one group for all of them where one exists)."""
    if len(axes) == mesh.ndim and mesh.size() == torch.distributed.get_world_size():
        torch.distributed.all_reduce(t)
        return t
    for a in axes:
        torch.distributed.all_reduce(t, group=mesh.get_group(a))
    return t


class _SumOver(torch.autograd.Function):
    """Sum over mesh axes (an all-reduce); each rank's input is a summand, so
    its gradient is the sum's gradient summed over the ranks that read it."""

    @staticmethod
    def forward(ctx, t, mesh, axes):
        ctx.mesh, ctx.axes = mesh, axes
        return _all_reduce(t.clone(), mesh, axes)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.mesh, ctx.axes), None, None


class _GatherOver(torch.autograd.Function):
    """Every rank's ``t`` stacked (one all-gather over ``group``); in
    backward each rank's share of the gradient, summed over the ranks that
    read it (one reduce-scatter)."""

    @staticmethod
    def forward(ctx, t, group):
        ctx.group = group
        n = torch.distributed.get_world_size(group)
        out = t.new_empty(n * t.numel())
        _all_gather(out, t.reshape(-1), group=group)
        return out.view(n, *t.shape)

    @staticmethod
    def backward(ctx, grad):
        mine = grad.new_empty(grad[0].numel())
        _reduce_scatter(mine, grad.reshape(-1), group=ctx.group)
        return mine.view(grad.shape[1:]), None


def _reduce_over(t: torch.Tensor, mesh, axes: list) -> torch.Tensor:
    """Sum of ``t`` over the ranks of mesh ``axes``, with autograd."""
    return _SumOver.apply(t, mesh, tuple(axes))


def _gather(shards, mesh, axis: int, dims, async_op: bool = False):
    """Each of ``shards`` gathered over mesh ``axis`` on its dim in ``dims``:
    one all-gather (``async_op``: started; returns the call that finishes it)."""
    n = mesh.size(axis)
    flat = torch.cat([s.reshape(-1) for s in shards]) if len(shards) > 1 else shards[0].reshape(-1)
    out = flat.new_empty(n * flat.numel())
    work = _all_gather(out, flat, group=mesh.get_group(axis), async_op=async_op)

    def finish() -> tuple:
        if work is not None:
            work.wait()
        parts, fulls, offset = out.view(n, -1), [], 0
        for s, d in zip(shards, dims):
            pieces = parts[:, offset:offset + s.numel()].reshape(n, *s.shape)
            # on dim 0 the pieces stack as they lie (a view of the buffer where it holds one tensor)
            fulls.append(pieces.reshape(n * s.shape[0], *s.shape[1:]) if d == 0 else torch.cat(pieces.unbind(0), dim=d))
            offset += s.numel()
        return tuple(fulls)
    return finish if async_op else finish()


def _scatter(grads, mesh, axis: int, dims, shapes, whole: bool = False, async_op: bool = False):
    """``_gather``'s backward: each rank's piece of the sum of ``grads`` over
    mesh ``axis``, shaped ``shapes``: one reduce-scatter (``whole``: every
    rank has the sum already; its piece). ``async_op``: the reduce-scatter
    started; returns the call that finishes it and gives the pieces."""
    n = mesh.size(axis)
    if whole:
        mine = mesh.get_local_rank(axis)
        pieces = tuple(g.chunk(n, dim=d)[mine].contiguous().view(shape) for g, d, shape in zip(grads, dims, shapes))
        return (lambda: pieces) if async_op else pieces
    # rank r's row: its piece of every gradient, so that a reduce-scatter leaves each rank its own
    blocks = [torch.stack([c.reshape(-1) for c in g.chunk(n, dim=d)]) for g, d in zip(grads, dims)]
    rows = torch.cat(blocks, dim=1) if len(blocks) > 1 else blocks[0]
    mine = rows.new_empty(rows.shape[1])
    started = _reduce_scatter(mine, rows.reshape(-1), group=mesh.get_group(axis), async_op=async_op)

    def finish() -> tuple:
        if started is not None:
            started()
        out, offset = [], 0
        for shape in shapes:
            k = math.prod(shape)
            out.append(mine[offset:offset + k].view(shape))
            offset += k
        return tuple(out)
    return finish if async_op else finish()


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, once an in-flight functional collective producing it has finished."""
    return t.wait() if hasattr(t, "wait") else t


def _recomputing() -> bool:
    """Whether ops run again in backward (the second run of a checkpoint)."""
    return bool(getattr(_state, "recomputing", False))


_GROUPS: dict = {}


def _group_over(mesh, axes: tuple):
    """The process group of the ranks that differ only in mesh ``axes``,
    numbered as a dim split over those axes numbers its pieces (the first
    axis outermost): the axis's own group, or the mesh's flattening of them
    (made once per mesh, by every rank at the same point of the program)."""
    if len(axes) == 1:
        return mesh.get_group(axes[0])
    if len(axes) == mesh.ndim and mesh.size() == torch.distributed.get_world_size():
        return torch.distributed.group.WORLD
    key = (mesh, axes)
    if key not in _GROUPS:
        if not mesh.mesh_dim_names:
            raise ShardingError(f"a collective over mesh axes {axes} of a mesh without axis names: "
                                "name the mesh's axes (init_device_mesh(..., mesh_dim_names=...))")
        names = tuple(mesh.mesh_dim_names[a] for a in axes)
        _GROUPS[key] = mesh[names]._flatten("_".join(names)).get_group()
    return _GROUPS[key]
