"""The run-time vocabulary of emitted programs.

Every per-rank program autopar writes computes on plain local tensors, this
rank's shards, with ATen ops called as they are, and calls these functions
where the plan needs more. Codegen knows every value's placements (the
plan), so the program carries no placement metadata at run time:

* ``reshard(x, "S(0)->R", "P->S(0)")`` moves a value to the placements its
  consumer's strategy wants (the all-gather / all-reduce / reduce-scatter /
  all-to-all the plan lists for that edge, DTensor's collectives), and in
  backward moves its gradient as the second spec says;
* ``op`` runs an op that needs to know its shard (an embedding over a split
  vocabulary, a batch norm over a split batch, a random op, a mean loss);
* the gradient of an input that is replicated over a mesh axis its consumer
  splits comes back a partial sum over that axis. Where a value has such
  uses, codegen sums its gradient where the value is made
  (``grad_allreduce``, or within the ``reshard`` that made it), and a use
  that gives the whole gradient on every rank passes it on coordinate 0 of
  the axis only (``grad_share``), so that the uses add up. Parameters leave
  that sum to ``gradsync.GradSync`` (DDP's bucketed all-reduces, during backward).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
import weakref
import zlib
from dataclasses import dataclass, field

import torch
import torch.nn.attention.bias
import torch.utils.checkpoint
from torch.utils._pytree import tree_map
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.errors import ShardingError
from autopar.cost_models.resharding import nested_inside, producer_grad_spec
from autopar.passes.rules.attention import zigzag_axes
from autopar.passes.rules.experts import dispatch_axes
from autopar.passes.rules.indexing import routed_axes
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


def param(local: torch.Tensor, spec: str, axes: tuple) -> torch.Tensor:
    """A parameter's local shard (placed ``spec``), as it is. Its gradient
    arrives as a partial sum over the mesh ``axes`` (some of those that
    replicate it: where its uses split their work; codegen adds
    ``grad_share`` where another use gives the whole gradient there); the
    reduction over them is left to the step's ``gradsync.GradSync`` (bucketed
    all-reduces launched during backward) or, in a pipeline step, to
    ``gradsync.GradAccumulation``; without either it happens here, in backward. On
    the other axes that replicate it every rank has the whole gradient; the
    axes that shard it need nothing here: a gather of it (``reshard``)
    reduce-scatters its gradient back."""
    if not (torch.is_grad_enabled() and local.requires_grad):
        return local
    mesh = _mesh()
    acc = getattr(_state, "accumulation", None)
    sync = getattr(_state, "grad_sync", None) if acc is None else None
    if (sync is None or not axes) and getattr(local, "_autopar_sync", None) is not None:
        # reduced another way now, or not at all (its gradient whole on every rank): not by an earlier
        # step's GradSync, which would sum it again (a dynamic plan's piece that runs its ops whole)
        local._autopar_sync = None
    placements = _spec(spec, mesh.ndim)
    if any(not isinstance(placements[a], Replicate) for a in axes):
        raise ValueError(f"a parameter placed {spec} is summed over mesh axes {axes}: only axes that replicate it")
    if acc is not None:  # (with no axes too: ZeRO-1 takes its shard of the gradient at the end)
        acc.pending[local] = axes
        return local
    if not axes:
        return local
    if sync is not None:
        sync.add(local, axes)
        return local
    return grad_allreduce(local, axes)


# --- moving values between placements, with autograd ----------------------

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


class _Reshard(torch.autograd.Function):
    """``_redistribute`` forward (``fwd``: src, dst), and its gradient from
    where it arrives to where the source's gradient is wanted (``bwd``)."""

    @staticmethod
    def forward(ctx, x, mesh, fwd, bwd, even=False):
        ctx.mesh, ctx.bwd, ctx.even = mesh, bwd, even
        return _redistribute(x, mesh, *fwd, even)

    @staticmethod
    def backward(ctx, grad):
        return _redistribute(grad, ctx.mesh, *ctx.bwd, ctx.even), None, None, None, None


def reshard(x: torch.Tensor, fwd: str, bwd: str, regather: bool = False, uneven: bool = False) -> torch.Tensor:
    """Move ``x`` between placements, ``fwd`` = "<from>-><to>": the
    collective(s) the plan lists for this edge; in backward, its gradient
    moves as ``bwd`` says (from how it arrives, a partial sum where the
    consumers' are, to how the source's other uses give theirs: "P->S(0)"
    is a reduce-scatter). ``regather`` (ZeRO-3): ``x`` is a parameter's
    shard whose gathered copy is not kept for backward (``_Regather``).
    ``uneven``: some dim of ``x`` split here does not divide by its axes."""
    mesh = _mesh()
    move, back = _move(fwd, mesh.ndim), _move(bwd, mesh.ndim)
    if x.requires_grad and torch.is_grad_enabled():
        out = _Reshard.apply(x, mesh, move, back, not uneven)
    else:
        out = _redistribute(x, mesh, *move, not uneven)
    if regather and not getattr(_state, "in_checkpoint", False):
        _regather.add(x, out, mesh, move)
    return out


class _SumGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes):
        ctx.mesh, ctx.axes = mesh, axes
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad.clone(), ctx.mesh, ctx.axes), None, None


