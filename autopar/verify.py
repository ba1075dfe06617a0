"""Check a plan numerically: train the parallel program and the single-device
model side by side and compare loss, every gradient and the updated parameters.

Run under torchrun (it is also what ``autopar run`` launches):

    torchrun --nproc-per-node 4 -m autopar.verify examples/gpt.py:small --mesh 2x2 --cluster cpu
"""
from __future__ import annotations

import argparse
import copy
import json
import random
import sys

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from autopar.capture import capture
from autopar.codegen import build_program, load_program, program_source
from autopar.compiler import build_plan, compile as compile_plan
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.graph_costs import CostContext
from autopar.mesh import parse_mesh
from autopar.passes.enumerate import enumerate_strategies
from autopar.plan import Plan
from autopar.runtime import ParallelModule, init_distributed, load_factory
from autopar.solver import Solution


def random_plan(model, inputs, loss_fn, mesh, cluster, seed: int) -> Plan:
    """A plan whose every node takes a random valid strategy: a stress test of
    codegen and runtime (any valid plan must train exactly like one device)."""
    mesh = parse_mesh(mesh)
    graph = capture(model, inputs, loss_fn)
    strategies, _ = enumerate_strategies(graph, mesh.shape)
    rng = random.Random(seed)
    chosen = {name: rng.choice(s) for name, s in strategies.items()}
    ctx = CostContext.make(mesh.shape, get_cluster(cluster))
    sol = Solution({}, "RANDOM", 0.0, 0.0, 0, 0, 0.0)
    return build_plan(graph, chosen, strategies, ctx, mesh, sol, None)


def _full_grad(p, placements, mesh):
    return DTensor.from_local(p.grad, mesh, placements, run_check=False).full_tensor()


def check(source: str, mesh, cluster: str, steps: int = 2, lr: float = 1e-3, random_seed: int | None = None,
          plan_path: str | None = None, local_inputs: bool = False) -> dict:
    model, inputs, loss_fn = load_factory(source)
    reference = copy.deepcopy(model)
    mesh_ = parse_mesh(mesh)
    device_mesh = init_distributed(mesh_.shape, mesh_.names)
    if plan_path:
        plan = Plan.load(plan_path)
    elif random_seed is not None:
        plan = random_plan(model, inputs, loss_fn, mesh_, cluster, random_seed)
    else:
        plan = compile_plan(model, inputs, mesh=mesh_, cluster=cluster, loss_fn=loss_fn, source=source)
    graph = capture(model, inputs, loss_fn)
    program = load_program(program_source(build_program(graph, plan, local_inputs), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh,
                            local_inputs=local_inputs)
    run_inputs = inputs
    if local_inputs:
        from autopar.runtime import shard_of
        from autopar.passes.strategy import parse_spec
        run_inputs = tuple(shard_of(x, parse_spec("".join(i["placements"]), mesh_.ndim), device_mesh)
                           for x, i in zip(inputs, plan.inputs))
    opt = torch.optim.AdamW(pmodel.parameters(), lr=lr)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=lr)
    report = {"loss": [], "grad": 0.0, "param": 0.0}
    ref_params = dict(reference.named_parameters())
    for step in range(steps):
        loss = _scalar(pmodel(*run_inputs))
        loss.backward()
        out = reference(*inputs[:-1]) if loss_fn is not None else reference(*inputs)
        ref_loss = _scalar(loss_fn(out, inputs[-1]) if loss_fn is not None else out)
        ref_loss.backward()
        report["loss"].append([loss.item(), ref_loss.item()])
        if step == 0:
            for fqn, p in pmodel.named_parameters():
                g = _full_grad(p, pmodel._placements[fqn], device_mesh)
                ref = ref_params[fqn].grad
                report["grad"] = max(report["grad"], _rel(g, ref))
        opt.step(); opt.zero_grad(); ref_opt.step(); ref_opt.zero_grad()
    state = pmodel.state_dict()
    report["param_by_name"] = {}
    for k, v in reference.state_dict().items():
        report["param_by_name"][k] = _rel(state[k], v)
        report["param"] = max(report["param"], _rel(state[k], v))
    report["loss_rel"] = max(abs(a - b) / max(abs(b), 1e-12) for a, b in report["loss"])
    report["plan"] = {"strategies": {n.name: n.strategy for n in plan.nodes},
                      "collectives": len(plan.collectives)}
    return report


def _scalar(x):
    if isinstance(x, torch.Tensor):
        return x if x.dim() == 0 else x.float().square().mean()
    leaves = [t for t in torch.utils._pytree.tree_leaves(x) if isinstance(t, torch.Tensor)]
    return sum(t.float().square().mean() for t in leaves)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    """Norm-wise relative error ||a - b|| / ||b|| (0 when both are 0)."""
    a, b = a.detach().double(), b.detach().double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item() if b.norm() > 0 else (a - b).norm().item()


def main(argv=None):
    ap = argparse.ArgumentParser(prog="autopar.verify", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source", help="FILE.py:FACTORY")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--plan", help="a plan.json to check instead of compiling")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--random-plans", type=int, default=0, help="also check N random valid plans")
    ap.add_argument("--local-inputs", action="store_true", help="feed each rank its own shard of the batch")
    ap.add_argument("--tol", type=float, default=1e-5)
    ap.add_argument("--json", help="write the report here (rank 0)")
    args = ap.parse_args(argv)
    reports = [check(args.source, args.mesh, args.cluster, args.steps, plan_path=args.plan,
                     local_inputs=args.local_inputs)]
    for seed in range(args.random_plans):
        reports.append(check(args.source, args.mesh, args.cluster, args.steps, random_seed=seed))
    ok = all(max(r["loss_rel"], r["grad"], r["param"]) <= args.tol for r in reports)
    if dist.get_rank() == 0:
        for i, r in enumerate(reports):
            label = "solved plan" if i == 0 else f"random plan {i - 1}"
            print(f"{label}: loss rel err {r['loss_rel']:.1e}, grad rel err {r['grad']:.1e}, "
                  f"param rel err after {args.steps} AdamW steps {r['param']:.1e}")
        print("agreement with single device:", "OK" if ok else "FAILED", f"(tolerance {args.tol:g})")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(reports, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
