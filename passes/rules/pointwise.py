"""Elementwise ops with broadcasting: shard an output dim and every input that
really has that dim (not broadcast from size 1) along with it."""
from __future__ import annotations

from torch.distributed.tensor import Partial
from torch.ops import aten

from autopar.passes.rules import OpInfo, register
from autopar.passes.strategy import P, R, Row, S


def broadcast_rows(info: OpInfo) -> list[Row]:
    out = info.out.shape
    rows = []
    for d, size in enumerate(out):
        if size == 1:
            continue
        ins = []
        for m in info.inputs:
            j = d - (len(out) - m.ndim)
            ins.append(S(j) if j >= 0 and m.shape[j] == size else R)
        rows.append(Row(S(d), tuple(ins)))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


# Kept in alphabetical order.
POINTWISE = [
    aten.abs.default, aten.bitwise_not.default, aten.clamp.default, aten.cos.default,
    aten.eq.Scalar, aten.eq.Tensor, aten.erf.default, aten.exp.default, aten.ge.Scalar,
    aten.gelu.default, aten.gt.Scalar, aten.le.Scalar, aten.log.default, aten.logical_not.default,
    aten.lt.Scalar, aten.masked_fill.Scalar, aten.maximum.default, aten.minimum.default,
    aten.ne.Scalar, aten.pow.Tensor_Scalar, aten.reciprocal.default, aten.relu.default,
    aten.rsqrt.default, aten.sigmoid.default, aten.silu.default, aten.sin.default,
    aten.sqrt.default, aten.square.default, aten.tanh.default, aten.where.self,
]

# Linear in their (single) tensor argument or sums of tensors: a Partial
# (sum) input gives a Partial output without communication. Alphabetical.
LINEAR = [
    aten.add.Tensor, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.div.Scalar, aten.dropout.default, aten.mul.Scalar,
    aten.neg.default, aten.sub.Tensor,
]

# Multiplication and division by a replicated factor keep a Partial (sum) partial.
SCALING = [aten.div.Tensor, aten.mul.Tensor]

# dtype conversions are elementwise too.
CONVERSIONS = [aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default]


@register(*POINTWISE)
def pointwise_rule(info: OpInfo):
    return broadcast_rows(info)


@register(*LINEAR, *CONVERSIONS)
def linear_pointwise_rule(info: OpInfo):
    rows = broadcast_rows(info)
    if info.target is aten.dropout.default and info.arg(1, "p", 0.0) > 0 and info.arg(2, "train", True):
        return rows  # a random mask is not linear across partial summands
    if info.target in (aten.add.Tensor, aten.sub.Tensor) and len(info.inputs) < 2:
        return rows  # every rank would add the scalar to its summand
    if info.target in CONVERSIONS and not (info.inputs[0].dtype.is_floating_point
                                           and info.out.dtype.is_floating_point):
        return rows  # rounding to an integer does not commute with the sum
    if info.inputs and all(m.shape == info.out.shape for m in info.inputs):
        rows.append(Row(P, (P,) * len(info.inputs)))
    return rows


@register(*SCALING)
def scaling_rule(info: OpInfo):
    rows = broadcast_rows(info)
    if len(info.inputs) == 1:
        rows.append(Row(P, (P,)))
    elif len(info.inputs) == 2 and info.inputs[0].shape == info.out.shape:
        rows.append(Row(P, (P, R)))
    return rows


def is_partial_sum(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"
