"""``autopar diff``: what changed between two plans, and where the cost difference comes from.

``diff_plans(a, b)`` returns a JSON-able dict; ``format_diff(d)`` prints it for
the terminal. Parameters are matched by fqn and nodes by name (plans of the same
model share both). Placements are compared twice: as written (``S(0)S(0)`` on a
2x2 mesh differs from ``S(0)`` on a 4-mesh) and as a *layout*: how many pieces
each tensor dim is cut into and over how many devices it is replicated or
partial. Two plans of one model on different meshes often differ only in the
first sense; ``layout_changed`` says which changes move data.
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.errors import AutoparError
from autopar.passes.strategy import parse_spec
from autopar.plan import Plan
from autopar.report import fmt_bytes
from autopar.report import fmt_s


def layer_class(path: str) -> str:
    """'blocks.3.attn' -> 'blocks.*.attn', 'blocks.1' -> 'blocks.*' (repeated layers fold together)."""
    return ".".join("*" if part.isdigit() else part for part in path.split(".")) if path else path

PREDICTED = ("step_time_s", "compute_s", "comm_s", "bubble_s", "peak_memory_bytes", "mfu")
MEMORY = ("parameters", "gradients", "optimizer", "activations", "inputs")


def layout(spec: str, mesh_shape) -> tuple:
    """A spec as a mesh-independent layout: ((dim, pieces), ...), partial ways, replicated ways.

    ``layout("S(0)S(0)", (2, 2)) == layout("S(0)", (4,))``: dim 0 in 4 pieces."""
    pieces: dict = defaultdict(int)
    partial = replicated = 1
    for size, p in zip(mesh_shape, parse_spec(spec, len(mesh_shape))):
        if isinstance(p, Shard):
            pieces[p.dim] = pieces.get(p.dim, 1) * size
        elif isinstance(p, Partial):
            partial *= size
        elif isinstance(p, Replicate):
            replicated *= size
    return tuple(sorted((d, n) for d, n in pieces.items() if n > 1)), partial, replicated


def _node_layout(node, mesh_shape) -> tuple:
    return tuple(layout(s, mesh_shape) for s in (*node.input_specs, node.output_spec, *node.item_specs))


def _axis_label(plan: Plan, name: str) -> str:
    """'x=2 intra-node': axis names repeat across meshes, so the size and level go with them."""
    for t in plan.topology:
        if t["name"] == name:
            return f"{name}={t['size']} {t['level']}"
    return name


def _summary(plan: Plan) -> dict:
    axes = ", ".join(_axis_label(plan, n) for n in plan.mesh.names)
    return {"source": plan.model.get("source"), "fingerprint": plan.model.get("fingerprint"),
            "mesh": list(plan.mesh.shape), "axes": axes, "cluster": plan.cluster.get("name"),
            "pipeline": (plan.pipeline or {}).get("schedule")}


def _delta(a: float, b: float) -> dict:
    return {"a": a, "b": b, "delta": b - a, "ratio": (b / a) if a else None}


def _comm_table(plan: Plan) -> dict:
    """(phase, axis label, kind) -> [count, bytes, seconds]."""
    out: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        key = (c["phase"], ",".join(_axis_label(plan, a) for a in c["mesh_axes"]), c["kind"])
        out[key][0] += 1
        out[key][1] += c["bytes"]
        out[key][2] += c["seconds"]
    return out


def _by_class(plan: Plan) -> dict:
    """layer class of a node's location -> [compute seconds, communication seconds]."""
    where = {n.name: layer_class(n.location) or "(top level)" for n in plan.nodes}
    out: dict = defaultdict(lambda: [0.0, 0.0])
    for n in plan.nodes:
        out[where[n.name]][0] += n.compute_s
    for c in plan.collectives:
        out[where.get(c["node"], "(top level)")][1] += c["seconds"]
    return out


