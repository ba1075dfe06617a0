"""Grouped matmuls: a mixture of experts' expert layers, every token through
its own expert's weight.

``grouped_mm(x (S, K), w (E, K, N), offs (E,)) -> (S, N)``: the rows of x are
the S (token, expert) pairs sorted by expert, and ``offs`` holds the
cumulative count of rows per expert, so expert e's rows are
``offs[e - 1]:offs[e]`` (``offs[-1]`` = 0) and row i's output is
``x[i] @ w[e]``. Rows from ``offs[E - 1]`` on belong to no expert
(transformers' sentinel rows under its own expert parallelism): the
library's op leaves them zero, torch's leaves them undefined.

Two ops compute it: transformers' ``transformers::grouped_mm_fallback``,
which its experts call in every dtype when traced (torch.export) or on
CPU with torch <= 2.8 (transformers/integrations/moe.py, ``_grouped_mm``),
and torch's own ``torch._grouped_mm`` / ``F.grouped_mm`` (fp32, bf16 and fp16
on CPU as on GPUs). The plain batched-experts form, a stacked weight
(E, K, N) multiplied with tokens already dispatched to (E, C, K), is
``bmm`` or ``einsum``, whose rules split E as a batch dim.

Splitting the experts or the tokens needs the offsets relative to the
rank's shard, which only its rank knows: autopar/local_ops.py's ``_grouped_mm``
runs those splits. The offsets themselves (E integers) stay whole.

Expert parallelism splits both: each rank holds a contiguous piece of the
sorted rows and its experts' weights, sends every row to the rank of its
expert and gets the results back (two all-to-alls whose sizes every rank
computes from the whole offsets). Under balanced routing a rank's piece of
the sorted rows is its experts' rows and almost nothing moves; the token
exchange proper happens where the tokens are sorted, an advanced-indexing
op whose rule fetches rows from other ranks (indexing.routed_axes).
"""
from __future__ import annotations

from torch.distributed.tensor import Shard
from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import ReplicatedOnly, register
from autopar.passes.strategy import P, R, Row, S

GROUPED_MM_FALLBACK = "transformers.grouped_mm_fallback.default"
"""transformers' op (registered when transformers.integrations.moe is
imported), as ``str`` prints it: ``(Tensor input, Tensor weight, Tensor offs) -> Tensor``."""


def grouped_rows(info: OpInfo, features: bool) -> list[Row]:
    """Rows of ``grouped_mm(x, w, offs)``; ``features``: also split K and N."""
    x, w = info.inputs[0], info.inputs[1]
    rows = []
    if x.shape[0] > 1:
        rows.append(Row(S(0), (S(0), R, R)))      # tokens: the offsets shifted to the shard's rows
    if w.shape[0] > 1:
        rows.append(Row(P, (R, S(0), R)))         # experts: own experts' rows, zeros elsewhere, summed
    if x.shape[0] > 1 and w.shape[0] > 1:
        # expert parallelism: each rank's rows sent to their experts' ranks and back (all-to-alls)
        rows.append(Row(S(0), (S(0), S(0), R), routes=True))
    if features:
        rows.append(Row(S(1), (R, S(2), R)))      # output features
        rows.append(Row(P, (S(1), S(1), R)))      # the contracted dim: partial products
    rows.append(Row(R, (R, R, R)))
    return rows


def dispatch_axes(x_spec: tuple, w_spec: tuple, mesh_shape: tuple) -> tuple:
    """The mesh axes (of size > 1) over which a grouped matmul runs expert
    parallel: the sorted rows and the experts both split (grouped_rows'
    routed row): each rank sends its rows to the ranks of their experts,
    which compute them and send them back (autopar/local_ops.py, _grouped_mm;
    graph_costs.op_moves prices the all-to-alls). Empty: no rows move."""
    return tuple(a for a, (p, q) in enumerate(zip(x_spec, w_spec))
                 if isinstance(p, Shard) and p.dim == 0 and isinstance(q, Shard) and q.dim == 0 and mesh_shape[a] > 1)


@register(GROUPED_MM_FALLBACK, matmul=True)
def grouped_mm_fallback_rule(info: OpInfo):
    """transformers' grouped matmul: the experts (each rank its experts'
    rows, the result a Partial sum), the tokens (each rank its rows of the
    sorted tokens), the output features, or the contracted dim (Partial);
    the offsets whole."""
    return grouped_rows(info, features=True)


@register(aten._grouped_mm.default, matmul=True)
def grouped_mm_rule(info: OpInfo):
    """torch._grouped_mm(a, b, offs, bias, out_dtype). (S, K) x (E, K, N)
    with offsets: the experts or the tokens, as grouped_mm_fallback_rule.
    The kernel needs 16-byte strides (aten/src/ATen/native/GroupedMMUtils.h),
    which a shard of K or N may not have: those stay whole. (B, M, K) x
    (B, K, N) without offsets is a bmm: the batch or the rows of a. Other forms (offsets
    over K or over N) and a bias: replicated, with the reason."""
    a, b = info.inputs[0], info.inputs[1]
    offs = info.arg(2, "offs")
    if info.arg(3, "bias") is not None:
        raise ReplicatedOnly("a bias is added per group (by its offsets): only the bias-free grouped matmul splits")
    if offs is None and a.ndim == 3 and b.ndim == 3:
        rows = [Row(S(0), (S(0), S(0)))] if a.shape[0] > 1 else []
        rows += [Row(S(1), (S(1), R))] if a.shape[1] > 1 else []
        return rows + [Row(R, (R, R))]
    if offs is not None and a.ndim == 2 and b.ndim == 3:
        return grouped_rows(info, features=False)
    raise ReplicatedOnly(f"grouped matmul of a {a.ndim}-D by a {b.ndim}-D operand "
                         f"{'with' if offs is not None else 'without'} offsets: only (S, K) x (E, K, N) with "
                         "offsets and (B, M, K) x (B, K, N) without split")
