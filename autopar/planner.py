"""The flat (intra-operator) planner on a mesh: the whole of it in one screen.

    capture -> enumerate strategies -> price -> solve the ILP -> plan

``autopar.compile`` (autopar/compiler.py) calls it for a plan without a
pipeline; the pipeline search (autopar/pipeline/) calls it for the plan it
compares its pipelines with, and builds on ``build_plan`` and
``placeholders``. It imports nothing of either.
"""
from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
import warnings
from dataclasses import dataclass, replace

from torch import nn
from torch.distributed.tensor import Replicate, Shard

from autopar.capture import capture
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import Collective
from autopar.cost_models.graph_costs import (
    CostContext, SharedReshards, backward_working_set, bucket_bytes, edge_memory, edge_moves,
    gradient_transient, memory_breakdown, needs_grad, node_compute, op_moves,
    gather_transient, gathers, host_bytes, optimizer_time, produced, replays, saves_input, step_temporaries,
)
from autopar.errors import AutoparError, InfeasibleError
from autopar.ir import Graph, NodeKind
from autopar.mesh import parse_mesh
from autopar.passes.layer_classes import deeper_ends, layer_classes, layer_lists, layer_of, repeated_layers
from autopar.passes.enumerate import enumerate_strategies
from autopar.passes.recompute import MODES, NONE, Recomputation, recomputation
from autopar.passes.strategy import fmt_spec, local_shape
from autopar.plan import NodePlan, Plan
from autopar.timeline import GatherWindow, SyncWindow, Timeline, first_consumers
from autopar.forks import in_parallel
from autopar.solver import memory_bound, solve, time_limit_error

log = logging.getLogger("autopar")


def plan_flat(model: nn.Module, example_inputs, *, mesh, cluster, loss_fn=None, memory: float | None = None,
              optimizer: str = "adamw", precision: str = "fp32", recompute: str = "auto", opt_level: int = 1,
              time_limit_s: float = 60.0, relative_gap: float = 1e-4, solver: str = "HIGHS",
              source: str | None = None, parameter_placements: dict | None = None,
              cluster_layers: bool | None = None, deterministic: bool = False, cache: str | None = None,
              offload: bool = True, graph: Graph | None = None) -> Plan:
    """Plan ``model`` for ``mesh`` on ``cluster`` without a pipeline
    (``autopar.compile`` says what each argument means). The time limit
    bounds the whole of it, capture included. ``graph``: the step captured
    already (autopar/dynamic specializes one per size it plans), planned
    instead of capturing ``model``."""
    phases = _Phases()
    deadline = phases.start + time_limit_s  # the whole compile's, capture included
    with phases("capture"):
        mesh, cluster = parse_mesh(mesh), get_cluster(cluster)
        if graph is None:
            example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
            graph = capture(model, example_inputs, loss_fn)
    if cache is not None:
        from autopar import plancache
        key = plancache.cache_key(graph.fingerprint(), mesh, cluster, dict(
            memory=memory, optimizer=optimizer, precision=precision, recompute=recompute, opt_level=opt_level,
            time_limit_s=time_limit_s, relative_gap=relative_gap, solver=solver, source=source,
            parameter_placements=parameter_placements, cluster_layers=cluster_layers,
            deterministic=deterministic, offload=offload))
        hit = plancache.load(cache, key)
        if hit is not None:
            if not deterministic:
                hit.solver["cache"] = "hit"
            return hit
    problem = prepare(graph, mesh, cluster, memory=memory, optimizer=optimizer, precision=precision,
                      opt_level=opt_level, parameter_placements=parameter_placements, cluster_layers=cluster_layers,
                      offload=offload, phases=phases)
    solved = problem.solve(recompute=recompute, deadline=deadline, relative_gap=relative_gap, solver=solver,
                           phases=phases)
    solution, rc, budget = solved.solution, solved.rc, problem.budget
    with phases("plan"):
        plan = build_plan(graph, solved.chosen, problem.strategies, problem.ctx, mesh, solution, source, rc)
        if solved.out_of_time is not None:
            if plan.predicted["peak_memory_bytes"] > budget:
                raise solved.out_of_time
            plan.solver["objective"] = plan.predicted["step_time_s"]
    plan.fallbacks = [f.to_json() for f in problem.fallbacks]
    plan.warnings = problem.notes + [f.describe() for f in problem.fallbacks]
    plan.recompute = {"mode": rc.mode, "layers": rc.paths,
                      **({"regions": [list(r) for r in rc.regions]} if rc.mode == "selective" else {}),
                      "candidates": solution.extra.pop("recompute_candidates")}
    plan.solver.update(opt_level=opt_level, clustered=problem.clustered, relative_gap=relative_gap,
                       memory_budget_bytes=budget, time_limit_s=time_limit_s,
                       stopped_early=solution.status != "OPTIMAL")
    if solution.status != "OPTIMAL":
        plan.warnings.append(_stopped_early(solution, time_limit_s))
    plan.predicted["optimizer"] = optimizer
    if deterministic:
        plan.solver["wall_s"] = None
    else:
        plan.solver["timings"] = phases.seconds
    if cache is not None:
        plancache.store(cache, key, plan)
        if not deterministic:
            plan.solver["cache"] = "miss"
    return plan


