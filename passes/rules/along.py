"""Ops that work along some dims and treat every other dim independently:
statistics and selections over dims (var, std, logsumexp, max/min/argmax over a
dim, prod, all/any, topk), scans (cumsum, cumprod), order and position ops
(sort, flip, roll, tril, triu), padding, repetition. Splitting a dim they do
not work along is exact; splitting one they do would change the result, so
those rows do not exist.
"""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.rules.reduction import reduction_rows
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import P, R, Row, S


def _dims(value, nd: int) -> list:
    """The dims an op works along: an int, a list, or None or an empty list for all."""
    if value is None or (not isinstance(value, int) and len(value) == 0):
        return list(range(nd))
    return sorted({d % nd for d in ([value] if isinstance(value, int) else value)})


# op -> (position of ``dim``, position of ``keepdim``): a reduction with no Partial form
_REDUCE_ALONG = {
    aten.var.correction: (1, 3), aten.std.correction: (1, 3), aten.var.dim: (1, 3), aten.std.dim: (1, 3),
    aten.var_mean.correction: (1, 3), aten.std_mean.correction: (1, 3), aten.logsumexp.default: (1, 2),
    aten.linalg_vector_norm.default: (2, 3), aten.prod.dim_int: (1, 2), aten.all.dim: (1, 2),
    aten.any.dim: (1, 2), aten.argmax.default: (1, 2), aten.argmin.default: (1, 2), aten.max.dim: (1, 2),
    aten.min.dim: (1, 2), aten.var_mean.dim: (1, 3), aten.median.dim: (1, 2), aten.mode.default: (1, 2),
    aten.kthvalue.default: (2, 3), aten.aminmax.default: (1, 2), aten.linalg_matrix_norm.default: (2, 3),
    aten.linalg_matrix_norm.str_ord: (2, 3), aten.linalg_norm.default: (2, 3), aten.nanmean.default: (1, 2),
}
_DIM_DEFAULT = {aten.mode.default: -1, aten.kthvalue.default: -1, aten.linalg_matrix_norm.default: [-2, -1],
                aten.linalg_matrix_norm.str_ord: [-2, -1]}
"""Where ``dim`` has a default other than every dim."""


@register(*_REDUCE_ALONG)
def reduce_along_rule(info: OpInfo):
    """var/std (and their _mean pairs), logsumexp, vector and matrix norms,
    prod, all/any, argmax/argmin, max/min, aminmax, median, mode and the k-th
    value over dims: split the kept dims (a split reduced dim would need the
    other ranks' values, not a sum of local results)."""
    dim_at, keep_at = _REDUCE_ALONG[info.target]
    dims = info.arg(dim_at, "dim", _DIM_DEFAULT.get(info.target))
    x = info.inputs[0]
    if info.target in (aten.argmax.default, aten.argmin.default) and dims is None:
        return [Row(R, (R,))]  # over the flattened tensor
    return reduction_rows(info, _dims(dims, x.ndim), bool(info.arg(keep_at, "keepdim", False)), None)


@register(aten.sort.default, aten.argsort.default, aten.cumprod.default, aten.logcumsumexp.default,
          aten.cummax.default, aten.cummin.default)
def along_one_dim_rule(info: OpInfo):
    """sort/argsort (dim -1 by default), cumprod, logcumsumexp, cummax and
    cummin along ``dim``: any other dim splits."""
    default = -1 if info.target in (aten.sort.default, aten.argsort.default) else None
    return other_dims_rows(info, _dims(info.arg(1, "dim", default), info.inputs[0].ndim))


@register(aten.glu.default, aten.linalg_cross.default)
def along_dim_default_last_rule(info: OpInfo):
    """glu halves ``dim`` (default -1) into value and gate; cross takes the
    3-vectors along ``dim`` (default -1), its two inputs alike: both split
    any other dim."""
    if any(m.shape != info.inputs[0].shape for m in info.inputs):
        return [Row(R, (R,) * len(info.inputs))]  # broadcast operands of cross
    return other_dims_rows(info, _dims(info.arg(1 if info.target is aten.glu.default else 2, "dim", -1),
                                       info.inputs[0].ndim), len(info.inputs))


@register(aten.fft_fft.default, aten.fft_ifft.default, aten.fft_rfft.default, aten.fft_irfft.default,
          aten.fft_hfft.default, aten.fft_ihfft.default)
def fft_rule(info: OpInfo):
    """A one-dimensional FFT along ``dim`` (default -1): any other dim splits."""
    return other_dims_rows(info, _dims(info.arg(2, "dim", -1), info.inputs[0].ndim))


