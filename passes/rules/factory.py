"""Tensor factories: tensors made from sizes alone (the same replicated
tensor on every rank), those shaped like their input (zeros_like, random
draws in an input's shape), and fills."""
from __future__ import annotations

from torch.ops import aten

from autopar.ir import OpInfo
from autopar.passes.rules.base import register
from autopar.passes.rules.view import other_dims_rows
from autopar.passes.strategy import R, Row, S


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
    autopar/local_ops.py): shaped as their input, so they split with it."""
    x = info.inputs[0]
    rows = [Row(S(d), (S(d),)) for d in range(x.ndim) if x.shape[d] > 1]
    rows.append(Row(R, (R,)))
    return rows


@register(aten.fill.Scalar, aten.new_zeros.default, aten.new_ones.default, aten.new_full.default,
          aten.new_empty.default)
def fill_rule(info: OpInfo):
    """fill(x, v) keeps x's shape: it splits with x. new_* make a tensor of a
    given size (the input only gives dtype and device): the same replicated
    tensor on every rank."""
    if info.target is aten.fill.Scalar:
        return other_dims_rows(info, [])
    return [Row(R, (R,) * len(info.inputs))]
