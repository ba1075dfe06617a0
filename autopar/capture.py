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


def _module_path(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    path = path.replace("L['self'].", "").replace("L__self__.", "")
    for prefix in ("model.", "model"):
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


ASSERTIONS = {torch.ops.aten._assert_tensor_metadata.default}


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


SMALL_CONSTANT = 64
"""The most elements a constant written in forward may have to be inlined
as factories (one ``scalar_tensor`` each); a larger one must be a buffer."""


def _inline_constants(ep) -> set:
    """Constants torch.export lifts out of forward as tensors become
    factories in the graph (replicated, as every rank makes the same): a
    scalar (the 0.0 of ``x[:, 0] = 0.0``) a ``scalar_tensor``, an empty
    tensor (``torch.tensor([])``, as Hugging Face's caches start) an
    ``empty``, a small one (the index list of ``x[..., [-2], :]``) its
    elements' ``scalar_tensor`` stacked and viewed to its shape; their
    placeholders and the ``lift_fresh_copy`` that copied them go. Returns the
    placeholders removed."""
    gm, removed = ep.graph_module, set()
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    body = next(n for n in gm.graph.nodes if n.op != "placeholder")
    aten = torch.ops.aten
    for spec in ep.graph_signature.input_specs:
        value = ep.constants.get(spec.target) if spec.kind.name == "CONSTANT_TENSOR" else None
        if not isinstance(value, torch.Tensor) or value.is_complex() or value.numel() > SMALL_CONSTANT:
            continue
        ph = placeholders[spec.arg.name]
        fake = ph.meta["val"].fake_mode
        where = {"dtype": value.dtype, "device": value.device}  # the rank's device, at run time

        def make(target, args, kwargs=None):
            node = gm.graph.call_function(target, args, kwargs or {})
            with fake:
                node.meta = {**ph.meta, "val": target(*fx.node.map_arg(args, lambda a: a.meta["val"]),
                                                      **(kwargs or {}))}
            return node

        with gm.graph.inserting_before(body):
            if value.dim() == 0:
                made = make(aten.scalar_tensor.default, (value.item(),), where)
            elif value.numel() == 0:
                made = make(aten.empty.memory_format, (list(value.shape),), where)
            else:
                items = [make(aten.scalar_tensor.default, (v,), where) for v in value.flatten().tolist()]
                made = make(aten.view.default, (make(aten.stack.default, (items,)), list(value.shape)))
        for user in list(ph.users):
            if user.target is aten.lift_fresh_copy.default:
                user.replace_all_uses_with(made)
                gm.graph.erase_node(user)
        ph.replace_all_uses_with(made)
        gm.graph.erase_node(ph)
        removed.add(spec.arg.name)
    if removed:
        gm.recompile()
    return removed


def _to_graph(ep, n_inputs: int, has_loss: bool) -> Graph:
    gm = ep.graph_module
    sig = ep.graph_signature
    kinds = {}
    params, buffers = {}, {}
    user_index = 0
    inlined = _inline_constants(ep)
    for spec in sig.input_specs:
        name = spec.arg.name
        k = spec.kind.name
        if name in inlined:
            continue
        if k == "PARAMETER":
            kinds[name] = (NodeKind.PARAM, _strip(spec.target), -1)
            params[_strip(spec.target)] = name
        elif k == "BUFFER":
            kinds[name] = (NodeKind.BUFFER, _strip(spec.target), -1)
            buffers[_strip(spec.target)] = name
        elif k == "CONSTANT_TENSOR":
            raise AutoparError(
                f"the model creates a constant tensor in forward ({spec.target}, e.g. a torch.tensor([...]) "
                f"literal) of more than {SMALL_CONSTANT} elements; autopar needs it as a registered buffer "
                "(self.register_buffer(...)) so that every rank can place it"
            )
        elif k == "USER_INPUT":
            kinds[name] = (NodeKind.INPUT, f"input[{user_index}]", user_index)
            user_index += 1
        else:
            raise AutoparError(f"unsupported graph input kind {k} for {name}")
    node_kinds = {name: kind for name, (kind, _, _) in kinds.items()}
    _inline_regions(gm)
    _drop_device_moves(gm)
    _out_of_place(gm, node_kinds, {name: fqn for name, (_, fqn, _) in kinds.items()})
    mutated = [s for s in sig.output_specs if s.kind.name != "USER_OUTPUT"]
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
                    f"{op_label(n.target)} at {_module_path(n) or 'the top level'} (node {n.name}) makes a tensor "
                    f"of shape {shape}, a size that depends on the values of its input (masked_select, nonzero, "
                    "boolean-mask indexing, unique); autopar plans tensors of fixed shapes: write it with a "
                    "fixed-shape op (torch.where, masked_fill, multiplying by the mask)") from None
            nodes[n.name].state_update = updates_state(n, node_kinds)
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


