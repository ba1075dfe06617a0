"""Pipeline (inter-operator) parallelism: cut the captured training step into
layers, choose stages, microbatches and schedule, and write the plan's
``pipeline`` section.

    compile_pipelined(model, inputs, mesh="pp=2,tp=2", ...)      the pp axis is given
    compile_pipelined(model, inputs, mesh=1024, ...)              the planner factors the world
                                                                  into pp x dp x tp (or does not pipeline)

The steps, in order:

1. **Layers** (``group_layers``). Every op of the captured graph belongs to a
   layer: its module path truncated at the repeated container (``blocks.3``),
   or the top-level module (``tok``, ``head``); an op called at the top level
   (a residual add, the loss) joins the latest layer among its inputs. Layers
   are ordered by first use, and an op never sits in an earlier layer than its
   inputs, so every cut between layers is a valid stage boundary: the tensors
   crossing it (``Layers.crossing``) are exactly what is sent, including long
   skip connections, which intermediate stages relay. Ops that depend on no
   parameter (``arange``, views of the target) are *floating*: each stage that
   needs them recomputes them, and the user inputs reach every stage directly.
2. **Price** (``profile``). The intra-operator ILP (autopar/solver.py) is solved
   once per stage submesh shape and microbatch size on the whole microbatch
   graph; each layer's cost is the sum over its nodes of compute (forward,
   backward) and activation resharding, its gradient synchronisation (once per
   step), its parameter/optimizer bytes and saved activations. This is an
   approximation: the ILP does not know where the cuts fall (at a cut the
   tensor is made replicated, sent, and resharded on the other side, which
   ``Cut`` prices) and it counts gradient synchronisation once per microbatch.
   Large models with a repeated container are priced on a copy truncated to
   two layers and the block costs are reused for every layer.
3. **Stages** (``partition``). A dynamic program over contiguous layer ranges
   minimises the slowest stage's time per microbatch (compute, resharding,
   point-to-point transfers of the crossing tensors on the pp axis) subject
   to each stage's memory: parameters, gradients and optimizer states plus
   the activations of the microbatches it holds (1F1B: stage s holds
   min(m, p - s), GPipe all m, interleaved a factor 1 + (p-1)/(p v) more);
   with full recomputation a layer keeps only its input and one layer's
   activations are live at a time.
4. **Step time**: (m + (p - 1)/v) x slowest stage (the bubble is (p-1)/m of
   the work, (p-1)/(v m) interleaved) plus the exposed gradient
   synchronisation of the slowest stage.
"""
from __future__ import annotations

import copy
import itertools
import logging
import math
import operator
import time
from dataclasses import dataclass, field, fields, replace
from enum import Enum

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import Replicate

from autopar.capture import Graph, NodeKind, capture
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import Collective, axis_links, collective_time
from autopar.cost_models.graph_costs import (
    CostContext, _dtype_name, edge_moves, needs_grad, node_compute, node_memory, op_flops,
)
from autopar.cost_models.resharding import transitions
from autopar.errors import AutoparError, InfeasibleError
from autopar.mesh import Mesh, parse_mesh
from autopar.passes.enumerate import enumerate_strategies
from autopar.passes.rules import get_rule
from autopar.passes.strategy import fmt_spec, local_shape, parse_spec, shard_factor
from autopar.plan import NodePlan, Plan
from autopar.solver import solve

log = logging.getLogger("autopar")

