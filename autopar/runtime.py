"""Runtime: the process group and DeviceMesh from the torchrun environment, the
sharded parameters, and an nn.Module that runs the emitted program.

``ParallelModule`` behaves like the user's model: ``.parameters()`` are this
rank's shards (an ordinary optimizer updates them; elementwise optimizers such
as SGD and AdamW then match single-device training exactly), and
``state_dict()`` / ``load_state_dict()`` speak full tensors under the original
names, so checkpoints move between single-device and parallel runs.
"""
from __future__ import annotations

import importlib.util
import os
import sys

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_unflatten, treespec_loads

from autopar import errors, gradsync, local_ops, rankcheck, spmd
from autopar.cost_models.collectives import BUCKET_BYTES
from autopar.errors import AutoparError, FactoryError, InputError, LaunchError
from autopar.offload import OffloadOptimizer, is_offloaded, mark_offloaded
from autopar.passes.strategy import parse_spec
from autopar.plan import Plan
from autopar.tracebacks import format_frames, user_frames


def in_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def torchrun_command(nproc: int) -> str:
    script = sys.argv[0] if sys.argv and sys.argv[0] else "train.py"
    return f"torchrun --nproc-per-node {nproc} {' '.join([script, *sys.argv[1:]])}"


def init_distributed(mesh_shape, axis_names):
    """Join the torchrun job (gloo on CPU, NCCL on GPUs) and build the mesh."""
    size = 1
    for s in mesh_shape:
        size *= s
    if not in_torchrun() and not dist.is_initialized():
        raise LaunchError(
            f"autopar runs the plan on {size} processes, but this is not a torchrun job. Launch it with:\n"
            f"    {torchrun_command(size)}\n"
            "or pass single_device=True to run the plain model on this process"
        )
    if not dist.is_initialized():
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
    world = dist.get_world_size()
    if world != size:
        shape = " x ".join(f"{n}({s})" for n, s in zip(axis_names, mesh_shape))
        raise LaunchError(
            f"world size {world} does not match the plan's mesh: {shape} = {size} devices. "
            f"Launch with torchrun --nproc-per-node {size} (or --nnodes N --nproc-per-node {size}/N), "
            f"or compile the plan for a mesh of {world} devices"
        )
    device = "cuda" if torch.cuda.is_available() else "cpu"
    return init_device_mesh(device, tuple(mesh_shape), mesh_dim_names=tuple(axis_names))


def agreed_plan(make_plan) -> Plan:
    """Rank 0 plans and every rank runs that plan: ranks planning on their own
    could break a cost tie differently (or stop at a time limit at different
    points) and then disagree about the collectives to run. A compile that
    raises on rank 0 raises the same error on every rank: none is left
    waiting in the broadcast for a plan that never comes."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return make_plan()
    failure = None
    obj = [None]
    if dist.get_rank() == 0:
        try:
            obj[0] = make_plan().to_json()
        except Exception as e:  # every rank raises it, none waits in the broadcast for a plan
            failure = e
            obj[0] = {"error": _error_payload(e)}
    dist.broadcast_object_list(obj, src=0)
    if failure is not None:
        raise failure
    if "error" in obj[0]:
        raise _remote_error(obj[0]["error"])
    return Plan.from_json(obj[0])


def _error_payload(e: BaseException) -> dict:
    return {"type": type(e).__name__, "message": str(e), "autopar": isinstance(e, AutoparError),
            "needed_bytes": getattr(e, "needed_bytes", None), "status": getattr(e, "status", None)}


def _remote_error(payload: dict) -> Exception:
    """Rank 0's compile error, raised on this rank as the same autopar type."""
    cls = getattr(errors, payload["type"], None)
    if payload["autopar"] and isinstance(cls, type) and issubclass(cls, AutoparError):
        if cls is errors.InfeasibleError:
            return cls(payload["message"], needed_bytes=payload["needed_bytes"], status=payload["status"])
        return cls(payload["message"])
    return AutoparError(f"compiling the plan on rank 0 raised {payload['type']}: {payload['message']}")


