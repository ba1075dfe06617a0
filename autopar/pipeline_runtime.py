"""Running a pipelined plan: per-stage programs on ``torch.distributed.pipelining``.

Each stage is a slice of the captured microbatch graph (``stage_graph``): its
layers' ops and parameters, the floating ops it needs (recomputed), the user
inputs it reads, and one placeholder per tensor crossing into it. autopar's
SPMD codegen (autopar/codegen.py ``build_program``) turns the slice into a
per-rank program on the stage's submesh (the mesh axes other than pp), with the
plan's intra-stage placements; what crosses to the next stage leaves the
program in its producer's placement (a Partial sum reduced first,
``pipeline.cut_placements``) and every submesh rank sends its shard to its
peer at the same submesh coordinate of the next stage, which receives it in
the same placement.

``PipelinedModule`` keeps the user's training loop:

* ``pmodel(*inputs, target)`` runs one schedule step (every microbatch's
  forward and backward) and returns the full-batch loss on every rank
  (broadcast from the last stage); ``loss.backward()`` afterwards is a no-op
  kept so that the usual loop reads the same;
* ``pmodel.parameters()`` are this rank's shards of its stage's parameters, so
  a plain AdamW updates them; a parameter replicated over a submesh axis is
  exposed as a flat 1/n shard of it (ZeRO stage 1, ``gradsync.OptimizerShard``: its
  gradient is reduce-scattered once per step and the updated shards are
  all-gathered at the start of the next step, in buckets), so the optimizer
  states are sharded too; gradients equal single-device full-batch
  training: each microbatch's mean loss is divided by m (``scale_grads`` of
  the torch schedules is off), which is exact for a loss that averages over
  the batch, as torch's losses do by default. Gradients of parameters
  replicated over a submesh axis accumulate as local partial sums over the
  microbatches and are all-reduced once per step, in buckets
  (``gradsync.GradAccumulation``);
* ``state_dict()`` / ``load_state_dict()`` speak full tensors under the
  original names, gathered across the submesh and the stages.

Check a plan against single-device training (autopar.verify runs pipelined
plans here; what tests/test_pipeline.py runs):

    autopar verify examples/gpt.py:small --mesh pp=2,tp=2 --microbatches 4 --schedule 1f1b
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B,
)
from torch.distributed.tensor import DTensor, Replicate

from autopar import gradsync, rankcheck, spmd
from autopar.capture import capture
from autopar.codegen import build_program, load_program, program_source, same_steps
from autopar.errors import AutoparError, InputError, LaunchError, PlanError
from autopar.ir import Graph, Node, NodeKind
from autopar.mesh import Mesh
from autopar.passes.strategy import fmt_spec, parse_spec
from autopar.pipeline import (
    PP_AXIS, Layers, Schedule, cut_placements, group_layers, inner_spec, microbatch_inputs, stage_ranges, zero1_axis,
)
from autopar.plan import NodePlan, Plan
from autopar.runtime import in_torchrun, shard_of, torchrun_command

SCHEDULES = {Schedule.GPIPE: ScheduleGPipe, Schedule.ONE_F_ONE_B: Schedule1F1B,
             Schedule.INTERLEAVED: ScheduleInterleaved1F1B}


# --- stage slices -------------------------------------------------------------------

class StageGraph:
    """One stage's slice of the microbatch graph."""

    def __init__(self, graph: Graph, layers: list, recv: list, order: list, sends: list | None):
        self.graph = graph
        self.layers = layers
        """The layers (module paths) the stage runs."""
        self.recv = recv
        """Names of the tensors received from the previous stage (the positional arguments)."""
        self.order = order
        """The program's arguments: ("recv", i), ("param", fqn), ("buffer", fqn) or ("input", index)."""
        self.sends = sends
        """Names of the tensors sent to the next stage; None on the last stage (it returns the loss)."""


