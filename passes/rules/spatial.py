"""Ops over the spatial dims of (N, C, *spatial) tensors: resampling
(interpolate, grid_sample, affine_grid), pooling, pixel shuffle, im2col and
col2im. Each output position mixes positions of its own sample and channel
only, so the batch and channel dims split."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import P, R, Row, S


@register(aten.affine_grid_generator.default)
def affine_grid_rule(info: OpInfo):
    """F.affine_grid(theta (N, 2, 3), size): each sample's grid from its own
    theta (the runtime gives ``size`` the local batch, local_ops._affine_grid)."""
    theta = info.inputs[0]
    return ([Row(S(0), (S(0),))] if theta.shape[0] > 1 else []) + [Row(R, (R,))]


_UPSAMPLE = [
    aten.upsample_nearest1d.vec, aten.upsample_nearest2d.vec, aten.upsample_nearest3d.vec,
    aten._upsample_nearest_exact1d.vec, aten._upsample_nearest_exact2d.vec, aten._upsample_nearest_exact3d.vec,
    aten.upsample_linear1d.vec, aten.upsample_bilinear2d.vec, aten.upsample_trilinear3d.vec,
    aten.upsample_bicubic2d.vec,
]


@register(*_UPSAMPLE)
def upsample_rule(info: OpInfo):
    """F.interpolate on (N, C, *spatial): each output position mixes input
    positions of its own sample and channel only, so batch and channel dims
    split freely; it is a linear map, so a Partial (sum) input gives a
    Partial output."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in (0, 1) if x.shape[d] > 1]
    rows += [Row(P, (P,)), Row(R, (R,))]
    return rows


@register(aten.grid_sampler.default)
def grid_sampler_rule(info: OpInfo):
    """F.grid_sample(x (N, C, *in), grid (N, *out, k)) -> (N, C, *out): each
    output point reads its own sample's channels at one place: N splits with
    both, C with x (the grid whole), an output position with the grid (x
    whole). The input's positions do not split (any point may read any)."""
    x, grid = info.inputs
    rows = [Row(S(0), (S(0), S(0)))] if x.shape[0] > 1 else []
    if x.shape[1] > 1:
        rows.append(Row(S(1), (S(1), R)))
    rows += [Row(S(d + 1), (R, S(d))) for d in range(1, grid.ndim - 1) if grid.shape[d] > 1]
    rows.append(Row(R, (R, R)))
    return rows


_SPATIAL = {
    aten.adaptive_avg_pool1d.default: 1, aten.adaptive_avg_pool2d.default: 2, aten.adaptive_avg_pool3d.default: 3,
    aten.adaptive_max_pool1d.default: 1, aten.adaptive_max_pool2d.default: 2, aten.adaptive_max_pool3d.default: 3,
    aten.avg_pool1d.default: 1, aten.avg_pool2d.default: 2, aten.avg_pool3d.default: 3,
    aten.max_pool1d.default: 1, aten.max_pool2d.default: 2, aten.max_pool3d.default: 3,
    aten.max_pool1d_with_indices.default: 1, aten.max_pool2d_with_indices.default: 2,
    aten.max_pool3d_with_indices.default: 3,
}


_AVERAGING = {aten.adaptive_avg_pool1d.default, aten.adaptive_avg_pool2d.default, aten.adaptive_avg_pool3d.default,
              aten.avg_pool1d.default, aten.avg_pool2d.default, aten.avg_pool3d.default}


@register(*_SPATIAL)
def pool_rule(info: OpInfo):
    """Pooling mixes only spatial positions: batch and channel dims split freely;
    averaging is linear, so a Partial (sum) input gives a Partial output."""
    x = info.inputs[0]
    lead = x.ndim - _SPATIAL[info.target]  # 2 for (N, C, *spatial), 1 for (C, *spatial)
    rows = [Row(S(d), (S(d),)) for d in range(lead) if x.shape[d] > 1]
    if info.target in _AVERAGING:
        rows.append(Row(P, (P,)))
    rows.append(Row(R, (R,)))
    return rows


@register(aten.pixel_shuffle.default, aten.pixel_unshuffle.default)
def pixel_shuffle_rule(info: OpInfo):
    """(*, C r^2, H, W) <-> (*, C, H r, W r): each output channel gathers r^2
    consecutive input channels, each input row and column r consecutive
    output ones, so a contiguous block of any dim maps to a contiguous block
    of the same dim; the divisibility check on both shapes keeps a block of
    channels whole (C divides by the axis)."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1 and info.out.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.im2col.default)
def im2col_rule(info: OpInfo):
    """F.unfold, (N, C, H, W) -> (N, C kh kw, L): sliding windows within each
    image and channel; output channel c kh kw + k comes from input channel c,
    so the batch and channel blocks split alike."""
    nd = info.inputs[0].ndim
    return other_dims_rows(info, [nd - 2, nd - 1])


@register(aten.col2im.default)
def col2im_rule(info: OpInfo):
    """F.fold, (N, C kh kw, L) -> (N, C, H, W): sums overlapping windows
    within each image and channel, the inverse layout of im2col, so the
    batch and channel blocks split alike (the divisibility check on the
    output keeps each channel's kh kw rows together)."""
    return other_dims_rows(info, [info.inputs[0].ndim - 1])
