"""Reductions: shard a kept dim and the output follows; shard a reduced dim and
the output is Partial: a sum of local sums, or for a mean P(avg), run as a
sum of local means / n. A max over a split dim has no row: its gradient
would reach every rank's local maximum, not only the global one."""
from __future__ import annotations

from torch.distributed.tensor import Partial
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import R, Row, S

_PARTIAL = {
    aten.sum.dim_IntList: "sum", aten.sum.default: "sum",
    aten.mean.dim: "avg", aten.mean.default: "avg",
    aten.amax.default: None, aten.amin.default: None, aten.max.default: None, aten.min.default: None,
    aten.nansum.default: "sum", aten.count_nonzero.dim_IntList: "sum", aten.count_nonzero.default: "sum",
}


def reduction_rows(info: OpInfo, dims, keepdim: bool, op: str) -> list[Row]:
    x = info.inputs[0]
    nd = x.ndim
    dims = sorted({d % nd for d in dims}) if dims else list(range(nd))
    rows = []
    out_dim = 0
    for d in range(nd):
        if d in dims:
            if x.shape[d] > 1 and op is not None:
                rows.append(Row(Partial(op), (S(d),)))
            if keepdim:
                out_dim += 1
            continue
        if x.shape[d] > 1:
            rows.append(Row(S(out_dim), (S(d),)))
        out_dim += 1
    rows.append(Row(R, (R,)))
    return rows


@register(*_PARTIAL)
def reduction_rule(info: OpInfo):
    """sum, mean, nansum, count_nonzero, amax, amin over dims (max, min of a
    whole tensor): a kept dim splits; a reduced dim splits into a Partial sum
    (a mean into local means summed over n), except for the maxima and minima."""
    if info.target in (aten.sum.default, aten.mean.default, aten.max.default, aten.min.default):
        dims, keepdim = None, False
    elif info.target in (aten.count_nonzero.dim_IntList, aten.count_nonzero.default):
        dims, keepdim = info.arg(1, "dim"), False
    else:
        dims, keepdim = info.arg(1, "dim"), info.arg(2, "keepdim", False)
    if isinstance(dims, int):
        dims = [dims]
    return reduction_rows(info, dims, bool(keepdim), _PARTIAL[info.target])


@register(aten.histc.default)
def histc_rule(info: OpInfo):
    """histc(x, bins, min, max): counts per bin, of every element: any split
    dim gives partial counts, summed. With min = max the range is the data's
    own minimum and maximum, which a shard does not know: replicated."""
    x = info.inputs[0]
    low, high = info.arg(2, "min", 0), info.arg(3, "max", 0)
    rows = [Row(Partial("sum"), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1] if low != high else []
    return rows + [Row(R, (R,))]
