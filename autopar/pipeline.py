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
2. **Price** (``profile``). The intra-operator ILP (autopar/solver.py, identical
   layers sharing variables) is solved once per stage submesh shape and
   microbatch size on the whole microbatch graph; each layer's cost is the sum
   over its nodes of compute (forward, backward) and activation resharding,
   its gradient synchronisation (once per step), its parameter, gradient and
   optimizer bytes and saved activations (graph_costs.memory_breakdown). A
   tensor crossing a cut travels in its producer's placement, each rank
   sending its shard to its peer (``cut_placements``), so the edges around a
   cut cost what the ILP priced; a Partial sum is reduced before it is sent
   (``Cut``). The ILP does not know where the cuts fall, and it weighs
   gradient synchronisation once per microbatch; the runtime reduces
   replicated parameters' gradients once per step (``once_per_step``), and
   the stage pricing counts them so. When the planner factors the world, a model with many
   identical layers is priced on a copy truncated to two of them (checked
   against a three-layer copy) and their costs are reused for every layer.
3. **Stages** (``partition``). A dynamic program over contiguous layer ranges
   minimises the slowest stage's time per microbatch (compute, resharding,
   point-to-point transfers of the crossing tensors on the pp axis) subject
   to each stage's memory: parameters, optimizer states and gradients plus
   the activations of the microbatches it holds (1F1B: stage s holds
   min(m, p - s), GPipe all m, interleaved a factor 1 + (p-1)/(p v) more);
   with full recomputation a numbered layer (``blocks.3``) keeps only its
   inputs and one such layer's activations are live at a time, as
   autopar/codegen.py checkpoints them.
4. **Step time**: (m + (p - 1)/v) x slowest stage (the bubble is (p-1)/m of
   the work, (p-1)/(v m) interleaved) plus the exposed gradient
   synchronisation of the slowest stage.
"""
from __future__ import annotations

import copy
import logging
import time
from dataclasses import dataclass, field, fields, replace
from enum import Enum

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import Partial, Replicate

from autopar.capture import Graph, Node, NodeKind, capture
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import Collective, axis_links, collective_time
from autopar.cost_models.graph_costs import (
    CostContext, SharedReshards, _dtype_name, backward_working_set, edge_memory, edge_moves, memory_breakdown, needs_grad, node_compute,
    node_memory, saved_outputs, saves_input,
    op_flops, optimizer_step_bytes,
)
from autopar.cost_models.resharding import transitions
from autopar.errors import AutoparError, InfeasibleError
from autopar.mesh import Mesh, parse_mesh
from autopar.passes.cluster import layer_classes
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
REPEAT_THRESHOLD = 8
"""Above this many repeated layers the planner (when it factors the world) prices the model on
a two-layer copy."""
VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""Model chunks per device tried for the interleaved schedule."""
MICROBATCH_PER_DP_RANK = (1, 2)
"""Sequences per data-parallel rank per microbatch tried when the planner
factors the world (Megatron-LM uses 1-2, Narayanan et al. SC'21)."""
MAX_MICROBATCH_CANDIDATES = 4
"""With a given pp axis and no pinned count, the smallest divisors of the batch
that are >= p are tried as microbatch counts (each costs a capture and an ILP)."""


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
    param_bytes: float = 0.0
    grad_bytes: float = 0.0
    """Gradients (also what data parallelism outside the submesh all-reduces)."""
    optimizer_bytes: float = 0.0
    """Optimizer states (and fp32 master weights under mixed precision)."""
    sharded_optimizer_bytes: float = 0.0
    """The same in a pipeline, where the optimizer states of a parameter are
    sharded over a submesh axis it is replicated on (``zero1_axis``)."""
    updated_bytes: float = 0.0
    """Bytes of the parameter shards this device's optimizer updates in a pipeline."""
    act_bytes: float = 0.0
    """Activations saved for backward, and resharded copies kept for it."""
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

        layers = [LayerCost(a.name, **mix(a, b, _NUMERIC_LAYER), recomputable=a.recomputable)
                  for a, b in zip(self.layers, other.layers)]
        cuts = [Cut(**mix(a, b, _NUMERIC_CUT)) for a, b in zip(self.cuts, other.cuts)]
        return replace(self, layers=layers, cuts=cuts, microbatch=microbatch)


