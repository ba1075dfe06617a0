"""The op-rule registry: one small function per op family, written for ONE mesh
axis. ``expand_to_mesh`` turns the rows into strategies over the whole mesh.

Every row must be exact when the op runs on the local shards (that is how the
runtime executes it, see autopar/spmd.py): sharding a dim the op treats
independently, or a contracted/reduced dim that leaves a Partial sum.

A rule receives an ``OpInfo`` (shapes of the tensor inputs and outputs, and the
non-tensor arguments) and returns ``Row``s: for one mesh axis, the placement of
the output and of each tensor input, in the order they appear in the args.
"""
from autopar.passes.rules.base import (  # noqa: F401  (the registry, with every rule below loaded)
    ReplicatedOnly, Rule, get_rule, register, registered_ops, rule_table,
)
from autopar.passes.rules import (  # noqa: F401,E402
    along, attention, conv, distance, embedding, experts, factory, indexing, loss, matmul, norm, pointwise, recurrent,
    reduction, spatial, view,
)
