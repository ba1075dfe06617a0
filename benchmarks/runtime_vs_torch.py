"""Emitted programs against the same parallelization written by hand with torch.distributed.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/runtime_vs_torch.py [--steps 30] \
        [--cases dp,zero2,zero3,tp,tp_zero2] [--cluster PROFILE.json] [--profile] [--collectives]

One launch, 4 gloo ranks. For each case autopar compiles the family's hand plan on
the ``cpu`` cluster (autopar/pinned.py: parameters and inputs placed as the
family places them; the benchmark checks that the plan is that family), and the hand-written
equivalent is built from the same initial weights:

* ``dp``: every parameter replicated, the batch split, against
  ``DistributedDataParallel``;
* ``zero2``: parameters held sharded on dim 0 and gathered for use, gradients
  reduce-scattered, against FSDP2 ``fully_shard(reshard_after_forward=False)``;
* ``zero3``: the same, the gathered copies freed after use and gathered
  again in backward, against FSDP2 ``fully_shard(reshard_after_forward=True)``;
* ``tp``: Megatron tensor parallelism of a GPT (q, k, v and the MLP's first
  GEMM split by columns, the projections by rows, the rest replicated),
  against ``parallelize_module`` with ColwiseParallel / RowwiseParallel;
* ``tp_zero2``: a 2x2 mesh, the GPT's Megatron split on the second axis and
  every parameter held sharded on dim 0 over the first (ZeRO-2), the batch
  split over the first, against ``parallelize_module`` on the second axis
  composed with FSDP2 ``fully_shard(reshard_after_forward=False)`` on the
  first (as torchtitan composes them).

Each row also gives the plain model's step on one device (rank 0, the whole
batch, while the others wait).

autopar's program returns the loss of the whole batch (one device's loss);
a hand-written step over a split batch returns its rank's. ``hand+loss``
is the hand-written step that reports the whole batch's loss too, as a user
logging it writes: an asynchronous all-reduce of the loss launched in
forward, waited for after backward, as autopar's is; its ratio compares like
with like.

The steps (forward, backward, AdamW) rotate, each after a barrier; a step's
time is the slowest rank's. The table gives medians over ``--steps`` steps
after warm-up, the ratios (with their 95% intervals, by the bootstrap over
the steps, below it), and the plan's predicted step. On a shared machine
read the ratios, not the milliseconds.

``--collectives`` says where a gap between the measured and the predicted
step lies in the activations' collectives: per kind, the plan's prediction
per call, the same call timed alone, and its wall time inside the program.
"""
from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import time
import types

import torch
import torch.distributed as dist
import torch.nn.functional as F

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "examples"))

import gpt as gpt_example  # noqa: E402
import mlp as mlp_example  # noqa: E402
from collective_skew import slowest_median  # noqa: E402  (benchmarks/, beside this script)

from autopar import moves, spmd  # noqa: E402
from autopar.capture import capture  # noqa: E402
from autopar.codegen import build_program, load_program, program_source  # noqa: E402
from autopar.pinned import compile_pinned  # noqa: E402
from autopar.runtime import ParallelModule, agreed_plan, init_distributed, shutdown  # noqa: E402

WORLD = 4
LR = 1e-3


def mlp_case():
    """An MLP 256 wide, 4 layers, batch 2048 (issue 25's model)."""
    return mlp_example.make(batch=2048, hidden=256, d_in=256, d_out=256, layers=4)


def gpt_case():
    """A GPT, hidden 128, 4 layers, 4 heads, sequence 64, batch 16."""
    torch.manual_seed(0)
    cfg = gpt_example.GPTConfig(vocab=512, seq=64, hidden=128, heads=4, layers=4)
    model = gpt_example.GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (16, cfg.seq))
    target = torch.randint(0, cfg.vocab, (16, cfg.seq))
    return model, (idx, target), gpt_example.lm_loss


def all_params(model, spec):
    return {fqn: [spec] for fqn, _ in model.named_parameters()}