def grad_allreduce(x: torch.Tensor, axes: tuple) -> torch.Tensor:
    """``x`` itself; in backward its gradient, a partial sum over mesh
    ``axes`` (consumers that split their work there), is all-reduced over
    them (Megatron-LM's "f": identity forward, all-reduce backward)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x
    return _SumGrad.apply(x, _mesh(), axes)


class _ShareGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, mesh, axes):
        ctx.off = _off_first(mesh, axes)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return (torch.zeros_like(grad) if ctx.off else grad), None, None


def grad_share(x: torch.Tensor, axes: tuple) -> torch.Tensor:
    """``x`` itself, for a use that gives the whole gradient on every rank of
    mesh ``axes`` where the value's other uses give partial sums: in
    backward coordinate 0 of those axes keeps it and the others pass zeros,
    so that it adds up with theirs (the sum is all-reduced where ``x`` is
    made)."""
    if not (x.requires_grad and torch.is_grad_enabled()):
        return x
    return _ShareGrad.apply(x, _mesh(), axes)


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


def shard_input(t: torch.Tensor, spec: str, shape: list, local_input: bool = False) -> torch.Tensor:
    """A user input: this rank's piece of the full global batch (a slice, no
    communication), or with ``local_input`` this rank's own shard as given
    (e.g. from a DistributedSampler)."""
    mesh = _mesh()
    placements = _spec(spec, mesh.ndim)
    if local_input:
        full = [n * math.prod(mesh.size(a) for a, p in enumerate(placements) if isinstance(p, Shard) and p.dim == d)
                for d, n in enumerate(t.shape)]
        if full != list(shape):
            raise ShardingError(
                f"local input of shape {list(t.shape)} with placements {spec} makes a global shape "
                f"{full}, but the plan was compiled for {list(shape)}")
        return t
    if list(t.shape) != list(shape):
        raise ShardingError(
            f"input of shape {list(t.shape)} does not match the plan, compiled for {list(shape)}; "
            "autopar plans static shapes: recompile for this shape (the decorator form does so itself)")
    whole = (Replicate(),) * mesh.ndim
    if t.requires_grad and torch.is_grad_enabled():
        grads = producer_grad_spec(placements)
        return _Reshard.apply(t, mesh, (whole, placements), (grads, whole))
    return _redistribute(t, mesh, whole, placements)


# --- parameters gathered in buckets (ZeRO) ----------------------------------------

def gather_params(shards: tuple, moves: tuple, regather: bool = False, whole: tuple = (), ahead=None) -> tuple:
    """Parameters held sharded over some mesh axes, gathered whole over them
    with one all-gather per axis for the bucket, the innermost axis first
    (``moves[k]``: shard k's "<from>-><to>", S(d) -> R on those axes, the
    same axes for every shard); in backward their gradients, partial sums
    over the axes, are reduce-scattered back into the shards with one
    reduce-scatter per axis for the bucket, once the last of them is ready
    (FSDP2 groups its parameters per module the same way), and where one
    reduce-scatter gives the shards' whole gradients, in a step with a
    ``GradSync``, it is waited for at the end of backward
    (``GradSync.scattered``), not where it starts; on the axes in
    ``whole`` the ops that use them run whole on every rank, so their
    gradients are too: each rank takes its piece. ``regather`` (ZeRO-3):
    the gathered copies are not kept for backward (``_Regather``).
    ``ahead``: the bucket's first all-gather, started earlier by
    ``prefetch_params``."""
    mesh = _mesh()
    axes, dims = _bucket_axes(moves, mesh)
    if torch.is_grad_enabled() and any(s.requires_grad for s in shards):
        out = _GatherBucket.apply(mesh, axes, dims, tuple(a in whole for a in axes), ahead, *shards)
    else:
        out = shards
        for k, (a, d) in enumerate(zip(axes, dims)):
            out = ahead() if k == 0 and ahead is not None else _gather(out, mesh, a, d)
    if regather and not getattr(_state, "in_checkpoint", False):
        for shard, full, move in zip(shards, out, (_move(m, mesh.ndim) for m in moves)):
            _regather.add(shard, full, mesh, move)
    return out


def prefetch_params(shards: tuple, moves: tuple):
    """Start the first all-gather of a bucket that ``gather_params`` will
    gather later (the emitted program starts the next ZeRO-3 module's where
    it gathers one, as FSDP prefetches the next module in forward), so the
    gather runs while the ops before that use compute; returns the call that
    finishes it (``gather_params(..., ahead=)``)."""
    mesh = _mesh()
    axes, dims = _bucket_axes(moves, mesh)
    return _gather(tuple(s.detach() for s in shards), mesh, axes[0], dims[0], async_op=True)


def _bucket_axes(moves: tuple, mesh) -> tuple:
    """(the mesh axes a bucket's moves gather over, innermost first; per axis, each shard's dim)."""
    placed = tuple(_move(m, mesh.ndim) for m in moves)
    axes = tuple(a for a in reversed(range(mesh.ndim)) if placed[0][0][a] != placed[0][1][a])
    return axes, tuple(tuple(src[a].dim for src, _ in placed) for a in axes)


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


class _GatherBucket(torch.autograd.Function):
    @staticmethod
    def forward(ctx, mesh, axes, dims, whole, ahead, *shards):
        ctx.mesh, ctx.axes, ctx.dims, ctx.whole, ctx.shapes = mesh, axes, dims, whole, []
        sync = getattr(_state, "grad_sync", None) if getattr(_state, "accumulation", None) is None else None
        # one reduce-scatter whose pieces are the shards' whole gradients: left to the step's GradSync
        ctx.later = sync if sync is not None and len(axes) == 1 and not whole[0] and all(
            s.requires_grad and s not in sync.params for s in shards) else None
        ctx.leaves = shards if ctx.later is not None else ()
        for k, (a, d) in enumerate(zip(axes, dims)):
            ctx.shapes.append([s.shape for s in shards])
            shards = ahead() if k == 0 and ahead is not None else _gather(shards, mesh, a, d)
        return shards

    @staticmethod
    def backward(ctx, *grads):
        if ctx.later is not None:  # started here, waited for at the end of backward
            ctx.later.scattered(ctx.leaves, _scatter(grads, ctx.mesh, ctx.axes[0], ctx.dims[0], ctx.shapes[0],
                                                     async_op=True))
            return (None,) * (5 + len(grads))
        for a, d, shapes, whole in reversed(list(zip(ctx.axes, ctx.dims, ctx.shapes, ctx.whole))):
            grads = _scatter(grads, ctx.mesh, a, d, shapes, whole)
        return (None, None, None, None, None, *grads)


# --- ZeRO-3: gathered parameters are gathered again in backward, not kept ---------

PREFETCH_NOTES = 2
"""How many regathered parameters backward gathers ahead of their use (each
a full copy alive early): two, since backward unpacks an op's saved tensors
in about the reverse of the order forward saved them, not exactly (a linear
layer's, for one, in pairs swapped)."""


class _Regather:
    """The full copies of regathered parameters that are alive in this forward,
    by storage. An op that would save one for backward saves (parameter shard,
    placements, view geometry) instead, and unpacking gathers it again: the
    all-gather runs once more in backward, identically on every rank, and the
    full parameter is freed after its last forward use (ZeRO stage 3;
    Rajbhandari et al. 2020, sec. 5.3). Backward unpacks them in about the
    reverse of the order forward saved them, so each unpack also starts the
    gathers of the ones saved before it (``PREFETCH_NOTES``; asynchronously,
    where each is one all-gather: ``_gather_ahead``), as FSDP prefetches the
    next module's parameters in backward: those gathers run while backward
    computes."""

    def __init__(self):
        self.live: dict = {}  # storage pointer -> (weakref to the full local tensor, shard, mesh, move)
        self.order: list = []  # this forward's notes, in the order saved
        self.ahead: dict = {}  # note index -> a gather started ahead: call it for the full tensor
        self.done: set = set()  # the notes this backward has unpacked
        self.unpacking = False

    def add(self, source: torch.Tensor, gathered: torch.Tensor, mesh, move) -> None:
        if self.unpacking:  # a new forward: the last backward's notes and prefetches are done with
            self.order, self.ahead, self.done, self.unpacking = [], {}, set(), False
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.live[gathered.untyped_storage().data_ptr()] = (weakref.ref(gathered), source, mesh, move)

    def _entry(self, t: torch.Tensor):
        if not self.live or type(t) is not torch.Tensor:
            return None
        entry = self.live.get(t.untyped_storage().data_ptr())
        if entry is None or entry[0]() is None:
            return None
        return entry

    def involved(self, tensors) -> bool:
        return any(isinstance(t, torch.Tensor) and self._entry(t) is not None for t in tensors)

    def pack(self, t: torch.Tensor):
        entry = self._entry(t)
        if entry is None:
            return t
        _, source, mesh, move = entry
        note = _Note(source, mesh, move, t.size(), t.stride(), t.storage_offset(), len(self.order))
        self.order.append(note)
        return note

    def unpack(self, saved):
        if not isinstance(saved, _Note):
            return saved
        self.unpacking = True
        if saved.index in self.done:  # another backward through the same graph (retain_graph)
            self.done = set()
        self.done.add(saved.index)
        with torch.no_grad():
            started = self.ahead.pop(saved.index, None)
            full = started() if started is not None else _gather_ahead(saved)()
            # the next to come: the latest notes saved before this one and not unpacked yet (two:
            # backward reaches an op's saved tensors in about, not exactly, the reverse order)
            coming = (i for i in range(min(saved.index, len(self.order)) - 1, -1, -1) if i not in self.done)
            for i in itertools.islice(coming, PREFETCH_NOTES):
                if i not in self.ahead:
                    self.ahead[i] = _gather_ahead(self.order[i])
        return full.as_strided(saved.size, saved.stride, saved.offset)


@dataclass(frozen=True)
class _Note:
    source: torch.Tensor
    mesh: object
    move: tuple
    size: torch.Size
    stride: tuple
    offset: int
    index: int = 0


def _gather_ahead(note: _Note):
    """Start gathering a saved parameter's full tensor; returns the call
    that finishes it. A gather over one mesh axis of a dim no other axis
    splits runs as one asynchronous all-gather; any other move runs when
    called (``_redistribute``)."""
    src, dst = note.move
    changed = [a for a, (p, q) in enumerate(zip(src, dst)) if p != q]
    a = changed[0] if len(changed) == 1 else None
    if a is None or not (isinstance(src[a], Shard) and isinstance(dst[a], Replicate)) or any(
            isinstance(p, Shard) and p.dim == src[a].dim for b, p in enumerate(src) if b != a) \
            or any(type(c) is not int for c in note.mesh.get_coordinate()):
        return lambda: _redistribute(note.source.detach(), note.mesh, *note.move, True)  # parameters divide
    finish = _gather((note.source.detach(),), note.mesh, a, (src[a].dim,), async_op=True)
    return lambda: finish()[0]


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, once an in-flight functional collective producing it has finished."""
    return t.wait() if hasattr(t, "wait") else t


_regather = _Regather()


# --- ops on local shards ---------------------------------------------------

@dataclass(frozen=True)
class OpStrategy:
    """An op's planned placements, as the emitted program spells them:
    "(S(0), R, R) -> S(0)", or "(...) -> (S(0), S(1))" for outputs placed
    apart. ``avg``: the mesh axes where the output is a P(avg), which runs
    as a Partial sum of local means over the axis size."""
    inputs: tuple
    output: tuple
    items: tuple
    avg: tuple


@functools.lru_cache(maxsize=None)
def _strategy(text: str, ndim: int) -> OpStrategy:
    ins, _, out = text.partition("->")
    inputs = tuple(parse_spec(s.strip(), ndim) for s in ins.strip()[1:-1].split(",") if s.strip())
    out = out.strip()
    items = tuple(parse_spec(s.strip(), ndim) for s in out[1:-1].split(",")) if out.startswith("(") else ()
    output = items[0] if items else parse_spec(out, ndim)
    avg = tuple(a for a, p in enumerate(output) if isinstance(p, Partial) and p.reduce_op == "avg")
    return OpStrategy(inputs, output, items, avg)


def op(node: str, fn, strategy: str, *args, **kwargs):
    """Run one op on the local shards, where it needs to know its shard (a
    local implementation in ``LOCAL_IMPLS``), makes a P(avg), or may save a
    regathered parameter (ZeRO-3); other ops are plain calls in the emitted
    program. ``strategy``: its planned placements (``OpStrategy``)."""
    mesh = _mesh()
    st = _strategy(strategy, mesh.ndim)
    hooks = contextlib.nullcontext()
    if _regather.involved((*args, *kwargs.values())):
        hooks = torch.autograd.graph.saved_tensors_hooks(_regather.pack, _regather.unpack)
    _state.node = node
    try:
        with hooks:
            out = _local_impl(fn)(fn, mesh, st, args, kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:  # not checkpoint's control flow
        raise RuntimeError(f"autopar: node {node} ({fn}) failed with placements {strategy}: {e}") from e
    if st.avg:  # a mean over a dim split n ways is the local mean / n, summed over ranks
        out = out / math.prod(mesh.size(a) for a in st.avg)
    return out


def reshape(node: str, fn, x: torch.Tensor, local_shape: list, *rest):
    """A view/reshape/expand whose arguments name the global shape: the same
    op on the local shard, to the planned local shape."""
    if fn is torch.ops.aten.expand.default:
        return x.expand(local_shape)
    return x.reshape(local_shape)


def checkpoint(layer, *args):
    """Run a layer keeping only its inputs; its forward (with its collectives,
    identically on every rank) runs again during backward. Inputs without a
    gradient (buffers that the layer may update in place, integer tensors)
    are not checkpoint's inputs, which it would check for in-place changes:
    the recomputation reads them as they are."""
    mesh = _mesh()
    step_seed = getattr(_state, "step_seed", None)
    calls = []
    tracked = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]

    def run(*inputs):
        # the recomputation runs in backward, outside the forward's context:
        # it gets the forward's mesh and step seed back (the same random
        # draws); a recomputed layer gathers its parameters again anyway (no _Regather)
        calls.append(None)
        full = list(args)
        for i, x in zip(tracked, inputs):
            full[i] = x
        with _scoped("in_checkpoint", True), _scoped("recomputing", len(calls) > 1), use_mesh(mesh), \
                _scoped("step_seed", step_seed):
            return layer(*full)

    return torch.utils.checkpoint.checkpoint(run, *(args[i] for i in tracked), use_reentrant=False)


def _recomputing() -> bool:
    """Whether ops run again in backward (the second run of a checkpoint)."""
    return bool(getattr(_state, "recomputing", False))


def state_update(node: str, fn, strategy: str, *args, **kwargs):
    """An in-place op on a buffer (a step counter, an EMA, batch norm's count): run
    once per step, not again when its layer is recomputed (the buffer holds
    what the forward left, which is what the op returns)."""
    if _recomputing():
        return args[0]
    return op(node, fn, strategy, *args, **kwargs)


def factory(fn, *args, **kwargs):
    """A tensor factory (arange, zeros, ...): the same replicated tensor on every
    rank, made on this rank's device."""
    mesh = _mesh()
    if "device" in kwargs:
        kwargs["device"] = torch.device(mesh.device_type, torch.cuda.current_device()) \
            if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    return fn(*args, **kwargs)


def random_factory(node: str, fn, *args, **kwargs):
    """A random factory (randn, rand, randint, ...): a replicated tensor, so
    every rank draws the same values, from the step's seed and the node's
    name (``_per_shard_rng``), whatever its own generator holds."""
    mesh = _mesh()
    _state.node = node
    whole = (Replicate(),) * mesh.ndim
    return _per_shard_rng(_factory_impl)(fn, mesh, OpStrategy((), whole, (), ()), args, kwargs)


def _factory_impl(fn, mesh, st, args, kwargs):
    return factory(fn, *args, **kwargs)


def output(x: torch.Tensor, spec: str) -> torch.Tensor:
    """A program output that is a partial sum (a loss over a split batch),
    returned whole on every rank.

    Returned from a forward whose backward follows (a ``GradSync`` step) it
    is summed by an all-reduce that is not waited for here: the value waits
    for it when first read (``.item()``, printing, arithmetic), or at the end
    of backward, which needs only its shape. So reporting the loss does not
    stall every rank mid-step."""
    mesh = _mesh()
    placements = _spec(spec, mesh.ndim)
    sync = getattr(_state, "grad_sync", None)
    group = _sum_group(mesh, placements) if sync is not None and torch.is_grad_enabled() else None
    if group is not None:
        return _SumLater.apply(x, group, sync)
    whole = (Replicate(),) * mesh.ndim
    grads = producer_grad_spec(placements)
    if x.requires_grad and torch.is_grad_enabled():
        return _Reshard.apply(x, mesh, (placements, whole), (whole, grads))
    return _redistribute(x, mesh, placements, whole)


def _sum_group(mesh, placements):
    """The process group of the mesh axes a value is a partial sum over, when
    it is replicated on the others and one group holds exactly those axes."""
    partial = [a for a, p in enumerate(placements) if isinstance(p, Partial)]
    if not partial or any(not isinstance(p, (Partial, Replicate)) for p in placements) \
            or any(p.reduce_op != "sum" for p in placements if isinstance(p, Partial)):
        return None
    if len(partial) == 1:
        return mesh.get_group(partial[0])
    if len(partial) == mesh.ndim and mesh.size() == torch.distributed.get_world_size():
        return torch.distributed.group.WORLD
    return None


class _SumLater(torch.autograd.Function):
    """Sum of a partial value over ``group``, all-reduced asynchronously; the
    gradient of each summand is the sum's gradient."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group, sync):
        total = local.detach().clone()
        pending = _Pending(total, torch.distributed.all_reduce(total, group=group, async_op=True))
        sync.pending.append(pending)
        return pending

    @staticmethod
    def backward(ctx, grad):
        return grad, None, None


class _Pending(torch.Tensor):
    """A value an asynchronous all-reduce is still writing. Any op on it waits
    for the all-reduce first, except ``ones_like``, all that ``backward()``
    asks of a loss."""

    @staticmethod
    def __new__(cls, elem: torch.Tensor, work):
        t = torch.Tensor._make_wrapper_subclass(cls, elem.size(), strides=elem.stride(), dtype=elem.dtype,
                                                device=elem.device, requires_grad=elem.requires_grad)
        t.elem, t.work = elem, work
        return t

    def __repr__(self, *, tensor_contents=None):
        return f"_Pending({self.wait()!r})"

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        return self.elem

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.ones_like.default:
            return func(args[0].elem, **kwargs)
        unwrap = lambda t: t.wait() if isinstance(t, _Pending) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs))




# --- local implementations that need to know their shard -----------------

def _plain(fn, mesh, st, args, kwargs):
    return fn(*args, **kwargs)


def _mean_loss(fn, mesh, st, args, kwargs):
    """cross_entropy / nll_loss with a mean over a batch split: this rank's loss
    sum over the global count of targets that are not ignore_index, so the
    Partial sum over ranks is the single-device mean. The count is all-reduced
    (a 4-byte all-reduce on the split axes, inside the op)."""
    partial = [a for a, p in enumerate(st.output) if isinstance(p, Partial)]
    reduction = args[3] if len(args) > 3 else kwargs.get("reduction", 1)
    if not partial or reduction != 1:
        return fn(*args, **kwargs)
    target = args[1]
    ignore = args[4] if len(args) > 4 else kwargs.get("ignore_index", -100)
    summed = list(args) + [None] * (4 - len(args))  # (input, target, weight, reduction, ...)
    summed[3] = 2  # torch's Reduction.Sum
    total = fn(*summed, **{k: v for k, v in kwargs.items() if k != "reduction"})
    if target.is_floating_point():  # class probabilities (dim 1): the mean is over the samples
        count = torch.ones_like(target.select(1, 0)).sum().to(total.dtype)
    else:
        count = (target != ignore).sum().to(total.dtype)
    count = _reduce_over(count.detach(), mesh, partial)
    return total / count


def _affine_grid(fn, mesh, st, args, kwargs):
    """F.affine_grid's ``size`` names the batch: this rank's share of it."""
    theta, size, *rest = args
    return fn(theta, [theta.shape[0], *size[1:]], *rest, **kwargs)


def _shard_index(mesh, placements, dim: int | None = None) -> tuple[int, int]:
    """(index, count) of this rank's piece of a dim sharded on several axes
    (axis 0 outermost); ``dim`` None: over the axes that split any dim (ranks
    of an axis that replicates the tensor share an index)."""
    coord = mesh.get_coordinate()
    index, count = 0, 1
    for axis, p in enumerate(placements):
        if isinstance(p, Shard) and (dim is None or p.dim == dim):
            index = index * mesh.size(axis) + coord[axis]
            count *= mesh.size(axis)
    return index, count


def _embedding(fn, mesh, st, args, kwargs):
    """Lookup in this rank's rows of the table: ids outside them give zeros, so
    over a vocabulary split the result is a Partial (sum). The padding id's
    lookups pass no gradient, whichever rank holds its row (the local call
    gets no padding_idx: the global one would name another row of a shard)."""
    w, idx, *rest = args
    index, count = _shard_index(mesh, st.inputs[0], 0)
    if count == 1:
        return fn(w, idx, *rest, **kwargs)
    padding = rest[0] if rest else kwargs.get("padding_idx", -1)
    rest, kwargs = rest[1:], {k: v for k, v in kwargs.items() if k != "padding_idx"}
    start = index * w.shape[0]
    inside = (idx >= start) & (idx < start + w.shape[0])
    out = fn(w, torch.where(inside, idx - start, torch.zeros_like(idx)), -1, *rest, **kwargs)
    out = out * inside.unsqueeze(-1).to(out.dtype)
    return torch.where((idx == padding).unsqueeze(-1), out.detach(), out) if padding >= 0 else out


def _batch_norm(fn, mesh, st, args, kwargs):
    """Training-mode batch norm on split inputs.

    The batch (or a spatial dim) split: synchronised statistics (as
    torch.nn.SyncBatchNorm): each rank's per-channel mean and sum of squared
    deviations are all-gathered over the split axes (one collective of 2C
    values a rank, inside the op; one reduce-scatter of their gradients in
    backward) and combined exactly (the pairwise update of Chan, Golub and
    LeVeque 1979), so every rank normalises with the statistics of the
    global batch. The channel split: the op on the rank's channels.

    Running statistics (the rule passes the buffers whole) are updated as one
    device would, momentum-weighted with the batch mean and unbiased
    variance; with the channels split each rank's update is all-gathered over
    those axes, so every rank holds every channel's. A recomputation
    (checkpoint.recomputing) leaves them alone: one update per forward."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    a = dict(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in names})
    x, running = a["input"], (a.get("running_mean"), a.get("running_var"))
    placements = st.inputs[0]
    split = sorted({axis for axis, p in enumerate(placements) if isinstance(p, Shard) and p.dim != 1})
    channels = sorted({axis for axis, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 1})
    tracked = a.get("training") and running[0] is not None
    if not a.get("training") or not (split or (tracked and (channels or _recomputing()))):
        return fn(*args, **kwargs)
    stats_placements = tuple(Shard(0) if axis in channels else Replicate() for axis in range(mesh.ndim))
    if tracked:  # this rank's channels of the running statistics, as a copy
        whole = (Replicate(),) * mesh.ndim
        old = [_redistribute(r, mesh, whole, stats_placements).clone() for r in running]
    if split:
        dims = [d for d in range(x.ndim) if d != 1]
        local = math.prod(x.shape[d] for d in dims)  # every rank's count: the shards divide evenly
        shape = [1, x.shape[1]] + [1] * (x.ndim - 2)
        mine = x.mean(dims)
        stats = _GatherOver.apply(torch.stack([mine, ((x - mine.view(shape)) ** 2).sum(dims)]),
                                  _group_over(mesh, tuple(split)))
        means, squares = stats[:, 0], stats[:, 1]  # every rank's mean and sum of squared deviations
        count = local * stats.shape[0]
        mean = means.mean(0)
        var = (squares.sum(0) + local * ((means - mean) ** 2).sum(0)) / count  # Chan et al.'s pairwise update
        out = (x - mean.view(shape)) * torch.rsqrt(var + a.get("eps", 1e-5)).view(shape)
        if a.get("weight") is not None:
            out = out * a["weight"].view(shape)
        if a.get("bias") is not None:
            out = out + a["bias"].view(shape)
        if tracked:
            m = a.get("momentum", 0.1)
            with torch.no_grad():
                new = [(1 - m) * old[0] + m * mean.detach(),
                       (1 - m) * old[1] + m * var.detach() * (count / max(count - 1, 1))]
    else:  # channels split: the op updates this rank's copy
        local = list(args)
        local[3:5] = old
        out = fn(*local, **{k: v for k, v in kwargs.items() if k not in ("running_mean", "running_var")})
        new = old
    if tracked and not _recomputing():
        with torch.no_grad():
            for buffer, mine in zip(running, new):
                full = _redistribute(mine, mesh, stats_placements, (Replicate(),) * mesh.ndim) \
                    if channels else mine
                buffer.copy_(full.to(buffer.dtype))
    return out


def _grouped_mm(fn, mesh, st, args, kwargs):
    """A grouped matmul (passes/rules/experts.py) with its experts or its
    sorted tokens split: this rank's experts' rows among this rank's rows.

    The offsets (whole) give every expert's global rows; those of the rank's
    experts (the weight's dim 0 split) that fall in the rank's rows (the
    input's dim 0 split) are ``lo:hi`` of the local input. The input is
    rotated by ``lo`` so that they come first, the op runs with the offsets
    shifted by the shard's first row and by ``lo`` (it computes nothing
    beyond the last one), rows from ``hi - lo`` on are zeroed in its input
    and output (torch's kernel leaves them, and their input gradient,
    undefined) and the rotation is undone: rows of other experts
    are zero, so over an expert split the result is a Partial sum. All of
    it is tensor arithmetic on the coordinate, with autograd. Without
    offsets (a batch of matmuls) the op runs as it is."""
    x, w, *rest = args
    kwargs = dict(kwargs)
    offs = rest.pop(0) if rest else kwargs.pop("offs", None)
    axes = dispatch_axes(st.inputs[0], st.inputs[1], tuple(mesh.shape))
    if axes and offs is not None:
        return _expert_parallel(fn, mesh, st, axes, x, w, offs, rest, kwargs)
    row, rows = _shard_index(mesh, st.inputs[0], 0)
    expert, experts = _shard_index(mesh, st.inputs[1], 0)
    if offs is None or (rows == 1 and experts == 1):  # a batched (3-D) one splits as a bmm
        return fn(x, w, offs, *rest, **kwargs)
    n, e = x.shape[0], w.shape[0]
    starts = torch.cat([offs.new_zeros(1), offs])
    bounds = starts.index_select(0, torch.arange(e + 1, device=offs.device) + expert * e)
    bounds = (bounds - row * n).clamp(0, n)  # this rank's experts' boundaries among its rows
    lo, hi = bounds[0], bounds[-1]
    positions = torch.arange(n, device=x.device)
    mine = (positions < hi - lo).unsqueeze(-1)
    first = x.index_select(0, (positions + lo) % n)
    first = torch.where(mine, first, torch.zeros_like(first))  # so that their undefined gradient is dropped
    out = fn(first, w, (bounds[1:] - lo).to(offs.dtype), *rest, **kwargs)
    out = torch.where(mine, out, torch.zeros_like(out))
    return out.index_select(0, (positions - lo) % n)


def _expert_parallel(fn, mesh, st, axes, x, w, offs, rest, kwargs):
    """A grouped matmul with its sorted rows and its experts split over the
    same ``axes`` (passes/rules/experts.py, dispatch_axes): every rank sends
    each of its rows to the rank holding that row's expert (the whole
    offsets say which, on every rank alike, so no sizes are exchanged),
    which runs its experts on the rows it gets, in sorted order, and sends
    the results back; rows of no expert stay zero. Two all-to-alls
    (``_Route``), each with its backward."""
    group = _group_over(mesh, axes)
    me, n = _shard_index(mesh, st.inputs[0], 0)
    local, experts = x.shape[0], w.shape[0]
    expert = torch.searchsorted(offs, torch.arange(local * n, device=offs.device, dtype=offs.dtype), right=True)
    owner = torch.where(expert < experts * n, expert // experts, n).view(n, local)  # n: no expert's row
    ranks = torch.arange(n, device=owner.device)
    counts = (owner[me].unsqueeze(0) == ranks.unsqueeze(1)).sum(1).tolist()
    send = torch.argsort(owner[me], stable=True)[:sum(counts)]  # my rows by the rank they go to
    arriving = (owner == me).sum(1).tolist()
    rows = _Route.apply(x, group, send, counts, arriving)  # my experts' rows, in sorted order
    base = offs[me * experts - 1] if me > 0 else offs.new_zeros(())
    out = fn(rows, w, (offs[me * experts:(me + 1) * experts] - base).to(offs.dtype), *rest, **kwargs)
    back = _Route.apply(out, group, torch.arange(out.shape[0], device=out.device), arriving, counts)
    return out.new_zeros((local, *out.shape[1:])).index_copy(0, send, back)


class _Route(torch.autograd.Function):
    """Rows (dim 0) sent between the ranks of ``group`` by one all-to-all:
    ``send`` the local rows to send, grouped by destination in rank order,
    ``counts`` how many go to each rank, ``arriving`` how many come from
    each; returns the rows received, in rank order. In backward their
    gradients go back where the rows came from and add into them."""

    @staticmethod
    def forward(ctx, rows, group, send, counts, arriving):
        ctx.group, ctx.send, ctx.counts, ctx.arriving, ctx.n = group, send, counts, arriving, rows.shape[0]
        out = rows.new_empty((sum(arriving), *rows.shape[1:]))
        torch.distributed.all_to_all_single(out, rows.index_select(0, send), arriving, counts, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        back = grad.new_empty((sum(ctx.counts), *grad.shape[1:]))
        torch.distributed.all_to_all_single(back, grad.contiguous(), ctx.counts, ctx.arriving, group=ctx.group)
        return grad.new_zeros((ctx.n, *grad.shape[1:])).index_add_(0, ctx.send, back), None, None, None, None


def _index(fn, mesh, st, args, kwargs):
    """Advanced indexing ``x[..., positions, ...]`` with x split along the
    indexed dim and the positions whole (passes/rules/indexing.py,
    routed_axes): the result is split along dim j of the positions, and
    each rank fetches the rows of its chunk of positions from the ranks
    that hold them (one all-to-all, ``_Route``; every rank knows from the
    whole positions what each other needs from it). Otherwise the op runs
    as it is."""
    x, indices = args[0], list(args[1])
    axes = routed_axes(st.inputs[0], indices, tuple(mesh.shape))
    if not axes:
        return fn(*args, **kwargs)
    d = next(k for k, t in enumerate(indices) if t is not None)
    positions = indices[d]
    j = st.output[axes[0]].dim - d
    group = _group_over(mesh, axes)
    me, n = _shard_index(mesh, st.inputs[0], d)
    held = x.shape[d]
    whole = torch.where(positions < 0, positions + held * n, positions).movedim(j, 0)
    chunk = whole.shape[0] // n
    wanted = whole.reshape(n, -1)  # rank r's positions, in order
    owner = wanted // held
    counts = (owner == me).sum(1).tolist()
    send = wanted[owner == me] - me * held  # my rows each rank wants, by rank
    arriving = torch.bincount(owner[me], minlength=n).tolist()
    got = _Route.apply(x.movedim(d, 0), group, send, counts, arriving)
    order = torch.argsort(owner[me], stable=True)  # which of my positions each arriving row is
    rows = got.index_select(0, torch.argsort(order))
    rest = [x.shape[k] for k in range(x.ndim) if k != d]
    out = rows.reshape(chunk, *whole.shape[1:], *rest).movedim(0, j)  # (positions' dims, x's other dims)
    k = positions.ndim
    return out.permute(*range(k, k + d), *range(k), *range(k + d, out.ndim))


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _attention(fn, mesh, st, args, kwargs):
    """Causal attention with the queries' sequence split (context
    parallelism, passes/rules/attention.py): keys and values arrive whole, and
    the queries at positions ``p .. p + m`` attend to keys ``0 .. p + m``,
    the last m causally (the lower-right-aligned causal mask, which torch's
    kernels run without materialising it where they can). Where the chunks
    halve (``zigzag_axes``), the work is balanced: query halves move by an
    all-to-all over the axes that split the sequence so that rank j of cp
    computes halves j and 2cp-1-j, and the outputs move back (their
    gradients the other way in backward, ``_Zigzag``); otherwise each rank
    computes its contiguous chunk, the last the most. Without
    ``is_causal``, or with the sequence whole, the op runs as it is."""
    a = dict(zip(_SDPA_ARGS, args), **kwargs)
    q = a["query"]
    seq = q.ndim - 2
    index, count = _shard_index(mesh, st.inputs[0], seq)
    if count == 1 or not a.get("is_causal", False):
        return fn(*args, **kwargs)
    n = q.shape[seq]
    axes = zigzag_axes(st.inputs[0], seq, n, tuple(mesh.shape))
    if not axes:
        return _causal_chunk(a, q, index * n)
    group, m = _group_over(mesh, axes), n // 2
    mine = _Zigzag.apply(q, group, seq, count, index, False)
    halves = [_causal_chunk(a, part, h * m) for part, h in zip(mine.split(m, dim=seq), (index, 2 * count - 1 - index))]
    return _Zigzag.apply(torch.cat(halves, dim=seq), group, seq, count, index, True)


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


def _causal_chunk(a: dict, q: torch.Tensor, start: int) -> torch.Tensor:
    """Queries at positions ``start ..`` of a causal sequence against the keys up to their last."""
    seq = q.ndim - 2
    visible = start + q.shape[seq]
    k, v = (t.narrow(t.ndim - 2, 0, visible) for t in (a["key"], a["value"]))
    mask = torch.nn.attention.bias.causal_lower_right(q.shape[seq], visible)
    return torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, dropout_p=a.get("dropout_p", 0.0), scale=a.get("scale"),
        enable_gqa=a.get("enable_gqa", False))


def _zigzag(x: torch.Tensor, group, dim: int, cp: int, rank: int, back: bool) -> torch.Tensor:
    """Sequence halves over one mesh axis of ``cp`` ranks, from the
    contiguous layout (rank i holds halves 2i, 2i+1) to the balanced one
    (rank j holds halves j, 2cp-1-j), or ``back``: one all-to-all, each
    rank sending its two halves where they go (to itself, for some)."""
    def held(r: int) -> tuple:
        return (r, 2 * cp - 1 - r) if back else (2 * r, 2 * r + 1)

    def dest(h: int) -> int:
        return h // 2 if back else min(h, 2 * cp - 1 - h)

    m = x.shape[dim] // 2
    parts = dict(zip(held(rank), x.movedim(dim, 0).split(m)))
    sending = sorted(parts, key=dest)  # all_to_all_single sends in rank order; sorted() keeps ties in order
    arriving = [[h for h in sorted(held(r), key=dest) if dest(h) == rank] for r in range(cp)]
    send = torch.cat([parts[h] for h in sending])
    got = torch.empty_like(send)
    torch.distributed.all_to_all_single(got, send, [m * len(hs) for hs in arriving],
                                        [m * sum(dest(h) == r for h in sending) for r in range(cp)], group=group)
    pieces = dict(zip([h for hs in arriving for h in hs], got.split(m)))
    return torch.cat([pieces[h] for h in sorted(pieces)]).movedim(0, dim)


class _Zigzag(torch.autograd.Function):
    """``_zigzag`` forward, its inverse on the gradient."""

    @staticmethod
    def forward(ctx, x, group, dim, cp, rank, back):
        ctx.args = (group, dim, cp, rank, not back)
        return _zigzag(x, group, dim, cp, rank, back)

    @staticmethod
    def backward(ctx, grad):
        return _zigzag(grad, *ctx.args), None, None, None, None, None


class StepSeed:
    """One random seed per training step, the same on every rank: rank 0 draws
    it and broadcasts it, once, at the step's first random op. Random ops
    derive their generators from it, so the draws do not depend on each
    rank's own generator, which a training script may seed per rank (for
    data augmentation, say)."""

    def __init__(self):
        self.seed = None

    def get(self, mesh) -> int:
        if self.seed is None:
            device = torch.device("cuda", torch.cuda.current_device()) if mesh.device_type == "cuda" else "cpu"
            value = torch.randint(0, 2**62, (1,), device=device)
            torch.distributed.broadcast(value, src=0)
            self.seed = int(value.item())
        return self.seed


def random_step():
    """The ops run inside the ``with`` block (one forward) share one StepSeed."""
    return _scoped("step_seed", StepSeed())


def _per_shard_rng(impl):
    """A random op (dropout, bernoulli, rand_like, attention dropout).

    Drawing on the local shard from the rank's own generator would give every
    shard of a split tensor the same mask (every rank's generator is in the
    same state), and could give the replicas of a replicated one different
    masks (if the ranks were seeded apart). The op instead draws from a
    generator seeded by the step's seed (StepSeed; without one, as in a unit
    test, a draw of the default generator), the node's name and the shard's
    index over the axes that split the output: shards draw independently,
    replicas alike, and a recomputed layer (checkpoint keeps the step's seed)
    draws what its forward drew. Statistically one device's independent
    draws, not its bit pattern."""
    def run(fn, mesh, st, args, kwargs):
        if not _draws(fn, args, kwargs):
            return impl(fn, mesh, st, args, kwargs)
        index, _ = _shard_index(mesh, st.output)
        step = getattr(_state, "step_seed", None)
        seed = step.get(mesh) if step is not None else int(torch.randint(0, 2**62, (1,)))
        node = zlib.crc32(str(getattr(_state, "node", "")).encode())
        op_seed = (seed + node * 0xD1B54A32D192ED03 + index * 0x9E3779B97F4A7C15) % 2**62  # odd strides
        devices = [torch.cuda.current_device()] if mesh.device_type == "cuda" else []
        with torch.random.fork_rng(devices=devices, device_type=mesh.device_type):
            if mesh.device_type == "cuda":
                torch.cuda.manual_seed(op_seed)  # this device's generator only
            else:
                torch.random.default_generator.manual_seed(op_seed)
            return impl(fn, mesh, st, args, kwargs)
    return run


def _draws(fn, args, kwargs) -> bool:
    """Whether the call draws random numbers (attention only with dropout, a
    dropout only in training with p > 0)."""
    if fn is torch.ops.aten.scaled_dot_product_attention.default:
        return (args[4] if len(args) > 4 else kwargs.get("dropout_p", 0.0)) > 0
    if fn in _DROPOUTS:
        p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
        train = args[2] if len(args) > 2 else kwargs.get("train", True)
        return bool(p > 0 and train)
    if fn is torch.ops.aten.rrelu.default:  # a random slope per element in training only
        return bool(args[3] if len(args) > 3 else kwargs.get("training", False))
    return True


_DROPOUTS = {torch.ops.aten.dropout.default, torch.ops.aten.native_dropout.default,
             torch.ops.aten.feature_dropout.default, torch.ops.aten.alpha_dropout.default,
             torch.ops.aten.feature_alpha_dropout.default}
RANDOM_OPS = {*_DROPOUTS, torch.ops.aten.scaled_dot_product_attention.default, torch.ops.aten.bernoulli.default,
              torch.ops.aten.bernoulli.p, torch.ops.aten.rand_like.default, torch.ops.aten.randn_like.default,
              torch.ops.aten.randint_like.default, torch.ops.aten.randint_like.low_dtype, torch.ops.aten.rrelu.default,
              torch.ops.aten.bernoulli.Tensor, torch.ops.aten.uniform.default, torch.ops.aten.normal_functional.default,
              torch.ops.aten.exponential.default}

LOCAL_IMPLS = {
    torch.ops.aten.embedding.default: _embedding,
    torch.ops.aten.cross_entropy_loss.default: _mean_loss,
    torch.ops.aten.nll_loss.default: _mean_loss,
    torch.ops.aten.nll_loss_nd.default: _mean_loss,
    torch.ops.aten.batch_norm.default: _batch_norm,
    torch.ops.aten.affine_grid_generator.default: _affine_grid,
    torch.ops.aten._grouped_mm.default: _grouped_mm,
    torch.ops.aten.index.Tensor: _index,
    torch.ops.aten._unsafe_index.Tensor: _index,
    torch.ops.aten.scaled_dot_product_attention.default: _attention,
    "transformers.grouped_mm_fallback.default": _grouped_mm,  # a library's op, by name (passes/rules/experts.py)
}
LOCAL_IMPLS.update({fn: _per_shard_rng(LOCAL_IMPLS.get(fn, _plain)) for fn in RANDOM_OPS})


def runs_as_is(fn) -> bool:
    """Whether op ``fn`` runs on local shards exactly as on whole tensors (no
    local implementation): the emitted program calls it directly."""
    return _local_impl(fn) is _plain


@functools.lru_cache(maxsize=None)
def _local_impl(fn):
    """The local implementation of op ``fn``: its entry (by the op, or for a
    library's op by its name), or the op itself, found once per op (it
    formatted the op's name on every call)."""
    impl = LOCAL_IMPLS.get(fn)
    if impl is None and isinstance(fn, torch._ops.OpOverload):
        impl = LOCAL_IMPLS.get(str(fn))
    return impl or _plain
