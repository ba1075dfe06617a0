"""A hand plan priced by the planner's own books: every parameter and input
placed as the hand plan places it, every op that reads a weight computing
on it where it is stored over the tensor-parallel axes and on its batch
shard over the data-parallel ones, the rest as the ILP finds cheapest; the
whole plan priced by the ILP and by ``build_plan``, as ``autopar compile``
prices what it chooses.

    plan = compile_pinned(model, inputs, mesh="dp=2,tp=4", cluster="dgx-h100", loss_fn=loss,
                          parameter_placements=megatron, input_placements={0: ["S(0)", "R"], 1: ["S(0)", "R"]})

The data-parallel axes are those the inputs are split over. On them a GEMM
may gather a weight stored sharded (ZeRO) but not the batch, so no op
escapes a gradient sync by computing on the whole batch (which the free ILP
does for an embedding, when that is cheaper than reducing the table's
gradient); on the others it computes where its weights are (tensor
parallelism: a column-split GEMM's input gradient is a partial sum,
all-reduced: Megatron-LM's f). That is how Megatron-LM and FSDP lay a model
out given where its weights and batch live; ``autopar estimate`` prices the
same plans from a transformer's shape, and tests/test_estimate.py holds the
two to 2%.
"""
from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard

from autopar.capture import capture
from autopar.ir import NodeKind
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.graph_costs import CostContext
from autopar.errors import AutoparError
from autopar.mesh import parse_mesh
from autopar.passes.enumerate import enumerate_strategies
from autopar.passes.recompute import recomputation
from autopar.passes.strategy import fmt_spec
from autopar.planner import build_plan
from autopar.solver import solve


def compile_pinned(model, example_inputs, *, mesh, cluster, loss_fn=None, parameter_placements: dict,
                   input_placements: dict, precision: str = "fp32", optimizer: str = "adamw",
                   recompute: str = "none", time_limit_s: float = 60.0):
    """The Plan of ``model`` with every parameter placed as
    ``parameter_placements`` says ({fqn: ["S(0)", "R", ...], a trailing
    "regather" for ZeRO-3}), every input as ``input_placements`` says
    ({input index: spec}), the ops that read weights held to them
    (``hand_strategies``) and the rest chosen by the ILP, priced by the ILP
    and by ``build_plan``."""
    mesh, cluster = parse_mesh(mesh), get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    graph = capture(model, example_inputs, loss_fn)
    strategies, _ = enumerate_strategies(graph, mesh.shape)
    strategies = {name: [s for s in ss if not s.offload] for name, ss in strategies.items()}
    ctx = CostContext.make(mesh.shape, cluster, optimizer, precision, offload=False)
    rc = recomputation(graph, recompute, None, ctx=ctx)
    pins = _placed(graph, strategies, parameter_placements, input_placements)
    strategies, pins = hand_strategies(graph, strategies, pins)
    solution = solve(graph, strategies, ctx, memory_budget=None, time_limit_s=time_limit_s, pinned=pins,
                     recomputed=rc)
    chosen = {name: strategies[name][i] for name, i in solution.choice.items()}
    plan = build_plan(graph, chosen, strategies, ctx, mesh, solution, None, rc)
    plan.recompute = {"mode": rc.mode, "layers": rc.paths}
    return plan


def hand_strategies(graph, strategies: dict, pins: dict) -> tuple[dict, dict]:
    """(strategies, pins) with every pinned node's strategies cut to its pin,
    and every op that reads a parameter cut to those that compute on the
    parameter as it is stored over each axis the inputs are not split over,
    and on the whole parameter (gathered, if stored sharded: ZeRO) and the
    batch shard (an input derived from the inputs, split) over each axis
    they are: the hand plan's layout. An op left with no strategy keeps all
    of them."""
    n_axes = len(next(iter(strategies.values()))[0].output)
    batch_axes = {a for name, i in pins.items() if graph.nodes[name].kind is NodeKind.INPUT
                  for a, p in enumerate(strategies[name][i].output) if isinstance(p, Shard)}
    batched = set()  # nodes derived from the inputs
    for node in graph.nodes.values():
        if node.kind is NodeKind.INPUT or any(i in batched for i in node.inputs):
            batched.add(node.name)
    out = {name: [ss[pins[name]]] if name in pins else list(ss) for name, ss in strategies.items()}
    for node in graph.nodes.values():
        weights = {idx: out[src][0].output for idx, src in enumerate(node.inputs)
                   if graph.nodes[src].kind is NodeKind.PARAM and src in pins}
        if node.kind is not NodeKind.OP or not weights:
            continue
        data = [idx for idx, src in enumerate(node.inputs) if src in batched]

        def hand(s) -> bool:
            return all(s.inputs[idx][a] == spec[a] if a not in batch_axes else isinstance(s.inputs[idx][a], Replicate)
                       for idx, spec in weights.items() for a in range(n_axes)) \
                and all(isinstance(s.inputs[idx][a], Shard) for idx in data for a in batch_axes)

        kept = [s for s in out[node.name] if hand(s)]
        out[node.name] = kept or out[node.name]
    return out, {name: 0 for name in pins}


def _placed(graph, strategies: dict, parameters: dict, inputs: dict) -> dict:
    """node -> strategy index of every parameter and input the hand plan places."""
    wanted = {graph.params[fqn]: spec for fqn, spec in parameters.items() if fqn in graph.params}
    unknown = sorted(set(parameters) - set(graph.params))
    if unknown:
        raise AutoparError(f"cannot place {unknown}: the model has no such parameters")
    for node in graph.nodes.values():
        if node.kind is NodeKind.INPUT and node.input_index in inputs:
            wanted[node.name] = inputs[node.input_index]
    pins = {}
    for name, spec in wanted.items():
        spec = list(spec)
        regather = bool(spec) and spec[-1] == "regather"
        text = "".join(spec[:-1] if regather else spec)
        options = [i for i, s in enumerate(strategies[name]) if fmt_spec(s.output) == text and s.regather == regather]
        if not options:
            valid = sorted({fmt_spec(s.output) + " regather" * s.regather for s in strategies[name]})
            raise AutoparError(f"cannot place {graph.nodes[name].fqn or name} as {' '.join(spec)}: valid placements "
                               f"are {valid}")
        pins[name] = options[0]
    return pins
