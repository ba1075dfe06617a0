"""Activation memory over the backward pass, in program order.

Backward runs the ops in reverse. When it reaches op ``o``, the activations
kept by ``o`` and everything before it are still alive (those of later ops
were freed by their own backward) and ``o``'s gradient working set is
allocated. A recomputed region's activations are alive again while backward
runs through it. So the activation side of the peak is

    max over ops o of:  kept(n <= o) + recomputed(region of o, n <= o) + working_set(o)

``Timeline`` collects those terms as {key: bytes} maps, where a key is an
ILP variable (the solver: the bytes count when it is chosen) or None (a
chosen plan, ``build_plan``: plain bytes), and walks them as points.
"""
from __future__ import annotations

from collections import defaultdict

from autopar.cost_models.overlap import prefetched_chain
from autopar.ir import Graph
from autopar.passes.recompute import Recomputation


def add(table: dict, key, amount: float) -> None:
    """``table[key] += amount`` (a sparse sum of terms: key -> coefficient)."""
    if amount:
        table[key] = table.get(key, 0.0) + amount


def first_consumers(graph: Graph) -> dict:
    """Each node's first consumer in program order (where a resharded copy of
    it, or a gathered parameter's gradient, is placed on the timeline)."""
    return {src: uses[0][0] for src, uses in graph.consumers().items() if uses}


class Timeline:
    def __init__(self, graph: Graph, rc: Recomputation):
        self.position = {name: k for k, name in enumerate(graph.nodes)}
        self.region = {n: i for i, r in enumerate(rc.regions) for n in r}
        self.rc = rc
        self.kept = defaultdict(dict)  # position -> {key: bytes}, kept until that op's backward
        self.again = defaultdict(dict)  # position -> {key: bytes}, recomputed in its region's backward
        self.working = defaultdict(list)  # position -> [{key: bytes}], a working set during that op's backward

    def activation(self, name: str, key, nbytes: float) -> None:
        """Node ``name`` keeps ``nbytes`` for backward (as if not recomputed)."""
        table = self.again if self.rc.drops(name) else self.kept
        add(table[self.position[name]], key, nbytes)

    def copy(self, consumer: str, key, nbytes: float) -> None:
        """A resharded copy made for ``consumer`` and kept for its backward."""
        table = self.again if consumer in self.region else self.kept
        add(table[self.position[consumer]], key, nbytes)

    def working_set(self, at: str, terms: dict) -> None:
        """Bytes alive for a moment during the backward of node ``at``."""
        if terms:
            self.working[self.position[at]].append(terms)

    def points(self, wanted=None):
        """Yield (kept since the previous point, recomputed in this region so
        far, [working sets]) at each op with a working set (``wanted``: a set
        of node names to stop at, default all), in program order, and finally
        ({kept since}, {}, []) for the end of forward."""
        names = list(self.position)
        since: dict = {}
        region_so_far: dict = {}
        current = None
        for k, name in enumerate(names):
            region = self.region.get(name)
            if region != current:
                region_so_far, current = {}, region
            for key, b in self.kept.get(k, {}).items():
                add(since, key, b)
            for key, b in self.again.get(k, {}).items():
                add(region_so_far, key, b)
            if self.working.get(k) and (wanted is None or name in wanted):
                yield since, dict(region_so_far), self.working[k]
                since = {}
        yield since, {}, []

    def peak(self, value=lambda key: 1.0) -> tuple[float, float]:
        """(activations alive, working set) where their sum is largest, each
        key's bytes counted ``value(key)`` times (1 for a chosen plan's None
        keys; an ILP variable's 0/1 solution value)."""
        total = lambda table: sum(b * value(k) for k, b in table.items())  # noqa: E731
        best, running = (0.0, 0.0), 0.0
        for since, region, working in self.points():
            running += total(since)
            alive = running + total(region)
            ws = max((total(t) for t in working), default=0.0)
            if alive + ws >= sum(best):
                best = (alive, ws)
        return best


