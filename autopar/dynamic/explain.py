"""Why a dynamic plan's pieces differ: each piece's plan in words, and at each
boundary what the plan below it would cost there, term by term.

``summary`` says what a piece's plan splits on each mesh axis, as a share of
its compute: a symbol's dims (``batch``: data parallelism; ``seq``: sequence
or context parallelism), other dims (features, heads: tensor parallelism) or
partial sums, and how it holds its weights (autopar show's "held as").
``boundary`` prices the lower piece's plan at the first size of the next
piece with the planner's accounting, next to that piece's own plan, and
lists their collectives by kind. ``describe`` prints the pieces and, at each
boundary, the terms that changed the most (``autopar explain --over``,
autopar/explain.py).
"""
from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from autopar.dynamic.planfile import Dynamic
from autopar.passes.strategy import parse_spec
from autopar.plan import ZERO_LABELS, Plan
from autopar.units import fmt_bytes, fmt_s

TERMS = (("compute_s", "compute"), ("comm_s", "communication"), ("grad_sync_exposed_s", "exposed gradient sync"),
         ("optimizer_s", "optimizer"))
"""The step-time terms a boundary compares (``comm_s`` includes the exposed sync)."""


def summary(plan: Plan, sg) -> dict:
    """What ``plan`` splits on each mesh axis (share of its compute) and how it holds its weights."""
    from torch.distributed.tensor import Partial, Shard
    total = sum(n.compute_s for n in plan.nodes if n.op not in ("param", "input")) or 1.0
    axes = {}
    for a, (name, size) in enumerate(zip(plan.mesh.names, plan.mesh.shape)):
        if size == 1:
            continue
        share: dict = defaultdict(float)
        for n in plan.nodes:
            if n.op in ("param", "input", "output", "buffer") or not n.compute_s:
                continue
            p = parse_spec(n.output_spec, plan.mesh.ndim)[a]
            if isinstance(p, Shard):
                symbols = sorted(str(s) for s in sg.shape(n.name)[p.dim].free_symbols) if n.name in sg.graph.nodes \
                    else []
                what = f"{'·'.join(symbols)} split" if symbols else "features split"
            elif isinstance(p, Partial):
                what = "partial sums"
            else:
                what = "whole"
            share[what] += n.compute_s / total
        axes[name] = dict(sorted(share.items(), key=lambda kv: -kv[1]))
    held = Counter(ZERO_LABELS.get(p.get("zero_stage"), "-") for p in plan.parameters.values())
    return {"axes": axes, "weights": dict(held), "recompute": plan.recompute.get("mode", "none")}


def words(s: dict) -> str:
    """A summary in one line: "x: batch split 97%, whole 3%; weights 16 replicated (DP), 4 TP"."""
    parts = []
    for axis, share in s["axes"].items():
        top = [f"{k} {v:.0%}" for k, v in sorted(share.items(), key=lambda kv: -kv[1]) if v >= 0.005][:3]
        parts.append(f"{axis}: {', '.join(top) or 'nothing'}")
    weights = ", ".join(f"{n} {k}" for k, n in sorted(s["weights"].items(), key=lambda kv: -kv[1]))
    rc = f"; recompute {s['recompute']}" if s.get("recompute", "none") != "none" else ""
    return "; ".join(parts) + f"; weights {weights}{rc}"


def collectives(plan: Plan) -> dict:
    """Bytes moved per collective kind (logical collectives, as plan.json lists them)."""
    out: dict = defaultdict(float)
    for c in plan.collectives:
        out[c["kind"]] += c["bytes"]
    return dict(out)


def boundary(pricer, lattice, below, here, point: tuple, best: Plan | None) -> dict | None:
    """At ``point``, the first sizes of a piece: the lower piece's plan (``below``),
    this piece's (``here``) and the ILP's optimum there (``best``, which the
    search solved there: what showed that the plan below no longer holds)."""
    a, b = pricer.plan(below, lattice, point), pricer.plan(here, lattice, point)
    if b is None:
        return None
    best = best or b
    out = {"at": dict(zip(pricer.names, point)), "here": _terms(b), "best": _terms(best),
           "best_collectives": collectives(best)}
    if a is None:
        out["below"] = None
        out["why"] = "the plan below does not divide these sizes"
        return out
    out["below"] = _terms(a)
    out["below_collectives"] = collectives(a)
    if a.predicted["peak_memory_bytes"] > pricer.budget >= best.predicted["peak_memory_bytes"]:
        out["why"] = (f"the plan below needs {fmt_bytes(a.predicted['peak_memory_bytes'])} per device here, over the "
                      f"budget of {fmt_bytes(pricer.budget)}")
    return out


def _terms(plan: Plan) -> dict:
    p = plan.predicted
    return {k: p.get(k, 0.0) for k in ("step_time_s", *(t for t, _ in TERMS), "peak_memory_bytes")}


