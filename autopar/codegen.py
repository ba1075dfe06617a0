"""Codegen: the captured graph rewritten as a per-rank SPMD program.

Each op runs on this rank's shards (plain tensors) placed as the plan says;
wherever a producer's placement differs from what its consumer's strategy
wants, a ``reshard`` call is inserted, which is the collective the plan lists
for that edge, and where gradients come back as partial sums they are summed
(see ``_Gradients``). The result
is an fx GraphModule, printed as readable Python; the runtime executes exactly
this source, and ``autopar codegen`` writes it next to a torchrun entry point.
"""
from __future__ import annotations

import linecache
import math
import operator
import os
import textwrap
import types

import torch
import torch.fx as fx
from torch.distributed.tensor import Partial, Replicate, Shard

from autopar import local_ops, spmd
from autopar.cost_models.collectives import BUCKET_BYTES
from autopar.capture import is_size
from autopar.errors import AutoparError, PlanError
from autopar.ir import Graph, NodeKind
from autopar.outputs import record_written, write_text
from autopar.passes.rules.factory import FACTORIES, RANDOM_FACTORIES
from autopar.cost_models.graph_costs import input_grad_spec
from autopar.cost_models.resharding import as_sum, producer_grad_spec
from autopar.passes.strategy import Strategy, divides, fmt_spec, local_shape, parse_spec
from autopar.plan import Plan

HEADER = '''"""Per-rank program emitted by autopar for mesh {mesh} on {cluster}.

Every value is this rank's shard, a plain tensor; ops run on it as they are.
Collectives are the calls below, with the mesh axes they run on:
`autopar_spmd_reshard(x, "<from>-><to>", "<grad from>-><grad to>")` moves a
value between placements (S(d) / R / P per mesh axis) and, in backward, its
gradient (a move from P is an all-reduce or, to S(d), a reduce-scatter);
`autopar_spmd_grad_allreduce(x, axes)` is the identity whose backward
all-reduces the gradient over those axes; `autopar_spmd_grad_share(x, axes)`
passes a whole gradient on coordinate 0 of those axes only (no collective);
`autopar_spmd_gather_params((w, ...), ("<from>-><to>", ...))` all-gathers a
bucket of sharded parameters and reduce-scatters their gradients in backward;
`autopar_spmd_prefetch_params` starts the next ZeRO-3 bucket's all-gather
there, finished where that bucket is gathered (`ahead=`).
`autopar_spmd_param(w, spec, axes)` leaves the all-reduce of a parameter's
gradient over `axes` (those that replicate it where its uses split their
work; elsewhere each rank has the whole gradient) to buckets launched while
backward runs, waited for at its end (autopar.gradsync.GradSync); `autopar_spmd_output` of a partial sum
(the loss) all-reduces it without waiting there. Predicted step time
{step:.3g} s, peak memory {mem:.3g} GiB per device.
"""
'''


_aten = torch.ops.aten
# Ops whose arguments are a global shape: they run as a reshape (or expand) of
# the local shard to the planned local shape.
RESHAPES = {
    _aten.view.default, _aten.reshape.default, _aten._unsafe_view.default, _aten.flatten.using_ints,
    _aten.unflatten.int, _aten.squeeze.dim, _aten.squeeze.dims, _aten.unsqueeze.default, _aten.expand.default,
}


def check_plan_matches(graph: Graph, plan: Plan, traced: Graph | None = None) -> None:
    """The plan is for this model, and each op's and parameter's placements are
    among those its sharding rule allows on the plan's mesh: a plan file
    edited by hand (or by another version) cannot run an op on shards where
    the local op is not exact. ``traced``: the graph the plan was compiled
    from, when ``graph`` is the same step in other dtypes (see ``same_steps``)."""
    fp, traced = plan.model.get("fingerprint"), traced or graph
    if fp != traced.fingerprint():
        raise PlanError(
            f"the plan was compiled for a different model or input shapes (fingerprint {fp}, "
            f"this model traces to {traced.fingerprint()}); recompile the plan for this model"
        )
    if traced is not graph:
        same_steps(traced, graph)
    from autopar.passes.enumerate import enumerate_strategies
    strategies, _ = enumerate_strategies(graph, plan.mesh.shape, warn=False)
    for spec in plan.nodes:
        node = graph.nodes.get(spec.name)
        if node is None or node.kind not in (NodeKind.OP, NodeKind.PARAM):
            continue
        allowed = {str(Strategy(s.inputs, s.output, items=s.items)) for s in strategies[spec.name]}
        if spec.strategy not in allowed:
            valid = sorted(allowed)
            raise PlanError(
                f"plan node {spec.name} ({node.op_name} at {node.fqn or 'the top level'}) has strategy "
                f"{spec.strategy}, which its sharding rule does not allow on mesh {plan.mesh}; valid: "
                f"{valid[:6]}{' ...' if len(valid) > 6 else ''}. The plan file was edited or is corrupt: "
                "recompile it")


