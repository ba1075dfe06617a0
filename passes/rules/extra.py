"""Ops the example models need beyond the core families: batch, instance and
group norm, advanced indexing, resampling (interpolate), pooling, einsum,
routing (topk, one_hot), scans, broadcast_tensors and the
gather/scatter index ops.

Every row is exact when the op runs on the local shards with its own
(global) non-tensor arguments, which is how the emitted program runs it.
"""
from __future__ import annotations

import string

import torch
from torch.ops import aten

from autopar.errors import AutoparError
from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.rules.matmul import einsum_rows
from autopar.passes.rules.pointwise import broadcast_rows
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import P, R, Row, S


# --- normalisation ---------------------------------------------------------


def _norm_tensor_args(info: OpInfo) -> list:
    """Argument positions of batch or instance norm's tensor inputs after the
    input: weight 1, bias 2, running_mean 3, running_var 4, those not None."""
    return [i for i, name in enumerate(("weight", "bias", "running_mean", "running_var"), 1)
            if info.arg(i, name) is not None]


@register(aten.batch_norm.default)
def batch_norm_rule(info: OpInfo):
    """batch_norm(input, weight, bias, running_mean, running_var, training, momentum, eps, cudnn).

    Channel split (dim 1) is exact in both modes: statistics are per channel.
    In eval mode the op is a per-channel affine map and any dim may be split.
    In training the statistics are over the batch and spatial dims: a split
    of those runs as synchronised batch norm (autopar/spmd.py, _batch_norm:
    the per-channel mean and variance all-reduced over the split axes inside
    the op). Training also updates the running statistics in place: those
    inputs are the buffers themselves (replicated), which every rank updates
    with the global batch's statistics of every channel."""
    x = info.inputs[0]
    aux = _norm_tensor_args(info)
    updated = {3, 4} if info.arg(5, "training", False) else set()
    rows = []
    if x.ndim >= 2 and x.shape[1] > 1:
        rows.append(Row(S(1), (S(1),) + tuple(R if i in updated else S(0) for i in aux)))
    rows += [Row(S(d), (S(d),) + (R,) * len(aux)) for d in range(x.ndim) if d != 1 and x.shape[d] > 1]
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.instance_norm.default)
def instance_norm_rule(info: OpInfo):
    """instance_norm(input, weight, bias, running_mean, running_var, use_input_stats, momentum, eps, cudnn).

    With the input's statistics (training, or no running statistics) they are
    per sample and channel: the batch and the channels split (weight and bias
    with the channels). Updating running statistics averages them over the
    batch, in place: replicated only. With running statistics in eval the op
    is a per-channel affine map: any dim splits."""
    x = info.inputs[0]
    aux = _norm_tensor_args(info)
    uses_input = info.arg(5, "use_input_stats", True)
    if uses_input and 3 in aux:
        return [Row(R, (R,) * len(info.inputs))]
    rows = []
    if x.ndim >= 2 and x.shape[1] > 1:
        rows.append(Row(S(1), (S(1),) + (S(0),) * len(aux)))
    split = [0] if uses_input else [d for d in range(x.ndim) if d != 1]
    rows += [Row(S(d), (S(d),) + (R,) * len(aux)) for d in split if x.shape[d] > 1]
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.group_norm.default)
def group_norm_rule(info: OpInfo):
    """group_norm(input, num_groups, weight, bias, eps): statistics per sample, so
    the batch splits; channel splits would change the local group count."""
    x = info.inputs[0]
    n = len(info.inputs)
    rows = [Row(S(0), (S(0),) + (R,) * (n - 1))] if x.ndim >= 2 and x.shape[0] > 1 else []
    rows.append(Row(R, (R,) * n))
    return rows


# --- advanced indexing -----------------------------------------------------


