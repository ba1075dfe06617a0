"""A plan's cost at any size, and as an expression over a range of sizes.

An ``Assignment`` is what a plan decides, free of sizes: a strategy per node
(as it prints, ``(S(0), R) -> S(0)``) and the regions it recomputes. The
``Pricer`` prices one at given sizes with the planner's own accounting
(``autopar.planner.build_plan`` on the step specialized to those sizes), so a
price is exactly what a static compile of those sizes predicts for that plan.

``Pricer.curve`` turns those prices into a sympy expression over a lattice of
sizes. The cost model is piecewise polynomial in the sizes: FLOPs, bytes and
memory are polynomials in the symbols (an element count times at most one
contracted size: ``SymbolicGraph.degree``), and times are sums of maxima of
such terms (a roofline, an exposed gradient sync). Each piece of a curve is
the polynomial through ``degree + 1`` prices per symbol, kept where it also
matches the prices between them (relative error under 1e-9, ``TOLERANCE``);
where it does not, the range is split (at the kink the two ends' lines meet,
for a one-symbol line) and each part fitted on its own.
"""
from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass

import numpy as np
import sympy

from autopar.cost_models.graph_costs import CostContext
from autopar.dynamic.graph import Lattice, SymbolicGraph
from autopar.passes.enumerate import enumerate_strategies
from autopar.passes.recompute import from_plan
from autopar.plan import Plan

TOLERANCE = 1e-9
"""Relative error at which a fitted polynomial counts as the price (float64
sums of a few thousand terms agree to ~1e-13)."""

COMPONENTS = ("step_time_s", "compute_s", "comm_s", "peak_memory_bytes")
"""The predictions a piece carries as expressions."""


@dataclass(frozen=True)
class Assignment:
    """A plan's decisions, free of sizes."""

    strategies: tuple  # ((node, strategy text), ...), in graph order
    recompute: str  # the plan's recompute entry (mode, layers, regions), as JSON

    @classmethod
    def of(cls, plan: Plan) -> "Assignment":
        by_fqn = plan.parameters
        out = []
        for n in plan.nodes:
            text = n.strategy
            if n.op == "param":
                info = by_fqn.get(n.location, {})
                text += " regather" * bool(info.get("regather")) + " offload" * bool(info.get("offload"))
            out.append((n.name, text))
        rc = {k: v for k, v in plan.recompute.items() if k != "candidates"}
        return cls(tuple(out), json.dumps(rc, sort_keys=True))

    def differs(self, other: "Assignment") -> list:
        """The nodes whose strategy differs between the two, and the two strategies."""
        mine, theirs = dict(self.strategies), dict(other.strategies)
        return [(n, s, theirs.get(n)) for n, s in mine.items() if theirs.get(n) != s]


class Pricer:
    """Prices assignments at sizes, with memoized prices and strategies."""

    def __init__(self, sg: SymbolicGraph, mesh, cluster, *, optimizer: str, precision: str, budget: float,
                 source: str | None):
        self.sg, self.mesh, self.cluster, self.budget, self.source = sg, mesh, cluster, budget, source
        self.ctx = CostContext.make(mesh.shape, cluster, optimizer, precision, offload=False)
        self.names = tuple(s.name for s in sg.symbols)
        self._strategies: dict = {}
        self._prices: dict = {}
        self.evaluations = 0

    def values(self, point: tuple) -> dict:
        return dict(zip(self.names, point))

    def strategies(self, lattice: Lattice) -> tuple[dict, dict]:
        """The lattice's strategies (the same at every size on it) and, per node, strategy text -> index."""
        if lattice not in self._strategies:
            graph = self.sg.specialize(self.values(lattice.first))
            strategies, _ = enumerate_strategies(graph, self.mesh.shape, warn=False)
            index = {n: {str(s): i for i, s in enumerate(ss)} for n, ss in strategies.items()}
            self._strategies[lattice] = (strategies, index)
        return self._strategies[lattice]

    def price(self, a: Assignment, lattice: Lattice, point: tuple) -> dict | None:
        """``a``'s predicted step at sizes ``point`` (on ``lattice``): the
        plan's ``predicted`` section, or None where some strategy is not
        valid there (a split that does not divide)."""
        key = (a, point)
        if key not in self._prices:
            self._prices[key] = self._price(a, lattice, point)
        return self._prices[key]

    def plan(self, a: Assignment, lattice: Lattice, point: tuple) -> Plan | None:
        """``a`` at sizes ``point`` as a whole plan (what codegen needs), or None where it is not valid."""
        from autopar.planner import build_plan
        from autopar.solver import Solution
        strategies, index = self.strategies(lattice)
        choice = {}
        for node, text in a.strategies:
            i = index.get(node, {}).get(text)
            if i is None:
                return None
            choice[node] = i
        graph = self.sg.specialize(self.values(point))
        chosen = {n: strategies[n][i] for n, i in choice.items()}
        rc = from_plan(graph, json.loads(a.recompute))
        solution = Solution(choice, "PRICED", math.nan, 0.0, 0, 0, 0.0, {})
        plan = build_plan(graph, chosen, strategies, self.ctx, self.mesh, solution, self.source, rc)
        plan.recompute = json.loads(a.recompute)
        return plan

    def _price(self, a, lattice, point):
        self.evaluations += 1
        plan = self.plan(a, lattice, point)
        if plan is None:
            return None
        return {k: plan.predicted[k] for k in COMPONENTS}

    def cost(self, a: Assignment, lattice: Lattice, point: tuple) -> float:
        """Step time, or infinity where ``a`` is not valid (a split that does not divide)."""
        p = self.price(a, lattice, point)
        return math.inf if p is None else p["step_time_s"]

    def fits(self, a: Assignment, lattice: Lattice, point: tuple) -> bool:
        """Whether ``a``'s predicted peak memory at ``point`` is within the budget."""
        p = self.price(a, lattice, point)
        return p is not None and p["peak_memory_bytes"] <= self.budget

    def curve(self, a: Assignment, lattice: Lattice, box: tuple, component: str = "step_time_s") -> "Curve":
        """``component`` of ``a`` over ``box`` (an index range per symbol on ``lattice``)."""
        def f(index):
            p = self.price(a, lattice, lattice.value(index))
            return math.nan if p is None else p[component]
        bound = tuple(self.sg.degree(n) for n in self.names)
        return Curve(lattice, fit(f, box, bound))


