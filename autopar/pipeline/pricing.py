"""Step 2 of pipeline planning: per-layer costs on a stage submesh, from the
intra-operator ILP (see autopar/pipeline/__init__.py)."""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, fields, replace

import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate

from autopar import plancache
from autopar.capture import capture
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import Collective, collective_time
from autopar.cost_models.graph_costs import CostContext, _dtype_name, needs_grad, op_flops
from autopar.cost_models.resharding import transitions
from autopar.errors import AutoparError
from autopar.ir import Graph, Node, NodeKind
from autopar.mesh import Mesh
from autopar.passes.recompute import NONE, Recomputation, recomputation
from autopar.passes.rules import get_rule
from autopar.passes.strategy import shard_factor
from autopar.pipeline.layers import Layers, group_layers
from autopar.planner import Problem, Solved, node_costs, prepare
from autopar.forks import in_parallel

log = logging.getLogger("autopar")


REPEAT_THRESHOLD = 8
"""Above this many repeated layers the planner (when it factors the world) prices the model on
a two-layer copy."""


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
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    """Gradients (also what data parallelism outside the submesh reduces, ``stages._outer_sync``)."""
    optimizer_bytes: float = 0.0
    """Optimizer states (and fp32 master weights under mixed precision)."""
    sharded_optimizer_bytes: float = 0.0
    """The same in a pipeline, where the optimizer states of a parameter are
    sharded over a submesh axis it is replicated on (``zero1_axis``)."""
    updated_bytes: float = 0.0
    """Bytes of the parameter shards this device's optimizer updates in a pipeline."""
    act_bytes: float = 0.0
    """Activations saved for backward, and resharded copies kept for it."""
    recomputed_bytes: float = 0.0
    """Activations made again during its backward instead (the regions
    selective recomputation runs again, ``Profile.selective``)."""
    transient_bytes: float = 0.0
    """The largest gradient working set of one of its ops in backward
    (graph_costs.backward_working_set)."""
    flops: float = 0.0
    """Model FLOPs (matmuls, forward and backward) of the whole microbatch."""
    recomputable: bool = False
    """A numbered layer (``blocks.3``): full recomputation keeps only its inputs
    (what codegen checkpoints: autopar/codegen.py, ``plan.recompute``)."""

    @property
    def time_s(self) -> float:
        return self.fwd_s + self.bwd_s + self.comm_s

    @property
    def state_bytes(self) -> float:
        return self.param_bytes + self.grad_bytes + self.optimizer_bytes


@dataclass
class Cut:
    """The boundary before a layer, for one microbatch."""

    nbytes: float = 0.0
    """Bytes each device of the sending stage sends: its shards of the crossing
    tensors (``cut_placements``)."""
    held_bytes: float = 0.0
    """Local bytes of the crossing tensors (what a recomputed layer keeps)."""
    to_cut_s: float = 0.0
    """Reducing crossing tensors that are Partial sums on the sending submesh (forward)."""
    p2p_fwd_s: float = 0.0
    """Send/recv of the activations on the pp axis."""
    p2p_bwd_s: float = 0.0
    """Send/recv of their gradients."""
    tensors: int = 0


def cut_placements(spec: tuple) -> tuple:
    """How a tensor crosses a stage boundary: in its producer's placements,
    except that a Partial sum is reduced first. Every device of the sending
    submesh sends its own shard to the device at the same submesh coordinate
    of the next stage, which receives it in the same placements, so a tensor
    sharded over the submesh crosses as 1/n of its bytes per device and is not
    gathered (Megatron-LM's scatter/gather optimisation, Narayanan et al.
    SC'21 sec. 4.1, falls out of sequence-parallel placements)."""
    return tuple(Replicate() if isinstance(p, Partial) else p for p in spec)