def stage_graph(graph: Graph, layers: Layers, start: int, stop: int) -> StageGraph:
    """The slice of ``graph`` for layers [start, stop)."""
    last = stop == layers.n
    names = layers.nodes_of(graph, start, stop)
    ops = [n for n in names if graph.nodes[n].kind is NodeKind.OP]
    own_params = {n for n in names if graph.nodes[n].kind is NodeKind.PARAM}
    recv = list(layers.crossing[start]) if start > 0 else []
    sends = None if last else list(layers.crossing[stop])
    have = set(ops) | set(recv)
    needed = set()
    for n in ops:
        for src in graph.nodes[n].inputs:
            if src in have:
                continue
            kind = graph.nodes[src].kind
            if kind is NodeKind.PARAM and src not in own_params:
                raise AutoparError(
                    f"parameter {graph.nodes[src].fqn} is used by stages over layers {layers.names[start]}.."
                    f"{layers.names[stop - 1]} and elsewhere (tied weights); pipelines cannot split tied "
                    "parameters yet: keep their users in one stage")
            if kind in (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT):
                needed.add(src)
            else:
                raise AutoparError(f"stage over layers [{start}, {stop}) needs {src}, which is neither computed, "
                                   "received nor an input; the layer cut is invalid")
    for s in sends or []:
        if s not in have:
            raise AutoparError(f"stage over layers [{start}, {stop}) must send {s} but does not have it")
    g = fx.Graph()
    env: dict = {}
    nodes: dict = {}
    order = []
    for i, name in enumerate(recv):
        env[name] = g.placeholder(name)
        nodes[name] = Node(name, NodeKind.INPUT, fqn=f"recv[{i}]", outputs=[graph.nodes[name].out], input_index=-1)
        order.append(("recv", i))
    params, buffers = {}, {}
    for fxn in graph.gm.graph.nodes:
        if fxn.op == "placeholder" and fxn.name in needed:
            env[fxn.name] = g.placeholder(fxn.name)
            node = graph.nodes[fxn.name]
            nodes[fxn.name] = node
            if node.kind is NodeKind.PARAM:
                params[node.fqn] = node.name
                order.append(("param", node.fqn))
            elif node.kind is NodeKind.BUFFER:
                buffers[node.fqn] = node.name
                order.append(("buffer", node.fqn))
            else:
                order.append(("input", node.input_index))
    op_set = set(ops)
    out_fx = None
    for fxn in graph.gm.graph.nodes:
        if fxn.op == "call_function" and fxn.name in op_set:
            env[fxn.name] = g.node_copy(fxn, lambda a: env[a.name])
            nodes[fxn.name] = graph.nodes[fxn.name]
        elif fxn.op == "output":
            out_fx = fxn
    if last:
        g.output(fx.node.map_arg(out_fx.args[0], lambda a: env[a.name]))
        outs = list(graph.nodes["output"].inputs)
    else:
        g.output(tuple(env[s] for s in sends))
        outs = list(sends)
    nodes["output"] = Node("output", NodeKind.OUTPUT, inputs=outs, outputs=[graph.nodes[o].out for o in outs])
    g.lint()
    gm = fx.GraphModule(nn.Module(), g, class_name="StageProgram")
    sub = Graph(nodes, gm, params, buffers, len([o for o in order if o[0] == "input"]),
                last and graph.has_loss, graph.out_spec if last else "")
    return StageGraph(sub, layers.names[start:stop], recv, order, sends)


def stage_plan(sg: StageGraph, plan: Plan, submesh: Mesh) -> Plan:
    """The intra-stage plan of one stage, on its submesh, in the form codegen reads."""
    by_name = {n.name: n for n in plan.nodes}
    synthetic = plan.mesh.ndim == 1
    replicated = fmt_spec(tuple(Replicate() for _ in submesh.shape))

    def inner(spec: str) -> str:
        return replicated if synthetic else inner_spec(spec, plan.mesh)

    def crossing(name: str) -> str:
        return cut_spec(by_name[name].output_spec, plan.mesh)

    nodes, inputs = [], []
    shapes = {i["name"]: i for i in plan.inputs}
    for node in sg.graph.nodes.values():
        if node.name in sg.recv:  # this rank's shard, from its peer in the previous stage
            nodes.append(NodePlan(node.name, "recv", node.fqn, [], [], crossing(node.name)))
            inputs.append({"name": node.name, "shape": list(node.out.shape), "local": True})
        elif node.kind is NodeKind.OUTPUT:
            outs = [crossing(n) for n in node.inputs] if sg.sends is not None else [replicated] * len(node.inputs)
            nodes.append(NodePlan("output", "output", "", list(node.inputs), outs, replicated))
        else:
            src = by_name.get(node.name)
            if src is None:
                raise PlanError(f"the plan has no strategy for node {node.name}; recompile it for this model")
            nodes.append(NodePlan(node.name, src.op, src.location, list(src.inputs),
                                  [inner(s) for s in src.input_specs], inner(src.output_spec),
                                  item_specs=[inner(s) for s in src.item_specs]))
            if node.kind is NodeKind.INPUT:
                inputs.append({"name": node.name, "shape": shapes[node.name]["microbatch_shape"]})
    model = {"fingerprint": sg.graph.fingerprint(), "local_outputs": sg.sends is not None}
    out = Plan(submesh, plan.cluster, [], model, {}, inputs, nodes, [],
               {"step_time_s": 0.0, "peak_memory_bytes": 0.0}, {})
    recomputed = [name for name in plan.recompute.get("layers", []) if name in sg.layers]
    regions = [r for r in plan.recompute.get("regions", []) if all(n in sg.graph.nodes for n in r)]
    if plan.recompute.get("mode") == "selective" and regions:  # this stage's regions (each inside one layer)
        out.recompute = {"mode": "selective", "layers": recomputed, "regions": regions}
    else:
        out.recompute = {"mode": "full" if recomputed else "none", "layers": recomputed}
    return out