def zero3_pins(model):
    return {fqn: ["S(0)", "regather"] for fqn, _ in model.named_parameters()}


def megatron_pins(model):
    """Column-parallel q, k, v, fc (weight and bias split on the output dim),
    row-parallel projections (weight on its input dim, bias replicated);
    everything else replicated."""
    pins = {}
    for fqn, _ in model.named_parameters():
        if fqn.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight", "mlp.fc.bias")):
            pins[fqn] = ["S(0)"]
        elif fqn.endswith(("attn.proj.weight", "mlp.proj.weight")):
            pins[fqn] = ["S(1)"]
        else:
            pins[fqn] = ["R"]
    return pins


def megatron_zero2_pins(model):
    """``megatron_pins`` on the second mesh axis, every parameter held
    sharded over the first on a dim the second does not split (dim 0, or
    dim 1 for a column-parallel weight), so that gathering over the first
    gives each rank its tensor-parallel piece whole, as FSDP2's shard of a
    ``parallelize_module`` weight (its ``_StridedShard``) does. A vector
    split by Megatron has no other dim: its two splits nest on dim 0."""
    shapes = {fqn: p.dim() for fqn, p in model.named_parameters()}
    return {fqn: ["S(1)" if tp == ["S(0)"] and shapes[fqn] > 1 else "S(0)", *tp]
            for fqn, tp in megatron_pins(model).items()}


# --- the hand-written equivalents -------------------------------------------

def ddp(model, mesh, inputs, loss_fn):
    from torch.nn.parallel import DistributedDataParallel
    module = DistributedDataParallel(model)
    x, y = (t.chunk(WORLD)[dist.get_rank()] for t in inputs)
    return module, lambda: loss_fn(module(x), y)


def fsdp2(reshard: bool):
    def build(model, mesh, inputs, loss_fn):
        from torch.distributed.fsdp import fully_shard
        for layer in model.layers:
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard)
        fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
        x, y = (t.chunk(WORLD)[dist.get_rank()] for t in inputs)
        return model, lambda: loss_fn(model(x), y)
    return build


def megatron_fsdp2(model, mesh, inputs, loss_fn):
    """Megatron on the second axis, FSDP2 (ZeRO-2) over the first, the batch split over the first."""
    from torch.distributed.fsdp import fully_shard
    dp, tp = mesh[mesh.mesh_dim_names[0]], mesh[mesh.mesh_dim_names[1]]
    _megatron_blocks(model, tp)
    for block in model.blocks:
        fully_shard(block, mesh=dp, reshard_after_forward=False)
    fully_shard(model, mesh=dp, reshard_after_forward=False)
    idx, target = (t.chunk(dp.size())[dp.get_local_rank()] for t in inputs)
    return model, lambda: loss_fn(model(idx), target)


def _local_heads_forward(self, x):
    """gpt.Attention.forward on this rank's heads (the hidden size from the local q)."""
    b, s, _ = x.shape
    q, k, v = (t(x) for t in (self.q, self.k, self.v))
    width = q.shape[-1] // self.heads
    q, k, v = (t.view(b, s, self.heads, width).transpose(1, 2) for t in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, s, self.heads * width))


