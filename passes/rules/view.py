"""Shape ops: each maps input dims to output dims; a shard moves with its dim
when the dim survives (or leads a merged/split group), otherwise that row
does not exist."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import P, R, Row, S


def map_rows(info: OpInfo, dim_map: dict[int, int], partial_ok: bool = True) -> list[Row]:
    """Rows from an input-dim -> output-dim map for a single-input op."""
    x = info.inputs[0]
    rows = [Row(S(o), (S(i),)) for i, o in dim_map.items() if x.shape[i] > 1]
    rows.append(Row(R, (R,)))
    if partial_ok:
        rows.append(Row(P, (P,)))
    return rows


def reshape_map(src, dst) -> dict[int, int]:
    """Input dim -> output dim for a reshape: within each group of dims whose
    products match, the leading non-1 input dim maps to the leading non-1 output dim."""
    out, i, j = {}, 0, 0
    while i < len(src) and j < len(dst):
        i0, j0 = i, j
        a, b = src[i], dst[j]
        i, j = i + 1, j + 1
        while a != b:
            if a < b:
                a *= src[i]; i += 1
            else:
                b *= dst[j]; j += 1
        lead_in = next((k for k in range(i0, i) if src[k] != 1), None)
        lead_out = next((k for k in range(j0, j) if dst[k] != 1), None)
        if lead_in is not None and lead_out is not None:
            out[lead_in] = lead_out
        # trailing size-1 dims join the next group naturally
    return out


@register(aten.view.default, aten.reshape.default, aten._unsafe_view.default,
          aten.flatten.using_ints, aten.unflatten.int, aten.squeeze.dim, aten.squeeze.dims,
          aten.unsqueeze.default)
def reshape_rule(info: OpInfo):
    """view/reshape/flatten/unflatten/squeeze/unsqueeze: a dim splits when it
    maps to an output dim whose leading factor it is (reshape_map)."""
    # No Partial row: DTensor runs a reshape of a non-contiguous Partial as a
    # copy that it reshards first (observed on torch 2.13).
    return map_rows(info, reshape_map(info.inputs[0].shape, info.out.shape), partial_ok=False)


@register(aten.transpose.int)
def transpose_rule(info: OpInfo):
    """Swaps ``dim0`` and ``dim1``: a dim splits and moves with the swap."""
    nd = info.inputs[0].ndim
    a, b = info.arg(1, "dim0") % nd, info.arg(2, "dim1") % nd
    perm = list(range(nd)); perm[a], perm[b] = perm[b], perm[a]
    return map_rows(info, {perm[o]: o for o in range(nd)})


@register(aten.t.default)
def t_rule(info: OpInfo):
    """Transpose of a matrix: a dim splits and moves to the other place."""
    nd = info.inputs[0].ndim
    return map_rows(info, {0: nd - 1, nd - 1: 0} if nd == 2 else {0: 0})


@register(aten.view_as_complex.default, aten.view_as_real.default)
def complex_view_rule(info: OpInfo):
    """view_as_complex pairs the last dim (size 2) into one complex number,
    view_as_real splits each back into a last dim of 2: every other dim
    keeps its place and splits."""
    x = info.inputs[0]
    return other_dims_rows(info, [x.ndim - 1] if info.target is aten.view_as_complex.default else [])


@register(aten.numpy_T.default)
def numpy_t_rule(info: OpInfo):
    """x.T: every dim reversed."""
    nd = info.inputs[0].ndim
    return map_rows(info, {d: nd - 1 - d for d in range(nd)})


@register(aten.permute.default)
def permute_rule(info: OpInfo):
    """A dim splits and moves to where the permutation puts it."""
    nd = info.inputs[0].ndim
    perm = [d % nd for d in info.arg(1, "dims")]
    return map_rows(info, {perm[o]: o for o in range(nd)})


@register(aten.movedim.int)
def movedim_rule(info: OpInfo):
    """x.movedim(source, destination): a permutation, written by its moved dim."""
    nd = info.inputs[0].ndim
    src, dst = info.arg(1, "source") % nd, info.arg(2, "destination") % nd
    order = [d for d in range(nd) if d != src]
    order.insert(dst, src)
    return map_rows(info, {order[o]: o for o in range(nd)})


@register(aten.meshgrid.indexing, aten.meshgrid.default)
def meshgrid_rule(info: OpInfo):
    """meshgrid(t_0, ..., t_k-1): output j is t_j spread over the grid, so
    splitting t_i splits every output along t_i's grid dim (dims 0 and 1
    swap under indexing="xy"), the other inputs replicated."""
    k = len(info.inputs)
    xy = info.arg(1, "indexing", "ij") == "xy" and k >= 2
    grid = [1, 0, *range(2, k)] if xy else list(range(k))
    rows = []
    for i, t in enumerate(info.inputs):
        if t.shape[0] > 1:
            rows.append(Row(S(grid[i]), tuple(S(0) if j == i else R for j in range(k)), items=(S(grid[i]),) * k))
    rows.append(Row(R, (R,) * k, items=(R,) * k))
    return rows


@register(aten.expand.default)
def expand_rule(info: OpInfo):
    """Broadcast to a larger shape: a dim that keeps its size splits in its new
    place."""
    x, out = info.inputs[0].shape, info.out.shape
    lead = len(out) - len(x)
    return map_rows(info, {i: i + lead for i in range(len(x)) if x[i] == out[i + lead]}, partial_ok=False)


def other_dims_rows(info: OpInfo, dims, n_in: int = 1, drop: bool = False) -> list[Row]:
    """Split any dim but ``dims`` (one dim, or several), every tensor input
    with it; ``drop``: the output lacks that one dim (select, unbind)."""
    x = info.inputs[0]
    along = {dims} if isinstance(dims, int) else set(dims)
    rows = []
    for d in range(x.ndim):
        if d in along or x.shape[d] == 1:
            continue
        o = d - 1 if drop and d > dims else d
        rows.append(Row(S(o), (S(d),) * n_in))
    rows.append(Row(R, (R,) * n_in))
    return rows


@register(aten.select_scatter.default, aten.slice_scatter.default)
def scatter_back_rule(info: OpInfo):
    """x with one index (select_scatter) or a slice (slice_scatter) of ``dim``
    replaced by src, as an assignment ``x[:, i] = v`` runs out of place: any
    other dim splits, x and src with it; linear in both, so Partial x and
    src give a Partial result."""
    x = info.inputs[0]
    dim = info.arg(2, "dim", 0) % x.ndim
    drop = info.target is aten.select_scatter.default
    rows = [Row(S(d), (S(d), S(d - 1 if drop and d > dim else d))) for d in range(x.ndim)
            if d != dim and x.shape[d] > 1]
    return rows + [Row(P, (P, P)), Row(R, (R, R))]


@register(aten.slice.Tensor, aten.split.Tensor, aten.split_with_sizes.default, aten.chunk.default,
          aten.narrow.default)
def slice_rule(info: OpInfo):
    """slice/split/chunk/narrow along ``dim``: any other dim splits."""
    nd = info.inputs[0].ndim
    default = 0
    dim = info.arg(2, "dim", default) if info.target is not aten.slice.Tensor else info.arg(1, "dim", 0)
    if info.target is aten.narrow.default:
        dim = info.arg(1, "dim")
    return other_dims_rows(info, dim % nd, 1)


@register(aten.select.int, aten.unbind.int)
def select_rule(info: OpInfo):
    """select/unbind along ``dim``: any other dim splits (one place lower
    behind ``dim``)."""
    nd = info.inputs[0].ndim
    return other_dims_rows(info, info.arg(1, "dim", 0) % nd, 1, drop=True)


@register(aten.diagonal.default)
def diagonal_rule(info: OpInfo):
    """diagonal(self, offset, dim1, dim2): the other dims keep their order
    ahead of the diagonal's; any of them splits."""
    x = info.inputs[0]
    pair = {info.arg(2, "dim1", 0) % x.ndim, info.arg(3, "dim2", 1) % x.ndim}
    others = [d for d in range(x.ndim) if d not in pair]
    rows = [Row(S(k), (S(d),)) for k, d in enumerate(others) if x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.cat.default)
def cat_rule(info: OpInfo):
    """Concatenation along ``dim``: any other dim splits, every input with it."""
    nd = info.out.ndim
    return other_dims_rows(info, info.arg(1, "dim", 0) % nd, len(info.inputs))


@register(aten.stack.default)
def stack_rule(info: OpInfo):
    """Stacking along a new ``dim``: any input dim splits, every input with it."""
    nd = info.out.ndim
    dim = info.arg(1, "dim", 0) % nd
    x = info.inputs[0]
    rows = [Row(S(d if d < dim else d + 1), (S(d),) * len(info.inputs)) for d in range(x.ndim) if x.shape[d] > 1]
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.expand_as.default)
def expand_as_rule(info: OpInfo):
    """x.expand_as(other): each output dim split with ``other``'s, and with
    x's where x has it at full size (a broadcast dim of x stays whole)."""
    x, out = info.inputs[0].shape, info.out.shape
    lead = len(out) - len(x)
    rows = []
    for d in range(len(out)):
        if out[d] == 1:
            continue
        i = d - lead
        rows.append(Row(S(d), (S(i) if i >= 0 and x[i] == out[d] else R, S(d))))
    rows.append(Row(R, (R, R)))
    return rows