def cut_spec(spec: str, mesh: Mesh) -> str:
    """A crossing tensor's placements on the stage submesh (``pipeline.cut_placements``);
    "R" on the one-device submesh of a pp-only mesh."""
    if mesh.ndim == 1:
        return "R"
    inner = inner_spec(spec, mesh)
    return fmt_spec(cut_placements(parse_spec(inner, mesh.ndim - 1)))


def stage_source(sg: StageGraph, plan: Plan, submesh: Mesh) -> str:
    """The per-rank Python program of one stage (what the runtime executes)."""
    splan = stage_plan(sg, plan, submesh)
    return program_source(build_program(sg.graph, splan), splan)


class StageModule(nn.Module):
    """One stage's program with this rank's parameter shards: forward(*received, **inputs)."""

    def __init__(self, program: nn.Module, sg: StageGraph, params: dict, buffers: dict, mesh, last: bool):
        super().__init__()
        self.program = program
        self._order = sg.order
        self._params = nn.ParameterList([params[k] for kind, k in sg.order if kind == "param"])
        self._param_of = {k: params[k] for kind, k in sg.order if kind == "param"}
        self._buffers_of = {k: buffers[k] for kind, k in sg.order if kind == "buffer"}
        self._mesh = mesh
        self._last = last

    def forward(self, *received, **inputs):
        args = []
        for kind, key in self._order:
            if kind == "recv":
                args.append(received[key])
            elif kind == "param":
                args.append(self._param_of[key])
            elif kind == "buffer":
                args.append(self._buffers_of[key])
            else:
                args.append(inputs[f"input_{key}"])
        with spmd.use_mesh(self._mesh):
            out = self.program(*args)
        if self._last:
            flat = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            if len(flat) != 1 or flat[0].dim() != 0:
                raise AutoparError("a pipelined model's last stage must produce one scalar loss "
                                   "(give loss_fn; the last input is the target)")
            return flat[0]
        return tuple(out)


class _ReportedLoss(torch.autograd.Function):
    """The step's loss as a tensor whose backward does nothing: the schedule
    already ran every microbatch's backward."""

    @staticmethod
    def forward(ctx, value, anchor):
        return value.clone()

    @staticmethod
    def backward(ctx, grad):
        return None, None


def init_pipeline_mesh(mesh: Mesh):
    """Join the torchrun job and build the DeviceMesh of a pipelined plan (a
    one-device submesh axis is added when the mesh has only the pp axis)."""
    from autopar.runtime import init_distributed
    if mesh.ndim == 1:
        if not in_torchrun() and not dist.is_initialized():
            raise LaunchError(f"autopar runs the plan on {mesh.size} processes, but this is not a torchrun job. "
                              f"Launch it with:\n    {torchrun_command(mesh.size)}")
        init_distributed(mesh.shape, mesh.names)
        device = "cuda" if torch.cuda.is_available() else "cpu"
        return init_device_mesh(device, (mesh.size, 1), mesh_dim_names=(PP_AXIS, "tp"))
    return init_distributed(mesh.shape, mesh.names)


def stage_sources(model: nn.Module, plan: Plan, loss_fn=None) -> dict:
    """The per-stage programs of a pipelined plan, as Python source, by model chunk."""
    example = microbatch_inputs(plan)
    graph = capture(model, example, loss_fn)
    layers = group_layers(graph)
    inner = tuple(n for n in plan.mesh.names if n != PP_AXIS)
    submesh = Mesh(tuple(s for n, s in zip(plan.mesh.names, plan.mesh.shape) if n != PP_AXIS), inner)
    return {c: stage_source(stage_graph(graph, layers, start, stop), plan, submesh)
            for c, (start, stop) in enumerate(stage_ranges(plan, layers.names))}


