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
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np
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


CHAIN_OPS = 48
"""Each long op chain has 48 tiny ops whose arithmetic is negligible next to
their dispatch: 48 x Linear(8, 8) (three tensor inputs each: x, weight, bias;
two parameters each), Linear(8, 8) then 47 x tanh (one input each), and
Linear(8, 8) then 47 x h - h (two inputs each). The last two run as many
runtime calls with different input counts, which separates the per-call and
per-input terms; the first is mostly parameters and their wrapping. The
single-op chain (one Linear(8, 8)) has next to no calls, which separates
the fixed cost per step from both."""

OP_CHAINS = ("linear-chain", "unary-chain", "product-chain", "single-op")


def runtime_overheads(nproc: int, cluster: str = "cpu", steps: int = 20,
                      runs: int = 1) -> tuple[float, float, float, list]:
    """(seconds per call and pass, seconds per unwrapped input and pass,
    seconds per step, the runs) that autopar's runtime adds on this machine:
    the op chains are timed through the emitted program on ``nproc`` ranks
    ``runs`` times each, and their step time beyond the cost model (priced
    without these overheads) is fitted by ``fit_runtime_overheads``."""
    rows = []
    for _ in range(runs):
        for source in OP_CHAINS:
            excess, result = _excess(source, nproc, cluster, steps)
            rows.append((result["call_passes"], result["input_passes"], excess))
    return (*fit_runtime_overheads(rows), rows)


def fit_runtime_overheads(rows) -> tuple[float, float, float]:
    """(runtime_overhead, input_overhead, step_overhead): non-negative least
    squares of ``excess = runtime_overhead * call passes + input_overhead *
    input passes + step_overhead`` over (call passes, input passes, excess
    seconds) rows (graph_costs.runtime_passes counts the passes). Every
    subset of the three terms is fitted alone; the best fit whose terms are
    all >= 0 wins, the terms it leaves out being 0."""
    a = np.array([(r[0], r[1], 1.0) for r in rows], float)
    b = np.array([r[2] for r in rows], float)
    best, terms = None, (0.0, 0.0, 0.0)
    for keep in itertools.chain.from_iterable(itertools.combinations(range(3), k) for k in (3, 2, 1)):
        coef = np.linalg.lstsq(a[:, keep], b, rcond=None)[0]
        if (coef < 0).any():
            continue
        residual = float(np.sum((a[:, keep] @ coef - b) ** 2))
        if best is None or residual < best - 1e-18:
            best, terms = residual, tuple(float(coef[keep.index(i)]) if i in keep else 0.0 for i in range(3))
    return terms


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


class _Difference(torch.nn.Module):
    def forward(self, h):
        return h - h  # two inputs; the values stay exactly 0: nothing overflows or goes subnormal


def _op_chain(make_layers):
    """A calibration model: ``make_layers()`` in sequence on an 8 x 8 input, an MSE loss, no pins."""
    torch.manual_seed(0)
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return torch.nn.Sequential(*make_layers()), (x, y), torch.nn.functional.mse_loss, None


def _linear_chain():
    return _op_chain(lambda: [torch.nn.Linear(8, 8) for _ in range(CHAIN_OPS)])


def _unary_chain():
    return _op_chain(lambda: [torch.nn.Linear(8, 8), *(torch.nn.Tanh() for _ in range(CHAIN_OPS - 1))])


def _product_chain():
    return _op_chain(lambda: [torch.nn.Linear(8, 8), *(_Difference() for _ in range(CHAIN_OPS - 1))])


def _single_op():
    return _op_chain(lambda: [torch.nn.Linear(8, 8)])


def _tp_chain():
    from torch import nn
    torch.manual_seed(0)
    layers = [m for _ in range(TP_PAIRS) for m in (nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 8, bias=False))]
    pins = {}
    for i in range(TP_PAIRS):
        pins.update({f"{3 * i}.weight": ["S(0)"], f"{3 * i}.bias": ["S(0)"], f"{3 * i + 2}.weight": ["S(1)"]})
    x, y = torch.randn(8, 8), torch.randn(8, 8)
    return nn.Sequential(*layers), (x, y), torch.nn.functional.mse_loss, pins


RUNTIME_TERMS = ("runtime_overhead", "input_overhead", "step_overhead")
CALIBRATION_CHAINS = {
    "linear-chain": (RUNTIME_TERMS, _linear_chain),
    "unary-chain": (RUNTIME_TERMS, _unary_chain),
    "product-chain": (RUNTIME_TERMS, _product_chain),
    "single-op": (RUNTIME_TERMS, _single_op),
    "tp-chain": (("collective_overhead",), _tp_chain),
}
"""source -> (the Device fields it measures, the model (with its pins)). Each
chain is priced without the overheads it measures; ``autopar calibrate``
measures the op chains first (runtime_overheads), then the collective chain
priced with their result (collective_overhead)."""


def main(argv=None) -> None:
    from autopar.capture import capture
    from autopar.codegen import build_program, load_program, program_source
    from autopar.compiler import compile as compile_plan
    from autopar.cost_models.graph_costs import runtime_passes
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
        measured, make = CALIBRATION_CHAINS[args.source]
        model, inputs, loss_fn, pins = make()
        base = get_cluster(cluster)
        cluster = replace(base, device=replace(base.device, **dict.fromkeys(measured, 0.0)))
    else:
        model, inputs, loss_fn = load_factory(args.source)
    device_mesh = init_distributed(parse_mesh(args.mesh).shape, parse_mesh(args.mesh).names)
    plan = agreed_plan(lambda: compile_plan(model, inputs, mesh=args.mesh, cluster=cluster, loss_fn=loss_fn,
                                            parameter_placements=pins))
    graph = capture(model, inputs, loss_fn)
    program = load_program(program_source(build_program(graph, plan), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh)
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3)

    def step():
        pmodel(*inputs).backward()
        opt.step()
        opt.zero_grad()

    def sync():  # on a GPU the steps' kernels run behind the host: wait for them at a window's ends
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    for _ in range(args.warmup):
        step()
    times = []
    for _ in range(args.windows):
        sync()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        elapsed = torch.tensor([(time.perf_counter() - t) / args.steps], dtype=torch.float64,
                               device="cuda" if torch.cuda.is_available() else "cpu")  # where the backend reduces
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        times.append(elapsed.item())
    result = {"source": args.source, "mesh": args.mesh, "cluster": args.cluster,
              "predicted_step_s": plan.predicted["step_time_s"], "measured_step_s": statistics.median(times),
              "predicted": {k: plan.predicted[k] for k in ("compute_s", "comm_s", "optimizer_s")},
              "op_nodes": sum(1 for n in plan.nodes if n.op not in ("param", "input", "buffer", "output")),
              **dict(zip(("call_passes", "input_passes"), runtime_passes(graph))),
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
