"""``autopar show``: a plan as tidy terminal tables.

Parameters of repeated layers (``blocks.0.attn.q.weight``, ``blocks.1.attn.q.weight``,
...) are summarised as one row per layer class (``blocks.*.attn.q.weight``)
when their placements agree; ``--all`` lists every parameter and node.
"""
from __future__ import annotations

import re
from collections import defaultdict

from rich.console import Console
from rich.table import Table

from autopar.plan import ZERO_LABELS, Plan  # noqa: F401  (ZERO_LABELS: re-exported)
from autopar.units import fmt_bytes, fmt_s  # noqa: F401  (re-exported)

GiB = 2**30


def layer_class(fqn: str) -> str:
    """'blocks.3.attn.q.weight' -> 'blocks.*.attn.q.weight'."""
    return re.sub(r"\.\d+\.", ".*.", fqn)




def parameter_rows(plan: Plan, all_rows: bool = False) -> list[tuple]:
    groups: dict = defaultdict(list)
    for fqn, p in plan.parameters.items():
        key = fqn if all_rows else (layer_class(fqn), tuple(p["placements"]), p.get("zero_stage"),
                                    p.get("offload", False))
        groups[key].append((fqn, p))
    rows = []
    for key, members in groups.items():
        fqn, p = members[0]
        name = fqn if all_rows or len(members) == 1 else f"{layer_class(fqn)} (x{len(members)})"
        held = ZERO_LABELS.get(p.get("zero_stage", "unknown"), "-") + (", optimizer on host" if p.get("offload") else "")
        rows.append((name, " ".join(p["placements"]), held,
                     "x".join(map(str, p["shape"])), "x".join(map(str, p["local_shape"]))))
    return rows


def collective_rows(plan: Plan) -> list[tuple]:
    agg: dict = defaultdict(lambda: [0, 0.0, 0.0])
    for c in plan.collectives:
        key = (c["phase"], ",".join(c["mesh_axes"]), c["kind"])
        agg[key][0] += 1
        agg[key][1] += c["bytes"]
        agg[key][2] += c["seconds"]
    return [(phase, axes, kind, n, fmt_bytes(b), fmt_s(s)) for (phase, axes, kind), (n, b, s) in sorted(agg.items())]


