"""Running a dynamic plan: each forward runs the piece for its batch's sizes.

``DynamicModule`` reads the symbols' sizes off the (global) inputs, finds the
piece that covers them (``Dynamic.piece``) and runs that piece's program,
built the first time the piece is used from the step captured once with
symbolic sizes: the program reads its sizes from its inputs, so one program
serves every size of its piece (autopar/codegen.py). Nothing is compiled
again; ``compile_count`` stays 1.

Pieces may place parameters differently. The parameters (and their
gradients, and the state of the optimizers that update them) then move to
the new piece's placements when a forward first runs it: gathered whole over
the axes they leave and cut again (exact, one all-gather per moved tensor).
A moved parameter is a new tensor: the optimizers are pointed at it, and
``pmodel.parameters()`` gives it, but a list of the old ones kept elsewhere
is stale. Optimizers are found as they step (torch's global optimizer step
hook); ``pmodel.optimizer(cls, ...)`` registers the one it builds at once.

A size outside every piece raises an ``InputError`` naming the declared
sizes; with ``fallback="compile"`` a plan for that one size is compiled
instead (``compile_count`` counts it) and kept for the next time.
"""
from __future__ import annotations

import copy
import weakref

import torch

import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from autopar.codegen import build_program, load_program, program_source
from autopar.dynamic.graph import SymbolicGraph
from autopar.dynamic.planfile import Dynamic
from autopar.errors import AutoparError, InputError, RankMismatchError
from autopar.plan import Plan
from autopar.runtime import ParallelModule, adopt, shard_of

FALLBACKS = ("error", "compile")

_LIVE: "weakref.WeakSet[DynamicModule]" = weakref.WeakSet()
_HOOK = None


def _seen_step(optimizer, args, kwargs) -> None:
    """torch's global optimizer step pre-hook: an optimizer over a dynamic
    module's parameters is one whose state moves with them."""
    for module in list(_LIVE):
        module._track(optimizer)


class _Piece(ParallelModule):
    """A piece's program: takes any sizes of its piece (the parent checks them)."""

    sizes: dict = {}

    def _input_shapes(self, key: str) -> list:
        return self.symbolic.input_shapes(self.sizes)