@register(aten.index.Tensor, aten._unsafe_index.Tensor)
def index_rule(info: OpInfo):
    """x[..., idx, ...]: index tensors on a block of adjacent dims (None, i.e.
    ``:``, elsewhere). The dims not indexed split and keep their place around
    the index's dims; the index tensors stay whole, as their values are global
    positions. Indexing is linear in x: a Partial x gives a Partial result.
    Index tensors on dims that are not adjacent (which moves their dims to
    the front) get the replicated row only."""
    x = info.inputs[0]
    n_idx = len(info.inputs) - 1
    indexed = [d for d, t in enumerate(info.arg(1, "indices")) if t is not None]
    rows = []
    if indexed and indexed == list(range(indexed[0], indexed[-1] + 1)):
        index_ndim = info.out.ndim - (x.ndim - len(indexed))
        for d in range(x.ndim):
            if d in indexed or x.shape[d] == 1:
                continue
            out = d if d < indexed[0] else d - len(indexed) + index_ndim
            rows.append(Row(S(out), (S(d),) + (R,) * n_idx))
        rows.append(Row(P, (P,) + (R,) * n_idx))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.index_put.default)
def index_put_rule(info: OpInfo):
    """x[idx] = v (or += with accumulate), out of place: index tensors on a
    block of adjacent dims, as ``index_rule``. A dim of x not indexed splits,
    and the values with it where they have that dim at full size (where they
    broadcast along it, whole); the index tensors stay whole."""
    x, values = info.inputs[0], info.inputs[-1]
    indices = [t for t in info.arg(1, "indices") if t is not None]
    indexed = [d for d, t in enumerate(info.arg(1, "indices")) if t is not None]
    n_idx = len(info.inputs) - 2
    rows = []
    if indexed and indexed == list(range(indexed[0], indexed[-1] + 1)) and all(
            not t.meta.dtype.is_floating_point and t.meta.dtype != torch.bool for t in indices):
        index_ndim = max(t.meta.ndim for t in indices)
        result_ndim = x.ndim - len(indexed) + index_ndim  # x[idx]'s shape, which v broadcasts to
        for d in range(x.ndim):
            if d in indexed or x.shape[d] == 1:
                continue
            j = (d if d < indexed[0] else d - len(indexed) + index_ndim) - (result_ndim - values.ndim)
            v = R if j < 0 or values.shape[j] == 1 else S(j) if values.shape[j] == x.shape[d] else None
            if v is not None:
                rows.append(Row(S(d), (S(d),) + (R,) * n_idx + (v,)))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.index_add.default, aten.index_copy.default)
