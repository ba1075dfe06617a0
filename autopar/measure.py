"""Measured vs predicted step time of an emitted program on this machine.

    torchrun --nproc-per-node 4 -m autopar.measure examples/gpt.py:small --mesh 4 --cluster cpu

Each rank runs warm-up steps, then times windows of back-to-back training
steps (forward, backward, AdamW step); a window's step time is its length over
its steps on the slowest rank, and the measurement is the median window. No
barrier between steps: the program's own collectives are its only meeting
points, as in training (a barrier per step would add a synchronisation, and
on a host with more ranks than cores the ranks' skew at it, that the program
does not have), and the calibration's timings are window means too.
``measure_step_time`` launches that and returns the numbers next to the
plan's prediction.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist


def measure_step_time(source: str, mesh: str, cluster: str, nproc: int, steps: int = 10, windows: int = 3) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "measure.json")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
               "-m", "autopar.measure", source, "--mesh", mesh, "--cluster", cluster, "--steps", str(steps),
               "--windows", str(windows), "--json", out]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))
        if proc.returncode != 0:
            raise RuntimeError(f"measuring {source} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


CHAIN_LAYERS = 24
"""The calibration chain: 24 x (Linear(8, 8), tanh), i.e. 48 tiny ops whose
arithmetic is negligible next to their dispatch."""


def runtime_overhead(nproc: int, cluster: str = "cpu", steps: int = 20) -> float:
    """Seconds autopar's runtime adds per op and pass on this machine: a chain of
    tiny ops is timed through the emitted program on ``nproc`` ranks, the
    cost model's prediction (without this overhead) is subtracted and the rest
    is divided by the op count, forward and backward."""
    excess, result = _excess("chain", nproc, cluster, steps)
    return max(0.0, excess / (2 * result["op_nodes"]))


def _excess(source: str, nproc: int, cluster: str, steps: int) -> tuple[float, dict]:
    """(measured minus predicted step seconds, the measurement) of a calibration chain."""
    result = measure_step_time(source, mesh=str(nproc), cluster=cluster, nproc=nproc, steps=steps)
    return result["measured_step_s"] - result["predicted_step_s"], result


TP_PAIRS = 12
"""The collective chain: 12 x (Linear(8, 32), tanh, Linear(32, 8)) with the
first weight of each pair stored split by rows and the second by columns
(Megatron's MLP), so that no pair runs without communication: tiny collectives
(whichever the planner finds cheapest: all-reducing the partial outputs, or
all-gathering the weights) between tiny ops."""


def collective_overhead(nproc: int, cluster: str = "cpu", steps: int = 20) -> float:
    """Seconds a collective in an emitted program costs beyond the link's
    alpha-beta time (the DTensor redistribution around it, and on an
    oversubscribed host the ranks' skew when they meet): the collective chain
    is timed on ``nproc`` ranks, its prediction (runtime overhead included,
    this one left out) subtracted, the rest divided by the collectives run."""
    excess, result = _excess("tp-chain", nproc, cluster, steps)
    return max(0.0, excess / result["collectives"])


def _chain():
    from torch import nn
    torch.manual_seed(0)
    layers = [m for _ in range(CHAIN_LAYERS) for m in (nn.Linear(8, 8), nn.Tanh())]
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return nn.Sequential(*layers), (x, y), torch.nn.functional.mse_loss


def _tp_chain():
    from torch import nn
    torch.manual_seed(0)
    layers = [m for _ in range(TP_PAIRS) for m in (nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8, bias=False))]
    pins = {}
    for i in range(TP_PAIRS):
        pins.update({f"{3 * i}.weight": ["S(0)"], f"{3 * i}.bias": ["S(0)"], f"{3 * i + 2}.weight": ["S(1)"]})
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return nn.Sequential(*layers), (x, y), torch.nn.functional.mse_loss, pins


CALIBRATION_CHAINS = {
    "chain": ("runtime_overhead", lambda: (*_chain(), None), runtime_overhead,
              f"the {2 * CHAIN_LAYERS}-op chain through the emitted program (step time beyond the cost model, "
              "per op and pass)"),
    "tp-chain": ("collective_overhead", _tp_chain, collective_overhead,
                 f"{TP_PAIRS} Megatron MLP pairs with pinned sharded weights through the emitted program (step "
                 "time beyond the cost model, per collective)"),
}
"""source -> (the Device field it measures, the model (with its pins), the
measuring function, what it runs). Each is priced without the overhead it
measures; ``autopar calibrate`` measures them in this order, the second
priced with the first."""


def main(argv=None) -> None:
    from autopar.capture import capture
    from autopar.codegen import build_program, load_program, program_source
    from autopar.compiler import compile as compile_plan
    from autopar.mesh import parse_mesh
    from autopar.runtime import ParallelModule, agreed_plan, init_distributed, load_factory, shutdown

    ap = argparse.ArgumentParser(prog="autopar.measure", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("source")
    ap.add_argument("--mesh", required=True)
    ap.add_argument("--cluster", default="cpu")
    ap.add_argument("--steps", type=int, default=10, help="steps per timed window")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    cluster, pins = args.cluster, None
    if args.source in CALIBRATION_CHAINS:  # priced without the overhead it measures
        from dataclasses import replace
        from autopar.cost_models.cluster import get_cluster
        field, make, _, _ = CALIBRATION_CHAINS[args.source]
        model, inputs, loss_fn, pins = make()
        base = get_cluster(cluster)
        cluster = replace(base, device=replace(base.device, **{field: 0.0}))
    else:
        model, inputs, loss_fn = load_factory(args.source)
    device_mesh = init_distributed(parse_mesh(args.mesh).shape, parse_mesh(args.mesh).names)
    plan = agreed_plan(lambda: compile_plan(model, inputs, mesh=args.mesh, cluster=cluster, loss_fn=loss_fn,
                                            parameter_placements=pins))
    program = load_program(program_source(build_program(capture(model, inputs, loss_fn), plan), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

    def step():
        pmodel(*inputs).backward()
        opt.step()
        opt.zero_grad()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.windows):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        elapsed = torch.tensor([(time.perf_counter() - t) / args.steps], dtype=torch.float64)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    result = {"source": args.source, "mesh": args.mesh, "cluster": args.cluster,
              "predicted_step_s": plan.predicted["step_time_s"], "measured_step_s": statistics.median(times),
              "predicted": {k: plan.predicted[k] for k in ("compute_s", "comm_s", "optimizer_s")},
              "op_nodes": sum(1 for n in plan.nodes if n.op not in ("param", "input", "buffer", "output")),
              "collectives": len(plan.collectives),
              "windows": times}
    if dist.get_rank() == 0:
        print(f"{args.source} on {args.mesh}: predicted {result['predicted_step_s'] * 1e3:.2f} ms, "
              f"measured {result['measured_step_s'] * 1e3:.2f} ms (median of {args.windows} windows of {args.steps} steps)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f)
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