PP_AXIS = "pp"
"""Name of the pipeline axis in the meshes the planner writes (and looks for)."""
MARGIN = 0.05
"""Pipelining must predict a step at least this much faster than the best
non-pipelined plan to be chosen: a pipeline adds memory imbalance, schedule
complexity and point-to-point traffic the model prices only roughly."""
REPEAT_THRESHOLD = 4
"""Above this many repeated layers the model is priced on a two-layer copy."""
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""Model chunks per device tried for the interleaved schedule."""
MICROBATCH_PER_DP_RANK = (1, 2)
"""Sequences per data-parallel rank per microbatch tried when the planner
factors the world (Megatron-LM uses 1-2, Narayanan et al. SC'21)."""
MAX_MICROBATCH_CANDIDATES = 4


class Schedule(str, Enum):
    GPIPE = "gpipe"
    """All forwards, then all backwards: every stage holds all m microbatches."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward in steady state: stage s holds min(m, p - s) microbatches."""
    INTERLEAVED = "interleaved-1f1b"
    """1F1B over v model chunks per device: the bubble shrinks v times, transfers grow v times."""


def bubble_fraction(schedule, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step relative to its useful work: (p - 1)/m for
    GPipe and 1F1B, (p - 1)/(v m) for interleaved 1F1B (Narayanan et al. SC'21)."""
    schedule = Schedule(schedule)
    if p < 1 or m < 1 or v < 1:
        raise AutoparError(f"bubble_fraction needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    if schedule is Schedule.INTERLEAVED:
        return (p - 1) / (v * m)
    return (p - 1) / m


# --- 1. layers -------------------------------------------------------------------------

@dataclass
class Layers:
    """The captured graph cut into layers, the units stages are made of."""

    names: list
    """Layer module paths in execution order (``tok``, ``blocks.0``, ..., ``head``)."""
    group: dict
    """Anchored node (an op depending on a parameter, or a parameter) -> layer index."""
    floating: set
    """Ops that depend on no parameter: recomputed by every stage that uses them."""
    crossing: list
    """crossing[c]: tensors (node names, topological order) alive across the cut
    before layer c; crossing[0] is empty."""
    forbidden: set
    """Cuts that would separate the users of one parameter (tied weights)."""
    container: str | None = None
    """Module path of the repeated layers (``blocks``), if any."""
    cost_group: dict = field(default_factory=dict)
    """Every node -> the layer its cost is counted in (floating ops: their first user)."""

    @property
    def n(self) -> int:
        return len(self.names)

    def nodes_of(self, graph: Graph, start: int, stop: int) -> list:
        """Node names a stage over layers [start, stop) runs: its anchored ops and
        parameters, and the floating ops they need."""
        own = [name for name, g in self.group.items() if start <= g < stop]
        need = set(own)
        for name in reversed(list(graph.nodes)):
            if name in need or (name == "output" and stop == self.n):
                for src in graph.nodes[name].inputs:
                    if src in self.floating:
                        need.add(src)
        return [name for name in graph.nodes if name in need]


def find_container(graph: Graph) -> str | None:
    """The module list whose children the graph calls most (``blocks``), or None."""
    indices: dict = {}
    for node in graph.nodes.values():
        path = node.fqn if node.kind is NodeKind.OP else ""
        parts = path.split(".") if path else []
        for k, part in enumerate(parts):
            if part.isdigit():
                indices.setdefault(".".join(parts[:k]), set()).add(int(part))
    best = [(len(v), -len(k), k) for k, v in indices.items() if len(v) >= 2 and k]
    return max(best)[2] if best else None


def _key(path: str, container: str | None) -> str | None:
    if not path:
        return None
    parts = path.split(".")
    if container:
        depth = len(container.split("."))
        if path.startswith(container + ".") and len(parts) > depth:
            return ".".join(parts[:depth + 1])
        return ".".join(parts[:depth])
    return parts[0]


def group_layers(graph: Graph) -> Layers:
    """Assign every anchored node to a layer; see the module docstring."""
    container = find_container(graph)
    anchored: dict = {}
    names: list = []
    index: dict = {}
    floating: set = set()
    for node in graph.nodes.values():
        if node.kind is not NodeKind.OP:
            continue
        params = [graph.nodes[s] for s in node.inputs if graph.nodes[s].kind is NodeKind.PARAM]
        deps = [anchored[s] for s in node.inputs if s in anchored]
        if not params and not deps:
            floating.add(node.name)
            continue
        key = _key(node.fqn, container)
        if key is None and params:
            key = _key(params[0].fqn.rpartition(".")[0], container) or params[0].fqn
        own = -1
        if key is not None:
            if key not in index:
                index[key] = len(names)
                names.append(key)
            own = index[key]
        anchored[node.name] = max([own, *deps])
    if not names:
        raise AutoparError("the model has no parameters to place in pipeline stages")
    n = len(names)
    group = dict(anchored)
    forbidden: set = set()
    consumers = graph.consumers()
    for fqn, ph in graph.params.items():
        users = [anchored[c] for c, _ in consumers[ph] if c in anchored]
        if not users:
            continue
        group[ph] = min(users)
        forbidden.update(range(min(users) + 1, max(users) + 1))
    crossing: list = [[] for _ in range(n)]
    for name, g in anchored.items():
        if graph.nodes[name].outputs and len(graph.nodes[name].outputs) > 1:
            continue  # a tuple-valued op: its getitems are what cross
        last = g
        for c, _ in consumers[name]:
            last = max(last, n if c == "output" else anchored.get(c, g))
        for cut in range(g + 1, min(last, n - 1) + 1):
            crossing[cut].append(name)
    cost_group: dict = dict(group)
    for name in reversed(list(graph.nodes)):
        if name in cost_group:
            continue
        users = [cost_group.get(c, n - 1) if c != "output" else n - 1 for c, _ in consumers[name]]
        cost_group[name] = min(users) if users else n - 1
    return Layers(names, group, floating, crossing, forbidden, container, cost_group)


# --- 2. price ---------------------------------------------------------------------------

@dataclass
class LayerCost:
    """One layer for one microbatch on one device of its stage's submesh."""

    name: str
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    comm_s: float = 0.0
    """Activation resharding, forward and backward."""
    sync_s: float = 0.0
    """Gradient synchronisation over the submesh (once per step)."""
    state_bytes: float = 0.0
    """Parameters, gradients and optimizer states."""
    grad_bytes: float = 0.0
    """Local gradient bytes (what data parallelism outside the submesh all-reduces)."""
    act_bytes: float = 0.0
    """Activations saved for backward."""
    flops: float = 0.0
    """Model FLOPs (matmuls, forward and backward) of the whole microbatch."""

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.comm_s


@dataclass
class Cut:
    """The boundary before a layer, for one microbatch."""

    nbytes: float = 0.0
    """Full bytes of the crossing tensors (each device of the sending stage sends them replicated)."""
    held_bytes: float = 0.0
    """Local bytes of the crossing tensors (what a recomputed layer keeps)."""
    to_replicated_s: float = 0.0
    """Making the crossing tensors replicated on the sending submesh (forward)."""
    p2p_fwd_s: float = 0.0
    """Send/recv of the activations on the pp axis."""
    p2p_bwd_s: float = 0.0
    """Send/recv of their gradients."""
    tensors: int = 0


_NUMERIC_LAYER = [f.name for f in fields(LayerCost) if f.name != "name"]
_NUMERIC_CUT = [f.name for f in fields(Cut)]


@dataclass
class Profile:
    """Per-layer costs of one model at one microbatch size on one stage submesh."""

    layers: list  # list[LayerCost]
    cuts: list  # list[Cut]; cuts[c] is the boundary before layer c (cuts[0] unused)
    forbidden: set
    submesh: Mesh
    microbatch: int
    """Sequences per microbatch on this submesh."""
    graph: Graph | None = None
    """The captured microbatch graph (None when priced by repetition)."""
    grouping: Layers | None = None
    chosen: dict | None = None
    """Node name -> Strategy on the submesh (for ``graph``)."""
    strategies: dict | None = None
    solution: object = None
    repeated: tuple | None = None
    """(container, layers in the model, layers captured) when priced on a truncated copy."""
    fallbacks: list = field(default_factory=list)
    dtype: str = "fp32"

    @property
    def names(self) -> list:
        return [lc.name for lc in self.layers]

    def scaled(self, other: "Profile", microbatch: int) -> "Profile":
        """Affine inter/extrapolation in the microbatch size between two profiles
        of the same model and submesh (activations, compute and transfers grow
        with the batch; parameters do not)."""
        if other.microbatch == self.microbatch:
            return self
        k = (microbatch - self.microbatch) / (other.microbatch - self.microbatch)

        def mix(a, b, names):
            kwargs = {n: max(0.0, getattr(a, n) + k * (getattr(b, n) - getattr(a, n))) for n in names}
            return kwargs

        layers = [LayerCost(a.name, **mix(a, b, _NUMERIC_LAYER)) for a, b in zip(self.layers, other.layers)]
        cuts = [Cut(**mix(a, b, _NUMERIC_CUT)) for a, b in zip(self.cuts, other.cuts)]
        return replace(self, layers=layers, cuts=cuts, microbatch=microbatch, graph=None, chosen=None)


def _solve_intra(graph: Graph, submesh: Mesh, cluster, optimizer: str, time_limit_s: float, solver: str):
    """The intra-operator ILP on the stage submesh, with no memory row (memory
    is checked per stage by the pipeline search). Mirrors autopar.compile's steps."""
    strategies, fallbacks = enumerate_strategies(graph, submesh.shape)
    ctx = CostContext.make(submesh.shape, cluster, optimizer)
    solution = solve(graph, strategies, ctx, memory_budget=None, time_limit_s=time_limit_s, backend=solver)
    chosen = {name: strategies[name][i] for name, i in solution.choice.items()}
    return chosen, strategies, solution, ctx, fallbacks


def _price(graph: Graph, layers: Layers, chosen: dict, ctx: CostContext, pp_link) -> tuple[list, list]:
    grad = needs_grad(graph)
    ms = ctx.mesh_shape
    costs = [LayerCost(name) for name in layers.names]
    for node in graph.nodes.values():
        s = chosen[node.name]
        lc = costs[layers.cost_group.get(node.name, layers.n - 1)]
        backward = node.name in grad
        f, b = node_compute(node, s, ctx, backward)
        lc.fwd_s += f
        lc.bwd_s += b
        mem = node_memory(node, s, ctx, backward)
        if node.kind is NodeKind.PARAM:
            lc.state_bytes += mem
            lc.grad_bytes += node.out.nbytes / shard_factor(s.output, ms)
        elif node.kind is NodeKind.OP:
            lc.act_bytes += mem
            rule = get_rule(node.target) if node.info is not None else None
            if rule is not None and rule.matmul:
                lc.flops += op_flops(node) * (3 if backward else 1)
        for idx, src in enumerate(node.inputs):
            meta = graph.nodes[src].outputs[0]
            fwd, bwd = edge_moves(chosen[src].output, s, idx, meta, ctx, backward and src in grad)
            sync = graph.nodes[src].kind is NodeKind.PARAM
            for m in (*fwd, *bwd):
                if sync and m in bwd:
                    lc.sync_s += m.seconds
                else:
                    lc.comm_s += m.seconds
    cuts = [Cut() for _ in range(layers.n)]
    replicated = tuple(Replicate() for _ in ms)
    for c in range(1, layers.n):
        cut = cuts[c]
        for name in layers.crossing[c]:
            spec = chosen[name].output
            meta = graph.nodes[name].out
            cut.tensors += 1
            cut.nbytes += meta.nbytes
            cut.held_bytes += meta.nbytes / shard_factor(spec, ms)
            cut.to_replicated_s += sum(m.seconds for m in transitions(spec, replicated, meta.nbytes, ms, ctx.links))
            t = collective_time(Collective.SEND_RECV, meta.nbytes, pp_link) if pp_link is not None else 0.0
            cut.p2p_fwd_s += t
            if name in grad and meta.dtype.is_floating_point:
                cut.p2p_bwd_s += t
    return costs, cuts


def _microbatch_inputs(example_inputs: tuple, b: int) -> tuple:
    return tuple(x[:b] if isinstance(x, torch.Tensor) else x for x in example_inputs)


def batch_size(example_inputs: tuple) -> int:
    sizes = {x.shape[0] for x in example_inputs if isinstance(x, torch.Tensor) and x.dim() > 0}
    if len(sizes) != 1:
        raise AutoparError(
            f"pipelining splits every input along dim 0 into microbatches; the example inputs have "
            f"dim-0 sizes {sorted(sizes)} (they must all be the batch size)")
    return sizes.pop()


def _repeated_container(model: nn.Module, container: str | None):
    """The container module if its children are structurally identical, else None."""
    if not container:
        return None
    try:
        mod = model.get_submodule(container)
    except AttributeError:
        return None
    if not isinstance(mod, (nn.ModuleList, nn.Sequential)) or len(mod) <= REPEAT_THRESHOLD:
        return None
    shapes = [tuple((n, tuple(p.shape), p.dtype) for n, p in child.named_parameters()) for child in mod]
    types = {type(child) for child in mod}
    if len(types) != 1 or any(s != shapes[0] for s in shapes):
        return None
    return mod


def _truncated(model: nn.Module, path: str, keep: int) -> nn.Module:
    """A shallow copy of ``model`` whose container at ``path`` keeps its first ``keep`` children."""
    parts = path.split(".")
    root = copy.copy(model)
    root._modules = dict(model._modules)
    parent = root
    for name in parts[:-1]:
        child = copy.copy(parent._modules[name])
        child._modules = dict(child._modules)
        parent._modules[name] = child
        parent = child
    container = parent._modules[parts[-1]]
    kept = list(container)[:keep]
    parent._modules[parts[-1]] = nn.Sequential(*kept) if isinstance(container, nn.Sequential) else nn.ModuleList(kept)
    return root


def _expand(costs: list, cuts: list, layers: Layers, total: int) -> tuple[list, list, set]:
    """Layer costs of a model with ``total`` repeated layers from a capture with two."""
    reps = [i for i, name in enumerate(layers.names) if name.startswith(layers.container + ".")]
    if len(reps) != 2 or reps[1] != reps[0] + 1:
        raise AutoparError("repetition pricing expects two consecutive captured layers")
    first, second = reps
    head = list(range(first))
    tail = list(range(second + 1, layers.n))
    out_costs = [costs[i] for i in head]
    out_cuts = [cuts[i] for i in head]
    for k in range(total):
        src = first if k == 0 else second
        out_costs.append(replace(costs[src], name=f"{layers.container}.{k}"))
        out_cuts.append(cuts[src])
    out_costs += [costs[i] for i in tail]
    out_cuts += [cuts[i] for i in tail]
    shift = total - 2
    forbidden = {c if c <= first else c + shift for c in layers.forbidden}
    return out_costs, out_cuts, forbidden


def profile(model: nn.Module, example_inputs: tuple, loss_fn, submesh: Mesh, cluster, *, microbatch: int,
            pp_link=None, optimizer: str = "adamw", time_limit_s: float = 60.0, solver: str = "HIGHS",
            reuse_layers: bool | None = None, graph_cache: dict | None = None) -> Profile:
    """Per-layer costs at ``microbatch`` sequences on ``submesh`` (see the module docstring)."""
    cluster = get_cluster(cluster)
    graph_cache = graph_cache if graph_cache is not None else {}
    key = ("graph", microbatch)
    if key not in graph_cache:
        graph_cache[key] = _capture_for_pricing(model, example_inputs, loss_fn, microbatch, reuse_layers)
    graph, layers, repeated = graph_cache[key]
    chosen, strategies, solution, ctx, fallbacks = _solve_intra(graph, submesh, cluster, optimizer, time_limit_s,
                                                                solver)
    costs, cuts = _price(graph, layers, chosen, ctx, pp_link)
    forbidden = set(layers.forbidden)
    if repeated:
        costs, cuts, forbidden = _expand(costs, cuts, layers, repeated[1])
    dtypes = [graph.nodes[ph].out.dtype for ph in graph.params.values()]
    dtype = _dtype_name(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"
    return Profile(costs, cuts, forbidden, submesh, microbatch, None if repeated else graph,
                   layers, chosen, strategies, solution, repeated, fallbacks, dtype)


def _capture_for_pricing(model, example_inputs, loss_fn, microbatch: int, reuse_layers: bool | None):
    inputs = _microbatch_inputs(example_inputs, microbatch)
    if reuse_layers is not False:
        container = _container_of_model(model)
        mod = _repeated_container(model, container)
        if mod is not None:
            try:
                graph = capture(_truncated(model, container, 2), inputs, loss_fn)
                layers = group_layers(graph)
                if layers.container == container:
                    return graph, layers, (container, len(mod), 2)
            except AutoparError as e:
                log.info("autopar: pricing %s on a truncated copy failed (%s); capturing it whole", container, e)
    graph = capture(model, inputs, loss_fn)
    return graph, group_layers(graph), None


def _container_of_model(model: nn.Module) -> str | None:
    """The largest ModuleList/Sequential of identical children (by parameter count)."""
    best = None
    for name, mod in model.named_modules():
        if name and isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > REPEAT_THRESHOLD:
            if best is None or len(mod) > best[0]:
                best = (len(mod), name)
    return best[1] if best else None


# --- 3. stages ------------------------------------------------------------------------

@dataclass
class Candidate:
    """One pipeline configuration and its predicted cost."""

    stages: int
    """Pipeline stages p (devices along the pp axis)."""
    submesh: tuple
    """Shape of each stage's submesh (the axes other than pp)."""
    dp: int
    """Data parallelism outside the submesh (priced analytically), 1 when the submesh holds it."""
    microbatches: int
    microbatch: int
    """Sequences per microbatch on one submesh."""
    schedule: Schedule
    virtual_stages: int
    recompute: bool
    ranges: list
    """[start, stop) layer ranges, one per chunk (p x v chunks; chunk c runs on pp rank c mod p)."""
    chunk_time_s: list
    device_time_s: list
    """Per pp rank, seconds per microbatch (all its chunks)."""
    device_memory: list
    """Per pp rank, bytes per device."""
    step_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    sync_s: float
    flops: float
    """Model FLOPs per step."""

    @property
    def memory_bytes(self) -> float:
        return max(self.device_memory)

    def summary(self) -> dict:
        return {"stages": self.stages, "submesh": list(self.submesh), "dp": self.dp,
                "microbatches": self.microbatches, "microbatch": self.microbatch,
                "schedule": self.schedule.value, "virtual_stages": self.virtual_stages,
                "recompute": "full" if self.recompute else "none", "step_s": self.step_s,
                "bubble_s": self.bubble_s, "memory_bytes": self.memory_bytes}


def _in_flight(schedule: Schedule, p: int, m: int, v: int, rank: int) -> float:
    if schedule is Schedule.GPIPE:
        return float(m)
    held = float(min(m, p - rank))
    if schedule is Schedule.INTERLEAVED:
        held *= 1 + (p - 1) / (p * v)
    return held


def partition(prof: Profile, chunks: int, *, p: int, m: int, schedule: Schedule, v: int, recompute: bool,
              budget: float) -> list | None:
    """Contiguous layer ranges for ``chunks`` chunks minimising the slowest
    chunk's time per microbatch, each chunk inside its memory share; None if
    no partition fits."""
    n = len(prof.layers)
    if chunks > n:
        return None
    L, C = prof.layers, prof.cuts
    t = np.array([lc.time_s + (lc.fwd_s if recompute else 0.0) for lc in L])
    state = np.array([lc.state_bytes for lc in L])
    act = np.array([lc.act_bytes for lc in L])
    held = np.array([C[i].held_bytes if i > 0 else 0.0 for i in range(n)])
    pt, ps, pa, ph = (np.concatenate([[0.0], np.cumsum(x)]) for x in (t, state, act, held))
    p2p_in = np.array([C[i].p2p_fwd_s if 0 < i < n else 0.0 for i in range(n + 1)])
    out = np.array([C[j].p2p_bwd_s + C[j].to_replicated_s if 0 < j < n else 0.0 for j in range(n + 1)])
    i_idx = np.arange(n + 1)[:, None]
    j_idx = np.arange(n + 1)[None, :]
    valid = i_idx < j_idx
    T = np.where(valid, pt[None, :] - pt[:, None] + p2p_in[:, None] + out[None, :], np.inf)
    S = ps[None, :] - ps[:, None]
    if recompute:
        run_max = np.full((n + 1, n + 1), 0.0)
        for i in range(n):
            run_max[i, i + 1:] = np.maximum.accumulate(act[i:])
        A = ph[None, :] - ph[:, None] + run_max  # inputs kept per microbatch + one layer live
        working = run_max
    else:
        A = pa[None, :] - pa[:, None]
        working = np.zeros_like(A)
    allowed = np.ones(n + 1, bool)
    for c in prof.forbidden:
        if 0 < c < n:
            allowed[c] = False
    share = budget / v
    F = np.full(n + 1, np.inf)
    F[0] = 0.0
    back = []
    for k in range(chunks):
        rank = k % p
        inflight = _in_flight(schedule, p, m, v, rank)
        if recompute:
            mem = S + inflight * (A - working) + working
        else:
            mem = S + inflight * A
        cost = np.where(valid & (mem <= share), T, np.inf)
        if k > 0:
            cost = np.where(allowed[:, None], cost, np.inf)
        M = np.maximum(F[:, None], cost)
        back.append(M.argmin(axis=0))
        F = M.min(axis=0)
    if not np.isfinite(F[n]):
        return None
    ranges, j = [], n
    for k in reversed(range(chunks)):
        i = int(back[k][j])
        ranges.append((i, j))
        j = i
    return list(reversed(ranges))


def evaluate(prof: Profile, *, p: int, m: int, schedule: Schedule, v: int, recompute: bool, budget: float,
             dp: int = 1, dp_link=None, ranges: list | None = None) -> Candidate | None:
    """Partition (unless ``ranges`` is given) and price one configuration."""
    schedule = Schedule(schedule)
    chunks = p * v
    if ranges is None:
        ranges = partition(prof, chunks, p=p, m=m, schedule=schedule, v=v, recompute=recompute, budget=budget)
        if ranges is None:
            return None
    L, C = prof.layers, prof.cuts
    n = len(L)
    chunk_time, chunk_compute, chunk_state, chunk_act, chunk_work, chunk_sync, chunk_grad = [], [], [], [], [], [], []
    for i, j in ranges:
        layer = L[i:j]
        compute = sum(lc.fwd_s + lc.bwd_s + (lc.fwd_s if recompute else 0.0) for lc in layer)
        comm = sum(lc.comm_s for lc in layer)
        comm += (C[i].p2p_fwd_s if i > 0 else 0.0) + (C[j].p2p_bwd_s + C[j].to_replicated_s if j < n else 0.0)
        chunk_time.append(compute + comm)
        chunk_compute.append(compute)
        chunk_state.append(sum(lc.state_bytes for lc in layer))
        if recompute:
            work = max(lc.act_bytes for lc in layer)
            chunk_act.append(sum(C[k].held_bytes for k in range(i, j) if k > 0))
            chunk_work.append(work)
        else:
            chunk_act.append(sum(lc.act_bytes for lc in layer))
            chunk_work.append(0.0)
        chunk_sync.append(sum(lc.sync_s for lc in layer))
        chunk_grad.append(sum(lc.grad_bytes for lc in layer))
    dev_time = [0.0] * p
    dev_compute = [0.0] * p
    dev_mem = [0.0] * p
    dev_sync = [0.0] * p
    dev_grad = [0.0] * p
    for c in range(chunks):
        r = c % p
        dev_time[r] += chunk_time[c]
        dev_compute[r] += chunk_compute[c]
        dev_mem[r] += chunk_state[c] + _in_flight(schedule, p, m, v, r) * chunk_act[c]
        dev_sync[r] += chunk_sync[c]
        dev_grad[r] += chunk_grad[c]
    for r in range(p):
        dev_mem[r] += max(chunk_work[c] for c in range(r, chunks, p))
        if dp > 1 and dp_link is not None:
            dev_sync[r] += collective_time(Collective.ALL_REDUCE, dev_grad[r], dp_link)
    if max(dev_mem) > budget:
        return None
    slow = max(range(p), key=lambda r: dev_time[r])
    per_mb = dev_time[slow]
    bubble = (p - 1) / v * per_mb
    sync = max(dev_sync)
    step = m * per_mb + bubble + sync
    flops = m * dp * sum(lc.flops for lc in L)
    return Candidate(p, tuple(prof.submesh.shape), dp, m, prof.microbatch, schedule, v, recompute, list(ranges),
                     chunk_time, dev_time, dev_mem, step, m * dev_compute[slow],
                     m * (per_mb - dev_compute[slow]) + sync, bubble, sync, flops)


def _schedules(schedule, p: int, m: int, n: int) -> list:
    """(schedule, v) pairs to try."""
    if p == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    if schedule is not None:
        schedule = Schedule(schedule)
        if schedule is not Schedule.INTERLEAVED:
            return [(schedule, 1)]
        return [(schedule, v) for v in VIRTUAL_STAGES if p * v <= n and m % p == 0]
    out = [(Schedule.ONE_F_ONE_B, 1)]
    if m % p == 0:
        out += [(Schedule.INTERLEAVED, v) for v in VIRTUAL_STAGES if p * v <= n]
    return out


def _best(cands):
    cands = [c for c in cands if c is not None]
    return min(cands, key=lambda c: (c.step_s, c.memory_bytes)) if cands else None


def should_pipeline(pipelined: Candidate | None, flat: Candidate | None, *, margin: float = MARGIN) -> bool:
    """Whether to pipeline: when nothing fits without it, or when the best pipelined
    plan is predicted at least ``margin`` faster than the best plan without."""
    if pipelined is None:
        return False
    if flat is None:
        return True
    return pipelined.step_s < (1.0 - margin) * flat.step_s


# --- 4. search over meshes ------------------------------------------------------------

@dataclass
class PipelineSearch:
    """What the planner considered when it factored the world into pp x dp x tp."""

    pipelined: Candidate | None
    """Best configuration with more than one stage."""
    flat: Candidate | None
    """Best configuration without pipelining (one stage, one microbatch)."""
    evaluated: int
    feasible: int
    layers: list
    repeated: tuple | None
    wall_s: float
    margin: float = MARGIN
    profiles: dict = field(default_factory=dict, repr=False)

    @property
    def pipeline(self) -> bool:
        return should_pipeline(self.pipelined, self.flat, margin=self.margin)

    @property
    def best(self) -> Candidate | None:
        return self.pipelined if self.pipeline else self.flat

    def mesh(self, cand: Candidate | None = None) -> Mesh:
        """The mesh of a candidate: pp x dp x tp (axes of size 1 dropped, one kept)."""
        c = cand or self.best
        axes = [(PP_AXIS, c.stages), ("dp", c.dp), ("tp", c.submesh[-1])]
        kept = [(n, s) for n, s in axes if s > 1] or [("tp", 1)]
        return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))

    def summary(self) -> dict:
        return {"pipelined": self.pipelined.summary() if self.pipelined else None,
                "flat": self.flat.summary() if self.flat else None, "decision": "pipeline" if self.pipeline
                else "no pipeline", "evaluated": self.evaluated, "feasible": self.feasible,
                "wall_s": self.wall_s, "margin": self.margin,
                "priced_by_repetition": list(self.repeated) if self.repeated else None}


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_pipeline(model: nn.Module, example_inputs, *, world: int, cluster, loss_fn, stages: int | None = None,
                    microbatches: int | None = None, schedule=None, memory: float | None = None,
                    recompute: bool | None = None, optimizer: str = "adamw", time_limit_s: float = 60.0,
                    solver: str = "HIGHS", reuse_layers: bool | None = None, margin: float = MARGIN,
                    max_tp: int | None = None) -> PipelineSearch:
    """Factor ``world`` devices into pp x dp x tp and choose layers, microbatches
    and schedule (tp inside a node; dp outside the stage submesh, priced as a
    gradient all-reduce once per step)."""
    t0 = time.perf_counter()
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    B = batch_size(example_inputs)
    budget = memory if memory is not None else cluster.device.memory
    dpn = cluster.devices_per_node
    tps = [t for t in _divisors(dpn) if world % t == 0 and (max_tp is None or t <= max_tp)]
    cache: dict = {}
    points = [b for b in MICROBATCH_PER_DP_RANK if b <= B] or [1]
    profiles: dict = {}
    for t in tps:
        for b in points:
            profiles[t, b] = profile(model, example_inputs, loss_fn, Mesh((t,), ("tp",)), cluster, microbatch=b,
                                     optimizer=optimizer, time_limit_s=time_limit_s, solver=solver,
                                     reuse_layers=reuse_layers, graph_cache=cache)
    first = next(iter(profiles.values()))
    n = len(first.layers)
    evaluated = feasible = 0
    best_pipe, best_flat = [], []
    recomputes = [recompute] if recompute is not None else [False, True]
    for t in tps:
        for p in _divisors(world // t):
            if p > n or (stages is not None and p != stages):
                continue
            d = world // (t * p)
            links = axis_links(cluster, (p, d, t))
            for b0 in ([B // d] if p == 1 and B % d == 0 else points if p > 1 else []):
                if B % (d * b0):
                    continue
                m = B // (d * b0)
                if microbatches is not None and m != microbatches and p > 1:
                    continue
                prof = _profile_at(profiles, t, b0, points)
                prof = _with_pp_link(prof, links[0] if p > 1 else None)
                for sched, v in _schedules(schedule, p, m, n):
                    for rc in recomputes:
                        evaluated += 1
                        c = evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget, dp=d,
                                     dp_link=links[1])
                        if c is None:
                            continue
                        feasible += 1
                        (best_pipe if p > 1 else best_flat).append(c)
    result = PipelineSearch(_best(best_pipe), _best(best_flat), evaluated, feasible, first.names, first.repeated,
                            time.perf_counter() - t0, margin, profiles)
    if result.best is None:
        raise InfeasibleError(
            f"no pipeline configuration of {world} devices fits in {budget / 2**30:.2f} GiB per device "
            f"(tried {evaluated} configurations of stages x tp x microbatches x schedule x recomputation)")
    return result


def _profile_at(profiles: dict, t: int, b0: int, points: list) -> Profile:
    if (t, b0) in profiles:
        return profiles[t, b0]
    a = profiles[t, points[0]]
    if len(points) == 1:
        return replace(a, microbatch=b0, graph=None, chosen=None)
    return a.scaled(profiles[t, points[-1]], b0)


def _with_pp_link(prof: Profile, pp_link) -> Profile:
    """The same profile with its cut transfers priced on ``pp_link``."""
    cuts = []
    for cut in prof.cuts:
        if pp_link is None or cut.tensors == 0:
            cuts.append(replace(cut, p2p_fwd_s=0.0, p2p_bwd_s=0.0))
            continue
        per = cut.nbytes / cut.tensors
        t = cut.tensors * collective_time(Collective.SEND_RECV, per, pp_link)
        cuts.append(replace(cut, p2p_fwd_s=t, p2p_bwd_s=t))
    return replace(prof, cuts=cuts)


# --- 5. the plan --------------------------------------------------------------------------

def compile_pipelined(model: nn.Module, example_inputs, *, mesh, cluster, loss_fn, stages: int | None = None,
                      microbatches: int | None = None, schedule=None, memory: float | None = None,
                      recompute: bool | None = None, optimizer: str = "adamw", time_limit_s: float = 60.0,
                      solver: str = "HIGHS", source: str | None = None, margin: float = MARGIN,
                      reuse_layers: bool | None = None) -> Plan:
    """Plan ``model`` with pipeline parallelism where it pays.

    * ``mesh`` with a ``pp`` axis ("pp=2,tp=2"): the pipeline has that many
      stages (``stages``, if given, must agree); each stage runs the
      intra-operator plan on the other axes.
    * ``mesh`` without one (a device count, "dp=128,tp=8", ...): the planner
      factors the devices into pp x dp x tp (tp inside a node) and pipelines
      only when ``should_pipeline`` says so; ``stages=`` pins the stage count
      (``stages=1`` never pipelines).
    ``microbatches`` / ``schedule`` ("gpipe", "1f1b", "interleaved-1f1b") pin
    those choices; ``recompute`` pins full activation recomputation on/off
    (planning only: the runtime does not recompute yet). The returned Plan's
    ``pipeline`` section is None when the plan does not pipeline."""
    from autopar.compiler import compile as compile_flat

    t0 = time.perf_counter()
    mesh = parse_mesh(mesh)
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if schedule is not None:
        schedule = _schedule_arg(schedule)
    if stages is not None and (not isinstance(stages, int) or stages < 1):
        raise AutoparError(f"stages must be a positive integer, got {stages!r}")
    flat_options = dict(mesh=mesh, cluster=cluster, loss_fn=loss_fn, memory=memory, optimizer=optimizer,
                        time_limit_s=time_limit_s, solver=solver, source=source)
    if PP_AXIS in mesh.names:
        p = mesh.shape[mesh.names.index(PP_AXIS)]
        if stages is not None and stages != p:
            raise AutoparError(f"stages={stages} disagrees with the mesh's pp axis ({mesh}): the pipeline has one "
                               f"stage per pp coordinate; use a mesh with pp={stages}")
        if p == 1:
            inner = _inner_mesh(mesh)
            return compile_flat(model, example_inputs, **{**flat_options, "mesh": inner})
        return _plan_on_mesh(model, example_inputs, loss_fn, mesh, cluster, microbatches=microbatches,
                             schedule=schedule, memory=memory, recompute=recompute, optimizer=optimizer,
                             time_limit_s=time_limit_s, solver=solver, source=source, reuse_layers=reuse_layers,
                             t0=t0)
    if stages == 1:
        return compile_flat(model, example_inputs, **flat_options)
    max_tp = mesh.shape[-1] if mesh.ndim > 1 else None
    found = search_pipeline(model, example_inputs, world=mesh.size, cluster=cluster, loss_fn=loss_fn,
                            stages=stages, microbatches=microbatches, schedule=schedule, memory=memory,
                            recompute=recompute, optimizer=optimizer, time_limit_s=time_limit_s, solver=solver,
                            reuse_layers=reuse_layers, margin=margin if stages is None else -math.inf,
                            max_tp=max_tp)
    if not found.pipeline:
        plan = compile_flat(model, example_inputs, **flat_options)
        plan.solver["pipeline_search"] = found.summary()
        return plan
    best = found.pipelined
    chosen_mesh = found.mesh(best)
    if found.repeated:
        plan = _plan_from_candidate(found.profiles, best, chosen_mesh, cluster, source, found)
    else:
        plan = _plan_on_mesh(model, example_inputs, loss_fn, chosen_mesh, cluster, microbatches=best.microbatches,
                             schedule=best.schedule, virtual_stages=best.virtual_stages, memory=memory,
                             recompute=best.recompute, optimizer=optimizer, time_limit_s=time_limit_s,
                             solver=solver, source=source, reuse_layers=reuse_layers, t0=t0)
    plan.solver["pipeline_search"] = found.summary()
    return plan


def _schedule_arg(schedule) -> Schedule:
    try:
        return Schedule(schedule)
    except ValueError:
        raise AutoparError(f"schedule {schedule!r} is not one of {[s.value for s in Schedule]}") from None


def _inner_mesh(mesh: Mesh) -> Mesh:
    """The stage submesh: every axis but pp (a single axis of size 1 when there is none)."""
    kept = [(n, s) for n, s in zip(mesh.names, mesh.shape) if n != PP_AXIS]
    if not kept:
        return Mesh((1,), ("tp",))
    return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))


def _plan_on_mesh(model, example_inputs, loss_fn, mesh: Mesh, cluster, *, microbatches=None, schedule=None,
                  virtual_stages: int | None = None, memory=None, recompute=None, optimizer="adamw",
                  time_limit_s=60.0, solver="HIGHS", source=None, reuse_layers=None, t0=None) -> Plan:
    """Path with a given pp axis: choose layers, microbatches and schedule."""
    t0 = t0 if t0 is not None else time.perf_counter()
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    B = batch_size(example_inputs)
    pp_index = mesh.names.index(PP_AXIS)
    p = mesh.shape[pp_index]
    inner = _inner_mesh(mesh)
    budget = memory if memory is not None else cluster.device.memory
    links = axis_links(cluster, mesh.shape)
    if microbatches is not None:
        if not isinstance(microbatches, int) or microbatches < 1 or B % microbatches:
            raise AutoparError(f"microbatches={microbatches!r} must be a positive integer dividing the batch ({B})")
        ms = [microbatches]
    else:
        ms = [m for m in _divisors(B) if m >= min(p, B)][:MAX_MICROBATCH_CANDIDATES]
    cache: dict = {}
    best, best_prof, evaluated = None, None, 0
    for m in ms:
        prof = profile(model, example_inputs, loss_fn, inner, cluster, microbatch=B // m, pp_link=links[pp_index],
                       optimizer=optimizer, time_limit_s=time_limit_s, solver=solver, reuse_layers=reuse_layers,
                       graph_cache=cache)
        pairs = _schedules(schedule, p, m, len(prof.layers))
        if virtual_stages is not None:
            pairs = [(s, v) for s, v in pairs if v == virtual_stages] or [(Schedule(schedule), virtual_stages)]
        for sched, v in pairs:
            for rc in ([recompute] if recompute is not None else [False, True]):
                evaluated += 1
                c = evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget)
                if c is not None and (best is None or (c.step_s, c.memory_bytes) < (best.step_s, best.memory_bytes)):
                    best, best_prof = c, prof
    if best is None:
        raise InfeasibleError(
            f"no pipeline of {p} stages on {mesh} fits in {budget / 2**30:.2f} GiB per device "
            f"(tried microbatches {ms}); give more memory, more stages or a larger submesh")
    if best_prof.graph is None:
        plan = _plan_from_candidate({("given",): best_prof}, best, mesh, cluster, source, None)
    else:
        plan = build_pipeline_plan(best_prof, best, mesh, cluster, source)
    plan.solver["wall_s"] = time.perf_counter() - t0
    plan.solver["pipeline_search"] = {"evaluated": evaluated, "microbatches_tried": ms,
                                      "chosen": best.summary()}
    return plan


def _stage_ranks(mesh: Mesh, pp_index: int, coord: int) -> list:
    grid = np.arange(mesh.size).reshape(mesh.shape)
    return [int(r) for r in np.take(grid, coord, axis=pp_index).flatten()]


def _with_pp(spec: tuple, pp_index: int, inner_is_synthetic: bool) -> str:
    """An inner-mesh spec as a full-mesh spec (replicated on the pp axis)."""
    placements = [] if inner_is_synthetic else list(spec)
    placements.insert(pp_index, Replicate())
    return fmt_spec(tuple(placements))


def inner_spec(spec: str, mesh: Mesh) -> str:
    """A full-mesh spec of a pipelined plan on the stage submesh (the pp axis dropped)."""
    placements = list(parse_spec(spec, mesh.ndim))
    del placements[mesh.names.index(PP_AXIS)]
    return fmt_spec(tuple(placements)) if placements else "R"


def stage_ranges(plan: Plan, layer_names: list) -> list:
    """The [start, stop) layer ranges of a pipelined plan's stages in ``layer_names``."""
    ranges = []
    for st in plan.pipeline["stages"]:
        names = st["layers"]
        try:
            start = layer_names.index(names[0])
        except ValueError:
            raise AutoparError(f"the plan's stage {st['index']} starts at layer {names[0]!r}, which this model "
                               f"does not have (its layers: {layer_names[:6]}...)") from None
        if layer_names[start:start + len(names)] != names:
            raise AutoparError(f"the plan's stage {st['index']} layers {names} are not consecutive layers of this "
                               "model; recompile the plan for this model")
        ranges.append((start, start + len(names)))
    return ranges


def build_pipeline_plan(prof: Profile, cand: Candidate, mesh: Mesh, cluster, source: str | None) -> Plan:
    """The Plan of a candidate whose profile holds the whole microbatch graph."""
    graph, layers, chosen = prof.graph, prof.grouping, prof.chosen
    pp_index = mesh.names.index(PP_AXIS)
    inner = prof.submesh
    synthetic = mesh.ndim == 1  # only the pp axis: stages run on a one-device submesh
    ctx = CostContext.make(inner.shape, cluster)
    full_ctx = CostContext.make(mesh.shape, cluster)
    grad = needs_grad(graph)
    p, m = cand.stages, cand.microbatches
    nodes = []
    for node in graph.nodes.values():
        s = chosen[node.name]
        f, b = node_compute(node, s, ctx, node.name in grad)
        nodes.append(NodePlan(node.name, node.op_name, node.fqn, list(node.inputs),
                              [_with_pp(x, pp_index, synthetic) for x in s.inputs],
                              _with_pp(s.output, pp_index, synthetic), f + b,
                              node_memory(node, s, ctx, node.name in grad), len(prof.strategies[node.name])))
    stage_of = {}
    stage_entries = []
    B = m * prof.microbatch
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
            "sends": list(layers.crossing[j]) if j < layers.n else [],
            "plan": {"mesh": inner.to_json(), "parameters": params,
                     "strategies": {nm: str(chosen[nm]) for nm in names}},
        })
    parameters = {}
    for fqn, ph in graph.params.items():
        spec = chosen[ph].output
        shape = graph.nodes[ph].out.shape
        parameters[fqn] = {"placements": _placements_full(spec, pp_index, synthetic, mesh.ndim),
                           "shape": list(shape), "local_shape": list(local_shape(shape, spec, inner.shape)),
                           "dtype": str(graph.nodes[ph].out.dtype), "stage": stage_of.get(ph, 0)}
    inputs = []
    for node in graph.nodes.values():
        if node.kind is NodeKind.INPUT:
            spec = chosen[node.name].output
            shape = list(node.out.shape)
            inputs.append({"name": node.name, "placements": _placements_full(spec, pp_index, synthetic, mesh.ndim),
                           "shape": [B, *shape[1:]] if shape else shape, "microbatch_shape": shape,
                           "dtype": str(node.out.dtype),
                           "local_shape": list(local_shape(node.out.shape, spec, inner.shape))})
    collectives = _collectives(graph, layers, chosen, ctx, inner, cand, stage_of, mesh, full_ctx)
    pred = _predicted(cand, cluster, mesh, prof.dtype)
    topology = [{"name": nm, "size": a.size, "intra_node": a.intra, "inter_node": a.inter,
                 "level": "inter-node" if a.intra == 1 and a.inter > 1 else
                          ("hierarchical" if a.inter > 1 else "intra-node")}
                for nm, a in zip(mesh.names, full_ctx.links)]
    from autopar.compiler import _placeholders
    model_info = {"source": source, "fingerprint": graph.fingerprint(), "has_loss": graph.has_loss,
                  "placeholders": _placeholders(graph), "out_spec": graph.out_spec, "microbatch_size": prof.microbatch}
    sol = prof.solution
    solver_info = {"status": sol.status, "objective": cand.step_s, "wall_s": sol.wall_s,
                   "variables": sol.variables, "constraints": sol.constraints, "backend": sol.extra.get("backend"),
                   "intra_objective_s": sol.objective_s}
    pipeline = {"schedule": cand.schedule.value, "microbatches": m, "virtual_stages": cand.virtual_stages,
                "axis": PP_AXIS, "recompute": "full" if cand.recompute else "none",
                "microbatch_size": prof.microbatch, "bubble_fraction":
                    bubble_fraction(cand.schedule, p, m, cand.virtual_stages), "stages": stage_entries}
    plan = Plan(mesh, cluster.to_json(), topology, model_info, parameters, inputs, nodes, collectives, pred,
                solver_info, pipeline)
    plan.fallbacks = [vars(f) for f in prof.fallbacks]
    plan.warnings = [f"no sharding rule for {f.op} at {f.location} (node {f.node}); runs replicated"
                     for f in prof.fallbacks]
    if cand.recompute:
        plan.warnings.append("the plan recomputes activations (full recomputation); the pipeline runtime "
                             "does not recompute yet, so it needs the memory of the plan without it")
    return plan


