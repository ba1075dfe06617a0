"""Ops that work along some dims and treat every other dim independently:
statistics and selections over dims (var, std, logsumexp, max/min/argmax over a
dim, prod, all/any), order and position ops (sort, cumprod, flip, roll, tril,
triu), padding, repetition. Splitting a dim they do not work along is exact;
splitting one they do would change the result, so those rows do not exist.
Also fills and the factories that take only a dtype and device from a tensor.
"""
from __future__ import annotations

from torch.ops import aten

from autopar.passes.rules import OpInfo, register
from autopar.passes.rules.reduction import reduction_rows
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import R, Row, S


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
    aten.min.dim: (1, 2),
}


@register(*_REDUCE_ALONG)
def reduce_along_rule(info: OpInfo):
    """var/std (and their _mean pairs), logsumexp, a vector norm, prod, all/any,
    argmax/argmin and max/min over dims: split the kept dims (a split reduced
    dim would need the other ranks' values, not a sum of local results)."""
    dim_at, keep_at = _REDUCE_ALONG[info.target]
    dims = info.arg(dim_at, "dim")
    x = info.inputs[0]
    if info.target in (aten.argmax.default, aten.argmin.default) and dims is None:
        return [Row(R, (R,))]  # over the flattened tensor
    return reduction_rows(info, _dims(dims, x.ndim), bool(info.arg(keep_at, "keepdim", False)), None)


@register(aten.sort.default, aten.argsort.default, aten.cumprod.default, aten.logcumsumexp.default)
def along_one_dim_rule(info: OpInfo):
    """sort/argsort (dim -1 by default), cumprod and logcumsumexp along ``dim``."""
    default = -1 if info.target in (aten.sort.default, aten.argsort.default) else None
    return other_dims_rows(info, _dims(info.arg(1, "dim", default), info.inputs[0].ndim))


@register(aten.flip.default)
def flip_rule(info: OpInfo):
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


@register(aten.expand_as.default)
def expand_as_rule(info: OpInfo):
    """x.expand_as(other): each output dim split with ``other``'s, and with
    x's where x has it at full size (a broadcast dim of x stays whole)."""
    x, out = info.inputs[0].shape, info.out.shape
    lead = len(out) - len(x)
    rows = []
    for d in range(len(out)):
        if out[d] == 1:
            continue
        i = d - lead
        rows.append(Row(S(d), (S(i) if i >= 0 and x[i] == out[d] else R, S(d))))
    rows.append(Row(R, (R, R)))
    return rows


@register(aten.fill.Scalar, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
          aten.new_empty.default)
def fill_rule(info: OpInfo):
    """fill(x, v) keeps x's shape: it splits with x. new_* make a tensor of a
    given size (the input only gives dtype and device): the same replicated
    tensor on every rank."""
    if info.target is aten.fill.Scalar:
        return other_dims_rows(info, [])
    return [Row(R, (R,) * len(info.inputs))]
