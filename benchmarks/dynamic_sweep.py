"""One dynamic compile against static compiles of many sizes.

    nice -n 10 python benchmarks/dynamic_sweep.py [--quick]

For each case (a GPT over a range of batch sizes, or of sequence lengths,
on a mesh of A100s): one ``autopar.compile(..., dynamic=...)``, then static
compiles of sampled sizes (each lattice's ends, every piece's boundary and
the sizes on both sides of it, and random sizes), and for each the piece's
plan priced at that size against the static compile's plan. Prints per case
the pieces, the ILPs the dynamic compile solved, its wall time against the
static compiles' mean times the range's size, and the worst and mean
excess of the pieces' plans over the static optimum (the tolerance bounds
it; negative: the piece's plan is faster than the static compile's, which
the solver's gap allows). Timings are wall clock: report the 1-minute load
average next to them (printed).
"""
import argparse
import os
import random
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, ".."))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

import torch  # noqa: E402

import autopar  # noqa: E402
from autopar.cost_models.cluster import get_cluster  # noqa: E402
from autopar.dynamic import Assignment, Dynamic, Pricer, SymbolicGraph  # noqa: E402
from gpt import GPT, GPTConfig, lm_loss  # noqa: E402

CASES = {
    "medium, batch 1..1024, 2 A100": (dict(vocab=512, seq=64, hidden=256, heads=4, layers=2), 2,
                                       {"batch": (1, 1024)}, 8, 64),
    "medium, batch 1..1024, 4 A100": (dict(vocab=512, seq=64, hidden=256, heads=4, layers=2), 4,
                                       {"batch": (1, 1024)}, 8, 64),
    "medium, seq 64..1024:64, 4 A100": (dict(vocab=512, seq=1024, hidden=256, heads=4, layers=2), 4,
                                         {"seq": (64, 1024, 64)}, 8, 128),
}


def inputs(cfg: GPTConfig, batch: int, seq: int):
    idx = torch.zeros(batch, seq, dtype=torch.long)
    return idx, idx


def run(name, spec, mesh, dynamic, batch, seq, samples, tolerance):
    cfg = GPTConfig(**spec)
    torch.manual_seed(0)
    model = GPT(cfg)
    symbol = next(iter(dynamic))
    example = inputs(cfg, batch, seq)
    t = time.perf_counter()
    plan = autopar.compile(model, example, mesh=mesh, cluster="dgx-a100", loss_fn=lm_loss, dynamic=dynamic,
                           tolerance=tolerance)
    dynamic_s = time.perf_counter() - t
    dyn = Dynamic(plan)
    sg = SymbolicGraph(model, example, lm_loss, dyn.symbols)
    cluster = get_cluster("dgx-a100")
    pricer = Pricer(sg, plan.mesh, cluster, optimizer="adamw", precision="fp32", budget=cluster.device.memory,
                    source=None)
    s = dyn.symbols[0]
    sizes = {s.lo, s.hi}
    for i in range(len(dyn.pieces)):
        lo, hi, step = dyn.ranges(i)[symbol]
        sizes |= {v for v in (lo - 1, lo, lo + 1, hi - 1, hi, hi + 1) if v in s}
    rng = random.Random(0)
    values = list(range(s.lo, s.hi + 1, s.step))
    sizes |= set(rng.sample(values, min(samples, len(values))))
    excess, static_s = [], []
    for v in sorted(sizes):
        b, q = (v, seq) if symbol == "batch" else (batch, v)
        t = time.perf_counter()
        best = autopar.compile(model, inputs(cfg, b, q), mesh=mesh, cluster="dgx-a100", loss_fn=lm_loss)
        static_s.append(time.perf_counter() - t)
        i = dyn.piece({symbol: v})
        mine = pricer.cost(Assignment.of(dyn.plan(i)), dyn.lattices[i], (v,))
        excess.append((mine / best.predicted["step_time_s"] - 1, v, best.solver["status"],
                       best.solver["objective"] / best.predicted["step_time_s"] - 1))
    mean_static = sum(static_s) / len(static_s)
    search = plan.dynamic["search"]
    print(f"{name}: {len(dyn.pieces)} pieces on {search['lattices']} lattices, {search['probes']} ILPs, "
          f"{search['prices']} sizes priced; dynamic compile {dynamic_s:.1f} s, a static compile {mean_static:.2f} s "
          f"mean ({len(static_s)} sizes), so {s.count} static compiles ~{mean_static * s.count:.0f} s "
          f"({mean_static * s.count / dynamic_s:.1f}x the dynamic compile); piece plan vs static optimum at "
          f"{len(excess)} sizes: worst {_at(max(excess), symbol)}, mean {sum(e[0] for e in excess) / len(excess):+.3%},"
          f" best {_at(min(excess), symbol)} (tolerance {tolerance:.1%})", flush=True)


def _at(e, symbol) -> str:
    """An excess, where, and what the static compile there said (status; its ILP objective against its
    predicted step: where they differ, a plan found at another size may price faster than the ILP's)."""
    return f"{e[0]:+.3%} at {symbol} {e[1]} (static {e[2]}, ILP objective {e[3]:+.2%} off its predicted step)"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="the first case only, with 8 random sizes")
    ap.add_argument("--tolerance", type=float, default=0.01)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the start", flush=True)
    for name, (spec, mesh, dynamic, batch, seq) in list(CASES.items())[:1 if args.quick else None]:
        run(name, spec, mesh, dynamic, batch, seq, 8 if args.quick else 32, args.tolerance)
    print(f"load average {os.getloadavg()[0]:.2f} (1 min) at the end", flush=True)


if __name__ == "__main__":
    main()
