"""``autopar explain``: why a node (or a parameter) got its strategy.

The plan's model is captured again from ``plan.model["source"]``, the node's
candidate strategies are enumerated as ``autopar compile`` did, and each one is
priced *in the context of the plan*: its neighbours keep their planned
strategies, so a candidate pays its own compute (forward + backward) plus the
resharding, forward and backward, on every edge to its producers and to its
consumers, with the same cost functions the ILP's objective uses
(cost_models/graph_costs.py). Memory is the ILP's other constraint (a
per-device budget), shown next to each candidate.

A parameter is explained through its placeholder node: it computes nothing,
so its cost is the edges to its consumers (in backward, the gradient sync),
and its memory (weights, gradients, optimizer states).
"""
from __future__ import annotations

import argparse
import difflib
import os
import sys
from dataclasses import dataclass, field, replace

from torch.distributed.tensor import Shard

from autopar.errors import AutoparError, PlanError
from autopar.ir import NodeKind
from autopar.passes.strategy import Strategy, fmt_spec
from autopar.plan import Plan
from autopar.report import fmt_bytes
from autopar.report import fmt_s


@dataclass
class Transfer:
    """One collective a candidate causes on one of its edges."""

    neighbour: str
    direction: str  # "in" (from a producer) or "out" (to a consumer)
    node: str
    phase: str  # forward / backward
    kind: str
    axis: str
    nbytes: float
    seconds: float
    shared_with: tuple = ()
    """Other consumers of the same reshard (``reshard_key``): the plan runs
    it once for all of them."""
    paid: bool = True
    """False where a consumer the plan already has pays for this reshard
    (an input edge whose placement another consumer of the producer wants
    too): it adds nothing to this candidate's total."""

    def __str__(self) -> str:
        src, dst = (self.neighbour, self.node) if self.direction == "in" else (self.node, self.neighbour)
        shared = ""
        if self.shared_with:
            shared = (f"; shared with {', '.join(self.shared_with)}" +
                      (", counted once" if self.paid else ", which the plan runs anyway: not counted"))
        return (f"{self.phase:8s} {self.kind} on {self.axis}, {fmt_bytes(self.nbytes)}, {fmt_s(self.seconds)}"
                f"  (edge {src} -> {dst}{shared})")


@dataclass
class Candidate:
    strategy: str
    compute_s: float
    comm_in_s: float
    comm_out_s: float
    memory_bytes: float
    chosen: bool
    transfers: list = field(default_factory=list)
    over_budget: bool = False
    reading: str = ""
    """What the strategy does, in the words of the technique, where the op has
    them (attention: data, head or context parallelism per mesh axis)."""
    """With this strategy instead, the plan's peak memory per device would exceed the budget."""

    @property
    def comm_s(self) -> float:
        return self.comm_in_s + self.comm_out_s

    @property
    def total_s(self) -> float:
        return self.compute_s + self.comm_s


@dataclass
class Explanation:
    target: str
    node: str
    op: str
    location: str
    parameter: str | None
    producers: list  # [(name, planned output spec)]
    consumers: list  # [(name, planned spec it takes this node's output in)]
    candidates: list  # list[Candidate], cheapest first, the chosen one first among equals
    memory_budget_bytes: float
    grad_sync: tuple | None = None
    """For a parameter: (seconds of all parameter-gradient syncs of the step,
    seconds of them left exposed after backward, whether the cluster
    overlaps them with backward), from the plan's prediction."""
    stage: str = ""
    """For a pipelined plan: the submesh its stages' nodes were planned on."""
    prefetch: tuple | None = None
    """For a ZeRO-3 parameter: (seconds of the step's prefetched forward
    gathers, seconds of them left exposed, whether the cluster overlaps
    them with compute), from the plan's prediction."""

    @property
    def chosen(self) -> Candidate:
        return next(c for c in self.candidates if c.chosen)

    @property
    def runner_up(self) -> Candidate | None:
        return next((c for c in self.candidates if not c.chosen), None)


