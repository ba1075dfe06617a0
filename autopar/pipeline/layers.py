"""Step 1 of pipeline planning: every op of the captured graph belongs to a layer
(see autopar/pipeline/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field


from autopar.errors import AutoparError
from autopar.ir import Graph, NodeKind


@dataclass
class Layers:
    """The captured graph cut into layers, the units stages are made of."""

    names: list
    """Layer module paths in execution order (``tok``, ``blocks.0``, ..., ``head``)."""
    group: dict
    """Anchored node (an op depending on a parameter, or a parameter) -> layer index."""
    floating: set
    """Ops that depend on no parameter: recomputed by every stage that uses them."""
    crossing: list
    """crossing[c]: tensors (node names, topological order) alive across the cut
    before layer c; crossing[0] is empty."""
    forbidden: set
    """Cuts that would separate the users of one parameter (tied weights)."""
    container: str | None = None
    """Module path of the repeated layers (``blocks``), if any."""
    cost_group: dict = field(default_factory=dict)
    """Every node -> the layer its cost is counted in (floating ops: their first user)."""

    @property
    def n(self) -> int:
        return len(self.names)

    def nodes_of(self, graph: Graph, start: int, stop: int) -> list:
        """Node names a stage over layers [start, stop) runs: its anchored ops and
        parameters, and the floating ops they need."""
        own = [name for name, g in self.group.items() if start <= g < stop]
        need = set(own)
        for name in reversed(list(graph.nodes)):
            if name in need or (name == "output" and stop == self.n):
                for src in graph.nodes[name].inputs:
                    if src in self.floating:
                        need.add(src)
        return [name for name in graph.nodes if name in need]


def find_container(graph: Graph) -> str | None:
    """The module list whose children the graph calls most (``blocks``), or None."""
    indices: dict = {}
    for node in graph.nodes.values():
        path = node.fqn if node.kind is NodeKind.OP else ""
        parts = path.split(".") if path else []
        for k, part in enumerate(parts):
            if part.isdigit():
                indices.setdefault(".".join(parts[:k]), set()).add(int(part))
    best = [(len(v), -len(k), k) for k, v in indices.items() if len(v) >= 2 and k]
    return max(best)[2] if best else None


def _key(path: str, container: str | None) -> str | None:
    if not path:
        return None
    parts = path.split(".")
    if container:
        depth = len(container.split("."))
        if path.startswith(container + ".") and len(parts) > depth:
            return ".".join(parts[:depth + 1])
        return ".".join(parts[:depth])
    return parts[0]


def group_layers(graph: Graph) -> Layers:
    """Assign every anchored node to a layer; see the module docstring."""
    container = find_container(graph)
    anchored: dict = {}
    names: list = []
    index: dict = {}
    floating: set = set()
    for node in graph.nodes.values():
        if node.kind is not NodeKind.OP:
            continue
        params = [graph.nodes[s] for s in node.inputs if graph.nodes[s].kind is NodeKind.PARAM]
        deps = [anchored[s] for s in node.inputs if s in anchored]
        if not params and not deps:
            floating.add(node.name)
            continue
        key = _key(node.fqn, container)
        if key is None and params:
            key = _key(params[0].fqn.rpartition(".")[0], container) or params[0].fqn
        own = -1
        if key is not None:
            if key not in index:
                index[key] = len(names)
                names.append(key)
            own = index[key]
        anchored[node.name] = max([own, *deps])
    if not names:
        raise AutoparError("the model has no parameters to place in pipeline stages")
    n = len(names)
    group = dict(anchored)
    forbidden: set = set()
    consumers = graph.consumers()
    for fqn, ph in graph.params.items():
        users = [anchored[c] for c, _ in consumers[ph] if c in anchored]
        if not users:
            continue
        group[ph] = min(users)
        forbidden.update(range(min(users) + 1, max(users) + 1))
    crossing: list = [[] for _ in range(n)]
    for name, g in anchored.items():
        if graph.nodes[name].outputs and len(graph.nodes[name].outputs) > 1:
            continue  # a tuple-valued op: its getitems are what cross
        last = g
        for c, _ in consumers[name]:
            last = max(last, n if c == "output" else anchored.get(c, g))
        for cut in range(g + 1, min(last, n - 1) + 1):
            crossing[cut].append(name)
    cost_group: dict = dict(group)
    for name in reversed(list(graph.nodes)):
        if name in cost_group:
            continue
        users = [cost_group.get(c, n - 1) if c != "output" else n - 1 for c, _ in consumers[name]]
        cost_group[name] = min(users) if users else n - 1
    return Layers(names, group, floating, crossing, forbidden, container, cost_group)