@register(aten.diff.default)
def diff_rule(info: OpInfo):
    """diff(x, n, dim=-1, prepend, append): differences along ``dim``; any
    other dim splits, with the prepended and appended tensors."""
    x = info.inputs[0]
    if any(m.ndim != x.ndim for m in info.inputs[1:]):
        return [Row(R, (R,) * len(info.inputs))]
    return other_dims_rows(info, _dims(info.arg(2, "dim", -1), x.ndim), len(info.inputs))


_MATRIX_FUNCTIONS = [
    aten.linalg_cholesky.default, aten.linalg_det.default, aten.linalg_inv.default, aten.linalg_matrix_exp.default,
    aten.linalg_qr.default, aten.linalg_svdvals.default, aten.logdet.default,
]


@register(*_MATRIX_FUNCTIONS)
def matrix_function_rule(info: OpInfo):
    """A function of each matrix (the last two dims) of a batch: the batch
    dims split (det, logdet and svdvals drop or replace the matrix dims,
    behind the batch dims)."""
    x = info.inputs[0]
    return other_dims_rows(info, [x.ndim - 2, x.ndim - 1])


@register(aten.linalg_solve.default)
def solve_rule(info: OpInfo):
    """solve(A (*, n, n), B (*, n, k) or (*, n)): the batch dims split, A and B
    with them where B has them all (B broadcast against A: replicated)."""
    a, b = info.inputs
    batch = a.ndim - 2
    if b.shape[:batch] != a.shape[:batch] or b.ndim not in (a.ndim, a.ndim - 1):
        return [Row(R, (R, R))]
    return other_dims_rows(info, [batch, batch + 1], 2)


@register(aten.channel_shuffle.default)
def channel_shuffle_rule(info: OpInfo):
    """Permutes the channels (dim 1): any other dim splits."""
    return other_dims_rows(info, [1])


@register(aten.repeat_interleave.self_int)
def repeat_interleave_rule(info: OpInfo):
    """Each element repeated along ``dim`` (without one, the flattened tensor):
    any other dim splits."""
    dim = info.arg(2, "dim")
    if dim is None:
        return [Row(R, (R,))]
    return other_dims_rows(info, dim % info.inputs[0].ndim)


@register(aten.unfold.default)
def unfold_windows_rule(info: OpInfo):
    """x.unfold(dim, size, step): windows along ``dim`` in a new last dim; any
    other dim splits (it keeps its position)."""
    return other_dims_rows(info, info.arg(1, "dimension") % max(1, info.inputs[0].ndim))


@register(aten.flip.default)
def flip_rule(info: OpInfo):
    """Reverses ``dims``: any other dim splits."""
    return other_dims_rows(info, _dims(info.arg(1, "dims"), info.inputs[0].ndim))


@register(aten.roll.default)
def roll_rule(info: OpInfo):
    """roll(x, shifts, dims): without dims it rolls the flattened tensor."""
    return other_dims_rows(info, _dims(info.arg(2, "dims", []), info.inputs[0].ndim))


@register(aten.tril.default, aten.triu.default)
def triangle_rule(info: OpInfo):
    """tril/triu keep a triangle of the last two dims: the leading dims split."""
    nd = info.inputs[0].ndim
    return other_dims_rows(info, [nd - 2, nd - 1])


@register(aten.constant_pad_nd.default, aten.pad.default, aten.reflection_pad1d.default,
          aten.reflection_pad2d.default, aten.reflection_pad3d.default, aten.replication_pad1d.default,
          aten.replication_pad2d.default, aten.replication_pad3d.default)
def pad_rule(info: OpInfo):
    """Padding of the last len(pad) / 2 dims: the leading dims split."""
    nd = info.inputs[0].ndim
    pad = info.arg(1, "pad")  # the reflection and replication pads call it "padding"
    padded = len(pad if pad is not None else info.kwargs["padding"]) // 2
    return other_dims_rows(info, list(range(nd - padded, nd)))


@register(aten.repeat.default)
def repeat_rule(info: OpInfo):
    """x.repeat(r...): a dim repeated once keeps its shard (leading new dims shift it)."""
    x, reps = info.inputs[0], list(info.arg(1, "repeats"))
    lead = len(reps) - x.ndim
    rows = [Row(S(d + lead), (S(d),)) for d in range(x.ndim) if reps[d + lead] == 1 and x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.topk.default)
def topk_rule(info: OpInfo):
    """topk(self, k, dim=-1) -> (values, indices): any dim but the selected one splits."""
    x = info.inputs[0]
    dim = info.arg(2, "dim", -1) % max(x.ndim, 1)
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if d != dim and x.shape[d] > 1]
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
