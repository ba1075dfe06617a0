"""Check a plan numerically: train the parallel program and the single-device
model side by side and compare loss, every gradient and the updated parameters.

Errors are relative and norm-wise over the whole model: the loss per step; the
gradients after the first backward, ||g - g_ref|| / ||g_ref|| (each tensor's
own ratio is reported too, but a gradient that is zero in exact arithmetic,
like an attention key bias's, makes that ratio rounding noise over rounding
noise); the parameters after the last optimizer step, ||theta - theta_ref|| /
||theta_ref||, leaving out the parameters whose gradient is zero up to
rounding on both sides (``rounding_only``): Adam scales such noise to steps of
+-lr, so their updates cannot agree, however exact the program. For the same
reason an element whose gradient is near zero moves by rounding: the
parameters pass within the tolerance or within ``param_floor``, how far one
device drifts from itself when its gradients are off by as much as the
program's were.

Run under torchrun (it is also what ``autopar run`` launches):

    torchrun --nproc-per-node 4 -m autopar.verify examples/gpt.py:small --mesh 2x2 --cluster cpu
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import warnings

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.capture import capture
from autopar.codegen import build_program, load_program, program_source, same_steps
from autopar.errors import AutoparError, InputError
from autopar.compiler import build_plan, compile as compile_plan
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.graph_costs import CostContext
from autopar.mesh import parse_mesh
from autopar.passes.enumerate import enumerate_strategies
from autopar.plan import Plan
from autopar.runtime import ParallelModule, agreed_plan, init_distributed, load_factory, relative_error, shutdown
from autopar.solver import Solution


def random_plan(model, inputs, loss_fn, mesh, cluster, seed: int) -> Plan:
    """A plan whose every node takes a random valid strategy: a stress test of
    codegen and runtime (any valid plan must train exactly like one device)."""
    mesh = parse_mesh(mesh)
    graph = capture(model, inputs, loss_fn)
    strategies, _ = enumerate_strategies(graph, mesh.shape)
    rng = random.Random(seed)
    chosen = {name: rng.choice(s) for name, s in strategies.items()}
    for alias, first in graph.tied.items():  # one tensor, one placement
        chosen[alias] = chosen[first]
    ctx = CostContext.make(mesh.shape, get_cluster(cluster))
    sol = Solution({}, "RANDOM", 0.0, 0.0, 0, 0, 0.0)
    return build_plan(graph, chosen, strategies, ctx, mesh, sol, None)


def _full_grad(p, placements, mesh):
    """The whole gradient, or None where backward gave none (a parameter used
    only under no_grad, which the reference then has none for either)."""
    if p.grad is None:
        return None
    return DTensor.from_local(p.grad, mesh, placements, run_check=False).full_tensor()


def random_draws(graph) -> list[str]:
    """The ops of a captured model that draw random numbers when it trains
    (dropout with p > 0, noise drawn in forward, ...), as "op at location"."""
    from autopar.ir import NodeKind
    from autopar.passes.rules.factory import RANDOM_FACTORIES
    from autopar.local_ops import RANDOM_OPS, _draws
    return [f"{n.op_name} at {n.fqn or 'the top level'}" for n in graph.nodes.values()
            if n.kind is NodeKind.OP and n.info is not None and (n.target in RANDOM_OPS or n.target in RANDOM_FACTORIES)
            and _draws(n.target, n.info.args, n.info.kwargs)]


def lowest_precision(graph) -> torch.dtype:
    """The least precise floating dtype the captured step computes in (a
    bfloat16 model, or a ``torch.autocast`` block, computes below float32)."""
    dtypes = {o.dtype for n in graph.nodes.values() for o in n.outputs
              if o is not None and o.dtype.is_floating_point and not o.dtype.is_complex}
    return max(dtypes, key=lambda d: torch.finfo(d).eps, default=torch.float32)


def tolerance(requested: float | None, dtype: torch.dtype) -> tuple[float, str]:
    """A check's relative tolerance and why: ``--tol`` when given; otherwise
    1e-5 for float32, and torch.testing.assert_close's default relative
    tolerance for other dtypes: float64 1e-7 (a float32 model checked in
    float64, see ``widened``), bfloat16 1.6e-2, float16 1e-3 (a split sum adds
    its terms in another order and rounds each partial sum to the dtype, so
    one device and the parallel program differ by rounding errors of that
    size)."""
    if requested is not None:
        return requested, ""
    from torch.testing._comparison import default_tolerances
    rtol, _ = default_tolerances(torch.empty(0, dtype=dtype))
    if dtype == torch.float32:
        return 1e-5, ""
    name = str(dtype).removeprefix("torch.")
    return rtol, f"{rtol:.2g} where the model computes in {name} (torch.testing.assert_close's default for {name})"


PRECISIONS = ("auto", "float64", "model")


def widened(model, inputs) -> tuple:
    """The model and its inputs with every floating tensor cast to float64.

    A check in float32 cannot tell a rule error from rounding on a model
    whose gradients rounding alone moves far: ReLU networks with batch norm
    (a ResNet-50 at batch 8) flip the sign of a few activations near zero
    when the last bits change, and their gradients differ by 1e-2 between
    two one-device float32 runs that sum in another order (1 and 2 threads;
    ``float32_rounding`` measures it). In float64 rounding is 1e-16, nine
    orders below the tolerance, so the program must agree with one device to
    1e-7 and any rule error shows. The plan is the float32 model's: the same
    step, node for node, in other dtypes (codegen.same_steps). Casts the
    model writes itself (``x.float()``, autocast blocks) stay, and the check
    runs at the precision they leave (``lowest_precision``)."""
    model = copy.deepcopy(model).double()
    return model, torch.utils._pytree.tree_map(
        lambda x: x.double() if isinstance(x, torch.Tensor) and x.is_floating_point() else x, inputs)


def float32_rounding(model, inputs, loss_fn) -> float:
    """How far float32 rounding alone moves this model's first gradients on
    one device: ||g_fp32 - g_fp64|| / ||g_fp64||; what a float32 check of a
    perfect program could not rule out."""
    def grads(m, x):
        m = copy.deepcopy(m)
        _one_device_loss(m, x, loss_fn).backward()
        return torch.cat([_or_zeros(p.grad, p).flatten().double() for p in m.parameters()])
    return _rel(grads(model, inputs), grads(*widened(model, inputs)))


def _first_few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def noise_note(names: list[str]) -> str:
    return (f"note: {_first_few(names)}: gradient zero up to rounding in both runs (no element above the "
            "rounding unit times the largest gradient; the runs disagree beyond the tolerance), which Adam scales "
            "to steps of +-lr; their updates are left out of the parameter error")


def rounding_note(moved: float) -> str:
    """Why a float32 model was checked in float64, and how much that mattered."""
    return (f"note: checked in float64 (--precision model to check in the model's own dtypes); on one device, "
            f"float32 rounding alone moves this model's first gradients by {moved:.1e}")


def random_note(draws: list[str]) -> str:
    """Why a model that draws random numbers cannot agree with one device bit for bit."""
    return (f"note: the model draws random numbers ({_first_few(draws)}); the parallel program draws them per "
            "shard from the step's seed (like one device statistically, not bit for bit), so it cannot agree with "
            "one device: check it with the draws off (dropout p=0, noise outside the model)")


def rounding_only(mine: dict, ref: dict, tol: float) -> list[str]:
    """Parameters whose gradient is zero up to rounding in both runs, and so
    disagrees beyond ``tol``: every element at most the dtype's rounding unit
    times the largest gradient element of the model (an attention key's bias,
    whose gradient the softmax cancels). A small gradient the two runs agree
    on (a branch scaled by 1e-6) stays compared."""
    scale = max((g.abs().max().item() for g in ref.values() if g.numel()), default=0.0)
    return sorted(k for k in ref if ref[k].numel() and ref[k].is_floating_point() and max(
        ref[k].abs().max().item(), mine[k].abs().max().item()) <= torch.finfo(ref[k].dtype).eps * scale
        and _rel(mine[k], ref[k]) > tol)


def _or_zeros(grad, like):
    return torch.zeros_like(like) if grad is None else grad


def mesh_problem(plan: Plan, mesh) -> str | None:
    """Why ``mesh`` (--mesh) cannot run ``plan``, if it cannot: another shape,
    or, for a pipelined plan whose axes it names, other names (where ``pp`` is)."""
    given, want = parse_mesh(mesh), plan.mesh
    named = isinstance(mesh, str) and "=" in mesh and plan.pipeline is not None
    if given.shape == want.shape and (not named or given.names == want.names):
        return None
    spelled = ",".join(f"{n}={s}" for n, s in zip(want.names, want.shape))
    return (f"--mesh {mesh} does not match the plan's mesh {spelled} ({want.size} devices): pass --mesh {spelled}, "
            "or recompile the plan for this mesh")


def check(source: str, mesh, cluster: str, steps: int = 2, lr: float = 1e-3, random_seed: int | None = None,
          plan_path: str | None = None, local_inputs: bool = False, tol: float | None = None,
          precision: str = "auto", **compile_options) -> dict:
    """Train the plan's program and one device side by side and compare them.
    ``precision``: "auto" checks a model that computes in float32 in float64
    (``widened``), "float64" casts any model's floating tensors to float64,
    "model" runs the model in its own dtypes."""
    if precision not in PRECISIONS:
        raise ValueError(f"precision {precision!r} is not one of {', '.join(PRECISIONS)}")
    model, inputs, loss_fn = load_factory(source)
    mesh_ = parse_mesh(mesh)
    device_mesh = init_distributed(mesh_.shape, mesh_.names)
    if plan_path:
        plan = Plan.load(plan_path)
        problem = mesh_problem(plan, mesh)
        if problem:
            raise InputError(problem)
    elif random_seed is not None:
        plan = agreed_plan(lambda: random_plan(model, inputs, loss_fn, mesh_, cluster, random_seed))
    else:
        plan = agreed_plan(lambda: compile_plan(model, inputs, mesh=mesh_, cluster=cluster, loss_fn=loss_fn,
                                                source=source, **compile_options))
    pipelined = plan.pipeline is not None
    if pipelined and local_inputs:
        raise InputError("--local-inputs: a pipelined plan takes the full global batch on every rank "
                         "(its first stage splits it into microbatches); leave the flag out")
    traced = graph = capture(model, inputs, loss_fn)
    planned = None  # the model the plan was compiled for, where the check runs a float64 copy
    draws = random_draws(graph)
    rounding = None
    if precision == "float64" or (precision == "auto" and lowest_precision(graph) == torch.float32):
        wide_model, wide_inputs = widened(model, inputs)
        try:
            wide_graph = capture(wide_model, wide_inputs, loss_fn)
            same_steps(traced, wide_graph)
        except AutoparError as e:  # float32 written into the model (a scatter of a float32 constant), or
            # an op whose auxiliary outputs' sizes depend on the dtype (embedding_bag's offset2bag)
            if precision == "float64":
                raise
            warnings.warn(f"checking in the model's own dtypes: {e}", stacklevel=2)
        else:
            rounding = float32_rounding(model, inputs, loss_fn) if lowest_precision(graph) == torch.float32 else None
            planned = model
            model, inputs, graph = wide_model, wide_inputs, wide_graph
    reference, initial = copy.deepcopy(model), copy.deepcopy(model)
    if pipelined:  # the stages' programs on torch.distributed.pipelining (autopar/pipeline_runtime.py)
        from autopar.pipeline_runtime import PipelinedModule, init_pipeline_mesh
        pmodel = PipelinedModule(model, plan, loss_fn=loss_fn, device_mesh=init_pipeline_mesh(plan.mesh),
                                 planned=planned)
    else:
        program = load_program(program_source(build_program(graph, plan, local_inputs, traced=traced), plan))
        pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh,
                                local_inputs=local_inputs)
    run_inputs = inputs
    if local_inputs:
        from autopar.runtime import shard_of
        from autopar.passes.strategy import parse_spec
        run_inputs = tuple(shard_of(x, parse_spec("".join(i["placements"]), mesh_.ndim), device_mesh)
                           for x, i in zip(inputs, plan.inputs))
    opt = pmodel.optimizer(torch.optim.AdamW, lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    dtype = lowest_precision(graph)
    report = {"loss": [], "grad": 0.0, "random_draws": draws, "dtype": str(dtype), "float32_rounding": rounding}
    report["tol"], report["tol_why"] = tolerance(tol, dtype)
    if dtype == torch.float64 and rounding is not None and tol is None:
        report["tol_why"] = "the float32 model checked in float64"
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        loss = _scalar(pmodel(*run_inputs))
        loss.backward()
        ref_loss = _one_device_loss(reference, inputs, loss_fn)
        ref_loss.backward()
        report["loss"].append([loss.item(), ref_loss.item()])
        if step == 0:
            grads = pmodel.full_gradients() if pipelined else \
                {fqn: _full_grad(p, pmodel._placements[fqn], device_mesh) for fqn, p in pmodel.named_parameters()}
            names = sorted(grads)
            mine = {k: _or_zeros(grads[k], ref_params[k]) for k in names}
            ref = {k: _or_zeros(ref_params[k].grad, ref_params[k]) for k in names}
            report["grad"] = _rel(torch.cat([mine[k].flatten() for k in names]),
                                  torch.cat([ref[k].flatten() for k in names]))
            report["grad_by_name"] = {k: _rel(mine[k], ref[k]) for k in names}
            report["no_grad"] = sorted(k for k in names if grads[k] is None and ref_params[k].grad is None)
            report["rounding_only"] = rounding_only(mine, ref, report["tol"])
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    state = pmodel.state_dict()
    # Parameters: norm-wise over the whole model. Per tensor, a parameter that
    # starts at zero (a LayerNorm bias) has a tiny norm after 2 steps, and Adam
    # turns rounding-level gradient differences into update differences of the
    # same relative size, so its per-tensor ratio says little; the largest
    # absolute element difference is reported next to it.
    ref_state = reference.state_dict()
    keys = sorted(set(ref_state) - set(report["rounding_only"]))
    report["param"] = _state_error(state, ref_state, keys)
    report["param_max_abs"] = max((state[k].double() - ref_state[k].double()).abs().max().item() for k in keys)
    report["param_by_name"] = {k: _rel(state[k], ref_state[k]) for k in keys}
    report["loss_rel"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in report["loss"])
    if pipelined:  # evaluation (the schedule's forward only) and the full state dict read back in
        with torch.no_grad():
            evaluated = _scalar(pmodel(*run_inputs)).item()
            ref_eval = _one_device_loss(reference, inputs, loss_fn).item()
        report["eval_loss_rel"] = abs(evaluated - ref_eval) / max(abs(ref_eval), 1e-12)
        pmodel.load_state_dict(state)
        again = pmodel.state_dict()
        report["reload"] = _rel(torch.cat([again[k].flatten() for k in keys]),
                                torch.cat([state[k].flatten() for k in keys]))
    noise = {k: (mine[k] - ref[k]).abs() for k in names}
    report["param_floor"] = max(_drift(initial, inputs, loss_fn, steps, lr, noise, seed, ref_state, keys)
                                for seed in (0, 1))
    report["plan"] = {"recompute": plan.recompute.get("layers", []), "recompute_mode": plan.recompute.get("mode"),
                      "strategies": {n.name: n.strategy for n in plan.nodes},
                      "parameters": {k: v["placements"] for k, v in plan.parameters.items()},
                      "zero_stages": {k: v.get("zero_stage") for k, v in plan.parameters.items()},
                      "offloaded": [k for k, v in plan.parameters.items() if v.get("offload")],
                      "optimizer": type(opt).__name__,
                      "collectives": len(plan.collectives)}
    if pipelined:
        report["plan"]["pipeline"] = pmodel.describe()
    return report


def _drift(model, inputs, loss_fn, steps: int, lr: float, noise: dict, seed: int, ref_state: dict,
           keys: list) -> float:
    """How far one device's parameters move from the reference's when each
    gradient element is off by as much as the program's was (``noise``: the
    size of each element's difference in the first step, added with a random
    sign at every step): the parameter error that gradient differences of
    that size alone give this model under AdamW, whose update
    g / (sqrt(g^2) + eps) turns a difference in an element whose gradient is
    near zero into a step of up to lr."""
    model = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        _one_device_loss(model, inputs, loss_fn).backward()
        for k, p in model.named_parameters():
            if p.grad is not None and k in noise:
                sign = torch.randint(0, 2, p.grad.shape, generator=g).to(p.grad.dtype) * 2 - 1
                p.grad += sign * noise[k].to(p.grad.dtype)
        opt.step()
        opt.zero_grad()
    return _state_error(model.state_dict(), ref_state, keys)


def _state_error(state: dict, ref_state: dict, keys: list) -> float:
    """||theta - theta_ref|| / ||theta_ref|| over the tensors ``keys``, in float64."""
    return _rel(torch.cat([state[k].flatten().double() for k in keys]),
                torch.cat([ref_state[k].flatten().double() for k in keys]))


def _one_device_loss(model, inputs, loss_fn):
    """The step's loss on one device: ``loss_fn(model(*inputs[:-1]), inputs[-1])``
    or, without a loss function, the model's own output made a scalar."""
    out = model(*inputs[:-1]) if loss_fn is not None else model(*inputs)
    return _scalar(loss_fn(out, inputs[-1]) if loss_fn is not None else out)


