"""Convolutions: split the batch, the output channels, or the input channels.

Layout is (N, C, *spatial) for activations and (C_out, C_in / groups, *kernel)
for weights ((C_in, C_out / groups, *kernel) when transposed). With one group:
- batch split:          x S(0), w R,    b R    -> S(0)
- output-channel split: x R,    w S(o), b S(0) -> S(1)   (o = 0, or 1 if transposed)
- input-channel split:  x S(1), w S(i), b P    -> P      (i = 1, or 0 if transposed)
  each rank convolves its channels with its slice of the kernel: a partial sum;
  the bias is Partial so that it is added once in the sum.
With groups > 1 only the batch split is offered (channel splits would have to
keep the group structure). Spatial splits need halo exchange and are not offered.
Each row is exact when the op runs on the local shards with its own arguments.
"""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import P, R, Row, S


def conv_rows(info: OpInfo, transposed: bool, groups: int) -> list[Row]:
    x, w = info.inputs[0], info.inputs[1]
    has_bias = len(info.inputs) > 2
    batched = x.ndim == w.ndim  # unbatched input: (C, *spatial)
    c = 1 if batched else 0
    out_w, in_w = (1, 0) if transposed else (0, 1)
    rows = []
    if batched and x.shape[0] > 1:
        rows.append(Row(S(0), (S(0), R) + (R,) * has_bias))
    if groups == 1:
        if w.shape[out_w] > 1:
            rows.append(Row(S(c), (R, S(out_w)) + (S(0),) * has_bias))
        if x.shape[c] > 1:
            rows.append(Row(P, (S(c), S(in_w)) + (P,) * has_bias))
    rows.append(Row(R, (R,) * len(info.inputs)))
    return rows


@register(aten.conv1d.default, aten.conv2d.default, aten.conv3d.default,
          aten.conv1d.padding, aten.conv2d.padding, aten.conv3d.padding, matmul=True)
def conv_rule(info: OpInfo):
    """convNd: the batch splits; with groups=1 also the output channels (with
    the weight and bias) or the input channels (a Partial sum; conv_rows)."""
    # convNd(input, weight, bias=None, stride, padding, dilation, groups)
    return conv_rows(info, transposed=False, groups=info.arg(6, "groups", 1))


@register(aten.conv_transpose1d.default, aten.conv_transpose2d.input, aten.conv_transpose3d.input, matmul=True)
def conv_transpose_rule(info: OpInfo):
    """conv_transposeNd: the batch, the output channels, or the input channels
    (a Partial sum), as conv_rule."""
    # conv_transposeNd(input, weight, bias=None, stride, padding, output_padding, groups, dilation)
    return conv_rows(info, transposed=True, groups=info.arg(6, "groups", 1))


@register(aten.convolution.default, matmul=True)
def convolution_rule(info: OpInfo):
    """aten.convolution, plain or transposed, as conv_rule and
    conv_transpose_rule."""
    # convolution(input, weight, bias, stride, padding, dilation, transposed, output_padding, groups)
    return conv_rows(info, transposed=bool(info.arg(6, "transposed")), groups=info.arg(8, "groups"))