def capture_plan_model(plan: Plan, source: str | None = None):
    """The plan's model captured again, checked against the plan's fingerprint
    (a pipelined plan's: of one microbatch, what its stages were planned on).

    ``source`` overrides ``plan.model["source"]`` (FILE.py:FACTORY), e.g. when
    the plan was compiled from another directory."""
    from autopar.capture import capture
    from autopar.runtime import load_factory

    source = source or plan.model.get("source")
    if not source:
        raise PlanError("the plan does not name its model (it was compiled in-process); "
                        "pass the model as FILE.py:FACTORY (--source)")
    path = source.rsplit(":", 1)[0]
    if not os.path.exists(path):
        raise PlanError(f"the plan's model {source!r} is not found from {os.getcwd()}: run from the directory "
                        "the plan was compiled in, or pass --source FILE.py:FACTORY")
    model, inputs, loss_fn = load_factory(source)
    if plan.pipeline is not None:
        from autopar.pipeline.planfile import microbatch_inputs
        inputs = microbatch_inputs(plan)
    graph = capture(model, inputs, loss_fn)
    want = plan.model.get("fingerprint")
    if want and graph.fingerprint() != want:
        raise PlanError(f"{source} now traces to a different graph (fingerprint {graph.fingerprint()}, the plan "
                        f"has {want}): the model changed since the plan was compiled; recompile it")
    return graph


def _per_stage(plan: Plan, graph, source: str | None) -> tuple:
    """(a pipelined plan as its stages' ILP solved it, the microbatch graph):
    every node's placements on the stage submesh (the pp axis dropped; a
    pp-only mesh's stages run on one device), without the pipeline."""
    from autopar.pipeline.planfile import inner_mesh, inner_spec
    mesh = plan.mesh
    graph = graph if graph is not None else capture_plan_model(plan, source)
    def inner(specs: list) -> list:
        return [inner_spec(x, mesh) for x in specs]
    nodes = [replace(n, input_specs=inner(n.input_specs), output_spec=inner_spec(n.output_spec, mesh),
                     item_specs=inner(n.item_specs)) for n in plan.nodes]
    return replace(plan, mesh=inner_mesh(mesh), nodes=nodes, pipeline=None), graph


def _resolve(plan: Plan, graph, target: str) -> tuple[str, str | None]:
    """(node name, parameter fqn or None) for a node name, parameter fqn or module path."""
    names = {n.name for n in plan.nodes}
    if target in names:
        fqn = next((f for f, ph in graph.params.items() if ph == target), None)
        return target, fqn
    if target in graph.params:
        return graph.params[target], target
    at = [n for n in plan.nodes if n.location == target and n.op not in ("param", "buffer")]
    if len(at) == 1:
        return at[0].name, None
    if at:
        raise AutoparError(f"{target!r} is a module with {len(at)} nodes: "
                           f"{', '.join(n.name + ' (' + n.op + ')' for n in at)}; explain one of them")
    pool = sorted(names | set(graph.params) | {n.location for n in plan.nodes if n.location})
    close = difflib.get_close_matches(target, pool, n=6, cutoff=0.5)
    hint = f"; did you mean {', '.join(close)}?" if close else \
        "; `autopar show --all` lists the nodes, and parameters are named by fqn (e.g. blocks.0.attn.q.weight)"
    raise AutoparError(f"the plan has no node or parameter named {target!r}{hint}")


def _planned_strategy(plan_node, text: str, strategies: list, ndim: int) -> Strategy:
    for s in strategies:
        if str(s) == text:
            return s
    return plan_node.placed(ndim)


def _strategy_text(plan: Plan, plan_node, graph_node) -> str:
    """A node's planned strategy as ``Strategy`` prints it: a parameter's
    ZeRO-3 ("regather") and offload choices are in ``plan.parameters``."""
    info = plan.parameters.get(graph_node.fqn, {}) if graph_node.kind is NodeKind.PARAM else {}
    return plan_node.strategy + " regather" * bool(info.get("regather")) + " offload" * bool(info.get("offload"))