def diff_plans(a: Plan, b: Plan) -> dict:
    """Everything that differs between plans ``a`` and ``b`` (deltas are b - a)."""
    ms_a, ms_b = a.mesh.shape, b.mesh.shape
    params, classes = [], {}
    for fqn in (f for f in a.parameters if f in b.parameters):
        pa, pb = a.parameters[fqn], b.parameters[fqn]
        if pa["placements"] == pb["placements"]:
            continue
        moved = (layout("".join(pa["placements"]), ms_a) != layout("".join(pb["placements"]), ms_b)
                 or pa.get("local_shape") != pb.get("local_shape"))
        params.append({"fqn": fqn, "a": pa["placements"], "b": pb["placements"],
                       "a_local_shape": pa.get("local_shape"), "b_local_shape": pb.get("local_shape"),
                       "layout_changed": moved})
        key = (layer_class(fqn), " ".join(pa["placements"]), " ".join(pb["placements"]), moved)
        classes.setdefault(key, []).append(fqn)

    nodes_b = {n.name: n for n in b.nodes}
    nodes, node_classes = [], {}
    total = defaultdict(int)
    for n in a.nodes:
        m = nodes_b.get(n.name)
        if m is None or n.op == "param":  # parameters are compared above
            continue
        cls = (layer_class(n.location) or "(top level)", n.op)
        total[cls] += 1
        if n.strategy == m.strategy:
            continue
        moved = _node_layout(n, ms_a) != _node_layout(m, ms_b)
        nodes.append({"name": n.name, "op": n.op, "location": n.location, "a": n.strategy, "b": m.strategy,
                      "layout_changed": moved})
        entry = node_classes.setdefault(cls, {"class": cls[0], "op": cls[1], "changed": 0, "layout_changed": 0,
                                              "a": {}, "b": {}})
        entry["changed"] += 1
        entry["layout_changed"] += moved
        entry["a"][n.strategy] = entry["a"].get(n.strategy, 0) + 1
        entry["b"][m.strategy] = entry["b"].get(m.strategy, 0) + 1
    for (cls, op), entry in node_classes.items():
        entry["count"] = total[cls, op]

    names_a = {n.name for n in a.nodes}
    comm_a, comm_b = _comm_table(a), _comm_table(b)
    comm = []
    for key in sorted(comm_a.keys() | comm_b.keys()):
        ca, cb = comm_a.get(key, [0, 0.0, 0.0]), comm_b.get(key, [0, 0.0, 0.0])
        comm.append({"phase": key[0], "axis": key[1], "kind": key[2], "a_count": ca[0], "b_count": cb[0],
                     "a_bytes": ca[1], "b_bytes": cb[1], "a_s": ca[2], "b_s": cb[2], "delta_s": cb[2] - ca[2]})

    cls_a, cls_b = _by_class(a), _by_class(b)
    where = []
    for cls in sorted(cls_a.keys() | cls_b.keys()):  # ties then read in name order, whatever the hash seed
        (fa, ca), (fb, cb) = cls_a.get(cls, (0.0, 0.0)), cls_b.get(cls, (0.0, 0.0))
        where.append({"class": cls, "a_compute_s": fa, "b_compute_s": fb, "a_comm_s": ca, "b_comm_s": cb,
                      "delta_s": (fb + cb) - (fa + ca)})
    where.sort(key=lambda r: -abs(r["delta_s"]))

    pa, pb = a.predicted, b.predicted
    sources = [{"what": "compute", "delta_s": pb.get("compute_s", 0.0) - pa.get("compute_s", 0.0)},
               {"what": "pipeline bubble", "delta_s": pb.get("bubble_s", 0.0) - pa.get("bubble_s", 0.0)},
               {"what": "optimizer step", "delta_s": pb.get("optimizer_s", 0.0) - pa.get("optimizer_s", 0.0)}]
    sources += [{"what": f"{c['phase']} {c['kind']} on {c['axis']}", "delta_s": c["delta_s"]} for c in comm]
    sources = sorted((s for s in sources if s["delta_s"]), key=lambda s: -abs(s["delta_s"]))

    return {
        "a": _summary(a), "b": _summary(b),
        "same_model": a.model.get("fingerprint") == b.model.get("fingerprint"),
        "same_mesh": tuple(ms_a) == tuple(ms_b),
        "parameters": params,
        "parameter_count": sum(1 for f in a.parameters if f in b.parameters),
        "parameter_classes": [{"class": k[0], "a": k[1], "b": k[2], "layout_changed": k[3], "count": len(v),
                               "fqns": v} for k, v in classes.items()],
        "parameters_only_in_a": sorted(a.parameters.keys() - b.parameters.keys()),
        "parameters_only_in_b": sorted(b.parameters.keys() - a.parameters.keys()),
        "nodes": nodes,
        "node_count": sum(total.values()),
        "node_classes": list(node_classes.values()),
        "nodes_only_in_a": [n.name for n in a.nodes if n.name not in nodes_b],
        "nodes_only_in_b": [n.name for n in b.nodes if n.name not in names_a],
        "predicted": {k: _delta(pa.get(k, 0.0), pb.get(k, 0.0)) for k in PREDICTED},
        "memory": {k: _delta(pa.get("memory", {}).get(k, 0.0), pb.get("memory", {}).get(k, 0.0)) for k in MEMORY},
        "communication": comm,
        "collective_count": {"a": len(a.collectives), "b": len(b.collectives)},
        "by_layer_class": where,
        "sources": sources,
    }


