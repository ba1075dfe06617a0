"""Elementwise ops with broadcasting: shard an output dim and every input that
really has that dim (not broadcast from size 1) along with it."""
from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
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


# Elementwise: each output element reads the same position of every input
# (after broadcasting). Alphabetical.
POINTWISE = [
    aten.abs.default, aten.acos.default, aten.acosh.default, aten.add.Scalar, aten.addcdiv.default,
    aten.addcmul.default, aten.asin.default, aten.asinh.default, aten.atan.default, aten.atan2.default,
    aten.atanh.default, aten.bitwise_and.Tensor, aten.bitwise_not.default, aten.bitwise_or.Tensor,
    aten.ceil.default, aten.celu.default, aten.clamp.Tensor, aten.clamp.default, aten.clamp_max.default,
    aten.clamp_min.default, aten.copysign.Tensor, aten.cos.default, aten.cosh.default, aten.digamma.default,
    aten.elu.default,
    aten.eq.Scalar, aten.eq.Tensor, aten.erf.default, aten.erfc.default, aten.erfinv.default, aten.exp.default,
    aten.exp2.default, aten.expm1.default, aten.floor.default, aten.floor_divide.default, aten.fmax.default,
    aten.fmin.default, aten.fmod.Scalar, aten.fmod.Tensor, aten.frac.default, aten.ge.Scalar, aten.ge.Tensor,
    aten.gelu.default, aten.gt.Scalar, aten.gt.Tensor, aten.hardshrink.default, aten.hardsigmoid.default,
    aten.hardswish.default, aten.hardtanh.default, aten.hypot.default, aten.isinf.default, aten.isnan.default,
    aten.le.Scalar, aten.le.Tensor, aten.leaky_relu.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.lgamma.default,
    aten.log.default, aten.log10.default, aten.log1p.default, aten.log2.default, aten.log_sigmoid.default,
    aten.logical_and.default, aten.logical_not.default,
    aten.logical_or.default, aten.logical_xor.default, aten.logit.default, aten.lt.Scalar, aten.lt.Tensor,
    aten.masked_fill.Scalar, aten.max.other, aten.maximum.default, aten.min.other, aten.minimum.default,
    aten.mish.default,
    aten.nan_to_num.default, aten.ne.Scalar, aten.ne.Tensor, aten.pow.Scalar, aten.pow.Tensor_Scalar,
    aten.pow.Tensor_Tensor, aten.reciprocal.default, aten.relu.default, aten.remainder.Scalar,
    aten.remainder.Tensor, aten.round.default, aten.rsqrt.default, aten.rsub.Scalar, aten.rsub.Tensor,
    aten.rrelu.default, aten.selu.default, aten.sigmoid.default, aten.sign.default, aten.silu.default,
    aten.sin.default, aten.sinh.default, aten.softplus.default, aten.softshrink.default, aten.special_erf.default,
    aten.special_expm1.default, aten.special_xlogy.default, aten.sqrt.default,
    aten.square.default, aten.sub.Scalar, aten.tan.default, aten.tanh.default, aten.threshold.default,
    aten.trunc.default, aten.where.ScalarOther, aten.where.ScalarSelf, aten.where.self, aten.xlogy.Tensor,
]

# Linear in their (single) tensor argument or sums of tensors: a Partial
# (sum) input gives a Partial output without communication. Alphabetical.
LINEAR = [
    aten.add.Tensor, aten.alias.default, aten.clone.default, aten.contiguous.default,
    aten.detach.default, aten.div.Scalar, aten.dropout.default, aten.mul.Scalar,
    aten.neg.default, aten.sub.Tensor, aten.subtract.Tensor,
]

# Multiplication and division by a replicated factor keep a Partial (sum) partial.
SCALING = [aten.div.Tensor, aten.mul.Tensor]

# dtype conversions are elementwise too.
CONVERSIONS = [aten._to_copy.default, aten.to.dtype, aten.to.dtype_layout, aten.type_as.default]