def explain_node(plan: Plan, target: str, *, graph=None, source: str | None = None) -> Explanation:
    """Price every candidate strategy of ``target`` with its neighbours as planned."""
    from autopar.cost_models.cluster import Cluster
    from autopar.cost_models.graph_costs import (
        CostContext, bucket_bytes, edge_memory, edge_moves, kept_outputs, needs_grad, node_compute,
        node_memory, op_moves, optimizer_time, produced, replays, reshard_key, saves_input, shares_reshard,
    )
    from autopar.cost_models.resharding import reads_in_place
    from autopar.passes.enumerate import enumerate_strategies

    stage = plan.pipeline is not None
    if stage:  # priced as the stages' ILP priced it: per microbatch, on the submesh
        plan, graph = _per_stage(plan, graph, source)
    graph = graph if graph is not None else capture_plan_model(plan, source)
    name, fqn = _resolve(plan, graph, target)
    if name not in graph.nodes:
        raise PlanError(f"node {name!r} of the plan is not in the captured model; recompile the plan")
    mesh = plan.mesh
    strategies, _ = enumerate_strategies(graph, mesh.shape)
    if stage:  # what a stage may choose (planner.prepare, stage=True)
        strategies = {n: [s for s in ss if not (s.regather or s.offload)] for n, ss in strategies.items()}
    kwargs = {}
    precision = plan.predicted.get("precision")
    if precision and precision != "fp32":
        kwargs["precision"] = precision
    optimizer = plan.predicted.get("optimizer") or plan.model.get("optimizer") or "adamw"
    ctx = CostContext.make(mesh.shape, Cluster.from_json(plan.cluster), optimizer, stage=stage, **kwargs)
    grad = needs_grad(graph)
    kept_share, read = kept_outputs(graph)
    planned = {n.name: n for n in plan.nodes}
    node = graph.nodes[name]
    chosen_text = _strategy_text(plan, planned[name], node)

    def planned_of(other: str) -> Strategy:
        if other not in planned:
            raise PlanError(f"node {other!r} is in the model but not in the plan; recompile the plan")
        return _planned_strategy(planned[other], _strategy_text(plan, planned[other], graph.nodes[other]),
                                 strategies[other], mesh.ndim)

    uses = graph.consumers()
    consumers = uses[name]
    producers = [(src, fmt_spec(planned_of(src).output)) for src in node.inputs]
    consumer_specs = [(c, fmt_spec(planned_of(c).inputs[i])) for c, i in consumers]

    def key_of(consumer: str, idx: int, s: Strategy, src: str):
        """What the plan shares ``consumer``'s reshard of input ``idx`` by (None: its own)."""
        if not shares_reshard(graph.nodes[consumer]):
            return None
        return reshard_key(idx, s, mesh.ndim, consumer in grad and src in grad)

    # per producer: the planned consumers (other than this node) by the reshard they share
    wanted: dict = {}
    for src in set(node.inputs):
        for c, idx in uses[src]:
            key = key_of(c, idx, planned_of(c), src) if c != name else None
            if key is not None:
                wanted.setdefault((src, key), []).append((c, idx))

    candidates = []
    for s in strategies[name]:
        f, b = node_compute(node, s, ctx, name in grad)
        if not stage:  # parameters: the update of this shard (a stage's runs once a step, after the microbatches)
            f += optimizer_time(node, s, ctx)
        transfers = _transfers(name, "in", name, *op_moves(node, s, ctx, name in grad), mesh.names, [], True)
        held = 0.0  # resharded copies of its inputs kept for backward (as the plan counts them)
        mine: set = set()  # reshards of its inputs this candidate pays for
        for idx, src in enumerate(node.inputs):
            producer = planned_of(src)
            have, meta = produced(graph, src, node, producer)
            fwd, bwd = edge_moves(have, s, idx, meta, ctx, name in grad and src in grad,
                                  bucket_bytes(graph, src, producer.regather, ctx))
            key = key_of(name, idx, s, src)
            others = wanted.get((src, key), []) if key is not None else []
            paid = not others and (src, key) not in mine
            if key is not None:
                mine.add((src, key))
            transfers += _transfers(src, "in", name, fwd, bwd, mesh.names, [c for c, _ in others], paid)
            if not producer.regather:
                # one tensor kept per reshard, or the producer's own for all that read it in place
                keepers = others if not reads_in_place(have, s.inputs[idx]) else [
                    (c, j) for c, j in uses[src]
                    if c != name and reads_in_place(have, planned_of(c).inputs[j])]
                keeps = edge_memory(have, s.inputs[idx], meta, ctx, name in grad and saves_input(node),
                                    src in read)
                kept = max((edge_memory(have, planned_of(c).inputs[j], meta, ctx,
                                        c in grad and saves_input(graph.nodes[c]), src in read)
                            for c, j in keepers), default=0.0)
                held += max(0.0, keeps - kept)
        if name in read:  # its output, kept if a consumer that saves it reads it in place
            held += max((edge_memory(s.output, planned_of(c).inputs[j], node.outputs[0], ctx,
                                     c in grad and saves_input(graph.nodes[c]), True)
                         for c, j in consumers if reads_in_place(s.output, planned_of(c).inputs[j])), default=0.0)
        groups: dict = {}  # consumers of its output by the reshard they share
        for c, idx in consumers:
            key = key_of(c, idx, planned_of(c), name)
            groups.setdefault((c, idx) if key is None else key, []).append((c, idx))
        for group in groups.values():
            c, idx = group[0]
            have, meta = produced(graph, name, graph.nodes[c], s)
            fwd, bwd = edge_moves(have, planned_of(c), idx, meta, ctx, c in grad and name in grad,
                                  bucket_bytes(graph, name, s.regather, ctx))
            transfers += _transfers(c, "out", name, fwd, bwd, mesh.names, [o for o, _ in group[1:]], True)
            for o, _ in group:
                if replays(s.regather, False, o in grad):  # ZeRO-3: gathered again in backward, per consumer
                    transfers += [Transfer(o, "out", name, "recompute", m.kind.value, mesh.names[m.axis],
                                           m.nbytes, m.seconds) for m in fwd]
        candidates.append(Candidate(
            str(s), f + b, sum(t.seconds for t in transfers if t.direction == "in" and t.paid),
            sum(t.seconds for t in transfers if t.direction == "out" and t.paid),
            node_memory(node, s, ctx, kept_share.get(name, 0.0)) + held, str(s) == chosen_text, transfers,
            reading=_reading(node, s, mesh.names, bool(op_moves(node, s, ctx, False)[0]))))
    if not any(c.chosen for c in candidates):
        raise PlanError(f"the plan's strategy {chosen_text} for {name} is not among its candidates now; "
                        "the model or autopar's rules changed since the plan was compiled; recompile it")
    # cheapest first; among equals the chosen one first, then fewer bytes per device
    candidates.sort(key=lambda c: (round(c.total_s, 15), not c.chosen, c.memory_bytes))
    budget = plan.solver.get("memory_budget_bytes") or plan.predicted.get("memory_capacity_bytes", 0.0)
    chosen_memory = next(c.memory_bytes for c in candidates if c.chosen)
    peak = plan.predicted.get("peak_memory_bytes", 0.0)
    for c in candidates:
        c.over_budget = bool(budget) and peak - chosen_memory + c.memory_bytes > budget
    pred = plan.predicted
    overlap = bool((plan.cluster or {}).get("overlap_grad_sync", True))
    sync = (pred.get("grad_sync_s", 0.0), pred.get("grad_sync_exposed_s", 0.0), overlap) if fqn else None
    regathered = bool(fqn and plan.parameters.get(fqn, {}).get("regather"))
    prefetch = (pred.get("prefetched_gather_s", 0.0), pred.get("prefetched_gather_exposed_s", 0.0),
                overlap) if regathered and not stage else None
    return Explanation(target, name, node.op_name, node.fqn, fqn, producers, consumer_specs, candidates, budget,
                       None if stage else sync,
                       ",".join(f"{n}={s}" for n, s in zip(mesh.names, mesh.shape)) if stage else "", prefetch)