@dataclass
class Problem:
    """A captured graph on a (sub)mesh, ready to solve (``prepare``)."""

    graph: Graph
    mesh: object
    strategies: dict
    fallbacks: list
    notes: list
    """Warnings for the plan (divisibility, the cluster's caveat, recompute options left out)."""
    classes: "_Classes"
    pinned: dict
    ctx: CostContext
    budget: float | None
    clustered: bool
    stage: bool
    opt_level: int

    def solve(self, *, recompute: str = "auto", deadline: float, relative_gap: float = 1e-4, solver: str = "HIGHS",
              phases=None) -> "Solved":
        """An ILP per recomputation option, the fastest plan that fits, by
        ``deadline`` (time.perf_counter()). Where the solver has no plan by
        then, the replicated plan (``Solved.out_of_time`` says so)."""
        phases = phases if phases is not None else _Phases()
        with phases("solve"):
            try:
                if time.perf_counter() >= deadline:  # capture and the strategies took the whole limit
                    raise time_limit_error(0.0, "capture and enumerating the strategies took it all")
                solution, rc = _solve_with_recompute(
                    self.graph, self.strategies, self.ctx, "none" if self.stage else recompute, budget=self.budget,
                    classes=self.classes, partial=self.opt_level == 2, deadline=deadline, relative_gap=relative_gap,
                    backend=solver, pinned=self.pinned, notes=self.notes, optimizer_step=not self.stage)
            except InfeasibleError as e:
                if e.status != "TIME LIMIT" or self.stage:
                    raise
                return Solved(self, _replicated(self.graph, self.strategies, self.pinned,
                                                time.perf_counter() - phases.start), NONE, e)
        return Solved(self, solution, rc)


@dataclass
class Solved:
    """A problem and its solution: what ``build_plan`` and the pipeline's
    stage pricing read."""

    problem: Problem
    solution: object
    rc: Recomputation = NONE
    out_of_time: InfeasibleError | None = None
    """Set where the solver had no plan by the deadline: ``solution`` is then the replicated plan."""

    @property
    def chosen(self) -> dict:
        strategies = self.problem.strategies
        return {name: strategies[name][i] for name, i in self.solution.choice.items()}


def prepare(graph: Graph, mesh, cluster, *, memory: float | None = None, optimizer: str = "adamw",
            precision: str = "fp32", opt_level: int = 1, parameter_placements: dict | None = None,
            cluster_layers: bool | None = None, offload: bool = True, stage: bool = False, phases=None) -> Problem:
    """The flat planner's steps before the solve, on a captured graph and a
    (sub)mesh: enumerate strategies, share ILP variables between repeated
    layers, pin parameters, make the cost context.

    ``stage``: ``graph`` is a pipeline stage's microbatch graph
    (autopar/pipeline/): no memory row (the stage search checks memory per
    stage), no ZeRO-3 or offload choices (stages keep gathered parameters
    until backward and optimizer state on the device), gradient syncs not
    hidden under backward and no optimizer step in the objective (the stage
    search prices both once per step), no recomputation (the stage search
    chooses it), and every class of repeated layers sharing variables (no
    position-dependent cost is left to peel for)."""
    phases = phases if phases is not None else _Phases()
    mesh, cluster = parse_mesh(mesh), get_cluster(cluster)
    with phases("strategies"):
        strategies, fallbacks = enumerate_strategies(graph, mesh.shape)
        if stage:
            strategies = {name: [s for s in ss if not (s.regather or s.offload)] for name, ss in strategies.items()}
        elif not (offload and cluster.host is not None):  # no offload twins in the ILP at all
            strategies = {name: [s for s in ss if not s.offload] for name, ss in strategies.items()}
        notes = [] if stage else _divisibility_warnings(graph, strategies, mesh) + _cluster_caveat(cluster)
    if stage:
        cluster = replace(cluster, overlap_grad_sync=False)
    ctx = CostContext.make(mesh.shape, cluster, optimizer, precision, offload and not stage, stage=stage)
    budget = None if stage else memory if memory is not None else cluster.device.memory
    with phases("cluster"):
        if opt_level not in (1, 2):
            raise AutoparError(f"opt_level {opt_level!r} is not 1 (fast: clustered layers) or 2 (wider search)")
        if cluster_layers is None:
            cluster_layers = stage or opt_level == 1 or len(graph.nodes) > O2_MAX_UNCLUSTERED_NODES
        layers = repeated_layers(graph) if cluster_layers else []
        if not stage and (budget is None or memory_bound(graph, strategies, ctx) <= budget):
            layers = [c for c in layers if len(c) > SOLVED_ALONE]  # memory cannot bind: see SOLVED_ALONE
        classes = _Classes(graph, layers)
        pinned = _pins(graph, strategies, parameter_placements or {}, classes(classes.first))
    return Problem(graph, mesh, strategies, fallbacks, notes, classes, pinned, ctx, budget, bool(cluster_layers),
                   stage, opt_level)


