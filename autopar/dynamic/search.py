"""The piecewise plan: where over a range of sizes the optimal plan changes.

On each lattice (sizes that divide alike, autopar/dynamic/graph.py), with
``tolerance`` the most a piece's plan may be slower than each size's optimum:

* One symbol (``_sweep``), from the lowest size up. The ILP solves the
  piece's first size (a ``probe``: the static compile of that size, on the
  step specialized to it); of the plans found so far, the one that holds
  there and, by the expressions (``Pricer.curve``), holds furthest is the
  piece's plan: the first size at which another is faster than it by more
  than the tolerance (or it outgrows the memory budget) ends its reach. The
  ILP at the size before that, and at the size halfway there, checks that
  the plan still holds. If it does, that size ends the piece, and the next
  piece starts where the plan was shown not to hold; if it does not, the
  ILP has found a faster plan, and the end is sought again.
* Several symbols (``_box``), on boxes of sizes: a plan that holds at every
  corner (the ILP solved there) and, by the expressions, inside the box is
  the box's piece; otherwise the box is split where the expressions say the
  plan stops holding, or where the corners' plans cross, and each part
  searched.

So a boundary between two pieces of one symbol is where the static compile's
plan changes: the lower piece's plan is within the tolerance of the ILP's
optimum at its last size, and more than the tolerance slower than it at the
next one, where the upper piece's plan is the ILP's own. Pieces of one
lattice with the same plan that touch are merged.
"""
from __future__ import annotations

import itertools
import logging
import math
import time
from dataclasses import dataclass, field

import numpy as np

from autopar.dynamic.graph import Lattice
from autopar.dynamic.pricing import Assignment, Curve, Pricer
from autopar.plan import Plan

log = logging.getLogger("autopar")

MAX_CHECK_POINTS = 20000
"""The most sizes of a box the expressions are compared at (all of a one-symbol
lattice's; a regular sub-grid, ends included, of a larger box of several)."""


@dataclass
class Probe:
    point: tuple
    plan: Plan
    assignment: Assignment

    @property
    def cost(self) -> float:
        return self.plan.predicted["step_time_s"]


@dataclass
class Piece:
    lattice: Lattice
    box: tuple  # per symbol, (first index, last index) on the lattice
    assignment: Assignment
    probes: list = field(default_factory=list)  # the probes inside the box, in order of solving

    def contains(self, index: tuple) -> bool:
        return all(lo <= t <= hi for t, (lo, hi) in zip(index, self.box))

    def corners(self) -> list:
        return [tuple(c) for c in itertools.product(*[sorted({lo, hi}) for lo, hi in self.box])]