def _megatron_blocks(model, mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
    for block in model.blocks:
        parallelize_module(block, mesh, {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(),
                                         "attn.v": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                         "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})
        block.attn.heads //= mesh.size()
        block.attn.forward = types.MethodType(_local_heads_forward, block.attn)


def megatron(model, mesh, inputs, loss_fn):
    _megatron_blocks(model, mesh)
    idx, target = inputs
    return model, lambda: loss_fn(model(idx), target)


BATCH_SPLIT = {0: ["S(0)"], 1: ["S(0)"]}
"""The inputs (x and the target) split by batch over the mesh's one axis."""

CASES = {
    # name: (model factory, pins, hand-written builder, its name, family check on the plan, input placements,
    #        mesh)
    "dp": (mlp_case, lambda m: all_params(m, "R"), ddp, "DistributedDataParallel",
           lambda plan: all(p["placements"] == ["R"] for p in plan.parameters.values()), BATCH_SPLIT, "4"),
    "zero2": (mlp_case, lambda m: all_params(m, "S(0)"), fsdp2(reshard=False),
              "FSDP2 fully_shard(reshard_after_forward=False)",
              lambda plan: all(p.get("zero_stage") == 2 for p in plan.parameters.values()), BATCH_SPLIT, "4"),
    "zero3": (mlp_case, zero3_pins, fsdp2(reshard=True), "FSDP2 fully_shard(reshard_after_forward=True)",
              lambda plan: all(p.get("zero_stage") == 3 for p in plan.parameters.values()), BATCH_SPLIT, "4"),
    "tp": (gpt_case, megatron_pins, megatron, "parallelize_module Colwise/Rowwise",
           lambda plan: any(p["placements"] == ["S(1)"] for p in plan.parameters.values())
           and all(p.get("zero_stage") is None for p in plan.parameters.values() if p["placements"] != ["R"]),
           {0: ["R"], 1: ["R"]}, "4"),
    "tp_zero2": (gpt_case, megatron_zero2_pins, megatron_fsdp2, "parallelize_module (y) + FSDP2 no reshard (x)",
                 lambda plan: all(p.get("zero_stage") == 2 for p in plan.parameters.values())
                 and any(p["placements"] == ["S(0)", "S(1)"] for p in plan.parameters.values()),
                 {0: ["S(0)", "R"], 1: ["S(0)", "R"]}, "2x2"),
}


def autopar_step(model, inputs, loss_fn, device_mesh, pins, input_pins, mesh: str, cluster: str):
    """The hand plan priced and emitted by autopar (autopar/pinned.py): the
    parameters and inputs placed as pinned, the ops that read a weight
    computing where it is stored over the axes the batch is not split on
    (tensor parallelism) and gathering it over the others (ZeRO), the rest
    as the ILP finds cheapest."""
    def solve():
        return compile_pinned(model, inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn,
                              parameter_placements=pins, input_placements=input_pins)

    plan = agreed_plan(solve)
    graph = capture(model, inputs, loss_fn)
    program = load_program(program_source(build_program(graph, plan), plan))
    pmodel = ParallelModule(model, plan, program, loss_fn=loss_fn, device_mesh=device_mesh)
    return plan, pmodel, lambda: pmodel(*inputs)


PENDING: list = []
"""All-reduces of a reported loss, launched in forward, waited for after backward."""


def global_loss(step, device_mesh, input_pins):
    """The hand-written step returning the loss of the whole batch, as
    autopar's program does: its local loss averaged over the ranks the batch
    is split across, by an all-reduce launched asynchronously and waited for
    after backward (None where the batch is not split: its loss is whole)."""
    axes = [a for a, p in enumerate(input_pins[0]) if p != "R"]
    if not axes:
        return None
    (axis,) = axes
    group = device_mesh.get_group(axis)

    def run():
        loss = step()
        total = loss.detach() / dist.get_world_size(group)
        PENDING.append(dist.all_reduce(total, group=group, async_op=True))
        return loss
    return run


def timed(step, opt) -> float:
    dist.barrier()
    t = time.perf_counter()
    step().backward()
    while PENDING:
        PENDING.pop().wait()
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t


def one_device(model, inputs, loss_fn):
    """The plain model's step on rank 0 (the whole batch); the other ranks do nothing."""
    if dist.get_rank() != 0:
        return lambda: torch.zeros((), requires_grad=True)
    return lambda: loss_fn(model(*inputs[:-1]), inputs[-1])


def profiled(name: str, plan, steps_: tuple, opts: list, hand_name: str, steps: int = 5) -> None:
    """Rank 0's autopar step and its hand-written equivalent under
    torch.profiler: the ops that take the most self time (spmd's autograd
    functions hold their collectives' waits), next to the plan's predicted
    split of the step."""
    from torch.profiler import ProfilerActivity, profile
    for label, step, opt in (("autopar", steps_[0], opts[0]), (hand_name, steps_[1], opts[1])):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                timed(step, opt)
        if dist.get_rank() == 0:
            p = plan.predicted
            print(f"\n{name}: {steps} {label} steps on rank 0; autopar's predicted step: compute "
                  f"{p['compute_s'] * 1e3:.1f} ms, communication {p['comm_s'] * 1e3:.1f} ms, optimizer "
                  f"{p['optimizer_s'] * 1e3:.1f} ms, step {p['step_time_s'] * 1e3:.1f} ms")
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


BLOCKING = {"all_gather": ("autopar.moves", "_all_gather"), "reduce_scatter": ("torch.distributed", "all_to_all_single"),
            "all_reduce": ("torch.distributed", "all_reduce")}
"""The calls the emitted programs' blocking collectives go through, by the
kind the plan lists (on gloo the runtime's reduce-scatter is an all-to-all
and a local sum: autopar.moves._reduce_scatter)."""


def collectives_breakdown(name: str, plan, step, opt, device_mesh, steps: int = 10) -> None:
    """The activations' collectives (tensor parallelism's, on the critical
    path) per kind: the plan's calls per step and predicted seconds per
    call, against the same kind timed alone (``collective_skew.slowest_median``:
    each call after a barrier, at the plan's median size for it) and inside the program (each blocking
    call's wall time: waiting for the slowest rank to arrive included).
    The loss's all-reduce (not waited for) is left out, and so are other
    asynchronous calls, whose wall time is their launch. Slowest rank's mean
    per call. Then the parameters' bucketed all-gathers and the gradients'
    bucketed reduce-scatters (spmd.gather_params, ZeRO): the seconds a step
    their calls hold the program up (blocking calls, launches and waits),
    next to what the plan puts on the critical path for them."""
    import importlib
    planned = {}
    for c in plan.collectives:
        if c["kind"] in BLOCKING and c["tensor"] not in plan.parameters and c["node"] != "output":
            planned.setdefault(c["kind"], []).append(c)
    spent = {kind: [0.0, 0] for kind in BLOCKING}
    in_bucket = [False]  # inside a parameter bucket's all-gather or reduce-scatter (spmd's _gather / _scatter)
    originals = {}
    for kind, (module, attr) in BLOCKING.items():
        mod = importlib.import_module(module)
        fn = originals[kind] = getattr(mod, attr)

        def timed_call(*a, _fn=fn, _kind=kind, **k):
            if k.get("async_op") or in_bucket[0]:
                return _fn(*a, **k)
            t = time.perf_counter()
            out = _fn(*a, **k)
            spent[_kind][0] += time.perf_counter() - t
            spent[_kind][1] += 1
            return out
        setattr(mod, attr, timed_call)
    bucket_calls = {name: getattr(spmd, name) for name in ("_gather", "_scatter")}

    on_path = {"_gather": [0.0, 0], "_scatter": [0.0, 0]}  # a bucket's blocking call, launch and wait: seconds, calls

    def outside(fn, name):
        def call(*a, **k):
            in_bucket[0] = True
            t = time.perf_counter()
            try:
                out = fn(*a, **k)
            finally:
                in_bucket[0] = False
                on_path[name][0] += time.perf_counter() - t
                on_path[name][1] += 1
            if not k.get("async_op"):
                return out

            def finish():
                t = time.perf_counter()
                try:
                    return out()
                finally:
                    on_path[name][0] += time.perf_counter() - t
            return finish
        return call
    for fn_name, fn in bucket_calls.items():
        setattr(spmd, fn_name, outside(fn, fn_name))
    try:
        for _ in range(steps):
            timed(step, opt)
    finally:
        for kind, (module, attr) in BLOCKING.items():
            setattr(importlib.import_module(module), attr, originals[kind])
        for fn_name, fn in bucket_calls.items():
            setattr(spmd, fn_name, fn)
    alone = {}
    for kind, calls in planned.items():
        nbytes = statistics.median(c["bytes"] for c in calls)
        axis = statistics.mode(c["mesh_axes"][0] for c in calls)  # the axis most of them move over
        g = device_mesh.get_group(device_mesh.mesh_dim_names.index(axis))
        n = dist.get_world_size(g)
        whole, piece = torch.ones(int(nbytes) // 4), torch.empty(int(nbytes) // 4 // n)
        run = {"all_gather": lambda: originals["all_gather"](whole, piece.new_ones(piece.shape), group=g),
               "reduce_scatter": lambda: moves._reduce_scatter(piece, whole, g),
               "all_reduce": lambda: dist.all_reduce(whole, group=g)}[kind]
        alone[kind] = slowest_median(run, reps=20)
    kinds = sorted(planned)
    mine = torch.tensor([[spent[k][0] / max(1, spent[k][1]), spent[k][1] / steps, alone[k]] for k in kinds]
                        + [[on_path[b][0] / steps, on_path[b][1] / steps, 0.0] for b in ("_gather", "_scatter")],
                        dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    (gathers, gather_calls, _), (scatters, scatter_calls, _) = mine[len(kinds):].tolist()
    mine = mine[:len(kinds)]
    planned_gathers = sum(c["seconds"] for c in plan.collectives
                          if c["tensor"] in plan.parameters and c["kind"] == "all_gather")
    if dist.get_rank() == 0:
        print(f"\n{name}: blocking collectives per kind (slowest rank, {steps} steps)")
        print(f"  {'kind':<15} {'planned/step':>12} {'run/step':>8} {'predicted ms':>12} {'alone ms':>8} {'in the program ms':>17}")
        for k, (inside, count, by_itself) in zip(kinds, mine.tolist()):
            predicted = statistics.mean(c["seconds"] for c in planned[k])
            print(f"  {k:<15} {len(planned[k]):>12} {count:>8.0f} {predicted * 1e3:>12.2f} {by_itself * 1e3:>8.2f} "
                  f"{inside * 1e3:>17.2f}")
        p = plan.predicted
        if gather_calls:
            print(f"  parameters' bucket gathers: {gather_calls:.0f} calls a step, {gathers * 1e3:.1f} ms a step in "
                  f"their blocking calls, launches and waits; the plan's parameter all-gathers add up to "
                  f"{planned_gathers * 1e3:.1f} ms ({p['prefetched_gather_exposed_s'] * 1e3:.1f} ms of prefetched "
                  "ones exposed)")
        if scatter_calls:
            print(f"  gradients' bucket reduce-scatters: {scatter_calls:.0f} calls a step, {scatters * 1e3:.1f} ms a step "
                  f"in their launches and waits; predicted exposed gradient sync {p['grad_sync_exposed_s'] * 1e3:.1f} ms")


def run_case(name: str, meshes: dict, steps: int, warmup: int, cluster: str, profile: bool = False,
             collectives: bool = False) -> dict:
    make, pins, hand, hand_name, is_family, input_pins, mesh = CASES[name]
    device_mesh = meshes[mesh]
    model, inputs, loss_fn = make()
    twin, alone = copy.deepcopy(model), copy.deepcopy(model)
    plan, pmodel, ours = autopar_step(model, inputs, loss_fn, device_mesh, pins(model), input_pins, mesh, cluster)
    if not is_family(plan):
        raise SystemExit(f"{name}: the pinned plan is not the family it benchmarks: "
                         f"{ {k: (v['placements'], v.get('zero_stage')) for k, v in plan.parameters.items()} }")
    theirs_module, theirs = hand(twin, device_mesh, inputs, loss_fn)
    reported = global_loss(theirs, device_mesh, input_pins)
    steps_ = (ours, theirs, one_device(alone, inputs, loss_fn), reported)
    opts = [torch.optim.AdamW(m.parameters(), lr=LR) for m in (pmodel, theirs_module, alone)]
    opts.append(opts[1])  # the same hand-written model, reporting its loss
    times: list[list[float]] = [[], [], [], []]
    rotations = ((0, 1, 3), (1, 3, 0), (3, 0, 1)) if reported else ((0, 1), (1, 0))
    for i in range(warmup + steps):
        for k in (*rotations[i % len(rotations)], 2):
            t = timed(steps_[k], opts[k])
            if i >= warmup:
                times[k].append(t)
    if not reported:
        times[3] = times[1]  # its loss is the whole batch's already
    if profile:
        profiled(name, plan, steps_, opts, hand_name)
    if collectives:
        collectives_breakdown(name, plan, steps_[0], opts[0], device_mesh)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    rows = slowest.tolist()
    a, b, one, c = (statistics.median(row) for row in rows)
    return {"case": name, "mesh": mesh, "hand": hand_name, "autopar_ms": a * 1e3, "hand_ms": b * 1e3,
            "ratio": a / b, "hand_loss_ms": c * 1e3, "ratio_loss": a / c, "one_device_ms": one * 1e3,
            "predicted_ms": plan.predicted["step_time_s"] * 1e3,
            "ratio_interval": ratio_interval(rows[0], rows[1]), "ratio_loss_interval": ratio_interval(rows[0], rows[3])}


def ratio_interval(ours: list, theirs: list, draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """The 95% interval of median(ours) / median(theirs) over the steps,
    by the bootstrap: the step rounds resampled with replacement, each
    round's two times kept together (they ran one after the other)."""
    rng = random.Random(seed)
    n = len(ours)
    ratios = []
    for _ in range(draws):
        pick = [rng.randrange(n) for _ in range(n)]
        ratios.append(statistics.median(ours[i] for i in pick) / statistics.median(theirs[i] for i in pick))
    ratios.sort()
    return ratios[int(0.025 * draws)], ratios[int(0.975 * draws) - 1]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--cluster", default="cpu", help="the cluster the plans are priced on (a preset or a profile "
                    "file: `autopar calibrate -o F` measures this machine now)")
    ap.add_argument("--profile", action="store_true", help="also profile 5 autopar steps of each case on rank 0 "
                    "and print where they go, next to the plan's predicted compute and communication")
    ap.add_argument("--collectives", action="store_true", help="also time each case's blocking collectives per "
                    "kind, alone and inside the program, next to the plan's prediction per call")
    args = ap.parse_args()
    from torch.distributed.device_mesh import init_device_mesh
    meshes = {"4": init_distributed((WORLD,), ("x",))}
    meshes["2x2"] = init_device_mesh(meshes["4"].device_type, (2, 2), mesh_dim_names=("x", "y"))
    rows = [run_case(c, meshes, args.steps, args.warmup, args.cluster, args.profile, args.collectives)
            for c in args.cases.split(",")]
    if dist.get_rank() == 0:
        print(f"{'case':<9} {'mesh':<4} {'hand-written':<46} {'autopar ms':>10} {'hand ms':>8} {'ratio':>6} "
              f"{'hand+loss ms':>12} {'ratio':>6} {'predicted ms':>12} {'one device ms':>13}")
        for r in rows:
            print(f"{r['case']:<9} {r['mesh']:<4} {r['hand']:<46} {r['autopar_ms']:>10.1f} {r['hand_ms']:>8.1f} "
                  f"{r['ratio']:>5.2f}x {r['hand_loss_ms']:>12.1f} {r['ratio_loss']:>5.2f}x {r['predicted_ms']:>12.1f} "
                  f"{r['one_device_ms']:>13.1f}")
        print("95% intervals of the ratios (bootstrap over the steps): " + "; ".join(
            f"{r['case']} {r['ratio_interval'][0]:.2f}-{r['ratio_interval'][1]:.2f}x, with the loss "
            f"{r['ratio_loss_interval'][0]:.2f}-{r['ratio_loss_interval'][1]:.2f}x" for r in rows))
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