def _solve_intra(graph: Graph, submesh: Mesh, cluster, optimizer: str, precision: str, time_limit_s: float,
                 solver: str):
    """The intra-operator ILP on the stage submesh, identical layers sharing
    variables (passes/cluster.py), with no memory row: memory is checked per
    stage by the pipeline search. Mirrors autopar.compile's steps."""
    strategies, fallbacks = enumerate_strategies(graph, submesh.shape)
    # stages keep gathered parameters until backward (ZeRO-2 at most): the
    # stage pricing below and the stage programs do not regather
    strategies = {name: [s for s in ss if not s.regather] for name, ss in strategies.items()}
    # gradient sync is priced by the stage search itself (_price: sync_s), not hidden here
    ctx = CostContext.make(submesh.shape, replace(cluster, overlap_grad_sync=False), optimizer, precision)
    solution = solve(graph, strategies, ctx, memory_budget=None, time_limit_s=time_limit_s, backend=solver,
                     classes=layer_classes(graph), optimizer_step=False)
    chosen = {name: strategies[name][i] for name, i in solution.choice.items()}
    return chosen, strategies, solution, ctx, fallbacks


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


def _price(graph: Graph, layers: Layers, chosen: dict, ctx: CostContext, pp_link) -> tuple[list, list]:
    grad = needs_grad(graph)
    kept_share = saved_outputs(graph)
    ms = ctx.mesh_shape
    costs = [LayerCost(name, recomputable=bool(layers.container) and name.startswith(layers.container + "."))
             for name in layers.names]
    reshards = SharedReshards(len(ms))
    for node in graph.nodes.values():
        s = chosen[node.name]
        lc = costs[layers.cost_group.get(node.name, layers.n - 1)]
        backward = node.name in grad
        f, b = node_compute(node, s, ctx, backward)
        lc.fwd_s += f
        lc.bwd_s += b
        parts = memory_breakdown(node, s, ctx, kept_share.get(node.name, 0.0))
        lc.param_bytes += parts.get("parameters", 0.0)
        lc.grad_bytes += parts.get("gradients", 0.0)
        lc.optimizer_bytes += parts.get("optimizer", 0.0)
        if node.kind is NodeKind.PARAM:
            axis = zero1_axis(s.output, ms)
            k = ms[axis] if axis is not None else 1
            lc.sharded_optimizer_bytes += parts.get("optimizer", 0.0) / k
            lc.updated_bytes += parts.get("parameters", 0.0) / k
        lc.act_bytes += parts.get("activations", 0.0)
        lc.transient_bytes = max(lc.transient_bytes, backward_working_set(graph, node, s, ctx, grad))
        if node.kind is NodeKind.OP and node.info is not None:
            rule = get_rule(node.target)
            if rule is not None and rule.matmul:
                lc.flops += op_flops(node) * (3 if backward else 1)
        for idx, src in enumerate(node.inputs):
            meta = graph.nodes[src].outputs[0]
            held = edge_memory(chosen[src].output, s.inputs[idx], meta, ctx, backward and saves_input(node))
            lc.act_bytes += reshards.keeps(node, idx, src, s, backward and src in grad, held)
            if not reshards.pays(node, idx, src, s, backward and src in grad):
                continue  # the first consumer's reshard serves this one
            fwd, bwd = edge_moves(chosen[src].output, s, idx, meta, ctx, backward and src in grad)
            lc.comm_s += sum(mv.seconds for mv in fwd)
            for mv in bwd:
                if once_per_step(graph.nodes[src], chosen[src].output, mv):
                    lc.sync_s += mv.seconds
                else:
                    lc.comm_s += mv.seconds
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
            pp_link=None, optimizer: str = "adamw", precision: str = "fp32", time_limit_s: float = 60.0,
            solver: str = "HIGHS", reuse_layers: bool = False, graph_cache: dict | None = None) -> Profile:
    """Per-layer costs at ``microbatch`` sequences on ``submesh`` (see the module docstring).
    ``reuse_layers``: price a model with many identical layers on a two-layer copy."""
    cluster = get_cluster(cluster)
    graph_cache = graph_cache if graph_cache is not None else {}
    key = ("graph", microbatch)
    if key not in graph_cache:
        graph_cache[key] = _capture_for_pricing(model, example_inputs, loss_fn, microbatch, reuse_layers,
                                                graph_cache)
    graph, layers, repeated = graph_cache[key]
    chosen, strategies, solution, ctx, fallbacks = _solve_intra(graph, submesh, cluster, optimizer, precision,
                                                                time_limit_s, solver)
    costs, cuts = _price(graph, layers, chosen, ctx, pp_link)
    forbidden = set(layers.forbidden)
    if repeated:
        costs, cuts, forbidden = _expand(costs, cuts, layers, repeated[1])
    if precision != "fp32":
        dtype = precision
    else:
        dtypes = [graph.nodes[ph].out.dtype for ph in graph.params.values()]
        dtype = _dtype_name(max(set(dtypes), key=dtypes.count)) if dtypes else "fp32"
    return Profile(costs, cuts, forbidden, submesh, microbatch, graph, layers, chosen, strategies, solution,
                   repeated, fallbacks, dtype, ctx)


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
    device_memory_parts: list
    """Per pp rank: parameters, gradients, optimizer and activations bytes."""
    step_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    sync_s: float
    flops: float
    """Model FLOPs per step."""
    profile: Profile | None = field(default=None, repr=False)
    """The layer costs it was priced with."""

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


