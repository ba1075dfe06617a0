"""Gradient synchronisation in buckets.

Two moments reduce a step's gradients over the mesh axes that replicate
their parameters:

- during backward (a flat plan's step): ``GradSync``, DDP's reducer's way,
  buckets all-reduced asynchronously as their gradients are made, waited
  for at the end of backward, and ZeRO buckets' reduce-scatters with them;
  ``grad_sync`` opens it for one forward;
- after the last microbatch (a pipeline step): ``GradAccumulation`` defers
  each microbatch's reduction and reduces the sums once, per mesh axis as
  one flat buffer cut in buckets (``in_buckets``), and ``OptimizerShard``
  (ZeRO-1) reduce-scatters into and gathers from its optimizer's shard in
  the same buckets.

The emitted program only marks parameters (``spmd.param``); the step that
runs it picks the moment. The buckets are the ones the cost model prices
(cost_models/collectives.py: ``BUCKET_BYTES``, ``step_bucket_bytes``).
"""
from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field

import torch

from autopar.cost_models.collectives import BUCKET_BYTES, step_bucket_bytes
from autopar.moves import _all_gather, _group_over, _reduce_scatter, _scoped


class GradAccumulation:
    """Gradient accumulation over the microbatches of a pipeline step. Inside
    it, the reduction of a parameter's gradient over the mesh axes the
    parameter is replicated on is deferred: each microbatch adds its local
    partial sum to ``.grad``, and ``reduce()`` reduces the accumulated
    gradients once, after the last microbatch (what Megatron-LM and DDP's
    ``no_sync`` do), in buckets. Reductions into sharded parameters (ZeRO)
    still run in every microbatch's backward."""

    def __init__(self):
        self.pending: dict = {}  # parameter -> mesh axes its gradient is still a partial sum over

    def collecting(self):
        """Defer the reductions of the parameters used inside this ``with`` block."""
        return _scoped("accumulation", self)

    def reduce(self, mesh, scatter: dict | None = None, bucket_bytes: int | None = None) -> int:
        """Reduce every accumulated gradient over its deferred axes of ``mesh``
        (a DeviceMesh), except that a parameter in ``scatter`` (its optimizer
        state sharded over one axis: an ``OptimizerShard``) is
        reduce-scattered over that axis into its shard's gradient (or,
        summed already, sliced). Per mesh axis and dtype the gradients go
        as one flat buffer cut in ``bucket_bytes`` pieces (default
        ``step_bucket_bytes`` of the axis), one collective each, in the
        order the forward used them (``in_buckets``); returns how many
        collectives ran."""
        summed: dict = {}  # (axis, dtype) -> gradients to all-reduce over the axis
        scattered: dict = {}  # (summed over the axis here, axis, dtype) -> optimizer shards
        for prm, axes in self.pending.items():
            if prm.grad is None:
                continue
            if not prm.grad.is_contiguous():
                prm.grad = prm.grad.contiguous()
            own = (scatter or {}).get(prm)
            for a in axes:
                if own is None or a != own.axis:
                    summed.setdefault((a, prm.grad.dtype), []).append(prm.grad)
            if own is not None:
                scattered.setdefault((own.axis in axes, own.axis, prm.grad.dtype), []).append(own)
        self.pending.clear()
        count = sum(all_reduce_in_buckets(grads, mesh.get_group(a), bucket_bytes or step_bucket_bytes(
            mesh.size(a), grads[0].element_size())) for (a, _), grads in summed.items())
        for (reduced, _, _), shards in scattered.items():
            if reduced:
                count += reduce_scatter_in_buckets(shards, bucket_bytes or shards[0].bucket_bytes)
                continue
            for own in shards:  # every rank has the whole gradient already: its piece
                own.accumulate(own.piece(own.full.grad).clone())
                own.full.grad = None
        return count


def in_buckets(sizes: list, per: int) -> list:
    """Tensors of ``sizes`` elements laid end to end, as one flat buffer,
    and cut every ``per`` elements (Megatron-LM's contiguous gradient buffer
    in buckets): per bucket, its (tensor index, start, stop) ranges. A
    tensor may straddle two buckets, so n bytes make ceil(n / bucket)
    buckets, the count the pipeline search prices (``pipeline.stages``)."""
    buckets, current, room = [], [], per
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            take = min(room, size - start)
            current.append((i, start, start + take))
            start, room = start + take, room - take
            if room == 0:
                buckets.append(current)
                current, room = [], per
    return buckets + [current] if current else buckets


