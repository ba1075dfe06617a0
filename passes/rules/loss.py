"""Losses: cross entropy / NLL over classes, and the losses that reduce a
per-element term."""
from __future__ import annotations

from torch.distributed.tensor import Partial
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import P, R, Row, S


REDUCTION = {0: None, 1: "avg", 2: "sum"}  # torch's Reduction enum: none, mean, sum


@register(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def cross_entropy_rule(info: OpInfo):
    """Batch split (dim 0 of a batched input: dim 1 holds the classes),
    without class weights. A mean over the targets that are not ignore_index
    (over the samples, for class probabilities) is a Partial sum of (local
    loss sum / global count); the runtime all-reduces the count
    (autopar/local_ops.py, _mean_loss)."""
    x = info.inputs[0]
    reduction = REDUCTION[info.arg(3, "reduction", 1)]
    n_in = len(info.inputs)
    rows = [Row(R, (R,) * n_in)]
    if x.ndim >= 2 and x.shape[0] > 1 and n_in == 2:
        rows.append(Row(S(0) if reduction is None else P, (S(0), S(0))))
    return rows


_LOSS_REDUCTION_ARG = {
    aten.binary_cross_entropy.default: 3, aten.binary_cross_entropy_with_logits.default: 4,
    aten.huber_loss.default: 2, aten.l1_loss.default: 2, aten.mse_loss.default: 2, aten.smooth_l1_loss.default: 2,
    aten.soft_margin_loss.default: 2, aten.kl_div.default: 2, aten.hinge_embedding_loss.default: 3,
    aten.margin_ranking_loss.default: 4, aten.poisson_nll_loss.default: 5,
}
"""Losses that are a reduction of a per-element term: the argument position of ``reduction``."""


@register(*_LOSS_REDUCTION_ARG)
def elementwise_loss_rule(info: OpInfo):
    """Any dim splits when every tensor input (prediction, target, a weight)
    has the prediction's shape: the per-element losses split with it, and a
    mean or sum is a Partial of the local ones (a broadcast weight or
    pos_weight: replicated only)."""
    x = info.inputs[0]
    reduction = REDUCTION[info.arg(_LOSS_REDUCTION_ARG[info.target], "reduction", 1)]
    n_in = len(info.inputs)
    rows = [Row(R, (R,) * n_in)]
    if all(t.shape == x.shape for t in info.inputs):
        for d in range(x.ndim):
            if x.shape[d] > 1:
                rows.append(Row(S(d) if reduction is None else Partial(reduction), (S(d),) * n_in))
    return rows