PEEL_TIME_FACTOR, PEEL_MIN_S = 10.0, 5.0
"""A solve with layer instances peeled off the classes' ends gets at most
this many times the clustered solve's wall time, and at least these seconds
(both within the compile's time limit); it starts only with PEEL_MIN_S and
its build time (the last build's, scaled by its nodes) left. A compile-time
policy, from what the peeled solves took on this 2-core machine
(benchmarks/compile_scale.py and
the GPT models of tests/test_planner.py): 1-10x the clustered solve without a
binding memory budget (GPT-3 175B on 1024 GPUs: 6.6 s clustered, 20 s
peeled); under a binding one, HiGHS may need 50x, and the clustered plan
stands."""

SOLVED_ALONE = 4
"""Where memory cannot bind (solver.memory_bound under the budget), a class
of this many repeated layers or fewer is not clustered: every layer is
solved on its own from the start. Its peel (``deeper_ends``) would solve it
layer by layer at the first refinement, and the clustered solve before that
costs more than it saves (the README demo's two blocks: 9.8 s clustered, then
28.1 s layer by layer, on this machine). Under a budget that may bind, the
clustered solve comes first as before: the unclustered model with its memory
rows can take HiGHS 50x longer (tests/test_memory.py's GPT)."""

O2_MAX_UNCLUSTERED_NODES = 3000
"""-O2 solves every node separately up to this graph size (a few seconds of HiGHS
on this 2-core machine for a 2-D mesh); larger graphs stay clustered."""


class _Phases:
    """Times the compiler's named phases; says what it is doing once a compile
    has taken more than a couple of seconds (or always, with logging at INFO)."""

    def __init__(self):
        self.start = time.perf_counter()
        self.seconds: dict = {}

    @contextlib.contextmanager
    def __call__(self, name: str):
        t = time.perf_counter()
        if t - self.start > 2.0 or log.isEnabledFor(logging.INFO):
            print(f"autopar: {name} ... ({t - self.start:.1f} s so far)", file=sys.stderr, flush=True)
        yield
        self.seconds[f"{name}_s"] = time.perf_counter() - t


RECOMPUTE = ("auto", *MODES)


def _replicated(graph: Graph, strategies: dict, pinned: dict, wall_s: float):
    """The plan when the solver has none by the time limit: every node
    replicated where it can be (pinned parameters as pinned), as on one
    device; the compile says so and prices it."""
    from autopar.solver import Solution
    choice = {}
    for name, options in strategies.items():
        flat = [i for i, s in enumerate(options) if not s.regather and not s.offload and all(
            isinstance(p, Replicate) for spec in (*s.inputs, s.output) for p in spec)]
        choice[name] = pinned.get(name, flat[0] if flat else 0)
    return Solution(choice, "TIME LIMIT", math.nan, wall_s, 0, 0, 0.0,
                    {"gap": None, "recompute_candidates": [], "fallback": "replicated: no plan from the solver"})


def _stopped_early(solution, time_limit_s: float) -> str:
    """The warning for a plan the solver did not prove optimal in the time it had."""
    if solution.status == "TIME LIMIT":
        msg = (f"the solver found no plan within the compile's time limit of {time_limit_s:g} s: the plan "
               "runs every op replicated, as on one device; a longer time_limit_s (autopar compile "
               "--time-limit) lets the solver parallelize it")
        warnings.warn("autopar: " + msg, stacklevel=3)
        return msg
    msg = (f"the solver stopped at the compile's time limit of {time_limit_s:g} s (status {solution.status}): "
           f"the plan is the best found, within {solution.extra['gap']:.2%} of the best bound, not proven "
           "optimal; a longer time_limit_s (autopar compile --time-limit) may find a faster one")
    warnings.warn("autopar: " + msg, stacklevel=3)
    return msg