def _layer_arrays(prof: Profile, recompute: bool, pipelined: bool, dp: int = 1):
    """Per layer: time per microbatch, state bytes, activation bytes kept per
    microbatch in flight, its working set in backward (its activations again
    when recomputed, plus its largest gradient working set), and the bytes of
    parameters its devices update. In a pipeline, optimizer states are
    sharded over the submesh (``zero1_axis``) and over ``dp`` replicas."""
    L, C = prof.layers, prof.cuts
    rc = [recompute and lc.recomputable for lc in L]
    t = np.array([lc.time_s + (lc.fwd_s if r else 0.0) for lc, r in zip(L, rc)])
    if pipelined:
        state = np.array([lc.param_bytes + lc.sharded_optimizer_bytes / dp for lc in L])
        updated = np.array([lc.updated_bytes / dp for lc in L])
    else:
        state = np.array([lc.param_bytes + lc.optimizer_bytes for lc in L])
        updated = np.array([lc.param_bytes for lc in L])
    grads = np.array([lc.grad_bytes for lc in L])
    kept = np.array([(C[i].held_bytes if i > 0 else 0.0) if r else lc.act_bytes for i, (lc, r) in enumerate(zip(L, rc))])
    work = np.array([(lc.act_bytes if r else 0.0) + lc.transient_bytes for lc, r in zip(L, rc)])
    return t, state, grads, kept, work, updated


def _step_temp(prof: Profile, param_bytes: float) -> float:
    return optimizer_step_bytes(param_bytes, prof.ctx) if prof.ctx is not None else 0.0


def _device_memory(state, grads, acts, temp, p: int) -> float:
    """Peak bytes of a device: parameters and optimizer states always; with one
    stage the activations are freed as gradients build up (autopar.compile's
    rule); in a pipeline gradients coexist with the microbatches in flight."""
    if p == 1:
        return state + np.maximum(acts, grads + temp)
    return state + grads + np.maximum(acts, temp)


def partition(prof: Profile, chunks: int, *, p: int, m: int, schedule: Schedule, v: int, recompute: bool,
              budget: float, dp: int = 1) -> list | None:
    """Contiguous layer ranges for ``chunks`` chunks minimising the slowest
    chunk's time per microbatch, each chunk inside its share of the memory
    budget (budget / v: a device holds v chunks); None if none fits."""
    n = len(prof.layers)
    if chunks > n:
        return None
    C = prof.cuts
    t, state, grads, kept, work, updated = _layer_arrays(prof, recompute, p > 1, dp)
    pt, ps, pg, pk, pp_ = (np.concatenate([[0.0], np.cumsum(x)]) for x in (t, state, grads, kept, updated))
    p2p_in = np.array([C[i].p2p_fwd_s if 0 < i < n else 0.0 for i in range(n + 1)])
    out = np.array([C[j].p2p_bwd_s + C[j].to_cut_s if 0 < j < n else 0.0 for j in range(n + 1)])
    i_idx = np.arange(n + 1)[:, None]
    j_idx = np.arange(n + 1)[None, :]
    valid = i_idx < j_idx
    T = np.where(valid, pt[None, :] - pt[:, None] + p2p_in[:, None] + out[None, :], np.inf)
    S = ps[None, :] - ps[:, None]
    G = pg[None, :] - pg[:, None]
    K = pk[None, :] - pk[:, None]
    temp = _step_temp(prof, 1.0) * (pp_[None, :] - pp_[:, None])  # optimizer-step temporaries
    W = np.zeros((n + 1, n + 1))
    for i in range(n):
        W[i, i + 1:] = np.maximum.accumulate(work[i:])
    allowed = np.ones(n + 1, bool)
    for c in prof.forbidden:
        if 0 < c < n:
            allowed[c] = False
    share = budget / v
    F = np.full(n + 1, np.inf)
    F[0] = 0.0
    back = []
    for k in range(chunks):
        acts = _in_flight(schedule, p, m, v, k % p) * K + W
        mem = _device_memory(S, G, acts, temp, p)
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