def shutdown(exit_code: int | None = None) -> None:
    """Leave the process group together (a barrier, then destroy it); with
    ``exit_code``, also end the process right there.

    Ending it is what a torchrun script should do last. A gloo worker thread
    releases each finished collective's work object a moment after the
    collective returns, and with it tensors whose Python objects it must then
    free under the GIL. If the interpreter is already tearing down by then,
    the thread cannot take the GIL and the process aborts ("terminate called
    without an active exception"; a core dump shows ~AsyncBarrierWork ->
    ~AsyncAllreduceWork -> decref_pyobject -> PyThread_exit_thread). Measured
    here: 2 of 11 four-rank runs, with one barrier or two. ``os._exit`` skips
    the teardown (stdout and stderr are flushed first; open files are not)."""
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    if exit_code is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(exit_code)


def shard_of(full: torch.Tensor, placements, mesh) -> torch.Tensor:
    """This rank's piece of ``full`` (no communication: every rank holds
    ``full``), in storage of its own: a chunk is a view, and a view would keep
    the whole tensor alive."""
    local = full
    coord = mesh.get_coordinate()
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            local = local.chunk(mesh.size(axis), dim=p.dim)[coord[axis]]
    return local.clone(memory_format=torch.contiguous_format) if local is not full else local.contiguous()


def adopt(owner: nn.Module, model: nn.Module) -> None:
    """Register ``model``'s children and own tensors on ``owner``, so that
    ``owner``'s parameter and state-dict names are the model's own."""
    for name, child in model.named_children():
        owner.add_module(name, child)
    for name, p in model.named_parameters(recurse=False):
        owner.register_parameter(name, p)
    for name, b in model.named_buffers(recurse=False):
        owner.register_buffer(name, b)


def _split(fqn: str):
    parent, _, leaf = fqn.rpartition(".")
    return parent, leaf


