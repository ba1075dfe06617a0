"""Scaled dot-product attention: batch, heads, or the queries' sequence
(context parallelism)."""
from __future__ import annotations

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
    (autopar/spmd.py, _attention), which needs q and k of one length."""
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


def _mask_follows(info: OpInfo, d: int) -> list:
    """Placements of the attention mask when q's dim ``d`` splits: split on
    the dim it has there (broadcast dims stay whole)."""
    q = info.inputs[0]
    out = []
    for m in info.inputs[3:]:
        j = d - (q.ndim - m.ndim)
        out.append(S(j) if j >= 0 and m.shape[j] == q.shape[d] else R)
    return out