class Search:
    """Runs the piecewise search with ``solve(sizes) -> Plan`` (the ILP) and a ``Pricer``."""

    def __init__(self, pricer: Pricer, solve, tolerance: float):
        self.pricer, self.solve, self.tolerance = pricer, solve, tolerance
        self.probes: dict = {}
        self.known: dict = {}  # assignment -> first probe that chose it
        self._curves: dict = {}
        self._fits: dict = {}
        self.start = time.perf_counter()

    # --- the ILP and the expressions -------------------------------------
    def probe(self, lattice: Lattice, index: tuple) -> Probe:
        point = lattice.value(index)
        if point not in self.probes:
            plan = self.solve(self.pricer.values(point))
            a = Assignment.of(plan)
            self.probes[point] = Probe(point, plan, a)
            self.known.setdefault(a, self.probes[point])
        return self.probes[point]

    def curve(self, a: Assignment, lattice: Lattice, component: str = "step_time_s") -> Curve:
        key = (a, lattice, component)
        if key not in self._curves:
            self._curves[key] = self.pricer.curve(a, lattice, tuple((0, n - 1) for n in lattice.count), component)
        return self._curves[key]

    def fits_until(self, a: Assignment, lattice: Lattice, axis: int) -> int:
        """The last index along ``axis`` at which ``a`` fits the memory budget (-1:
        nowhere). A plan's memory only grows with the sizes (every byte it
        holds is a sum of products of them), so a binary search finds it."""
        key = (a, lattice, axis)
        chosen = [lattice.index(p.point)[axis] for p in self.probes.values()
                  if p.assignment == a and lattice.index(p.point) is not None]
        if key not in self._fits:
            at = lambda t: tuple(t if i == axis else 0 for i in range(len(lattice.count)))  # noqa: E731

            def fits(t):
                return self.pricer.fits(a, lattice, lattice.value(at(t)))
            lo, hi = -1, lattice.count[axis] - 1
            if fits(hi):
                lo = hi
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if mid >= 0 and fits(mid):
                    lo = mid
                else:
                    hi = mid - 1
            self._fits[key] = lo
        # where the ILP chose it, it fits by the ILP's own memory rows (which may count a little less)
        return max([self._fits[key], *chosen])

    # --- the search ------------------------------------------------------
    def run(self, lattices: list) -> list[Piece]:
        pieces = []
        for k, lattice in enumerate(lattices):
            log.info("dynamic: lattice %d of %d (%s)", k + 1, len(lattices), lattice.describe(self.pricer.names))
            varying = [i for i, n in enumerate(lattice.count) if n > 1]
            if len(varying) <= 1:
                found = self._sweep(lattice, varying[0] if varying else 0)
            else:
                found = self._box(lattice, tuple((0, n - 1) for n in lattice.count))
            pieces += _merge(found)
        return pieces

    def holds(self, a: Assignment, lattice: Lattice, index: tuple) -> bool:
        """Whether ``a`` fits and is within the tolerance of the ILP's optimum at ``index`` (solving there)."""
        p = self.probe(lattice, index)
        fits = a == p.assignment or self.pricer.fits(a, lattice, p.point)
        return fits and self.pricer.cost(a, lattice, p.point) <= p.cost * (1 + self.tolerance) + 1e-15

    def _sweep(self, lattice: Lattice, axis: int) -> list[Piece]:
        n = lattice.count[axis]
        at = lambda t: tuple(t if i == axis else 0 for i in range(len(lattice.count)))  # noqa: E731
        self.probe(lattice, at(n - 1))  # the plan of the largest sizes, whose reach the pieces below may extend to
        pieces, t = [], 0
        while t < n:
            here = self.probe(lattice, at(t))
            while True:
                # of the plans found so far that hold here, the one the expressions say holds the furthest
                reach = {}
                for a in self.known:
                    if t <= self.fits_until(a, lattice, axis) and \
                            self.pricer.cost(a, lattice, here.point) <= here.cost * (1 + self.tolerance) + 1e-15:
                        fails = self._first_failure(a, lattice, axis, t)
                        reach[a] = n - 1 if fails is None else fails - 1
                a = max(reach, key=lambda x: (reach[x], x == here.assignment))
                end = reach[a]
                # the ILP at the last size, and in the middle (a plan not found yet may be faster inside)
                if end == t or all(self.holds(a, lattice, at(u)) for u in dict.fromkeys((end, (t + end) // 2))
                                   if u != t):
                    break  # the ILP there found a faster plan otherwise: the reaches change
            box = tuple((t, end) if i == axis else (0, 0) for i in range(len(lattice.count)))
            inside = [p for p in self.probes.values() if (i := lattice.index(p.point)) is not None
                      and t <= i[axis] <= end]
            pieces.append(Piece(lattice, box, a, inside))
            log.info("dynamic: piece %s (%d ILPs, %d prices so far)", Lattice(lattice.value(at(t)), lattice.step, tuple(
                end - t + 1 if i == axis else 1 for i in range(len(lattice.count)))).describe(self.pricer.names),
                len(self.probes), self.pricer.evaluations)
            t = end + 1
        return pieces

    def _first_failure(self, a: Assignment, lattice: Lattice, axis: int, t: int) -> int | None:
        """The first index after ``t`` at which, by the expressions, a plan found
        so far beats ``a`` by more than the tolerance or ``a`` does not fit."""
        n = lattice.count[axis]
        grid = np.array([[u if i == axis else 0 for i in range(len(lattice.count))] for u in range(t + 1, n)],
                        dtype=float)
        if not len(grid):
            return None
        mine = self.curve(a, lattice).at(grid)
        steps = grid[:, axis]
        bad = (steps > self.fits_until(a, lattice, axis)) | ~np.isfinite(mine)
        for other in self.known:
            if other == a or self.pricer.price(other, lattice, lattice.first) is None:
                continue  # itself, or a plan whose splits do not divide here
            theirs = self.curve(other, lattice).at(grid)
            bad |= (steps <= self.fits_until(other, lattice, axis)) & (theirs * (1 + self.tolerance) < mine)
        hits = np.nonzero(bad)[0]
        return t + 1 + int(hits[0]) if len(hits) else None

    def _box(self, lattice: Lattice, box: tuple) -> list[Piece]:
        corners = [tuple(c) for c in itertools.product(*[sorted({lo, hi}) for lo, hi in box])]
        probes = [self.probe(lattice, c) for c in corners]
        inside = [p for p in self.probes.values() if (i := lattice.index(p.point)) is not None
                  and all(lo <= t <= hi for t, (lo, hi) in zip(i, box))]
        split = None
        for a in dict.fromkeys(p.assignment for p in probes):
            if all(self.holds(a, lattice, c) for c in corners):
                bad = self._violation(a, lattice, box)
                if bad is None:
                    return [Piece(lattice, box, a, inside)]
                split = bad
                break
        if all(lo == hi for lo, hi in box):
            return [Piece(lattice, box, probes[0].assignment, inside)]
        axis, cut = split if split is not None else self._crossing(lattice, box, corners, probes)
        lo, hi = box[axis]
        left = tuple((lo, cut) if i == axis else b for i, b in enumerate(box))
        right = tuple((cut + 1, hi) if i == axis else b for i, b in enumerate(box))
        return self._box(lattice, left) + self._box(lattice, right)

    def _grid(self, box: tuple) -> np.ndarray:
        """The index points of ``box`` the expressions are compared at."""
        n = math.prod(hi - lo + 1 for lo, hi in box)
        per = max(2, int(MAX_CHECK_POINTS ** (1 / len(box))))
        axes = [np.arange(lo, hi + 1) if n <= MAX_CHECK_POINTS or hi - lo + 1 <= per
                else np.unique(np.linspace(lo, hi, per).round().astype(int)) for lo, hi in box]
        return np.array(list(itertools.product(*axes)), dtype=float)

    def _violation(self, a: Assignment, lattice: Lattice, box: tuple):
        """Where, inside ``box``, a plan found so far beats ``a`` by more than the
        gap or ``a`` outgrows the memory budget: (axis, cut) to split at, with the
        ILP solved there; None where ``a`` holds over the whole box."""
        grid = self._grid(box)
        mine = self.curve(a, lattice).at(grid)
        memory = self.curve(a, lattice, "peak_memory_bytes").at(grid)
        worst, at = 0.0, None
        over = np.nonzero(memory > self.pricer.budget)[0]
        if len(over):
            worst, at = math.inf, grid[over[0]]
        for other in self.known:
            if other == a or at is not None and worst == math.inf:
                continue
            theirs = self.curve(other, lattice).at(grid)
            fits = self.curve(other, lattice, "peak_memory_bytes").at(grid) <= self.pricer.budget
            gain = np.where(fits & np.isfinite(theirs), (mine - theirs) / mine, -math.inf)
            k = int(np.argmax(gain))
            if gain[k] > self.tolerance and gain[k] > worst:
                worst, at = gain[k], grid[k]
        if at is None:
            return None
        index = tuple(int(v) for v in at)
        self.probe(lattice, index)  # the ILP confirms (or finds yet another plan) there
        inner = [i for i, (lo, hi) in enumerate(box) if lo < index[i] < hi]
        axis = max(inner or [i for i, (lo, hi) in enumerate(box) if lo < hi], key=lambda i: box[i][1] - box[i][0])
        lo = box[axis][0]
        return axis, index[axis] - 1 if index[axis] > lo else lo

    def _crossing(self, lattice: Lattice, box: tuple, corners: list, probes: list) -> tuple:
        """(axis, cut): along the longest edge whose ends' plans disagree, the last
        index at which the first end's plan is still the cheaper (their
        expressions meet there); the middle if they do not cross."""
        best = None
        for c, p in zip(corners, probes):
            for d, q in zip(corners, probes):
                diff = [i for i in range(len(box)) if c[i] != d[i]]
                if len(diff) != 1 or c[diff[0]] > d[diff[0]] or p.assignment == q.assignment:
                    continue
                axis = diff[0]
                if best is None or box[axis][1] - box[axis][0] > best[0]:
                    best = (box[axis][1] - box[axis][0], axis, c, p.assignment, q.assignment)
        if best is None:
            axis = max(range(len(box)), key=lambda i: box[i][1] - box[i][0])
            return axis, (box[axis][0] + box[axis][1]) // 2
        _, axis, start, a, b = best
        lo, hi = box[axis]
        edge = np.array([tuple(t if i == axis else start[i] for i in range(len(box))) for t in range(lo, hi + 1)],
                        dtype=float)
        ta, tb = self.curve(a, lattice).at(edge), self.curve(b, lattice).at(edge)
        cheaper = np.nonzero(~(ta <= tb))[0]  # first index where a is no longer the cheaper (or not valid)
        cut = lo + int(cheaper[0]) - 1 if len(cheaper) else (lo + hi) // 2
        if not lo <= cut < hi:
            cut = (lo + hi) // 2
        return axis, cut


def _merge(pieces: list[Piece]) -> list[Piece]:
    """Neighbouring boxes with the same plan, one box."""
    changed = True
    while changed:
        changed = False
        for p, q in itertools.permutations(pieces, 2):
            if p.assignment != q.assignment:
                continue
            diff = [i for i, (a, b) in enumerate(zip(p.box, q.box)) if a != b]
            if len(diff) == 1 and p.box[diff[0]][1] + 1 == q.box[diff[0]][0]:
                i = diff[0]
                box = tuple((p.box[i][0], q.box[i][1]) if k == i else b for k, b in enumerate(p.box))
                pieces = [x for x in pieces if x is not p and x is not q] + [
                    Piece(p.lattice, box, p.assignment, p.probes + q.probes)]
                changed = True
                break
    return sorted(pieces, key=lambda p: p.box)


__all__ = ["Search", "Piece", "Probe"]