def index_add_rule(info: OpInfo):
    """index_add / index_copy(x, dim, index, source): rows of ``source`` go
    to positions ``index`` along ``dim`` of x; any other dim splits, x and
    source with it, the index whole."""
    x = info.inputs[0]
    dim = info.arg(1, "dim") % x.ndim
    rows = [Row(S(d), (S(d), R, S(d))) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    rows.append(Row(R, (R, R, R)))
    return rows


@register(aten.bucketize.Tensor)
def bucketize_rule(info: OpInfo):
    """The bucket of each element among replicated boundaries: x splits freely."""
    x = info.inputs[0]
    return [Row(S(d), (S(d), R)) for d in range(x.ndim) if x.shape[d] > 1] + [Row(R, (R, R))]


@register(aten.searchsorted.Tensor)
def searchsorted_rule(info: OpInfo):
    """searchsorted(sorted_sequence, values): with one (1-D) sequence, the
    values split freely; a batch of sequences splits with the values on the
    leading dims."""
    seq, values = info.inputs
    if seq.ndim == 1:
        rows = [Row(S(d), (R, S(d))) for d in range(values.ndim) if values.shape[d] > 1]
    else:
        rows = [Row(S(d), (S(d), S(d))) for d in range(seq.ndim - 1) if seq.shape[d] > 1]
    return rows + [Row(R, (R, R))]


@register(aten.affine_grid_generator.default)
def affine_grid_rule(info: OpInfo):
    """F.affine_grid(theta (N, 2, 3), size): each sample's grid from its own
    theta (the runtime gives ``size`` the local batch, spmd._affine_grid)."""
    theta = info.inputs[0]
    return ([Row(S(0), (S(0),))] if theta.shape[0] > 1 else []) + [Row(R, (R,))]


# --- resampling ------------------------------------------------------------

_UPSAMPLE = [
    aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec,
    aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact3d.vec,
    aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec,
    aten.upsample_bicubic2d.vec,
]


@register(*_UPSAMPLE)
def upsample_rule(info: OpInfo):
    """F.interpolate on (N, C, *spatial): each output position mixes input
    positions of its own sample and channel only, so batch and channel dims
    split freely; it is a linear map, so a Partial (sum) input gives a
    Partial output."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in (0, 1) if x.shape[d] > 1]
    rows += [Row(P, (P,)), Row(R, (R,))]
    return rows


@register(aten.grid_sampler.default)
def grid_sampler_rule(info: OpInfo):
    """F.grid_sample(x (N, C, *in), grid (N, *out, k)) -> (N, C, *out): each
    output point reads its own sample's channels at one place: N splits with
    both, C with x (the grid whole), an output position with the grid (x
    whole). The input's positions do not split (any point may read any)."""
    x, grid = info.inputs
    rows = [Row(S(0), (S(0), S(0)))] if x.shape[0] > 1 else []
    if x.shape[1] > 1:
        rows.append(Row(S(1), (S(1), R)))
    rows += [Row(S(d + 1), (R, S(d))) for d in range(1, grid.ndim - 1) if grid.shape[d] > 1]
    rows.append(Row(R, (R, R)))
    return rows


# --- pooling ---------------------------------------------------------------

_SPATIAL = {
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2, aten.adaptive_avg_pool3d.default: 3,
    aten.adaptive_max_pool1d.default: 1, aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
    aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
    aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
    aten.max_pool1d_with_indices.default: 1, aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
}
_AVERAGING = {aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default,
              aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default}


@register(*_SPATIAL)
def pool_rule(info: OpInfo):
    """Pooling mixes only spatial positions: batch and channel dims split freely;
    averaging is linear, so a Partial (sum) input gives a Partial output."""
    x = info.inputs[0]
    lead = x.ndim - _SPATIAL[info.target]  # 2 for (N, C, *spatial), 1 for (C, *spatial)
    rows = [Row(S(d), (S(d),)) for d in range(lead) if x.shape[d] > 1]
    if info.target in _AVERAGING:
        rows.append(Row(P, (P,)))
    rows.append(Row(R, (R,)))
    return rows


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(info: OpInfo):
    """(*, C r^2, H, W) <-> (*, C, H r, W r): each output channel gathers r^2
    consecutive input channels, each input row and column r consecutive
    output ones, so a contiguous block of any dim maps to a contiguous block
    of the same dim; the divisibility check on both shapes keeps a block of
    channels whole (C divides by the axis)."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1 and info.out.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.im2col.default)
def im2col_rule(info: OpInfo):
    """F.unfold, (N, C, H, W) -> (N, C kh kw, L): sliding windows within each
    image and channel; output channel c kh kw + k comes from input channel c,
    so the batch and channel blocks split alike."""
    nd = info.inputs[0].ndim
    return other_dims_rows(info, [nd - 2, nd - 1])


@register(aten.col2im.default)
def col2im_rule(info: OpInfo):
    """F.fold, (N, C kh kw, L) -> (N, C, H, W): sums overlapping windows
    within each image and channel, the inverse layout of im2col, so the
    batch and channel blocks split alike (the divisibility check on the
    output keeps each channel's kh kw rows together)."""
    return other_dims_rows(info, [info.inputs[0].ndim - 1])


# --- einsum ----------------------------------------------------------------


def normalize_equation(equation: str, ndims: list[int]) -> str:
    """Explicit, ellipsis-free form of an einsum equation: 'bij,bjk' -> 'bij,bjk->bik',
    '...ij,jk->...ik' with a 3-D first operand -> 'Aij,jk->Aik'."""
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(ndims):
        raise AutoparError(f"einsum equation {equation!r} names {len(operands)} operands; the call passes {len(ndims)}")
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    widths = [n - len(op.replace("...", "")) if "..." in op else 0 for op, n in zip(operands, ndims)]
    width = max(widths, default=0)
    ell = "".join(spare[:width])
    operands = [op.replace("...", ell[width - w:]) for op, w in zip(operands, widths)]
    if arrow:
        out = out.replace("...", ell)
    else:
        counts = {c: "".join(operands).count(c) for c in "".join(operands)}
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return ",".join(operands) + "->" + out


@register(aten.einsum.default, matmul=True)
def einsum_rule(info: OpInfo):
    """einsum(equation, tensors): split any output letter (operands without it
    stay replicated) or any summed letter (the output is Partial). An operand
    that repeats a letter (a diagonal) is only replicated."""
    equation = normalize_equation(info.arg(0, "equation"), [m.ndim for m in info.inputs])
    operands = equation.split("->")[0].split(",")
    if any(len(set(op)) != len(op) for op in operands):
        return [Row(R, (R,) * len(info.inputs))]
    return einsum_rows(equation, info)


# --- routing ---------------------------------------------------------------


@register(aten.topk.default)
def topk_rule(info: OpInfo):
    """topk(self, k, dim=-1) -> (values, indices): any dim but the selected one splits."""
    x = info.inputs[0]
    dim = info.arg(2, "dim", -1) % max(x.ndim, 1)
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.one_hot.default)
def one_hot_rule(info: OpInfo):
    """one_hot(self, num_classes): index dims split. With num_classes=-1 the
    class count comes from the data, which differs per shard: replicate only."""
    x = info.inputs[0]
    rows = []
    if info.arg(1, "num_classes", -1) > 0:
        rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.cumsum.default)