def same_steps(a: Graph, b: Graph) -> None:
    """``b`` is the step ``a`` traced to, node for node (names, ops, module
    paths, inputs, output shapes), in other dtypes: the model and its inputs
    cast to float64 to check a float32 plan (autopar.verify)."""
    def steps(g):
        return [(n.name, n.op_name, n.fqn, n.inputs, [o.shape for o in n.outputs]) for n in g.nodes.values()]
    mine, theirs = steps(a), steps(b)
    if mine != theirs:
        first = next((x, y) for x, y in zip(mine + [None], theirs + [None]) if x != y)
        raise PlanError(f"the model in other dtypes traces to a different step (first difference: {first[0]} "
                        f"became {first[1]}); check the plan in the model's own dtype")


def build_program(graph: Graph, plan: Plan, local_inputs: bool = False, traced: Graph | None = None) \
        -> fx.GraphModule:
    """The per-rank program: a GraphModule whose forward takes the flat
    (parameters, buffers, inputs) and returns the flat outputs. Layers the plan
    recomputes become submodules run under activation checkpointing.
    ``traced``: the graph the plan was compiled from, when ``graph`` is that
    step in other dtypes (``check_plan_matches``).

    Emitted twice: the first pass records how every use of every value gives
    its gradient (``_Gradients``), the second writes the program with the
    gradient sums and shares that makes them add up."""
    check_plan_matches(graph, plan, traced)
    grads = _Gradients(plan.mesh.shape)
    _emit(graph, plan, local_inputs, grads)
    grads.solve()
    return _emit(graph, plan, local_inputs, grads)


def _emit(graph: Graph, plan: Plan, local_inputs: bool, grads: "_Gradients") -> fx.GraphModule:
    main, env = fx.Graph(), {}
    emit = _Emitter(graph, plan, local_inputs, grads, main)
    regions = _recompute_regions(graph, plan)
    region_of = {name: i for i, names in enumerate(regions) for name in names}
    root = torch.nn.Module()
    consumers = graph.consumers()
    done = set()
    for src in graph.gm.graph.nodes:
        if src.op == "call_function" and is_size(src):
            emit.size(main, env, src)
            continue
        if src.name in done or (src.op == "call_function" and src.name not in graph.nodes):
            continue  # already emitted in a recomputed layer, or an export assertion
        if src.name not in region_of:
            emit.node(main, env, src)
            continue
        i = region_of[src.name]
        names = regions[i]
        inside = set(names)
        sizes = list(dict.fromkeys(a.name for n in names for a in emit.fx_nodes[n].all_input_nodes if is_size(a)))
        externals = list(dict.fromkeys(p for n in names for p in graph.nodes[n].inputs if p not in inside)) + sizes
        outputs = [n for n in names if any(c not in inside for c, _ in consumers[n])]
        sub, sub_env = fx.Graph(), {}
        for e in externals:
            sub_env[e] = sub.placeholder(e)
        for k, (ph, d) in enumerate(emit.symbols.values()):  # a dynamic graph's sizes, for its local shapes
            key = ("size", str(list(emit.symbols)[k]))
            externals.append(key)
            emit._expr(main, env, list(emit.symbols)[k])
            sub_env[key] = sub.placeholder(f"{ph}_size{d}")
        for n in names:
            emit.node(sub, sub_env, emit.fx_nodes[n])
        sub.output(tuple(sub_env[o] for o in outputs))
        name = f"recompute_{_slug(regions_label(graph, names))}"
        name = name if not hasattr(root, name) else f"{name}_{i}"
        setattr(root, name, fx.GraphModule(torch.nn.Module(), sub, class_name=f"Recompute_{i}"))
        call = main.call_function(spmd.checkpoint, (main.get_attr(name), *[env[e] for e in externals]))
        call.name = f"{name}_out"
        for j, o in enumerate(outputs):
            env[o] = main.call_function(operator.getitem, (call, j))
            env[o].name = o
        done.update(names)
    main.lint()
    return fx.GraphModule(root, main, class_name="RankProgram")