def all_reduce_in_buckets(grads: list, group, bucket_bytes: int) -> int:
    """All-reduce ``grads`` (contiguous, one dtype) over ``group`` in place,
    in buckets of ``bucket_bytes``; returns the number of collectives."""
    flats = [g.view(-1) for g in grads]
    buckets = in_buckets([f.numel() for f in flats], max(1, bucket_bytes // grads[0].element_size()))
    for bucket in buckets:
        if len(bucket) == 1 and bucket[0][1:] == (0, flats[bucket[0][0]].numel()):
            torch.distributed.all_reduce(flats[bucket[0][0]], group=group)  # one whole gradient: in place
            continue
        buf = torch.cat([flats[i][a:b] for i, a, b in bucket])
        torch.distributed.all_reduce(buf, group=group)
        offset = 0
        for i, a, b in bucket:
            flats[i][a:b].copy_(buf[offset:offset + b - a])
            offset += b - a
    return len(buckets)


# --- ZeRO-1: optimizer state sharded over one mesh axis (a pipeline's) -------------

class OptimizerShard:
    """ZeRO stage 1 for one parameter replicated over mesh ``axis``: the
    optimizer updates ``shard``, this rank's 1/n of the flattened parameter
    (padded to a multiple of n). After the microbatches the accumulated
    gradient is reduce-scattered over the axis into ``shard.grad``
    (``GradAccumulation.reduce``); before the next step the updated shards
    are all-gathered into the parameter the program uses
    (``all_gather_in_buckets``). Both run in buckets over all the axis's
    shards of one dtype, rank r's row of a bucket holding its pieces."""

    def __init__(self, full: torch.nn.Parameter, mesh, axis: int):
        self.full, self.axis = full, axis
        self.group = mesh.get_group(axis)
        self.n = mesh.size(axis)
        self.index = mesh.get_local_rank(axis)
        self.size = -(-full.numel() // self.n)
        self.shard = torch.nn.Parameter(torch.zeros(self.size, dtype=full.dtype, device=full.device))
        self.load()

    def load(self) -> None:
        """Take this rank's piece of ``full`` (after it was written)."""
        with torch.no_grad():
            self.shard.copy_(self.piece(self.full.detach()))

    def piece(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``t`` (shaped like the parameter), zero-padded."""
        return self.columns(t, 0, self.size)[self.index]

    def columns(self, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
        """Columns ``a:b`` of every rank's piece of ``t`` (shaped like the
        parameter) as an (n, b - a) tensor, zero-padded past its end: a view
        where the pieces are whole, else a copy of only those columns."""
        flat = t.reshape(-1)
        if flat.numel() == self.n * self.size:
            return flat.view(self.n, self.size)[:, a:b]
        out = flat.new_zeros(self.n, b - a)
        for r in range(self.n):
            lo, hi = r * self.size + a, min(r * self.size + b, flat.numel())
            if lo < hi:
                out[r, :hi - lo] = flat[lo:hi]
        return out

    @property
    def bucket_bytes(self) -> int:
        """The bucket its reduce-scatters and gathers share (``step_bucket_bytes``)."""
        return step_bucket_bytes(self.n, self.shard.element_size())

    def accumulate(self, piece: torch.Tensor) -> None:
        self.shard.grad = piece if self.shard.grad is None else self.shard.grad + piece

    def write(self, columns: torch.Tensor, a: int, b: int) -> None:
        """Columns ``a:b`` of every rank's piece (``columns``: n rows) into the parameter."""
        flat = self.full.detach().view(-1)
        if flat.numel() == self.n * self.size:
            flat.view(self.n, self.size)[:, a:b].copy_(columns)
            return
        for r in range(self.n):
            lo, hi = r * self.size + a, min(r * self.size + b, flat.numel())
            if lo < hi:
                flat[lo:hi].copy_(columns[r, :hi - lo])

    def full_grad(self) -> torch.Tensor:
        """The reduced gradient of the whole local parameter (collective; for checks)."""
        flat = self.shard.grad.new_empty(self.n * self.size)
        _all_gather(flat, self.shard.grad.detach(), group=self.group)
        return flat[:self.full.numel()].view_as(self.full)


def reduce_scatter_in_buckets(shards: list, bucket_bytes: int) -> int:
    """Each of ``shards``' parameter gradient (one axis, one dtype), summed
    over the axis, into this rank's piece (``OptimizerShard.accumulate``):
    their pieces laid end to end and cut in buckets of ``bucket_bytes`` of
    gradient, one reduce-scatter each; returns the number of collectives."""
    first = shards[0]
    grads = [s.full.grad for s in shards]
    mine = [g.new_empty(s.size) for g, s in zip(grads, shards)]
    buckets = in_buckets([s.size for s in shards], max(1, bucket_bytes // (first.n * grads[0].element_size())))
    for bucket in buckets:  # rank r's row: its columns of each piece in the bucket
        rows = torch.cat([shards[i].columns(grads[i], a, b) for i, a, b in bucket], dim=1)
        out = rows.new_empty(rows.shape[1])
        _reduce_scatter(out, rows.reshape(-1), group=first.group)
        offset = 0
        for i, a, b in bucket:
            mine[i][a:b] = out[offset:offset + b - a]
            offset += b - a
    for s, piece in zip(shards, mine):
        s.accumulate(piece)
        s.full.grad = None
    return len(buckets)


def all_gather_in_buckets(shards: list, bucket_bytes: int) -> int:
    """The updated ``shards`` (one axis, one dtype) gathered into their
    parameters, in the buckets ``reduce_scatter_in_buckets`` uses; returns
    the number of collectives."""
    first = shards[0]
    buckets = in_buckets([s.size for s in shards],
                         max(1, bucket_bytes // (first.n * first.shard.element_size())))
    with torch.no_grad():
        for bucket in buckets:
            flat = torch.cat([shards[i].shard.detach()[a:b] for i, a, b in bucket])
            out = flat.new_empty(first.n * flat.numel())
            _all_gather(out, flat, group=first.group)
            rows, offset = out.view(first.n, -1), 0
            for i, a, b in bucket:
                shards[i].write(rows[:, offset:offset + b - a], a, b)
                offset += b - a
    return len(buckets)


def by_axis(shards) -> list:
    """Optimizer shards grouped per (axis, dtype), in order: the groups the bucketed collectives run over."""
    groups: dict = {}
    for s in shards:
        groups.setdefault((s.axis, s.shard.dtype), []).append(s)
    return list(groups.values())


DDP_FIRST_BUCKET_BYTES = 2**20
"""The cap of DDP's first bucket (the last parameters, whose gradients backward
makes first) under the default bucket size: ``torch.distributed.
_DEFAULT_FIRST_BUCKET_BYTES``, 1 MiB, so that the first all-reduce starts
early in backward."""


def grad_sync(mesh, bucket_bytes: int | None = BUCKET_BYTES):
    """Inside this ``with`` block (one forward), the gradients of parameters
    replicated over mesh axes are reduced by one ``GradSync`` during the
    backward that follows; ``bucket_bytes`` None: one blocking all-reduce per
    parameter in backward (``grad_allreduce``), as before buckets."""
    return _scoped("grad_sync", GradSync(mesh, bucket_bytes) if bucket_bytes else None)


class GradSync:
    """Gradient synchronisation of replicated parameters, the way DDP's reducer
    does it (Li et al., VLDB 2020, sec. 3.2): the parameters a forward uses
    (``param``) are put in buckets of about ``bucket_bytes`` (the first, as
    DDP's, of about 1 MiB under the default size), in reverse order
    of first use (the order backward makes their gradients), one mesh-axis
    group and dtype per bucket. Backward leaves each gradient a local partial
    sum (see ``param``); when every gradient of
    a bucket has been accumulated, the bucket is flattened and all-reduced
    asynchronously while backward goes on (one collective over all of its
    mesh axes: their flattened group, ``_group_over``), and at the end of backward (an
    autograd engine callback) every bucket is waited on and written back to
    ``.grad``. Buckets launch in index order on every rank, so their
    collectives match whatever order autograd finishes gradients in.

    A gradient accumulated over several backwards keeps its exact sum: the
    ``.grad`` already there is set aside before the new one is accumulated,
    and added back to the reduced new one (as one device adds them).

    The reduce-scatters of parameters gathered in buckets (ZeRO:
    ``spmd.gather_params``) whose pieces are their shards' whole gradients
    are started where backward makes the bucket's gradients and waited for
    here too (``scattered``), as FSDP2 does, so they run while backward goes
    on: the overlap the cost model prices where the cluster runs collectives
    under compute."""

    def __init__(self, mesh, bucket_bytes: int):
        self.mesh, self.bucket_bytes = mesh, bucket_bytes
        self.params: dict = {}  # local parameter -> mesh axes to reduce over, in order of first use
        self.buckets: list | None = None
        self.ready: set = set()
        self.stashed: dict = {}
        self.launched = 0
        self.queued = False
        self.pending: list = []  # outputs still being summed (output(), _SumLater)
        self.scatters: list = []  # (shards, the call that finishes their reduce-scatter), in backward's order

    def add(self, local: torch.Tensor, axes: tuple) -> None:
        local._autopar_sync = self  # until a later forward's, so a backward through this graph reduces here
        if local in self.params:  # tied weights: one tensor, one gradient
            return
        self.params[local] = axes
        _group_over(self.mesh, tuple(sorted(axes)))  # made in forward, on every rank alike: backward reduces over it
        if getattr(local, "_autopar_sync_hooks", None) is None:
            ref = weakref.ref(local)
            local._autopar_sync_hooks = (local.register_hook(functools.partial(_arriving, ref)),
                                         local.register_post_accumulate_grad_hook(_accumulated))

    def _plan(self) -> list:
        buckets, current = [], {}
        first = min(self.bucket_bytes, DDP_FIRST_BUCKET_BYTES) if self.bucket_bytes == BUCKET_BYTES \
            else self.bucket_bytes
        for local, axes in reversed(self.params.items()):
            key = (axes, local.dtype)
            bucket = current.get(key)
            if bucket is None or bucket.nbytes >= (first if bucket is buckets[0] else self.bucket_bytes):
                bucket = current[key] = _Bucket(axes)
                buckets.append(bucket)
            bucket.members.append(local)
            bucket.nbytes += local.numel() * local.element_size()
        return buckets

    def _queue(self) -> None:
        """The end of this backward waits for what it started (``finish``)."""
        if not self.queued:
            self.queued = True
            self.buckets = self._plan()
            torch.autograd.Variable._execution_engine.queue_callback(self.finish)

    def arriving(self, local: torch.Tensor) -> None:
        """A gradient for ``local`` is about to be accumulated."""
        self._queue()
        if local.grad is not None:
            self.stashed[local], local.grad = local.grad, None

    def scattered(self, shards: tuple, finish) -> None:
        """The reduce-scatter of ``shards``' gradients is started; ``finish()``
        gives their pieces, added to ``.grad`` at the end of backward."""
        self._queue()
        self.scatters.append((shards, finish))

    def accumulated(self, local: torch.Tensor) -> None:
        self.ready.add(local)
        while self.launched < len(self.buckets) and all(m in self.ready for m in self.buckets[self.launched].members):
            self._launch(self.buckets[self.launched])

    def _launch(self, bucket) -> None:
        grads = [m.grad.reshape(-1) if m in self.ready else m.new_zeros(m.numel()) for m in bucket.members]
        bucket.flat = torch.cat(grads) if len(grads) > 1 else grads[0]  # one contiguous gradient: in place
        group = _group_over(self.mesh, tuple(sorted(bucket.axes)))
        bucket.work = torch.distributed.all_reduce(bucket.flat, group=group, async_op=True)
        self.launched += 1

    def finish(self) -> None:
        """End of backward: launch what is left, wait, write the sums back."""
        while self.launched < len(self.buckets):
            self._launch(self.buckets[self.launched])
        for bucket in self.buckets:
            bucket.work.wait()
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
        for shards, done in self.scatters:
            for shard, piece in zip(shards, done()):
                if shard.grad is None:
                    shard.grad = piece
                else:
                    shard.grad.add_(piece)
        for value in self.pending:
            value.wait()
        # ready for another backward through the same graph (retain_graph=True)
        self.buckets, self.ready, self.launched, self.queued, self.scatters = None, set(), 0, False, []


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
