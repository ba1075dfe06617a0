"""Activation recomputation: which ops run again in backward, as checkpointed regions.

A region is a run of ops, contiguous in the traced program, that codegen wraps
in one ``torch.utils.checkpoint`` call: autograd keeps only the region's inputs
and runs its forward again during backward.

- ``full`` recomputes every op of a layer (Chen et al. 2016, "Training Deep
  Nets with Sublinear Memory Cost"): a layer keeps only its input.
- ``selective`` recomputes, in each layer, the runs of ops between parameter
  uses whose recomputation frees more memory than the checkpoint's inputs add
  (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
  Transformer Models", sec. 4.2). In a transformer block that is the attention
  core: QK^T, softmax, dropout and the product with V keep O(s^2) activations
  for few FLOPs. The rule does not name attention; it follows from the memory
  model (``saved_outputs``), so it finds such runs in any layer.
"""
from __future__ import annotations

import math

from dataclasses import dataclass
from functools import cached_property

from autopar.cost_models.graph_costs import is_view, kept_outputs, needs_grad, saved_outputs, saves_input, storage
from autopar.errors import AutoparError
from autopar.ir import Graph, NodeKind
from autopar.passes.layer_classes import layer_of, layer_lists, parse_layer

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Recomputation:
    """The regions one plan recomputes, and what the cost model needs of them."""

    mode: str
    """"none", "selective", "full", or "partial" (full recomputation of some layers)."""
    layers: tuple = ()
    """(list path, index) of the layers with recomputed regions, sorted."""
    regions: tuple = ()
    """Node names of each region, in program order."""
    kept_inputs: frozenset = frozenset()
    """Op nodes whose output a checkpoint keeps for backward: each region's
    inputs from outside it (the storage behind a view)."""

    @cached_property
    def nodes(self) -> frozenset:
        """Every recomputed node (asked once per node and strategy while pricing)."""
        return frozenset(n for r in self.regions for n in r)

    @property
    def paths(self) -> list:
        return [f"{lst}.{i}" for lst, i in self.layers]

    def kept(self, graph: Graph) -> tuple[dict, set]:
        """``kept_outputs`` with the checkpoints' inputs kept whole: (the
        shares kept whatever the consumers' placements, the nodes kept only
        for consumers that save them as they read them)."""
        share, read = kept_outputs(graph)
        return {**share, **dict.fromkeys(self.kept_inputs, 1.0)}, \
            {name for name in read if storage(graph, name) not in self.kept_inputs}

    def drops(self, name: str) -> bool:
        """Whether a node's activations are not kept through the step (they
        are made again, and alive, only during its region's backward:
        autopar/timeline.py)."""
        return name in self.nodes and name not in self.kept_inputs


NONE = Recomputation("none")


def recomputation(graph: Graph, mode: str, layers=None, ctx=None) -> Recomputation:
    """Regions for ``mode`` ("none", "selective", "full", or "partial" with
    ``layers`` a subset of the numbered layers) over ``layers`` (default all).
    Selective regions are priced on ``ctx`` (a CostContext)."""
    if mode not in (*MODES, "partial"):
        raise AutoparError(f"recompute {mode!r} is not one of {MODES}")
    every = {(lst, i) for lst, idx in layer_lists(graph).items() for i in idx}
    layers = every if layers is None else set(layers)
    if mode == "none" or not layers:
        return NONE
    if mode == "partial" and layers == every:
        mode = "full"
    runs = _layer_runs(graph, layers)
    if mode == "selective":
        runs = _worth_recomputing(graph, runs, ctx)
    return with_regions(graph, mode, runs)


def with_regions(graph: Graph, mode: str, regions) -> Recomputation:
    """A Recomputation of the given regions (lists of node names)."""
    regions = tuple(tuple(r) for r in regions if r)
    if not regions:
        return NONE
    for r in regions:
        missing = [n for n in r if n not in graph.nodes or graph.nodes[n].kind is not NodeKind.OP]
        if missing:
            raise AutoparError(f"recompute region names {missing[:3]}, which are not ops of this model")
    chosen = tuple(sorted({layer_of(graph.nodes[r[0]]) for r in regions} - {None}))
    return Recomputation(mode, chosen, regions, _checkpoint_inputs(graph, regions))


def from_plan(graph: Graph, recompute: dict) -> Recomputation:
    """The regions a plan's ``recompute`` entry names (codegen's view of it):
    its ``regions`` if listed (selective), else every op of its ``layers``."""
    if recompute.get("regions"):
        return with_regions(graph, recompute.get("mode", "selective"), recompute["regions"])
    layers = {parse_layer(p) for p in recompute.get("layers", [])}
    return with_regions(graph, recompute.get("mode", "full"), _layer_runs(graph, layers)) if layers else NONE


