"""Contractions written as einsum equations: one equation per op, one shared
row generator (the same idea as DTensor's gen_einsum_strategies)."""
from __future__ import annotations

import string

from torch.ops import aten

from autopar.errors import AutoparError
from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.strategy import P, R, Row, S


def einsum_rows(equation: str, info: OpInfo, additive: str | None = None) -> list[Row]:
    """Rows for ``equation`` over the first tensor inputs, plus an optional
    additive operand (a bias) whose letters are right-aligned with the output.

    Sharding an output letter shards every operand that has it (an operand that
    broadcasts along it, size 1, stays replicated); sharding a contracted
    letter leaves a Partial output and makes the additive operand Partial."""
    lhs, out = equation.split("->")
    operands = lhs.split(",")
    metas = info.inputs[: len(operands) + (additive is not None)]
    out_shape = info.out.shape

    def place(letters: str, letter: str, shape) -> object:
        if letter not in letters:
            return R
        pos = letters.index(letter)
        return S(pos) if shape[pos] != 1 else R

    rows = []
    for letter in dict.fromkeys(out):
        if out_shape[out.index(letter)] == 1:
            continue
        ins = [place(op, letter, m.shape) for op, m in zip(operands, metas)]
        if additive is not None:
            ins.append(place(additive, letter, metas[-1].shape))
        rows.append(Row(S(out.index(letter)), tuple(ins)))
    contracted = [c for c in dict.fromkeys("".join(operands)) if c not in out]
    for letter in contracted:
        ins = [place(op, letter, m.shape) for op, m in zip(operands, metas)]
        if all(p is R for p in ins):
            continue
        if additive is not None:
            ins.append(P)
        rows.append(Row(P, tuple(ins)))
    rows.append(Row(R, (R,) * len(metas)))
    return rows


def _batch_letters(n: int) -> str:
    return string.ascii_lowercase[:n]  # a, b, c, ... never clash with the upper-case core letters


@register(aten.mm.default, matmul=True)
def mm_rule(info: OpInfo):
    """a @ b: the rows of a, the columns of b, or the contracted dim (Partial)."""
    return einsum_rows("MK,KN->MN", info)


@register(aten.addmm.default, matmul=True)
def addmm_rule(info: OpInfo):
    """bias + a @ b: as mm, the bias split with the output (Partial where the
    product is)."""
    # addmm(bias, a, b): the bias comes first in the args, the rows put it last.
    rows = einsum_rows("MK,KN->MN", _rotate(info), additive="MN"[-info.inputs[0].ndim:] if info.inputs[0].ndim else "")
    return [Row(r.output, (r.inputs[-1], *r.inputs[:-1])) for r in rows]


@register(aten.bmm.default, matmul=True)
def bmm_rule(info: OpInfo):
    """Batched a @ b: the batch, the rows of a, the columns of b, or the
    contracted dim (Partial)."""
    return einsum_rows("BMK,BKN->BMN", info)


@register(aten.baddbmm.default, matmul=True)
def baddbmm_rule(info: OpInfo):
    """input + a @ b over a batch: as bmm, the added input split with the
    output."""
    rows = einsum_rows("BMK,BKN->BMN", _rotate(info), additive="BMN"[-info.inputs[0].ndim:])
    return [Row(r.output, (r.inputs[-1], *r.inputs[:-1])) for r in rows]


@register(aten.dot.default, matmul=True)
def dot_rule(info: OpInfo):
    """Dot product of two vectors: split both, and the scalar is a Partial sum."""
    return einsum_rows("K,K->", info)


@register(aten.mv.default, matmul=True)
def mv_rule(info: OpInfo):
    """Matrix times vector: the matrix's rows, or the contracted dim (Partial)."""
    return einsum_rows("MK,K->M", info)


@register(aten.outer.default)
def outer_rule(info: OpInfo):
    """One product per output element (no contraction): priced as element-wise."""
    return einsum_rows("M,N->MN", info)


@register(aten.linear.default, matmul=True)
def linear_rule(info: OpInfo):
    """x @ W^T + b: the batch dims, the output features (W's rows and b), or
    the input features (Partial)."""
    x = info.inputs[0]
    batch = _batch_letters(x.ndim - 1)
    eq = f"{batch}K,NK->{batch}N"
    return einsum_rows(eq, info, additive="N" if len(info.inputs) == 3 else None)


@register(aten.bilinear.default, matmul=True)
def bilinear_rule(info: OpInfo):
    """nn.Bilinear: y = x1 W x2 + b, one weight slice (I, J) per output feature."""
    x1, x2 = info.inputs[0], info.inputs[1]
    if x1.shape[:-1] != x2.shape[:-1]:
        return [Row(R, (R,) * len(info.inputs))]
    batch = _batch_letters(x1.ndim - 1)
    return einsum_rows(f"{batch}I,{batch}J,OIJ->{batch}O", info, additive="O" if len(info.inputs) == 4 else None)


@register(aten.matmul.default, matmul=True)
def matmul_rule(info: OpInfo):
    """torch.matmul with broadcast batch dims, as bmm; with a vector operand,
    replicated."""
    a, b = info.inputs[0].ndim, info.inputs[1].ndim
    if a == 1 or b == 1:
        return [Row(R, (R, R))]
    n = max(a, b) - 2
    batch = _batch_letters(n)
    eq = f"{batch[n - (a - 2):]}MK,{batch[n - (b - 2):]}KN->{batch}MN"
    return einsum_rows(eq, info)


def _rotate(info: OpInfo) -> OpInfo:
    """Move the first tensor input (the additive one) to the end."""
    return OpInfo(info.target, info.args, info.kwargs, info.inputs[1:] + info.inputs[:1], info.outputs)


def normalize_equation(equation: str, ndims: list[int]) -> str:
    """Explicit, ellipsis-free form of an einsum equation: 'bij,bjk' -> 'bij,bjk->bik',
    '...ij,jk->...ik' with a 3-D first operand -> 'Aij,jk->Aik'."""
    equation = equation.replace(" ", "")
    lhs, arrow, out = equation.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(ndims):
        raise AutoparError(f"einsum equation {equation!r} names {len(operands)} operands; the call passes {len(ndims)}")
    used = set(equation) - set(".,->")
    spare = [c for c in string.ascii_uppercase + string.ascii_lowercase if c not in used]
    widths = [n - len(op.replace("...", "")) if "..." in op else 0 for op, n in zip(operands, ndims)]
    width = max(widths, default=0)
    ell = "".join(spare[:width])
    operands = [op.replace("...", ell[width - w:]) for op, w in zip(operands, widths)]
    if arrow:
        out = out.replace("...", ell)
    else:
        counts = {c: "".join(operands).count(c) for c in "".join(operands)}
        out = ell + "".join(sorted(c for c, k in counts.items() if k == 1 and c not in ell))
    return ",".join(operands) + "->" + out


@register(aten.einsum.default, matmul=True)
def einsum_rule(info: OpInfo):
    """einsum(equation, tensors): split any output letter (operands without it
    stay replicated) or any summed letter (the output is Partial). An operand
    that repeats a letter (a diagonal) is only replicated."""
    equation = normalize_equation(info.arg(0, "equation"), [m.ndim for m in info.inputs])
    operands = equation.split("->")[0].split(",")
    if any(len(set(op)) != len(op) for op in operands):
        return [Row(R, (R,) * len(info.inputs))]
    return einsum_rows(equation, info)
