"""Step 5 of pipeline planning: the plan's ``pipeline`` section, stage ranks
and the per-stage tables (see autopar/pipeline/__init__.py)."""
from __future__ import annotations


import numpy as np
import torch
from torch.distributed.tensor import Replicate

from autopar.cost_models.collectives import Collective, axis_links, collective_time
from autopar.cost_models.graph_costs import CostContext, needs_grad
from autopar.cost_models.resharding import transitions
from autopar.errors import AutoparError
from autopar.ir import NodeKind
from autopar.mesh import Mesh
from autopar.passes.strategy import fmt_spec, local_shape, parse_spec, shard_factor
from autopar.plan import NodePlan, Plan
from autopar.planner import node_costs, placeholders
from autopar.pipeline.pricing import Profile, cut_placements, once_per_step
from autopar.pipeline.stages import Candidate, bubble_fraction


PP_AXIS = "pp"
"""Name of the pipeline axis in the meshes the planner writes (and looks for)."""


def _stage_ranks(mesh: Mesh, pp_index: int, coord: int) -> list:
    grid = np.arange(mesh.size).reshape(mesh.shape)
    return [int(r) for r in np.take(grid, coord, axis=pp_index).flatten()]


def _full_spec(spec: tuple, submesh: Mesh, mesh: Mesh) -> str:
    """A spec on the stage submesh as a spec on the whole mesh: replicated on
    the pp axis and on any axis the submesh does not have (dp priced outside it)."""
    by_name = dict(zip(submesh.names, spec))
    return fmt_spec(tuple(by_name.get(n, Replicate()) if n != PP_AXIS else Replicate() for n in mesh.names))


def _per_axis(spec: tuple, submesh: Mesh, mesh: Mesh) -> list:
    return [fmt_spec((q,)) for q in parse_spec(_full_spec(spec, submesh, mesh), mesh.ndim)]


def inner_mesh(mesh: Mesh) -> Mesh:
    """The stage submesh: every axis but pp (a single axis of size 1 when there is none)."""
    kept = [(n, s) for n, s in zip(mesh.names, mesh.shape) if n != PP_AXIS]
    if not kept:
        return Mesh((1,), ("tp",))
    return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))


def microbatch_inputs(plan: Plan) -> tuple:
    """Zeros shaped as one microbatch of a pipelined plan's inputs: what its stages were traced and planned on."""
    return tuple(torch.zeros(i["microbatch_shape"], dtype=getattr(torch, i["dtype"].replace("torch.", "")))
                 for i in plan.inputs)


def inner_spec(spec: str, mesh: Mesh) -> str:
    """A whole-mesh spec of a pipelined plan on the stage submesh (the pp axis
    dropped; "R" on the one-device submesh of a pp-only mesh)."""
    placements = list(parse_spec(spec, mesh.ndim))
    del placements[mesh.names.index(PP_AXIS)]
    return fmt_spec(tuple(placements)) if placements else "R"


def stage_ranges(plan: Plan, layer_names: list) -> list:
    """The [start, stop) ranges of a pipelined plan's stages in ``layer_names``."""
    ranges = []
    for st in plan.pipeline["stages"]:
        names = st["layers"]
        if names[0] not in layer_names:
            raise AutoparError(f"the plan's stage {st['index']} starts at layer {names[0]!r}, which this model "
                               f"does not have (its layers: {layer_names[:6]}...); recompile the plan")
        start = layer_names.index(names[0])
        if layer_names[start:start + len(names)] != names:
            raise AutoparError(f"the plan's stage {st['index']} layers {names} are not consecutive layers of this "
                               "model; recompile the plan for this model")
        ranges.append((start, start + len(names)))
    if not ranges or ranges[0][0] != 0 or ranges[-1][1] != len(layer_names) or \
            any(a[1] != b[0] for a, b in zip(ranges, ranges[1:])):
        raise AutoparError(f"the plan's stages {[s['layers'] for s in plan.pipeline['stages']]} do not cover this "
                           f"model's layers {layer_names} in order; recompile the plan")
    return ranges


def _topology(mesh: Mesh, cluster) -> list:
    return [{"name": nm, "size": a.size, "intra_node": a.intra, "inter_node": a.inter,
             "level": "inter-node" if a.intra == 1 and a.inter > 1 else
                      ("hierarchical" if a.inter > 1 else "intra-node")}
            for nm, a in zip(mesh.names, axis_links(cluster, mesh.shape))]


def _pipeline_section(cand: Candidate, stages: list) -> dict:
    return {"schedule": cand.schedule.value, "microbatches": cand.microbatches,
            "virtual_stages": cand.virtual_stages, "axis": PP_AXIS,
            "recompute": cand.recompute, "microbatch_size": cand.microbatch,
            "optimizer_sharding": "zero-1",  # over a submesh axis each parameter is replicated on (zero1_axis)
            "bubble_fraction": bubble_fraction(cand.schedule, cand.stages, cand.microbatches, cand.virtual_stages),
            "stages": stages}


