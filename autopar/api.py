"""Front door: ``autoparallelize`` (call or decorator)."""
from __future__ import annotations

import copy
import functools
import warnings

import torch
from torch import nn

from autopar import rankcheck
from autopar.codegen import build_program, load_program, program_source
from autopar.capture import capture
from autopar.compiler import compile as compile_plan
from autopar.errors import AutoparError
from autopar.mesh import parse_mesh
from autopar.plan import Plan
from autopar.runtime import ParallelModule, adopt, agreed_plan, in_torchrun, init_distributed


def autoparallelize(model=None, example_inputs=None, *, mesh, cluster, loss_fn=None, plan: Plan | str | None = None,
                    single_device: bool = False, local_inputs: bool = False, fallback: str = "error",
                    **compile_options):
    """Parallelize ``model`` for ``mesh`` on ``cluster`` and return an nn.Module
    that runs the plan on this torchrun rank.

    * ``autoparallelize(model, example_inputs, mesh=..., cluster=..., loss_fn=...)``
      compiles now; ``pmodel(*inputs, target)`` returns the loss.
    * ``@autoparallelize(mesh=..., cluster=...)`` on an nn.Module subclass compiles
      on the first forward call from the shapes it sees (and again for new shapes).
    * ``plan=`` runs a plan compiled earlier (a Plan or a plan.json path).
    * ``local_inputs=True``: each rank passes its own shard of the batch (e.g. from a
      DistributedSampler) instead of the full global batch.
    * ``single_device=True`` outside torchrun runs the plain model (with a warning).
    * ``dynamic={"batch": (4, 32)}`` (and ``dims=``, ``tolerance=``; see ``autopar.compile``):
      one compile for every size in the range; each forward runs the plan's piece for
      its sizes, compiling nothing again. A size outside the range raises, or with
      ``fallback="compile"`` gets a plan of its own. ``pmodel.compile_count`` says how
      many compiles it has run.
    """
    if isinstance(model, type) and issubclass(model, nn.Module):
        return _decorate(model, mesh=mesh, cluster=cluster, loss_fn=loss_fn, single_device=single_device,
                         local_inputs=local_inputs, fallback=fallback, **compile_options)
    if model is None:
        return functools.partial(autoparallelize, mesh=mesh, cluster=cluster, loss_fn=loss_fn, plan=plan,
                                 single_device=single_device, local_inputs=local_inputs, fallback=fallback,
                                 **compile_options)
    if example_inputs is None:
        raise AutoparError("autoparallelize(model, example_inputs, ...) needs example_inputs "
                           "(or use it as a class decorator, which compiles on the first call)")
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    mesh_ = parse_mesh(mesh)
    if not in_torchrun() and single_device:
        warnings.warn(f"autopar: not in a torchrun job; running the model on one process (single_device=True) "
                      f"instead of the {mesh_.size}-device plan", stacklevel=2)
        return _SingleDevice(model, loss_fn)
    device_mesh = init_distributed(mesh_.shape, mesh_.names)
    # before anything a rank could do on its own (compile, trace): ranks holding different models would part ways
    rankcheck.same_state(model, torch.device(device_mesh.device_type, torch.cuda.current_device())
                         if device_mesh.device_type == "cuda" else torch.device("cpu"))
    if isinstance(plan, str):
        plan = Plan.load(plan)
    compiles = 0
    if plan is None:
        plan = agreed_plan(lambda: compile_plan(model, example_inputs, mesh=mesh_, cluster=cluster, loss_fn=loss_fn,
                                                **compile_options))
        compiles = 1
    if plan.dynamic is not None:
        from autopar.dynamic.runtime import DynamicModule
        if local_inputs:
            raise AutoparError("local_inputs=True is not supported with a dynamic plan: pass the global batch "
                               "(each forward reads its sizes from it)")
        pmodel = DynamicModule(model, plan, example_inputs, loss_fn=loss_fn, device_mesh=device_mesh,
                               fallback=fallback, compile_options=compile_options)
        pmodel.compile_count = compiles
        return pmodel
    if plan.pipeline:
        from autopar.pipeline_runtime import PipelinedModule, init_pipeline_mesh
        if local_inputs:
            raise AutoparError("local_inputs=True is not supported with a pipelined plan: pass the global batch")
        pmodel = PipelinedModule(model, plan, loss_fn=loss_fn, device_mesh=init_pipeline_mesh(plan.mesh),
                                 check_ranks=False)
        pmodel.compile_count = compiles
        return pmodel
    graph = capture(model, example_inputs, loss_fn)
    program = load_program(program_source(build_program(graph, plan, local_inputs), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh, local_inputs=local_inputs,
                            check_ranks=False)
    pmodel.compile_count = compiles
    return pmodel


class _SingleDevice(nn.Module):
    def __init__(self, model, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, *inputs):
        if self.loss_fn is None:
            return self.model(*inputs)
        return self.loss_fn(self.model(*inputs[:-1]), inputs[-1])

    def state_dict(self, *args, **kwargs):
        return self.model.state_dict(*args, **kwargs)

    def load_state_dict(self, *args, **kwargs):
        return self.model.load_state_dict(*args, **kwargs)

    def optimizer(self, optimizer_class, params=None, **kwargs) -> torch.optim.Optimizer:
        """``optimizer_class`` over the parameters (ParallelModule.optimizer's counterpart)."""
        return optimizer_class(self.parameters() if params is None else params, **kwargs)


def _decorate(cls, **options):
    """Wrap an nn.Module subclass: instances compile on first call and run the plan.

    A call with new input shapes, or in the other mode (``.eval()``, whose
    dropout and batch norm differ), compiles again, keeping the parameters'
    placements so that the shards (and the optimizer's state) stay valid.
    With ``dynamic=``, shapes within its ranges run the first compile's plan
    (its pieces); only the mode compiles again."""
    dynamic = options.get("dynamic") is not None

    class Parallel(cls):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self._autopar = {}

        @property
        def compile_count(self) -> int:
            """How many compiles this instance has run (a dynamic plan's fallbacks included)."""
            return sum(getattr(r, "compile_count", 1) for r in self._autopar.values())

        def forward(self, *inputs):
            key = (self.training, *((tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in inputs))
            if dynamic:  # the plan's pieces take every size in its ranges
                key = (self.training, *(x.dtype if isinstance(x, torch.Tensor) else x for x in inputs))
            runner = self._autopar.get(key)
            if runner is None:
                plain = _PlainForward(cls, self).train(self.training)
                if not self._autopar:
                    # a meta-device twin with the full shapes, for later compiles
                    object.__setattr__(self, "_autopar_shadow", copy.deepcopy(plain).to("meta"))
                    runner = autoparallelize(plain, inputs, **options)
                else:
                    runner = _recompile(plain, self._autopar_shadow.train(self.training),
                                        next(iter(self._autopar.values())), inputs, options)
                self._autopar[key] = runner
            return runner.train(self.training)(*inputs)

        def state_dict(self, *args, **kwargs):
            """Full tensors under the original names, sharded or not."""
            if self._autopar:
                return next(iter(self._autopar.values())).state_dict(*args, **kwargs)
            return super().state_dict(*args, **kwargs)

        def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
            if self._autopar:
                return next(iter(self._autopar.values())).load_state_dict(state_dict, strict, assign)
            return super().load_state_dict(state_dict, strict, assign)

    Parallel.__name__ = cls.__name__
    Parallel.__qualname__ = cls.__qualname__
    Parallel.__doc__ = cls.__doc__
    return Parallel


def _recompile(plain, shadow, first: ParallelModule, inputs, options):
    loss_fn = options.get("loss_fn")
    meta_inputs = tuple(torch.empty_like(x, device="meta") if isinstance(x, torch.Tensor) else x for x in inputs)
    compile_options = {k: v for k, v in options.items()
                       if k not in ("loss_fn", "single_device", "local_inputs", "mesh", "cluster", "plan", "fallback")}
    if compile_options.get("dynamic") is not None:
        raise AutoparError("a decorated module with a dynamic plan compiles once; another mode (train/eval) needs a "
                           "module of its own (build one with the model in that mode)")
    pins = {fqn: info["placements"] for fqn, info in first.plan.parameters.items()}
    plan = agreed_plan(lambda: compile_plan(shadow, meta_inputs, mesh=options["mesh"], cluster=options["cluster"],
                                            loss_fn=loss_fn, parameter_placements=pins, **compile_options))
    graph = capture(shadow, meta_inputs, loss_fn)
    program = load_program(program_source(build_program(graph, plan, options.get("local_inputs", False)), plan))
    return ParallelModule(plain, plan, program, loss_fn=loss_fn, device_mesh=first.mesh,
                          local_inputs=options.get("local_inputs", False), sharded=True)


class _PlainForward(nn.Module):
    """The decorated instance seen through its undecorated class's forward."""

    def __init__(self, cls, instance):
        super().__init__()
        object.__setattr__(self, "_cls", cls)
        adopt(self, instance)
        object.__setattr__(self, "_instance", instance)

    def forward(self, *inputs):
        return self._cls.forward(self, *inputs)