class _Gradients:
    """Codegen's account of gradients, from the plan alone.

    A value of the program is a node's output (keyed by the node's name), a
    reshard of one ("<name>@<spec>") or one output of a multi-output op
    ("<name>@item"). Each use gives the value's gradient in placements that
    follow from its consumer's strategy (``grad_spec``): on a mesh axis where
    the value is replicated, a partial sum if the consumer splits its work
    there, the whole gradient otherwise. ``partial[key]``: the axes where the
    gradient of the value is summed as partial sums (some use gives one
    there; a parameter's sum is ``GradSync``'s, and where every use gives the
    whole gradient, as ops replicated over an axis do, each rank has it and
    nothing is reduced there, as the cost model prices it); a use that gives
    the whole gradient there passes it through ``grad_share``, and the sum
    happens where the value is made (``grad_allreduce``, or the ``reshard``
    that made it moves the partial sum on: "P->S(0)" is a reduce-scatter)."""

    def __init__(self, mesh_shape):
        self.sizes = tuple(mesh_shape)
        self.spec: dict = {}  # key -> placements (a P(avg) as the Partial sum it runs as)
        self.params: set = set()
        self.uses: dict = {}  # key -> the gradient placements of each use
        self.reshards: dict = {}  # reshard key -> its source's key, in program order
        self.partial: dict = {}
        self.gathers: dict = {}  # key -> (source, move, gathered bytes, group: see gather()), in program order
        self.buckets: list = []  # per bucket: its members (key, source, move)
        self.whole: list = []  # per bucket: the gathered axes where its gradients arrive whole (a slice, no sum)
        self.bucket_of: dict = {}
        self.solved = False

    def value(self, key: str, spec: str, param: bool = False) -> None:
        self.spec[key] = as_sum(parse_spec(spec, len(self.sizes)))
        if param:
            self.params.add(key)

    def use(self, key: str, grad: tuple) -> tuple:
        """Record a use's gradient placements; once solved, the axes where it must share."""
        if not self.solved:
            self.uses.setdefault(key, []).append(grad)
            return ()
        return tuple(a for a in self.partial.get(key, ()) if not isinstance(grad[a], Partial))

    def reshard(self, key: str, source: str) -> None:
        self.reshards.setdefault(key, source)

    def gather(self, key: str, source: str, move: str, nbytes: int, group: tuple) -> None:
        """A parameter's gather over some mesh axes (S(d) -> R there), a candidate for a bucket;
        ``group``: (the axes, dtype, the module that holds it where it is regathered, else None)."""
        if not self.solved:
            self.gathers.setdefault(key, (source, move, nbytes, group))

    def _buckets(self) -> None:
        """Consecutive gathers over the same axes (same dtype, ZeRO stage) into
        buckets of up to ``BUCKET_BYTES`` gathered, where the
        gradient comes back as the bucket's reduce-scatters would give it: a
        partial sum over the axes, placed as the shard elsewhere. A ZeRO-2
        copy lives until backward wherever it is gathered; a ZeRO-3 one is
        freed after its last use, so regathered parameters share a bucket
        only with those of the same module (FSDP2 shards per module too)."""
        open_: dict = {}
        for key, (source, move, nbytes, group) in self.gathers.items():
            axes = group[0]
            back, shard = self.arriving(key), self.arriving(source)
            if any(not isinstance(back[a], (Partial, Replicate)) for a in axes) or any(
                    b != p for a, (b, p) in enumerate(zip(back, shard)) if a not in axes):
                continue
            whole = tuple(a for a in axes if isinstance(back[a], Replicate))  # ops run whole there: no sum
            bucket = open_.get((group, whole))
            if bucket is None or bucket[1] + nbytes > BUCKET_BYTES:
                bucket = open_[group, whole] = [[], 0]
                self.buckets.append((bucket[0], whole, group[2] is not None))
            bucket[0].append((key, source, move))
            bucket[1] += nbytes
        # one parameter alone moves as its reshard does, unless it is regathered: a bucket of its
        # own is prefetched in forward (``_Emitter._prefetch``)
        kept = [(b, whole) for b, whole, regathered in self.buckets if len(b) > 1 or regathered]
        self.whole = [whole for _, whole in kept]
        self.buckets = [b for b, _ in kept]
        self.bucket_of = {key: i for i, b in enumerate(self.buckets) for key, _, _ in b}

    def solve(self) -> None:
        for key, source in reversed(self.reshards.items()):  # a reshard's uses before its source's
            self.partial[key] = self._axes(key)
            self.uses.setdefault(source, []).append(tuple(
                Partial() if a in self.partial[key] and isinstance(p, Replicate) else p
                for a, p in enumerate(producer_grad_spec(self.spec[source]))))
        for key in self.spec:
            if key not in self.partial:
                self.partial[key] = self._axes(key)
        self._buckets()
        self.solved = True

    def _axes(self, key: str) -> tuple:
        uses = self.uses.get(key, [])
        return tuple(a for a, p in enumerate(self.spec[key]) if isinstance(p, Replicate) and self.sizes[a] > 1
                     and any(isinstance(g[a], Partial) for g in uses))

    def arriving(self, key: str) -> tuple:
        """Where the gradient of the value arrives: whole (a partial value's
        gradient is the sum's), a partial sum on ``partial[key]``."""
        axes = self.partial.get(key, ())
        return tuple(Partial() if a in axes else p for a, p in enumerate(producer_grad_spec(self.spec[key])))

    def back(self, key: str, source: str) -> str:
        """The backward spec of the reshard ``key`` of ``source``."""
        return f"{fmt_spec(self.arriving(key))}->{fmt_spec(self.arriving(source))}"


