"""One compile for a range of sizes: the step captured with symbolic sizes,
priced as expressions in them, and planned piecewise.

    plan = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss,
                           dynamic={"batch": (1, 1024)})
    plan.dynamic["pieces"]       # where the optimal plan changes, each piece a plan

``plan_dynamic`` is the whole of it in one screen:

    symbols (symbols.py) -> symbolic capture (graph.py) -> lattices of sizes that
    divide alike (graph.py) -> piecewise search: the ILP at a box's corners, the
    plans' expressions between them (search.py, pricing.py) -> plan.json's
    dynamic section (planfile.py)

The ILP runs where the search asks (each probe a static compile of those sizes,
``autopar.planner.plan_flat`` on the step specialized to them); everything in
between is priced by the same accounting, without solving.
"""
from __future__ import annotations

import time
import warnings

from autopar.cost_models.cluster import get_cluster
from autopar.dynamic.graph import Lattice, SymbolicGraph, lattices
from autopar.dynamic.explain import boundary, summary
from autopar.dynamic.planfile import Dynamic
from autopar.dynamic.pricing import COMPONENTS, Assignment, Curve, Pricer, shift
from autopar.dynamic.search import Search
from autopar.dynamic.symbols import SymbolRange, parse_dims, parse_range, resolve
from autopar.errors import AutoparError, InfeasibleError
from autopar.mesh import parse_mesh
from autopar.passes.enumerate import enumerate_strategies
from autopar.plan import Plan


def plan_dynamic(model, example_inputs, *, dynamic: dict, dims: dict | None = None, mesh, cluster, loss_fn=None,
                 memory: float | None = None, optimizer: str = "adamw", precision: str = "fp32",
                 relative_gap: float = 1e-4, tolerance: float = 0.01, source: str | None = None,
                 deterministic: bool = False, **flat_options) -> Plan:
    """Plan ``model`` for every size ``dynamic`` declares, in pieces whose plan is
    within ``tolerance`` (a fraction, at least the solver's ``relative_gap``)
    of each size's optimum (``autopar.compile`` says what the other arguments
    mean; ``flat_options`` go to each ILP)."""
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise AutoparError(f"tolerance {tolerance!r} must be a fraction in [0, 1), e.g. 0.01 for pieces within 1% "
                           "of each size's optimum")
    start = time.perf_counter()
    mesh, cluster = parse_mesh(mesh), get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    symbols = resolve(dynamic, dims, example_inputs)
    sg = SymbolicGraph(model, example_inputs, loss_fn, symbols)
    budget = memory if memory is not None else cluster.device.memory
    pricer = Pricer(sg, mesh, cluster, optimizer=optimizer, precision=precision, budget=budget, source=source)
    notes: dict = {}

    def solve(values: dict) -> Plan:
        from autopar.planner import plan_flat
        with warnings.catch_warnings(record=True) as caught:  # said once, below, not once per size
            warnings.simplefilter("always")
            try:
                plan = plan_flat(None, None, mesh=mesh, cluster=cluster, loss_fn=loss_fn, memory=memory,
                                 optimizer=optimizer, precision=precision, relative_gap=relative_gap, source=source,
                                 deterministic=deterministic, offload=False, graph=sg.specialize(values),
                                 **flat_options)
            except InfeasibleError as e:
                at = ", ".join(f"{k} = {v}" for k, v in values.items())
                raise InfeasibleError(f"at {at}, one of the sizes dynamic declares: {e}; or declare a range that "
                                      "stops below it", needed_bytes=e.needed_bytes, status=e.status) from None
        for w in caught:
            notes.setdefault(str(w.message), w)
        return plan

    found = _peeled(pricer, lattices(sg, mesh.shape))
    search = Search(pricer, solve, max(tolerance, relative_gap))
    pieces = search.run(found)
    for w in notes.values():
        warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    plan = _assemble(sg, pricer, search, pieces, start, deterministic)
    binds = [p.point for p in search.probes.values()
             if not any("memory cannot bind" in k for k in (p.plan.solver.get("pruned") or {}))]
    if cluster.host is not None and binds:
        msg = (f"memory may bind at {dict(zip(pricer.names, binds[0]))}, where a compile of one size may keep "
               "some optimizer state in host memory (offload); a dynamic plan keeps it all on the devices")
        warnings.warn("autopar: " + msg, stacklevel=2)
        plan.warnings.append(msg)
    return plan


def _peeled(pricer: Pricer, found: list) -> list:
    """Lattices whose first sizes get other strategies than the rest (a dim of
    size 1, which no rule splits) with those sizes on lattices of their own."""
    out = []
    for lat in found:
        for axis in range(len(lat.first)):
            if lat.count[axis] < 2:
                continue
            second = tuple(1 if i == axis else 0 for i in range(len(lat.first)))
            if _signature(pricer, lat, (0,) * len(lat.first)) != _signature(pricer, lat, second):
                out.append(Lattice(lat.first, lat.step, tuple(1 if i == axis else n for i, n in enumerate(lat.count))))
                lat = Lattice(tuple(f + s if i == axis else f for i, (f, s) in enumerate(zip(lat.first, lat.step))),
                              lat.step, tuple(n - 1 if i == axis else n for i, n in enumerate(lat.count)))
        out.append(lat)
    return out


