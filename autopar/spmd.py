"""The run-time vocabulary of emitted programs.

Every per-rank program autopar writes calls only these functions (plus ATen
ops). Tensors travel between ops as DTensors over the current DeviceMesh:

* ``reshard`` moves a tensor to the placements its consumer's strategy wants
  (DTensor redistribute: the all-gather / all-reduce / reduce-scatter /
  all-to-all the plan lists for that edge, with autograd);
* ``op`` runs one ATen op on the local shards. The strategy rules only admit
  placements under which the local op is exact, so no communication happens
  inside an op; the gradient of an input that was replicated over an axis the
  op splits comes back Partial (sum), which the preceding reshard's backward
  reduces.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import weakref
import zlib
from dataclasses import dataclass, field

import torch
import torch.utils.checkpoint
from torch.utils._pytree import tree_map
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.errors import ShardingError
from autopar.passes.strategy import fmt_spec, parse_spec

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


def param(local: torch.Tensor, spec: str, regather: bool = False) -> DTensor:
    """A parameter's local shard as a DTensor; its gradient comes back in ``spec``.
    The reduction over the mesh axes the parameter is replicated on is left to
    the step's ``GradSync`` (bucketed all-reduces launched during backward) or,
    in a pipeline step, to ``GradAccumulation``; without either, and for the
    axes that shard it (ZeRO's reduce-scatter), it happens here, in backward.

    ``regather`` (ZeRO-3): the full copies ``reshard`` gathers from it are not
    kept for backward; ops that save them save a note instead, and backward
    gathers the parameter again (see ``_Regather``)."""
    mesh = _mesh()
    placements = _spec(spec, mesh.ndim)
    acc = getattr(_state, "accumulation", None)
    sync = getattr(_state, "grad_sync", None) if acc is None and torch.is_grad_enabled() else None
    axes = () if (acc is None and sync is None) or not local.requires_grad else \
        tuple(a for a, p in enumerate(placements) if isinstance(p, Replicate) and mesh.size(a) > 1)
    if torch.is_grad_enabled() and sync is None and getattr(local, "_autopar_sync", None) is not None:
        local._autopar_sync = None  # reduced another way now (an earlier step's GradSync no longer)
    if not axes:
        dt = DTensor.from_local(local, mesh, placements, run_check=False)
        if regather:
            dt._autopar_regather = True
        return dt
    if acc is not None:
        acc.pending[local] = axes
    else:
        sync.add(local, axes)
    keep = tuple(Partial() if a in axes else p for a, p in enumerate(placements))
    dt = DTensor.from_local(local, mesh, placements, run_check=False, grad_placements=keep)
    dt._autopar_deferred = axes
    return dt


class GradAccumulation:
    """Gradient accumulation over the microbatches of a pipeline step. Inside
    it, the reduction of a parameter's gradient over the mesh axes the
    parameter is replicated on is deferred: each microbatch adds its local
    partial sum to ``.grad``, and ``reduce()`` all-reduces the accumulated
    gradients once, after the last microbatch (what Megatron-LM and DDP's
    ``no_sync`` do). Reductions into sharded parameters (ZeRO) still run in
    every microbatch's backward."""

    def __init__(self):
        self.pending: dict = {}  # parameter -> mesh axes its gradient is still a partial sum over

    def collecting(self):
        """Defer the reductions of the parameters used inside this ``with`` block."""
        return _scoped("accumulation", self)

    def reduce(self, mesh, scatter: dict | None = None) -> int:
        """All-reduce every accumulated gradient over its deferred axes of
        ``mesh`` (a DeviceMesh), except that a parameter in ``scatter`` (its
        optimizer state sharded over one axis: an object with ``axis`` and
        ``reduce()``) is reduce-scattered over that axis; returns how many
        collectives ran."""
        count = 0
        for prm, axes in self.pending.items():
            if prm.grad is None:
                continue
            own = (scatter or {}).get(prm)
            for a in axes:
                if own is None or a != own.axis:
                    torch.distributed.all_reduce(prm.grad, group=mesh.get_group(a))
                    count += 1
            if own is not None:
                own.reduce()
                count += 1
        self.pending.clear()
        return count


DDP_BUCKET_BYTES = 25 * 2**20
"""DistributedDataParallel's default ``bucket_cap_mb`` (25 MiB)."""


def grad_sync(mesh, bucket_bytes: int | None = DDP_BUCKET_BYTES):
    """Inside this ``with`` block (one forward), the gradients of parameters
    replicated over mesh axes are reduced by one ``GradSync`` during the
    backward that follows; ``bucket_bytes`` None: one blocking all-reduce per
    parameter in its ``DTensor.from_local``'s backward, as before buckets."""
    return _scoped("grad_sync", GradSync(mesh, bucket_bytes) if bucket_bytes else None)


class GradSync:
    """Gradient synchronisation of replicated parameters, the way DDP's reducer
    does it (Li et al., VLDB 2020, sec. 3.2): the parameters a forward uses
    (``param``) are put in buckets of about ``bucket_bytes``, in reverse order
    of first use (the order backward makes their gradients), one mesh-axis
    group and dtype per bucket. Backward leaves each gradient a local partial
    sum (``GradAccumulation``'s deferred placements); when every gradient of
    a bucket has been accumulated, the bucket is flattened and all-reduced
    asynchronously while backward goes on, and at the end of backward (an
    autograd engine callback) every bucket is waited on and written back to
    ``.grad``. Buckets launch in index order on every rank, so their
    collectives match whatever order autograd finishes gradients in.

    A gradient accumulated over several backwards keeps its exact sum: the
    ``.grad`` already there is set aside before the new one is accumulated,
    and added back to the reduced new one (as one device adds them)."""

    def __init__(self, mesh, bucket_bytes: int):
        self.mesh, self.bucket_bytes = mesh, bucket_bytes
        self.params: dict = {}  # local parameter -> mesh axes to reduce over, in order of first use
        self.buckets: list | None = None
        self.ready: set = set()
        self.stashed: dict = {}
        self.launched = 0
        self.queued = False
        self.pending: list = []  # outputs still being summed (output(), _SumLater)

    def add(self, local: torch.Tensor, axes: tuple) -> None:
        local._autopar_sync = self  # until a later forward's, so a backward through this graph reduces here
        if local in self.params:  # tied weights: one tensor, one gradient
            return
        self.params[local] = axes
        if getattr(local, "_autopar_sync_hooks", None) is None:
            ref = weakref.ref(local)
            local._autopar_sync_hooks = (local.register_hook(functools.partial(_arriving, ref)),
                                         local.register_post_accumulate_grad_hook(_accumulated))

    def _plan(self) -> list:
        buckets, current = [], {}
        for local, axes in reversed(self.params.items()):
            key = (axes, local.dtype)
            bucket = current.get(key)
            if bucket is None or bucket.nbytes >= self.bucket_bytes:
                bucket = current[key] = _Bucket(axes)
                buckets.append(bucket)
            bucket.members.append(local)
            bucket.nbytes += local.numel() * local.element_size()
        return buckets

    def arriving(self, local: torch.Tensor) -> None:
        """A gradient for ``local`` is about to be accumulated."""
        if not self.queued:
            self.queued = True
            self.buckets = self._plan()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)
        if local.grad is not None:
            self.stashed[local], local.grad = local.grad, None

    def accumulated(self, local: torch.Tensor) -> None:
        self.ready.add(local)
        while self.launched < len(self.buckets) and all(m in self.ready for m in self.buckets[self.launched].members):
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket) -> None:
        grads = [m.grad.reshape(-1) if m in self.ready else m.new_zeros(m.numel()) for m in bucket.members]
        bucket.flat = torch.cat(grads) if len(grads) > 1 else grads[0]  # one contiguous gradient: in place
        bucket.work = torch.distributed.all_reduce(bucket.flat, group=self.mesh.get_group(bucket.axes[0]),
                                                   async_op=True)
        self.launched += 1

    def finish(self) -> None:
        """End of backward: launch what is left, wait, write the sums back."""
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        for bucket in self.buckets:
            bucket.work.wait()
            for axis in bucket.axes[1:]:
                torch.distributed.all_reduce(bucket.flat, group=self.mesh.get_group(axis))
            offset = 0
            for m in bucket.members:
                n = m.numel()
                if m in self.ready:
                    reduced = bucket.flat[offset:offset + n]
                    if reduced.data_ptr() != m.grad.data_ptr():
                        m.grad.copy_(reduced.view_as(m.grad))
                    if m in self.stashed:
                        m.grad = self.stashed.pop(m).add_(m.grad)
                offset += n
        for value in self.pending:
            value.wait()
        # ready for another backward through the same graph (retain_graph=True)
        self.buckets, self.ready, self.launched, self.queued = None, set(), 0, False


