"""The ILP: one strategy per node, a resharding choice per edge, a memory budget.

Variables: x[n, s] (node n runs strategy s) and, for every edge whose two ends
both have a choice, y[e, p, k] (producer emits spec p, consumer wants key k =
its input spec and the gradient spec that flows back). Flow constraints tie y
to x on both sides, so the products x[u]·x[v] are linear. (Where memory
cannot bind, an edge whose only cost is its producer's shared reshards gets
rows that ask for them instead: ``_ILP._demand``.) The objective is the
step time: compute (forward + backward), every resharding forward and
backward, and the optimizer step; on clusters that overlap gradient
synchronisation with backward, only the sync that the backward compute
left to run cannot hide is paid (timeline.SyncWindow). The memory rows bound
each device's bytes at each op of backward (timeline.Timeline).
Solved as a MIP through OR-tools (HiGHS by default; SCIP, CBC or CP-SAT on
request). x are binary; y may be continuous: with integral x the flow
constraints force them to 0/1. The objective is in microseconds.
"""
from __future__ import annotations

import contextlib
import math
import operator
import os
import sys
import time
from collections import Counter
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from autopar.cost_models.collectives import Collective
from autopar.cost_models.graph_costs import (
    CostContext, backward_working_set, bucket_bytes, edge_memory, edge_moves, gradient_transient,
    host_bytes, memory_breakdown, needs_grad, step_temporaries, node_compute, node_memory, op_moves, optimizer_time,
    param_transient, produced, replays, reshard_key, saves_input, seconds, shares_reshard,
)
from autopar.errors import InfeasibleError
from autopar.forks import Background
from autopar.ir import Graph, NodeKind
from autopar.passes.recompute import NONE, Recomputation
from autopar.passes.strategy import shard_factor
from autopar.cost_models.resharding import reads_in_place
from autopar.timeline import GatherWindow, SyncWindow, Timeline, add as _add, first_consumers

US = 1e6  # objective unit: microseconds
BACKENDS = ("HIGHS", "SCIP", "CBC", "CP_SAT")


@contextlib.contextmanager
def _quiet_stdout():
    """HiGHS prints a banner from C++ straight to fd 1; keep the CLI's output clean."""
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)


@dataclass
class Solution:
    choice: dict  # node name -> strategy index
    status: str
    objective_s: float
    wall_s: float
    variables: int
    constraints: int
    memory_bytes: float
    extra: dict = field(default_factory=dict)
    build_s: float = 0.0
    """Of ``wall_s``, the seconds building the model (a wall time: not in the plan)."""


def solve(graph: Graph, strategies: dict, ctx: CostContext, *, memory_budget: float | None = None,
          time_limit_s: float = 60.0, pinned: dict | None = None, backend: str = "HIGHS",
          relative_gap: float = 1e-4, classes: dict | None = None, recomputed: Recomputation = NONE,
          optimizer_step: bool = True) -> Solution:
    """``classes`` maps a node to the representative whose variables it shares
    (passes/layer_classes.py); its costs and memory add onto the representative's.
    The regions ``recomputed`` names keep only their inputs for backward and
    run their forward twice; their activations are alive again only during
    their own backward. ``optimizer_step`` False leaves the optimizer update
    out of the objective (a pipeline stage's graph is one microbatch; the
    update runs once a step)."""
    t0 = time.perf_counter()
    if backend not in BACKENDS:
        raise ValueError(f"solver backend {backend!r} is not one of {BACKENDS}")

    most = memory_bound(graph, strategies, ctx, recomputed) if memory_budget is not None else math.inf

    def build(follow_edges: bool):
        ilp = _ILP(graph, strategies, ctx, classes, recomputed, backend, deadline=t0 + time_limit_s,
                   memory_binds=memory_budget is not None and most > memory_budget)
        if not follow_edges:
            ilp.follow_edges = False
        reps = {ilp.rep[name]: i for name, i in (pinned or {}).items()}
        ilp.choose_strategies(reps, optimizer_step)
        ilp.working_sets()
        early = ilp.prune_dominated(memory_budget, reps, most) if ilp.prune_early else {}
        ilp.reshard_edges()
        ilp.gather_rows()
        return ilp, reps, {**early, **ilp.prune_dominated(memory_budget, reps)}

    try:
        ilp, pinned, pruned = build(_ILP.follow_edges)
        if ilp.memory_binds and ilp.followed and ilp.most > memory_budget:
            # Under a budget that may bind, the pairs into followers are not dominated: where a reshard
            # runs changes what is held (a budget sweep lost 3.5% to them): the full model
            ilp, pinned, pruned = build(False)
        # where no plan can exceed the budget (``most``), its rows cannot bind: left out
        bounded = ilp.memory_binds and ilp.most > memory_budget
        rows = ilp.budget_rows(memory_budget) if bounded else []
        ilp.host_rows()
        built = time.perf_counter() - t0
        left = lambda: time_limit_s - (time.perf_counter() - t0)  # noqa: E731  the limit covers building too
        # A solve takes at least about as long as building its model did, whatever its time limit (HiGHS's
        # MIP setup alone: 2.1 s for the README demo's model, built in 2.5 s): not started with less left.
        if left() < SOLVE_AFTER_BUILD * built:
            raise _OutOfTime()
    except _OutOfTime:
        raise time_limit_error(
            time_limit_s, "it was still being built, or there was too little time left to solve it") from None
    ilp.min_solve_s = SOLVE_AFTER_BUILD * built
    try:
        result, status, params = ilp.solve(left(), relative_gap)
        if result is not None and ilp.overlap:
            result = ilp.price_exposed_sync(result, params, left(), relative_gap)
    finally:
        if ilp.rival is not None:  # not needed: the first solve's plan hides its sync (or it has no plan)
            ilp.rival.stop()
    wall = time.perf_counter() - t0
    if result is None:
        if status == pywraplp.Solver.INFEASIBLE and memory_budget is not None:
            need = ilp.least_memory(rows, params, left())
            raise _infeasible(graph, strategies, ctx, ilp.grad, memory_budget, recomputed, need)
        name = _NAMES.get(status, str(status))
        if status != pywraplp.Solver.INFEASIBLE and (wall >= 0.9 * time_limit_s or ilp.out_of_time):
            raise time_limit_error(time_limit_s, f"solver status {name}, stopped after {wall:.1f} s without a plan "
                                                 "or a proof that none exists")
        raise InfeasibleError(f"the ILP found no plan: solver status {name}", status=name)
    chosen, used, value, bound, status_name = result
    choice = {name: chosen[ilp.rep[name]] for name in graph.nodes}
    model = ilp.model
    if ilp.followed:
        pruned["dominated reshards into followers (y variables)"] = ilp.followed
    if ilp.demanded:
        pruned["pairs of edges that only share reshards (y variables)"] = ilp.demanded
    return Solution(choice, status_name, value, wall, model.NumVariables(), model.NumConstraints(), float(used),
                    {"best_bound_s": bound, "gap": (value - bound) / value if value > 0 else 0.0,
                     "memory_never_binds": memory_budget is None or ilp.most <= memory_budget, "pruned": pruned,
                     "backend": backend, "window_exposed_s": ilp.first_exposed_s,
                     "solved_nodes": len(ilp.count), "solved_as_lp": ilp.by_lp,
                     "clustered_nodes": len(graph.nodes) - len(ilp.count)}, build_s=built)