def even_ranges(prof: Profile, chunks: int, recompute: bool) -> list | None:
    """Contiguous ranges of about equal time (cuts at the quantiles of the
    cumulative time per microbatch, on allowed cuts): with v chunks per device
    in an interleaved schedule, a device's time is the sum of its chunks, which
    ``partition``'s min-max over chunks leaves unbalanced when one layer (an
    LM head) is heavy. None if the layers cannot be cut that many times."""
    n = len(prof.layers)
    if chunks > n:
        return None
    t = _layer_arrays(prof, recompute, True)[0]
    cum = np.concatenate([[0.0], np.cumsum(t)])
    allowed = [c for c in range(1, n) if c not in prof.forbidden]  # increasing
    cuts, first = [], 0  # first: index in ``allowed`` of the earliest position the next cut may take
    for k in range(1, chunks):
        # leave an allowed position after this cut for each of the chunks - k - 1 cuts still to place
        options = range(first, len(allowed) - (chunks - k - 1))
        if not options:
            return None
        target = cum[-1] * k / chunks
        i = min(options, key=lambda j: (abs(cum[allowed[j]] - target), j))
        cuts.append(allowed[i])
        first = i + 1
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:]))


def evaluate(prof: Profile, *, p: int, m: int, schedule: Schedule, v: int, recompute: bool, budget: float,
             dp: int = 1, dp_link=None, ranges: list | None = None) -> Candidate | None:
    """Partition (unless ``ranges`` is given) and price one configuration; None
    if it does not fit in ``budget`` bytes per device."""
    schedule = Schedule(schedule)
    chunks = p * v
    if ranges is None:
        options = [partition(prof, chunks, p=p, m=m, schedule=schedule, v=v, recompute=recompute, budget=budget,
                             dp=dp)]
        if v > 1:  # a device runs v chunks: balance their sums, not only the slowest chunk
            options.append(even_ranges(prof, chunks, recompute))
        found = [evaluate(prof, p=p, m=m, schedule=schedule, v=v, recompute=recompute, budget=budget, dp=dp,
                          dp_link=dp_link, ranges=r) for r in options if r is not None]
        return _best(found)
    L, C = prof.layers, prof.cuts
    n = len(L)
    t, state, grads, kept, work, updated = _layer_arrays(prof, recompute, p > 1, dp)
    params = np.array([lc.param_bytes for lc in L])
    compute_of = np.array([lc.fwd_s + lc.bwd_s + (lc.fwd_s if recompute and lc.recomputable else 0.0) for lc in L])
    chunk_time = []
    dev = [dict(time=0.0, compute=0.0, state=0.0, grads=0.0, params=0.0, updated=0.0, acts=0.0, work=0.0, sync=0.0)
           for _ in range(p)]
    for c, (i, j) in enumerate(ranges):
        r = c % p
        comm = (C[i].p2p_fwd_s if i > 0 else 0.0) + (C[j].p2p_bwd_s + C[j].to_cut_s if j < n else 0.0)
        chunk_time.append(float(t[i:j].sum()) + comm)
        d = dev[r]
        d["time"] += chunk_time[-1]
        d["compute"] += float(compute_of[i:j].sum())
        d["state"] += float(state[i:j].sum())
        d["grads"] += float(grads[i:j].sum())
        d["params"] += float(params[i:j].sum())
        d["updated"] += float(updated[i:j].sum())
        d["acts"] += _in_flight(schedule, p, m, v, r) * float(kept[i:j].sum())
        d["work"] = max(d["work"], float(work[i:j].max()))
        d["sync"] += sum(lc.sync_s for lc in L[i:j])
    memory, parts = [], []
    for d in dev:
        if dp > 1 and dp_link is not None:
            d["sync"] += collective_time(Collective.ALL_REDUCE, d["grads"], dp_link)
        acts = d["acts"] + d["work"]
        temp = _step_temp(prof, d["updated"])
        memory.append(float(_device_memory(d["state"], d["grads"], acts, temp, p)))
        parts.append({"parameters": d["params"], "gradients": d["grads"], "optimizer": d["state"] - d["params"],
                      "activations": acts, "inputs": 0.0, "optimizer_step": temp})
    if max(memory) > budget:
        return None
    slow = max(range(p), key=lambda r: dev[r]["time"])
    per_mb = dev[slow]["time"]
    bubble = (p - 1) / v * per_mb
    sync = max(d["sync"] for d in dev)
    step = m * per_mb + bubble + sync
    flops = m * dp * sum(lc.flops for lc in L)
    return Candidate(p, tuple(prof.submesh.shape), dp, m, prof.microbatch, schedule, v, recompute, list(ranges),
                     chunk_time, [d["time"] for d in dev], memory, parts, step, m * dev[slow]["compute"],
                     m * (per_mb - dev[slow]["compute"]) + sync, bubble, sync, flops, prof)


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
    """(container, layers, layers captured) when priced by repetition."""
    wall_s: float
    margin: float = MARGIN

    @property
    def pipeline(self) -> bool:
        return should_pipeline(self.pipelined, self.flat, margin=self.margin)

    @property
    def best(self) -> Candidate | None:
        return self.pipelined if self.pipeline else self.flat

    def mesh(self, cand: Candidate | None = None) -> Mesh:
        """A candidate's mesh, pp x dp x tp (axes of size 1 dropped, at least one kept)."""
        c = cand or self.best
        axes = [(PP_AXIS, c.stages), ("dp", c.dp), ("tp", c.submesh[-1])]
        kept = [(n, s) for n, s in axes if s > 1] or [("tp", 1)]
        return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))

    def summary(self) -> dict:
        return {"decision": "pipeline" if self.pipeline else "no pipeline",
                "pipelined": self.pipelined.summary() if self.pipelined else None,
                "flat": self.flat.summary() if self.flat else None, "evaluated": self.evaluated,
                "feasible": self.feasible, "wall_s": self.wall_s, "margin": self.margin,
                "priced_by_repetition": list(self.repeated) if self.repeated else None}


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_pipeline(model: nn.Module, example_inputs, *, world: int, cluster, loss_fn, stages: int | None = None,
                    microbatches: int | None = None, schedule=None, memory: float | None = None,
                    recompute: bool | None = None, optimizer: str = "adamw", precision: str = "fp32",
                    time_limit_s: float = 60.0, solver: str = "HIGHS", reuse_layers: bool | None = None,
                    margin: float = MARGIN, max_tp: int | None = None) -> PipelineSearch:
    """Factor ``world`` devices into pp x dp x tp and choose layers, microbatches,
    schedule and recomputation for each factorisation.

    tp stays inside a node (it divides ``devices_per_node``); the intra-stage
    ILP runs on the tp submesh at 1 and 2 sequences per data-parallel rank
    (``MICROBATCH_PER_DP_RANK``; other sizes by affine interpolation of the
    layer costs); dp replicates the pipeline and adds an all-reduce of each
    stage's gradients once per step. ``stages=1`` or a single stage candidate
    is "no pipeline": one microbatch of the whole local batch."""
    t0 = time.perf_counter()
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    if schedule is not None:
        schedule = _schedule_arg(schedule)
    B = batch_size(example_inputs)
    budget = memory if memory is not None else cluster.device.memory
    tps = [t for t in _divisors(cluster.devices_per_node) if world % t == 0 and (max_tp is None or t <= max_tp)]
    points = [b for b in MICROBATCH_PER_DP_RANK if b <= B] or [1]
    cache: dict = {}
    profiles = {(t, b): profile(model, example_inputs, loss_fn, Mesh((t,), ("tp",)), cluster, microbatch=b,
                                optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver,
                                reuse_layers=reuse_layers is not False, graph_cache=cache)
                for t in tps for b in points}
    first = next(iter(profiles.values()))
    n = len(first.layers)
    evaluated = feasible = 0
    pipelined, flat = [], []
    recomputes = [recompute] if recompute is not None else [False, True]
    for t in tps:
        for p in _divisors(world // t):
            if p > n or (stages is not None and p != stages):
                continue
            d = world // (t * p)
            links = axis_links(cluster, (p, d, t))
            per_rank = d * (microbatches or 1)  # without a pipeline: one microbatch unless pinned
            sizes = points if p > 1 else ([B // per_rank] if B % per_rank == 0 else [])
            for b0 in sizes:
                if B % (d * b0):
                    continue
                m = B // (d * b0)
                if p > 1 and microbatches is not None and m != microbatches:
                    continue
                prof = _with_pp_link(_profile_at(profiles, t, b0, points), links[0] if p > 1 else None)
                for sched, v in _schedules(schedule, p, m, n):
                    for rc in recomputes:
                        evaluated += 1
                        c = evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget, dp=d,
                                     dp_link=links[1])
                        if c is not None:
                            feasible += 1
                            (pipelined if p > 1 else flat).append(c)
    result = PipelineSearch(_best(pipelined), _best(flat), evaluated, feasible, first.names, first.repeated,
                            time.perf_counter() - t0, margin)
    if result.best is None:
        raise InfeasibleError(
            f"no configuration of {world} devices fits in {budget / 2**30:.2f} GiB per device (tried {evaluated} "
            "combinations of stages x tp x microbatches x schedule x recomputation)")
    return result


def _profile_at(profiles: dict, t: int, b0: int, points: list) -> Profile:
    if (t, b0) in profiles:
        return profiles[t, b0]
    a = profiles[t, points[0]]
    if len(points) == 1:
        return replace(a, microbatch=b0)
    return a.scaled(profiles[t, points[-1]], b0)


def _with_pp_link(prof: Profile, pp_link) -> Profile:
    """The same profile with its cut transfers priced on ``pp_link`` (none without one)."""
    cuts = []
    for cut in prof.cuts:
        if pp_link is None or cut.tensors == 0:
            cuts.append(replace(cut, p2p_fwd_s=0.0, p2p_bwd_s=0.0))
            continue
        t = cut.tensors * collective_time(Collective.SEND_RECV, cut.nbytes / cut.tensors, pp_link)
        cuts.append(replace(cut, p2p_fwd_s=t, p2p_bwd_s=t))
    return replace(prof, cuts=cuts)


# --- 5. the plan --------------------------------------------------------------------------

def compile_pipelined(model: nn.Module, example_inputs, *, mesh, cluster, loss_fn, stages: int | None = None,
                      microbatches: int | None = None, schedule=None, memory: float | None = None,
                      recompute: bool | None = None, optimizer: str = "adamw", precision: str = "fp32",
                      time_limit_s: float = 60.0, solver: str = "HIGHS", source: str | None = None,
                      margin: float = MARGIN, reuse_layers: bool | None = None) -> Plan:
    """Plan ``model`` with pipeline parallelism where it pays.

    * ``mesh`` with a ``pp`` axis ("pp=2,tp=2"): the pipeline has that many
      stages (``stages``, if given, must agree); each stage runs the
      intra-operator plan on the other axes.
    * ``mesh`` without one (a device count, "dp=128,tp=8", ...): the planner
      factors the devices into pp x dp x tp (tp inside a node, at most the
      mesh's last axis) and pipelines only when ``should_pipeline`` says so;
      ``stages=`` pins the stage count (``stages=1`` never pipelines).
      Otherwise it returns ``autopar.compile``'s plan on ``mesh``; or, with
      ``microbatches`` > 1, a one-stage pipeline: gradient accumulation over
      the microbatches, reduced once per step, ZeRO-1 over data parallelism.
    ``microbatches`` / ``schedule`` ("gpipe", "1f1b", "interleaved-1f1b") pin
    those choices; ``recompute`` pins full activation recomputation on or off
    (the runtime does not recompute yet). The plan's ``pipeline`` section is
    None when it does not pipeline. A model on the meta device with many
    identical layers gets a planning-only plan (stages and costs, no per-node
    strategies); ``reuse_layers=False`` captures it whole instead."""
    from autopar.compiler import compile as compile_flat

    t0 = time.perf_counter()
    mesh = parse_mesh(mesh)
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if schedule is not None:
        schedule = _schedule_arg(schedule)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise AutoparError(f"stages must be a positive integer, got {stages!r}")
    options = dict(optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver)
    flat = dict(cluster=cluster, loss_fn=loss_fn, memory=memory, source=source, **options)
    accumulate = dict(microbatches=microbatches, schedule=schedule, memory=memory, recompute=recompute,
                      source=source, reuse_layers=bool(reuse_layers), t0=t0, **options)
    accumulates = microbatches not in (None, 1)  # without a pipeline: a pipeline of one stage
    if PP_AXIS in mesh.names:
        p = mesh.shape[mesh.names.index(PP_AXIS)]
        if stages is not None and stages != p:
            raise AutoparError(f"stages={stages} disagrees with the mesh ({mesh}): the pipeline has one stage per "
                               f"coordinate of its pp axis; use a mesh with pp={stages}")
        if p == 1 and not accumulates:
            return compile_flat(model, example_inputs, mesh=_inner_mesh(mesh), **flat)
        return _plan_on_mesh(model, example_inputs, loss_fn, mesh, cluster, **accumulate)
    if stages == 1 and not accumulates:
        return compile_flat(model, example_inputs, mesh=mesh, **flat)
    if stages == 1:
        return _plan_on_mesh(model, example_inputs, loss_fn, _with_pp(mesh), cluster, **accumulate)
    found = search_pipeline(model, example_inputs, world=mesh.size, cluster=cluster, loss_fn=loss_fn,
                            stages=stages, microbatches=microbatches, schedule=schedule, memory=memory,
                            recompute=recompute, reuse_layers=reuse_layers, margin=margin,
                            max_tp=mesh.shape[-1] if mesh.ndim > 1 else None, **options)
    if not found.pipeline:
        plan = _plan_on_mesh(model, example_inputs, loss_fn, _with_pp(mesh), cluster, **accumulate) \
            if accumulates else compile_flat(model, example_inputs, mesh=mesh, **flat)
        plan.solver["pipeline_search"] = found.summary()
        return plan
    best = found.pipelined
    if found.repeated and _on_meta(model):
        plan = plan_from_candidate(best, found.mesh(best), cluster, source)
        plan.solver["wall_s"] = time.perf_counter() - t0
    else:
        plan = _plan_on_mesh(model, example_inputs, loss_fn, found.mesh(best), cluster,
                             microbatches=best.microbatches, schedule=best.schedule,
                             virtual_stages=best.virtual_stages, memory=memory, recompute=best.recompute,
                             source=source, reuse_layers=bool(reuse_layers), t0=t0, **options)
    plan.solver["pipeline_search"] = found.summary()
    return plan


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _schedule_arg(schedule) -> Schedule:
    try:
        return Schedule(schedule)
    except ValueError:
        raise AutoparError(f"schedule {schedule!r} is not one of {[s.value for s in Schedule]}") from None


def _with_pp(mesh: Mesh) -> Mesh:
    """``mesh`` with a pp axis of size 1 in front: one stage, its microbatches
    accumulating gradients (and ZeRO-1 over its data-parallel axes)."""
    return Mesh((1, *mesh.shape), (PP_AXIS, *mesh.names))


def _inner_mesh(mesh: Mesh) -> Mesh:
    """The stage submesh: every axis but pp (a single axis of size 1 when there is none)."""
    kept = [(n, s) for n, s in zip(mesh.names, mesh.shape) if n != PP_AXIS]
    if not kept:
        return Mesh((1,), ("tp",))
    return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))


