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
  vocabulary, a batch norm over a split batch, a random op, a mean loss:
  their implementations are autopar.local_ops');
* the gradient of an input that is replicated over a mesh axis its consumer
  splits comes back a partial sum over that axis. Where a value has such
  uses, codegen sums its gradient where the value is made
  (``grad_allreduce``, or within the ``reshard`` that made it), and a use
  that gives the whole gradient on every rank passes it on coordinate 0 of
  the axis only (``grad_share``), so that the uses add up. Parameters leave
  that sum to ``gradsync.GradSync`` (DDP's bucketed all-reduces, during backward).

The collectives under all of them, and the mesh the program runs on
(``use_mesh``), are autopar.moves'.
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import math
import weakref
from dataclasses import dataclass

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_map
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.errors import ShardingError
from autopar.cost_models.resharding import producer_grad_spec
from autopar.local_ops import _local_impl, _per_shard_rng
from autopar.moves import (
    _all_reduce, _gather, _mesh, _move, _off_first, _recomputing, _redistribute, _scatter, _scoped, _spec, _state,
    use_mesh,
)
from autopar.passes.strategy import parse_spec


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