def memory_bound(graph: Graph, strategies: dict, ctx: CostContext, recomputed: Recomputation = NONE) -> float:
    """An upper bound of the most memory any plan could take, from the nodes
    alone (no ILP): each node's largest choice, every edge keeping a copy of
    its whole tensor twice (its own and a shared reshard's), and the largest
    working set with every input's gradient resharded at twice its whole size.
    Under a budget above it, memory cannot bind."""
    grad, (kept_share, _) = needs_grad(graph), recomputed.kept(graph)
    held = late = edges = transient = 0.0
    for node in graph.nodes.values():
        options = [s for s in strategies[node.name] if ctx.can_offload or not s.offload]
        sides = [_sides(node, s, ctx, kept_share.get(node.name, 0.0)) for s in options]
        held += max(a + b for a, b, _ in sides)
        late += max(c for _, _, c in sides)
        inputs = sum(ctx.tensor_bytes(graph.nodes[src].outputs[0]) for src in node.inputs)
        edges += 2 * inputs
        if node.name in grad:
            ws = max(param_transient(node, s, ctx) if node.kind is NodeKind.PARAM
                     else backward_working_set(graph, node, s, ctx, grad) for s in options)
            transient = max(transient, ws + 2 * inputs)
    return max(held + edges + transient, late)


def time_limit_error(left_s: float, why: str) -> InfeasibleError:
    """The error of an ILP left without a plan by the ``left_s`` seconds it
    had of the compile's time limit, and ``why``."""
    return InfeasibleError(f"the ILP found no plan within the {max(left_s, 0.0):.3g} s left of the compile's time "
                           f"limit ({why}); raise it with time_limit_s= (autopar compile --time-limit)",
                           status="TIME LIMIT")


class _Both:
    """A key of memory terms where memory cannot bind: an edge's pair is
    chosen (one of ``spec``, its producer's variables, and one of ``key``,
    its consumer's)."""

    __slots__ = ("spec", "key")

    def __init__(self, spec: list, key: list):
        self.spec, self.key = spec, key


class _Any:
    """A key of memory terms where memory cannot bind: some of ``selections``
    (lists of variables or markers) is chosen."""

    __slots__ = ("selections",)

    def __init__(self, selections: list):
        self.selections = selections


def _value(solved):
    """0/1 of a variable or a marker on a solution (``solved``: a variable's value)."""

    def value(v) -> float:
        kind = type(v)
        if kind is _Both:
            return float(chosen(v.spec) and chosen(v.key))
        if kind is _Any:
            return float(any(chosen(terms) for terms in v.selections if terms is not None))
        return 1.0 if solved(v) > 0.5 else 0.0

    def chosen(terms) -> bool:
        return sum(value(v) for v in terms) > 0.5

    return value


class _OutOfTime(Exception):
    """The compile's deadline passed while the ILP was being built, or too little time is left to solve it."""


SOLVE_AFTER_BUILD = 1.0
"""A solve starts only with at least this many times the model's build time
left: HiGHS sets up a MIP (presolve, its first LP) whatever its time limit,
in about the time the model took to build (2.1 s against 2.5 s for the README
demo's 26,500 variables on this 2-core machine), so a solve started later
would end past the compile's time limit."""


_OK = (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE)
_NAMES = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
          pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}


