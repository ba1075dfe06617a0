"""What a blocking collective costs after compute, beyond the two timed apart.

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 benchmarks/collective_skew.py [--bytes 524288]

On every rank: ten rounds of a square fp32 GEMM (sides 64 to 640) followed
by a blocking all-gather of ``--bytes``, against the GEMMs alone and the
all-gathers alone (each loop after a barrier; the slowest rank's median
of 30). The excess, (both - GEMM - all-gather) per round, is what each
rank waits beyond its own work for the slowest to arrive: ranks that share
cores drift apart over a compute segment and meet again at the collective.
The cost model prices one collective call at its alpha-beta time plus a
fixed ``collective_overhead`` (cost_models/calibrate.py measures it on a
chain of tiny ops, where the segments are empty); this prints how the
excess grows with the segment before the call.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

ROUNDS = 10
SIDES = (64, 256, 320, 384, 512, 640)


def slowest_median(fn, reps: int = 30) -> float:
    """The slowest rank's median seconds of ``fn`` (each call after a barrier)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    x = torch.tensor(statistics.median(times), dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX)
    return x.item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bytes", type=int, default=512 * 1024, help="the all-gather's output buffer (default 512 KiB)")
    args = ap.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    n = dist.get_world_size()
    out = torch.empty(args.bytes // 4)
    piece = torch.ones(out.numel() // n)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def collectives():
        for _ in range(ROUNDS):
            gather(out, piece)
    alone = slowest_median(collectives) / ROUNDS
    if dist.get_rank() == 0:
        print(f"{n} ranks, all-gather of {args.bytes} B alone: {alone * 1e3:.2f} ms")
        print(f"{'GEMM side':>9} {'GEMM ms':>8} {'GEMM + all-gather ms':>20} {'excess ms':>9}")
    for side in SIDES:
        a, b = torch.randn(side, side), torch.randn(side, side)

        def gemms():
            for _ in range(ROUNDS):
                a @ b

        def both():
            for _ in range(ROUNDS):
                a @ b
                gather(out, piece)
        compute = slowest_median(gemms) / ROUNDS
        together = slowest_median(both) / ROUNDS
        if dist.get_rank() == 0:
            print(f"{side:>9} {compute * 1e3:>8.2f} {together * 1e3:>20.2f} {(together - compute - alone) * 1e3:>9.2f}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