def build_pipeline_plan(cand: Candidate, mesh: Mesh, cluster, source: str | None) -> Plan:
    """The Plan of a candidate priced on the whole microbatch graph."""
    prof = cand.profile
    graph, layers, chosen = prof.graph, prof.grouping, prof.chosen
    pp_index = mesh.names.index(PP_AXIS)
    inner = prof.submesh
    ctx = prof.ctx
    p, m = cand.stages, cand.microbatches
    costs = node_costs(graph, chosen, ctx)  # the flat planner's accounting, as the stage pricing summed it
    nodes = []
    for cost in costs:
        node, s = graph.nodes[cost.name], cost.strategy
        memory = sum(cost.parts.values()) + cost.activations + sum(e.held for e in cost.edges)
        nodes.append(NodePlan(node.name, node.op_name, node.fqn, list(node.inputs),
                              [_full_spec(x, inner, mesh) for x in s.inputs], _full_spec(s.output, inner, mesh),
                              cost.fwd_s + cost.bwd_s, memory, len(prof.strategies[node.name]),
                              [_full_spec(x, inner, mesh) for x in s.items or ()]))
    stage_of, stage_entries = {}, []
    for c, (i, j) in enumerate(cand.ranges):
        names = layers.nodes_of(graph, i, j)
        for nm in names:
            stage_of.setdefault(nm, c)
        params = {graph.nodes[nm].fqn: fmt_spec(chosen[nm].output) for nm in names
                  if graph.nodes[nm].kind is NodeKind.PARAM}
        stage_entries.append({
            "index": c, "layers": layers.names[i:j], "nodes": names, "submesh": list(inner.shape),
            "devices": _stage_ranks(mesh, pp_index, c % p), "time_s": cand.chunk_time_s[c],
            "memory_bytes": cand.device_memory[c % p],
            "receives": list(layers.crossing[i]) if i > 0 else [],
            "sends": list(layers.crossing[j]) if j < layers.n else [],
            "plan": {"mesh": inner.to_json(), "parameters": params,
                     "strategies": {nm: str(chosen[nm]) for nm in names}},
        })
    parameters = {}
    for fqn, ph in graph.params.items():
        spec, shape = chosen[ph].output, graph.nodes[ph].out.shape
        parameters[fqn] = {"placements": _per_axis(spec, inner, mesh), "shape": list(shape),
                           "local_shape": list(local_shape(shape, spec, inner.shape)),
                           "dtype": str(graph.nodes[ph].out.dtype), "stage": stage_of.get(ph, 0)}
    inputs = []
    for node in graph.nodes.values():
        if node.kind is NodeKind.INPUT:
            spec, shape = chosen[node.name].output, list(node.out.shape)
            inputs.append({"name": node.name, "placements": _per_axis(spec, inner, mesh),
                           "shape": [m * shape[0], *shape[1:]] if shape else shape, "microbatch_shape": shape,
                           "dtype": str(node.out.dtype),
                           "local_shape": list(local_shape(node.out.shape, spec, inner.shape))})
    model_info = {"source": source, "fingerprint": graph.fingerprint(), "has_loss": graph.has_loss,
                  "training": graph.training,
                  "placeholders": placeholders(graph), "out_spec": graph.out_spec,
                  "microbatch_size": prof.microbatch}
    sol = prof.solution
    solver_info = {"status": sol.status, "objective": cand.step_s, "wall_s": sol.wall_s,
                   "variables": sol.variables, "constraints": sol.constraints, "backend": sol.extra.get("backend"),
                   "stage_objective_s": sol.objective_s}
    plan = Plan(mesh, cluster.to_json(), _topology(mesh, cluster), model_info, parameters, inputs, nodes,
                _collectives(cand, ctx, costs, stage_of, mesh, cluster), _predicted(cand, cluster, mesh),
                solver_info, _pipeline_section(cand, stage_entries))
    plan.fallbacks = [f.to_json() for f in prof.fallbacks]
    plan.warnings = [f.describe() for f in prof.fallbacks]
    plan.recompute = _recompute_section(cand)
    return plan


def _recompute_section(cand: Candidate, regions: bool = True) -> dict:
    """plan.recompute: the numbered layers run under activation checkpointing,
    whole (full) or their selective regions (listed where the plan has the
    graph's nodes, ``regions``)."""
    prof = cand.profile
    if cand.recompute == "selective":
        rc = prof.selective_rc
        layers = [lc.name for lc, sel in zip(prof.layers, prof.selective) if sel.recomputed_bytes > 0]
        out = {"mode": "selective", "layers": layers}
        if regions:
            out["regions"] = [list(r) for r in rc.regions]
        return out
    layers = [lc.name for lc in prof.layers if cand.recompute == "full" and lc.recomputable]
    return {"mode": "full" if layers else "none", "layers": layers}


