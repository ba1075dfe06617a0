"""Strategy value types and the expansion of single-axis rules to a full mesh.

Placements are torch.distributed.tensor's own ``Shard(d)``, ``Replicate()`` and
``Partial(op)``. A *spec* is one placement per mesh axis for one tensor; it
prints as ``S(0)`` on a 1-D mesh and ``S(0)R`` on a 2-D one (DTensor's style).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement

from autopar.errors import PlanError

R = Replicate()
P = Partial()
Spec = tuple  # tuple[Placement, ...], one per mesh axis


def S(dim: int) -> Shard:
    return Shard(dim)


def fmt_placement(p: Placement) -> str:
    if isinstance(p, Shard):
        return f"S({p.dim})"
    if isinstance(p, Replicate):
        return "R"
    if isinstance(p, Partial):
        return "P" if p.reduce_op == "sum" else f"P({p.reduce_op})"
    raise PlanError(f"placement {p!r} is not one of Shard, Replicate, Partial")


def parse_placement(text: str) -> Placement:
    text = text.strip()
    if text == "R":
        return Replicate()
    if text == "P":
        return Partial()
    if text.startswith("P(") and text.endswith(")"):
        op = text[2:-1]
        if op not in ("sum", "avg", "max", "min"):
            raise PlanError(f"placement {text!r}: partial reduce op must be sum, avg, max or min")
        return Partial(op)
    if text.startswith("S(") and text.endswith(")"):
        try:
            return Shard(int(text[2:-1]))
        except ValueError:
            pass
    raise PlanError(f"placement {text!r} is not valid; expected S(<dim>), R, P or P(<op>)")


def fmt_spec(spec: Spec | None) -> str:
    if spec is None:
        return "-"
    return "".join(fmt_placement(p) for p in spec)


def parse_spec(text: str, ndim: int) -> Spec:
    """Inverse of fmt_spec: 'S(0)R' -> (Shard(0), Replicate())."""
    parts, i = [], 0
    while i < len(text):
        if text[i] == "R":
            parts.append("R"); i += 1
        elif text[i] in "SP" and i + 1 < len(text) and text[i + 1] == "(":
            j = text.index(")", i)
            parts.append(text[i:j + 1]); i = j + 1
        elif text[i] == "P":
            parts.append("P"); i += 1
        else:
            raise PlanError(f"placement spec {text!r} is not valid at {text[i:]!r}; expected e.g. 'S(0)R'")
    if len(parts) != ndim:
        raise PlanError(f"placement spec {text!r} has {len(parts)} placements; the mesh has {ndim} axes")
    return tuple(parse_placement(p) for p in parts)


@dataclass(frozen=True)
class Strategy:
    """One way to run a node: a spec for each tensor input and for the output."""

    inputs: tuple  # tuple[Spec, ...], one per tensor input
    output: Spec
    regather: bool = False
    """Parameters only (ZeRO stage 3): full copies gathered from this sharded
    parameter are not kept for backward but gathered again there. Without it a
    gathered copy stays alive until backward (ZeRO stage 2)."""
    items: tuple | None = None
    """An op with several outputs placed differently (a batch-first LSTM's
    output has its batch on dim 0, its final states on dim 1): a Spec per
    output, ``output`` being the first. None: every output is placed as
    ``output``."""
    offload: bool = False
    """Parameters only (ZeRO-Offload): its optimizer state lives in host memory
    and its update runs there; each step its gradient goes to the host and the
    updated values come back."""

    def item(self, k: int) -> Spec:
        """The placement of output ``k`` (what a ``getitem`` of it receives)."""
        return self.items[k] if self.items else self.output

    def __str__(self) -> str:
        out = f"({', '.join(fmt_spec(s) for s in self.items)})" if self.items else fmt_spec(self.output)
        text = f"({', '.join(fmt_spec(s) for s in self.inputs)}) -> {out}"
        return text + " regather" * self.regather + " offload" * self.offload

    def splits(self, axis: int) -> bool:
        """Whether the work of this op is divided over mesh axis ``axis``."""
        return any(isinstance(s[axis], Shard) for s in (*self.inputs, self.output, *(self.items or ())))


@dataclass(frozen=True)
class Row:
    """A single-mesh-axis strategy row, as rules write them."""

    output: Placement
    inputs: tuple  # tuple[Placement, ...]
    items: tuple | None = None
    """A placement per output, for an op whose outputs are placed differently
    (``Strategy.items``); ``output`` is then the first of them."""
    routes: bool = False
    """The op's local implementation moves rows between the ranks of the
    axes this row is on (an all-to-all inside the op, priced by
    graph_costs.op_moves): on other mesh axes it combines only with itself
    (its group is then their flattening) or with the replicate row."""


def row(output: Placement, *inputs: Placement) -> Row:
    return Row(output, tuple(inputs))


def replicate_row(n_inputs: int) -> Row:
    return Row(R, (R,) * n_inputs)


def divides(spec: Spec, shape: Sequence[int], mesh_shape: Sequence[int]) -> bool:
    """Whether every dim ``spec`` splits divides by the mesh axes that split it."""
    factor = [1] * len(shape)
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            d = p.dim
            if d < 0 or d >= len(shape):
                return False
            factor[d] *= mesh_shape[axis]
    return all(size % f == 0 for size, f in zip(shape, factor))


def expand_to_mesh(
    rows: Sequence[Row],
    mesh_shape: Sequence[int],
    input_shapes: Sequence[Sequence[int]],
    output_shapes: Sequence[Sequence[int]],
) -> list[Strategy]:
    """Every combination of one row per mesh axis, keeping those whose shards divide.

    Axes of size 1 only take the all-replicate row."""
    rows = list(dict.fromkeys(rows))
    for r in rows:
        if r.items is not None and (len(r.items) != len(output_shapes) or r.items[0] != r.output):
            raise PlanError(f"rule row {r} places {len(r.items)} outputs, first {r.items[0]}; the op has "
                            f"{len(output_shapes)} outputs and the first must be the row's output {r.output}")
    per_axis = []
    for size in mesh_shape:
        per_axis.append(rows if size > 1 else [r for r in rows if _is_replicate(r)] or rows[:1])
    out = []
    for combo in itertools.product(*per_axis):
        routing = {r for r in combo if r.routes}
        if routing and (len(routing) > 1 or any(not r.routes and not _is_replicate(r) for r in combo)):
            continue
        inputs = tuple(tuple(r.inputs[i] for r in combo) for i in range(len(combo[0].inputs)))
        output = tuple(r.output for r in combo)
        items = tuple(tuple(r.items[k] if r.items else r.output for r in combo) for k in range(len(output_shapes)))
        if not all(divides(s, sh, mesh_shape) for s, sh in zip(inputs, input_shapes)):
            continue
        if not all(divides(s, sh, mesh_shape) for s, sh in zip(items, output_shapes)):
            continue
        out.append(Strategy(inputs, output, items=None if all(s == output for s in items) else items))
    return out


def _is_replicate(r: Row) -> bool:
    return isinstance(r.output, Replicate) and all(isinstance(p, Replicate) for p in r.inputs)


def shard_factor(spec: Spec, mesh_shape: Sequence[int]) -> int:
    """How many pieces a tensor with this spec is cut into."""
    return math.prod(mesh_shape[a] for a, p in enumerate(spec) if isinstance(p, Shard))


def local_shape(shape: Sequence[int], spec: Spec, mesh_shape: Sequence[int]) -> tuple[int, ...]:
    out = list(shape)
    for axis, p in enumerate(spec):
        if isinstance(p, Shard):
            if out[p.dim] % mesh_shape[axis]:
                from autopar.errors import ShardingError
                raise ShardingError(
                    f"dimension {p.dim} of size {shape[p.dim]} does not divide mesh axis {axis} of size "
                    f"{mesh_shape[axis]}; valid: sizes that are multiples of the axis size"
                )
            out[p.dim] //= mesh_shape[axis]
    return tuple(out)