def _transfers(neighbour: str, direction: str, node: str, fwd, bwd, axis_names, shared_with: list,
               paid: bool) -> list[Transfer]:
    return [Transfer(neighbour, direction, node, phase, m.kind.value, axis_names[m.axis], m.nbytes, m.seconds,
                     tuple(shared_with), paid)
            for phase, moves in (("forward", fwd), ("backward", bwd)) for m in moves]


def _reading(node, s: Strategy, axis_names, balanced: bool = False) -> str:
    """Attention's strategy in the words of the technique: per mesh axis, the
    dim of the queries it splits (passes/rules/attention.py, sdpa_rule), and
    whether a causal sequence split runs ``balanced`` (zigzag_axes)."""
    if node.op_name != "scaled_dot_product_attention" or node.info is None:
        return ""
    seq = node.info.inputs[0].ndim - 2
    context = "sequence split, keys and values gathered (context parallel)"
    if balanced:
        context += ", causal work balanced (query halves exchanged)"
    words = {0: "batch split (data parallel)", seq: context}
    parts = [f"{axis}: " + words.get(p.dim, "heads split (tensor parallel)")
             for axis, p in zip(axis_names, s.output) if isinstance(p, Shard)]
    return "; ".join(parts) or "whole on every device"


def format_explanation(e: Explanation, *, limit: int = 12) -> str:
    what = f"parameter {e.parameter} (node {e.node})" if e.parameter else f"node {e.node}: {e.op}"
    out = [f"{what}" + (f" at {e.location}" if e.location and not e.parameter else "")]
    if e.producers:
        out.append("  inputs from: " + ", ".join(f"{n} as {s}" for n, s in e.producers))
    if e.consumers:
        shown = e.consumers[:8]
        more = f", ... {len(e.consumers) - 8} more" if len(e.consumers) > 8 else ""
        out.append("  consumed by: " + ", ".join(f"{n} (takes {s})" for n, s in shown) + more)
    n = len(e.candidates)
    if e.stage:
        out.append(f"  pipelined: priced as its stage's ILP priced it, one microbatch on the submesh {e.stage} "
                   "(a parameter's gradient sync and update run once a step, after the microbatches)")
        out.append(f"{n} candidate strateg{'y' if n == 1 else 'ies'}, each priced with its neighbours as planned "
                   "(compute fwd+bwd; resharding fwd+bwd on its edges, a parameter's gradient sync its share "
                   "of the step's buckets):")
    else:
        out.append(f"{n} candidate strateg{'y' if n == 1 else 'ies'}, each priced with its neighbours as planned "
                   "(compute fwd+bwd and, for a parameter, its optimizer update; resharding fwd+bwd on its edges, "
                   "gradient sync at full time, though the plan may hide it under backward compute):")
    rows = []
    shown = e.candidates[:limit]
    if not any(c.chosen for c in shown):
        shown = shown[:-1] + [e.chosen]
    rank = {id(c): i + 1 for i, c in enumerate(e.candidates)}
    for c in shown:
        rows.append(("*" if c.chosen else "", rank[id(c)], c.strategy, fmt_s(c.total_s), fmt_s(c.compute_s),
                     fmt_s(c.comm_in_s), fmt_s(c.comm_out_s),
                     fmt_bytes(c.memory_bytes) + (" (over budget)" if c.over_budget else "")))
    head = ("", "#", "strategy", "total", "compute", "comm in", "comm out", "memory/device")
    cells = [head] + [tuple(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    for r in cells:
        out.append("  " + "  ".join(x.rjust(w) if i in (1, 3, 4, 5, 6, 7) else x.ljust(w)
                                    for i, (x, w) in enumerate(zip(r, widths))).rstrip())
    if n > len(shown):
        out.append(f"  ... {n - len(shown)} more (--limit)")

    ch, nxt = e.chosen, e.runner_up
    out.append("")
    out.append(f"chosen: {ch.strategy}  total {fmt_s(ch.total_s)}")
    if ch.reading:
        out.append(f"  {ch.reading}")
    for t in ch.transfers:
        out.append(f"  {t}")
    if not ch.transfers:
        out.append("  no collectives on its edges")
    if e.grad_sync and any(t.phase == "backward" and t.direction == "out" for t in ch.transfers):
        total, exposed, overlap = e.grad_sync
        if not overlap:
            out.append(f"  gradient sync: after backward (this cluster does not overlap them); the step's "
                       f"{fmt_s(total)} of them all exposed")
        else:
            left = (f"{fmt_s(exposed)} exposed (the first layers' syncs, made last, have the least backward "
                    "left to hide under)") if exposed else "all hidden"
            out.append(f"  gradient sync: under the backward still to come; the step's {fmt_s(total)} of them "
                       f"{left}")
    if e.prefetch and any(t.phase == "forward" and t.direction == "out" and t.kind == "all_gather"
                          for t in ch.transfers):
        total, exposed, overlap = e.prefetch
        if not overlap:
            out.append("  forward gather (ZeRO-3): started where the module before it is gathered, but this cluster "
                       "does not overlap collectives with compute: priced whole")
        else:
            out.append(f"  forward gather (ZeRO-3): started where the module before it is gathered, under the compute "
                       f"in between; the step's {fmt_s(total)} of them {fmt_s(exposed)} exposed (the first "
                       "module's waits whole)")
    if nxt is None:
        out.append("it is the only candidate")
        return "\n".join(out)
    gap = nxt.total_s - ch.total_s
    if gap > 0:
        rel = f" ({gap / ch.total_s:.0%})" if ch.total_s else ""
        out.append(f"next best: {nxt.strategy} costs {fmt_s(gap)} more{rel}: total {fmt_s(nxt.total_s)}")
    elif gap == 0:
        out.append(f"next best: {nxt.strategy} costs the same here ({fmt_s(nxt.total_s)}); the solver "
                   "picked one of equals")
    else:
        why = ("it needs more memory than the budget allows" if nxt.over_budget else
               "the chosen one saves elsewhere: nodes of one layer class share their strategy, or the solver "
               "stopped within its optimality gap")
        out.append(f"cheaper here: {nxt.strategy} by {fmt_s(-gap)}; {why}")
    if nxt.reading:
        out.append(f"  {nxt.reading}")
    for t in nxt.transfers:
        out.append(f"  {t}")
    if nxt.compute_s != ch.compute_s:
        out.append(f"  compute {fmt_s(nxt.compute_s)} instead of {fmt_s(ch.compute_s)}")
    if nxt.memory_bytes != ch.memory_bytes:
        out.append(f"  memory {fmt_bytes(nxt.memory_bytes)} instead of {fmt_bytes(ch.memory_bytes)} per device")
    return "\n".join(out)


def explain(plan: Plan, target: str, *, graph=None, source: str | None = None, limit: int = 12) -> str:
    """Why ``target`` (a node name, parameter fqn or module path) got its strategy, as text."""
    return format_explanation(explain_node(plan, target, graph=graph, source=source), limit=limit)


def explain_over(plan: Plan, over: dict, *, source: str | None = None, dims: dict | None = None,
                 tolerance: float | None = None) -> str:
    """``autopar explain PLAN --over batch=1..4096``: the pieces over those sizes
    and why they change. A dynamic plan that covers them answers from its own
    pieces; otherwise the plan's model (``source``, or the one the plan names)
    is compiled for them with the plan's mesh, cluster and options."""
    from autopar.compiler import compile as compile_plan
    from autopar.dynamic.explain import describe
    from autopar.dynamic.planfile import Dynamic
    from autopar.dynamic.symbols import SymbolRange
    from autopar.runtime import load_factory

    wanted = {n: SymbolRange(n, *((v[0], v[1], v[2]) if len(v) == 3 else (v[0], v[1], 1))) for n, v in over.items()}
    if plan.dynamic is not None:
        have = {s.name: s for s in Dynamic(plan).symbols}
        if set(wanted) <= set(have) and all(have[n].lo <= w.lo and w.hi <= have[n].hi for n, w in wanted.items()):
            return describe(plan, over={n: (w.lo, w.hi) for n, w in wanted.items()})
        dims = dims or {s.name: [list(d) for d in s.dims] for s in have.values() if s.name in wanted}
        tolerance = tolerance if tolerance is not None else plan.dynamic.get("search", {}).get("tolerance")
    source = source or plan.model.get("source")
    if not source or not os.path.exists(source.rsplit(":", 1)[0]):
        raise PlanError(f"to explain {', '.join(map(str, wanted.values()))} the plan's model is compiled for those "
                        f"sizes, but the plan names {source!r}, which is not found from {os.getcwd()}: pass "
                        "--source FILE.py:FACTORY")
    model, inputs, loss_fn = load_factory(source)
    sv, pred = plan.solver, plan.predicted
    new = compile_plan(model, inputs, mesh=plan.mesh, cluster=plan.cluster, loss_fn=loss_fn,
                       memory=sv.get("memory_budget_bytes"), optimizer=pred.get("optimizer", "adamw"),
                       precision=pred.get("precision", "fp32"), relative_gap=sv.get("relative_gap", 1e-4),
                       opt_level=sv.get("opt_level", 1), time_limit_s=sv.get("time_limit_s", 60.0), source=source,
                       dynamic={n: (w.lo, w.hi, w.step) for n, w in wanted.items()}, dims=dims,
                       **({"tolerance": tolerance} if tolerance is not None else {}))
    covered = ", ".join(str(s) for s in Dynamic(plan).symbols) if plan.dynamic else "one size"
    return (f"the plan covers {covered}: {source} compiled for {', '.join(map(str, wanted.values()))} with the "
            f"plan's mesh {plan.mesh}, cluster {plan.cluster.get('name')} and options\n" + describe(new))


def explain_main(argv=None) -> int:
    """``autopar explain plan.json NODE_OR_PARAM [--source FILE.py:FACTORY] [--limit N]``."""
    ap = argparse.ArgumentParser(prog="autopar explain",
                                 description="Why a node or parameter got its strategy: every candidate priced "
                                             "with its neighbours as planned")
    ap.add_argument("plan")
    ap.add_argument("target", nargs="?", help="node name (autopar show --all), parameter fqn, or module path with "
                                               "one op")
    ap.add_argument("--source", help="FILE.py:FACTORY of the model, if not the one the plan names")
    ap.add_argument("--limit", type=int, default=12, help="candidates to list (default 12)")
    ap.add_argument("--over", action="append", metavar="NAME=LOW..HIGH[:STEP]",
                    help="the plan's pieces over a range of sizes and why they change (repeatable; compiles the "
                         "model for the range where the plan does not cover it)")
    ap.add_argument("--dims", action="append", metavar="NAME=INPUT.DIM,...", help="with --over: the input dims a "
                                                                                    "symbol names (as compile's)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        if args.over:
            from autopar.dynamic.symbols import parse_dims, parse_range
            over = dict(parse_range(t) for t in args.over)
            dims = dict(parse_dims(t) for t in args.dims or []) or None
            print(explain_over(Plan.load(args.plan), over, source=args.source, dims=dims))
            return 0
        if args.target is None:
            raise AutoparError("say what to explain: a node or parameter (autopar explain PLAN NODE), or the "
                               "pieces over a range of sizes (autopar explain PLAN --over batch=1..4096)")
        print(explain(Plan.load(args.plan), args.target, source=args.source, limit=args.limit))
    except AutoparError as e:
        print(f"autopar: error: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["explain", "explain_node", "explain_over", "format_explanation", "explain_main", "Explanation",
           "Candidate"]