def _solve_with_recompute(graph, strategies, ctx, mode: str, *, budget, classes, partial: bool = False,
                          notes: list, deadline: float, **options) -> tuple:
    """Solve once per recomputation option and keep the fastest plan that fits.

    Options (passes/recompute.py): none; selective (in every numbered layer,
    the pieces between parameter uses that free memory more cheaply than the
    whole layer would, Korthikanti et al. 2022); full recomputation of every
    layer (Chen et al. 2016); with ``partial`` also full recomputation of the
    first half of each layer list. Every solve ends by ``deadline`` (time.
    perf_counter()), the compile's time limit. Returns the solution and its
    Recomputation.
    Under "auto", an option the model's layers cannot take is left out with a
    warning, appended to ``notes``."""
    if mode not in RECOMPUTE:
        raise AutoparError(f"recompute {mode!r} is not one of {RECOMPUTE}")
    lists = layer_lists(graph)
    half = {(lst, i) for lst, idx in lists.items() for i in idx[: len(idx) // 2]}
    wanted = ("none", "selective", "full") if mode == "auto" else (mode,)
    asked = [(m, None) for m in wanted]
    if partial and mode == "auto" and half:
        asked.append(("partial", half))
    choices = {}
    for m, layers in asked:
        try:
            choices[m] = recomputation(graph, m, layers, ctx=ctx)
        except AutoparError as e:
            if mode != "auto":
                raise
            msg = f"recompute {m!r} is not an option for this model; the plan is chosen without it: {e}"
            warnings.warn("autopar: " + msg, stacklevel=3)
            notes.append(msg)
    seen, tried = set(), []
    for name, rc in choices.items():  # an option that names the same regions as an earlier one is not solved twice
        if rc.regions in seen:
            continue
        seen.add(rc.regions)
        tried.append((name, rc))
    def solve_one(rc):
        """Solve with each class of repeated layers sharing one set of
        variables. The one cost that depends on a layer's position is the
        gradient sync window (timeline.SyncWindow: the first layer's backward
        runs last, with the least compute left to hide its sync): where the
        window binds (the optimum with sync free leaves some exposed, so the
        solver priced it), solve again with instances peeled off
        the classes' ends, deeper while that pays more than the solver's
        relative gap and time is left. A peeled solve that finds nothing in
        its time leaves the best plan so far."""
        ends, best, solves, cap = classes.first, None, 0, math.inf
        while True:
            left = min(deadline - time.perf_counter(), cap)
            try:
                sol = solve(graph, strategies, ctx, memory_budget=budget, classes=classes(ends), recomputed=rc,
                            **{**options, "time_limit_s": left})
            except InfeasibleError as e:  # peeling only adds freedom: only the first solve can be infeasible
                if best is None:
                    return e
                log.info("layer classes: no plan from solve %d (%s)", solves + 1, e)
                break
            solves += 1
            if best is None:  # a refinement is bounded by the clustered solve's time
                cap = max(PEEL_MIN_S, PEEL_TIME_FACTOR * sol.wall_s)
            gain = best[0].objective_s - sol.objective_s if best else math.inf
            if gain > 0:
                best = (sol, ends)
            deeper = deeper_ends(classes.layers, ends, sol.choice)
            tolerance = options["relative_gap"] * sol.objective_s
            # a peeled model has more nodes to build than the last: what is left must cover that too
            grows = len(set(classes(deeper).values())) / len(set(classes(ends).values()))
            needed = PEEL_MIN_S + grows * sol.build_s
            if deeper == ends or gain <= tolerance or deadline - time.perf_counter() < needed \
                    or (solves == 1 and sol.extra["window_exposed_s"] <= tolerance):
                break
            log.info("layer classes: solve %d gave %.4f ms in %.1f s; peeling the ends to %s", solves,
                     sol.objective_s * 1e3, sol.wall_s, deeper)
            ends = deeper
        best[0].extra["layer_classes"] = classes.summary(best[1], solves)
        return best[0]

    def settles(rc, sol) -> bool:
        """Without recomputation, memory never binds: recomputing only adds time."""
        return mode == "auto" and rc is NONE and not isinstance(sol, InfeasibleError) \
            and sol.extra.get("memory_never_binds", False)

    # The first option alone (it may settle the search), then the others at
    # once where cores allow.
    results = [solve_one(tried[0][1])]
    if len(tried) > 1 and not settles(tried[0][1], results[0]):
        if time.perf_counter() < deadline:
            results += in_parallel(solve_one, [rc for _, rc in tried[1:]])
        else:  # the time limit is spent: the other options are not tried
            results += [InfeasibleError(f"recompute {n!r} not solved: the compile's time limit was spent",
                                        status="TIME LIMIT") for n, _ in tried[1:]]
    best, errors, candidates = None, [], []
    for k, ((name, rc), sol) in enumerate(zip(tried, results)):
        label = _label(name, rc)
        if isinstance(sol, InfeasibleError):
            errors.append(sol)
            candidates.append({"recompute": label, "status": sol.status})
            continue
        candidates.append({"recompute": label, "status": sol.status,
                           "objective": sol.objective_s, "memory_bytes": sol.memory_bytes})
        if best is None or sol.objective_s < best[0].objective_s:
            best = (sol, rc)
        if settles(rc, sol):
            candidates += [{"recompute": _label(n, r), "status": "SKIPPED (memory never binds)"}
                           for n, r in tried[k + 1:]]
        sol.extra.pop("memory_never_binds", None)
    if best is None:
        raise min(errors, key=lambda e: e.needed_bytes if e.needed_bytes is not None else float("inf"))
    sol, rc = best
    sol.extra["recompute_candidates"] = candidates
    return sol, rc


class _Classes:
    """The representatives the ILP shares variables by: each class of
    repeated layers (passes/layer_classes.py) sharing one set to begin with
    (``first``), with instances peeled off its ends as ``deeper_ends`` says;
    a tied weight has one placement under all its names."""

    def __init__(self, graph: Graph, layers: list):
        self.graph, self.layers = graph, layers
        self.first = tuple((0, 0) for _ in layers)

    def __call__(self, ends) -> dict:
        rep = layer_classes(self.graph, ends, self.layers)
        for alias, first in self.graph.tied.items():
            rep[alias] = rep[first]
        return rep

    def summary(self, ends, solves: int) -> list:
        """Per class, for the plan: its layers, and how many at each end were solved on their own."""
        out = []
        for instances, (front, back) in zip(self.layers, ends):
            names = [".".join(map(str, layer_of(self.graph.nodes[i[0]]))) for i in instances]
            out.append({"layers": names, "own_front": front, "own_back": back,
                        "shared": len(instances) - front - back, "solves": solves})
        return out


def _label(name: str, rc) -> str:
    if name == "partial":
        return f"full in {len(rc.layers)} layers"
    if name == "selective" and rc.regions:
        return f"selective ({len(rc.regions)} regions in {len(rc.layers)} layers)"
    return name


def _pins(graph: Graph, strategies: dict, placements: dict, classes: dict) -> dict:
    """node -> pinned strategy index; layers that share variables must agree."""
    pins, shared = {}, {}
    for fqn, spec in placements.items():
        if fqn not in graph.params:
            raise AutoparError(f"cannot pin {fqn!r}: the model has no such parameter")
        name = graph.params[fqn]
        spec = list(spec)
        offload = bool(spec) and spec[-1] == "offload"  # optimizer state on the host
        spec = spec[:-1] if offload else spec
        regather = bool(spec) and spec[-1] == "regather"  # ZeRO-3: gathered copies not kept for backward
        text = "".join(spec[:-1] if regather else spec)
        for i, s in enumerate(strategies[name]):
            if fmt_spec(s.output) == text and s.regather == regather and s.offload == offload:
                rep = classes[name]
                if shared.get(rep, i) != i:
                    raise AutoparError(f"cannot pin {fqn} to {text}: it shares its layer class's placement "
                                       "(compile with cluster_layers=False to pin layers differently)")
                shared[rep] = pins[name] = i
                break
        else:
            valid = [fmt_spec(s.output) + " regather" * s.regather + " offload" * s.offload for s in strategies[name]]
            raise AutoparError(f"cannot pin {fqn} to {' '.join(spec + ['offload'] * offload)}: valid placements for "
                               f"it are {valid} (a trailing 'regather' asks for ZeRO-3: shards gathered again in "
                               "backward; then 'offload' for its optimizer state in host memory)")
    return pins


def _cluster_caveat(cluster) -> list[str]:
    """What the cluster description says its numbers get wrong (Cluster.caveat)."""
    if not cluster.caveat:
        return []
    msg = f"cluster {cluster.name}: {cluster.caveat}"
    warnings.warn("autopar: " + msg, stacklevel=3)
    return [msg]


def _divisibility_warnings(graph: Graph, strategies: dict, mesh) -> list[str]:
    """Parameters and inputs that no mesh axis can shard: they stay replicated."""
    notes = []
    for node in graph.nodes.values():
        if node.kind not in (NodeKind.PARAM, NodeKind.INPUT) or not node.out.shape:
            continue
        if any(s.splits(a) for s in strategies[node.name] for a in range(mesh.ndim)):
            continue
        if all(size == 1 for size in mesh.shape):
            continue
        msg = (f"{node.fqn} of shape {list(node.out.shape)}: no dimension divides any mesh axis "
               f"({mesh}); it stays replicated. Sizes that are multiples of an axis size can be sharded")
        warnings.warn("autopar: " + msg, stacklevel=3)
        notes.append(msg)
    return notes


@dataclass
class EdgeCost:
    """What one edge of a chosen plan costs: the edge into input ``index`` of
    its consumer from ``src``."""

    src: str
    index: int
    fwd: list
    """Forward moves paid here (none where another consumer's reshard of the same producer serves it)."""
    bwd: list
    """Backward moves paid here: the gradient back to the producer's placement."""
    again: list
    """Forward moves run again in backward (a recomputed consumer, a regathered parameter)."""
    held: float
    """Bytes of a resharded copy this edge adds to what is kept for backward."""
    gather_transient: float
    """For a parameter gathered here: its full gradient alive until reduced (graph_costs.gather_transient)."""
    gathers: bool
    """Whether the forward moves all-gather (a parameter held sharded, used whole: ZeRO)."""


@dataclass
class NodeCost:
    """What one node of a chosen plan costs, with its input edges: the one
    accounting that the plan's totals (``build_plan``) and the pipeline's
    per-layer costs (autopar/pipeline/pricing.py) sum, as the ILP prices it."""

    name: str
    strategy: object
    fwd_s: float
    bwd_s: float
    """Backward compute, with the forward again where the node is recomputed."""
    parts: dict
    """Memory (graph_costs.memory_breakdown) other than activations: parameters, gradients, optimizer, inputs."""
    activations: float
    """Bytes kept for backward, made again in backward instead where recomputed (``dropped``)."""
    dropped: bool
    working: float
    """Bytes alive for a moment during its backward: its gradients and its inputs' gradients resharded."""
    edges: list
    own_fwd: list
    """Collectives inside the op (graph_costs.op_moves: batch norm's statistics over a split batch, the
    balanced causal attention's exchanges), forward..."""
    own_bwd: list
    """... backward ..."""
    own_again: list
    """... and forward again in backward where recomputed."""


def node_costs(graph: Graph, chosen: dict, ctx: CostContext, rc: Recomputation = NONE) -> list:
    """Every node's NodeCost under the chosen strategies, in program order."""
    grad = needs_grad(graph)
    kept_share, read = rc.kept(graph)
    reshards = SharedReshards(len(ctx.mesh_shape))
    out = []
    for node in graph.nodes.values():
        s = chosen[node.name]
        f, b = node_compute(node, s, ctx, node.name in grad)
        recomputed = node.name in rc.nodes
        if recomputed:
            b += f  # the forward runs again in backward
        own_fwd, own_bwd = op_moves(node, s, ctx, node.name in grad)  # collectives inside the op
        parts = memory_breakdown(node, s, ctx, kept_share.get(node.name, 0.0))
        acts = parts.pop("activations", 0.0)
        working = backward_working_set(graph, node, s, ctx, grad) if node.kind is NodeKind.OP and node.name in grad \
            else 0.0
        edges = []
        for idx, src in enumerate(node.inputs):
            (src_spec, meta), regather = produced(graph, src, node, chosen[src]), chosen[src].regather
            backward = node.name in grad and src in grad
            fwd, bwd = edge_moves(src_spec, s, idx, meta, ctx, backward, bucket_bytes(graph, src, regather, ctx))
            replayed = fwd
            working += gradient_transient(bwd, src_spec, s, idx, meta, ctx)
            kept = node.name in grad and saves_input(node)
            held = 0.0 if regather else edge_memory(src_spec, s.inputs[idx], meta, ctx, kept, src in read)
            held = reshards.keeps(node, idx, src, src_spec, s, backward, held)
            if not reshards.pays(node, idx, src, s, backward):
                fwd, bwd = [], []  # the first consumer's reshard serves this one
            param = graph.nodes[src].kind is NodeKind.PARAM
            again = replayed if replays(regather, recomputed, node.name in grad) else []
            edges.append(EdgeCost(src, idx, fwd, bwd, again, held,
                                  gather_transient(fwd, s.inputs[idx], meta, ctx, regather, backward) if param else 0.0,
                                  param and gathers(fwd)))
        out.append(NodeCost(node.name, s, f, b, parts, acts, rc.drops(node.name), working, edges, own_fwd, own_bwd,
                            own_fwd if recomputed else []))
    return out


def build_plan(graph: Graph, chosen: dict, strategies: dict, ctx: CostContext, mesh, solution,
               source: str | None, rc: Recomputation = NONE) -> Plan:
    """The Plan of the chosen strategies: nodes, collectives, parameters, and
    the predicted totals, summed from ``node_costs``."""
    grad = needs_grad(graph)
    timeline, first_use, param_ws = Timeline(graph, rc), first_consumers(graph), {}
    window, gathers, redo = SyncWindow(graph), GatherWindow(graph), rc.nodes
    nodes, collectives = [], []
    gathered = set()  # parameters whose consumers all-gather them (ZeRO-2/3 style)
    compute = ctx.cluster.device.step_overhead  # the runtime's fixed cost per step, then every node's
    comm = sync_s = 0.0
    memory = {"parameters": 0.0, "gradients": 0.0, "optimizer": 0.0, "activations": 0.0, "inputs": 0.0,
              "buffers": 0.0}
    ms = mesh.shape
    for cost in node_costs(graph, chosen, ctx, rc):
        node, s = graph.nodes[cost.name], cost.strategy
        compute += cost.fwd_s + cost.bwd_s
        for phase, moves in (("forward", cost.own_fwd), ("backward", cost.own_bwd), ("recompute", cost.own_again)):
            for m in moves:  # collectives inside the op
                comm += m.seconds
                collectives.append({"kind": m.kind.value, "phase": phase,
                                    "mesh_axes": [mesh.names[a] for a in m.axes or (m.axis,)],
                                    "bytes": m.nbytes, "seconds": m.seconds, "node": node.name,
                                    "producer": node.name, "tensor": node.name, "gradient_sync": False})
        window.compute(node.name, None, cost.bwd_s)
        gathers.compute(node.name, None, cost.fwd_s)
        timeline.activation(node.name, None, cost.activations)
        mem = sum(cost.parts.values()) + (0.0 if cost.dropped else cost.activations)
        for k, v in cost.parts.items():
            memory[k] += v
        nodes.append(NodePlan(node.name, node.op_name, node.fqn, list(node.inputs),
                              [fmt_spec(x) for x in s.inputs], fmt_spec(s.output), cost.fwd_s + cost.bwd_s, mem,
                              len(strategies[node.name]), [fmt_spec(x) for x in s.items or ()]))
        for edge in cost.edges:
            src = edge.src
            timeline.copy(first_use[src], None, edge.held)  # made at the producer's first use, as the ILP counts it
            if not cost.dropped:
                nodes[-1].memory_bytes += edge.held
            # a regathered parameter's gather at its first use, outside recomputed layers, is prefetched
            # (hidden only where the cluster runs collectives under compute)
            ahead = ctx.cluster.overlap_grad_sync and graph.nodes[src].kind is NodeKind.PARAM \
                and first_use[src] == node.name and node.name not in redo
            if graph.nodes[src].kind is NodeKind.PARAM:
                param_ws[src] = max(param_ws.get(src, 0.0), edge.gather_transient)
                if edge.gathers:
                    gathered.add(src)
                if ahead and any(st.regather for st in strategies[src]):
                    gathers.point(node.name)  # where the ILP may have placed one
            for phase, moves in (("forward", edge.fwd), ("backward", edge.bwd), ("recompute", edge.again)):
                for m in moves:
                    if phase == "forward" and ahead and chosen[src].regather and all(
                            x.kind is Collective.ALL_GATHER for x in edge.fwd):
                        gathers.gather(node.name, None, m.seconds)
                    else:
                        comm += m.seconds
                    if phase == "backward" and graph.nodes[src].kind is NodeKind.PARAM:
                        sync_s += m.seconds
                        window.sync(node.name, None, m.seconds, ctx.links[m.axis].levels)
                    collectives.append({
                        "kind": m.kind.value, "phase": phase, "mesh_axes": [mesh.names[m.axis]],
                        "bytes": m.nbytes, "seconds": m.seconds, "node": node.name, "producer": src,
                        "tensor": graph.nodes[src].fqn if graph.nodes[src].kind is NodeKind.PARAM else src,
                        "gradient_sync": phase == "backward" and graph.nodes[src].kind is NodeKind.PARAM,
                    })
        if cost.working:
            timeline.working_set(node.name, {None: cost.working})
    for src, nbytes in param_ws.items():
        timeline.working_set(first_use[src], {None: nbytes})
    memory["activations"], memory["buffers"] = timeline.peak()
    params = {}
    for fqn, ph in graph.params.items():
        spec = chosen[ph].output
        shape = graph.nodes[ph].out.shape
        params[fqn] = {"placements": [fmt_spec((p,)) for p in spec], "shape": list(shape),
                       "local_shape": list(local_shape(shape, spec, ms)), "dtype": str(graph.nodes[ph].out.dtype),
                       **zero_stage(spec, ph in gathered, chosen[ph].regather, ms),
                       **({"offload": True} if chosen[ph].offload else {})}
    inputs = []
    for node in graph.nodes.values():
        if node.kind is NodeKind.INPUT:
            spec = chosen[node.name].output
            inputs.append({"name": node.name, "placements": [fmt_spec((p,)) for p in spec],
                           "shape": list(node.out.shape), "dtype": str(node.out.dtype),
                           "local_shape": list(local_shape(node.out.shape, spec, ms))})
    total_flops = _model_flops(graph, grad)
    # gradient sync under the backward compute left to run, where the cluster overlaps them
    exposed_sync = window.exposed() if ctx.cluster.overlap_grad_sync else sync_s
    prefetched = sum(sum(g.values()) for g, _ in gathers.points())  # ZeRO-3's gathers in forward
    prefetched_exposed = gathers.exposed()
    comm += prefetched_exposed
    step = compute + comm - sync_s + exposed_sync
    # Activations: those alive at the op whose backward needs the most with
    # its working set (autopar/timeline.py); gradients build up in backward
    # as activations are freed, and the optimizer step adds its temporaries.
    step_temp = sum(step_temporaries(n, chosen[n.name], ctx) for n in graph.nodes.values())
    optimizer_s = sum(optimizer_time(n, chosen[n.name], ctx) for n in graph.nodes.values())
    step += optimizer_s
    peak = memory["parameters"] + memory["optimizer"] + memory["inputs"] + max(
        memory["activations"] + memory["buffers"], memory["gradients"] + step_temp)
    predicted = {
        "step_time_s": step, "compute_s": compute, "comm_s": comm - sync_s + exposed_sync, "bubble_s": 0.0,
        "optimizer_s": optimizer_s, "grad_sync_s": sync_s, "grad_sync_exposed_s": exposed_sync,
        "prefetched_gather_s": prefetched, "prefetched_gather_exposed_s": prefetched_exposed,
        "peak_memory_bytes": peak, "memory": memory,
        "memory_capacity_bytes": ctx.cluster.device.memory,
        **_host_memory(graph, chosen, ctx),
        "model_flops": total_flops,
        "mfu": total_flops / (step * mesh.size * ctx.cluster.device.flops(ctx.precision)) if step > 0 else 0.0,
        "precision": ctx.precision,
    }
    topology = [{"name": n, "size": a.size, "intra_node": a.intra, "inter_node": a.inter,
                 "level": "inter-node" if a.intra == 1 and a.inter > 1 else
                          ("hierarchical" if a.inter > 1 else "intra-node")}
                for n, a in zip(mesh.names, ctx.links)]
    model = {"source": source, "fingerprint": graph.fingerprint(), "has_loss": graph.has_loss,
             "training": graph.training,
             "placeholders": placeholders(graph), "out_spec": graph.out_spec}
    solver = {"status": solution.status, "objective": solution.objective_s, "wall_s": solution.wall_s,
              "variables": solution.variables, "constraints": solution.constraints, **solution.extra}
    return Plan(mesh, ctx.cluster.to_json(), topology, model, params, inputs, nodes, collectives,
                predicted, solver)


def _host_memory(graph: Graph, chosen: dict, ctx: CostContext) -> dict:
    """Host memory per device the plan's offloaded optimizer state takes, and
    each device's share of its node's host memory (absent where nothing is
    offloaded)."""
    held = sum(host_bytes(n, chosen[n.name], ctx) for n in graph.nodes.values())
    if not held:
        return {}
    host = ctx.cluster.host
    return {"host_memory_bytes": held,
            "host_capacity_bytes": host.memory / ctx.cluster.devices_per_node if host is not None else None}


def zero_stage(spec: tuple, gathered: bool, regather: bool, mesh_shape: tuple) -> dict:
    """How a parameter is held, in ZeRO's terms (Rajbhandari et al. 2020):
    stage 2 when it is stored sharded and a consumer gathers the full copy and
    keeps it until backward, 3 when backward gathers it again instead, 0 when
    it is stored replicated on a mesh axis of size > 1 (plain data parallelism
    there: a gradient all-reduce), none when tensor parallelism alone shards
    it. Stage 1 (sharded optimizer state, replicated gradients) is not a
    separate choice: without gradient accumulation stage 2 moves the same
    bytes and holds less."""
    if gathered:
        return {"zero_stage": 3 if regather else 2, "regather": regather}
    replicated = any(not isinstance(p, Shard) and size > 1 for p, size in zip(spec, mesh_shape))
    return {"zero_stage": 0 if replicated else None, "regather": False}


def placeholders(graph: Graph) -> list:
    """The program's arguments in order: ("param", fqn), ("buffer", fqn) or ("input", index)."""
    out = []
    for n in graph.nodes.values():
        if n.kind is NodeKind.PARAM:
            out.append(["param", n.fqn])
        elif n.kind is NodeKind.BUFFER:
            out.append(["buffer", n.fqn])
        elif n.kind is NodeKind.INPUT:
            out.append(["input", n.input_index])
    return out


def _model_flops(graph: Graph, grad: set) -> float:
    from autopar.cost_models.graph_costs import op_flops
    from autopar.passes.rules import get_rule
    total = 0.0
    for n in graph.nodes.values():
        if n.kind is NodeKind.OP and n.info is not None:
            rule = get_rule(n.target)
            if rule is not None and rule.matmul:
                total += op_flops(n) * (3 if n.name in grad else 1)
    return total


__all__ = ["plan_flat", "prepare", "Problem", "Solved", "node_costs", "build_plan", "zero_stage", "placeholders"]
