"""Codegen: the captured graph rewritten as a per-rank SPMD program.

Each op runs on DTensors placed as the plan says; wherever a producer's
placement differs from what its consumer's strategy wants, a ``reshard`` call
is inserted, which is the collective the plan lists for that edge. The result
is an fx GraphModule, printed as readable Python; the runtime executes exactly
this source, and ``autopar codegen`` writes it next to a torchrun entry point.
"""
from __future__ import annotations

import operator
import os
import textwrap
import types

import torch
import torch.fx as fx

from autopar import spmd
from autopar.capture import Graph, NodeKind
from autopar.errors import AutoparError, PlanError
from autopar.outputs import record_written, write_text
from autopar.passes.rules.misc import FACTORIES, RANDOM_FACTORIES
from autopar.passes.strategy import Strategy, local_shape, parse_spec
from autopar.plan import Plan

HEADER = '''"""Per-rank program emitted by autopar for mesh {mesh} on {cluster}.

Every `autopar_spmd_reshard(x, "<spec>")` is a collective (or a free local slice)
on the mesh axes whose placement changes; placements print as S(d) / R / P per
mesh axis. Gradient sync: the gradient of `autopar_spmd_param(w, "<spec>")` is
reduce-scattered in backward over the axes where spec shards w, and all-reduced
over the axes where it is R in buckets launched while backward runs, waited for
at its end (autopar.spmd.GradSync); `autopar_spmd_output` of a partial sum (the
loss) all-reduces it without waiting there. Predicted step time {step:.3g} s,
peak memory {mem:.3g} GiB per device.
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
    step in other dtypes (``check_plan_matches``)."""
    check_plan_matches(graph, plan, traced)
    emit = _Emitter(graph, plan, local_inputs)
    regions = _recompute_regions(graph, plan)
    region_of = {name: i for i, names in enumerate(regions) for name in names}
    root = torch.nn.Module()
    main, env = fx.Graph(), {}
    consumers = graph.consumers()
    done = set()
    for src in graph.gm.graph.nodes:
        if src.name in done or (src.op == "call_function" and src.name not in graph.nodes):
            continue  # already emitted in a recomputed layer, or an export assertion
        if src.name not in region_of:
            emit.node(main, env, src)
            continue
        i = region_of[src.name]
        names = regions[i]
        inside = set(names)
        externals = list(dict.fromkeys(p for n in names for p in graph.nodes[n].inputs if p not in inside))
        outputs = [n for n in names if any(c not in inside for c, _ in consumers[n])]
        sub, sub_env = fx.Graph(), {}
        for e in externals:
            sub_env[e] = sub.placeholder(e)
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
    """Emits one captured node into an fx graph, with the reshards its strategy needs."""

    def __init__(self, graph: Graph, plan: Plan, local_inputs: bool):
        self.graph, self.plan, self.local_inputs = graph, plan, local_inputs
        self.specs = {n.name: n for n in plan.nodes}
        self.inputs = {i["name"]: i for i in plan.inputs}
        self.fx_nodes = {n.name: n for n in graph.gm.graph.nodes}

    def node(self, g: fx.Graph, env: dict, src: fx.Node) -> None:
        specs = self.specs
        node = self.graph.nodes.get(src.name) if src.op != "output" else self.graph.nodes["output"]
        if src.op == "placeholder":
            ph = g.placeholder(src.name)
            spec = specs[src.name].output_spec
            if node.kind is NodeKind.PARAM:
                regather = self.plan.parameters.get(node.fqn, {}).get("regather", False)
                env[src.name] = g.call_function(spmd.param, (ph, spec, True) if regather else (ph, spec))
            elif node.kind is NodeKind.INPUT:
                entry = self.inputs[src.name]
                local = self.local_inputs or entry.get("local", False)
                env[src.name] = g.call_function(spmd.shard_input, (ph, spec, entry["shape"], local))
            else:
                env[src.name] = g.call_function(spmd.replicate, (ph,))
            env[src.name].name = f"{src.name}_d"
            return
        if src.op == "output":
            plan_node = specs["output"]
            # a pipeline stage sends its shards on (pipeline_runtime.stage_plan); programs return full values
            local = self.plan.model.get("local_outputs")
            outs = [env[a] if not local and _sums_in_output(specs[a].output_spec, plan_node.input_specs[i])
                    else _resharded(g, env, a, plan_node.input_specs[i], specs) for i, a in enumerate(node.inputs)]
            it = iter(outs)
            emit = spmd.local_output if local else spmd.output
            g.output(fx.node.map_arg(src.args[0], lambda _: g.call_function(emit, (next(it),))))
            return
        plan_node = specs[src.name]
        if src.target is operator.getitem:
            item = g.call_function(operator.getitem, (env[src.args[0].name], src.args[1]))
            want = plan_node.input_specs[0]
            if specs[src.args[0].name].item_spec(src.args[1]) != want:
                item.name = f"{src.name}_item"
                item = g.call_function(spmd.reshard, (item, want))
            item.name = src.name
            env[src.name] = item
            return
        counter = iter(range(len(node.inputs)))

        def arg(a):
            return _resharded(g, env, a.name, plan_node.input_specs[next(counter)], specs)

        args = fx.node.map_arg(src.args, arg)
        kwargs = fx.node.map_arg(src.kwargs, arg)
        spec = tuple(plan_node.item_specs) or plan_node.output_spec
        if src.target in FACTORIES:
            new = g.call_function(spmd.factory, (src.target, *args), kwargs)
        elif src.target in RANDOM_FACTORIES:
            new = g.call_function(spmd.random_factory, (src.name, src.target, *args), kwargs)
        elif src.target in RESHAPES:
            mesh = self.plan.mesh
            shape = list(local_shape(node.out.shape, parse_spec(spec, mesh.ndim), mesh.shape))
            new = g.call_function(spmd.reshape, (src.name, src.target, spec, args[0], shape))
        elif node.state_update:
            new = g.call_function(spmd.state_update, (src.name, src.target, spec, *args), kwargs)
        else:
            new = g.call_function(spmd.op, (src.name, src.target, spec, *args), kwargs)
        new.name = src.name
        env[src.name] = new


def _sums_in_output(have: str, want: str) -> bool:
    """A partial sum (a loss over a batch split) returned replicated: ``spmd.output``
    all-reduces it itself, without stalling the step (see there)."""
    return "P" in have and "S" not in have and set(want) == {"R"}


def _resharded(g: fx.Graph, env: dict, src: str, want: str, specs: dict) -> fx.Node:
    """``src`` in placements ``want``; consumers wanting the same placement share one reshard."""
    have = specs[src].output_spec
    if have == want:
        return env[src]
    key = (src, want)
    if key not in env:
        node = g.call_function(spmd.reshard, (env[src], want))
        node.name = f"{src}_{_slug(want)}"
        env[key] = node
    return env[key]


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
    namespace: dict = {"__name__": "autopar_program"}
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


PIPELINE_ENTRY = ENTRY.replace(
    "from rank_program import RankProgram  # noqa: E402\n", "").replace(
    "    pmodel = ParallelModule(model, plan, program=RankProgram(), loss_fn=loss_fn)\n",
    "    # the stage programs (stage_<chunk>.py here) are rebuilt from the model, exactly as written\n"
    "    pmodel = autopar.autoparallelize(model, inputs, loss_fn=loss_fn, mesh=plan.mesh, cluster=plan.cluster,\n"
    "                                     plan=plan)\n").replace(
    "The model comes from", "Pipelined: each stage's program is in stage_<chunk>.py. The model comes from")


def write_program(plan: Plan, graph: Graph, out_dir: str, stages: dict | None = None) -> str:
    """Write rank_program.py (or, for a pipelined plan, ``stages``: chunk ->
    its stage program, autopar.pipeline_runtime.stage_sources), plan.json and
    train.py into ``out_dir``; return train.py's path."""
    source = plan.model.get("source")
    if not source:
        raise PlanError("the plan does not name its model source (FILE.py:FACTORY); compile it with the CLI "
                        "or pass source= to autopar.compile so that codegen can rebuild the model")
    os.makedirs(out_dir, exist_ok=True)
    path, factory = source.rsplit(":", 1)
    template = ENTRY
    if plan.pipeline:
        if stages is None:
            raise PlanError("a pipelined plan's program is its stages: pass stages= "
                            "(autopar.pipeline_runtime.stage_sources)")
        for chunk, text in stages.items():
            write_text(os.path.join(out_dir, f"stage_{chunk}.py"), text)
        template = PIPELINE_ENTRY
    else:
        write_text(os.path.join(out_dir, "rank_program.py"), program_source(build_program(graph, plan), plan))
    plan.save(os.path.join(out_dir, "plan.json"))
    entry = os.path.join(out_dir, "train.py")
    write_text(entry, template.format(world=plan.mesh.size, entry=entry, source=os.path.abspath(path) + ":" + factory))
    programs = [f"stage_{chunk}.py" for chunk in stages] if plan.pipeline else ["rank_program.py"]
    record_written(out_dir, [*programs, "plan.json", "train.py"])
    return entry
