"""Local implementations of the ops that need to know their shard.

Most ops run on this rank's shards exactly as on whole tensors and the
emitted program calls them as they are (``runs_as_is``). The ops here do
not: a mean loss over a split batch, an embedding over a split vocabulary,
a batch norm whose statistics span a split batch, grouped expert GEMMs with
their tokens routed by all-to-alls, an index into a split dim, causal
attention with the queries' sequence split (context parallelism, balanced
where the chunks halve), and every random op, which draws from a generator
seeded by the step (``StepSeed``), the node and the shard's index, so that
shards draw independently and replicas alike. ``LOCAL_IMPLS`` maps each op
to its implementation; ``autopar.spmd.op`` looks it up.
"""
from __future__ import annotations

import functools
import math
import zlib

import torch
import torch.nn.attention.bias
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.passes.rules.attention import zigzag_axes
from autopar.passes.rules.experts import dispatch_axes
from autopar.passes.rules.indexing import routed_axes
from autopar.moves import _GatherOver, _group_over, _recomputing, _redistribute, _reduce_over, _scoped, _state


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