def regions_label(graph: Graph, names: list) -> str:
    """"blocks_0" for a whole layer, "blocks_0_attn" for a region inside one:
    the module path its ops share (ops of the top level, glue between a
    layer's submodules, name none)."""
    paths = [graph.nodes[n].fqn.split(".") for n in names if graph.nodes[n].fqn]
    return "_".join(os.path.commonprefix(paths)) or "region"


def _recompute_regions(graph: Graph, plan: Plan) -> list[list[str]]:
    """Node names of each recomputed region, in program order (passes/recompute.py)."""
    from autopar.passes.recompute import from_plan
    try:
        return [list(r) for r in from_plan(graph, plan.recompute).regions]
    except AutoparError as e:
        raise PlanError(f"the plan's recompute entry does not fit this model: {e}") from None


class _Emitter:
    """Emits one captured node into an fx graph, with the reshards its strategy
    needs and the gradient sums and shares ``grads`` asks for."""

    def __init__(self, graph: Graph, plan: Plan, local_inputs: bool, grads: _Gradients, main: fx.Graph):
        self.graph, self.plan, self.local_inputs, self.grads = graph, plan, local_inputs, grads
        self.main = main  # the program's own graph (not a recomputed layer's)
        self.specs = {n.name: n for n in plan.nodes}
        self.inputs = {i["name"]: i for i in plan.inputs}
        self.fx_nodes = {n.name: n for n in graph.gm.graph.nodes}
        self.ndim = plan.mesh.ndim
        self.regather = {fqn for fqn, p in plan.parameters.items() if p.get("regather")}
        self.gathered: set = set()  # keys of values that may hold a regathered parameter's storage
        self.symbols = {d.node.expr: (n.name, k) for n in reversed(graph.gm.graph.nodes) if n.op == "placeholder"
                        and isinstance(n.meta.get("val"), torch.Tensor)
                        for k, d in enumerate(n.meta["val"].shape) if isinstance(d, torch.SymInt)}
        """A graph captured with dynamic shapes (autopar/dynamic): each size symbol's input and dim."""

    def size(self, g: fx.Graph, env: dict, src: fx.Node) -> None:
        """A size of a dynamic graph (``aten.sym_size`` of an input, arithmetic
        on sizes): computed in the program from the input it reads, whole (the
        program takes the global batch), so every size an op is given is the
        global one, as in a program of one size."""
        if src.target is torch.ops.aten.sym_size.int:
            x = src.args[0]
            if x.op != "placeholder" or self.graph.nodes[x.name].kind is not NodeKind.INPUT or self.local_inputs:
                raise PlanError(f"size {src.name} reads {x.name}: a dynamic program reads its sizes from its "
                                "global inputs only (not with local_inputs=True)")
            env[src.name] = g.call_function(torch.ops.aten.sym_size.int, (env[("raw", x.name)], *src.args[1:]))
        else:
            env[src.name] = g.node_copy(src, lambda a: env[a.name])
        env[src.name].name = src.name

    def _sizes(self, g: fx.Graph, env: dict, value) -> list:
        """A (global) shape whose entries are ints or, in a dynamic graph, SymInts:
        ints, and for each SymInt the program's expression for it."""
        return [self._expr(g, env, d.node.expr) if isinstance(d, torch.SymInt) else int(d) for d in value]

    def _expr(self, g: fx.Graph, env: dict, e):
        import sympy
        if e.is_Integer:
            return int(e)
        key = ("size", str(e))
        if key in env:
            return env[key]
        if e in self.symbols:  # read off the (global) input it is a dim of
            ph, d = self.symbols[e]
            env[key] = self._named(g.call_function(torch.ops.aten.sym_size.int, (env[("raw", ph)], d)),
                                   f"{ph}_size{d}")
            return env[key]
        args = [self._expr(g, env, a) for a in e.args]
        if isinstance(e, sympy.Add):
            fn = operator.add
        elif isinstance(e, sympy.Mul):
            fn = operator.mul
        elif isinstance(e, sympy.Pow) and e.exp.is_Integer and e.exp > 0:
            args, fn = [args[0]] * int(e.exp), operator.mul
        elif type(e).__name__ == "FloorDiv":
            fn = operator.floordiv
        else:
            raise PlanError(f"cannot write the size {e} into the program ({type(e).__name__}); autopar plans sizes "
                            "that are sums, products and floor divisions of the symbols")
        out = args[0]
        for a in args[1:]:
            out = self._named(g.call_function(fn, (out, a)), f"size_{fn.__name__}_{len(env)}")
        env[key] = out
        return out

    @staticmethod
    def _named(node: fx.Node, name: str) -> fx.Node:
        """A node the program adds, named apart from the captured graph's own names."""
        node.name = name
        return node

    def _local(self, g: fx.Graph, env: dict, src: fx.Node, spec: str) -> list:
        """The planned local shape of ``src``'s output: its global shape divided over the mesh."""
        node, mesh = self.graph.nodes[src.name], self.plan.mesh
        placements = parse_spec(spec, mesh.ndim)
        local = list(local_shape(node.out.shape, placements, mesh.shape))  # checks that it divides
        if not self.symbols:
            return local
        sizes = self._sizes(g, env, src.meta["val"].shape)
        for axis, p in enumerate(placements):
            if isinstance(p, Shard) and not isinstance(sizes[p.dim], int):
                sizes[p.dim] = self._named(g.call_function(operator.floordiv, (sizes[p.dim], mesh.shape[axis])),
                                           f"{src.name}_local{p.dim}_{axis}")
            elif isinstance(p, Shard):
                sizes[p.dim] //= mesh.shape[axis]
        return sizes

    def _made(self, g: fx.Graph, env: dict, name: str, spec: str, param: bool = False) -> None:
        """Value ``name`` (in ``env``) is made here: the sum of its partial gradients, if any."""
        self.grads.value(name, spec, param)
        axes = self.grads.partial.get(name, ()) if not param else ()
        if axes:
            made = env[name]
            env[name] = g.call_function(spmd.grad_allreduce, (made, axes))
            env[name].name = f"{made.name}_g"

    def node(self, g: fx.Graph, env: dict, src: fx.Node) -> None:
        specs = self.specs
        node = self.graph.nodes.get(src.name) if src.op != "output" else self.graph.nodes["output"]
        if src.op == "placeholder":
            ph = g.placeholder(src.name)
            spec = specs[src.name].output_spec
            if node.kind is NodeKind.PARAM:  # its gradient's sum (GradSync's) over the axes a use gives partial sums
                env[src.name] = g.call_function(spmd.param, (ph, spec, self.grads.partial.get(src.name, ())))
                env[src.name].name = f"{src.name}_p"
                self._made(g, env, src.name, spec, param=True)
            elif node.kind is NodeKind.INPUT:
                entry = self.inputs[src.name]
                local = self.local_inputs or entry.get("local", False)
                env[("raw", src.name)] = ph
                shape = entry["shape"]
                if self.symbols and not local:  # its sizes, read from it
                    shape = self._sizes(g, env, src.meta["val"].shape)
                env[src.name] = g.call_function(spmd.shard_input, (ph, spec, shape, local))
                env[src.name].name = f"{src.name}_s"
                self._made(g, env, src.name, spec)
            else:
                env[src.name] = ph
                self._made(g, env, src.name, spec)
            return
        if src.op == "output":
            plan_node = specs["output"]
            # a pipeline stage sends its shards on (pipeline_runtime.stage_plan); programs return full values
            local = self.plan.model.get("local_outputs")
            outs = []
            for i, a in enumerate(node.inputs):
                have, want = specs[a].output_spec, plan_node.input_specs[i]
                if not local and _sums_in_output(have, want):
                    value = self._use(g, env, a, env[a], self._whole(have))
                    outs.append(g.call_function(spmd.output, (value, _as_sum(have))))
                else:
                    outs.append(self._use(g, env, self._key(a, want), self._resharded(g, env, a, want),
                                          self._whole(want)))
            it = iter(outs)
            g.output(fx.node.map_arg(src.args[0], lambda _: next(it)))
            return
        plan_node = specs[src.name]
        if src.target is operator.getitem:
            item = g.call_function(operator.getitem, (env[src.args[0].name], src.args[1]))
            want, have = plan_node.input_specs[0], specs[src.args[0].name].item_spec(src.args[1])
            if src.args[0].name in self.gathered:
                self.gathered.add(src.name)
            if have == want:
                item.name = src.name
                env[src.name] = item
                self._made(g, env, src.name, want)
                return
            raw = f"{src.name}@item"
            item.name = f"{src.name}_item"
            env[raw] = item
            self._made(g, env, raw, have)
            env[src.name] = self._reshard(g, env[raw], raw, src.name, have, want)
            env[src.name].name = src.name
            self.grads.value(src.name, want)
            return
        counter = iter(range(len(node.inputs)))
        grads = use_grads(plan_node.placed(self.ndim))
        keys = []

        def arg(a):
            if is_size(a):
                return env[a.name]
            i = next(counter)
            want = plan_node.input_specs[i]
            key = self._key(a.name, want)
            keys.append(key)
            return self._use(g, env, key, self._resharded(g, env, a.name, want), grads[i])

        args = fx.node.map_arg(src.args, arg)
        kwargs = fx.node.map_arg(src.kwargs, arg)
        strategy = plan_node.strategy
        gathered = any(k in self.gathered for k in keys)
        if src.target in FACTORIES:
            new = g.call_function(spmd.factory, (src.target, *args), kwargs)
        elif src.target in RANDOM_FACTORIES:
            new = g.call_function(spmd.random_factory, (src.name, src.target, *args), kwargs)
        elif src.target in RESHAPES:
            shape = self._local(g, env, src, plan_node.output_spec)
            new = g.call_function(spmd.reshape, (src.name, src.target, args[0], shape))
        elif node.state_update:
            new = g.call_function(spmd.state_update, (src.name, src.target, strategy, *args), kwargs)
        elif local_ops.runs_as_is(src.target) and "avg" not in plan_node.output_spec and not gathered:
            new = g.call_function(src.target, tuple(args), kwargs)
        else:
            new = g.call_function(spmd.op, (src.name, src.target, strategy, *args), kwargs)
        new.name = src.name
        env[src.name] = new
        if gathered and _may_alias(src.target):
            self.gathered.add(src.name)
        if not plan_node.item_specs and len(node.outputs) <= 1:
            self._made(g, env, src.name, plan_node.output_spec)

    def _whole(self, spec: str) -> tuple:
        """The gradient placements of a value returned placed ``spec``: the
        whole gradient where it is replicated or a partial sum."""
        return producer_grad_spec(parse_spec(spec, self.ndim))

    def _key(self, name: str, want: str) -> str:
        """The key of the value a consumer wanting ``want`` reads: ``name`` itself or its reshard."""
        return name if self.specs[name].output_spec == want else f"{name}@{want}"

    def _use(self, g: fx.Graph, env: dict, key: str, value: fx.Node, grad: tuple) -> fx.Node:
        """``value`` for a use whose gradient lands in placements ``grad`` (shared where needed)."""
        axes = self.grads.use(key, grad)
        if not axes:
            return value
        cached = ("share", key, axes)
        if cached not in env:
            env[cached] = g.call_function(spmd.grad_share, (value, axes))
            env[cached].name = f"{value.name}_shared{''.join(map(str, axes))}"
        return env[cached]

    def _resharded(self, g: fx.Graph, env: dict, src: str, want: str) -> fx.Node:
        """``src`` in placements ``want``; consumers wanting the same placement share one reshard."""
        have = self.specs[src].output_spec
        if have == want:
            return env[src]
        key = self._key(src, want)
        if g is self.main:
            self._gather_candidate(src, key, have, want)
            bucket = self.grads.bucket_of.get(key)
            if bucket is not None and ("bucket", bucket) not in env:
                self._gather_bucket(g, env, bucket)
        if key not in env:
            env[key] = self._reshard(g, env[src], src, key, have, want)
            env[key].name = f"{src}_{_slug(want)}"
            self.grads.value(key, want)
        return env[key]

    def _gather_candidate(self, src: str, key: str, have: str, want: str) -> None:
        node = self.graph.nodes[src]
        if node.kind is not NodeKind.PARAM:
            return
        a, b = parse_spec(have, self.ndim), parse_spec(want, self.ndim)
        changed = tuple(i for i in range(self.ndim) if a[i] != b[i])
        if not changed or any(not isinstance(a[i], Shard) or not isinstance(b[i], Replicate) for i in changed):
            return
        # gathered innermost axis first, each a plain all-gather unless a later axis left sharded splits its dim
        if any(a[e] == a[c] for c in changed for e in range(c + 1, self.ndim) if e not in changed):
            return  # the pieces nest
        if not divides(a, node.out.shape, self.plan.mesh.shape):
            return  # a bucket's pieces are even
        nbytes = math.prod(node.out.shape) * node.out.dtype.itemsize
        group = (changed, node.out.dtype, node.fqn.rpartition(".")[0] if node.fqn in self.regather else None)
        self.grads.gather(key, src, f"{_as_sum(have)}->{_as_sum(want)}", nbytes, group)

    def _gather_bucket(self, g: fx.Graph, env: dict, bucket: int) -> None:
        """One all-gather for the parameters of ``bucket``, where its first is first used."""
        members = self.grads.buckets[bucket]
        regather = self.graph.nodes[members[0][1]].fqn in self.regather  # a bucket is one ZeRO stage
        args = (tuple(env[src] for _, src, _ in members), tuple(move for _, _, move in members))
        whole = self.grads.whole[bucket]
        kwargs = {"whole": whole} if whole else {}
        if ("ahead", bucket) in env:
            kwargs["ahead"] = env[("ahead", bucket)]
        call = g.call_function(spmd.gather_params, (*args, True) if regather else args, kwargs)
        call.name = f"gathered_{bucket}"
        env[("bucket", bucket)] = call
        if regather:
            self._prefetch(g, env, bucket)
        for i, (key, src, move) in enumerate(members):
            env[key] = g.call_function(operator.getitem, (call, i))
            env[key].name = f"{src}_{_slug(move.split('->')[1])}"
            self.grads.value(key, move.split("->")[1])
            if regather:
                self.gathered.add(key)

    def _prefetch(self, g: fx.Graph, env: dict, bucket: int) -> None:
        """Start the next ZeRO-3 bucket's all-gather where ``bucket`` is
        gathered: it runs while the ops up to its use compute (FSDP's forward
        prefetch, one module ahead; the cost model prices it so,
        ``timeline.GatherWindow``)."""
        after = [b for b in range(bucket + 1, len(self.grads.buckets))
                 if self.graph.nodes[self.grads.buckets[b][0][1]].fqn in self.regather]
        if not after or ("bucket", after[0]) in env:
            return
        members = self.grads.buckets[after[0]]
        call = g.call_function(spmd.prefetch_params, (tuple(env[src] for _, src, _ in members),
                                                      tuple(move for _, _, move in members)))
        call.name = f"ahead_{after[0]}"
        env[("ahead", after[0])] = call

    def _reshard(self, g: fx.Graph, value: fx.Node, source: str, key: str, have: str, want: str) -> fx.Node:
        self.grads.reshard(key, source)
        back = self.grads.back(key, source) if self.grads.solved else ""  # known once solved
        param = self.graph.nodes.get(source)
        regather = param is not None and param.kind is NodeKind.PARAM and param.fqn in self.regather
        if regather or source in self.gathered:
            self.gathered.add(key)
        move = f"{_as_sum(have)}->{_as_sum(want)}"
        args = (value, move, back, True) if regather else (value, move, back)
        node = self.graph.nodes.get(source)
        uneven = node is None or len(node.outputs) != 1 or any(
            not divides(parse_spec(spec, self.ndim), node.out.shape, self.plan.mesh.shape) for spec in (have, want))
        return g.call_function(spmd.reshard, args, {"uneven": True} if uneven else {})


