"""Embedding, attention, losses and tensor factories."""
from __future__ import annotations

from torch.distributed.tensor import Partial
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import ReplicatedOnly, register
from autopar.passes.strategy import P, R, Row, S


@register(aten.embedding.default)
def embedding_rule(info: OpInfo):
    """Lookup of rows of a table: the indices' dims split, or the embedding dim
    (the table's columns), or the vocabulary (a masked lookup whose result
    is a Partial sum, autopar/spmd.py). With ``scale_grad_by_freq`` each
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


REDUCTION = {0: None, 1: "avg", 2: "sum"}  # torch's Reduction enum: none, mean, sum


@register(aten.cross_entropy_loss.default, aten.nll_loss.default, aten.nll_loss_nd.default)
def cross_entropy_rule(info: OpInfo):
    """Batch split (dim 0 of a batched input: dim 1 holds the classes),
    without class weights. A mean over the targets that are not ignore_index
    (over the samples, for class probabilities) is a Partial sum of (local
    loss sum / global count); the runtime all-reduces the count
    (autopar/spmd.py, _mean_loss)."""
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


# Tensor factories: every rank makes the same (replicated) tensor. Alphabetical.
FACTORIES = [
    aten.arange.default, aten.arange.start, aten.arange.start_step, aten.empty.memory_format, aten.eye.default,
    aten.eye.m, aten.full.default, aten.linspace.default, aten.ones.default, aten.scalar_tensor.default,
    aten.zeros.default,
]
# Random ones (noise, timesteps drawn in forward): replicated too, every rank
# drawing the same values from the step's seed (autopar/spmd.py, random_factory).
RANDOM_FACTORIES = [
    aten.normal.float_float, aten.rand.default, aten.randint.default, aten.randint.low, aten.randn.default,
    aten.randperm.default,
]


@register(*FACTORIES, *RANDOM_FACTORIES)
def factory_rule(info: OpInfo):
    """A tensor made from sizes alone: the same replicated tensor on every
    rank."""
    return [Row(R, ())]


@register(aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.empty_like.default,
          aten.rand_like.default, aten.randn_like.default, aten.randint_like.default, aten.randint_like.low_dtype,
          aten.bernoulli.default, aten.bernoulli.p, aten.uniform.default, aten.normal_functional.default,
          aten.exponential.default)
def like_rule(info: OpInfo):
    """zeros_like and kin, and random tensors drawn in their input's shape
    (rand_like, bernoulli, uniform_, ...; each shard draws its own,
    autopar/spmd.py): shaped as their input, so they split with it."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows

