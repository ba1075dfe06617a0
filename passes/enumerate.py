"""Strategy enumeration: every node gets the list of strategies the ILP chooses from."""
from __future__ import annotations

import dataclasses
import logging
import operator
from dataclasses import dataclass

from autopar.ir import Graph, Node, NodeKind
from autopar.passes.rules import ReplicatedOnly, get_rule
from torch.distributed.tensor import Shard

from autopar.passes.strategy import R, Row, S, Strategy, expand_to_mesh

log = logging.getLogger("autopar")


@dataclass(frozen=True)
class Fallback:
    """An op that runs replicated: it has no sharding rule, or its rule has
    no exact split for the arguments it is called with (``reason``)."""

    node: str
    op: str
    location: str
    reason: str = ""

    def to_json(self) -> dict:
        """As plan.json lists it (``reason`` only where there is one)."""
        return {k: v for k, v in vars(self).items() if k != "reason" or v}

    def describe(self) -> str:
        if self.reason:
            return f"{self.op} at {self.location} (node {self.node}) runs replicated: {self.reason}"
        return f"no sharding rule for {self.op} at {self.location} (node {self.node}); runs replicated"


def tensor_rows(node: Node) -> list[Row]:
    shape = node.out.shape
    rows = [Row(S(d), ()) for d in range(len(shape)) if shape[d] > 1]
    rows.append(Row(R, ()))
    return rows


def enumerate_strategies(graph: Graph, mesh_shape: tuple, warn: bool = True) -> tuple[dict, list[Fallback]]:
    """Every node's strategies, and the ops without a rule (logged unless ``warn`` is False)."""
    strategies: dict[str, list[Strategy]] = {}
    fallbacks: list[Fallback] = []
    for node in graph.nodes.values():
        strategies[node.name] = _node_strategies(node, graph, mesh_shape, strategies, fallbacks)
    for f in fallbacks if warn else ():
        if f.reason:
            log.warning("autopar: %s (node %s, in %s) runs replicated on every device: %s",
                        f.op, f.node, f.location, f.reason)
        else:
            log.warning("autopar: no sharding rule for %s (node %s, in %s); it runs replicated on every device",
                        f.op, f.node, f.location)
    return strategies, fallbacks


def _node_strategies(node, graph, mesh_shape, done, fallbacks) -> list[Strategy]:
    k = node.kind
    if k is NodeKind.INPUT:
        return expand_to_mesh(tensor_rows(node), mesh_shape, [], [node.out.shape])
    if k is NodeKind.PARAM:
        # a sharded parameter that a consumer gathers keeps the full copy until
        # backward (ZeRO-2) or gathers it again there (regather: ZeRO-3); any
        # of them may keep its optimizer state on the host (offload)
        specs = expand_to_mesh(tensor_rows(node), mesh_shape, [], [node.out.shape])
        specs += [Strategy(s.inputs, s.output, regather=True) for s in specs
                  if any(isinstance(p, Shard) and mesh_shape[a] > 1 for a, p in enumerate(s.output))]
        if not node.out.dtype.is_floating_point:
            return specs
        return specs + [dataclasses.replace(s, offload=True) for s in specs]
    if k in (NodeKind.BUFFER, NodeKind.CONSTANT):
        return [Strategy((), (R,) * len(mesh_shape))]
    if k is NodeKind.OUTPUT:
        return [Strategy(((R,) * len(mesh_shape),) * len(node.inputs), (R,) * len(mesh_shape))]
    if node.target is operator.getitem:
        specs = dict.fromkeys(s.item(node.item) if node.item >= 0 else s.output for s in done[node.inputs[0]])
        return [Strategy((spec,), spec) for spec in specs]
    rule = get_rule(node.target)
    replicated = [Strategy(((R,) * len(mesh_shape),) * len(node.inputs), (R,) * len(mesh_shape))]
    if node.state_update:  # runs on the buffer where it lives: replicated, the same update on every rank
        return replicated
    if rule is None:
        fallbacks.append(Fallback(node.name, node.op_name, node.fqn or "the top level"))
        return replicated
    try:
        rows = rule.fn(node.info)
    except ReplicatedOnly as e:
        fallbacks.append(Fallback(node.name, node.op_name, node.fqn or "the top level", str(e)))
        return replicated
    out = expand_to_mesh(rows, mesh_shape, [m.shape for m in node.info.inputs], [m.shape for m in node.outputs])
    return out