def use_grads(strategy: Strategy) -> list:
    """The placements of the gradient each input of an op placed ``strategy``
    gives back: on an axis where the op splits its work or makes a partial
    output, a replicated input's local gradient is one summand (the rule the
    cost model prices edges by, ``graph_costs.input_grad_spec``)."""
    return [input_grad_spec(strategy, i, len(strategy.output)) for i in range(len(strategy.inputs))]


def _as_sum(spec: str) -> str:
    """A spec with its P(avg)s as the Partial sums they run as (``spmd.op``)."""
    return spec.replace("P(avg)", "P")


def _may_alias(fn) -> bool:
    """Whether an op's output may share its input's storage (a view), by its schema."""
    schema = getattr(fn, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def _sums_in_output(have: str, want: str) -> bool:
    """A partial sum (a loss over a batch split) returned replicated: ``spmd.output``
    all-reduces it itself, without stalling the step (see there)."""
    return "P" in have and "S" not in have and set(want) == {"R"}


def _slug(spec: str) -> str:
    return spec.replace("(", "").replace(")", "").replace(",", "")


def program_source(gm: fx.GraphModule, plan: Plan) -> str:
    """Standalone Python for the per-rank program: imports, a class per
    recomputed layer, then ``class RankProgram``."""
    classes, globals_ = [], {}
    children = list(gm.named_children())
    for name, sub in children:
        code = sub.graph.python_code(root_module="self")
        globals_.update(code.globals)
        classes.append(f"class {type(sub).__name__}(torch.nn.Module):\n"
                       + textwrap.indent(code.src.strip("\n"), "    ") + "\n")
    code = gm.graph.python_code(root_module="self")
    globals_.update(code.globals)
    lines = ["import torch", "import torch.fx"]
    for name, obj in sorted(globals_.items()):
        if name == "torch":
            continue
        if obj is type(None):
            lines.append(f"{name} = type(None)")
        elif isinstance(obj, types.ModuleType):
            lines.append(f"import {obj.__name__} as {name}")
        elif isinstance(obj, float):
            lines.append(f"{name} = float({str(obj)!r})")
        elif hasattr(obj, "__module__") and hasattr(obj, "__name__"):
            module = obj.__module__ or "builtins"
            if module == "_operator":
                module = "operator"
            lines.append(f"from {module} import {obj.__name__} as {name}")
        else:
            raise PlanError(f"cannot emit the global {name} = {obj!r} of the generated program")
    head = HEADER.format(mesh=plan.mesh, cluster=plan.cluster.get("name"),
                         step=plan.predicted["step_time_s"], mem=plan.predicted["peak_memory_bytes"] / 2**30)
    init = ""
    if children:
        init = "    def __init__(self):\n        super().__init__()\n" + "".join(
            f"        self.{name} = {type(sub).__name__}()\n" for name, sub in children) + "\n"
    body = textwrap.indent(code.src.strip("\n"), "    ")
    return (head + "\n".join(lines) + "\n\n\n" + "\n\n".join(classes) + ("\n\n" if classes else "")
            + "class RankProgram(torch.nn.Module):\n" + init + body + "\n")


def load_program(source: str, name: str = "<autopar program>") -> torch.nn.Module:
    """The program's ``RankProgram``; its source is registered with ``linecache``,
    so that a traceback through it shows the program's lines."""
    namespace: dict = {"__name__": "autopar_program"}
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    exec(compile(source, name, "exec"), namespace)
    return namespace["RankProgram"]()


ENTRY = '''"""Train with the autopar plan in plan.json. Run:

    torchrun --nproc-per-node {world} {entry} [--steps N] [--check]

The model comes from {source}, built on every rank with the same seed.
"""
import argparse
import os
import sys

import torch

import autopar
from autopar.runtime import ParallelModule, load_factory, relative_error, single_device_reference

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from rank_program import RankProgram  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--check", action="store_true", help="compare with single-device training")
    args = parser.parse_args()
    plan = autopar.Plan.load(os.path.join(HERE, "plan.json"))
    model, inputs, loss_fn = load_factory({source!r})
    pmodel = ParallelModule(model, plan, program=RankProgram(), loss_fn=loss_fn)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=args.lr)
    losses = []
    for _ in range(args.steps):
        loss = pmodel(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = pmodel.state_dict()
    if pmodel.rank == 0:
        print("losses:", " ".join(f"{{v:.6f}}" for v in losses))
    if args.check:
        ref_losses, ref_state = single_device_reference({source!r}, steps=args.steps, lr=args.lr)
        keys = sorted(ref_state)
        worst = relative_error(torch.cat([state[k].flatten() for k in keys]),
                               torch.cat([ref_state[k].flatten() for k in keys]))
        loss_err = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(losses, ref_losses))
        if pmodel.rank == 0:
            print(f"agreement with single device: loss rel err {{loss_err:.2e}}, parameter rel err {{worst:.2e}}")
        if worst > 1e-5 or loss_err > 1e-5:
            raise SystemExit("autopar: the parallel run disagrees with single-device training")
    autopar.runtime.shutdown(exit_code=0)


if __name__ == "__main__":
    main()
'''


def _rebuilding_entry(files: str, note: str) -> str:
    """train.py for a plan whose programs autoparallelize rebuilds from the model (``files``: what it writes)."""
    return ENTRY.replace("from rank_program import RankProgram  # noqa: E402\n", "").replace(
        "    pmodel = ParallelModule(model, plan, program=RankProgram(), loss_fn=loss_fn)\n",
        f"    # {files} here: rebuilt from the model, exactly as written\n"
        "    pmodel = autopar.autoparallelize(model, inputs, loss_fn=loss_fn, mesh=plan.mesh, cluster=plan.cluster,\n"
        "                                     plan=plan)\n").replace("The model comes from", f"{note} The model comes from")


PIPELINE_ENTRY = _rebuilding_entry("the stage programs (stage_<chunk>.py)",
                                   "Pipelined: each stage's program is in stage_<chunk>.py.")
DYNAMIC_ENTRY = _rebuilding_entry("each piece's program (piece_<i>.py; the example batch runs its sizes' piece)",
                                  "Dynamic: one program per piece of sizes, piece_<i>.py.")


def write_program(plan: Plan, graph: Graph, out_dir: str, stages: dict | None = None,
                  pieces: dict | None = None) -> str:
    """Write rank_program.py (or, for a pipelined plan, ``stages``: chunk ->
    its stage program, autopar.pipeline_runtime.stage_sources; for a dynamic
    plan, ``pieces``: piece index -> its program, autopar.dynamic.runtime.
    piece_sources), plan.json and train.py into ``out_dir``; return train.py's path."""
    source = plan.model.get("source")
    if not source:
        raise PlanError("the plan does not name its model source (FILE.py:FACTORY); compile it with the CLI "
                        "or pass source= to autopar.compile so that codegen can rebuild the model")
    os.makedirs(out_dir, exist_ok=True)
    path, factory = source.rsplit(":", 1)
    template, programs = ENTRY, None
    if plan.pipeline:
        template, programs, name, helper = PIPELINE_ENTRY, stages, "stage_{}.py", "pipeline_runtime.stage_sources"
    elif plan.dynamic:
        template, programs, name, helper = DYNAMIC_ENTRY, pieces, "piece_{}.py", "dynamic.runtime.piece_sources"
    else:
        write_text(os.path.join(out_dir, "rank_program.py"), program_source(build_program(graph, plan), plan))
    if template is not ENTRY:
        if programs is None:
            raise PlanError(f"a {'pipelined' if plan.pipeline else 'dynamic'} plan's program is one file per "
                            f"{'stage' if plan.pipeline else 'piece'}: pass them (autopar.{helper})")
        for key, text in programs.items():
            write_text(os.path.join(out_dir, name.format(key)), text)
    plan.save(os.path.join(out_dir, "plan.json"))
    entry = os.path.join(out_dir, "train.py")
    write_text(entry, template.format(world=plan.mesh.size, entry=entry, source=os.path.abspath(path) + ":" + factory))
    written = [name.format(key) for key in programs] if programs is not None else ["rank_program.py"]
    record_written(out_dir, [*written, "plan.json", "train.py"])
    return entry