def reason(b: dict) -> str:
    """One line: the plan below at this boundary against the best plan there (the
    ILP's), by the terms that moved most, and what this piece's own plan takes."""
    at = ", ".join(f"{k} {v}" for k, v in b["at"].items())
    if b.get("below") is None:
        return f"from {at}: {b.get('why', '')}"
    best, below, here = b["best"], b["below"], b["here"]
    gain = below["step_time_s"] / best["step_time_s"] - 1
    than = f"{abs(gain):.1%} {'more' if gain >= 0 else 'less'} than the best plan there ({fmt_s(best['step_time_s'])})"
    head = f"from {at}: the plan below would take {fmt_s(below['step_time_s'])}, {than}"
    if here["step_time_s"] != best["step_time_s"]:
        head += f"; this piece's plan takes {fmt_s(here['step_time_s'])} there and holds over more sizes"
    if b.get("why"):
        return f"{head}; {b['why']}"
    moved = sorted(((below[k] - best[k], k, label) for k, label in TERMS if k != "grad_sync_exposed_s"),
                   key=lambda x: -abs(x[0]))
    terms = [f"{label} {fmt_s(best[k])} vs {fmt_s(below[k])}" for d, k, label in moved[:2] if abs(d) > 1e-12]
    kinds = sorted(set(b["best_collectives"]) | set(b["below_collectives"]))
    bytes_ = [f"{k.replace('_', '-')} {fmt_bytes(b['best_collectives'].get(k, 0.0))} vs "
              f"{fmt_bytes(b['below_collectives'].get(k, 0.0))}" for k in kinds
              if b["best_collectives"].get(k, 0.0) != b["below_collectives"].get(k, 0.0)]
    exposed = ""
    if abs(below["grad_sync_exposed_s"] - best["grad_sync_exposed_s"]) > 0.1 * abs(below["step_time_s"] -
                                                                                best["step_time_s"]):
        exposed = (f"; gradient sync left exposed after backward {fmt_s(best['grad_sync_exposed_s'])} vs "
                   f"{fmt_s(below['grad_sync_exposed_s'])}")
    return (head + ". Best vs below: " + "; ".join(terms) + (f" ({', '.join(bytes_)} moved)" if bytes_ else "")
            + exposed)


def describe(plan: Plan, over: dict | None = None, reasons: bool = True) -> str:
    """The pieces of a dynamic plan (those that meet ``over``: symbol -> (lo, hi)) and, with
    ``reasons``, why they change."""
    dyn = Dynamic(plan)
    stats = plan.dynamic.get("search", {})
    head = ", ".join(str(s) for s in dyn.symbols)
    lines = [f"pieces over {head}: {len(dyn.pieces)} (each within {stats.get('tolerance', 0):.1%} of every size's "
             f"optimum; {stats.get('probes', '?')} ILPs, {stats.get('prices', '?')} sizes priced)"]
    by_lattice: dict = defaultdict(list)
    for i, lat in enumerate(dyn.lattices):
        by_lattice[lat].append(i)
    for lat, members in by_lattice.items():
        shown = [i for i in members if not over or not any(
            dyn.ranges(i)[n][1] < lo or dyn.ranges(i)[n][0] > hi for n, (lo, hi) in over.items() if n in dyn.names)]
        if shown:
            lines.append(f"  {lat.describe(dyn.names)}")
        for i in shown:
            r = dyn.ranges(i)
            p = dyn.pieces[i]
            span = ", ".join(f"{n} {a}..{b}" if a != b else f"{n} {a}" for n, (a, b, _) in r.items())
            ends = _ends(dyn, i)
            lines.append(f"    {span:<18} step {ends} = {_short(p['expressions']['step_time_s'])} s")
            if "summary" in p:
                lines.append(f"    {'':<18} {words(p['summary'])}")
            if reasons and p.get("boundary"):
                lines.append(f"    {'':<18} why: {reason(p['boundary'])}")
    return "\n".join(lines)


def _ends(dyn: Dynamic, i: int) -> str:
    """Predicted step at a piece's first and last sizes."""
    expr, r, env = dyn.expression(i), dyn.ranges(i), dyn.locals()
    lo = float(expr.subs({env[n]: a for n, (a, _, _) in r.items()}))
    hi = float(expr.subs({env[n]: b for n, (_, b, _) in r.items()}))
    return fmt_s(lo) if abs(hi - lo) < 1e-15 else f"{fmt_s(lo)} .. {fmt_s(hi)}"


def _short(text: str, digits: int = 4) -> str:
    """An expression with its floats to ``digits`` significant digits."""
    import sympy
    expr = sympy.sympify(text)
    return str(expr.xreplace({f: sympy.Float(f, digits) for f in expr.atoms(sympy.Float)}))


def curve_points(plan: Plan, per_piece: int = 64) -> list:
    """For the visualizer: per piece, (size, predicted step) points from its expression."""
    import sympy
    dyn = Dynamic(plan)
    if not dyn.pieces:
        return []
    axis = max(range(len(dyn.names)), key=lambda k: dyn.symbols[k].count)
    x = dyn.names[axis]
    out = []
    for i, p in enumerate(dyn.pieces):
        r = dyn.ranges(i)
        lo, hi, step = r[x]
        values = np.unique(np.linspace(lo, hi, min(per_piece, (hi - lo) // step + 1)).round().astype(int))
        values = [int(lo + step * round((v - lo) / step)) for v in values]
        env = dyn.locals()
        fixed = {env[n]: a for n, (a, _, _) in r.items() if n != x}
        f = sympy.lambdify(env[x], dyn.expression(i).subs(fixed), "math")
        out.append({"piece": i, "where": p["where"], "x": values, "step_s": [float(f(v)) for v in values],
                    "summary": words(p["summary"]) if "summary" in p else "",
                    "why": reason(p["boundary"]) if p.get("boundary") else "",
                    "lattice": dyn.lattices[i].describe(dyn.names)})
    return [{"symbol": x, "others": {n: "piece's lowest" for n in dyn.names if n != x}, "pieces": out}]


__all__ = ["summary", "words", "boundary", "reason", "describe", "curve_points"]