@dataclass
class _Bucket:
    axes: tuple
    members: list = field(default_factory=list)
    nbytes: int = 0
    flat: torch.Tensor | None = None
    work: object = None


def _arriving(ref, grad):
    local = ref()
    sync = getattr(local, "_autopar_sync", None)
    if sync is not None:
        sync.arriving(local)


def _accumulated(local):
    sync = getattr(local, "_autopar_sync", None)
    if sync is not None:
        sync.accumulated(local)


class _DeferredReshard(torch.autograd.Function):
    """``reshard`` of a parameter whose gradient reduction is deferred
    (``GradAccumulation``): the gradient goes back to the parameter's
    placements except that it stays a Partial sum on the deferred axes."""

    @staticmethod
    def forward(ctx, x: DTensor, want: tuple, axes: tuple):
        ctx.src, ctx.axes = x.placements, axes
        return x.redistribute(x.device_mesh, want)

    @staticmethod
    def backward(ctx, grad: DTensor):
        target = tuple(Partial() if a in ctx.axes and isinstance(grad.placements[a], Partial) else p
                       for a, p in enumerate(ctx.src))
        return grad.redistribute(grad.device_mesh, target), None, None


def replicate(t: torch.Tensor) -> DTensor:
    mesh = _mesh()
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False)