def _collectives(cand: Candidate, ctx: CostContext, costs: list, stage_of: dict, mesh: Mesh, cluster) -> list:
    """Logical collectives: each stage's intra-stage resharding (``per_step``
    times: m per microbatch, once for gradient synchronisation), from the
    plan's ``node_costs``, and one send_recv per crossing tensor per boundary
    per direction."""
    prof = cand.profile
    graph, layers, chosen = prof.graph, prof.grouping, prof.chosen
    grad = needs_grad(graph)
    inner = prof.submesh
    out = []
    m = cand.microbatches
    for cost in costs:
        node = graph.nodes[cost.name]
        stage = stage_of.get(node.name, len(cand.ranges) - 1)
        for phase, moves in (("forward", cost.own_fwd), ("backward", cost.own_bwd)):
            for mv in moves:  # collectives inside the op
                out.append({"kind": mv.kind.value, "phase": phase,
                            "mesh_axes": [inner.names[a] for a in mv.axes or (mv.axis,)],
                            "bytes": mv.nbytes, "seconds": mv.seconds, "node": node.name, "producer": node.name,
                            "tensor": node.name, "gradient_sync": False, "stage": stage, "per_step": m})
        for edge in cost.edges:
            src = edge.src
            for phase, moves in (("forward", edge.fwd), ("backward", edge.bwd)):
                for mv in moves:
                    sync = phase == "backward" and graph.nodes[src].kind is NodeKind.PARAM
                    once = phase == "backward" and once_per_step(graph.nodes[src], chosen[src].output, mv)
                    out.append({"kind": mv.kind.value, "phase": phase, "mesh_axes": [inner.names[mv.axis]],
                                "bytes": mv.nbytes, "seconds": mv.seconds, "node": node.name, "producer": src,
                                "tensor": graph.nodes[src].fqn if graph.nodes[src].kind is NodeKind.PARAM else src,
                                "gradient_sync": sync, "stage": stage, "per_step": 1 if once else m})
    pp_link = axis_links(cluster, mesh.shape)[mesh.names.index(PP_AXIS)]
    for c, (i, j) in enumerate(cand.ranges):
        if j >= layers.n:
            continue
        for name in layers.crossing[j]:
            meta = graph.nodes[name].out
            spec = chosen[name].output
            sent = cut_placements(spec)
            nbytes = ctx.tensor_bytes(meta)
            for mv in transitions(spec, sent, nbytes, inner.shape, ctx.links):  # Partial sums reduced first
                out.append({"kind": mv.kind.value, "phase": "forward", "mesh_axes": [inner.names[mv.axis]],
                            "bytes": mv.nbytes, "seconds": mv.seconds, "node": name, "producer": name,
                            "tensor": name, "gradient_sync": False, "stage": c, "per_step": m})
            local = nbytes / shard_factor(sent, inner.shape)
            t = collective_time(Collective.SEND_RECV, local, pp_link)
            phases = ["forward"] + (["backward"] if name in grad and meta.dtype.is_floating_point else [])
            for phase in phases:
                out.append({"kind": "send_recv", "phase": phase, "mesh_axes": [PP_AXIS], "bytes": local,
                            "seconds": t, "node": name, "producer": name, "tensor": name, "gradient_sync": False,
                            "stage": c, "from_stage": c if phase == "forward" else c + 1,
                            "to_stage": c + 1 if phase == "forward" else c, "per_step": m})
    return out


def _predicted(cand: Candidate, cluster, mesh: Mesh) -> dict:
    peak_rank = max(range(cand.stages), key=lambda r: cand.device_memory[r])
    dtype = cand.profile.dtype if cand.profile else "fp32"
    return {"step_time_s": cand.step_s, "compute_s": cand.compute_s, "comm_s": cand.comm_s,
            "bubble_s": cand.bubble_s, "sync_s": cand.sync_s, "optimizer_s": cand.optimizer_s, "peak_memory_bytes": cand.memory_bytes,
            "memory": dict(cand.device_memory_parts[peak_rank]), "peak_stage": peak_rank,
            "stage_memory_bytes": list(cand.device_memory), "stage_time_s": list(cand.device_time_s),
            "memory_capacity_bytes": cluster.device.memory, "model_flops": cand.flops,
            "mfu": cand.flops / (cand.step_s * mesh.size * cluster.device.flops(dtype)) if cand.step_s > 0 else 0.0,
            "precision": cand.profile.ctx.precision if cand.profile and cand.profile.ctx else "fp32"}