def fit(f, box: tuple, bound: tuple) -> list:
    """Segments (box, coefficients) of a piecewise polynomial through ``f``'s values on the index box."""
    segments = _fit(f, tuple(box), tuple(1 for _ in box), bound)
    return _absorbed(f, segments) if len(box) == 1 else segments


def _absorbed(f, segments: list) -> list:
    """One symbol: a short segment (a split left a few sizes on their own) that a
    neighbour's polynomial also gives becomes part of that neighbour."""
    out = []
    for box, coeffs in sorted(segments, key=lambda s: s[0]):
        (lo, hi), = box
        points = list(range(lo, hi + 1))
        if out and len(points) <= 3 and _gives(f, *out[-1], points):
            out[-1] = (((out[-1][0][0][0], hi),), out[-1][1])
            continue
        out.append((box, coeffs))
    merged = [out[0]] if out else []
    for box, coeffs in out[1:]:  # a short segment before one whose polynomial gives it
        (plo, phi), = merged[-1][0]
        if phi - plo < 3 and _gives(f, box, coeffs, list(range(plo, phi + 1))):
            merged[-1] = (((plo, box[0][1]),), shift(coeffs, box, ((plo, box[0][1]),)))
        else:
            merged.append((box, coeffs))
    return merged


def _gives(f, box, coeffs, points) -> bool:
    want = np.array([f((p,)) for p in points])
    got = evaluate(coeffs, box, [(p,) for p in points])
    return bool(np.all(np.abs(want - got) <= TOLERANCE * max(np.max(np.abs(want)), 1e-30)))


def shift(coeffs: np.ndarray, box: tuple, to: tuple) -> np.ndarray:
    """The same polynomial with its origin moved from ``box``'s low corner to ``to``'s."""
    out = np.zeros_like(coeffs)
    shifts = [c[0] - s[0] for s, c in zip(box, to)]
    for powers in itertools.product(*[range(n) for n in coeffs.shape]):
        # (u + d)^p = sum_k C(p, k) d^(p-k) u^k
        for ks in itertools.product(*[range(p + 1) for p in powers]):
            term = coeffs[powers]
            for p, k, d in zip(powers, ks, shifts):
                term = term * math.comb(p, k) * d ** (p - k)
            out[ks] += term
    return out


def _fit(f, box, degree, bound):
    extent = [hi - lo for lo, hi in box]
    nodes = [_spread(lo, hi, min(d + 1, hi - lo + 1)) for (lo, hi), d in zip(box, degree)]
    coeffs = _interpolate(f, nodes, box)
    if coeffs is None:  # not priced somewhere (a strategy that does not divide): no curve there
        return []
    checks = [sorted(set(_spread(lo, hi, 2 * len(n) + 1)) - set(n)) if len(n) < hi - lo + 1 else []
              for (lo, hi), n in zip(box, nodes)]
    if _matches(f, coeffs, box, nodes, checks):
        return [(box, coeffs)]
    if any(d < b and d < e for d, b, e in zip(degree, bound, extent)):
        return _fit(f, box, tuple(min(d + 1, b, max(e, 1)) for d, b, e in zip(degree, bound, extent)), bound)
    axis = max(range(len(box)), key=lambda i: extent[i])
    lo, hi = box[axis]
    cut = _kink(f, box, axis) if len(box) == 1 else None
    cut = cut if cut is not None and lo <= cut < hi else (lo + hi) // 2
    left = tuple((lo, cut) if i == axis else b for i, b in enumerate(box))
    right = tuple((cut + 1, hi) if i == axis else b for i, b in enumerate(box))
    return _fit(f, left, tuple(1 for _ in box), bound) + _fit(f, right, tuple(1 for _ in box), bound)


