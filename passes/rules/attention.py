"""Scaled dot-product attention: batch, heads, or the queries' sequence
(context parallelism)."""
from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import R, Row, S


@register(aten.scaled_dot_product_attention.default, matmul=True)
def sdpa_rule(info: OpInfo):
    """Batch or head split: every rank attends within its own sequences/heads.
    An attention mask follows q on dims it really has.

    Context parallelism: the queries' sequence split, keys and values whole
    (all-gathered before the op, their gradients reduce-scattered after it:
    the plan's reshards, as in Llama 3's all-gather context parallelism).
    Each rank's queries attend to every key; under ``is_causal`` the local
    call sees the keys up to its last query, causally aligned to its chunk
    and the chunks balanced where they halve (``zigzag_axes``; autopar/
    local_ops.py, _attention), which needs q and k of one length."""
    q, k = info.inputs[0], info.inputs[1]
    rows = []
    for d in (0, 1):
        if q.shape[d] == 1 or any(m.shape[d] != q.shape[d] for m in info.inputs[1:3]):
            continue
        rows.append(Row(S(d), (S(d), S(d), S(d), *_mask_follows(info, d))))
    seq = q.ndim - 2
    causal = bool(info.arg(5, "is_causal", False))
    if q.shape[seq] > 1 and not (causal and q.shape[seq] != k.shape[-2]):
        rows.append(Row(S(seq), (S(seq), R, R, *_mask_follows(info, seq))))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


def zigzag_axes(q_spec: tuple, seq: int, local_len: int, mesh_shape: tuple) -> tuple | None:
    """The mesh axes over which causal attention with its queries' sequence
    split runs load-balanced (those of size > 1 that split it, outermost
    first), or None where it runs on contiguous chunks.

    Contiguous chunks of a causal sequence are uneven work: rank r of cp
    computes (r + 1/2) / cp of a full row block of scores, the last nearly
    twice the mean. Balanced (the layout of Megatron-LM's context
    parallelism and of Llama 3's, Dubey et al. 2024, sec. 3.3.2): the
    sequence in 2cp halves, rank j computing halves j and 2cp-1-j, each rank
    the same work. The program keeps the contiguous layout everywhere else
    and exchanges query halves (and output halves back) by an all-to-all
    over the axes around the op (autopar/local_ops.py, _attention); the cost
    model prices that and the balanced work (graph_costs.op_moves). One rule
    for both: some axis splits the sequence and each rank's chunk halves
    evenly."""
    axes = tuple(a for a, p in enumerate(q_spec) if isinstance(p, Shard) and p.dim == seq and mesh_shape[a] > 1)
    return axes if axes and local_len % 2 == 0 else None


def _mask_follows(info: OpInfo, d: int) -> list:
    """Placements of the attention mask when q's dim ``d`` splits: split on
    the dim it has there (broadcast dims stay whole)."""
    q = info.inputs[0]
    out = []
    for m in info.inputs[3:]:
        j = d - (q.ndim - m.ndim)
        out.append(S(j) if j >= 0 and m.shape[j] == q.shape[d] else R)
    return out
