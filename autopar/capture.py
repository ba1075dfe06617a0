"""Capture: the training step's forward (model + loss) as an ATen-level fx graph.

``torch.export`` traces on fake tensors (node.meta["val"] holds a FakeTensor on
every node), so planning never runs the model; a model built on the meta device
traces without allocating parameters. The backward is not traced: every
strategy's backward cost and communication are derived from its forward rule
(see cost_models/resharding.py), and autograd produces the real backward at run
time through the same placements.
"""
from __future__ import annotations

import operator
import re
import warnings

import torch
import torch.fx as fx
from torch import nn

from autopar.errors import AutoparError, InputError
from autopar.ir import Graph, Node, NodeKind, OpInfo, TensorArg, TensorMeta, op_label
from autopar.passes.rewrites import (
    ASSERTIONS, CONSTANT, FQN, KIND, REWRITES, SMALL_CONSTANT, inlinable, module_path, updates_state,
)
from autopar.tracebacks import user_frames


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *args):
        *inputs, target = args
        return self.loss_fn(self.model(*inputs), target)


class _NoLoss(nn.Module):
    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, *args):
        return self.model(*args)


def _meta(v) -> TensorMeta | None:
    if isinstance(v, torch.Tensor):
        if any(isinstance(s, torch.SymInt) and not s.node.has_hint() for s in v.shape):
            raise _DataDependentShape(tuple(str(s) for s in v.shape))
        # a dynamic capture's sizes at their example values; int() would specialize them
        return TensorMeta(tuple(s.node.hint if isinstance(s, torch.SymInt) else int(s) for s in v.shape), v.dtype)
    return None


class _DataDependentShape(Exception):
    """A tensor whose size torch.export could only name symbolically (u0):
    it depends on the values of another tensor."""


_ASSIGNED = re.compile(r"The tensor attributes (.*) were assigned during export")


def _rnn_weight_cache_only(message: str) -> bool:
    """torch.export's warning that attributes were assigned while tracing,
    when they are all nn.LSTM/GRU/RNN's ``_flat_weights``: the layer
    re-points that list at its own parameters on every forward (and does so
    again after tracing), so there is nothing for the user to fix."""
    m = _ASSIGNED.search(message)
    return bool(m) and all(re.search(r"\._flat_weights\[\d+\]$", a.strip()) for a in m.group(1).split(","))


def capture(model: nn.Module, example_inputs: tuple, loss_fn=None, dynamic_shapes=None) -> Graph:
    """Trace ``loss_fn(model(*inputs[:-1]), inputs[-1])`` (or ``model(*inputs)``).

    ``dynamic_shapes``: torch.export's, one entry per example input (its dims
    that vary, as ``torch.export.Dim``; autopar/dynamic/graph.py makes it). The
    graph's shapes are then the example's, ``graph.gm`` keeps the symbolic
    sizes (``aten.sym_size`` nodes, SymInt arguments) and the ops' size
    arguments are SymInts: autopar/dynamic/ specializes it before planning."""
    if not isinstance(model, nn.Module):
        raise AutoparError(f"model must be an nn.Module, got {type(model).__name__}")
    example_inputs = tuple(example_inputs)
    if loss_fn is not None and len(example_inputs) < 2:
        raise AutoparError(
            f"with loss_fn, example_inputs must end with the target: got {len(example_inputs)} input(s), "
            "expected (input, ..., target)"
        )
    _check_inputs(example_inputs, loss_fn is not None)
    wrapper = _WithLoss(model, loss_fn) if loss_fn is not None else _NoLoss(model)
    state = _ModuleState(model)
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ep = torch.export.export(wrapper, example_inputs, strict=False,
                                     dynamic_shapes=None if dynamic_shapes is None else (tuple(dynamic_shapes),))
    except Exception as e:  # torch raises many types; keep the cause
        if _data_dependent(e):
            raise AutoparError(_branch_advice(e)) from e
        raise AutoparError(f"could not trace the model with torch.export: {type(e).__name__}: {e}") from e
    finally:
        assigned = state.restore()
    if assigned:
        warnings.warn(
            f"autopar: the model's forward assigned {', '.join(assigned)} while it was traced (state made on the "
            "first call); the trace computes it, and the model was left as it was before tracing, so its next "
            "eager forward makes it again. Create it in __init__ to make it a buffer the plan can place",
            stacklevel=2,
        )
    for w in caught:
        if not _rnn_weight_cache_only(str(w.message)):
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    graph = _to_graph(ep, len(example_inputs), loss_fn is not None)
    graph.tied = _tied(wrapper, graph)
    graph.training = model.training
    return graph