def _scalar(x):
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 0 else x.float().square().mean()
    leaves = [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
    return sum(t.float().square().mean() for t in leaves)


_rel = relative_error


def main(argv=None):
    ap = argparse.ArgumentParser(prog="autopar.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sources", nargs="+", metavar="source", help="FILE.py:FACTORY (several in one launch)")
    ap.add_argument("--mesh", required=True, action="append",
                    help="mesh to check; repeat to check several meshes of the same size in one launch")
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--plan", help="a plan.json to check instead of compiling")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--random-plans", type=int, default=0, help="also check N random valid plans")
    ap.add_argument("--local-inputs", action="store_true", help="feed each rank its own shard of the batch")
    ap.add_argument("--tol", type=float, help="relative tolerance (default: 1e-7 in float64, 1e-5 in float32, or "
                    "for a model computing in bfloat16 or float16, torch.testing.assert_close's default for that "
                    "dtype: 1.6e-2, 1e-3)")
    ap.add_argument("--precision", default="auto", choices=PRECISIONS,
                    help="auto (default): check a model that computes in float32 in float64, where rounding cannot "
                    "hide a wrong result; float64: cast any model's floating tensors to float64; model: its own dtypes")
    ap.add_argument("--recompute", default="auto", help="activation recomputation: auto (default), none, selective "
                    "or full; comma-separated to check several")
    ap.add_argument("--microbatches", type=int, help="microbatches of a pipelined plan (a mesh with a pp axis)")
    ap.add_argument("--schedule", help="pipeline schedule(s) to check, comma-separated: gpipe, 1f1b, "
                    "interleaved-1f1b (default: the planner's choice)")
    ap.add_argument("--memory", type=float, help="per-device memory budget in bytes")
    ap.add_argument("--no-offload", action="store_true", help="compile without offloading optimizer state")
    ap.add_argument("--json", help="write the report here (rank 0)")
    args = ap.parse_args(argv)
    recomputes = args.recompute.split(",")
    for mode in recomputes:
        if mode not in RECOMPUTE:
            ap.error(f"--recompute {mode!r}: expected {', '.join(RECOMPUTE)} (comma-separated)")
    schedules = args.schedule.split(",") if args.schedule else [None]
    reports = []
    for source in args.sources:
        name = source if len(args.sources) > 1 else ""
        for mesh in args.mesh:
            for schedule in schedules:
                for mode in recomputes:
                    r = check(source, mesh, args.cluster, args.steps, plan_path=args.plan,
                              local_inputs=args.local_inputs, tol=args.tol, precision=args.precision, recompute=mode,
                              memory=args.memory, offload=not args.no_offload, microbatches=args.microbatches,
                              schedule=schedule)
                    what = "".join([f", schedule {schedule}" if schedule else "",
                                    f", recompute {mode}" if len(recomputes) > 1 else ""])
                    reports.append({**r, "source": source, "mesh": mesh,
                                    "label": f"{name} mesh {mesh}{what}, solved plan".strip()})
            for seed in range(args.random_plans):
                r = check(source, mesh, args.cluster, args.steps, random_seed=seed, tol=args.tol,
                          precision=args.precision)
                reports.append({**r, "source": source, "mesh": mesh,
                                "label": f"{name} mesh {mesh}, random plan {seed}".strip()})
    ok = all(agrees(r) for r in reports)
    finish(reports, ok, args.tol or 1e-5, args.json, lambda r: (
        f"{r['label']}: loss rel err {r['loss_rel']:.1e}, grad rel err {r['grad']:.1e}, "
        f"param rel err after {args.steps} AdamW steps {r['param']:.1e} (max abs {r['param_max_abs']:.1e}"
        + (f"; one device, its gradients off by as much: {r['param_floor']:.1e})" if r["param"] > r["tol"] else ")")))


