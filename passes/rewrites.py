"""Capture's rewrites of the exported ATen graph, each a named fx pass:
GraphModule in, ``PassResult(graph_module, modified)`` out (torch.fx's pass
contract), run in this order by autopar/capture.py (``REWRITES``):

    inline_constants     small constants lifted out of forward -> factories in the graph
    inline_autocast      torch.autocast blocks -> their ops, autocast's casts written out
    inline_no_grad       torch.no_grad blocks -> their ops, each input detached
    drop_device_moves    x.to(device) -> its dtype conversion only
    scatter_write_back   x[:, 0] = v on an activation read later -> out of place + select/slice_scatter
    out_of_place         other in-place ops on activations -> their out-of-place forms

Capture tags the placeholders first: ``meta[KIND]`` (NodeKind.PARAM, BUFFER,
INPUT), ``meta[FQN]`` (the parameter's or buffer's name) and, for a constant
torch.export lifted, ``meta[CONSTANT]`` (its value).
"""
from __future__ import annotations

import operator
import warnings

import torch
import torch.fx as fx
from torch.fx.passes.infra.pass_base import PassResult

from autopar.errors import AutoparError
from autopar.ir import NodeKind

KIND, FQN, CONSTANT = "autopar_kind", "autopar_fqn", "autopar_constant"
"""Placeholder meta keys capture sets before the rewrites run."""


def module_path(node: fx.Node) -> str:
    """The module path an op was called from (``blocks.3.attn``), '' at the top level."""
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



SMALL_CONSTANT = 64
"""The most elements a constant written in forward may have to be inlined
as factories (one ``scalar_tensor`` each); a larger one must be a buffer."""


def inlinable(value) -> bool:
    """Whether ``inline_constants`` rebuilds a constant of this value in the graph."""
    return isinstance(value, torch.Tensor) and not value.is_complex() and value.numel() <= SMALL_CONSTANT


def inline_constants(gm: fx.GraphModule) -> PassResult:
    """Constants torch.export lifts out of forward as tensors become
    factories in the graph (replicated, as every rank makes the same): a
    scalar (the 0.0 of ``x[:, 0] = 0.0``) a ``scalar_tensor``, an empty
    tensor (``torch.tensor([])``, as Hugging Face's caches start) an
    ``empty``, a small one (the index list of ``x[..., [-2], :]``) its
    elements' ``scalar_tensor`` stacked and viewed to its shape; their
    placeholders (``meta[CONSTANT]``: the value, set by capture) and the
    ``lift_fresh_copy`` that copied them go."""
    removed = False
    body = next(n for n in gm.graph.nodes if n.op != "placeholder")
    aten = torch.ops.aten
    for ph in [n for n in gm.graph.nodes if n.op == "placeholder"]:
        value = ph.meta.get(CONSTANT)
        if not inlinable(value):
            continue
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
        removed = True
    if removed:
        gm.recompile()
    return PassResult(gm, removed)




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


def updates_state(n: fx.Node) -> bool:
    """An in-place op on a buffer (directly, through earlier in-place ops or
    through views of it): state that persists across steps."""
    if n.op != "call_function" or not writes_first_input(n.target):
        return False
    root = _overwritten_root(n)
    return root.op == "placeholder" and root.meta.get(KIND) is NodeKind.BUFFER


_GRAD_MODE = torch.ops.higher_order.wrap_with_set_grad_enabled
_AUTOCAST = torch.ops.higher_order.wrap_with_autocast
# Conversions run as written under autocast (it does not cast their inputs).
_CONVERSIONS = {torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout, torch.ops.aten._to_copy.default,
                torch.ops.aten.type_as.default, torch.ops.aten.to.device}


def inline_autocast(gm: fx.GraphModule) -> PassResult:
    """``with torch.autocast(device, dtype):`` blocks trace to higher-order
    ops calling a subgraph; their ops are inlined into the step, each with
    the casts autocast gives its inputs, written out as ``_to_copy`` nodes
    (``_autocast_op``), so the step computes in the dtypes the model does on
    one device; a block that disables autocast is inlined as it is. Blocks
    inside no_grad blocks too (those stay for ``inline_no_grad``)."""
    return PassResult(gm, _inline_autocast(gm, None))