def _signature(pricer: Pricer, lat: Lattice, index: tuple) -> tuple:
    graph = pricer.sg.specialize(pricer.values(lat.value(index)))
    strategies, _ = enumerate_strategies(graph, pricer.mesh.shape, warn=False)
    return tuple((n, tuple(map(str, ss))) for n, ss in strategies.items())


def _assemble(sg: SymbolicGraph, pricer: Pricer, search: Search, pieces: list, start: float,
              deterministic: bool) -> Plan:
    """The plan of the example sizes, with every piece in its dynamic section."""
    names = pricer.names
    symbols = tuple(sg.sym[n] for n in names)
    entries, example_piece = [], None
    example = tuple(sg.example[n] for n in names)
    for piece in pieces:
        rep = next((p for p in piece.probes if p.assignment == piece.assignment), None)
        if rep is None:  # every probe in it chose a plan of equal cost: this one priced at a corner
            corner = piece.corners()[0]
            point = piece.lattice.value(corner)
            plan = pricer.plan(piece.assignment, piece.lattice, point)
            probe = search.probes.get(point) or piece.probes[0]
            plan.solver = {**probe.plan.solver, "priced_from": "an ILP at these sizes chose a plan of equal cost"}
            plan.fallbacks, plan.warnings = probe.plan.fallbacks, probe.plan.warnings
        else:
            point, plan = rep.point, rep.plan
        box = piece.box
        expressions = {c: str(_restrict(search.curve(piece.assignment, piece.lattice, c), box).expression(symbols))
                       for c in COMPONENTS}
        body = plan.to_json()  # a plan of one size: dynamic null
        below = next((q for q in pieces if q.lattice == piece.lattice and _follows(q.box, box)), None)
        first = piece.lattice.value(tuple(lo for lo, _ in box))
        entries.append({
            "summary": summary(plan, sg),
            "boundary": boundary(pricer, piece.lattice, below.assignment, piece.assignment, first,
                                 getattr(search.probes.get(first), "plan", None)) if below else None,
            "lattice": {"first": list(piece.lattice.first), "step": list(piece.lattice.step),
                        "count": list(piece.lattice.count)},
            "box": [list(b) for b in box],
            "where": Lattice(piece.lattice.value(tuple(lo for lo, _ in box)), piece.lattice.step,
                             tuple(hi - lo + 1 for lo, hi in box)).describe(names),
            "point": dict(zip(names, point)),
            "plan": body,
            "expressions": expressions,
        })
        index = piece.lattice.index(example)
        if index is not None and piece.contains(index):
            example_piece = piece
    if example_piece is None:
        raise AutoparError(f"no piece covers the example sizes {dict(zip(names, example))}; this is a bug")
    top = pricer.plan(example_piece.assignment, example_piece.lattice, example)
    rep = next((p for p in example_piece.probes if p.assignment == example_piece.assignment), example_piece.probes[0])
    top.solver = {**rep.plan.solver, "solved_at": dict(zip(names, rep.point))}
    top.fallbacks, top.warnings = rep.plan.fallbacks, rep.plan.warnings
    top.predicted["optimizer"] = rep.plan.predicted.get("optimizer")
    search_stats = {"tolerance": search.tolerance, "probes": len(search.probes), "prices": pricer.evaluations, "lattices":
                    len({p.lattice for p in pieces}), "wall_s": None if deterministic else time.perf_counter() - start}
    top.dynamic = {"symbols": [s.to_json() for s in sg.symbols], "example": dict(sg.example),
                   "pieces": entries, "search": search_stats}
    return top


def _follows(a: tuple, b: tuple) -> bool:
    """Box ``b`` starts right after box ``a`` along one symbol, and spans the same sizes of the others."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    return len(diff) == 1 and a[diff[0]][1] + 1 == b[diff[0]][0]


def _restrict(curve: Curve, box: tuple) -> Curve:
    """The segments of ``curve`` inside ``box``, clipped to it."""
    segments = []
    for seg, coeffs in curve.segments:
        clipped = tuple((max(a, c), min(b, d)) for (a, b), (c, d) in zip(seg, box))
        if all(lo <= hi for lo, hi in clipped):
            segments.append((seg, coeffs, clipped))
    out = Curve(curve.lattice, [(seg, coeffs) for seg, coeffs, _ in segments])
    out.segments = [(clip, shift(coeffs, seg, clip)) for seg, coeffs, clip in segments]
    return out


__all__ = ["plan_dynamic", "SymbolicGraph", "SymbolRange", "Dynamic", "Assignment", "Pricer", "resolve",
           "parse_range", "parse_dims"]