class _ILP:
    """The model under construction, one phase per method (``solve`` runs them).

    Tables map a variable to its coefficient: ``objective`` in microseconds;
    ``always`` the bytes held all step (parameters, optimizer state, inputs),
    ``late`` those plus gradients and the optimizer step's temporaries, ``mem``
    every byte any choice keeps (an upper bound, to tell when memory cannot
    bind). Activations and working sets go on ``timeline`` (autopar/
    timeline.py), gradient syncs and backward compute on ``window``."""

    follow_edges = True
    """Leave out the dominated pairs on edges into followers (``_follower``);
    False builds the full model (tests compare the two optima)."""
    prune_early = True
    """Fix off the dominated ZeRO-3 and offload choices (``prune_dominated``)
    before the edges are built, where ``memory_bound`` shows memory cannot
    bind, so that they get no edge variables; False prunes them only after
    (tests compare the two optima)."""
    demand_edges = True
    """Where memory cannot bind, an edge whose only time is shared reshards
    gets no y pairs (``_demand``); False gives it pairs (tests compare the
    two optima and what the plans hold)."""
    lp_first = True
    """Solve the LP relaxation first and keep it where it is integral
    (``run``); False solves the MIP at once (tests compare the two optima)."""

    def __init__(self, graph: Graph, strategies: dict, ctx: CostContext, classes: dict | None,
                 recomputed: Recomputation, backend: str, deadline: float = math.inf, memory_binds: bool = True):
        self.graph, self.strategies, self.ctx, self.recomputed = graph, strategies, ctx, recomputed
        self.deadline = deadline  # time.perf_counter() by which building must end (the compile's time limit)
        self.grad = needs_grad(graph)
        self.kept_share, self.read = recomputed.kept(graph)
        self.rep = classes or {name: name for name in graph.nodes}
        self.count = Counter(self.rep[name] for name in graph.nodes)
        with _quiet_stdout():
            self.model = pywraplp.Solver.CreateSolver(backend)
        self.model.SuppressOutput()
        self.objective: dict = {}
        self.always: dict = {}
        self.late: dict = {}
        self.mem: dict = {}
        self.host: dict = {}  # x variable -> host bytes (offloaded optimizer state, graph_costs.host_bytes)
        self.timeline = Timeline(graph, recomputed)
        self.first_use = first_consumers(graph)
        # Gradient synchronisation hides under backward compute where the
        # cluster overlaps them (Cluster.overlap_grad_sync): the objective then
        # pays only the exposed part (price_exposed_sync).
        self.overlap = ctx.cluster.overlap_grad_sync
        self.window = SyncWindow(graph)
        self.gathers = GatherWindow(graph)  # ZeRO-3 gathers in forward, prefetched (gather_rows)
        self.x: dict = {}
        self.edge_vars: list = []  # the y variables of each edge
        self.used_vars: list = []  # a shared reshard's variable (used by some edge)
        self.demands: list = []  # (free, groups, needed, producers): sum(free) + the groups' >= sum(needed)
        self.made_from: dict = {}  # a demanded reshard's group -> (its spec's variables, producer instances)
        self.paid: dict = {}  # (shared group, producer instance) -> its variable (settle_shared)
        self.memory_binds = memory_binds  # False where no plan can exceed the budget (``solve``): memory-only
        # terms are then read off the solution (_Both, _Any), not modelled
        self.largest_transient = 0.0
        self.working: dict = {}  # op -> its backward working set's terms (on the timeline)
        self.resharded_grads: dict = {}  # op -> terms of its inputs' gradients resharded in its backward
        self.grad_bound: Counter = Counter()  # op -> the most those can be
        self.most = math.inf
        self.first_exposed_s = 0.0  # the sync left exposed by the optimum with gradient sync free
        self.followed = 0  # the y variables _follower left out
        self.demanded = 0  # the y variables _demand's rows stand for
        self._ids: dict = {}  # spec or reshard key -> its id (_id)
        self._values: list = []  # id -> spec or reshard key
        self._outs: dict = {}  # (producer, item) -> its live strategies' spec ids (_out_ids)
        self._keys: dict = {}  # (consumer, input, backward) -> its live strategies' key ids (_key_ids)
        self._pairs: dict = {}  # (spec id, key id, shape, dtype, backward) -> an edge pair's pricing (_pair)
        self._kept: dict = {}  # (spec id, key id, shape, dtype, saved, read) -> edge_memory (_held)
        self._alive: dict = {}  # node -> its strategies not fixed off (_live)
        self.relaxed: list = []  # the x variables an LP solve left continuous (``run``)
        self.by_lp = 0  # solves the LP relaxation answered (``run``)
        self.min_solve_s = 0.0  # the least time a MIP solve is started with (``SOLVE_AFTER_BUILD``)
        self.out_of_time = False  # a solve not started for lack of time
        self.rival: Background | None = None  # the model with its exposed sync, solved beside (_rival_solve)

    def choose_strategies(self, pinned: dict | None, optimizer_step: bool) -> None:
        """x[n][s]: one binary per strategy of each representative, exactly one
        chosen; each node's compute, optimizer step and memory on its class's
        variables."""
        graph, strategies, ctx, model, kept_share = self.graph, self.strategies, self.ctx, self.model, self.kept_share
        priced = {}
        for name in self.count:
            x = self.x[name] = [model.BoolVar(f"x_{name}_{i}") for i in range(len(strategies[name]))]
            one = model.Constraint(1, 1)
            for v in x:
                one.SetCoefficient(v, 1)
            if pinned and name in pinned:
                for i, v in enumerate(x):
                    if i != pinned[name]:
                        v.SetUb(0)
            elif not ctx.can_offload:  # no host described, or offload forbidden
                for st, v in zip(strategies[name], x):
                    if st.offload:
                        v.SetUb(0)
            node, backward = graph.nodes[name], name in self.grad
            priced[name] = [(node_compute(node, st, ctx, backward), _sides(node, st, ctx, kept_share.get(name, 0.0)),
                             optimizer_time(node, st, ctx) if optimizer_step else 0.0,
                             op_moves(node, st, ctx, backward))
                            for st in strategies[name]]
        for name in graph.nodes:
            r = self.rep[name]
            again = name in self.recomputed.nodes
            own = kept_share.get(name, 0.0) != kept_share.get(r, 0.0)  # a member saved unlike its representative
            for i, ((f, b), (kept_all, acts, later), opt, (mf, mb)) in enumerate(priced[r]):
                if own:
                    kept_all, acts, later = _sides(graph.nodes[name], strategies[r][i], ctx,
                                                   kept_share.get(name, 0.0))
                b += f if again else 0.0  # the forward runs again in backward
                moved = sum(m.seconds for m in mf) * (2 if again else 1) + sum(m.seconds for m in mb)
                v = self.x[r][i]
                _add(self.objective, v, (f + b + opt + moved) * US)
                if self.overlap:  # where collectives run under compute: what hides them
                    self.window.compute(name, v, b * US)
                    self.gathers.compute(name, v, f * US)
                _add(self.always, v, kept_all)
                _add(self.mem, v, kept_all + acts)
                _add(self.late, v, later)
                _add(self.host, v, host_bytes(graph.nodes[name], strategies[r][i], ctx))
                self.timeline.activation(name, v, acts)

    def working_sets(self) -> None:
        """Working sets during backward: an op's gradients (graph_costs.
        backward_working_set) at the op, and a gathered parameter's full
        gradient (graph_costs.gather_transient; an upper bound: a tensor-
        parallel consumer of the shard gathers nothing) at its first consumer."""
        graph, first_use = self.graph, self.first_use
        for name in graph.nodes:
            node, r = graph.nodes[name], self.rep[name]
            at = name if node.kind is NodeKind.OP else first_use.get(name)
            if name not in self.grad or at is None:
                continue
            terms = {self.x[r][i]: (param_transient(node, st, self.ctx) if node.kind is NodeKind.PARAM
                                    else backward_working_set(graph, node, st, self.ctx, self.grad))
                     for i, st in enumerate(self.strategies[r])}
            terms = {v: b for v, b in terms.items() if b}
            self.largest_transient = max(self.largest_transient, *terms.values(), 0.0)
            self.timeline.working_set(at, terms)
            if node.kind is NodeKind.OP:
                self.working[name] = terms  # reshard_edges adds its inputs' gradients' reshards

    def reshard_edges(self) -> None:
        """Each edge's resharding cost on the choices at its two ends (y
        variables where both ends choose), shared reshards paid once."""
        graph, rep, redo, first_use = self.graph, self.rep, self.recomputed.nodes, self.first_use
        # Edges with the same representatives share variables; `replayed`
        # counts the recomputed consumers (their forward collectives run
        # again) and `plain` the others. `keeping`: per edge key, each
        # producer instance and its first consumer (where the timeline places
        # a kept resharded copy).
        edges, replayed = Counter(), Counter()
        producers: dict = {}  # edge key -> the producer instances behind it
        keeping: dict = {}  # edge key -> {producer instance: consumer instance}
        instances: dict = {}  # edge key -> its consumer instances
        for node in graph.nodes.values():
            for idx, src in enumerate(node.inputs):
                key = (rep[src], rep[node.name], idx)
                edges[key] += 1
                producers.setdefault(key, set()).add(src)
                instances.setdefault(key, []).append(node.name)
                keeping.setdefault(key, {}).setdefault(src, first_use[src])
                if node.name in redo:
                    replayed[key] += 1
        # A reshard is shared by every consumer of one producer that wants the
        # same placement (codegen emits it once; the consumers' gradients meet
        # there and go back in one collective): its cost is paid once per
        # producer instance, through a variable above each edge's choice of it.
        shared: dict = {}  # group -> [seconds per instance, producer instances, [(selection, instances
        # behind it)], {copies}]
        fanout = Counter(src for src, _, _ in edges)  # a producer read by one edge alone shares no reshard
        for (src, dst, idx), times in edges.items():
            if time.perf_counter() > self.deadline:
                raise _OutOfTime()
            self._edge(src, dst, idx, times, replayed[src, dst, idx], producers[src, dst, idx],
                       keeping[src, dst, idx], instances[src, dst, idx], shared, fanout[src] == 1)
        for consumer, terms in self.resharded_grads.items():
            ws = self.working.get(consumer)
            bound = max(ws.values(), default=0.0) if ws else 0.0
            if ws:
                for v, b in terms.items():
                    _add(ws, v, b)
            else:
                self.timeline.working_set(consumer, terms)
            self.largest_transient = max(self.largest_transient, bound + self.grad_bound[consumer])
        self.settle_shared(shared)

    def settle_shared(self, shared: dict) -> None:
        """Each shared reshard paid once per producer instance where any of
        its consumers uses it; then each demand's row (``_demand``)."""
        self.paid = paid = {}  # (group key, producer instance) -> its variable
        for group_key, (seconds_us, made, selections, copies) in shared.items():
            # producer instances behind the same edges pay together: with
            # clustered layers, one edge's choice may cover a few of them
            # (the last layer feeding the head) and another's the rest
            if len(made) == 1:  # (unclustered) behind every selection: each one's ``behind`` is not empty
                covers = {tuple(range(len(selections))): list(made)}
            else:
                covers = {}
                for inst in made:
                    covers.setdefault(tuple(k for k, (_, behind) in enumerate(selections) if inst in behind),
                                      []).append(inst)
            for cover, insts in covers.items():
                kept = copies.values() if len(covers) == 1 else [copies[i] for i in insts if i in copies]
                used = self._pay([selections[k][0] for k in cover], seconds_us * len(insts), kept)
                for inst in insts:
                    paid[group_key, inst] = used
        model = self.model
        for free, made, needed, producers in self.demands:  # provided >= needed (_demand)
            for used in {tuple(paid[g, inst] for g in made) for inst in producers}:  # per distinct variables
                row = model.Constraint(0.0, model.infinity())
                for v in free:
                    row.SetCoefficient(v, 1.0)
                for v in used:
                    row.SetCoefficient(v, 1.0)
                for v in needed:
                    row.SetCoefficient(v, -1.0)
        for group_key, (chosen, producers) in self.made_from.items():  # made only from the spec chosen
            for used in {paid[group_key, inst] for inst in producers}:
                row = model.Constraint(-model.infinity(), 0.0)
                row.SetCoefficient(used, 1.0)
                for v in chosen:
                    row.SetCoefficient(v, -1.0)

    def _pay(self, selections: list, cost_us: float, copies):
        """``cost_us`` and the ``copies`` (bytes, where made) once if any of
        ``selections`` (each the variables whose sum says an edge chose
        this reshard; None for a ``_demand``) is chosen: its variable (None
        where paid on a lone selection's own, an ``_Any`` where it holds
        memory only and memory cannot bind)."""
        if not (cost_us or self.memory_binds) and None not in selections:
            # only memory, which cannot bind: read off the solution (a demand's row needs a variable)
            held = _Any(selections)
            for nbytes, consumer in copies:
                self.timeline.copy(consumer, held, nbytes)
            return held
        if len(selections) == 1 and selections[0] is not None:  # one consumer edge: pay on its choice
            (terms,) = selections
            for v in terms:
                _add(self.objective, v, cost_us)
                for nbytes, consumer in copies:
                    _add(self.mem, v, nbytes)
                    self.timeline.copy(consumer, v, nbytes)
            return None
        model = self.model
        used = model.NumVar(0.0, 1.0, "")
        self.used_vars.append(used)
        _add(self.objective, used, cost_us)
        for nbytes, consumer in copies:
            _add(self.mem, used, nbytes)
            self.timeline.copy(consumer, used, nbytes)
        for terms in selections:
            if terms is None:  # a demand: its row comes in settle_shared
                continue
            row = model.Constraint(0.0, model.infinity())  # used >= this edge's choice
            row.SetCoefficient(used, 1.0)
            for v in terms:
                row.SetCoefficient(v, -1.0)
        return used

    def _id(self, value: tuple) -> int:
        """A small int naming a spec or a reshard key, equal for equal ones:
        the edges' tables are keyed by these (placements hash slowly)."""
        i = self._ids.get(value)
        if i is None:
            i = self._ids[value] = len(self._values)
            self._values.append(value)
        return i

    def _out_ids(self, src: str, consumer) -> list:
        """(strategy index, spec id, regather) of each live strategy of
        ``src``, for what its edge into ``consumer`` carries (graph_costs.produced)."""
        item = consumer.item if consumer.target is operator.getitem else -1
        out = self._outs.get((src, item))
        if out is None:
            prod = self.strategies[src]
            out = self._outs[src, item] = [(i, self._id(produced(self.graph, src, consumer, prod[i])[0]),
                                            prod[i].regather) for i in self._live(src)]
        return out

    def _key_ids(self, dst: str, idx: int, backward: bool) -> list:
        """(strategy index, strategy, reshard key id) of each live strategy of ``dst`` for input ``idx``."""
        out = self._keys.get((dst, idx, backward))
        if out is None:
            cons, n_axes = self.strategies[dst], len(self.ctx.mesh_shape)
            out = self._keys[dst, idx, backward] = [(j, cons[j], self._id(reshard_key(idx, cons[j], n_axes, backward)))
                                                    for j in self._live(dst)]
        return out

    def _pair(self, sid: int, kid: int, consumer, idx: int, meta, backward: bool, bucket=None) -> tuple:
        """(forward s, backward s, backward us per link, gradient transient bytes,
        reads in place, whether it moves anything, whether its forward is
        all-gathers alone) of resharding spec ``sid``
        to a consumer's key ``kid``: what the edge costs depends on the
        specs, the key, the tensor and, for a parameter, its bucket alone
        (graph_costs.bucketed), so edges of repeated layers (and other edges
        alike) share one pricing."""
        cache_key = (sid, kid, meta.shape, meta.dtype, backward, bucket)  # tuples compare faster than TensorMeta
        hit = self._pairs.get(cache_key)
        if hit is None:
            spec, key = self._values[sid], self._values[kid]
            f, b = edge_moves(spec, consumer, idx, meta, self.ctx, backward, bucket)
            hit = self._pairs[cache_key] = (seconds(f), seconds(b), _on_links(b, self.ctx),
                                            gradient_transient(b, spec, consumer, idx, meta, self.ctx),
                                            reads_in_place(spec, key[0]), bool(f or b),
                                            bool(f) and all(m.kind is Collective.ALL_GATHER for m in f))
        return hit

    def _held(self, sid: int, kid: int, meta, saved: bool, read: bool) -> float:
        cache_key = (sid, kid, meta.shape, meta.dtype, saved, read)
        held = self._kept.get(cache_key)
        if held is None:
            held = self._kept[cache_key] = edge_memory(self._values[sid], self._values[kid][0], meta, self.ctx,
                                                       saved, read)
        return held

    def _live(self, name: str) -> list:
        """Indices of ``name``'s strategies that a solution may choose (not fixed off)."""
        live = self._alive.get(name)
        if live is None:
            live = self._alive[name] = [i for i, v in enumerate(self.x[name]) if v.ub() > 0]
        return live

    def _edge(self, src, dst, idx, times, replayed, producers, keeping, instances, shared, alone) -> None:
        graph, ctx, x, model = self.graph, self.ctx, self.x, self.model
        prod, cons = self.strategies[src], self.strategies[dst]
        meta = produced(graph, src, graph.nodes[dst], prod[0])[1]
        backward = dst in self.grad and src in self.grad
        out_groups: dict = {}  # (spec id, regather) -> strategies; those fixed off (pinned, pruned) have no pairs
        for i, sid, regather in self._out_ids(src, graph.nodes[dst]):
            out_groups.setdefault((sid, regather), []).append(i)
        in_groups: dict = {}  # reshard key id -> [(strategy index, strategy)]
        for j, s, kid in self._key_ids(dst, idx, backward):
            in_groups.setdefault(kid, []).append((j, s))
        # (p, key) -> (reshard us, forward us replayed, bytes kept, gradient bytes, sync per link, reads in place)
        priced: dict = {}
        saved = dst in self.grad and saves_input(graph.nodes[dst])
        hides = self.overlap and graph.nodes[src].kind is NodeKind.PARAM
        # a regathered parameter's gather at its first use, outside recomputed layers, is prefetched
        # (hidden only where the cluster runs collectives under compute)
        ahead = self.overlap and graph.nodes[src].kind is NodeKind.PARAM and not replayed and all(
            self.first_use.get(graph.nodes[c].inputs[idx]) == c for c in instances)
        plain = times - replayed
        follows = self._follower(src, dst, idx) if len(out_groups) > 1 and len(in_groups) > 1 else None
        most_grad = 0.0
        for p in out_groups:
            spec, regather = p
            bucket = bucket_bytes(graph, src, regather, ctx)
            again = replayed + (plain if replays(regather, False, dst in self.grad) else 0)
            for key, members in in_groups.items():
                if follows and not follows(p, key):
                    self.followed += 1
                    continue
                f, b, on_links, grad_bytes, as_read, _, gathered = self._pair(
                    spec, key, members[0][1], idx, meta, backward, bucket)
                held = 0.0 if regather else self._held(spec, key, meta, saved, src in self.read)
                early = f if ahead and regather and gathered else 0.0  # priced where it is waited for: gather_rows
                priced[p, key] = ((f - early + (0.0 if hides else b)) * US, f * again * US, held, grad_bytes,
                                  on_links if hides else None, as_read, early * US)  # sync: per instance, link -> us
                most_grad = max(most_grad, grad_bytes)
        for consumer in instances:
            self.grad_bound[consumer] += most_grad
        objective, resharded, window = self.objective, self.resharded_grads, self.window
        # a tuple item's reshard is its edge's own (not shared with other consumers): these instances
        item = not shares_reshard(graph.nodes[dst])
        behind_item = {(src, dst, idx, n) for n in range(times)} if item else None

        def charge(terms, p, key):
            """``terms``: the variables whose sum says this edge uses (p, key)."""
            unit, replay, held, grad_bytes, synced, as_read, early = priced[p, key]
            for v in terms:
                if replay:
                    _add(objective, v, replay)
                if early:
                    for consumer in instances:
                        self.gathers.gather(consumer, v, early)
                if grad_bytes:
                    for consumer in instances:
                        _add(resharded.setdefault(consumer, {}), v, grad_bytes)
                if synced:
                    for consumer in instances:
                        for link, us in synced.items():
                            window.sync(consumer, v, us, (link,))
            # A reshard is one group (one per tuple item: not shared), paid
            # once; the tensor kept for backward is its copy, or the
            # producer's own for every consumer that reads it in place.
            if unit or (held and not as_read):
                behind, kept = (behind_item if item else producers), (0.0 if as_read else held)
                if item or alone:  # this edge's choice alone uses the reshard: paid on it, not settled later
                    self._pay([terms], unit * len(behind), [(kept, c) for c in keeping.values()] if kept else ())
                else:
                    join((src, p, key), unit, behind, terms, kept)
            if as_read and held:
                join((src, p, "as read"), 0.0, producers, terms, held)

        merged: dict = {}  # group key -> the most bytes this edge's instances were merged into it with

        def join(group_key, cost_us, behind, terms, nbytes):
            """Add this edge's choice ``terms`` to a shared group: its cost once
            per producer instance (``behind``), and a kept tensor of ``nbytes``
            per producer instance, made at its first consumer. An edge's
            pairs share one ``behind`` and one ``keeping``: merged into a
            group once, again only for more bytes."""
            group = shared.get(group_key)
            if group is None:
                group = shared[group_key] = [cost_us, set(), [], {}]
            group[2].append((terms, behind))
            before = merged.get(group_key)
            if before is None:
                group[1] |= behind
            elif nbytes <= before:
                return
            merged[group_key] = nbytes
            copies = group[3]
            for inst, consumer in keeping.items():
                had = copies.get(inst)
                if had is None:
                    copies[inst] = (nbytes, consumer)
                elif nbytes > had[0]:
                    copies[inst] = (nbytes, had[1])

        if len(out_groups) == 1:  # the producer is fixed: cost depends on the consumer only
            (p0,) = out_groups
            for key, members in in_groups.items():
                charge([x[dst][j] for j, _ in members], p0, key)
            return
        if len(in_groups) == 1:  # the consumer's input is fixed
            (k0,) = in_groups
            for p, members in out_groups.items():
                charge([x[src][i] for i in members], p, k0)
            return
        if self.demand_edges and not (self.memory_binds or item or alone) and not any(
                replay or synced or early for _, replay, _, _, synced, _, early in priced.values()):
            # every cost of this edge is a shared reshard's: no y pairs, the
            # consumer's key asks for a reshard from the producer's spec (``_demand``)
            wanted = {key: [x[dst][j] for j, _ in members] for key, members in in_groups.items()}
            self._demand(src, wanted, out_groups, priced, producers, instances, join)
            self.demanded += len(priced)
            return
        y = {}
        for p, key in priced:
            y[p, key] = model.NumVar(0.0, 1.0, "")
            charge([y[p, key]], p, key)
        self.edge_vars.append(list(y.values()))
        for p, members in out_groups.items():
            row = model.Constraint(0, 0)
            for k in in_groups:
                if (p, k) in y:
                    row.SetCoefficient(y[p, k], 1)
            for i in members:
                row.SetCoefficient(x[src][i], -1)
        for key, members in in_groups.items():
            row = model.Constraint(0, 0)
            for p in out_groups:
                if (p, key) in y:
                    row.SetCoefficient(y[p, key], 1)
            for j, _ in members:
                row.SetCoefficient(x[dst][j], -1)

    def _demand(self, src, wanted: dict, out_groups: dict, priced: dict, producers: set, instances: list,
                join) -> None:
        """An edge whose only time is its shared reshards (no replay, sync or
        prefetch of its own), where memory cannot bind: no y pairs. Where
        its consumer chooses a key (``wanted``: key -> the variables whose
        sum chooses it), some spec of the producer must provide it, at no
        cost or through that reshard's shared variable; and where the
        producer chooses a spec, some key of the consumer must be provided
        by it. A row in ``settle_shared`` keeps each shared variable within
        the producer's choice of its spec. Exact on integral choices (the
        producer's one spec provides the consumer's one key), and about one
        row per spec and per key instead of a y variable and a row per pair.
        What the edge holds (a gradient resharded in backward, a copy that
        moves nothing) counts on ``_Both`` markers, read off the solution
        (``_value``)."""
        by_key = {key: ([], []) for key in wanted}  # key -> (specs providing it free, its reshards' groups)
        for p, members in out_groups.items():
            chosen = [self.x[src][i] for i in members]
            free_keys, made = [], []
            for key, wants in wanted.items():
                if (p, key) not in priced:  # left out by _follower: dominated
                    continue
                unit, _, held, grad_bytes, _, as_read, _ = priced[p, key]
                pair = _Both(chosen, wants) if held or grad_bytes else None
                if grad_bytes:
                    for consumer in instances:
                        _add(self.resharded_grads.setdefault(consumer, {}), pair, grad_bytes)
                if unit:
                    group_key = (src, p, key)
                    join(group_key, unit, producers, None, 0.0 if as_read else held)  # None: a demand's
                    made.append(group_key)
                    by_key[key][1].append(group_key)
                    self.made_from.setdefault(group_key, (chosen, set()))[1].update(producers)  # every edge's
                else:
                    free_keys.extend(wants)
                    by_key[key][0].extend(chosen)
                    if held:  # the copy, or the producer's own tensor read in place, held once
                        join((src, p, "as read" if as_read else (key, "kept")), 0.0, producers, [pair], held)
                if as_read and held and unit:
                    join((src, p, "as read"), 0.0, producers, [pair], held)
            self.demands.append((free_keys, made, chosen, producers))  # the spec's consumer key
        for key, (free, made) in by_key.items():
            self.demands.append((free, made, wanted[key], producers))  # the key's producer spec

    def _follower(self, src: str, dst: str, idx: int):
        """For an edge into a follower, the test a (producer spec, consumer
        key) pair must pass to get a y variable; None where every pair does.

        A follower (Alpa's term: an op that follows its operand) is a
        one-output op that moves the bytes of one input to its output
        unchanged in number and dtype (element-wise unary ops, views,
        transposes) and whose other inputs have no choice. Resharding its
        input from a spec it can run on, before it runs, costs the collective
        that the same reshard of its output after it costs (same bytes, same
        dims moved), and where it leaves the follower a local tensor no
        smaller, no less compute or memory: such a pair is dominated and left
        out (``follow_edges``). Kept: the pairs that move nothing (same spec;
        R -> S slices), those that shrink the follower's input (a Partial
        reduce-scattered before a view runs it on shards), and every pair
        from a spec the follower cannot run on (a Partial into a GELU).
        Under a memory budget that can bind, where the reshard runs changes
        what is held, so ``solve`` builds the full model there.
        Producers that are parameters or inputs keep every pair: their
        reshards are gathers and gradient syncs priced apart (ZeRO stages,
        the sync window). tests/test_solver_reductions.py checks the optimum
        is kept, model by model."""
        if not self.follow_edges:
            return None
        graph = self.graph
        node, producer = graph.nodes[dst], graph.nodes[src]
        if node.kind is not NodeKind.OP or producer.kind is not NodeKind.OP or not shares_reshard(node) \
                or len(node.outputs) != 1:
            return None
        if any(len(self.strategies[self.rep[other]]) > 1 for j, other in enumerate(node.inputs) if j != idx):
            return None
        meta = produced(graph, src, node, self.strategies[src][0])[1]
        if node.out.nbytes != meta.nbytes or node.out.dtype != meta.dtype:
            return None
        ms = self.ctx.mesh_shape
        n_axes, backward = len(ms), dst in self.grad and src in self.grad
        first = {}  # of the strategies a solution may choose
        for _, s, kid in self._key_ids(dst, idx, backward):
            first.setdefault(kid, s)
        # specs by id (equal specs, equal ids: placements compare and hash slowly)
        wanted = {kid: self._id(self._values[kid][0]) for kid in first}
        runs_on = set(wanted.values())
        pieces = {sid: shard_factor(self._values[sid], ms) for sid in runs_on}

        def follows(p, kid) -> bool:
            sid, want = p[0], wanted[kid]
            if want == sid or sid not in runs_on or pieces[want] > pieces[sid]:
                return True
            return not self._pair(sid, kid, first[kid], idx, meta, backward)[5]

        return follows

    def prune_dominated(self, budget: float | None, pinned: dict | None, most: float | None = None) -> dict:
        """Fix off dominated choices before solving: where memory cannot bind,
        a regathered (ZeRO-3) parameter costs what its stage-2 twin costs plus
        one more all-gather in backward, and saves only memory. (Its forward
        gather may hide where the stage-2 one cannot, prefetched
        ``gather_rows``, but by no more than that gather, which the blocking
        one in backward pays again; its bucket's call is shared by fewer
        bytes. Pricing the backward gather hidden too would break this: then
        ZeRO-2 needs its gathers prefetched alike first.) ``most`` is
        the most memory any plan could take (each node's and edge's largest
        choice; computed here once the edges are built, else ``memory_bound``'s
        bound before, so that the pruned choices get no edge variables);
        under the budget, memory never binds."""
        mem, late = self.mem, self.late
        if most is None:
            most = self.most = max(sum(max(mem.get(v, 0.0) for v in vs) for vs in self.x.values())
                                   + sum(max(mem.get(v, 0.0) for v in vs) for vs in self.edge_vars if vs)
                                   + sum(mem.get(v, 0.0) for v in self.used_vars) + self.largest_transient,
                                   sum(max(late.get(v, 0.0) for v in vs) for vs in self.x.values()))
        pruned = {}
        if budget is None or most <= budget:
            count_off = 0
            for name, vs in self.x.items():
                for i, st in enumerate(self.strategies[name]):
                    if (st.regather or st.offload) and not (pinned and pinned.get(name) == i):
                        count_off += vs[i].ub() > 0
                        vs[i].SetUb(0)
            if count_off:
                pruned["regather (ZeRO-3) and offload choices: memory cannot bind"] = count_off
        return pruned

    def host_rows(self) -> list:
        """The host memory row: offloaded state within each device's share of
        its node's host memory."""
        host = self.ctx.cluster.host
        terms = {v: b for v, b in self.host.items() if b}
        if host is None or not terms:
            return []
        mib = 2**20
        row = self.model.Constraint(-self.model.infinity(), host.memory / self.ctx.cluster.devices_per_node / mib)
        for v, b in terms.items():
            row.SetCoefficient(v, b / mib)
        return [row]

    def budget_rows(self, budget: float) -> list:
        return _budget_rows(self.model, self.graph, self.rep, self.timeline, self.always, self.late, budget)

    def solve(self, time_limit_s: float, relative_gap: float) -> tuple:
        """(the solution's snapshot or None, the solver status, its parameters)."""
        model = self.model
        self.obj = obj = model.Objective()
        for v, c in self.objective.items():
            obj.SetCoefficient(v, c)
        obj.SetMinimization()
        params = pywraplp.MPSolverParameters()
        params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
        if self.overlap and self.window.syncs:  # the model with its exposed sync, solved at once beside this one
            self.rival = Background.start(_rival_solve, self, params, time_limit_s)
        status = self.run(params, time_limit_s)
        return (self.snapshot(_NAMES[status]) if status in _OK else None), status, params

    def run(self, params, time_limit_s: float) -> int:
        """Solve the model as it stands: its LP relaxation first, which on
        these models is often integral (each node's strategy whole, as Meta's
        AutoParallel found for its sharding ILP): then that is the optimum, a
        fraction of the MIP's time (the README demo with gradient sync free:
        0.35 s against 1.6 s). Otherwise, the MIP in what time is left. The
        status is the solver's."""
        model, t0 = self.model, time.perf_counter()
        self.integral()
        if not self.lp_first:
            _time_limit(model, time_limit_s)
            with _quiet_stdout():
                return model.Solve(params)
        # every x relaxed, the pruned ones (fixed at 0) too: one integer column left makes HiGHS run its MIP
        # search around the LP (presolve, feasibility jump): 3.2 s against 1.1 s for Llama's 76k columns
        binaries = [v for vs in self.x.values() for v in vs]
        for v in binaries:
            v.SetInteger(False)
        self.relaxed = binaries  # integral again before the model next changes (``integral``)
        _time_limit(model, time_limit_s)
        with _quiet_stdout():
            status = model.Solve(params)
        if status == pywraplp.Solver.OPTIMAL and all(min(v.solution_value(), 1.0 - v.solution_value()) <= 1e-6
                                                    for v in binaries):
            self.by_lp += 1
            return status  # the solution stays readable: the model is left relaxed
        self.integral()
        if status == pywraplp.Solver.INFEASIBLE:
            return status  # the relaxation has no solution: neither has the MIP
        spent = time.perf_counter() - t0
        if time_limit_s - spent < max(spent, self.min_solve_s):  # the MIP costs at least its LP and its setup
            self.out_of_time = True
            return pywraplp.Solver.NOT_SOLVED
        _time_limit(model, time_limit_s - spent)
        with _quiet_stdout():
            return model.Solve(params)

    def integral(self) -> None:
        """The x variables binary again after an LP solve left them relaxed."""
        for v in self.relaxed:
            v.SetInteger(True)
        self.relaxed = []

    def snapshot(self, status_name: str, extra_us: float = 0.0, answer: "_Answer | None" = None) -> tuple:
        """(choices, memory, objective s, bound s, status) of the current
        solution, or of ``answer`` (the rival's: ``_rival_solve``)."""
        solved = answer.value if answer else lambda v: v.solution_value()  # noqa: E731
        chosen = {name: max(range(len(vs)), key=lambda i: solved(vs[i])) for name, vs in self.x.items()}
        value = _value(solved)
        total = lambda table: sum(c * value(v) for v, c in table.items())  # noqa: E731
        used = total(self.always) + max(sum(self.timeline.peak(value)), total(self.late) - total(self.always))
        if answer:
            value_us, bound_us = answer.objective_us, answer.bound_us
        else:
            value_us = self.obj.Value()
            bound_us = value_us if self.relaxed else self.obj.BestBound()  # an integral LP optimum is its own bound
        return chosen, used, (value_us + extra_us) / US, bound_us / US, status_name

    def price_exposed_sync(self, result: tuple, params, left_s: float, relative_gap: float) -> tuple:
        """Solved with gradient sync free. If some of the plan's sync cannot
        hide (timeline.SyncWindow), put the exposed sync into the model
        (``exposed_sync_rows``) and solve it again: its optimum is the
        model's. The first optimum is exact when its sync hides (no plan
        costs less with the exposed part), and its best bound bounds the full
        model too, so when the first plan priced with its exposed sync is
        within ``relative_gap`` of that bound it is an answer as good as the
        solver was asked for and the model is not solved again (a few
        nanoseconds of exposed sync once cost a 177-node model 43 s of
        solving again). If time runs out in the second solve, the better of
        its best plan and the first plan priced with its exposure stands
        (status FEASIBLE). Where a core is free, the second model has been
        solving in a forked process since the first solve began (``_rival_solve``),
        and its answer is taken from there.

        (Before, the window's bounds were added one at a time where the last
        plan was most exposed, each addition solving again from scratch: the
        README demo's unclustered model needed two such bounds, 26.6 s on this
        machine, against 17.8 s with the exposure in the model;
        docs/performance.md.)"""
        window, t0 = self.window, time.perf_counter()
        short, _ = window.most_exposed(lambda v: v.solution_value())
        self.first_exposed_s = short / US
        if short <= 1e-9:
            return result
        chosen, used, value_s, bound_s, status_name = result  # the first plan, priced with its exposed sync
        first = chosen, used, value_s + short / US, bound_s, status_name
        if first[2] - first[3] <= relative_gap * first[2]:
            return first
        first = first[:4] + ("FEASIBLE",)
        rival, self.rival = self.rival, None
        if rival is not None:  # it has been solving this model since the first solve began
            answer = rival.answer(left_s)
            if answer is None:
                return first  # it did not finish in time: the first plan, priced
            self.exposed_sync_rows()  # the model as the rival solved it
            self.by_lp += answer.by_lp
            status, again = answer.status, (self.snapshot(_NAMES[answer.status], answer=answer)
                                            if answer.status in _OK else None)
        else:
            if left_s < self.min_solve_s:
                return first  # no time to solve again: the first plan, priced
            self.exposed_sync_rows()
            status = self.run(params, left_s - (time.perf_counter() - t0))
            again = self.snapshot(_NAMES[status]) if status in _OK else None
        if again is None:
            return first
        if again[2] <= first[2] or status == pywraplp.Solver.OPTIMAL:
            return again
        return first[:3] + (max(first[3], again[3]), "FEASIBLE")

    def exposed_sync_rows(self) -> None:
        """The exposed gradient sync in the objective (timeline.SyncWindow):
        per link, a running sum of the syncs made minus the backward compute
        left, one variable and row per sync point (each term once), and
        ``exposed_sync`` at least every running sum and 0: the largest
        exposure over links and points."""
        model, inf = self.model, self.model.infinity()
        exposed = model.NumVar(0.0, inf, "exposed_sync")
        self.obj.SetCoefficient(exposed, 1.0)
        current = running = None
        for link, syncs, compute in self.window.points():
            if link != current:
                current, running = link, None
            total = model.NumVar(-inf, inf, "")
            row = model.Constraint(0.0, 0.0)  # total = running + syncs - compute
            row.SetCoefficient(total, 1.0)
            if running is not None:
                row.SetCoefficient(running, -1.0)
            for v, c in syncs.items():
                row.SetCoefficient(v, row.GetCoefficient(v) - c)
            for v, c in compute.items():
                row.SetCoefficient(v, row.GetCoefficient(v) + c)
            at_least = model.Constraint(0.0, inf)  # exposed_sync >= total
            at_least.SetCoefficient(exposed, 1.0)
            at_least.SetCoefficient(total, -1.0)
            running = total

    def gather_rows(self) -> None:
        """The ZeRO-3 gathers in forward at the time they are waited for
        (timeline.GatherWindow): the first point's whole, and at each later
        point a variable at least its gathers less the forward compute since
        the point before, and at least 0."""
        model, inf = self.model, self.model.infinity()
        for gathers, compute in self.gathers.points():
            if compute is None:
                for v, c in gathers.items():
                    _add(self.objective, v, c)
                continue
            exposed = model.NumVar(0.0, inf, "")
            _add(self.objective, exposed, 1.0)
            row = model.Constraint(0.0, inf)  # exposed >= gathers - compute
            row.SetCoefficient(exposed, 1.0)
            for v, c in gathers.items():
                row.SetCoefficient(v, row.GetCoefficient(v) - c)
            for v, c in compute.items():
                row.SetCoefficient(v, row.GetCoefficient(v) + c)

    def least_memory(self, rows: list, params, time_limit_s: float) -> float | None:
        """The same model, minimising memory without the budget: the least any
        plan needs (None if the time limit ends it first)."""
        model = self.model
        self.integral()
        _time_limit(model, time_limit_s)
        peak = model.NumVar(0.0, model.infinity(), "peak")
        for row in rows:  # peak >= each row
            row.SetUb(0.0)
            row.SetCoefficient(peak, -1.0)
        self.obj.Clear()
        self.obj.SetCoefficient(peak, 1.0)
        with _quiet_stdout():
            least = model.Solve(params)
        return self.obj.Value() * 2**20 if least in _OK else None