def shard_input(t: torch.Tensor, spec: str, shape: list, local_input: bool = False) -> DTensor:
    """A user input: the full global batch (sliced here, no communication), or
    with ``local_input`` this rank's own shard (e.g. from a DistributedSampler)."""
    mesh = _mesh()
    placements = _spec(spec, mesh.ndim)
    if local_input:
        dt = DTensor.from_local(t, mesh, placements, run_check=False)
        if list(dt.shape) != list(shape):
            raise ShardingError(
                f"local input of shape {list(t.shape)} with placements {spec} makes a global shape "
                f"{list(dt.shape)}, but the plan was compiled for {list(shape)}"
            )
        return dt
    if list(t.shape) != list(shape):
        raise ShardingError(
            f"input of shape {list(t.shape)} does not match the plan, compiled for {list(shape)}; "
            "autopar plans static shapes: recompile for this shape (the decorator form does so itself)"
        )
    return DTensor.from_local(t, mesh, [Replicate()] * mesh.ndim, run_check=False).redistribute(mesh, placements)


def reshard(x: DTensor, spec: str) -> DTensor:
    """Move ``x`` to the placements ``spec``: the collective(s) the plan lists for this edge."""
    mesh = _mesh()
    want = _spec(spec, mesh.ndim)
    to_partial = [isinstance(b, Partial) and a != b for a, b in zip(x.placements, want)]
    deferred = getattr(x, "_autopar_deferred", None)
    if deferred and not any(to_partial):
        return x if tuple(want) == tuple(x.placements) else _DeferredReshard.apply(x, want, deferred)
    if not any(to_partial):
        out = x.redistribute(mesh, want)
        if getattr(x, "_autopar_regather", False) and not getattr(_state, "in_checkpoint", False):
            _regather.add(x, out)
        return out
    # DTensor redistributes to Partial only internally: go through Replicate, then
    # keep the value on one rank of each such axis (zeros elsewhere).
    via = tuple(Replicate() if tp else b for tp, b in zip(to_partial, want))
    return _ToPartial.apply(x.redistribute(mesh, via), want)