# --- terminal ------------------------------------------------------------------

def _signed_s(s: float) -> str:
    return ("+" if s > 0 else "-" if s < 0 else "±") + fmt_s(abs(s))


def _signed_bytes(n: float) -> str:
    return ("+" if n > 0 else "-" if n < 0 else "±") + fmt_bytes(abs(n))


def _table(rows: list, header: tuple, right: set = frozenset()) -> list[str]:
    cells = [tuple(map(str, header))] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]

    def line(r):
        return "  " + "  ".join(c.rjust(w) if i in right else c.ljust(w)
                                for i, (c, w) in enumerate(zip(r, widths))).rstrip()
    return [line(cells[0]), "  " + "  ".join("-" * w for w in widths)] + [line(r) for r in cells[1:]]


def format_diff(d: dict, *, all_rows: bool = False, labels: tuple = ("A", "B"), limit: int = 12) -> str:
    """``diff_plans``'s result as terminal text; ``all_rows`` lists every parameter and node."""
    la, lb = labels
    out = []
    for lab, s in ((la, d["a"]), (lb, d["b"])):
        pipe = f", pipeline {s['pipeline']}" if s.get("pipeline") else ""
        out.append(f"{lab}: mesh {tuple(s['mesh'])} ({s['axes']}) on {s['cluster']}{pipe}; model {s['source']}")
    out.append("same model (fingerprint {})".format(d["a"]["fingerprint"]) if d["same_model"] else
               "different models: fingerprints {} and {} (nodes are matched by name)".format(
                   d["a"]["fingerprint"], d["b"]["fingerprint"]))

    p = d["predicted"]
    rows = []
    for key, label, fmt in (("step_time_s", "step time", fmt_s), ("compute_s", "compute", fmt_s),
                            ("comm_s", "communication", fmt_s), ("bubble_s", "pipeline bubble", fmt_s)):
        v = p[key]
        rel = f" ({v['delta'] / v['a']:+.1%})" if v["a"] else ""
        rows.append((label, fmt(v["a"]), fmt(v["b"]), _signed_s(v["delta"]) + rel))
    v = p["peak_memory_bytes"]
    rows.append(("peak memory/device", fmt_bytes(v["a"]), fmt_bytes(v["b"]), _signed_bytes(v["delta"])))
    for k, v in d["memory"].items():
        if v["delta"]:
            rows.append((f"  {k}", fmt_bytes(v["a"]), fmt_bytes(v["b"]), _signed_bytes(v["delta"])))
    v = p["mfu"]
    rows.append(("MFU", f"{v['a']:.1%}", f"{v['b']:.1%}", f"{(v['b'] - v['a']) * 100:+.1f} pt"))
    cc = d["collective_count"]
    rows.append(("collectives", cc["a"], cc["b"], f"{cc['b'] - cc['a']:+d}"))
    out += ["", "predicted"] + _table(rows, ("", la, lb, f"{lb} - {la}"), {1, 2, 3})

    if d["sources"]:
        out += ["", f"where the step-time difference comes from ({lb} - {la})"]
        rows = [(s["what"], _signed_s(s["delta_s"])) for s in d["sources"][:None if all_rows else limit]]
        out += _table(rows, ("cost", "delta"), {1})
        rows = [(r["class"], fmt_s(r["a_compute_s"] + r["a_comm_s"]), fmt_s(r["b_compute_s"] + r["b_comm_s"]),
                 _signed_s(r["delta_s"])) for r in d["by_layer_class"] if r["delta_s"]]
        if rows:
            out += ["", "by layer class (compute + communication of its nodes)"]
            out += _table(rows[:None if all_rows else limit], ("layer class", la, lb, "delta"), {1, 2, 3})

    n_moved = sum(x["layout_changed"] for x in d["parameters"])
    out += ["", f"parameters: {len(d['parameters'])} of {d['parameter_count']} placements differ, "
                f"{n_moved} of them change the local shard"]
    if d["parameters"] and not d["same_mesh"] and n_moved < len(d["parameters"]):
        out.append("  (the others are the same layout written for the other mesh, e.g. S(0)S(0) on 2x2 = S(0) on 4)")
    if all_rows:
        rows = [(x["fqn"], " ".join(x["a"]), " ".join(x["b"]), "x".join(map(str, x["a_local_shape"] or [])),
                 "x".join(map(str, x["b_local_shape"] or [])), "yes" if x["layout_changed"] else "")
                for x in d["parameters"]]
        head = ("parameter", la, lb, f"{la} local", f"{lb} local", "moved")
    else:
        rows = [(c["class"] + f" (x{c['count']})" if c["count"] > 1 else c["fqns"][0], c["a"], c["b"],
                 "yes" if c["layout_changed"] else "")
                for c in sorted(d["parameter_classes"], key=lambda c: not c["layout_changed"])]
        head = ("parameter (per layer class; --all for each)", la, lb, "moved")
    if rows:
        out += _table(rows, head)
    for side, key in ((la, "parameters_only_in_a"), (lb, "parameters_only_in_b")):
        if d[key]:
            out.append(f"  only in {side}: {', '.join(d[key])}")

    n_moved = sum(x["layout_changed"] for x in d["nodes"])
    out += ["", f"nodes: {len(d['nodes'])} of {d['node_count']} strategies differ, "
                f"{n_moved} of them change a layout"]
    if all_rows:
        rows = [(x["name"], x["op"], x["location"], x["a"], x["b"], "yes" if x["layout_changed"] else "")
                for x in d["nodes"]]
        head = ("node", "op", "location", la, lb, "moved")
    else:
        def most(strats: dict) -> str:
            s, n = max(strats.items(), key=lambda kv: kv[1])
            return s + (f" (+{len(strats) - 1} more)" if len(strats) > 1 else "")
        classes = sorted(d["node_classes"], key=lambda c: -c["layout_changed"])
        rows = [(c["class"], c["op"], f"{c['changed']}/{c['count']}", c["layout_changed"] or "",
                 most(c["a"]), most(c["b"])) for c in classes]
        if len(rows) > limit:
            rows = rows[:limit] + [(f"... {len(rows) - limit} more (--all)", "", "", "", "", "")]
        head = ("layer class", "op", "changed", "moved", la, lb)
    if rows:
        out += _table(rows, head)
    return "\n".join(out)


def diff_main(argv=None) -> int:
    """``autopar diff a.json b.json [--all] [--json]``."""
    import json

    ap = argparse.ArgumentParser(prog="autopar diff",
                                 description="Compare two plans: placements, strategies, predicted cost and "
                                             "where the difference comes from")
    ap.add_argument("a", help="first plan.json (A)")
    ap.add_argument("b", help="second plan.json (B)")
    ap.add_argument("--all", action="store_true", help="list every parameter and node instead of layer classes")
    ap.add_argument("--json", action="store_true", help="print the diff as one JSON object")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        a, b = Plan.load(args.a), Plan.load(args.b)
        d = diff_plans(a, b)
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        print(f"A = {args.a}\nB = {args.b}")
        print(format_diff(d, all_rows=args.all))
    return 0


__all__ = ["diff_plans", "format_diff", "diff_main", "layout"]