class _ModuleState:
    """Every submodule's attributes before tracing. torch.export runs the
    user's forward on fake tensors, so a forward that registers a buffer or
    caches a tensor on its first call (x-transformers' ALiBi, rotary caches)
    would leave a fake tensor in the model; ``restore`` puts every module's
    attributes back and names the tensors that forward assigned."""

    def __init__(self, model: nn.Module):
        self.saved = [
            (m, dict(m.__dict__), dict(m._parameters), dict(m._buffers), dict(m._modules),
             set(m._non_persistent_buffers_set))
            for m in model.modules()
        ]
        self.names = {id(m): name for name, m in model.named_modules()}

    def restore(self) -> list:
        assigned = []
        for m, attrs, params, buffers, modules, non_persistent in self.saved:
            prefix = self.names[id(m)] + "." if self.names[id(m)] else ""
            now = {**{k: v for k, v in m.__dict__.items() if isinstance(v, torch.Tensor)},
                   **m._parameters, **m._buffers}
            before = {**{k: v for k, v in attrs.items() if isinstance(v, torch.Tensor)}, **params, **buffers}
            assigned += [prefix + k for k, v in now.items() if before.get(k) is not v]
            m.__dict__.clear()
            m.__dict__.update(attrs)
            for live, old in ((m._parameters, params), (m._buffers, buffers), (m._modules, modules)):
                live.clear()
                live.update(old)
            m._non_persistent_buffers_set.clear()
            m._non_persistent_buffers_set.update(non_persistent)
        return sorted(set(assigned))


def _check_inputs(example_inputs: tuple, has_loss: bool) -> None:
    """Every example input is a tensor: the plan places and shards each one."""
    for i, x in enumerate(example_inputs):
        if not isinstance(x, torch.Tensor):
            what = "the target" if has_loss and i == len(example_inputs) - 1 else f"example input {i}"
            raise InputError(
                f"{what} is {x!r:.60} of type {type(x).__name__}, not a tensor; autopar traces and shards tensor "
                "inputs only: pass it as a tensor (e.g. torch.tensor(...)), or make it part of the model (a "
                "constructor argument or an attribute set before compiling) and leave it out of example_inputs")


def _data_dependent(e: Exception) -> bool:
    return type(e).__name__ in ("GuardOnDataDependentSymNode", "DataDependentOutputException") \
        or "data-dependent" in str(e).lower()


def _branch_advice(e: Exception) -> str:
    """A forward whose control flow depends on a tensor's value: where, and what to do."""
    frame = user_frames(e)[-1]
    where = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    cause = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    return (f"the forward depends on a tensor's value at {where}: an `if` or `while` on a tensor, or .item() / "
            "bool() of one. autopar traces one step for every batch, so the step's control flow cannot depend on "
            "the data. Fix: move the branch out of the traced step (decide it outside the model and compile a "
            "plan for each branch), or compute both sides and pick with torch.where(cond, a, b); torch.cond "
            f"expresses such a branch for torch.export, but autopar does not plan its subgraphs yet. "
            f"(torch.export: {type(e).__name__}: {cause})")


def _tied(wrapper: nn.Module, graph: Graph) -> dict:
    groups: dict = {}
    for fqn, p in wrapper.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(_strip(fqn))
    tied = {}
    for names in groups.values():
        placeholders = [graph.params[n] for n in names if n in graph.params]
        for ph in placeholders[1:]:
            tied[ph] = placeholders[0]
    return tied


