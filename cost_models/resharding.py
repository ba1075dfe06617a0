"""Resharding: the collectives that turn one placement spec into another, and
their cost, forward and backward.

Per mesh axis (DTensor redistributes axis by axis):
  S(i) -> R      all-gather          P -> R     all-reduce
  P -> S(i)      reduce-scatter      S(i)->S(j) all-to-all
  R -> S(i)      local slice (free)  R -> P     local (free)
The backward of an edge moves the gradient the other way: the consumer's
gradient is Partial on an axis where the consumer took a Replicate input but
split its work; a Partial producer receives a Replicate gradient.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost_models.collectives import AxisLinks, Collective, collective_time


@dataclass(frozen=True)
class Move:
    kind: Collective
    axis: int
    nbytes: float
    """Bytes of the buffer the collective works on (the gathered size for gathers/scatters)."""
    seconds: float
    axes: tuple = ()
    """Every mesh axis of its group where it spans several (``axis`` is then
    the one whose link bounds it)."""


def transitions(src: tuple, dst: tuple, nbytes: float, mesh_shape: tuple, links: list[AxisLinks]) -> list[Move]:
    """Collectives for src -> dst of a tensor of ``nbytes`` global bytes."""
    if src == dst:
        return []
    return list(_transitions(src, dst, nbytes, tuple(mesh_shape), tuple(links)))


@functools.lru_cache(maxsize=1 << 16)
def _transitions(src: tuple, dst: tuple, nbytes: float, mesh_shape: tuple, links: tuple) -> tuple:
    """``transitions``, remembered: the ILP asks for the same few specs and
    sizes on every edge of a layer (placements and links are frozen values)."""
    moves = []
    src, dst = as_sum(src), as_sum(dst)
    for axis, (a, b) in enumerate(zip(src, dst)):
        if a == b or mesh_shape[axis] == 1:
            continue
        # the group for this axis holds the tensor cut by the *other* axes' shards
        others = math.prod(mesh_shape[o] for o, p in enumerate(src) if o != axis and isinstance(p, Shard))
        size = nbytes / others
        kind = _kind(a, b)
        if kind is None:
            continue
        moves.append(Move(kind, axis, size, collective_time(kind, size, links[axis])))
        if kind in _NESTING and sum(x != y for x, y in zip(src, dst)) == 1:  # a one-axis move: moves._one_axis
            inner = nested_inside(src, axis, (a if isinstance(a, Shard) else b).dim, mesh_shape)
            if inner is not None:
                moves.append(Move(Collective.ALL_TO_ALL, inner, size,
                                  collective_time(Collective.ALL_TO_ALL, size, links[inner])))
    return tuple(moves)


_NESTING = (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)


def nested_inside(src: tuple, axis: int, dim: int, mesh_shape) -> int | None:
    """The axis b whose all-to-all a one-axis gather (S(dim) -> R) or
    reduce-scatter (P -> S(dim)) on ``axis`` of a value placed ``src`` also
    needs because b splits the dim inside this axis's pieces (b later, the
    same size, and the only other axis splitting it): the pieces nest, and
    the runtime routes them over b (moves._nested). None otherwise."""
    others = [b for b, p in enumerate(src) if b != axis and isinstance(p, Shard) and p.dim == dim]
    if len(others) == 1 and others[0] > axis and mesh_shape[others[0]] == mesh_shape[axis]:
        return others[0]
    return None


def as_sum(spec: tuple) -> tuple:
    """A P(avg) runs as a Partial sum of scaled local values (autopar/spmd.py)."""
    return tuple(Partial() if isinstance(p, Partial) and p.reduce_op == "avg" else p for p in spec)


def reads_in_place(src: tuple, dst: tuple) -> bool:
    """Whether a consumer taking ``src`` as ``dst`` reads the producer's own
    storage: the same placement, or only local steps from replicated (R -> S
    is a slice, a view of the whole tensor for a dim-0 shard; R -> P keeps
    it on one rank). Then what the consumer keeps for backward keeps the
    producer's tensor alive, not a copy of its own size."""
    return all(a == b or isinstance(a, Replicate) for a, b in zip(as_sum(src), as_sum(dst)))


def _kind(a, b) -> Collective | None:
    if isinstance(a, Replicate):
        return None  # R -> S is a slice, R -> P is local
    if isinstance(a, Shard):
        if isinstance(b, Shard):
            return Collective.ALL_TO_ALL
        return Collective.ALL_GATHER  # S -> R, and S -> P via R
    if isinstance(a, Partial):
        if isinstance(b, Shard):
            return Collective.REDUCE_SCATTER
        return Collective.ALL_REDUCE  # P -> R, and P(op) -> P(other op)
    return None


def grad_spec(spec: tuple, splits: tuple) -> tuple:
    """The placement of the gradient flowing back into an input of this spec.

    ``splits[a]`` says whether the consuming op divides its work over axis a."""
    out = []
    for p, split in zip(spec, splits):
        if isinstance(p, Partial):
            out.append(Replicate())
        elif isinstance(p, Replicate) and split:
            out.append(Partial())
        else:
            out.append(p)
    return tuple(out)


def producer_grad_spec(spec: tuple) -> tuple:
    """The gradient placement a producer with this output spec needs."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)
