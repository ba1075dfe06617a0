"""Indexing by tensors of positions: advanced indexing and index_put,
index_add/index_copy, index_select, gather and scatter, bucketize and
searchsorted, one_hot. The index tensors hold global positions, so they stay
whole wherever a split would need another rank's rows."""
from __future__ import annotations

import torch
from torch.distributed.tensor import Shard
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import P, R, Row, S


@register(aten.index.Tensor, aten._unsafe_index.Tensor)
def index_rule(info: OpInfo):
    """x[..., idx, ...]: index tensors on a block of adjacent dims (None, i.e.
    ``:``, elsewhere). The dims not indexed split and keep their place around
    the index's dims; the index tensors stay whole, as their values are global
    positions. Indexing is linear in x: a Partial x gives a Partial result.
    With one index tensor, the positions may split (x whole: each rank
    looks up its chunk of them), or x along the indexed dim: the result
    splits along a dim of the positions, each rank's rows fetched from
    their holders by an all-to-all inside the op (``routed_axes``).
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
        if len(indexed) == 1 and n_idx == 1 and x.shape[indexed[0]] > 1:
            # x split along the indexed dim, the positions whole: each rank fetches the rows of its
            # chunk of positions from the ranks that hold them (a mixture of experts' token dispatch)
            d, positions = indexed[0], info.inputs[1]
            split = [j for j in range(positions.ndim) if positions.shape[j] > 1]
            rows += [Row(S(d + j), (R, S(j))) for j in split]  # x whole: each rank its chunk of positions
            rows += [Row(S(d + j), (S(d), R), routes=True) for j in split]
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


def routed_axes(x_spec: tuple, indices: list, mesh_shape: tuple) -> tuple:
    """The mesh axes over which advanced indexing fetches rows from other
    ranks: those (of size > 1) that split x along its one indexed dim
    (index_rule's routed row; autopar/local_ops.py, _index; the cost model
    prices the all-to-all, graph_costs.op_moves). Empty: a local op."""
    dims = [d for d, t in enumerate(indices) if t is not None]
    if len(dims) != 1:
        return ()
    return tuple(a for a, p in enumerate(x_spec) if isinstance(p, Shard) and p.dim == dims[0] and mesh_shape[a] > 1)


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