class DynamicModule(nn.Module):
    """The user's model running a dynamic plan on this rank."""

    def __init__(self, model: nn.Module, plan: Plan, example_inputs, *, loss_fn=None, device_mesh,
                 fallback: str = "error", compile_options: dict | None = None,
                 bucket_bytes: int | None = None):
        super().__init__()
        global _HOOK
        if fallback not in FALLBACKS:
            raise AutoparError(f"fallback {fallback!r} is not one of {FALLBACKS} (what a size outside every piece "
                               "of the plan does: raise, or compile a plan for it)")
        if plan.dynamic is None:
            raise AutoparError("DynamicModule runs a plan compiled with dynamic=...; this plan is for one size")
        self.plan, self.dyn, self.fallback = plan, Dynamic(plan), fallback
        self.mesh, self.loss_fn = device_mesh, loss_fn
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.compile_count = 1
        self._compile_options = dict(compile_options or {})
        self._bucket = {} if bucket_bytes is None else {"bucket_bytes": bucket_bytes}
        # the model at full size on the meta device: for the symbolic capture and any later compile
        self._shadow = [copy.deepcopy(model).to("meta")]
        meta = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in example_inputs)
        self._meta_inputs = meta
        self.symbolic = SymbolicGraph(self._shadow[0], meta, loss_fn, self.dyn.symbols)
        self._model = [model]
        self._runners: dict = {}
        self._active: list = [None]  # the runner whose placements the parameters hold (a list: not a submodule)
        self._optimizers: "weakref.WeakSet" = weakref.WeakSet()
        self._active[0] = self._runner(self.dyn.piece(self.symbolic.example))
        adopt(self, model)
        self._param_ids = {id(p) for p in model.parameters()}
        _LIVE.add(self)
        if _HOOK is None:
            _HOOK = register_optimizer_step_pre_hook(_seen_step)

    @property
    def module(self) -> nn.Module:
        return self._model[0]

    @property
    def _current(self) -> ParallelModule:
        return self._active[0]

    @property
    def pieces(self) -> int:
        return len(self.dyn.pieces)

    def _runner(self, key) -> ParallelModule:
        """The program of piece ``key`` (an index), or of one size compiled on its own (("size", sizes))."""
        if key in self._runners:
            return self._runners[key]
        sharded = bool(self._runners)  # the first one shards the model's parameters; the rest find them sharded
        if isinstance(key, int):
            plan = self.dyn.plan(key)
            graph = self.symbolic.specialize(self.dyn.point(key))
            program = load_program(program_source(build_program(graph, plan), plan))
            runner = _Piece(self._model[0], plan, program, loss_fn=self.loss_fn, device_mesh=self.mesh,
                            sharded=sharded, check_ranks=False, **self._bucket)
            runner.symbolic = self.symbolic
        else:
            runner = self._compiled(dict(key[1]), sharded)
        self._runners[key] = runner
        return runner

    def _compiled(self, sizes: dict, sharded: bool) -> ParallelModule:
        """A plan for one size outside the plan's pieces (``fallback="compile"``)."""
        from autopar.capture import capture
        from autopar.compiler import compile as compile_plan
        from autopar.runtime import agreed_plan
        inputs = list(self._meta_inputs)
        for s in self.dyn.symbols:
            for i, d in s.dims:
                shape = list(inputs[i].shape)
                shape[d] = sizes[s.name]
                inputs[i] = torch.empty(shape, dtype=inputs[i].dtype, device="meta")
        shadow = self._shadow[0].train(self.training)
        opts = {k: v for k, v in self._compile_options.items() if k not in ("dynamic", "dims", "tolerance")}
        plan = agreed_plan(lambda: compile_plan(shadow, inputs, mesh=self.plan.mesh, cluster=self.plan.cluster,
                                                loss_fn=self.loss_fn, **opts))
        self.compile_count += 1
        program = load_program(program_source(build_program(capture(shadow, inputs, self.loss_fn), plan), plan))
        return ParallelModule(self._model[0], plan, program, loss_fn=self.loss_fn, device_mesh=self.mesh,
                              sharded=sharded, check_ranks=False, **self._bucket)

    # --- a forward ---------------------------------------------------------
    def forward(self, *inputs):
        sizes = self.symbolic.values_of(inputs)
        if "problem" in sizes:
            raise InputError(f"the batch's sizes do not fit the plan's symbols: {sizes['problem']}")
        _same_sizes(sizes, self.dyn.names)
        try:
            key = self.dyn.piece(sizes)
        except InputError:
            if self.fallback != "compile":
                raise
            key = ("size", tuple(sorted(sizes.items())))
        runner = self._runner(key)
        if runner is not self._current:
            self._move(self._current, runner)
            self._active[0] = runner
        if isinstance(runner, _Piece):
            runner.sizes = sizes
        return runner.train(self.training)(*inputs)

    def _move(self, old: ParallelModule, new: ParallelModule) -> None:
        """Parameters, their gradients and their optimizers' state from ``old``'s
        placements to ``new``'s. A parameter that moves is a new tensor (its
        shape changes, and autograd keeps the old one's): the model, the
        programs and the optimizers are pointed at it."""
        model = self._model[0]
        names: dict = {}
        for fqn, p in model.named_parameters(remove_duplicate=False):  # tied weights: every name of one tensor
            names.setdefault(id(p), (p, []))[1].append(fqn)
        owners = [self, *self._runners.values()]
        for p, fqns in names.values():
            src, dst = old._placements[fqns[0]], new._placements[fqns[0]]
            if src == dst:
                continue
            q = nn.Parameter(_moved(p.data, src, dst, self.mesh), requires_grad=p.requires_grad)
            if p.grad is not None:
                q.grad = _moved(p.grad, src, dst, self.mesh)
            for fqn in fqns:
                parent, _, leaf = fqn.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, leaf, q)
            for owner in owners:  # the model's top-level parameters, registered on each wrapper too
                for k, v in owner._parameters.items():
                    if v is p:
                        owner._parameters[k] = q
            for opt in list(self._optimizers):
                for group in opt.param_groups:
                    group["params"] = [q if x is p else x for x in group["params"]]
                if p in opt.state:
                    state = opt.state.pop(p)
                    opt.state[q] = {k: _moved(v, src, dst, self.mesh) if isinstance(v, torch.Tensor) and v.dim()
                                    and v.shape == p.shape else v for k, v in state.items()}
        self._param_ids = {id(p) for p in model.parameters()}

    def _track(self, optimizer) -> None:
        if any(id(p) in self._param_ids for g in optimizer.param_groups for p in g["params"]):
            self._optimizers.add(optimizer)

    def optimizer(self, optimizer_class, params=None, **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class`` over this module's parameters, its state moving with them between pieces."""
        opt = optimizer_class(list(self.parameters()) if params is None else params, **kwargs)
        self._optimizers.add(opt)
        return opt

    # --- checkpoints speak full tensors -------------------------------------
    def state_dict(self, *args, **kwargs):
        return self._current.state_dict(*args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self._current.load_state_dict(state_dict, strict, assign)


def piece_sources(model: nn.Module, example_inputs, loss_fn, plan: Plan) -> dict:
    """Each piece's program as ``DynamicModule`` builds it: piece index -> source."""
    dyn = Dynamic(plan)
    sg = SymbolicGraph(model, tuple(example_inputs), loss_fn, dyn.symbols)
    out = {}
    for i in range(len(dyn.pieces)):
        piece = dyn.plan(i)
        out[i] = program_source(build_program(sg.specialize(dyn.point(i)), piece), piece)
    return out


def _moved(t: torch.Tensor, src: tuple, dst: tuple, mesh) -> torch.Tensor:
    """``t`` (this rank's piece under ``src``) as its piece under ``dst``."""
    full = DTensor.from_local(t.detach(), mesh, src, run_check=False).full_tensor()
    return shard_of(full, dst, mesh)


def _same_sizes(sizes: dict, names: tuple) -> None:
    """Every rank passes a batch of the same sizes (each runs the piece its
    sizes name: ranks that differ would run different programs). One small
    all-reduce per forward."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    mine = torch.tensor([sizes[n] for n in names] + [-sizes[n] for n in names], dtype=torch.int64)
    if dist.get_backend() == "nccl":
        mine = mine.cuda()
    top = mine.clone()
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    if not torch.equal(top.cpu(), mine.cpu()):
        k = len(names)
        spread = {n: (-int(top[k + i]), int(top[i])) for i, n in enumerate(names)}
        raise RankMismatchError(
            f"ranks passed batches of different sizes ({', '.join(f'{n} from {a} to {b}' for n, (a, b) in spread.items())}"
            f"; this rank {sizes}): every rank passes the same global batch, and each runs the piece of the plan "
            "its sizes name")


__all__ = ["DynamicModule", "FALLBACKS", "piece_sources"]