_NUMERIC_LAYER = [f.name for f in fields(LayerCost) if f.name not in ("name", "recomputable")]
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
    """The captured microbatch graph (of the truncated copy when priced by repetition)."""
    grouping: Layers | None = None
    chosen: dict | None = None
    """Node name -> Strategy on the submesh (for ``graph``)."""
    strategies: dict | None = None
    solution: object = None
    repeated: tuple | None = None
    """(container, layers in the model, layers captured) when priced on a truncated copy."""
    fallbacks: list = field(default_factory=list)
    dtype: str = "fp32"
    """Compute dtype of the peak FLOP/s (for MFU)."""
    ctx: CostContext | None = None
    selective: list | None = None
    """The layers' costs under selective recomputation (passes/recompute.py:
    the pieces of each numbered layer between parameter uses that free the
    most memory per recomputed second), on the same plan; None where the
    model's layers cannot take it."""
    selective_rc: Recomputation | None = None
    """Its regions (of ``graph``)."""

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
            return {n: max(0.0, getattr(a, n) + k * (getattr(b, n) - getattr(a, n))) for n in names}

        def mixed(mine, theirs):
            return [LayerCost(a.name, **mix(a, b, _NUMERIC_LAYER), recomputable=a.recomputable)
                    for a, b in zip(mine, theirs)]

        cuts = [Cut(**mix(a, b, _NUMERIC_CUT)) for a, b in zip(self.cuts, other.cuts)]
        selective = mixed(self.selective, other.selective) if self.selective and other.selective else None
        return replace(self, layers=mixed(self.layers, other.layers), cuts=cuts, microbatch=microbatch,
                       selective=selective)


@dataclass
class _Stage:
    """One stage to price: the flat planner's problem (planner.prepare,
    ``stage=True``) for a captured microbatch graph on a stage submesh."""

    problem: Problem
    layers: Layers
    repeated: tuple | None
    microbatch: int

    @property
    def graph(self) -> Graph:
        return self.problem.graph

    @property
    def submesh(self) -> Mesh:
        return self.problem.mesh


def zero1_axis(spec: tuple, mesh_shape: tuple) -> int | None:
    """The submesh axis a pipeline shards a parameter's optimizer states over:
    the first one of size > 1 it is replicated on (ZeRO stage 1, Megatron-LM's
    distributed optimizer), or None. Its gradient is reduce-scattered there
    once per step, each rank updates its shard, and the shards are
    all-gathered before the next step: the bytes of the all-reduce, with the
    optimizer states and their update divided by the axis size."""
    for axis, (p, n) in enumerate(zip(spec, mesh_shape)):
        if isinstance(p, Replicate) and n > 1:
            return axis
    return None


def once_per_step(src: Node, spec: tuple, move) -> bool:
    """Whether a backward move on a parameter's edge runs once per step rather
    than once per microbatch: the reduction of a gradient over an axis the
    parameter is replicated on. The pipeline runtime accumulates those local
    partial sums over the microbatches and reduces them once after the last
    (``spmd.accumulating``); a reduce-scatter into a sharded (ZeRO) parameter
    runs in every microbatch's backward."""
    return src.kind is NodeKind.PARAM and isinstance(spec[move.axis], Replicate)


def _price(graph: Graph, layers: Layers, chosen: dict, ctx: CostContext, pp_link,
           rc: Recomputation = NONE) -> tuple[list, list]:
    """Per-layer costs: the flat planner's accounting of the chosen plan
    (planner.node_costs) under recomputation ``rc``, summed by layer, the
    gradient reductions a pipeline makes once per step apart
    (``once_per_step``); and the cuts."""
    grad = needs_grad(graph)
    ms = ctx.mesh_shape
    costs = [LayerCost(name, recomputable=bool(layers.container) and name.startswith(layers.container + "."))
             for name in layers.names]
    for cost in node_costs(graph, chosen, ctx, rc):
        node, s = graph.nodes[cost.name], cost.strategy
        again = cost.name in rc.nodes  # what it keeps is made again in its region's backward
        lc = costs[layers.cost_group.get(node.name, layers.n - 1)]
        lc.fwd_s += cost.fwd_s
        lc.bwd_s += cost.bwd_s
        lc.comm_s += sum(mv.seconds for moves in (cost.own_fwd, cost.own_bwd, cost.own_again) for mv in moves)
        parts = cost.parts
        lc.param_bytes += parts.get("parameters", 0.0)
        lc.grad_bytes += parts.get("gradients", 0.0)
        lc.optimizer_bytes += parts.get("optimizer", 0.0)
        if node.kind is NodeKind.PARAM:
            axis = zero1_axis(s.output, ms)
            k = ms[axis] if axis is not None else 1
            lc.sharded_optimizer_bytes += parts.get("optimizer", 0.0) / k
            lc.updated_bytes += parts.get("parameters", 0.0) / k
        if cost.dropped:
            lc.recomputed_bytes += cost.activations
        else:
            lc.act_bytes += cost.activations
        if node.kind is NodeKind.OP and node.info is not None:
            rule = get_rule(node.target)
            if rule is not None and rule.matmul:
                lc.flops += op_flops(node) * (3 if node.name in grad else 1)
        for edge in cost.edges:
            if again:
                lc.recomputed_bytes += edge.held
            else:
                lc.act_bytes += edge.held
            lc.comm_s += sum(mv.seconds for mv in edge.fwd) + sum(mv.seconds for mv in edge.again)
            for mv in edge.bwd:
                if once_per_step(graph.nodes[edge.src], chosen[edge.src].output, mv):
                    lc.sync_s += mv.seconds
                else:
                    lc.comm_s += mv.seconds
        lc.transient_bytes = max(lc.transient_bytes, cost.working)
    cuts = [Cut() for _ in range(layers.n)]
    for c in range(1, layers.n):
        cut = cuts[c]
        for name in layers.crossing[c]:
            spec = chosen[name].output
            sent = cut_placements(spec)
            meta = graph.nodes[name].out
            nbytes = ctx.tensor_bytes(meta)
            local = nbytes / shard_factor(sent, ms)
            cut.tensors += 1
            cut.nbytes += local
            cut.held_bytes += local
            cut.to_cut_s += sum(m.seconds for m in transitions(spec, sent, nbytes, ms, ctx.links))
            t = collective_time(Collective.SEND_RECV, local, pp_link) if pp_link is not None else 0.0
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
            **kwargs) -> Profile:
    """Per-layer costs at ``microbatch`` sequences on ``submesh`` (see the
    package docstring); keyword arguments as ``profiles``."""
    return profiles(model, example_inputs, loss_fn, [(submesh, microbatch)], cluster, **kwargs)[0]