def _placements_full(spec: tuple, pp_index: int, synthetic: bool, ndim: int) -> list:
    return [fmt_spec((q,)) for q in parse_spec(_with_pp(spec, pp_index, synthetic), ndim)]


def _collectives(graph, layers, chosen, ctx, inner: Mesh, cand: Candidate, stage_of: dict, mesh: Mesh,
                 full_ctx) -> list:
    grad = needs_grad(graph)
    out = []
    m = cand.microbatches
    for node in graph.nodes.values():
        s = chosen[node.name]
        stage = stage_of.get(node.name, len(cand.ranges) - 1)
        for idx, src in enumerate(node.inputs):
            meta = graph.nodes[src].outputs[0]
            fwd, bwd = edge_moves(chosen[src].output, s, idx, meta, ctx, node.name in grad and src in grad)
            for phase, moves in (("forward", fwd), ("backward", bwd)):
                for mv in moves:
                    sync = phase == "backward" and graph.nodes[src].kind is NodeKind.PARAM
                    out.append({"kind": mv.kind.value, "phase": phase, "mesh_axes": [inner.names[mv.axis]],
                                "bytes": mv.nbytes, "seconds": mv.seconds, "node": node.name, "producer": src,
                                "tensor": graph.nodes[src].fqn if graph.nodes[src].kind is NodeKind.PARAM else src,
                                "gradient_sync": sync, "stage": stage, "per_step": 1 if sync else m})
    pp_link = full_ctx.links[mesh.names.index(PP_AXIS)]
    for c, (i, j) in enumerate(cand.ranges):
        if j >= layers.n:
            continue
        for name in layers.crossing[j]:
            meta = graph.nodes[name].out
            t = collective_time(Collective.SEND_RECV, meta.nbytes, pp_link)
            phases = ["forward"] + (["backward"] if name in grad and meta.dtype.is_floating_point else [])
            for phase in phases:
                out.append({"kind": "send_recv", "phase": phase, "mesh_axes": [PP_AXIS], "bytes": meta.nbytes,
                            "seconds": t, "node": name, "producer": name, "tensor": name, "gradient_sync": False,
                            "stage": c, "from_stage": c if phase == "forward" else c + 1,
                            "to_stage": c + 1 if phase == "forward" else c, "per_step": m})
    return out


