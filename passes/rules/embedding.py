"""Lookups of rows of a table: nn.Embedding and nn.EmbeddingBag."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import ReplicatedOnly, register
from autopar.passes.strategy import P, R, Row, S


@register(aten.embedding.default)
def embedding_rule(info: OpInfo):
    """Lookup of rows of a table: the indices' dims split, or the embedding dim
    (the table's columns), or the vocabulary (a masked lookup whose result
    is a Partial sum, autopar/local_ops.py). With ``scale_grad_by_freq`` each
    row's gradient is divided by its id's count over all the indices, which
    a shard of the indices (or of the vocabulary, whose other ids the lookup
    masks) would count wrongly: only the columns split."""
    idx = info.inputs[1]
    whole_count = bool(info.arg(3, "scale_grad_by_freq", False))
    rows = [] if whole_count else [Row(S(d), (R, S(d))) for d in range(idx.ndim) if idx.shape[d] > 1]
    rows.append(Row(S(idx.ndim), (S(1), R)))      # hidden dim split
    if not whole_count:
        rows.append(Row(P, (S(0), R)))            # vocabulary split: masked lookup, summed
    rows.append(Row(R, (R, R)))
    return rows


@register(aten.embedding_bag.padding_idx, aten.embedding_bag.default)
def embedding_bag_rule(info: OpInfo):
    """nn.EmbeddingBag: split the embedding dim (the table's columns, as
    column-wise sharded recommendation tables are), each rank pooling its
    columns of every bag. Its other outputs (which bag each index is in, the
    bag sizes) come from the indices alone and stay replicated; in max mode
    the argmax per column splits with the columns. Bags are not split: where
    a shard of the indices starts depends on the offsets' values."""
    if info.arg(5, "sparse", False):
        raise ReplicatedOnly("sparse=True makes a sparse gradient, which the runtime does not place")
    table, n_in = info.inputs[0], len(info.inputs)
    rows = [Row(R, (R,) * n_in)]
    if table.shape[1] > 1:
        argmax = S(1) if info.outputs[3].ndim == 2 else R
        rows.append(Row(S(1), (S(1),) + (R,) * (n_in - 1), (S(1), R, R, argmax)))
    return rows