def _inline_autocast(gm: fx.GraphModule, autocast: tuple | None) -> bool:
    """``autocast``: the (device, dtype, cache) in force around ``gm``'s ops."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op != "call_function":
            continue
        if n.target is _GRAD_MODE:
            changed |= _inline_autocast(getattr(gm, n.args[1].target), autocast)
        elif n.target is _AUTOCAST:
            device, dtype, enabled, cache, sub, *operands = n.args
            here = {a.meta["val"].device.type for a in operands if isinstance(a.meta.get("val"), torch.Tensor)}
            if enabled and here and here != {device}:
                warnings.warn(
                    f"torch.autocast({device!r}, dtype={dtype}) at {module_path(n) or 'the top level'} was traced "
                    f"on {'/'.join(sorted(here))} tensors, which it does not cast: the block is planned and run in "
                    f"the dtypes it computes in here (no {dtype} casts); capture the model on the device type it "
                    "trains on", stacklevel=4)
            _inline_autocast(getattr(gm, sub.target), (device, dtype, cache) if enabled else None)
            _splice(gm, n, sub, operands, detach=False)
            changed = True
        elif autocast is not None and isinstance(n.target, torch._ops.OpOverload) and n.target not in _CONVERSIONS:
            _autocast_op(gm, n, *autocast)
            changed = True
    if changed:
        gm.recompile()
    return changed


def inline_no_grad(gm: fx.GraphModule) -> PassResult:
    """``with torch.no_grad():`` blocks trace to higher-order ops calling a
    subgraph; their ops are inlined into the step, each input of the block
    passing through ``detach`` first, so no gradient flows through them (a
    block that enables grad is inlined as it is)."""
    changed = False
    for n in list(gm.graph.nodes):
        if n.op == "call_function" and n.target is _GRAD_MODE:
            enabled, sub, *operands = n.args
            inline_no_grad(getattr(gm, sub.target))
            _splice(gm, n, sub, operands, detach=not enabled)
            changed = True
    if changed:
        gm.recompile()
    return PassResult(gm, changed)


def drop_device_moves(gm: fx.GraphModule) -> PassResult:
    """``x.to(device)`` (Hugging Face moves its rotary tables to the input's
    device) names the device the model was traced on; in the program every
    tensor already lives on its rank's device, so a move keeps only its dtype
    conversion: ``to.device`` becomes ``to.dtype``, a ``_to_copy`` loses its
    ``device`` argument."""
    changed = False
    for n in gm.graph.nodes:
        if n.target is torch.ops.aten.to.device:
            x, _, dtype, *rest = n.args
            n.target, n.args = torch.ops.aten.to.dtype, (x, dtype, *rest)
            changed = True
        elif n.target is torch.ops.aten._to_copy.default and "device" in n.kwargs:
            n.kwargs = {k: v for k, v in n.kwargs.items() if k != "device"}
            changed = True
    if changed:
        gm.recompile()
    return PassResult(gm, changed)



def _cast(gm: fx.GraphModule, x: fx.Node, dtype: torch.dtype, meta: dict) -> fx.Node:
    """A ``_to_copy(x, dtype=dtype)`` node (inserted where the graph's
    insertion point is), its meta ``meta`` with the cast fake value."""
    cast = gm.graph.call_function(torch.ops.aten._to_copy.default, (x,), {"dtype": dtype})
    with x.meta["val"].fake_mode:
        cast.meta = {**meta, "val": x.meta["val"].to(dtype)}
    return cast


def _copy_in(gm: fx.GraphModule, n: fx.Node, graph: fx.Graph, inputs: list, meta: dict | None = None,
             skip=frozenset(), owner: fx.GraphModule | None = None):
    """Copy ``graph``'s ops into ``gm`` before ``n``, its placeholders bound
    to ``inputs``, leaving out the ops whose target is in ``skip`` (each
    copy's meta ``meta`` with its own fake value, where given); returns its
    output, mapped. A region ``graph`` calls (a get_attr of ``owner``, the
    module ``graph`` belongs to) moves into ``gm`` under a fresh name."""
    env = dict(zip([p for p in graph.nodes if p.op == "placeholder"], inputs))
    with gm.graph.inserting_before(n):
        for t in graph.nodes:
            if t.op == "placeholder" or t.target in skip:
                continue
            if t.op == "output":
                return fx.node.map_arg(t.args[0], lambda a: env[a])
            if t.op == "get_attr" and owner is not None:
                name = _fresh_attr(gm, t.target)
                gm.add_submodule(name, getattr(owner, t.target))
                env[t] = gm.graph.get_attr(name)
                env[t].meta = dict(t.meta)
                continue
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
    region = getattr(gm, sub.target)
    _replace_results(gm, n, _copy_in(gm, n, region.graph, operands, owner=region))
    if not sub.users:
        gm.graph.erase_node(sub)
        delattr(gm, sub.target)


def _fresh_attr(gm: fx.GraphModule, base: str) -> str:
    name, k = base, 0
    while hasattr(gm, name):
        k += 1
        name = f"{base}_{k}"
    return name


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


def _functional(target):
    """The out-of-place form of in-place ATen op ``target`` (``relu_`` -> ``relu``), or None."""
    packet = getattr(torch.ops.aten, target._overloadpacket.__name__.rstrip("_"), None)
    return _FUNCTIONAL.get(target) or getattr(packet, target._overloadname, None)


def _in_place_on_activations(gm: fx.GraphModule):
    """The in-place ops that do not update state (buffers), in graph order."""
    for n in gm.graph.nodes:
        if n.op == "call_function" and writes_first_input(n.target) and not updates_state(n):
            yield n


def _read_after(t: fx.Node, op: fx.Node, chain: fx.Node | None, order: dict) -> list:
    """Readers of ``t`` (or of a view of it) that run after ``op``, except ``chain``."""
    out = []
    for u in t.users:
        if u is chain:
            continue
        if order[u] > order[op]:
            out.append(u)
        elif _returns_view(u):
            out += _read_after(u, op, chain, order)
    return out


def scatter_write_back(gm: fx.GraphModule) -> PassResult:
    """An assignment through select/slice views of an activation that is
    read afterwards (``h[:, 0] = 0.0``, ``h[:, 1:3] += x``) runs out of place
    on the view and is written back through each view (``select_scatter``,
    ``slice_scatter``), later readers reading the written-back tensor, as
    functionalization does (``_scatter_back``). Other in-place ops are left
    for ``out_of_place``."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    changed = False
    for n in list(_in_place_on_activations(gm)):
        root = _overwritten_root(n)
        functional = _functional(n.target)
        if (root.op == "placeholder" and root.meta.get(KIND) is NodeKind.PARAM) or functional is None:
            continue  # refused by out_of_place, by name
        changed |= _scatter_back(gm, n, functional, order)
    if changed:
        gm.recompile()
    return PassResult(gm, changed)


def out_of_place(gm: fx.GraphModule) -> PassResult:
    """In-place ops on activations (``nn.ReLU(inplace=True)``, ``y += x``) become
    their out-of-place forms, which the sharding rules know and autograd
    accepts on the runtime's local tensors. That is exact when nothing reads
    the overwritten tensor afterwards (nor a view of it, nor, for a view, its
    base); otherwise the model is refused, naming the op. In-place updates of
    buffers (state) stay in place (runtime: spmd.state_update); of parameters,
    which are sharded, are refused."""
    order = {n: k for k, n in enumerate(gm.graph.nodes)}
    changed = False
    for n in list(_in_place_on_activations(gm)):
        where = module_path(n) or "the top level"
        root = _overwritten_root(n)
        if root.op == "placeholder" and root.meta.get(KIND) is NodeKind.PARAM:
            raise AutoparError(
                f"in-place op {n.target} at {where} overwrites parameter {root.meta[FQN]} during the forward; "
                "autopar shards parameters and cannot update them in the step: apply such an update outside "
                "the forward (e.g. after optimizer.step())")
        functional = _functional(n.target)
        if functional is None:
            raise AutoparError(f"in-place op {n.target} at {where} has no out-of-place form autopar can run "
                               "instead: write the model with the out-of-place op")
        chain, src = n, n.args[0]
        while True:  # the overwritten tensor, then up through views to their bases
            readers = _read_after(src, n, chain, order)
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
    return PassResult(gm, changed)


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


def _scatter_back(gm: fx.GraphModule, n: fx.Node, functional, order: dict) -> bool:
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
    if any(_read_after(view, n, child, order) for view, child in zip(chain, below)) or not _read_after(base, n, chain[-1], order):
        return False
    other_views = [u for u in base.users if u is not chain[-1] and _returns_view(u) and order[u] < order[n]]
    if any(_read_after(u, n, None, order) for u in other_views):
        return False  # a view taken before the write, read after it: refused below
    # The op's result aliases the base no more once it runs out of place: a
    # reader of it after a later in-place op would miss that op's write.
    writes = [m for m in gm.graph.nodes if order.get(m, -1) > order[n] and m.op == "call_function"
              and writes_first_input(m.target)]
    stale = [u for u in _readers(n) if writes and order.get(u, -1) > order[writes[0]]]
    if stale:
        raise AutoparError(
            f"in-place op {n.target} at {module_path(n) or 'the top level'} writes through a view of {base.name}, "
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


REWRITES = (inline_constants, inline_autocast, inline_no_grad, drop_device_moves, scatter_write_back, out_of_place)
"""Capture's rewrites, in the order they run."""
