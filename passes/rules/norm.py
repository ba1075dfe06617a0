"""Normalisations and softmax: any dim outside the normalised ones may be sharded."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import R, Row, S


def keep_dims_rows(info: OpInfo, free_dims) -> list[Row]:
    """Shard the activation (input 0, output) on a free dim; other inputs (the
    affine weights) stay replicated."""
    x = info.inputs[0]
    rows = []
    for d in free_dims:
        if x.shape[d] > 1:
            rows.append(Row(S(d), (S(d),) + (R,) * (len(info.inputs) - 1)))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.layer_norm.default, aten.rms_norm.default)
def norm_rule(info: OpInfo):
    """Layer and RMS norm over the trailing ``normalized_shape`` dims: the
    leading dims split."""
    x = info.inputs[0]
    normalized = len(info.arg(1, "normalized_shape"))
    return keep_dims_rows(info, range(x.ndim - normalized))


@register(aten._softmax.default, aten.softmax.int, aten._log_softmax.default, aten.log_softmax.int)
def softmax_rule(info: OpInfo):
    """Softmax and log-softmax along ``dim``: any other dim splits."""
    x = info.inputs[0]
    dim = info.arg(1, "dim") % x.ndim
    return keep_dims_rows(info, [d for d in range(x.ndim) if d != dim])


@register(aten._weight_norm.default)
def weight_norm_rule(info: OpInfo):
    """weight_norm(v, g, dim): v * g / ||v||, the norm over every dim but
    ``dim`` (g keeps only ``dim``): v and g split along ``dim`` together.
    ``dim=-1`` normalises the whole tensor: replicated."""
    v = info.inputs[0]
    dim = info.arg(2, "dim", 0)
    rows = [Row(S(dim), (S(dim), S(dim)))] if dim != -1 and v.shape[dim] > 1 else []
    return rows + [Row(R, (R, R))]