def profiles(model: nn.Module, example_inputs: tuple, loss_fn, points: list, cluster, *, pp_link=None,
             optimizer: str = "adamw", precision: str = "fp32", time_limit_s: float = 60.0, solver: str = "HIGHS",
             reuse_layers: bool = False, graph_cache: dict | None = None, cache: str | None = None,
             deadline: float | None = None) -> list:
    """A Profile at each (submesh, microbatch) of ``points``.

    ``reuse_layers``: price a model with many identical layers on a two-layer
    copy. ``graph_cache`` keeps the captures (one per microbatch size) for the
    next call. ``cache``: a plan cache directory (autopar/plancache.py) whose
    solved layer classes answer the ILPs solved before, by this model or any
    other built of the same layers; the others are solved at once
    (forks.in_parallel) and stored there. The solves end by ``deadline``
    (time.perf_counter(); default: ``time_limit_s`` from now)."""
    cluster = get_cluster(cluster)
    deadline = deadline if deadline is not None else time.perf_counter() + time_limit_s
    graph_cache = graph_cache if graph_cache is not None else {}
    options = dict(optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver)
    ilps = []
    for submesh, microbatch in points:
        if ("graph", microbatch) not in graph_cache:
            graph_cache["graph", microbatch] = _capture_for_pricing(model, example_inputs, loss_fn, microbatch,
                                                                    reuse_layers, graph_cache)
        graph, layers, repeated = graph_cache["graph", microbatch]
        problem = prepare(graph, submesh, cluster, optimizer=optimizer, precision=precision, stage=True)
        ilps.append(_Stage(problem, layers, repeated, microbatch))
    found = [None] * len(ilps)
    if cache:
        fingerprints = {id(ilp.graph): ilp.graph.fingerprint() for ilp in ilps}  # one per capture
        keys = [plancache.cache_key(fingerprints[id(ilp.graph)], ilp.submesh, cluster, {"stage_ilp": True, **options})
                for ilp in ilps]
        found = [plancache.load_solution(cache, key, ilp.graph, ilp.problem.strategies)
                 for key, ilp in zip(keys, ilps)]
    todo = [i for i, sol in enumerate(found) if sol is None]

    def solve(i: int):
        return ilps[i].problem.solve(deadline=deadline, solver=solver).solution

    for i, sol in zip(todo, in_parallel(solve, todo)):
        if isinstance(sol, Exception):
            raise sol
        if cache:
            plancache.store_solution(cache, keys[i], sol)
        found[i] = sol
    solved = set(todo)
    for i, sol in enumerate(found):
        sol.extra["cache"] = None if not cache else "miss" if i in solved else "hit"
    return [_profile(ilp, sol, pp_link, precision) for ilp, sol in zip(ilps, found)]