# --- ZeRO-3: gathered parameters are gathered again in backward, not kept ---------

class _Regather:
    """The full copies of regathered parameters that are alive in this forward,
    by storage. An op that would save one for backward saves (parameter shard,
    placements, view geometry) instead, and unpacking gathers it again: the
    all-gather runs once more in backward, identically on every rank, and the
    full parameter is freed after its last forward use (ZeRO stage 3;
    Rajbhandari et al. 2020, sec. 5.3)."""

    def __init__(self):
        self.live: dict = {}  # storage pointer -> (weakref to the full local tensor, shard DTensor, placements)

    def add(self, source: DTensor, gathered: DTensor) -> None:
        local = gathered._local_tensor = _waited(gathered._local_tensor)
        self.live = {k: v for k, v in self.live.items() if v[0]() is not None}
        self.live[local.untyped_storage().data_ptr()] = (weakref.ref(local), source, gathered.placements)

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
        _, source, placements = entry
        return _Note(source, placements, t.size(), t.stride(), t.storage_offset())

    @staticmethod
    def unpack(saved):
        if not isinstance(saved, _Note):
            return saved
        with torch.no_grad():
            full = _waited(saved.source.redistribute(saved.source.device_mesh, saved.placements).to_local())
        return full.as_strided(saved.size, saved.stride, saved.offset)


@dataclass(frozen=True)
class _Note:
    source: DTensor
    placements: tuple
    size: torch.Size
    stride: tuple
    offset: int