def _time_limit(model, seconds: float) -> None:
    """What is left of the time limit, at least a millisecond (OR-tools reads 0 as no limit)."""
    model.SetTimeLimit(max(1, int(seconds * 1000)))


def _on_links(moves: list, ctx: CostContext) -> dict:
    """Microseconds of ``moves`` on each link they occupy (AxisLinks.levels)."""
    out: dict = {}
    for m in moves:
        for link in ctx.links[m.axis].levels:
            _add(out, link, m.seconds * US)
    return out


def _sides(node, s, ctx: CostContext, kept: float) -> tuple[float, float, float]:
    """A node's bytes: (held all step, activations kept for backward, held +
    gradients + optimizer-step temporaries)."""
    parts = memory_breakdown(node, s, ctx, kept)
    held = parts.get("parameters", 0.0) + parts.get("optimizer", 0.0) + parts.get("inputs", 0.0)
    return held, parts.get("activations", 0.0), held + parts.get("gradients", 0.0) + step_temporaries(node, s, ctx)


def _budget_rows(model, graph: Graph, rep: dict, timeline: Timeline, held: dict, late: dict,
                 budget: float) -> list:
    """Rows saying the plan fits ``budget``, in MiB (well scaled next to the
    objective): held + gradients + step temporaries; and held + activations
    alive + the working set at each op's backward. Activations accumulate in a
    chain of variables (A_k = A_k-1 + what is kept in between), so each byte
    appears once. Of a layer class only its last instance is checked: the
    earlier ones have the same working sets and fewer activations alive."""
    mib = 2.0**20
    last = {}
    for name in graph.nodes:
        last[rep[name]] = name
    wanted = set(last.values())
    rows = []

    def row(terms: dict, *chained) -> None:
        r = model.Constraint(-model.infinity(), budget / mib)
        for v, c in held.items():
            r.SetCoefficient(v, c / mib)
        for v, c in terms.items():
            r.SetCoefficient(v, r.GetCoefficient(v) + c / mib)
        for a in chained:
            r.SetCoefficient(a, 1.0)
        rows.append(r)

    row({v: c - held.get(v, 0.0) for v, c in late.items()})
    previous = None
    for since, region, working in timeline.points(wanted):
        alive = model.NumVar(0.0, model.infinity(), "")
        link = model.Constraint(0.0, 0.0)  # alive - previous - since = 0
        link.SetCoefficient(alive, 1.0)
        if previous is not None:
            link.SetCoefficient(previous, -1.0)
        for v, c in since.items():
            link.SetCoefficient(v, -c / mib)
        previous = alive
        for ws in working or [{}]:
            terms = dict(region)
            for v, c in ws.items():
                terms[v] = terms.get(v, 0.0) + c
            row(terms, alive)
    return rows