# More of them: bit operators, predicates, and torch.special's functions (some
# are aliases that torch.export keeps by their own name). Alphabetical.
POINTWISE += [
    aten.__and__.Tensor, aten.__lshift__.Scalar, aten.__or__.Tensor, aten.__rshift__.Scalar, aten.__xor__.Tensor,
    aten.bernoulli.Tensor, aten.bitwise_xor.Tensor, aten.deg2rad.default, aten.fill.Tensor, aten.float_power.Scalar,
    aten.float_power.Tensor_Scalar, aten.float_power.Tensor_Tensor, aten.heaviside.default, aten.i0.default,
    aten.isclose.default,
    aten.isfinite.default, aten.isneginf.default, aten.isposinf.default, aten.logaddexp.default,
    aten.logaddexp2.default, aten.rad2deg.default, aten.relu6.default, aten.signbit.default,
    aten.sinc.default, aten.special_digamma.default, aten.special_entr.default, aten.special_erfc.default,
    aten.special_erfinv.default, aten.special_exp2.default, aten.special_expit.default,
    aten.special_gammaln.default, aten.special_i0.default, aten.special_log1p.default, aten.special_logit.default,
    aten.special_ndtr.default, aten.special_psi.default, aten.special_sinc.default, aten.special_xlog1py.default,
]


@register(*POINTWISE)
def pointwise_rule(info: OpInfo):
    """Element-wise ops: any output dim splits, with every input that has it at
    full size."""
    return broadcast_rows(info)


@register(aten.prelu.default)
def prelu_rule(info: OpInfo):
    """prelu(x, weight): one slope, or one per channel (dim 1 of x), which
    splits with the channels; every other dim splits alone."""
    x, weight = info.inputs
    per_channel = weight.shape[0] > 1 and x.ndim > 1
    rows = [Row(S(d), (S(d), S(0) if d == 1 and per_channel else R)) for d in range(x.ndim) if x.shape[d] > 1]
    rows.append(Row(R, (R, R)))
    return rows


@register(aten.alpha_dropout.default, aten.feature_dropout.default, aten.feature_alpha_dropout.default)
def dropout_variant_rule(info: OpInfo):
    """AlphaDropout draws per element: any dim splits (each shard draws its
    own, autopar/local_ops.py). Dropout1d/2d/3d (feature_*) draw one mask per
    sample and channel, the same over the other dims: in training those
    dims would draw one mask per shard, so only dims 0 and 1 split."""
    rows = broadcast_rows(info)
    feature = info.target is not aten.alpha_dropout.default
    if feature and info.arg(1, "p", 0.5) > 0 and info.arg(2, "train", True):
        rows = [r for r in rows if isinstance(r.output, Replicate) or r.output.dim < 2]
    return rows


@register(*LINEAR, *CONVERSIONS)
def linear_pointwise_rule(info: OpInfo):
    """Element-wise ops linear in their inputs (add, sub, clone, conversions
    between float types, dropout at p = 0): they split like any element-wise
    op and also carry a Partial sum through."""
    rows = broadcast_rows(info)
    if info.target is aten.dropout.default and info.arg(1, "p", 0.0) > 0 and info.arg(2, "train", True):
        return rows  # a random mask is not linear across partial summands
    if info.target in (aten.add.Tensor, aten.sub.Tensor, aten.subtract.Tensor) and len(info.inputs) < 2:
        return rows  # every rank would add the scalar to its summand
    if info.target in CONVERSIONS and not (info.inputs[0].dtype.is_floating_point
                                           and info.out.dtype.is_floating_point):
        return rows  # rounding to an integer does not commute with the sum
    if info.inputs and all(m.shape == info.out.shape for m in info.inputs):
        rows.append(Row(P, (P,) * len(info.inputs)))
    return rows


@register(*SCALING)
def scaling_rule(info: OpInfo):
    """mul and div: element-wise, and a Partial sum times or over a replicated
    factor stays Partial."""
    rows = broadcast_rows(info)
    if len(info.inputs) == 1:
        rows.append(Row(P, (P,)))
    elif len(info.inputs) == 2 and info.inputs[0].shape == info.out.shape:
        rows.append(Row(P, (P, R)))
    return rows


def is_partial_sum(p) -> bool:
    return isinstance(p, Partial) and p.reduce_op == "sum"


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