def show(plan: Plan, all_nodes: bool = False, console: Console | None = None) -> None:
    con = console or Console(width=120)
    pred = plan.predicted
    axes = ", ".join(f"{t['name']}={t['size']} ({t['level']})" for t in plan.topology) or str(plan.mesh)
    con.print(f"[bold]autopar plan[/bold]  mesh {plan.mesh.shape} on {plan.cluster.get('name')}: {axes}")
    con.print(f"model {plan.model.get('source') or '(in-process)'}  fingerprint {plan.model.get('fingerprint')}")
    con.print(f"predicted step {fmt_s(pred['step_time_s'])} = compute {fmt_s(pred['compute_s'])} + "
              f"communication {fmt_s(pred['comm_s'])} + bubble {fmt_s(pred.get('bubble_s', 0.0))}"
              + (f" + optimizer {fmt_s(pred['optimizer_s'])}" if pred.get("optimizer_s") else "") + ";  "
              f"MFU {pred.get('mfu', 0.0):.1%}")

    mem = Table(title="memory per device", title_justify="left")
    kinds = ("parameters", "gradients", "optimizer", "activations", "buffers", "inputs")
    host = pred.get("host_memory_bytes")
    for col in (*kinds, "peak", "capacity", *(("on host", "host share") if host else ())):
        mem.add_column(col, justify="right")
    m = pred.get("memory", {})
    share = pred.get("host_capacity_bytes")
    mem.add_row(*(fmt_bytes(m.get(k, 0.0)) for k in kinds),
                fmt_bytes(pred["peak_memory_bytes"]), fmt_bytes(pred.get("memory_capacity_bytes", 0.0)),
                *((fmt_bytes(host), fmt_bytes(share) if share else "-") if host else ()))
    con.print(mem)

    params = Table(title="parameters" + ("" if all_nodes else " (per layer class; --all for every one)"),
                   title_justify="left")
    for col in ("parameter", "placements", "held as", "shape", "local shape"):
        params.add_column(col)
    for row in parameter_rows(plan, all_nodes):
        params.add_row(*row)
    con.print(params)

    coll = Table(title="collectives (logical, one per tensor)", title_justify="left")
    for col in ("phase", "mesh axis", "kind", "count", "bytes", "time"):
        coll.add_column(col, justify="right" if col in ("count", "bytes", "time") else "left")
    for row in collective_rows(plan):
        coll.add_row(*map(str, row))
    if not plan.collectives:
        coll.add_row("-", "-", "none", "0", "0 B", "0")
    con.print(coll)

    if all_nodes:
        nodes = Table(title="nodes", title_justify="left")
        for col in ("node", "op", "location", "strategy", "compute"):
            nodes.add_column(col)
        for n in plan.nodes:
            nodes.add_row(n.name, n.op, n.location, n.strategy, fmt_s(n.compute_s))
        con.print(nodes)

    if plan.pipeline:
        from autopar.pipeline import stage_rows
        pl = plan.pipeline
        stages = Table(title=f"pipeline: {len(pl['stages'])} stages, schedule {pl['schedule']}, "
                             f"{pl['microbatches']} microbatches"
                             + (f", {pl['virtual_stages']} virtual stages" if pl.get("virtual_stages", 1) > 1 else "")
                             + f", bubble {pl.get('bubble_fraction', 0.0):.1%}"
                             + (", ZeRO-1 optimizer states"
                                if pl.get("optimizer_sharding") == "zero-1" else ""), title_justify="left")
        for col in ("stage", "layers", "devices", "submesh", "time", "memory"):
            stages.add_column(col)
        for index, layers, devices, submesh, seconds, memory in stage_rows(plan):
            stages.add_row(str(index), layers, devices, submesh, fmt_s(seconds), fmt_bytes(memory))
        con.print(stages)

    sv = plan.solver
    wall = f", {sv['wall_s']:.2f} s" if sv.get("wall_s") is not None else ""
    if sv.get("cache") == "hit":
        wall += " (when it was solved; this time from the plan cache)"
    con.print(f"solver {sv.get('backend', '')} {sv['status']}: objective {fmt_s(sv['objective'])}, "
              f"{sv['variables']} variables, {sv['constraints']} constraints{wall}")
    hits = (sv.get("pipeline_search") or {}).get("layer_cache")
    if hits:
        con.print(f"stage ILPs: {hits['hits']} solved layer classes from the plan cache, {hits['misses']} solved "
                  "now")
    for k in sv.get("layer_classes") or []:
        span = f"layer class {k['layers'][0]} .. {k['layers'][-1]} ({len(k['layers'])} layers)"
        if k["shared"] == len(k["layers"]):
            con.print(f"{span}: one set of ILP variables")
        elif k["shared"] == 0:
            con.print(f"{span}: solved layer by layer, the gradient sync window bound ({k['solves']} solves)")
        else:
            con.print(f"{span}: first {k['own_front']} and last {k['own_back']} solved on their own, "
                      f"{k['shared']} share one set of ILP variables ({k['solves']} solves)")
    for what, count in (sv.get("pruned") or {}).items():
        con.print(f"pruned before solving: {count} {what}")
    if plan.recompute.get("layers"):
        layers, regions = plan.recompute["layers"], plan.recompute.get("regions")
        if regions:  # selective: name the ops of one region
            from autopar.cost_models.graph_costs import VIEW_OPS
            from autopar.ir import op_label
            views = {op_label(t) for t in VIEW_OPS}  # left out of the listing
            ops = {n.name: n.op for n in plan.nodes}
            kinds = list(dict.fromkeys(ops[n] for n in regions[0] if ops.get(n) not in views))
            con.print(f"recomputed in backward (selective): {len(regions)} regions in {len(layers)} layers "
                      f"({layers[0]} .. {layers[-1]}), e.g. {', '.join(kinds)}")
        else:
            con.print(f"recomputed in backward: {len(layers)} layers ({layers[0]} .. {layers[-1]})")
    if plan.dynamic:
        from autopar.dynamic.explain import describe
        example = ", ".join(f"{k} {v}" for k, v in plan.dynamic["example"].items())
        con.print(f"dynamic: the tables above are the plan at the example sizes ({example}); its pieces "
                  "(`autopar explain PLAN --over NAME=LOW..HIGH` says why they change):")
        con.print(describe(plan, reasons=False), markup=False, highlight=False)
    for w in plan.warnings:
        con.print(f"[yellow]warning:[/yellow] {w}")
