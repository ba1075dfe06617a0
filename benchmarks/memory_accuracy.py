"""Predicted vs measured peak memory per rank of emitted programs on this CPU.

    torchrun --nproc-per-node 4 benchmarks/memory_accuracy.py

Each rank runs 2 AdamW steps of the plan's program under autopar.memtrack
(live tensor bytes: parameters, gradients, optimizer state, activations,
collective outputs) and the peak is compared with plan.predicted.
"""
import collections
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))

import autopar  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.codegen import build_program, load_program, program_source  # noqa: E402
from autopar.memtrack import LiveBytes  # noqa: E402
from autopar.runtime import ParallelModule, init_distributed, load_factory, shutdown  # noqa: E402

FASTNET = "tests/fixtures/fastnet.json"
CASES = [  # (factory, mesh, cluster, per-device budget in MiB or None, recomputation)
    ("examples/gpt.py:demo", "2x2", "dgx-a100", None, "auto"),
    ("examples/gpt.py:demo", "4", FASTNET, None, "auto"),
    ("examples/gpt.py:small", "2x2", FASTNET, None, "auto"),
    ("examples/mlp.py:wide", "4", "dgx-a100", None, "auto"),
    # tight budgets without recomputation: parameters sharded at ZeRO stages 2 and 3
    ("examples/gpt.py:small", "4", "dgx-a100", 1.3, "none"),
    ("examples/gpt.py:small", "4", FASTNET, 1.3, "none"),
    # explicit attention (s x s scores) without, with selective and with full recomputation
    ("examples/gpt.py:explicit", "2x2", FASTNET, None, "none"),
    ("examples/gpt.py:explicit", "2x2", FASTNET, None, "selective"),
    ("examples/gpt.py:explicit", "2x2", FASTNET, None, "full"),
]


def measure(source, mesh, cluster, budget_mib, recompute):
    model, inputs, loss_fn = load_factory(source)
    options = {"memory": budget_mib * 2**20} if budget_mib else {}
    plan = autopar.compile(model, inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn, recompute=recompute,
                           **options)
    stages = collections.Counter(p.get("zero_stage") for p in plan.parameters.values())
    device_mesh = init_distributed(plan.mesh.shape, plan.mesh.names)
    program = load_program(program_source(build_program(capture(model, inputs, loss_fn), plan), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh)
    # the multi-tensor step torch uses by default on CUDA, which plans for GPU clusters price
    # (graph_costs.optimizer_step_bytes); on CPU torch defaults to a per-parameter loop
    opt = torch.optim.AdamW(pmodel.parameters(), lr=1e-3, foreach=True)
    tracker = LiveBytes()
    with tracker:
        tracker.track(list(pmodel.parameters()))
        for _ in range(2):
            pmodel(*inputs).backward()
            opt.step()
            opt.zero_grad()
    peak = torch.tensor([float(tracker.peak)])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    zero = " ".join(f"{k}:{v}" for k, v in sorted(stages.items(), key=lambda kv: str(kv[0])))
    return zero, plan.predicted["peak_memory_bytes"], peak.item()


def main():
    rows = [(s, m, c, b, r, *measure(s, m, c, b, r)) for s, m, c, b, r in CASES]
    if dist.get_rank() == 0:
        print(f"{'model':25} {'mesh':4} {'cluster':12} {'budget':>6} {'recompute':9} {'ZeRO stage:params':22} "
              f"{'predicted MiB':>13} {'measured MiB':>12} {'error':>7}")
        errors = []
        for s, m, c, b, r, zero, pred, meas in rows:
            errors.append(abs(pred / meas - 1))
            print(f"{s:25} {m:4} {os.path.basename(c):12} {b or '-':>6} {r:9} {zero:22} {pred / 2**20:13.2f} "
                  f"{meas / 2**20:12.2f} {pred / meas - 1:+7.1%}")
        print(f"mean absolute error {sum(errors) / len(errors):.1%}")
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