def _spread(lo: int, hi: int, n: int) -> list:
    if n <= 1 or hi == lo:
        return [lo]
    return sorted({int(round(lo + (hi - lo) * k / (n - 1))) for k in range(n)})


def _interpolate(f, nodes, box):
    """Coefficients c[i, j, ...] of sum c u^i w^j ... (u = index - box low) through f on the node grid."""
    grid = list(itertools.product(*nodes))
    values = np.array([f(p) for p in grid], dtype=float)
    if not np.all(np.isfinite(values)):
        return None
    mats = [np.vander(np.array(n, dtype=float) - lo, len(n), increasing=True) for n, (lo, _) in zip(nodes, box)]
    tensor = values.reshape([len(n) for n in nodes])
    for axis, m in enumerate(mats):
        tensor = np.moveaxis(np.tensordot(np.linalg.inv(m), np.moveaxis(tensor, axis, 0), axes=(1, 0)), 0, axis)
    return tensor


def evaluate(coeffs: np.ndarray, box: tuple, points) -> np.ndarray:
    """The polynomial at index points (an array of shape (k, n_symbols))."""
    points = np.asarray(points, dtype=float)
    out = np.zeros(len(points))
    for powers in itertools.product(*[range(n) for n in coeffs.shape]):
        term = np.full(len(points), coeffs[powers])
        for axis, p in enumerate(powers):
            if p:
                term = term * (points[:, axis] - box[axis][0]) ** p
        out += term
    return out


def _matches(f, coeffs, box, nodes, checks) -> bool:
    per_axis = [sorted(set(n) | set(c)) for n, c in zip(nodes, checks)]
    points = [p for p in itertools.product(*per_axis) if any(v not in n for v, n in zip(p, nodes))]
    if not points:
        return True
    want = np.array([f(p) for p in points])
    got = evaluate(coeffs, box, points)
    scale = max(np.max(np.abs(want)), 1e-30)
    return bool(np.all(np.abs(want - got) <= TOLERANCE * scale))


def _kink(f, box, axis) -> int | None:
    """Where the lines through each end's first two prices meet (one symbol)."""
    lo, hi = box[axis]
    if hi - lo < 3:
        return None
    a0, a1, b0, b1 = f((lo,)), f((lo + 1,)), f((hi - 1,)), f((hi,))
    sa, sb = a1 - a0, b1 - b0
    if sa == sb:
        return None
    x = lo + (b1 - sb * (hi - lo) - a0) / (sa - sb)
    return int(math.floor(x)) if math.isfinite(x) else None


class Curve:
    """A priced quantity over a box of a lattice: polynomial segments."""

    def __init__(self, lattice: Lattice, segments: list):
        self.lattice, self.segments = lattice, segments

    def at(self, points) -> np.ndarray:
        """Values at index points (k x n_symbols); NaN outside every segment."""
        points = np.asarray(points, dtype=float).reshape(-1, len(self.lattice.first))
        out = np.full(len(points), np.nan)
        for box, coeffs in self.segments:
            inside = np.all([(points[:, i] >= lo) & (points[:, i] <= hi) for i, (lo, hi) in enumerate(box)], axis=0)
            if inside.any():
                out[inside] = evaluate(coeffs, box, points[inside])
        return out

    def expression(self, symbols: tuple) -> sympy.Expr:
        """The curve in the sizes themselves: a polynomial, or a Piecewise of them."""
        pieces = []
        lat = self.lattice
        for box, coeffs in self.segments:
            us = [(s - f) / st - lo for s, f, st, (lo, _) in zip(symbols, lat.first, lat.step, box)]
            expr = sympy.Float(0)
            for powers in itertools.product(*[range(n) for n in coeffs.shape]):
                c = float(coeffs[powers])
                if c:
                    expr += sympy.Float(c, 15) * sympy.Mul(*[u ** p for u, p in zip(us, powers)])
            expr = sympy.expand(expr)
            cond = sympy.And(*[sympy.And(s >= f + st * lo, s <= f + st * hi)
                               for s, f, st, (lo, hi) in zip(symbols, lat.first, lat.step, box)])
            pieces.append((_tidy(expr), cond))
        if len(pieces) == 1:
            return pieces[0][0]
        return sympy.Piecewise(*pieces[:-1], (pieces[-1][0], True))


def _tidy(expr):
    """Rounding noise of the fit (terms 1e-12 below the largest) left out."""
    terms = sympy.Add.make_args(expr)
    scale = max((abs(float(t.as_coeff_Mul()[0])) for t in terms), default=0.0)
    return sympy.Add(*[t for t in terms if abs(float(t.as_coeff_Mul()[0])) > 1e-12 * scale])


__all__ = ["Assignment", "Pricer", "Curve", "fit", "COMPONENTS"]