class ParallelModule(nn.Module):
    """The user's model, running ``plan`` on this rank."""

    def __init__(self, model: nn.Module, plan: Plan, program: nn.Module, *, loss_fn=None,
                 device_mesh=None, local_inputs: bool = False, sharded: bool = False,
                 bucket_bytes: int | None = BUCKET_BYTES, check_ranks: bool = True):
        """``sharded=True``: the model's parameters already are this rank's shards.
        ``check_ranks=False``: the caller has checked that every rank holds
        rank 0's model (``rankcheck.same_state``; done here otherwise).
        ``bucket_bytes``: the size of the buckets replicated parameters'
        gradients are all-reduced in during backward (``gradsync.GradSync``;
        DDP's default); None: one blocking all-reduce per parameter."""
        super().__init__()
        self.bucket_bytes = bucket_bytes
        self.plan = plan
        self.mesh = device_mesh if device_mesh is not None else init_distributed(plan.mesh.shape, plan.mesh.names)
        self.rank = dist.get_rank()
        device = torch.device("cuda", torch.cuda.current_device()) if self.mesh.device_type == "cuda" \
            else torch.device("cpu")
        self._program = program
        self._local_inputs = local_inputs
        self._inputs_checked = False  # at the first forward, on every rank together
        if check_ranks and not sharded:
            rankcheck.same_state(model, device)
        self._placements = {}
        nd = plan.mesh.ndim
        names = dict(model.named_parameters(remove_duplicate=False))  # tied weights under every name
        aliases: dict = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):
            aliases.setdefault(id(p), []).append(fqn)
        missing = [f for f in plan.parameters if f not in names]
        if missing:
            raise AutoparError(f"the plan shards parameters the model does not have: {missing[:5]}")
        for fqn, info in plan.parameters.items():
            placements = tuple(parse_spec("".join(info["placements"]), nd))
            self._placements[fqn] = placements
            if sharded:
                continue
            original = names[fqn]
            for alias in aliases[id(original)]:
                if alias in plan.parameters and plan.parameters[alias]["placements"] != info["placements"]:
                    raise AutoparError(f"{fqn} and {alias} are one tied tensor but the plan places them "
                                       f"{info['placements']} and {plan.parameters[alias]['placements']}; "
                                       "recompile the plan with this autopar")
            local = nn.Parameter(shard_of(original.detach().to(device), placements, self.mesh),
                                 requires_grad=original.requires_grad)
            for alias in aliases[id(original)]:  # tied weights: every name gets the same shard
                parent, leaf = _split(alias)
                setattr(model.get_submodule(parent) if parent else model, leaf, local)
                self._placements[alias] = placements
        for fqn, buf in list(model.named_buffers()):
            parent, leaf = _split(fqn)
            owner = model.get_submodule(parent) if parent else model
            owner._buffers[leaf] = buf.to(device)
        adopt(self, model)
        self._model = [model]  # not a submodule: avoid a "model." prefix
        self._order = plan.model.get("placeholders") or []
        self._out_spec = treespec_loads(plan.model["out_spec"])
        self.loss_fn = loss_fn
        mark_offloaded(p for fqn, p in model.named_parameters(remove_duplicate=False)
                       if plan.parameters.get(fqn, {}).get("offload"))

    def optimizer(self, optimizer_class, params=None, **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class(params, **kwargs)`` (params: this module's
        parameters, or the groups given) as the plan runs it: where the plan
        keeps some parameters' optimizer state in host memory ("offload"),
        an ``autopar.offload.OffloadOptimizer`` that updates those there;
        otherwise the plain optimizer. Elementwise optimizers (SGD, Adam,
        AdamW) then train exactly like one device."""
        params = list(self.parameters()) if params is None else list(params)
        flat = [p for x in params for p in (x["params"] if isinstance(x, dict) else [x])]
        if any(is_offloaded(p) for p in flat):
            return OffloadOptimizer(params, optimizer_class, **kwargs)
        return optimizer_class(params, **kwargs)

    @property
    def module(self) -> nn.Module:
        return self._model[0]

    def _flat_args(self, inputs):
        model = self._model[0]
        params = dict(model.named_parameters(remove_duplicate=False))
        buffers = dict(model.named_buffers())
        out = []
        for kind, key in self._order:
            if kind == "param":
                out.append(params[key])
            elif kind == "buffer":
                out.append(buffers[key])
            else:
                out.append(inputs[key])
        return out

    def forward(self, *inputs):
        check_mode(self.training, self.plan)
        device = torch.device(self.mesh.device_type) if self.mesh.device_type == "cpu" else \
            torch.device("cuda", torch.cuda.current_device())
        problem = self._input_problem(inputs)
        if not self._inputs_checked:
            # Once, every rank together: a rank whose batch is wrong must not raise alone
            # (the others would wait for it in the step's first collective).
            rankcheck.agree(problem)
        elif problem:
            raise InputError(problem)
        inputs = [x.to(device) for x in inputs]
        if not self._inputs_checked:
            if not self._local_inputs:
                rankcheck.same_inputs(inputs, device)
            self._inputs_checked = True
        with spmd.use_mesh(self.mesh), local_ops.random_step(), gradsync.grad_sync(self.mesh, self.bucket_bytes):
            flat = self._program(*self._flat_args(inputs))
        return tree_unflatten(list(flat), self._out_spec)

    def _input_problem(self, inputs) -> str | None:
        """What is wrong with this rank's batch for the plan, if anything: the
        number of inputs, a non-tensor, a shape (the global one, or with
        ``local_inputs`` this rank's shard of it)."""
        what = "model inputs then the target" if self.plan.model.get("has_loss") else "model inputs"
        key, kind = ("local_shape", "this rank's shard, local_inputs=True") if self._local_inputs else \
            ("shape", "the whole global batch")
        return rankcheck.batch_problem(
            inputs, self._input_shapes(key), f"{len(self.plan.inputs)} input(s) ({what})",
            f"({kind}). autopar plans static shapes: compile for this shape (the decorator form does so itself), "
            "or for a range of them (dynamic=...)")

    def _input_shapes(self, key: str) -> list:
        """The shapes the plan takes (``shape``: global, ``local_shape``: this rank's)."""
        return [info[key] for info in self.plan.inputs]

    # --- checkpoints speak full tensors ---------------------------------
    def state_dict(self, *args, **kwargs):
        sd = super().state_dict(*args, **kwargs)
        prefix = kwargs.get("prefix", args[1] if len(args) > 1 else "")
        for fqn, placements in self._placements.items():
            key = prefix + fqn
            if key in sd and any(isinstance(p, Shard) for p in placements):
                local = sd[key]
                sd[key] = DTensor.from_local(local.detach(), self.mesh, placements, run_check=False).full_tensor()
        return sd

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        local = dict(state_dict)
        for fqn, placements in self._placements.items():
            if fqn in local:
                local[fqn] = shard_of(local[fqn], placements, self.mesh)
        return super().load_state_dict(local, strict=strict, assign=assign)


def check_mode(training: bool, plan: Plan) -> None:
    """The program bakes in the mode the model was traced in (dropout on or
    off, batch norm's batch or running statistics): running it in the other
    mode would silently do the wrong thing."""
    traced = plan.model.get("training", True)
    if training != traced:
        now, then = ("train", "eval") if training else ("eval", "train")
        raise AutoparError(
            f"the module is in {now} mode but its plan was compiled from the model in {then} mode, whose "
            f"dropout and batch norm the program keeps: compile a plan with the model in {now} mode "
            f"(model.{now}() before autopar.compile / autoparallelize) for this, or switch back with "
            f".{then}()")


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| in float64 (absolute when b is 0)."""
    a, b = a.detach().double(), b.detach().double()
    norm = b.norm()
    return ((a - b).norm() / norm).item() if norm > 0 else (a - b).norm().item()


def load_factory(spec: str):
    """'path/to/file.py:FACTORY' -> (model, example_inputs, loss_fn or None)."""
    if ":" not in spec:
        raise AutoparError(f"model source {spec!r} must look like FILE.py:FACTORY")
    path, name = spec.rsplit(":", 1)
    if not os.path.exists(path):
        raise AutoparError(f"model file {path!r} does not exist")
    folder = os.path.dirname(os.path.abspath(path))
    if folder not in sys.path:
        sys.path.insert(0, folder)  # a model file may import its neighbours, as a script would
    mod_name = "autopar_user_" + os.path.splitext(os.path.basename(path))[0]
    module = sys.modules.get(mod_name)
    if module is None or getattr(module, "__file__", None) != os.path.abspath(path):
        loader_spec = importlib.util.spec_from_file_location(mod_name, os.path.abspath(path))
        module = importlib.util.module_from_spec(loader_spec)
        sys.modules[mod_name] = module
        try:
            loader_spec.loader.exec_module(module)
        except Exception as e:
            del sys.modules[mod_name]
            raise FactoryError(_factory_failure(f"importing model file {path}", e, folder)) from None
    if not hasattr(module, name):
        raise AutoparError(f"{path} has no factory {name!r}")
    try:
        out = getattr(module, name)()
    except Exception as e:
        raise FactoryError(_factory_failure(f"factory {spec}", e, folder)) from None
    if not isinstance(out, tuple) or len(out) not in (2, 3):
        raise AutoparError(f"factory {spec} must return (model, example_inputs) or (model, example_inputs, loss_fn)")
    model, inputs = out[0], out[1]
    inputs = tuple(inputs) if isinstance(inputs, (tuple, list)) else (inputs,)
    return model, inputs, out[2] if len(out) == 3 else None


def _factory_failure(what: str, e: Exception, folder: str) -> str:
    """What failed, the error, and the user's own frames (those under the model
    file's folder, not autopar's or torch's), as a traceback shows them."""
    if isinstance(e, SyntaxError):
        where = f"  File \"{e.filename}\", line {e.lineno}\n    {(e.text or '').strip()}\n"
        return f"{what} failed: SyntaxError: {e.msg}\n{where}fix the syntax error and run again"
    return (f"{what} raised {type(e).__name__}: {e}\nin your code (most recent call last):\n"
            f"{format_frames(user_frames(e, folder))}fix the error in your code above and run again")


def single_device_reference(source: str, steps: int, lr: float):
    """Losses and final state of the plain model trained the same way on one process."""
    model, inputs, loss_fn = load_factory(source)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        out = model(*inputs[:-1]) if loss_fn is not None else model(*inputs)
        loss = loss_fn(out, inputs[-1]) if loss_fn is not None else out.sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, {k: v.detach() for k, v in model.state_dict().items()}