def cumsum_rule(info: OpInfo):
    """cumsum(self, dim): the scanned dim stays whole; a floating-point scan is
    linear, so a Partial input gives a Partial output."""
    x = info.inputs[0]
    dim = info.arg(1, "dim") % max(x.ndim, 1)
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    if x.dtype.is_floating_point and info.arg(2, "dtype") is None:
        rows.append(Row(P, (P,)))
    rows.append(Row(R, (R,)))
    return rows


@register(aten.broadcast_tensors.default)
def broadcast_tensors_rule(info: OpInfo):
    """broadcast_tensors(tensors) -> one tensor per input, all of the common shape.

    Every output takes the row's placement: an input replicated along a split
    output dim, broadcast against the local shard of another input, gives
    exactly the local shard of its broadcast."""
    rows = broadcast_rows(info)
    if all(m.shape == info.out.shape for m in info.inputs):
        rows.append(Row(P, (P,) * len(info.inputs)))
    return rows


# --- gather / scatter ------------------------------------------------------


def _aligned_rows(info: OpInfo, dim: int, n_in: int) -> list[Row]:
    """Split a dim other than ``dim`` on which every input has the output's size."""
    out = info.out.shape
    rows = [Row(S(d), (S(d),) * n_in) for d in range(len(out))
            if d != dim and out[d] > 1 and all(m.ndim == len(out) and m.shape[d] == out[d] for m in info.inputs)]
    rows.append(Row(R, (R,) * n_in))
    return rows


@register(aten.gather.default)
def gather_rule(info: OpInfo):
    """gather(self, dim, index): out[i][j] = self[index[i][j]][j] along dim."""
    x = info.inputs[0]
    return _aligned_rows(info, info.arg(1, "dim") % x.ndim, 2)


@register(aten.scatter.src, aten.scatter.value, aten.scatter_add.default, aten.scatter_reduce.two)
def scatter_rule(info: OpInfo):
    """scatter(self, dim, index, src or value), scatter_add and scatter_reduce
    (sum, prod, mean, amax, amin: a GNN's aggregation): the scattered dim
    stays whole; the others split, self, index and src alike."""
    x = info.inputs[0]
    return _aligned_rows(info, info.arg(1, "dim") % x.ndim, len(info.inputs))


@register(aten.index_select.default)
def index_select_rule(info: OpInfo):
    """index_select(self, dim, index): other dims split with self; or the index
    splits and the output follows on ``dim``."""
    x, index = info.inputs
    dim = info.arg(1, "dim") % x.ndim
    rows = [Row(S(d), (S(d), R)) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
    if index.ndim == 1 and index.shape[0] > 1:
        rows.append(Row(S(dim), (R, S(0))))
    rows.append(Row(R, (R, R)))
    return rows