def _waited(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself, once an in-flight functional collective producing it has finished."""
    return t.wait() if hasattr(t, "wait") else t


_regather = _Regather()


class _ToPartial(torch.autograd.Function):
    """Replicate -> Partial(sum) on some axes: rank 0 of the axis keeps the value.
    The gradient of a partial sum is the full gradient on every rank."""

    @staticmethod
    def forward(ctx, x: DTensor, want: tuple):
        mesh = x.device_mesh
        ctx.src = x.placements
        local = x.to_local()
        coord = mesh.get_coordinate()
        for axis, (a, b) in enumerate(zip(x.placements, want)):
            if isinstance(b, Partial) and not isinstance(a, Partial) and coord[axis] != 0:
                local = torch.zeros_like(local)
        return DTensor.from_local(local, mesh, want, run_check=False)

    @staticmethod
    def backward(ctx, grad: DTensor):
        target = tuple(Replicate() if isinstance(p, Partial) else p for p in ctx.src)
        return grad.redistribute(grad.device_mesh, target), None


def _grad_placements(placements, splits) -> tuple:
    """Where the gradient of an op input lands (see cost_models.resharding.grad_spec):
    ``splits[a]`` is true where the op splits its work over axis a or makes a
    Partial output (then a replicated input's local gradient is one summand)."""
    out = []
    for p, split in zip(placements, splits):
        if isinstance(p, Partial):
            out.append(Replicate())
        elif isinstance(p, Replicate) and split:
            out.append(Partial())
        else:
            out.append(p)
    return tuple(out)


def _unwrap(args, kwargs, out_spec: tuple, items: tuple = ()):
    """Local tensors of the DTensor arguments, with their gradient placements."""
    dts = [a for a in (*args, *kwargs.values()) if isinstance(a, DTensor)]
    for v in (*args, *kwargs.values()):
        if isinstance(v, (list, tuple)):
            dts.extend(a for a in v if isinstance(a, DTensor))
    splits = [any(isinstance(p, Shard) for p in (*(d.placements[a] for d in dts), out_spec[a], *(i[a] for i in items)))
              or isinstance(out_spec[a], Partial) for a in range(len(out_spec))]

    def un(a):
        if isinstance(a, DTensor):
            return a.to_local(grad_placements=_grad_placements(a.placements, splits))
        if isinstance(a, (list, tuple)):
            return type(a)(un(x) for x in a)
        return a

    return [un(a) for a in args], {k: un(v) for k, v in kwargs.items()}


def _wrap(out, spec: tuple, items: tuple = ()):
    """The local result as DTensors placed ``spec``, or its k-th output ``items[k]``."""
    mesh = _mesh()
    if isinstance(out, torch.Tensor):
        return DTensor.from_local(out, mesh, spec, run_check=False)
    if isinstance(out, (list, tuple)):
        return type(out)(_wrap(o, items[k] if items else spec) for k, o in enumerate(out))
    return out


def op(node: str, fn, spec: str | tuple, *args, **kwargs):
    """Run one op on the local shards; its output has the planned placements
    ``spec``, or output k ``spec[k]`` where its outputs are placed differently."""
    mesh = _mesh()
    items = tuple(_spec(s, mesh.ndim) for s in spec) if isinstance(spec, tuple) else ()
    out_spec = items[0] if items else _spec(spec, mesh.ndim)
    largs, lkwargs = _unwrap(args, kwargs, out_spec, items)
    hooks = contextlib.nullcontext()
    if _regather.involved((*largs, *lkwargs.values())):
        hooks = torch.autograd.graph.saved_tensors_hooks(_regather.pack, _regather.unpack)
    try:
        with hooks, _scoped("node", node):
            out = _local_impl(fn)(fn, mesh, out_spec, largs, lkwargs, args)
    except (RuntimeError, TypeError, ValueError, IndexError) as e:  # not checkpoint's control flow
        placements = [fmt_spec(a.placements) for a in args if isinstance(a, DTensor)]
        raise RuntimeError(f"autopar: node {node} ({fn}) failed on inputs placed {placements}: {e}") from e
    # A mean over a dim split n ways is the local mean / n, summed over ranks.
    avg = [a for a, p in enumerate(out_spec) if isinstance(p, Partial) and p.reduce_op == "avg"]
    if avg:
        out = out / math.prod(mesh.size(a) for a in avg)
        out_spec = tuple(Partial() if a in avg else p for a, p in enumerate(out_spec))
    return _wrap(out, out_spec, items)


def reshape(node: str, fn, spec: str, x: DTensor, local_shape: list, *rest):
    """A view/reshape/expand: the same op on the local shard, to the local shape."""
    mesh = _mesh()
    out_spec = _spec(spec, mesh.ndim)
    (lx,), _ = _unwrap((x,), {}, out_spec)
    if fn is torch.ops.aten.expand.default:
        out = lx.expand(local_shape)
    else:
        out = lx.reshape(local_shape)
    return _wrap(out, out_spec)


def checkpoint(layer, *args):
    """Run a layer keeping only its inputs; its forward (with its collectives,
    identically on every rank) runs again during backward."""
    mesh = _mesh()
    step_seed = getattr(_state, "step_seed", None)
    calls = []

    def run(*inputs):
        # the recomputation runs in backward, outside the forward's context:
        # it gets the forward's mesh and step seed back (the same random
        # draws); a recomputed layer gathers its parameters again anyway (no _Regather)
        calls.append(None)
        with _scoped("in_checkpoint", True), _scoped("recomputing", len(calls) > 1), use_mesh(mesh), \
                _scoped("step_seed", step_seed):
            return layer(*inputs)

    return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False)


def _recomputing() -> bool:
    """Whether ops run again in backward (the second run of a checkpoint)."""
    return bool(getattr(_state, "recomputing", False))


def state_update(node: str, fn, spec: str, *args, **kwargs):
    """An in-place op on a buffer (a step counter, an EMA, batch norm's count): run
    once per step, not again when its layer is recomputed (the buffer holds
    what the forward left, which is what the op returns)."""
    if _recomputing():
        return args[0]
    return op(node, fn, spec, *args, **kwargs)


def factory(fn, *args, **kwargs):
    """A tensor factory (arange, zeros, ...): the same replicated tensor on every
    rank, made on this rank's device."""
    mesh = _mesh()
    if "device" in kwargs:
        kwargs["device"] = torch.device(mesh.device_type, torch.cuda.current_device()) \
            if mesh.device_type == "cuda" else torch.device(mesh.device_type)
    return DTensor.from_local(fn(*args, **kwargs), mesh, [Replicate()] * mesh.ndim, run_check=False)


def random_factory(node: str, fn, *args, **kwargs):
    """A random factory (randn, rand, randint, ...): a replicated tensor, so
    every rank draws the same values, from the step's seed and the node's
    name (``_per_shard_rng``), whatever its own generator holds."""
    mesh = _mesh()
    with _scoped("node", node):
        return _per_shard_rng(_factory_impl)(fn, mesh, (Replicate(),) * mesh.ndim, args, kwargs, args)


def _factory_impl(fn, mesh, out_spec, args, kwargs, dargs):
    return factory(fn, *args, **kwargs)


def output(x):
    """A program output: the full (global) value on every rank.

    A partial sum (the loss of a batch split) returned from a forward whose
    backward follows (a ``GradSync`` step) is summed by an all-reduce that is
    not waited for here: the value waits for it when first read (``.item()``,
    printing, arithmetic), or at the end of backward, which needs only its
    shape. So reporting the loss does not stall every rank mid-step."""
    if isinstance(x, DTensor):
        mesh = _mesh()
        sync = getattr(_state, "grad_sync", None)
        group = _sum_group(mesh, x.placements) if sync is not None and torch.is_grad_enabled() else None
        if group is not None:
            grads = [Replicate() if isinstance(p, Partial) else p for p in x.placements]
            return _SumLater.apply(x.to_local(grad_placements=grads), group, sync)
        return x.redistribute(mesh, [Replicate()] * mesh.ndim).to_local()
    return x


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


def local_output(x):
    """A program output kept as this rank's shard (what a pipeline stage sends
    its peer in the next stage, which receives it in the same placements)."""
    return x.to_local() if isinstance(x, DTensor) else x


# --- local implementations that need to know their shard -----------------

def _plain(fn, mesh, out_spec, args, kwargs, dargs):
    return fn(*args, **kwargs)


def _reduce_over(t: torch.Tensor, mesh, axes: list) -> torch.Tensor:
    """Sum of ``t`` over the ranks of mesh ``axes``, with autograd (an
    all-reduce forward; the gradient, a partial sum on each rank, is
    all-reduced back)."""
    placements = [Partial() if a in axes else Replicate() for a in range(mesh.ndim)]
    dt = DTensor.from_local(t, mesh, placements, run_check=False)
    return dt.redistribute(mesh, [Replicate()] * mesh.ndim).to_local(grad_placements=placements)


def _mean_loss(fn, mesh, out_spec, args, kwargs, dargs):
    """cross_entropy / nll_loss with a mean over a batch split: this rank's loss
    sum over the global count of targets that are not ignore_index, so the
    Partial sum over ranks is the single-device mean. The count is all-reduced
    (a 4-byte all-reduce on the split axes, inside the op)."""
    partial = [a for a, p in enumerate(out_spec) if isinstance(p, Partial)]
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


def _affine_grid(fn, mesh, out_spec, args, kwargs, dargs):
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


def _embedding(fn, mesh, out_spec, args, kwargs, dargs):
    """Lookup in this rank's rows of the table: ids outside them give zeros, so
    over a vocabulary split the result is a Partial (sum). The padding id's
    lookups pass no gradient, whichever rank holds its row (the local call
    gets no padding_idx: the global one would name another row of a shard)."""
    w, idx, *rest = args
    index, count = _shard_index(mesh, dargs[0].placements, 0)
    if count == 1:
        return fn(w, idx, *rest, **kwargs)
    padding = rest[0] if rest else kwargs.get("padding_idx", -1)
    rest, kwargs = rest[1:], {k: v for k, v in kwargs.items() if k != "padding_idx"}
    start = index * w.shape[0]
    inside = (idx >= start) & (idx < start + w.shape[0])
    out = fn(w, torch.where(inside, idx - start, torch.zeros_like(idx)), -1, *rest, **kwargs)
    out = out * inside.unsqueeze(-1).to(out.dtype)
    return torch.where((idx == padding).unsqueeze(-1), out.detach(), out) if padding >= 0 else out


def _batch_norm(fn, mesh, out_spec, args, kwargs, dargs):
    """Training-mode batch norm on split inputs.

    The batch (or a spatial dim) split: synchronised statistics (as
    torch.nn.SyncBatchNorm): the per-channel mean and then the variance of
    the centred input are all-reduced over the split axes (two all-reduces of
    C values, inside the op), so every rank normalises with the statistics of
    the global batch. The channel split: the op on the rank's channels.

    Running statistics (the rule passes the buffers whole) are updated as one
    device would, momentum-weighted with the batch mean and unbiased
    variance; with the channels split each rank's update is all-gathered over
    those axes, so every rank holds every channel's. A recomputation
    (checkpoint.recomputing) leaves them alone: one update per forward."""
    names = ("input", "weight", "bias", "running_mean", "running_var", "training", "momentum", "eps")
    a = dict(zip(names, args))
    a.update({k: v for k, v in kwargs.items() if k in names})
    x, running = a["input"], (a.get("running_mean"), a.get("running_var"))
    placements = dargs[0].placements
    split = sorted({axis for axis, p in enumerate(placements) if isinstance(p, Shard) and p.dim != 1})
    channels = sorted({axis for axis, p in enumerate(placements) if isinstance(p, Shard) and p.dim == 1})
    tracked = a.get("training") and running[0] is not None
    if not a.get("training") or not (split or (tracked and (channels or _recomputing()))):
        return fn(*args, **kwargs)
    stats_placements = [Shard(0) if axis in channels else Replicate() for axis in range(mesh.ndim)]
    if tracked:  # this rank's channels of the running statistics, as a copy
        old = [DTensor.from_local(r, mesh, [Replicate()] * mesh.ndim, run_check=False)
               .redistribute(mesh, stats_placements).to_local().clone() for r in running]
    if split:
        dims = [d for d in range(x.ndim) if d != 1]
        count = math.prod(x.shape[d] for d in dims) * math.prod(mesh.size(axis) for axis in split)
        shape = [1, x.shape[1]] + [1] * (x.ndim - 2)
        mean = _reduce_over(x.sum(dims), mesh, split) / count
        centred = x - mean.view(shape)
        var = _reduce_over((centred * centred).sum(dims), mesh, split) / count
        out = centred * torch.rsqrt(var + a.get("eps", 1e-5)).view(shape)
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
                full = DTensor.from_local(mine, mesh, stats_placements, run_check=False).full_tensor() \
                    if channels else mine
                buffer.copy_(full.to(buffer.dtype))
    return out


def _grouped_mm(fn, mesh, out_spec, args, kwargs, dargs):
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
    row, rows = _shard_index(mesh, dargs[0].placements, 0)
    expert, experts = _shard_index(mesh, dargs[1].placements, 0)
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
    def run(fn, mesh, out_spec, args, kwargs, dargs):
        if not _draws(fn, args, kwargs):
            return impl(fn, mesh, out_spec, args, kwargs, dargs)
        index, _ = _shard_index(mesh, out_spec)
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
            return impl(fn, mesh, out_spec, args, kwargs, dargs)
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
    "transformers.grouped_mm_fallback.default": _grouped_mm,  # a library's op, by name (passes/rules/experts.py)
}
LOCAL_IMPLS.update({fn: _per_shard_rng(LOCAL_IMPLS.get(fn, _plain)) for fn in RANDOM_OPS})


def _local_impl(fn):
    """The local implementation of op ``fn``: its entry (by the op, or for a
    library's op by its name), or the op itself."""
    impl = LOCAL_IMPLS.get(fn)
    if impl is None and isinstance(fn, torch._ops.OpOverload):
        impl = LOCAL_IMPLS.get(str(fn))
    return impl or _plain