class SyncWindow:
    """Gradient synchronisation hidden under backward compute, per parameter.

    Each parameter's gradient is reduced (all-reduce or reduce-scatter) as
    soon as its consumer's backward has made it, one collective after another
    on each link, while backward computes the ops before that consumer (as
    PyTorch DDP and FSDP overlap their buckets; Li et al., VLDB 2020, sec.
    3.2.3). Each parameter's part of its bucket is placed where its gradient
    is made, at its bytes and its share of the bucket's call
    (graph_costs.bucketed). The syncs made at or after op k cannot start before backward
    reaches k, and only the compute of the ops before k is left to hide them,
    so on each link the exposed time is at least

        sum of the syncs at positions <= k on it  -  backward compute of ops before k

    for every k (with k the last op: that link's total sync minus the total
    backward compute). Links work at once (intra-node and inter-node syncs do
    not wait for each other; a hierarchical collective occupies both), so the
    step's exposed sync is the largest over links and k, or 0. Backward
    collectives of other tensors are not counted as hiding time: they may
    hold the same link.
    """

    def __init__(self, graph: Graph):
        self.position = {name: k for k, name in enumerate(graph.nodes)}
        self.backward = defaultdict(dict)  # position -> {key: seconds}
        self.syncs = defaultdict(lambda: defaultdict(dict))  # link -> position -> {key: seconds}

    def compute(self, name: str, key, seconds: float) -> None:
        add(self.backward[self.position[name]], key, seconds)

    def sync(self, consumer: str, key, seconds: float, links) -> None:
        """A gradient reduced after ``consumer``'s backward, on ``links``
        (AxisLinks.levels of its mesh axis)."""
        for link in links:
            add(self.syncs[link][self.position[consumer]], key, seconds)

    def points(self):
        """Per link, (link, syncs since the previous point, backward compute
        since it) at each position with a sync on it, in program order: the
        running sum of the second minus the third is a lower bound of the
        exposed time there (restart it at each new link)."""
        for link in sorted(self.syncs):
            at = self.syncs[link]
            syncs, compute = {}, {}
            for k in range(len(self.position)):
                for key, t in at.get(k, {}).items():
                    add(syncs, key, t)
                if at.get(k):
                    yield link, syncs, compute
                    syncs, compute = {}, {}
                for key, t in self.backward.get(k, {}).items():
                    add(compute, key, t)

    def exposed(self, value=lambda key: 1.0) -> float:
        return self.most_exposed(value)[0]

    def most_exposed(self, value=lambda key: 1.0) -> tuple[float, tuple | None]:
        """(the exposed time, the point where it is: (link, index of the
        point on it) or None when all sync hides)."""
        total = lambda table: sum(t * value(k) for k, t in table.items())  # noqa: E731
        running, worst, where, current, index = 0.0, 0.0, None, None, 0
        for link, syncs, compute in self.points():
            running, index = (running, index + 1) if link == current else (0.0, 0)
            current = link
            running += total(syncs) - total(compute)
            if running > worst:
                worst, where = running, (link, index)
        return worst, where


class GatherWindow:
    """ZeRO-3 parameter gathers in forward, each started one module ahead.

    The emitted program gathers a regathered parameter where it is first
    used and, right after, starts the all-gather of the next one (codegen's
    ``_prefetch``, FSDP's forward prefetch), so that gather runs while the
    ops from this point up to its own use compute: at gather point i its
    exposed time is

        max(0, gathers at i  -  forward compute of the ops from point i-1 up to i)

    and the first point's gathers are exposed whole. One gather is in flight
    at a time, so the points do not queue behind each other. The points are
    the first consumers of parameters that may be regathered (the ILP:
    every such choice still open; a chosen plan: its regathered ones, and
    ``point`` for the others it could have chosen), in program order.
    """

    def __init__(self, graph: Graph):
        self.position = {name: k for k, name in enumerate(graph.nodes)}
        self.forward = defaultdict(dict)  # position -> {key: seconds}
        self.gathers = defaultdict(dict)  # position -> {key: seconds}

    def compute(self, name: str, key, seconds: float) -> None:
        add(self.forward[self.position[name]], key, seconds)

    def gather(self, consumer: str, key, seconds: float) -> None:
        """A parameter's all-gather for ``consumer``, its first use."""
        self.point(consumer)
        add(self.gathers[self.position[consumer]], key, seconds)

    def point(self, consumer: str) -> None:
        """A gather point, whether or not a gather is chosen there."""
        self.gathers.setdefault(self.position[consumer], {})

    def points(self):
        """(gathers at the point, forward compute since the previous point or
        None at the first) at each point, in program order."""
        compute, first = {}, True
        for k in range(len(self.position)):
            if k in self.gathers:
                yield self.gathers[k], None if first else compute
                compute, first = {}, False
            for key, t in self.forward.get(k, {}).items():
                add(compute, key, t)

    def exposed(self, value=lambda key: 1.0) -> float:
        total = lambda table: sum(t * value(k) for k, t in table.items())  # noqa: E731
        points = list(self.points())
        return prefetched_chain([total(g) for g, _ in points], [total(c or {}) for _, c in points])