def _infeasible(graph, strategies, ctx, grad, budget, recomputed, need: float | None) -> InfeasibleError:
    """The error for a budget no plan fits: the least memory any plan needs
    (``need``, from the ILP minimising memory; else each node at its smallest,
    a lower bound), and the biggest parts."""
    least = {}
    kept_share, _ = recomputed.kept(graph)
    for node in graph.nodes.values():
        if recomputed.drops(node.name):
            least[node.name] = 0.0
            continue
        least[node.name] = min(node_memory(node, s, ctx, kept_share.get(node.name, 0.0))
                               for s in strategies[node.name] if ctx.can_offload or not s.offload)
    need = sum(least.values()) if need is None else need
    top = sorted(least.items(), key=lambda kv: -kv[1])[:5]
    from autopar.units import fmt_bytes
    parts = ", ".join(f"{graph.nodes[n].fqn or n} {fmt_bytes(b)}" for n, b in top)
    return InfeasibleError(
        f"no plan fits in {fmt_bytes(budget)} per device: the smallest plan needs at least "
        f"{fmt_bytes(need)} per device (biggest contributors: {parts}); "
        f"give more memory per device or a larger mesh{_offload_hint(ctx)}",
        needed_bytes=need,
    )


def _offload_hint(ctx) -> str:
    """What an InfeasibleError says about offloading optimizer state."""
    if ctx.can_offload:
        return " (keeping optimizer state in host memory was considered)"
    if ctx.cluster.host is None:
        return (f"; cluster {ctx.cluster.name!r} describes no host memory to offload optimizer state to "
                "(a \"host\" section, docs/clusters.md)")
    return "; offloading optimizer state to the host is off (offload=False, --no-offload): allowing it may fit"