def plan_from_candidate(cand: Candidate, mesh: Mesh, cluster, source: str | None) -> Plan:
    """A planning-only Plan for a model priced by repetition: stages list their
    layers, costs and the representative layers' placements (applied to every
    repeated layer), but no nodes: it cannot be executed as is."""
    prof = cand.profile
    pp_index = mesh.names.index(PP_AXIS)
    names = prof.names
    link = axis_links(cluster, mesh.shape)[pp_index]
    params = _representative_parameters(prof, cand, mesh)
    stages, collectives = [], []
    for c, (i, j) in enumerate(cand.ranges):
        stages.append({"index": c, "layers": names[i:j], "nodes": [], "submesh": list(cand.submesh),
                       "devices": _stage_ranks(mesh, pp_index, c % cand.stages), "time_s": cand.chunk_time_s[c],
                       "memory_bytes": cand.device_memory[c % cand.stages],
                       "plan": {"parameters": {k: "".join(v["placements"]) for k, v in params.items()
                                               if v["stage"] == c}}})
        if j < len(names):
            cut = prof.cuts[j]
            for phase in ("forward", "backward"):
                collectives.append({"kind": "send_recv", "phase": phase, "mesh_axes": [PP_AXIS],
                                    "bytes": cut.nbytes, "seconds": collective_time(Collective.SEND_RECV, cut.nbytes,
                                                                                    link),
                                    "node": names[j], "tensor": f"into {names[j]}", "gradient_sync": False,
                                    "stage": c, "per_step": cand.microbatches})
    pipeline = _pipeline_section(cand, stages)
    pipeline["priced_by_repetition"] = list(prof.repeated) if prof.repeated else None
    sol = prof.solution
    solver_info = {"status": sol.status, "objective": cand.step_s, "wall_s": sol.wall_s,
                   "variables": sol.variables, "constraints": sol.constraints, "backend": sol.extra.get("backend"),
                   "stage_objective_s": sol.objective_s}
    plan = Plan(mesh, cluster.to_json(), _topology(mesh, cluster),
                {"source": source, "fingerprint": None, "has_loss": True}, params, [], [], collectives,
                _predicted(cand, cluster, mesh), solver_info, pipeline)
    plan.recompute = _recompute_section(cand, regions=False)
    if prof.repeated:
        plan.warnings.append(f"priced by repetition: the {prof.repeated[1]} layers of {prof.repeated[0]} were "
                             f"priced on a {prof.repeated[2]}-layer copy; the plan has no per-node strategies, "
                             "compile with reuse_layers=False to execute it")
    return plan


def _representative_parameters(prof: Profile, cand: Candidate, mesh: Mesh) -> dict:
    """Parameter placements of the whole model from the captured (truncated) graph."""
    graph, layers = prof.graph, prof.grouping
    container, total, _ = prof.repeated or (None, 0, 0)
    stage_of_layer = {}
    for c, (i, j) in enumerate(cand.ranges):
        for k in range(i, j):
            stage_of_layer[prof.names[k]] = c
    out = {}
    for fqn, ph in graph.params.items():
        spec, shape = prof.chosen[ph].output, graph.nodes[ph].out.shape
        entry = {"placements": _per_axis(spec, prof.submesh, mesh), "shape": list(shape),
                 "local_shape": list(local_shape(shape, spec, prof.submesh.shape)),
                 "dtype": str(graph.nodes[ph].out.dtype)}
        layer = layers.names[layers.group.get(ph, 0)]
        if container and layer.startswith(container + "."):
            k = int(layer.rsplit(".", 1)[1])
            targets = [0] if k == 0 else range(1, total)
            for t in targets:
                name = fqn.replace(f"{container}.{k}.", f"{container}.{t}.", 1)
                out[name] = {**entry, "stage": stage_of_layer.get(f"{container}.{t}", 0)}
        else:
            out[fqn] = {**entry, "stage": stage_of_layer.get(layer, 0)}
    return out


def stage_rows(plan: Plan) -> list:
    """One row per stage of a pipelined plan for ``autopar show``: index,
    layers (first..last), devices, submesh, time per microbatch, memory."""
    rows = []
    for st in (plan.pipeline or {}).get("stages", []):
        layers = st["layers"]
        span = layers[0] if len(layers) == 1 else f"{layers[0]} .. {layers[-1]} ({len(layers)})"
        devices = st["devices"]
        dev = ",".join(map(str, devices)) if len(devices) <= 4 else f"{devices[0]}..{devices[-1]} ({len(devices)})"
        rows.append((st["index"], span, dev, "x".join(map(str, st["submesh"])), st["time_s"], st["memory_bytes"]))
    return rows