RECOMPUTE = ("auto", "none", "selective", "full")


def agrees(r: dict) -> bool:
    """Loss and gradients within the tolerance; the parameters within it or
    within what the same gradient differences give one device (``_drift``);
    a pipelined plan's evaluation loss and reloaded state within it too."""
    return max(r["loss_rel"], r["grad"], r.get("eval_loss_rel", 0.0), r.get("reload", 0.0)) <= r["tol"] \
        and r["param"] <= max(r["tol"], r["param_floor"])


def finish(reports: list, ok: bool, tol: float, json_path: str | None, line) -> None:
    """Rank 0 prints a line per report and the verdict, under each report's
    tolerance or ``tol`` (and writes the reports as JSON); every rank leaves the process group and exits, its status saying
    ok (autopar.runtime.shutdown)."""
    if dist.get_rank() == 0:
        for r in reports:
            print(line(r))
        why = "".join(dict.fromkeys(f"; {r['tol_why']}" for r in reports if r.get("tol_why")))
        tols = ", ".join(f"{t:g}" for t in sorted({r.get("tol", tol) for r in reports}))
        print("agreement with single device:", "OK" if ok else "FAILED", f"(tolerance {tols}{why})")
        rounding = [r["float32_rounding"] for r in reports if r.get("float32_rounding") is not None]
        if rounding:
            print(rounding_note(max(rounding)))
        noise = list(dict.fromkeys(k for r in reports for k in r.get("rounding_only", [])))
        if noise:
            print(noise_note(noise))
        draws = list(dict.fromkeys(d for r in reports for d in r.get("random_draws", [])))
        if draws and not ok:
            print(random_note(draws))
        if json_path:
            with open(json_path, "w") as f:
                json.dump(reports, f, indent=1)
    shutdown(exit_code=0 if ok else 1)


if __name__ == "__main__":
    main()