def _predicted(cand: Candidate, cluster, mesh: Mesh, dtype: str) -> dict:
    peak_rank = max(range(cand.stages), key=lambda r: cand.device_memory[r])
    return {"step_time_s": cand.step_s, "compute_s": cand.compute_s, "comm_s": cand.comm_s,
            "bubble_s": cand.bubble_s, "sync_s": cand.sync_s, "peak_memory_bytes": cand.memory_bytes,
            "memory": {"total": cand.memory_bytes, "stage": peak_rank},
            "stage_memory_bytes": list(cand.device_memory), "stage_time_s": list(cand.device_time_s),
            "memory_capacity_bytes": cluster.device.memory, "model_flops": cand.flops,
            "mfu": cand.flops / (cand.step_s * mesh.size * cluster.device.flops(dtype)) if cand.step_s > 0 else 0.0}


def _plan_from_candidate(profiles: dict, cand: Candidate, mesh: Mesh, cluster, source, found) -> Plan:
    """A planning-only Plan for a model priced by repetition: stages list their
    layers but not node names (the truncated capture has other names)."""
    prof = next(iter(profiles.values()))
    if found is not None:
        prof = profiles.get((cand.submesh[-1], cand.microbatch)) or profiles[next(iter(profiles))]
    pp_index = mesh.names.index(PP_AXIS)
    names = [lc.name for lc in _expanded_names(prof)]
    link = axis_links(cluster, mesh.shape)[pp_index]
    stages, collectives = [], []
    for c, (i, j) in enumerate(cand.ranges):
        stages.append({"index": c, "layers": names[i:j], "nodes": [], "submesh": list(cand.submesh),
                       "devices": _stage_ranks(mesh, pp_index, c % cand.stages), "time_s": cand.chunk_time_s[c],
                       "memory_bytes": cand.device_memory[c % cand.stages], "plan": None})
    pipeline = {"schedule": cand.schedule.value, "microbatches": cand.microbatches,
                "virtual_stages": cand.virtual_stages, "axis": PP_AXIS,
                "recompute": "full" if cand.recompute else "none", "microbatch_size": cand.microbatch,
                "bubble_fraction": bubble_fraction(cand.schedule, cand.stages, cand.microbatches,
                                                   cand.virtual_stages),
                "stages": stages, "priced_by_repetition": list(prof.repeated) if prof.repeated else None}
    for c, (i, j) in enumerate(cand.ranges):
        if j < len(prof.cuts):
            cut = prof.cuts[j]
            for phase in ("forward", "backward"):
                collectives.append({"kind": "send_recv", "phase": phase, "mesh_axes": [PP_AXIS],
                                    "bytes": cut.nbytes, "node": names[j], "tensor": f"into {names[j]}",
                                    "seconds": collective_time(Collective.SEND_RECV, cut.nbytes, link),
                                    "stage": c, "per_step": cand.microbatches, "gradient_sync": False})
    ctx = CostContext.make(mesh.shape, cluster)
    topology = [{"name": nm, "size": a.size, "intra_node": a.intra, "inter_node": a.inter,
                 "level": "inter-node" if a.intra == 1 and a.inter > 1 else
                          ("hierarchical" if a.inter > 1 else "intra-node")}
                for nm, a in zip(mesh.names, ctx.links)]
    sol = prof.solution
    solver_info = {"status": sol.status if sol else "DP", "objective": cand.step_s, "wall_s": 0.0,
                   "variables": sol.variables if sol else 0, "constraints": sol.constraints if sol else 0}
    plan = Plan(mesh, cluster.to_json(), topology, {"source": source, "fingerprint": None, "has_loss": True},
                {}, [], [], collectives, _predicted(cand, cluster, mesh, prof.dtype), solver_info, pipeline)
    plan.warnings = [f"priced by repetition: the model's {prof.repeated[1]} {prof.repeated[0]} layers were "
                     f"priced from a {prof.repeated[2]}-layer copy; this plan lists stages and costs but no per-node "
                     "strategies, so it cannot be executed as is"] if prof.repeated else []
    return plan


def _expanded_names(prof: Profile) -> list:
    return prof.layers


__all__ = ["compile_pipelined", "search_pipeline", "should_pipeline", "bubble_fraction", "group_layers",
           "Schedule", "Layers", "Candidate", "PipelineSearch", "profile", "partition", "evaluate",
           "inner_spec", "stage_ranges", "PP_AXIS"]
