"""Similarities and distances between vectors, and the losses built on them:
each compares whole vectors along one dim, so only the other dims split."""
from __future__ import annotations

from torch.distributed.tensor import Partial
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.rules.loss import REDUCTION
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import R, Row, S


def _same_shapes(info: OpInfo) -> bool:
    return all(m.shape == info.inputs[0].shape for m in info.inputs)


@register(aten.cosine_similarity.default, aten.pairwise_distance.default)
def similarity_rule(info: OpInfo):
    """cosine_similarity over ``dim`` (default 1), pairwise_distance over the
    last dim (kept with keepdim): the other dims split, both inputs alike
    (broadcast operands: replicated)."""
    x = info.inputs[0]
    if not _same_shapes(info) or x.ndim < 2:
        return [Row(R, (R, R))]
    if info.target is aten.cosine_similarity.default:
        dim, keep = info.arg(2, "dim", 1) % x.ndim, False
    else:
        dim, keep = x.ndim - 1, bool(info.arg(4, "keepdim", False))
    return other_dims_rows(info, dim, 2, drop=not keep)


@register(aten.cdist.default)
def cdist_rule(info: OpInfo):
    """cdist(x1 (*, P, M), x2 (*, R, M)) -> (*, P, R): the batch dims split
    with both inputs; P with x1 (x2 whole), R with x2 (x1 whole). The
    coordinate dim M does not (a distance is not a sum of local ones)."""
    a, b = info.inputs
    if a.ndim != b.ndim or a.shape[:-2] != b.shape[:-2]:
        return [Row(R, (R, R))]
    nd = a.ndim
    rows = [Row(S(d), (S(d), S(d))) for d in range(nd - 2) if a.shape[d] > 1]
    if a.shape[-2] > 1:
        rows.append(Row(S(nd - 2), (S(nd - 2), R)))
    if b.shape[-2] > 1:
        rows.append(Row(S(nd - 1), (R, S(nd - 2))))
    rows.append(Row(R, (R, R)))
    return rows


_ROW_LOSS_REDUCTION_ARG = {aten.triplet_margin_loss.default: 7, aten.cosine_embedding_loss.default: 4}


@register(*_ROW_LOSS_REDUCTION_ARG)
def row_loss_rule(info: OpInfo):
    """A loss per vector (the last dim of its inputs; cosine_embedding_loss's
    target has one label per vector): the leading dims split, every input
    with them; a mean or sum of the per-vector losses is a Partial of the
    local ones."""
    vectors = [m for m in info.inputs if m.ndim == info.inputs[0].ndim]
    x = info.inputs[0]
    reduction = REDUCTION[info.arg(_ROW_LOSS_REDUCTION_ARG[info.target], "reduction", 1)]
    n_in = len(info.inputs)
    rows = [Row(R, (R,) * n_in)]
    if any(m.shape != x.shape for m in vectors) or any(m.shape != x.shape[:-1] for m in info.inputs
                                                          if m.ndim != x.ndim):
        return rows
    for d in range(x.ndim - 1):
        if x.shape[d] > 1:
            rows.append(Row(S(d) if reduction is None else Partial(reduction), (S(d),) * n_in))
    return rows