def writes_first_input(target) -> bool:
    """Whether an ATen op updates its first argument in place (``relu_``, ``add_``)."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.arguments:
        return False
    alias = schema.arguments[0].alias_info
    return alias is not None and alias.is_write


def _returns_view(n: fx.Node) -> bool:
    if n.op != "call_function":
        return False
    if n.target is operator.getitem:  # an item of split/unbind is a view; of topk, a tensor of its own
        return isinstance(n.args[0], fx.Node) and _returns_view(n.args[0])
    schema = getattr(n.target, "_schema", None)
    aliases = bool(schema and schema.returns and schema.returns[0].alias_info is not None
                   and not schema.returns[0].alias_info.is_write)
    return aliases and (n.target not in _VIEW_WHEN_IT_CAN or _viewed(n))


_VIEW_WHEN_IT_CAN = {torch.ops.aten.contiguous.default, torch.ops.aten.reshape.default}
"""Ops whose schema says they may alias their input, which copy when the
input's strides do not allow a view (``x.permute(1, 0).contiguous()``,
BEiT's relative coordinates, is a new tensor that may be written in place)."""


def _viewed(n: fx.Node) -> bool:
    src, out = n.args[0].meta.get("val"), n.meta.get("val")
    if not isinstance(src, torch.Tensor) or not isinstance(out, torch.Tensor):
        return True  # unknown: assume it aliases, the safe side for in-place checks
    if n.target is torch.ops.aten.contiguous.default:
        return src.is_contiguous(memory_format=n.kwargs.get("memory_format", torch.contiguous_format))
    try:
        src.view(out.shape)
    except RuntimeError:
        return False
    return True


def _overwritten_root(n: fx.Node) -> fx.Node:
    """The tensor an in-place op overwrites, followed up through earlier
    in-place ops and views (``ema.mul_(d).add_(x)``, ``buf[0].add_(1)``,
    a ``detach`` under no_grad) to the node that owns the storage."""
    src = n.args[0]
    while src.op == "call_function" and (writes_first_input(src.target) or _returns_view(src)):
        src = src.args[0]
    return src


def updates_state(n: fx.Node, kinds: dict) -> bool:
    """An in-place op on a buffer (directly, through earlier in-place ops or
    through views of it): state that persists across steps."""
    if n.op != "call_function" or not writes_first_input(n.target):
        return False
    root = _overwritten_root(n)
    return root.op == "placeholder" and kinds.get(root.name) is NodeKind.BUFFER


_GRAD_MODE = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
# Conversions run as written under autocast (it does not cast their inputs).
_CONVERSIONS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
                torch.ops.aten.type_as.default, torch.ops.aten.to.device}


def _inline_regions(gm: fx.GraphModule, autocast: tuple | None = None) -> None:
    """Blocks in forward that change a mode trace to higher-order ops calling
    a subgraph; their ops are inlined into the step:

    - ``with torch.no_grad():`` each input of the region passes through
      ``detach``, so no gradient flows through its ops (a region that enables
      grad is inlined as it is);
    - ``with torch.autocast(device, dtype):`` each op gets the casts autocast
      gives its inputs, written out as ``_to_copy`` nodes (see
      ``_autocast_op``), so the step computes in the dtypes the model does on
      one device; a region that disables autocast is inlined as it is.

    ``autocast`` is the (device, dtype, cache) in force around ``gm``'s ops."""
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is _GRAD_MODE:
            enabled, sub, *operands = n.args
            _inline_regions(getattr(gm, sub.target), autocast)
            _splice(gm, n, sub, operands, detach=not enabled)
        elif n.target is _AUTOCAST:
            device, dtype, enabled, cache, sub, *operands = n.args
            here = {a.meta["val"].device.type for a in operands if isinstance(a.meta.get("val"), torch.Tensor)}
            if enabled and here and here != {device}:
                warnings.warn(
                    f"torch.autocast({device!r}, dtype={dtype}) at {_module_path(n) or 'the top level'} was traced "
                    f"on {'/'.join(sorted(here))} tensors, which it does not cast: the block is planned and run in "
                    f"the dtypes it computes in here (no {dtype} casts); capture the model on the device type it "
                    "trains on", stacklevel=2)
            _inline_regions(getattr(gm, sub.target), (device, dtype, cache) if enabled else None)
            _splice(gm, n, sub, operands, detach=False)
        elif autocast is not None and isinstance(n.target, torch._ops.OpOverload) and n.target not in _CONVERSIONS:
            _autocast_op(gm, n, *autocast)
    gm.recompile()