@dataclass(frozen=True)
class _Answer:
    """A rival solve's result: its status, the objective and best bound in
    microseconds, the LP relaxations it kept, and each variable's value."""
    status: int
    objective_us: float
    bound_us: float
    by_lp: int
    values: list

    def value(self, v) -> float:
        return self.values[v.index()]


def _rival_solve(ilp: "_ILP", params, time_limit_s: float) -> _Answer:
    """The model with its exposed gradient sync (``exposed_sync_rows``),
    solved in a forked process (forks.Background) while the first solve
    solves the model with sync free. Where the first optimum leaves sync
    exposed, this second model is the answer (``price_exposed_sync``), and
    it has been solving since the first solve began: the compile waits for
    the slower of the two solves, not for their sum (Llama's 2x2 model:
    1.8 s and 3.5 s). Where the first plan hides its sync, it is stopped.
    The same model is solved either way, so the plan is the one solving them
    one after the other gives."""
    from ortools.linear_solver import linear_solver_pb2
    ilp.rival = None
    ilp.exposed_sync_rows()
    status = ilp.run(params, time_limit_s)
    response = linear_solver_pb2.MPSolutionResponse()
    if status in _OK:
        ilp.model.FillSolutionResponseProto(response)
    objective = ilp.obj.Value() if status in _OK else math.nan
    bound = objective if ilp.relaxed else (ilp.obj.BestBound() if status in _OK else math.nan)
    return _Answer(status, objective, bound, ilp.by_lp, list(response.variable_value))