class PipelinedModule(nn.Module):
    """The user's model, running a pipelined ``plan`` on this rank."""

    def __init__(self, model: nn.Module, plan: Plan, *, loss_fn=None, device_mesh=None, check_ranks: bool = True,
                 planned: nn.Module | None = None):
        """``planned``: the model the plan was compiled for, where ``model``
        is a copy of it in float64 (autopar.verify checks a float32 plan
        so): the plan is matched against ``planned``, and ``model`` runs the
        same steps in its own dtype."""
        super().__init__()
        if plan.pipeline is None:
            raise PlanError("this plan does not pipeline (its 'pipeline' section is null); run it with "
                            "autopar.runtime.ParallelModule")
        if not plan.nodes:
            raise PlanError("this pipelined plan lists no per-node strategies (it was priced by repetition); "
                            "compile it with reuse_layers=False to run it")
        self.plan = plan
        pipe = plan.pipeline
        self.mesh = device_mesh if device_mesh is not None else init_pipeline_mesh(plan.mesh)
        self.rank = dist.get_rank()
        names = self.mesh.mesh_dim_names
        inner_names = tuple(n for n in names if n != PP_AXIS)
        self._inner = self.mesh[inner_names] if len(inner_names) > 1 else self.mesh[inner_names[0]]
        self._pp_group = self.mesh.get_group(PP_AXIS)
        p = self.mesh.size(names.index(PP_AXIS))
        self._p = p
        self._pp_coord = self.mesh.get_coordinate()[names.index(PP_AXIS)]
        self._m = pipe["microbatches"]
        submesh = Mesh(tuple(self._inner.shape), inner_names)
        device = torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" \
            else torch.device("cpu")
        self._device = device
        if check_ranks:  # every rank holds the whole model before it is split
            rankcheck.same_state(model, device)
        self._inputs_checked = False

        # the microbatch graph, sliced as the plan says
        example = microbatch_inputs(plan)
        graph = capture(planned if planned is not None else model, example, loss_fn)
        if graph.fingerprint() != plan.model.get("fingerprint"):
            raise PlanError(f"the plan was compiled for a different model or microbatch shape (fingerprint "
                            f"{plan.model.get('fingerprint')}, this model traces to {graph.fingerprint()}); "
                            "recompile the plan")
        if planned is not None:
            wide = tuple(x.double() if x.is_floating_point() else x for x in example)
            planned_graph, graph = graph, capture(model, wide, loss_fn)
            same_steps(planned_graph, graph)
        self._dtypes = {fqn: p.dtype for fqn, p in model.named_parameters(remove_duplicate=False)}
        out = next(n for n in graph.nodes.values() if n.kind is NodeKind.OUTPUT)
        self._loss_dtype = graph.nodes[out.inputs[0]].out.dtype  # what the last stage broadcasts
        layers = group_layers(graph)
        ranges = stage_ranges(plan, layers.names)
        by_name = {n.name: n for n in plan.nodes}
        self._stage_of = {fqn: info["stage"] for fqn, info in plan.parameters.items()}
        self._placements = {fqn: tuple(parse_spec(inner_spec("".join(info["placements"]), plan.mesh)
                                                  if plan.mesh.ndim > 1 else "R", len(inner_names)))
                            for fqn, info in plan.parameters.items()}
        full = dict(model.named_parameters())
        self._buffers_full = {k: b.detach().to(device) for k, b in model.named_buffers()}
        self._order = [k for k in model.state_dict()]
        mine = [c for c in range(len(ranges)) if c % p == self._pp_coord]
        local: dict = {}
        stages = []
        self.programs = {}
        for c in mine:
            start, stop = ranges[c]
            sg = stage_graph(graph, layers, start, stop)
            source = stage_source(sg, plan, submesh)
            self.programs[c] = source
            for kind, fqn in sg.order:
                if kind == "param" and fqn not in local:
                    shard = shard_of(full[fqn].detach().to(device), self._placements[fqn], self._inner)
                    local[fqn] = nn.Parameter(shard, requires_grad=full[fqn].requires_grad)
            module = StageModule(load_program(source, f"<autopar stage {c}>"), sg, local, self._buffers_full,
                                 self._inner, last=stop == layers.n)
            in_args = tuple(self._shard_example(graph.nodes[n].out, by_name[n].output_spec, device)
                            for n in sg.recv)
            if stop == layers.n:
                out_args = (torch.zeros((), device=device),)
            else:
                out_args = tuple(self._shard_example(graph.nodes[n].out, by_name[n].output_spec, device)
                                 for n in sg.sends)
            stages.append(PipelineStage(module, c, len(ranges), device, input_args=in_args, output_args=out_args,
                                        group=self._pp_group))
        for fqn, info in plan.parameters.items():  # parameters no op uses stay on their plan stage
            if info["stage"] in mine and fqn not in local:
                shard = shard_of(full[fqn].detach().to(device), self._placements[fqn], self._inner)
                local[fqn] = nn.Parameter(shard, requires_grad=full[fqn].requires_grad)
        self._local_fqns = list(local)
        # ZeRO-1: the optimizer updates a shard of each parameter replicated over a submesh axis
        self._zero1 = {}
        for fqn, prm in local.items():
            axis = zero1_axis(self._placements[fqn], tuple(self._inner.shape))
            if axis is not None and prm.requires_grad:
                self._zero1[fqn] = gradsync.OptimizerShard(prm, self._inner, axis)
        exposed = {fqn: self._zero1[fqn].shard if fqn in self._zero1 else prm for fqn, prm in local.items()}
        tree = _ParamTree(exposed)  # registered here so that names stay the originals
        for name, child in tree.named_children():
            self.add_module(name, child)
        for name, prm in tree.named_parameters(recurse=False):
            self.register_parameter(name, prm)
        self._local = local
        self._stages = stages
        schedule = Schedule(pipe["schedule"])
        m = self._m
        loss = _MicrobatchLoss(m)
        if schedule is Schedule.INTERLEAVED:
            self._schedule = ScheduleInterleaved1F1B(stages, m, loss_fn=loss, scale_grads=False)
        else:
            if len(stages) != 1:
                raise PlanError(f"schedule {schedule.value} runs one stage per pp rank; the plan has "
                                f"{len(ranges)} stages on {p} ranks")
            self._schedule = SCHEDULES[schedule](stages[0], m, loss_fn=loss, scale_grads=False)
        self._anchor = torch.zeros((), requires_grad=True)
        self._accumulation = gradsync.GradAccumulation()
        self.deferred_reductions = 0
        """Gradient all-reduces the last step ran once, after its microbatches."""
        self._batch_shapes = [list(i["shape"]) for i in plan.inputs]
        self.loss_fn = loss_fn

    def _shard_example(self, meta, spec: str, device):
        """This rank's shard of a crossing tensor (its shape is what the stages exchange)."""
        placements = parse_spec(cut_spec(spec, self.plan.mesh), self._inner.ndim)
        t = shard_of(torch.empty(meta.shape, dtype=meta.dtype, device=device), placements, self._inner)
        return t.contiguous().requires_grad_(meta.dtype.is_floating_point)

    def _input_problem(self, inputs) -> str | None:
        """What is wrong with this rank's batch for the plan, if anything."""
        m, shapes = self._m, self._batch_shapes
        return rankcheck.batch_problem(
            inputs, shapes, f"{len(shapes)} inputs (model inputs then the target)",
            f"({m} microbatches of {shapes[0][0] // m if shapes and shapes[0] else 0}); pass the full global batch")

    # --- the step ---------------------------------------------------------------------
    def forward(self, *inputs):
        problem = self._input_problem(inputs)
        if not self._inputs_checked:  # once, every rank together: none may raise alone
            rankcheck.agree(problem)
        elif problem:
            raise InputError(problem)
        kwargs = {f"input_{i}": x.to(self._device) for i, x in enumerate(inputs)}
        if not self._inputs_checked:
            rankcheck.same_inputs(list(kwargs.values()), self._device)
            self._inputs_checked = True
        self._refresh()
        losses: list = []
        # The loss is computed inside the last stage's program; the schedule's
        # target only has to split into m pieces.
        target = torch.zeros(self._m, device=self._device)
        training = torch.is_grad_enabled()
        if training:
            with self._accumulation.collecting():
                self._schedule.step(target=target, losses=losses, return_outputs=False, **kwargs)
            scatter = {z.full: z for z in self._zero1.values()}
            self.deferred_reductions = self._accumulation.reduce(self._inner, scatter)
        else:
            self._schedule.eval(target=target, losses=losses, return_outputs=False, **kwargs)
        value = torch.zeros((), dtype=self._loss_dtype, device=self._device)
        if losses:
            for loss in losses:
                value = value + loss.detach()
        dist.broadcast(value, group=self._pp_group, group_src=self._p - 1)
        return _ReportedLoss.apply(value, self._anchor) if training else value

    # --- full tensors under the original names -----------------------------------------
    def _gather(self, tensors: dict) -> dict:
        """{fqn: local shard} of this rank's stage -> {fqn: full tensor} of every parameter, on every rank."""
        full = {}
        for fqn in self._local_fqns:
            t = tensors.get(fqn)
            if t is None:
                t = torch.zeros_like(self._local[fqn])
            full[fqn] = DTensor.from_local(t.detach(), self._inner, self._placements[fqn],
                                           run_check=False).full_tensor()
        out = {}
        for fqn, info in self.plan.parameters.items():
            owner = self._stage_of[fqn] % self._p
            buf = full[fqn] if owner == self._pp_coord else \
                torch.empty(info["shape"], dtype=self._dtypes[fqn], device=self._device)
            dist.broadcast(buf, group=self._pp_group, group_src=owner)
            out[fqn] = buf
        return out

    def _refresh(self) -> None:
        """Gather the ZeRO-1 shards the optimizer updated into the stage's parameters (collective)."""
        for shards in gradsync.by_axis(self._zero1.values()):
            gradsync.all_gather_in_buckets(shards, shards[0].bucket_bytes)

    def optimizer(self, optimizer_class, params=None, **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class`` over this stage's parameters (ParallelModule.optimizer's
        counterpart: pipelined plans keep optimizer state on the device)."""
        return optimizer_class(self.parameters() if params is None else params, **kwargs)

    def state_dict(self, *args, **kwargs):
        self._refresh()
        full = self._gather({fqn: p for fqn, p in self._local.items()})
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        sd = {}
        for key in self._order:
            sd[prefix + key] = full[key] if key in full else self._buffers_full[key]
        return sd

    def describe(self) -> dict:
        """What the ranks run of the plan, for a check's report (autopar.verify; collective)."""
        plan, pipe = self.plan, self.plan.pipeline
        by_name = {n.name: n for n in plan.nodes}
        by_rank = [None] * dist.get_world_size()
        dist.all_gather_object(by_rank, sorted(self._local_fqns))
        return {"schedule": pipe["schedule"], "microbatches": pipe["microbatches"],
                "virtual_stages": pipe["virtual_stages"], "optimizer_sharding": pipe.get("optimizer_sharding"),
                "stages": [{"layers": s["layers"], "devices": s["devices"]} for s in pipe["stages"]],
                "programs": {c: src.count("checkpoint") for c, src in self.programs.items()},
                "send_recv": plan.count(kind="send_recv"),
                "sent": {n: cut_spec(by_name[n].output_spec, plan.mesh)
                         for s in pipe["stages"] for n in s.get("sends", [])},
                "local_parameters_by_rank": by_rank, "deferred_reductions": self.deferred_reductions,
                "zero1_parameters": sorted(self._zero1)}

    def full_gradients(self) -> dict:
        """Every parameter's full gradient, on every rank (for checks; collective)."""
        grads = {fqn: p.grad for fqn, p in self._local.items() if p.grad is not None}
        grads.update({fqn: z.full_grad() for fqn, z in self._zero1.items() if z.shard.grad is not None})
        return self._gather(grads)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        missing = [k for k in self._order if k not in state_dict]
        unexpected = [k for k in state_dict if k not in self._order]
        if strict and (missing or unexpected):
            raise AutoparError(f"state_dict mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
        with torch.no_grad():
            for fqn, prm in self._local.items():
                if fqn in state_dict:
                    prm.copy_(shard_of(state_dict[fqn].to(self._device), self._placements[fqn], self._inner))
                    if fqn in self._zero1:
                        self._zero1[fqn].load()
            for key, buf in self._buffers_full.items():
                if key in state_dict:
                    buf.copy_(state_dict[key])
        return torch.nn.modules.module._IncompatibleKeys(missing, unexpected)


class _MicrobatchLoss:
    """The schedule's loss: the last stage already returns the microbatch's mean
    loss; dividing by m makes the sum over microbatches the full-batch mean."""

    def __init__(self, m: int):
        self.m = m

    def __call__(self, output, target):
        return output / self.m


class _ParamTree(nn.Module):
    """Parameters registered under their original dotted names (``blocks.0.attn.q.weight``)."""

    def __init__(self, params: dict):
        super().__init__()
        for fqn, prm in params.items():
            owner = self
            *path, leaf = fqn.split(".")
            for part in path:
                if part not in owner._modules:
                    owner.add_module(part, nn.Module())
                owner = owner._modules[part]
            owner.register_parameter(leaf, prm)