def _plan_on_mesh(model, example_inputs, loss_fn, mesh: Mesh, cluster, *, microbatches=None, schedule=None,
                  virtual_stages: int | None = None, memory=None, recompute=None, optimizer="adamw",
                  precision="fp32", time_limit_s=60.0, solver="HIGHS", source=None, reuse_layers: bool = False,
                  t0=None) -> Plan:
    """The pp axis is given: choose layers, microbatches, schedule; the submesh
    plan is the ILP's on the whole microbatch graph."""
    t0 = t0 if t0 is not None else time.perf_counter()
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    B = batch_size(example_inputs)
    pp_index = mesh.names.index(PP_AXIS)
    p = mesh.shape[pp_index]
    inner = _inner_mesh(mesh)
    budget = memory if memory is not None else cluster.device.memory
    pp_link = axis_links(cluster, mesh.shape)[pp_index]
    if microbatches is not None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1 \
                or B % microbatches:
            raise AutoparError(f"microbatches={microbatches!r} must be a positive integer dividing the batch "
                               f"size ({B})")
        ms = [microbatches]
    else:
        ms = [m for m in _divisors(B) if m >= min(p, B)][:MAX_MICROBATCH_CANDIDATES]
    cache: dict = {}
    cands, evaluated = [], 0
    for m in ms:
        prof = profile(model, example_inputs, loss_fn, inner, cluster, microbatch=B // m, pp_link=pp_link,
                       optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver,
                       reuse_layers=reuse_layers,
                       graph_cache=cache)
        pairs = _schedules(schedule, p, m, len(prof.layers))
        if virtual_stages is not None:
            pairs = [(s, v) for s, v in pairs if v == virtual_stages]
        for sched, v in pairs:
            for rc in ([recompute] if recompute is not None else [False, True]):
                evaluated += 1
                cands.append(evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget))
    best = _best(cands)
    if best is None and prof.forbidden:
        free = [c for c in range(1, len(prof.layers)) if c not in prof.forbidden]
        if len(free) < p - 1:
            raise AutoparError(
                f"a pipeline of {p} stages needs {p - 1} cut(s) between layers, but parameters shared by several "
                f"layers (tied weights) leave only {len(free)}: {[prof.names[c] for c in free]} can start a "
                "stage; untie them or use fewer stages")
    if best is None:
        raise InfeasibleError(
            f"no pipeline of {p} stages on {mesh} fits in {budget / 2**30:.2f} GiB per device (tried microbatches "
            f"{ms}, schedules {[schedule.value] if schedule else [s.value for s in Schedule]}); give more memory, "
            "more stages or a larger submesh")
    if best.profile.repeated:
        plan = plan_from_candidate(best, mesh, cluster, source)
    else:
        plan = build_pipeline_plan(best, mesh, cluster, source)
    plan.solver["wall_s"] = time.perf_counter() - t0
    plan.solver["pipeline_search"] = {"evaluated": evaluated, "microbatches_tried": ms, "chosen": best.summary()}
    return plan


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
            "recompute": "full" if cand.recompute else "none", "microbatch_size": cand.microbatch,
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
    grad = needs_grad(graph)
    kept_share = saved_outputs(graph)
    p, m = cand.stages, cand.microbatches
    nodes = []
    for node in graph.nodes.values():
        s = chosen[node.name]
        f, b = node_compute(node, s, ctx, node.name in grad)
        nodes.append(NodePlan(node.name, node.op_name, node.fqn, list(node.inputs),
                              [_full_spec(x, inner, mesh) for x in s.inputs], _full_spec(s.output, inner, mesh), f + b,
                              node_memory(node, s, ctx, kept_share.get(node.name, 0.0)),
                              len(prof.strategies[node.name])))
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
    from autopar.compiler import _placeholders
    model_info = {"source": source, "fingerprint": graph.fingerprint(), "has_loss": graph.has_loss,
                  "placeholders": _placeholders(graph), "out_spec": graph.out_spec,
                  "microbatch_size": prof.microbatch}
    sol = prof.solution
    solver_info = {"status": sol.status, "objective": cand.step_s, "wall_s": sol.wall_s,
                   "variables": sol.variables, "constraints": sol.constraints, "backend": sol.extra.get("backend"),
                   "stage_objective_s": sol.objective_s}
    plan = Plan(mesh, cluster.to_json(), _topology(mesh, cluster), model_info, parameters, inputs, nodes,
                _collectives(cand, ctx, stage_of, mesh, cluster), _predicted(cand, cluster, mesh),
                solver_info, _pipeline_section(cand, stage_entries))
    plan.fallbacks = [vars(f) for f in prof.fallbacks]
    plan.warnings = [f"no sharding rule for {f.op} at {f.location} (node {f.node}); runs replicated"
                     for f in prof.fallbacks]
    plan.recompute = _recompute_section(cand)
    return plan


