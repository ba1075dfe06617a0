"""Normalisations and softmax: any dim outside the normalised ones may be
sharded; batch, instance and group norm, whose statistics run over the batch
or over groups of channels."""
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
    of those runs as synchronised batch norm (autopar/local_ops.py, _batch_norm:
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