def _drop_device_moves(gm: fx.GraphModule) -> None:
    """``x.to(device)`` (Hugging Face moves its rotary tables to the input's
    device) names the device the model was traced on; in the program every
    tensor already lives on its rank's device, so a move keeps only its dtype
    conversion: ``to.device`` becomes ``to.dtype``, a ``_to_copy`` loses its
    ``device`` argument."""
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.to.device:
            x, _, dtype, *rest = n.args
            n.target, n.args = torch.ops.aten.to.dtype, (x, dtype, *rest)
        elif n.target is torch.ops.aten._to_copy.default and "device" in n.kwargs:
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "device"}
    gm.recompile()


def _cast(gm: fx.GraphModule, x: fx.Node, dtype: torch.dtype, meta: dict) -> fx.Node:
    """A ``_to_copy(x, dtype=dtype)`` node (inserted where the graph's
    insertion point is), its meta ``meta`` with the cast fake value."""
    cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
    with x.meta["val"].fake_mode:
        cast.meta = {**meta, "val": x.meta["val"].to(dtype)}
    return cast


def _copy_in(gm: fx.GraphModule, n: fx.Node, graph: fx.Graph, inputs: list, meta: dict | None = None,
             skip=frozenset()):
    """Copy ``graph``'s ops into ``gm`` before ``n``, its placeholders bound
    to ``inputs``, leaving out the ops whose target is in ``skip`` (each
    copy's meta ``meta`` with its own fake value, where given); returns its
    output, mapped."""
    env = dict(zip([p for p in graph.nodes if p.op == "placeholder"], inputs))
    with gm.graph.inserting_before(n):
        for t in graph.nodes:
            if t.op == "placeholder" or t.target in skip:
                continue
            if t.op == "output":
                return fx.node.map_arg(t.args[0], lambda a: env[a])
            env[t] = gm.graph.node_copy(t, lambda a: env[a])
            if meta is not None:
                env[t].meta = {**meta, "val": t.meta.get("val")}


def _replace_results(gm: fx.GraphModule, n: fx.Node, result) -> None:
    """Point ``n``'s readers at ``result`` (for a tuple, each ``getitem(n, k)``
    at its k-th node) and drop ``n``."""
    if isinstance(result, fx.Node):
        n.replace_all_uses_with(result)
    else:
        for u in list(n.users):
            u.replace_all_uses_with(result[u.args[1]])
            gm.graph.erase_node(u)
    gm.graph.erase_node(n)


def _splice(gm: fx.GraphModule, n: fx.Node, sub: fx.Node, operands: list, detach: bool) -> None:
    """Replace the region call ``n`` by a copy of its subgraph's ops (with
    ``detach``, each operand cut from autograd first)."""
    if detach:
        with gm.graph.inserting_before(n):
            operands = [_detached(gm, a) for a in operands]
    _replace_results(gm, n, _copy_in(gm, n, getattr(gm, sub.target).graph, operands))
    if not sub.users:
        gm.graph.erase_node(sub)
        delattr(gm, sub.target)


def _detached(gm: fx.GraphModule, x: fx.Node) -> fx.Node:
    cut = gm.graph.call_function(torch.ops.aten.detach.default, (x,))
    cut.meta = {**x.meta, "val": x.meta["val"].detach()}
    return cut


