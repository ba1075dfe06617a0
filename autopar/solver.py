"""The ILP: one strategy per node, a resharding choice per edge, a memory budget.

Variables: x[n, s] (node n runs strategy s) and, for every edge whose two ends
both have a choice, y[e, p, k] (producer emits spec p, consumer wants key k =
its input spec and the gradient spec that flows back). Flow constraints tie y
to x on both sides, so the products x[u]·x[v] are linear. The objective is the
step time: compute (forward + backward) plus every resharding forward and
backward; the memory constraint bounds each device's bytes.
Solved as a MIP through OR-tools (HiGHS by default; SCIP, CBC or CP-SAT on
request). x are binary; y may be continuous: with integral x the flow
constraints force them to 0/1. The objective is in microseconds.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass, field

from ortools.linear_solver import pywraplp

from autopar.capture import Graph, NodeKind
from autopar.cost_models.graph_costs import (
    CostContext, edge_moves, needs_grad, node_compute, node_memory, seconds, splits,
)
from autopar.cost_models.resharding import grad_spec
from autopar.errors import InfeasibleError

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


def solve(graph: Graph, strategies: dict, ctx: CostContext, *, memory_budget: float | None = None,
          time_limit_s: float = 60.0, pinned: dict | None = None, backend: str = "HIGHS",
          relative_gap: float = 1e-4) -> Solution:
    t0 = time.perf_counter()
    grad = needs_grad(graph)
    if backend not in BACKENDS:
        raise ValueError(f"solver backend {backend!r} is not one of {BACKENDS}")
    with _quiet_stdout():
        model = pywraplp.Solver.CreateSolver(backend)
    model.SuppressOutput()
    x = {}
    objective = []
    mem_terms = []
    n_axes = len(ctx.mesh_shape)
    for node in graph.nodes.values():
        strats = strategies[node.name]
        allowed = range(len(strats))
        if pinned and node.name in pinned:
            allowed = [pinned[node.name]]
        x[node.name] = [model.BoolVar(f"x_{node.name}_{i}") for i in range(len(strats))]
        model.Add(sum(x[node.name]) == 1)
        for i, v in enumerate(x[node.name]):
            if i not in allowed:
                v.SetUb(0)
        backward = node.name in grad
        for i, s in enumerate(strats):
            f, b = node_compute(node, s, ctx, backward)
            c = (f + b) * US
            if c:
                objective.append(c * x[node.name][i])
            m = node_memory(node, s, ctx, backward)
            if m:
                mem_terms.append((m, x[node.name][i]))

    for node in graph.nodes.values():
        cons = strategies[node.name]
        for idx, src in enumerate(node.inputs):
            prod = strategies[src]
            meta = graph.nodes[src].outputs[0]
            backward = node.name in grad and src in grad
            out_groups: dict = {}
            for i, s in enumerate(prod):
                out_groups.setdefault(s.output, []).append(i)
            in_groups: dict = {}
            for j, s in enumerate(cons):
                key = (s.inputs[idx], grad_spec(s.inputs[idx], splits(s, n_axes)) if backward else None)
                in_groups.setdefault(key, []).append((j, s))
            cost = {}
            for p in out_groups:
                for key, members in in_groups.items():
                    f, b = edge_moves(p, members[0][1], idx, meta, ctx, backward)
                    cost[p, key] = (seconds(f) + seconds(b)) * US
            if len(out_groups) == 1 or len(in_groups) == 1:
                # one side is fixed: the edge cost is a function of the other side
                (p0,) = out_groups if len(out_groups) == 1 else (None,)
                if p0 is not None:
                    for key, members in in_groups.items():
                        c = cost[p0, key]
                        if c:
                            objective.extend(c * x[node.name][j] for j, _ in members)
                else:
                    (k0,) = in_groups
                    for p, members in out_groups.items():
                        c = cost[p, k0]
                        if c:
                            objective.extend(c * x[src][i] for i in members)
                continue
            y = {}
            for (p, key), c in cost.items():
                y[p, key] = model.NumVar(0.0, 1.0, f"y_{src}_{node.name}_{idx}_{len(y)}")
                if c:
                    objective.append(c * y[p, key])
            for p, members in out_groups.items():
                model.Add(sum(y[p, k] for k in in_groups) == sum(x[src][i] for i in members))
            for key, members in in_groups.items():
                model.Add(sum(y[p, key] for p in out_groups) == sum(x[node.name][j] for j, _ in members))

    if memory_budget is not None:
        # in MiB so that the row is well scaled next to the objective
        model.Add(sum((c / 2**20) * v for c, v in mem_terms) <= memory_budget / 2**20)
    model.Minimize(sum(objective))
    model.SetTimeLimit(int(time_limit_s * 1000))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, relative_gap)
    with _quiet_stdout():
        status = model.Solve(params)
    wall = time.perf_counter() - t0
    names = {pywraplp.Solver.OPTIMAL: "OPTIMAL", pywraplp.Solver.FEASIBLE: "FEASIBLE",
             pywraplp.Solver.INFEASIBLE: "INFEASIBLE"}
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        if status == pywraplp.Solver.INFEASIBLE and memory_budget is not None:
            raise _infeasible(graph, strategies, ctx, grad, memory_budget)
        raise InfeasibleError(f"the ILP found no plan: solver status {names.get(status, status)}")
    choice = {name: max(range(len(vs)), key=lambda i: vs[i].solution_value()) for name, vs in x.items()}
    mem = sum(c for c, v in mem_terms if v.solution_value() > 0.5)
    return Solution(choice, names[status], model.Objective().Value() / US, wall,
                    model.NumVariables(), model.NumConstraints(), float(mem),
                    {"best_bound_s": model.Objective().BestBound() / US, "backend": backend})


def _infeasible(graph, strategies, ctx, grad, budget) -> InfeasibleError:
    """Smallest memory any plan needs (each node at its smallest), and the biggest parts."""
    least = {}
    for node in graph.nodes.values():
        least[node.name] = min(node_memory(node, s, ctx, node.name in grad) for s in strategies[node.name])
    need = sum(least.values())
    top = sorted(least.items(), key=lambda kv: -kv[1])[:5]
    parts = ", ".join(f"{graph.nodes[n].fqn or n} {b / 2**20:.1f} MiB" for n, b in top)
    return InfeasibleError(
        f"no plan fits in {budget / 2**30:.2f} GiB per device: the smallest plan needs at least "
        f"{need / 2**30:.2f} GiB per device (biggest contributors: {parts}); "
        f"give more memory per device or a larger mesh",
        needed_bytes=need,
    )
