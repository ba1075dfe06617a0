"""Classes of repeated layers: nodes of identical layers share one set of ILP
variables, so a 96-layer model costs the ILP what one layer does.

A layer is a numbered module (``blocks.7``, ``h.7``, ``layers.7``...): every
node whose module path (or parameter name) starts with ``<list>.<i>.`` belongs
to layer i of that list. Layers are identical when their node sequences match
op for op, shape for shape, with inputs that point to the same relative
positions (inside the layer) or to the same kind of outside producer. Each
node of layer i maps to the node at the same position of the first layer of
its class, its representative.
"""
from __future__ import annotations

import re
from collections import defaultdict

from autopar.ir import Graph, NodeKind

_LAYER = re.compile(r"^(.*?)\.(\d+)(?:\.|$)")


def layer_of(node) -> tuple[str, int] | None:
    """(list path, index) of the numbered layer a node belongs to, e.g. ("blocks", 3)."""
    m = _LAYER.match(node.fqn or "")
    return (m.group(1), int(m.group(2))) if m else None


def repeated_layers(graph: Graph) -> list[list[list[str]]]:
    """Classes of identical layers, each a list of its instances in layer
    order, each instance its node names in graph order. Layers without a twin
    are left out."""
    members: dict = defaultdict(list)
    for node in graph.nodes.values():
        if node.kind in (NodeKind.OP, NodeKind.PARAM):
            key = layer_of(node)
            if key is not None:
                members[key].append(node.name)
    by_list: dict = defaultdict(list)
    for (lst, i), names in members.items():
        by_list[lst].append((i, names))
    classes: dict = {}
    for lst, layers in by_list.items():
        for i, names in sorted(layers):
            classes.setdefault((lst, _signature(graph, names)), []).append(names)
    return [instances for instances in classes.values() if len(instances) > 1]


Ends = tuple[tuple[int, int], ...]
"""Per class, how many instances at its front and at its back have their own
variables; the instances in between share the first of them's."""


def layer_classes(graph: Graph, ends: Ends | None = None, layers: list | None = None) -> dict[str, str]:
    """node name -> representative node name (itself when not clustered).
    ``ends`` (default: none) peels instances off each class's ends
    (``deeper_ends``); ``layers`` is ``repeated_layers(graph)`` if known."""
    layers = repeated_layers(graph) if layers is None else layers
    rep = {name: name for name in graph.nodes}
    for k, instances in enumerate(layers):
        front, back = ends[k] if ends else (0, 0)
        shared = instances[front:len(instances) - back]
        for names in shared[1:]:
            for mine, theirs in zip(names, shared[0]):
                rep[mine] = theirs
    return rep


def deeper_ends(layers: list, ends: Ends, choice: dict) -> Ends:
    """Peel the first and last instance off each class at first; then one
    more instance off an end of a class where the solved plan
    gives its outermost shared instance's neighbour a different strategy:
    where a layer's position changes its best strategy (the first layer's
    gradient sync has the least backward compute left to hide under; the
    last layer feeds the head), the next one may differ too. Unchanged ends
    mean every class's shared instances agree with the peeled ones around
    them."""
    out = []
    for instances, start in zip(layers, ends):
        (front, back), n = start, len(instances)
        same = lambda a, b: all(choice[x] == choice[y] for x, y in zip(instances[a], instances[b]))  # noqa: E731
        if front + back < n - 1 and (front == 0 or not same(front - 1, front)):
            front += 1
        if front + back < n - 1 and (back == 0 or not same(n - back, n - back - 1)):
            back += 1
        if (front, back) != start and n - front - back <= 2:
            front, back = n, 0  # sharing one set between two saves less than solving again costs
        out.append((front, back))
    return tuple(out)


def _signature(graph: Graph, names: list[str]) -> tuple:
    pos = {n: k for k, n in enumerate(names)}
    out = []
    for n in names:
        node = graph.nodes[n]
        ins = tuple(("in", pos[s]) if s in pos else ("out", graph.nodes[s].kind.value,
                                                      tuple(graph.nodes[s].out.shape)) for s in node.inputs)
        args = _static_args(node)
        out.append((node.kind.value, node.op_name, tuple(tuple(m.shape) for m in node.outputs), ins, args))
    return tuple(out)


def _static_args(node) -> str:
    if node.info is None:
        return ""
    return repr([a for a in node.info.args if not hasattr(a, "meta")]) + repr(sorted(node.info.kwargs.items()))


def summary(rep: dict) -> dict:
    """Counts for the plan: nodes, variables sets solved, classes."""
    reps = set(rep.values())
    clustered = sum(1 for k, v in rep.items() if k != v)
    return {"nodes": len(rep), "solved_nodes": len(reps), "clustered_nodes": clustered}


def parse_layer(path: str) -> tuple[str, int]:
    """"blocks.3" -> ("blocks", 3), the inverse of how plans name layers."""
    lst, _, i = path.rpartition(".")
    return lst, int(i)


def layer_lists(graph: Graph) -> dict[str, list[int]]:
    """Numbered layer lists of the graph, e.g. {"blocks": [0, 1, ..., 23]}."""
    out: dict = defaultdict(set)
    for node in graph.nodes.values():
        if node.kind is NodeKind.OP:
            key = layer_of(node)
            if key is not None:
                out[key[0]].add(key[1])
    return {k: sorted(v) for k, v in out.items()}


def nodes_of_layers(graph: Graph, layers: set) -> set:
    """Op nodes inside the given (list path, index) layers."""
    return {n.name for n in graph.nodes.values() if n.kind is NodeKind.OP and layer_of(n) in layers}