def _autocast_op(gm: fx.GraphModule, n: fx.Node, device: str, dtype: torch.dtype, cache: bool) -> None:
    """Write out the casts autocast applies to op ``n``'s tensor inputs.

    Which inputs autocast casts, and to what, is torch's own policy per op and
    device (lower precision for matmuls and convolutions, float32 for
    reductions and norms, the widest type for mixed inputs): it is read off by
    tracing the op alone under ``torch.autocast`` on fake tensors, where the
    casts show as ``_to_copy`` of its inputs. An op that autocast reaches only
    inside its decomposition (``einsum``'s ``bmm`` on float32 inputs) casts
    mid-way, which no input cast can write: it is replaced by that traced
    decomposition, casts included."""
    from torch.fx.experimental.proxy_tensor import make_fx
    slots = [a for a in n.all_input_nodes if isinstance(a.meta.get("val"), torch.Tensor)]
    if not any(a.meta["val"].is_floating_point() for a in slots):
        return
    vals = [a.meta["val"] for a in slots]

    def alone(*tensors):
        env = dict(zip(slots, tensors))
        args, kwargs = fx.node.map_arg((n.args, n.kwargs), lambda a: env.get(a, a.meta.get("val")))
        with torch.autocast(device, dtype=dtype, cache_enabled=cache):
            return n.target(*args, **kwargs)

    with vals[0].fake_mode:
        traced = make_fx(alone)(*vals)
    inputs = [p for p in traced.graph.nodes if p.op == "placeholder"]
    casts, cast_nodes = {}, set()
    for slot, p in zip(slots, inputs):
        for u in p.users:
            if u.target is torch.ops.aten._to_copy.default and set(u.kwargs) == {"dtype"}:
                casts[slot] = u.kwargs["dtype"]
                cast_nodes.add(u)
    inner = [c for c in traced.graph.nodes if c.target is torch.ops.aten._to_copy.default and c not in cast_nodes]
    if inner:  # cast mid-way: n becomes its traced decomposition
        _replace_results(gm, n, _copy_in(gm, n, traced.graph, slots, n.meta, skip=ASSERTIONS))
        return
    with gm.graph.inserting_before(n):
        for slot, to in casts.items():
            if slot.meta["val"].dtype == to:
                continue
            n.replace_input_with(slot, _cast(gm, slot, to, n.meta))