def _profile(ilp: _Stage, solution, pp_link, precision: str) -> Profile:
    graph, layers, problem = ilp.graph, ilp.layers, ilp.problem
    chosen = Solved(problem, solution).chosen
    costs, cuts = _price(graph, layers, chosen, problem.ctx, pp_link)
    try:
        rc = recomputation(graph, "selective", ctx=problem.ctx)
    except AutoparError as e:  # layers a checkpoint cannot hold: selective is not offered
        log.info("autopar: selective recomputation is not an option in this pipeline: %s", e)
        rc = None
    selective = _price(graph, layers, chosen, problem.ctx, pp_link, rc)[0] if rc is not None and rc.regions \
        else None
    forbidden = set(layers.forbidden)
    if ilp.repeated:
        if selective is not None:
            selective = _expand(selective, cuts, layers, ilp.repeated[1])[0]
        costs, cuts, forbidden = _expand(costs, cuts, layers, ilp.repeated[1])
    if precision != "fp32":
        dtype = precision
    else:
        dtypes = [graph.nodes[ph].out.dtype for ph in graph.params.values()]
        dtype = _dtype_name(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"
    return Profile(costs, cuts, forbidden, ilp.submesh, ilp.microbatch, graph, layers, chosen, problem.strategies,
                   solution, ilp.repeated, problem.fallbacks, dtype, problem.ctx, selective,
                   rc if selective is not None else None)


def _capture_for_pricing(model, example_inputs, loss_fn, microbatch: int, reuse_layers: bool, cache: dict):
    inputs = _microbatch_inputs(example_inputs, microbatch)
    if reuse_layers and cache.get("repeats", True):
        container = _container_of_model(model)
        mod = _repeated_container(model, container)
        if mod is not None:
            try:
                two = capture(_truncated(model, container, 2), inputs, loss_fn)
                l2 = group_layers(two)
                if "repeats" not in cache:  # checked once, at the first microbatch size
                    three = capture(_truncated(model, container, 3), inputs, loss_fn)
                    cache["repeats"] = _repeats(two, l2, three, group_layers(three), container)
                if cache["repeats"]:
                    return two, l2, (container, len(mod), 2)
                log.info("autopar: %s layers do not repeat uniformly; capturing the whole model", container)
            except AutoparError as e:
                cache["repeats"] = False
                log.info("autopar: pricing %s on a truncated copy failed (%s); capturing it whole", container, e)
    graph = capture(model, inputs, loss_fn)
    return graph, group_layers(graph), None


def _repeats(two: Graph, l2: Layers, three: Graph, l3: Layers, container: str) -> bool:
    """Whether copies truncated to 2 and 3 layers agree on everything repetition
    pricing assumes: the same layers around the repeated ones, the same ops in
    every repeated layer, and the same tensors (shapes, dtypes) across the
    cuts before, between and after them."""
    if l2.container != container or l3.container != container:
        return False
    reps2 = [i for i, nm in enumerate(l2.names) if nm.startswith(container + ".")]
    reps3 = [i for i, nm in enumerate(l3.names) if nm.startswith(container + ".")]
    if len(reps2) != 2 or len(reps3) != 3 or reps2[0] != reps3[0]:
        return False
    a = reps2[0]
    if l2.names[:a] != l3.names[:a] or l2.names[a + 2:] != l3.names[a + 3:]:
        return False

    def ops(graph, layers, g):
        return [graph.nodes[n].op_name for n in graph.nodes
                if layers.group.get(n) == g and graph.nodes[n].kind is NodeKind.OP]

    def cut(graph, layers, c):
        return sorted((graph.nodes[n].out.shape, str(graph.nodes[n].out.dtype)) for n in layers.crossing[c]) \
            if 0 < c < layers.n else []

    block = ops(two, l2, a + 1)
    if any(ops(three, l3, g) != block for g in (a + 1, a + 2)) or ops(two, l2, a) != ops(three, l3, a):
        return False
    if cut(three, l3, a + 1) != cut(two, l2, a + 1) or cut(three, l3, a + 2) != cut(two, l2, a + 1):
        return False
    if cut(three, l3, a + 3) != cut(two, l2, a + 2):
        return False
    return all(cut(three, l3, c) == cut(two, l2, c) for c in range(1, a + 1))


def _container_of_model(model: nn.Module) -> str | None:
    """The longest ModuleList/Sequential in the model (candidate for repetition pricing)."""
    best = None
    for name, mod in model.named_modules():
        if name and isinstance(mod, (nn.ModuleList, nn.Sequential)) and len(mod) > REPEAT_THRESHOLD:
            if best is None or len(mod) > best[0]:
                best = (len(mod), name)
    return best[1] if best else None