def _recompute_section(cand: Candidate) -> dict:
    """plan.recompute: the numbered layers run under activation checkpointing."""
    layers = [lc.name for lc in cand.profile.layers if cand.recompute and lc.recomputable]
    return {"mode": "full" if layers else "none", "layers": layers}


def _collectives(cand: Candidate, ctx: CostContext, stage_of: dict, mesh: Mesh, cluster) -> list:
    """Logical collectives: each stage's intra-stage resharding (``per_step``
    times: m per microbatch, once for gradient synchronisation) and one
    send_recv per crossing tensor per boundary per direction."""
    prof = cand.profile
    graph, layers, chosen = prof.graph, prof.grouping, prof.chosen
    grad = needs_grad(graph)
    inner = prof.submesh
    out = []
    m = cand.microbatches
    reshards = SharedReshards(len(inner.shape))
    for node in graph.nodes.values():
        s = chosen[node.name]
        stage = stage_of.get(node.name, len(cand.ranges) - 1)
        for idx, src in enumerate(node.inputs):
            backward = node.name in grad and src in grad
            if not reshards.pays(node, idx, src, s, backward):
                continue
            meta = graph.nodes[src].outputs[0]
            fwd, bwd = edge_moves(chosen[src].output, s, idx, meta, ctx, backward)
            for phase, moves in (("forward", fwd), ("backward", bwd)):
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
            "bubble_s": cand.bubble_s, "sync_s": cand.sync_s, "peak_memory_bytes": cand.memory_bytes,
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
    plan.recompute = _recompute_section(cand)
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


__all__ = ["compile_pipelined", "search_pipeline", "should_pipeline", "bubble_fraction", "group_layers",
           "Schedule", "Layers", "Candidate", "PipelineSearch", "profile", "partition", "evaluate",
           "inner_spec", "stage_ranges", "stage_rows", "build_pipeline_plan", "plan_from_candidate", "PP_AXIS"]