def _strip(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def tag_placeholders(ep) -> tuple[dict, dict, dict]:
    """Tag the exported graph's placeholders for the rewrites
    (passes/rewrites.py: ``meta[KIND]``, ``meta[FQN]``, ``meta[CONSTANT]``);
    returns (placeholder -> (kind, name, input index), parameter name ->
    placeholder, buffer name -> placeholder)."""
    kinds, params, buffers = {}, {}, {}
    user_index = 0
    placeholders = {n.name: n for n in ep.graph_module.graph.nodes if n.op == "placeholder"}
    for spec in ep.graph_signature.input_specs:
        name, k, ph = spec.arg.name, spec.kind.name, placeholders[spec.arg.name]
        if k == "PARAMETER":
            kinds[name] = (NodeKind.PARAM, _strip(spec.target), -1)
            params[_strip(spec.target)] = name
        elif k == "BUFFER":
            kinds[name] = (NodeKind.BUFFER, _strip(spec.target), -1)
            buffers[_strip(spec.target)] = name
        elif k == "CONSTANT_TENSOR":
            ph.meta[CONSTANT] = ep.constants.get(spec.target)
            if not inlinable(ph.meta[CONSTANT]):
                raise AutoparError(
                    f"the model creates a constant tensor in forward ({spec.target}, e.g. a torch.tensor([...]) "
                    f"literal) of more than {SMALL_CONSTANT} elements; autopar needs it as a registered buffer "
                    "(self.register_buffer(...)) so that every rank can place it"
                )
            kinds[name] = (NodeKind.CONSTANT, spec.target, -1)
        elif k == "USER_INPUT":
            kinds[name] = (NodeKind.INPUT, f"input[{user_index}]", user_index)
            user_index += 1
        else:
            raise AutoparError(f"unsupported graph input kind {k} for {name}")
        ph.meta[KIND], ph.meta[FQN] = kinds[name][0], kinds[name][1]
    return kinds, params, buffers


def _to_graph(ep, n_inputs: int, has_loss: bool) -> Graph:
    kinds, params, buffers = tag_placeholders(ep)
    gm = ep.graph_module
    for rewrite in REWRITES:
        gm = rewrite(gm).graph_module
    mutated = [s for s in ep.graph_signature.output_specs if s.kind.name != "USER_OUTPUT"]
    if mutated:
        raise AutoparError(
            f"the model mutates state during forward ({[s.target for s in mutated]}); "
            "in-place buffer updates (e.g. BatchNorm running stats in train mode) are not supported yet: "
            "use model.eval() for such modules or a norm without running statistics"
        )

    nodes: dict = {}
    for n in gm.graph.nodes:
        if n.op == "placeholder":
            kind, fqn, idx = kinds[n.name]
            nodes[n.name] = Node(n.name, kind, fqn=fqn, outputs=[_meta(n.meta["val"])], input_index=idx)
        elif n.op == "call_function" and n.target in ASSERTIONS:
            continue  # checks of metadata export adds (e.g. for .to()); nothing to shard or run
        elif n.op == "call_function" and is_size(n):
            continue  # a symbolic size (dynamic capture): an argument of the ops that use it
        elif n.op == "call_function":
            try:
                nodes[n.name] = _op_node(n, nodes)
            except _DataDependentShape as e:
                shape = "(" + ", ".join(e.args[0]) + ")"
                raise AutoparError(
                    f"{op_label(n.target)} at {module_path(n) or 'the top level'} (node {n.name}) makes a tensor "
                    f"of shape {shape}, a size that depends on the values of its input (masked_select, nonzero, "
                    "boolean-mask indexing, unique); autopar plans tensors of fixed shapes: write it with a "
                    "fixed-shape op (torch.where, masked_fill, multiplying by the mask)") from None
            nodes[n.name].state_update = updates_state(n)
        elif n.op == "output":
            flat = []
            fx.node.map_arg(n.args[0], lambda a: flat.append(a.name))
            nodes["output"] = Node("output", NodeKind.OUTPUT, inputs=flat,
                                   outputs=[nodes[a].outputs[0] for a in flat])
        elif n.op == "get_attr":
            users = sorted({getattr(u.target, "__name__", str(u.target)) for u in n.users})
            raise AutoparError(f"the traced forward runs a subgraph ({n.target}) through {', '.join(users)}, a "
                               "higher-order op autopar does not inline (it inlines torch.no_grad and "
                               "torch.autocast blocks; torch.cond is one it does not): write the forward without it")
        else:
            raise AutoparError(f"unsupported fx node {n.op} {n.target}")
    from torch.utils._pytree import treespec_dumps
    return Graph(nodes, gm, params, buffers, n_inputs, has_loss, treespec_dumps(ep.call_spec.out_spec))


def is_size(n: fx.Node) -> bool:
    """A node computing a size, not a tensor: ``aten.sym_size`` of an input
    and arithmetic on such sizes, in a graph captured with dynamic shapes."""
    return isinstance(n.meta.get("val"), torch.SymInt)


def _op_node(n: fx.Node, nodes: dict) -> Node:
    val = n.meta.get("val")
    if n.target is operator.getitem:
        src = n.args[0].name
        return Node(n.name, NodeKind.OP, operator.getitem, module_path(n), [src], [_meta(val)], item=n.args[1])
    inputs, metas = [], []

    def lift(a):
        if isinstance(a, fx.Node):
            m = _meta(a.meta.get("val"))
            if m is None:
                return a.meta.get("val")
            inputs.append(a.name)
            metas.append(m)
            return TensorArg(len(metas) - 1, m)
        return a

    args = fx.node.map_aggregate(n.args, lift)
    kwargs = fx.node.map_aggregate(n.kwargs, lift)
    if isinstance(val, (tuple, list)):
        outputs = [_meta(v) for v in val if isinstance(v, torch.Tensor)]
    else:
        outputs = [_meta(val)] if isinstance(val, torch.Tensor) else []
    if not outputs:
        raise AutoparError(f"op {n.target} at {module_path(n) or 'top level'} returns no tensor; not supported")
    info = OpInfo(n.target, tuple(args), dict(kwargs), metas, outputs)
    return Node(n.name, NodeKind.OP, n.target, module_path(n), inputs, outputs, info)