def _out_of_place(gm: fx.GraphModule, kinds: dict, fqns: dict) -> None:
    """In-place ops on activations (``nn.ReLU(inplace=True)``, ``y += x``) become
    their out-of-place forms, which the sharding rules know and autograd
    accepts on the runtime's local tensors. That is exact when nothing reads
    the overwritten tensor afterwards (nor a view of it, nor, for a view, its
    base); otherwise the model is refused, naming the op. In-place updates of
    buffers (state) stay in place (runtime: spmd.state_update); of parameters,
    which are sharded, are refused."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}

    def read_after(t: fx.Node, op: fx.Node, chain: fx.Node) -> list:
        """Readers of ``t`` (or of a view of it) that run after ``op``."""
        out = []
        for u in t.users:
            if u is chain:
                continue
            if order[u] > order[op]:
                out.append(u)
            elif _returns_view(u):
                out += read_after(u, op, chain)
        return out

    changed = False
    for n in gm.graph.nodes:
        if n.op != "call_function" or not writes_first_input(n.target) or updates_state(n, kinds):
            continue
        where = _module_path(n) or "the top level"
        root = _overwritten_root(n)
        if root.op == "placeholder" and kinds.get(root.name) is NodeKind.PARAM:
            raise AutoparError(
                f"in-place op {n.target} at {where} overwrites parameter {fqns[root.name]} during the forward; "
                "autopar shards parameters and cannot update them in the step: apply such an update outside "
                "the forward (e.g. after optimizer.step())")
        packet = getattr(torch.ops.aten, n.target._overloadpacket.__name__.rstrip("_"), None)
        functional = _FUNCTIONAL.get(n.target) or getattr(packet, n.target._overloadname, None)
        if functional is None:
            raise AutoparError(f"in-place op {n.target} at {where} has no out-of-place form autopar can run "
                               "instead: write the model with the out-of-place op")
        if _scatter_back(gm, n, functional, order, read_after):
            changed = True
            continue
        chain, src = n, n.args[0]
        while True:  # the overwritten tensor, then up through views to their bases
            readers = read_after(src, n, chain)
            if readers:
                raise AutoparError(
                    f"in-place op {n.target} at {where} overwrites {src.name}, which "
                    f"{', '.join(u.name for u in readers)} read afterwards; autopar runs in-place ops on "
                    "activations as their out-of-place forms, exact only when nothing reads the old tensor "
                    "again: write the model with the out-of-place op (e.g. inplace=False)")
            if not _returns_view(src):
                break
            chain, src = src, src.args[0]
        _run_out_of_place(gm, n, functional)
        changed = True
    if changed:
        gm.recompile()


_FUNCTIONAL = {torch.ops.aten.bernoulli_.float: torch.ops.aten.bernoulli.p,
               torch.ops.aten.normal_.default: torch.ops.aten.normal_functional.default}
"""In-place ops whose out-of-place form is not named after them (timm's
DropPath draws its mask with ``x.new_empty(...).bernoulli_(keep)``)."""


def _run_out_of_place(gm: fx.GraphModule, n: fx.Node, functional) -> None:
    """Make in-place ``n`` its out-of-place form. ``dst.copy_(src)``'s,
    aten.copy, has no derivative: it becomes src (in dst's dtype) expanded
    to dst's shape, which is what the copy holds."""
    if functional is not torch.ops.aten.copy.default:
        n.target = functional
        return
    dst, src = n.args[0], n.args[1]
    if isinstance(src, fx.Node) and src.meta["val"].dtype != dst.meta["val"].dtype:
        with gm.graph.inserting_before(n):
            src = _cast(gm, src, dst.meta["val"].dtype, src.meta)
    n.target, n.args, n.kwargs = torch.ops.aten.expand_as.default, (src, dst), {}


_SCATTERS = {torch.ops.aten.select.int: torch.ops.aten.select_scatter.default,
             torch.ops.aten.slice.Tensor: torch.ops.aten.slice_scatter.default}
"""The out-of-place write-back of each view an assignment may go through."""


def _scatter_back(gm: fx.GraphModule, n: fx.Node, functional, order: dict, read_after) -> bool:
    """``x[:, 0] = v`` and ``x[1:3] += y``: an in-place op on a chain of
    select/slice views of an activation that is read afterwards. Runs the op
    out of place on the view and writes the result back through each view
    (select_scatter, slice_scatter), and the readers after it read the
    written-back tensor, as functionalization does. False (nothing changed)
    where the pattern does not hold: no such view, a base that is not an
    op's result, or a view read again afterwards."""
    chain, v = [], n.args[0]
    while isinstance(v, fx.Node) and v.op == "call_function" and v.target in _SCATTERS:
        chain.append(v)
        v = v.args[0]
    base = v
    if not chain or not isinstance(base, fx.Node) or base.op != "call_function" or _returns_view(base):
        return False
    below = [n] + chain[:-1]  # each view's consumer along the chain
    if any(read_after(view, n, child) for view, child in zip(chain, below)) or not read_after(base, n, chain[-1]):
        return False
    other_views = [u for u in base.users if u is not chain[-1] and _returns_view(u) and order[u] < order[n]]
    if any(read_after(u, n, None) for u in other_views):
        return False  # a view taken before the write, read after it: refused below
    # The op's result aliases the base no more once it runs out of place: a
    # reader of it after a later in-place op would miss that op's write.
    writes = [m for m in gm.graph.nodes if order.get(m, -1) > order[n] and m.op == "call_function"
              and writes_first_input(m.target)]
    stale = [u for u in _readers(n) if writes and order.get(u, -1) > order[writes[0]]]
    if stale:
        raise AutoparError(
            f"in-place op {n.target} at {_module_path(n) or 'the top level'} writes through a view of {base.name}, "
            f"and {', '.join(u.name for u in stale)} read its result after {writes[0].name} writes in place again; "
            "autopar runs such writes out of place and cannot keep their results aliased: read the tensor "
            "again after the last write (or write the model without in-place ops)")
    later = [u for u in base.users if order[u] > order[n]]
    _run_out_of_place(gm, n, functional)
    current, anchor = n, n
    for view in chain:
        with gm.graph.inserting_after(anchor):
            current = gm.graph.call_function(_SCATTERS[view.target], (view.args[0], current, *view.args[1:]))
        current.meta = {**view.args[0].meta, "nn_module_stack": n.meta.get("nn_module_stack", {})}
        anchor = current
    for u in later:
        u.replace_input_with(base, current)
    order.update({m: k for k, m in enumerate(gm.graph.nodes)})
    return True


def _readers(t: fx.Node) -> list:
    """The nodes that read ``t``, directly or through views of it."""
    out = []
    for u in t.users:
        out.append(u)
        if _returns_view(u):
            out += _readers(u)
    return out


def _op_node(n: fx.Node, nodes: dict) -> Node:
    val = n.meta.get("val")
    if n.target is operator.getitem:
        src = n.args[0].name
        return Node(n.name, NodeKind.OP, operator.getitem, _module_path(n), [src], [_meta(val)], item=n.args[1])
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
        raise AutoparError(f"op {n.target} at {_module_path(n) or 'top level'} returns no tensor; not supported")
    info = OpInfo(n.target, tuple(args), dict(kwargs), metas, outputs)
    return Node(n.name, NodeKind.OP, n.target, _module_path(n), inputs, outputs, info)