def _layer_runs(graph: Graph, layers: set) -> list:
    """Each wanted layer's region: the op nodes from its first op to its last,
    in program order. Ops of no layer between them (the glue a parent's
    forward runs between a layer's submodules, e.g. a transpose between the
    modules of a ModuleDict block) belong to the region; another layer's ops
    there cannot, as one checkpoint would then run two layers."""
    order = [n.name for n in graph.gm.graph.nodes]
    ops = [n for n in order if n in graph.nodes and graph.nodes[n].kind is NodeKind.OP]
    span: dict = {}
    for k, name in enumerate(ops):
        key = layer_of(graph.nodes[name])
        if key in layers:
            span[key] = (span.get(key, (k, k))[0], k)
    runs = []
    for key in sorted(span):
        first, last = span[key]
        run = ops[first:last + 1]
        others = sorted({layer_of(graph.nodes[n]) for n in run} - {key, None})
        if others:
            lst, i = key
            raise AutoparError(f"layer {lst}.{i} is interleaved in the traced program with "
                               f"{', '.join(f'{a}.{b}' for a, b in others)}; one checkpoint cannot hold it "
                               "(compile with recompute='none')")
        runs.append(run)
    return runs


def _parameters_and_derived(graph: Graph) -> set:
    """Parameters and the ops computed from parameters alone (a transposed or cast weight)."""
    out = set()
    for node in graph.nodes.values():
        if node.kind is NodeKind.PARAM or (node.kind is NodeKind.OP and node.inputs
                                           and all(i in out for i in node.inputs)):
            out.add(node.name)
    return out


def _split_at_parameters(graph: Graph, run: list, from_params: set) -> list:
    """The pieces of a run between ops that read a parameter (a weight GEMM,
    a norm's scale): those ops stay out of selective regions."""
    pieces, piece = [], []
    for name in run:
        if name in from_params or any(i in from_params for i in graph.nodes[name].inputs):
            pieces.append(piece)
            piece = []
        else:
            piece.append(name)
    pieces.append(piece)
    return [p for p in pieces if p]


def _worth_recomputing(graph: Graph, layer_runs: list, ctx) -> list:
    """The pieces of each layer, between parameter uses, whose recomputation
    frees memory at least as cheaply as recomputing the whole layer would:
    bytes freed per second of recomputed forward no lower than the layer's."""
    kept, consumers, grad = saved_outputs(graph), graph.consumers(), needs_grad(graph)
    from_params = _parameters_and_derived(graph)
    out = []
    for run in layer_runs:
        whole = _per_second(_freed(graph, run, kept, consumers, grad), _forward_seconds(graph, run, ctx))
        for piece in _split_at_parameters(graph, run, from_params):
            freed = _freed(graph, piece, kept, consumers, grad)
            if freed > 0 and _per_second(freed, _forward_seconds(graph, piece, ctx)) >= whole:
                out.append(piece)
    return out


def _per_second(freed: float, seconds: float) -> float:
    """Bytes freed per second of forward recomputed; a region that computes
    nothing (views only) frees what it frees for free."""
    if seconds > 0:
        return freed / seconds
    return math.inf if freed > 0 else 0.0 if freed == 0 else -math.inf


def _freed(graph: Graph, region: list, kept: dict, consumers: dict, grad: set) -> float:
    """Bytes checkpointing ``region`` stops keeping: what its ops keep for
    backward (storage no outside consumer keeps), less the inputs the
    checkpoint keeps that nothing kept before."""
    inside = set(region)

    def kept_outside(name: str) -> bool:  # through views, which share the storage
        return any(c in grad and ((c not in inside and saves_input(graph.nodes[c]))
                                  or (is_view(graph.nodes[c]) and kept_outside(c)))
                   for c, _ in consumers.get(name, []))

    freed = sum(kept.get(n, 0.0) * sum(m.nbytes for m in graph.nodes[n].outputs) for n in region
                if n in grad and not is_view(graph.nodes[n]) and not kept_outside(n))
    added = sum(sum(m.nbytes for m in graph.nodes[b].outputs)
                for b in _checkpoint_inputs(graph, [region]) if b in grad and not kept.get(b, 0.0))
    return freed - added


def _forward_seconds(graph: Graph, region: list, ctx) -> float:
    from autopar.cost_models.graph_costs import node_compute
    from autopar.passes.strategy import R, Strategy
    n_axes = len(ctx.mesh_shape)
    return sum(node_compute(graph.nodes[n], Strategy(((R,) * n_axes,) * len(graph.nodes[n].inputs),
                                                     (R,) * n_axes), ctx, False)[0] for n in region)


def _checkpoint_inputs(graph: Graph, regions) -> frozenset:
    out = set()
    for region in regions:
        inside = set(region)
        for name in region:
            for src in graph.nodes[name].inputs:
                if src not in inside:
                    base = storage(graph, src)
                    if graph.nodes[base].kind is NodeKind.OP:
                        out.add(base)
    return frozenset(out)


