"""One rank of ``autopar calibrate``, run by torchrun (never imported by the model).

    python -m torch.distributed.run --standalone --nproc-per-node N \\
        -m autopar.cost_models.calibrate_worker --out raw.json --backend gloo

Every rank measures at the same time, as the ranks of a real job share the
machine: GEMMs of several sizes and large copies (CPU ranks with one torch
thread each), then all-reduce and all-gather over a sweep of sizes. Rank 0
writes the raw timings; cost_models/calibrate.py fits the model to them.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

from autopar import moves

CPU_GEMM_SIZES = (64, 128, 256, 384, 512, 768, 1024)
GPU_GEMM_SIZES = (256, 512, 1024, 2048, 4096, 8192)
CPU_COPY_BYTES = (32 << 20, 64 << 20, 128 << 20, 256 << 20)
"""Larger than the last-level cache, so copies stream from DRAM."""
GPU_COPY_BYTES = (1 << 20, 16 << 20, 256 << 20, 1 << 30)
COLLECTIVE_BYTES = (4, 1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20)
CPU_ELEMENT_SIZES = (64, 512)
"""Rows of 256 elements: 16 Ki and 128 Ki elements (64 and 512 KiB of fp32),
cache-resident, where an op's arithmetic shows rather than DRAM bandwidth."""
GPU_ELEMENT_SIZES = (4096, 32768)
ELEMENT_OPS = {
    "add": lambda x: x + x, "mul": lambda x: x * x, "relu": torch.relu, "tanh": torch.tanh, "exp": torch.exp,
    "sigmoid": torch.sigmoid, "silu": F.silu, "gelu": F.gelu, "rsqrt": torch.rsqrt,
    "pow": lambda x: torch.pow(x, 2), "mean": lambda x: x.mean(-1), "sum": lambda x: x.sum(-1),
    "softmax": lambda x: torch.softmax(x, -1), "log_softmax": lambda x: torch.log_softmax(x, -1),
    "layer_norm": lambda x: F.layer_norm(x, x.shape[-1:]), "dropout": lambda x: F.dropout(x, 0.1, True),
}
"""ATen op name (as torch.export records it) -> the op on a (rows, 256) tensor
of values in [0.5, 1.5): the element-wise, reduction and normalisation ops
common in models, timed forward and backward (Device.element_time)."""
MIN_SECONDS = 0.2
"""Repeat each measurement until this much time has passed (and at least 3 times)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device, min_seconds: float = MIN_SECONDS) -> float:
    """Mean seconds of one ``fn()`` call over back-to-back calls for at least
    ``min_seconds``, after a warm-up. A mean over a window, not the median of
    single calls: when ranks outnumber cores, short calls timed one by one
    would dodge the time-slicing that a real run of N ranks pays."""
    fn()
    _sync(device)
    calls, start = 0, time.perf_counter()
    while calls < 3 or time.perf_counter() - start < min_seconds:
        fn()
        calls += 1
        if calls % 8 == 0:
            _sync(device)
    _sync(device)
    return (time.perf_counter() - start) / calls


def _timed_collective(fn, device: torch.device, min_seconds: float = MIN_SECONDS) -> float:
    """Mean seconds of one collective ``fn()`` as seen by the slowest rank. All
    ranks must call a collective equally often, so rank 0 picks the count."""
    t = time.perf_counter()
    fn()
    _sync(device)
    reps = torch.tensor([max(3, min(200, int(min_seconds / max(time.perf_counter() - t, 1e-6))))], device=device)
    dist.broadcast(reps, 0)
    dist.barrier()
    t = time.perf_counter()
    for _ in range(int(reps.item())):
        fn()
    _sync(device)
    seconds = torch.tensor([(time.perf_counter() - t) / int(reps.item())], dtype=torch.float64, device=device)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return float(seconds.item())


def measure_gemms(device: torch.device, dtype: torch.dtype, sizes) -> list[dict]:
    out = []
    for n in sizes:
        a = torch.randn(n, n, device=device, dtype=dtype)
        b = torch.randn(n, n, device=device, dtype=dtype)
        dist.barrier()
        seconds = _timed(lambda: torch.mm(a, b), device)
        out.append({"m": n, "n": n, "k": n, "flops": 2.0 * n ** 3, "seconds": seconds})
    return out


def measure_copies(device: torch.device, sizes) -> list[dict]:
    out = []
    for nbytes in sizes:
        x = torch.empty(nbytes // 4, device=device, dtype=torch.float32).uniform_()
        y = torch.empty_like(x)
        dist.barrier()
        seconds = _timed(lambda: y.copy_(x), device)
        out.append({"bytes_moved": 2.0 * nbytes, "seconds": seconds})  # read + write
    return out


HOST_COPY_BYTES = (16 << 20, 256 << 20)
HOST_ADAMW_ELEMENTS = 1 << 24
"""ZeRO-Offload's host side: pinned copies of these sizes each way, and one
torch.optim.AdamW step over this many fp32 host elements (64 MiB of
parameters, 320 MiB of state and gradient)."""


def measure_host(device: torch.device) -> dict:
    """What offloading optimizer state costs here, on all ranks at once (as
    every device of a node offloads together): copies between this GPU and
    pinned host memory, each way, and torch.optim.AdamW's step on host
    tensors with one torch thread per rank."""
    link = []
    for nbytes in HOST_COPY_BYTES:
        on_device = torch.empty(nbytes // 4, device=device)
        on_host = torch.empty(nbytes // 4, pin_memory=True)
        dist.barrier()
        down = _timed(lambda: on_host.copy_(on_device, non_blocking=True), device)
        up = _timed(lambda: on_device.copy_(on_host, non_blocking=True), device)
        link.append({"bytes": float(nbytes), "to_host_s": down, "to_device_s": up})
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // dist.get_world_size()))  # the ranks share the cores
    p = torch.zeros(HOST_ADAMW_ELEMENTS, requires_grad=True)
    p.grad = torch.rand_like(p)
    opt = torch.optim.AdamW([p])
    opt.step()  # its states allocated
    dist.barrier()
    adamw = _timed(opt.step, torch.device("cpu"))
    torch.set_num_threads(threads)
    return {"link": _gather_median(link, ("to_host_s", "to_device_s")), "adamw_elements": HOST_ADAMW_ELEMENTS,
            "adamw_s": _gather_median([{"seconds": adamw}])[0]["seconds"]}


def measure_op_latency(device: torch.device) -> float:
    """Seconds of a one-element add: the fixed cost of launching (or dispatching) an op."""
    x = torch.ones(1, device=device)
    y = torch.empty_like(x)
    dist.barrier()
    return _timed(lambda: torch.add(x, 1, out=y), device)


def measure_elements(device: torch.device, dtype: torch.dtype, sizes) -> list[dict]:
    """Forward and backward seconds of each ELEMENT_OPS op at two sizes; the
    fit takes the slope, which leaves out the per-call costs."""
    out = []
    for op, fn in ELEMENT_OPS.items():
        for rows in sizes:
            x = (torch.rand(rows, 256, device=device, dtype=dtype) + 0.5).requires_grad_()
            y = fn(x)
            dy = torch.ones_like(y)
            dist.barrier()
            forward = _timed(lambda: fn(x), device, MIN_SECONDS / 2)
            backward = _timed(lambda: torch.autograd.grad(y, x, dy, retain_graph=True), device, MIN_SECONDS / 2)
            out.append({"op": op, "elements": rows * 256, "forward_s": forward, "backward_s": backward})
    return out


def measure_collectives(device: torch.device, sizes) -> list[dict]:
    """All-reduce and all-gather through the functional collectives (on gloo
    they cost more than the in-place c10d call: an output buffer, the
    asynchronous work's hand-off), and reduce-scatter as the emitted
    programs run it (``moves._reduce_scatter``: on gloo a pairwise exchange)."""
    world, group = dist.get_world_size(), dist.group.WORLD
    out = []
    for nbytes in sizes:
        numel = max(1, nbytes // 4)
        buf = torch.ones(numel, device=device)
        chunk = max(1, numel // world)
        shard = torch.ones(chunk, device=device)
        whole, piece = torch.ones(chunk * world, device=device), torch.empty(chunk, device=device)
        for kind, fn, full in (
            ("all_reduce", lambda: funcol.wait_tensor(funcol.all_reduce(buf, "sum", group)), numel * 4),
            ("all_gather", lambda: funcol.wait_tensor(funcol.all_gather_tensor(shard, 0, group)), chunk * world * 4),
            ("reduce_scatter", lambda: moves._reduce_scatter(piece, whole, group), chunk * world * 4),
        ):
            out.append({"kind": kind, "bytes": float(full), "seconds": _timed_collective(fn, device)})
    return out


def _gather_median(rows: list[dict], keys: tuple = ("seconds",)) -> list[dict]:
    """Per-row median of each of ``keys`` across ranks (rank 0's rows otherwise)."""
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    merged = []
    for i, row in enumerate(rows):
        merged.append(dict(row, **{key: statistics.median(r[i][key] for r in everyone) for key in keys}))
    return merged


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", choices=["gloo", "nccl"], required=True)
    args = ap.parse_args(argv)

    if args.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        device, dtype, gemm_sizes, copy_sizes = torch.device("cuda", local), torch.bfloat16, GPU_GEMM_SIZES, GPU_COPY_BYTES
        element_sizes = GPU_ELEMENT_SIZES
    else:
        torch.set_num_threads(1)
        device, dtype, gemm_sizes, copy_sizes = torch.device("cpu"), torch.float32, CPU_GEMM_SIZES, CPU_COPY_BYTES
        element_sizes = CPU_ELEMENT_SIZES
    dist.init_process_group(args.backend)
    raw = {
        "world_size": dist.get_world_size(),
        "backend": args.backend,
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
        "gemm": _gather_median(measure_gemms(device, dtype, gemm_sizes)),
        "copy": _gather_median(measure_copies(device, copy_sizes)),
        "op_latency": _gather_median([{"seconds": measure_op_latency(device)}])[0]["seconds"],
        "elements": _gather_median(measure_elements(device, dtype, element_sizes), ("forward_s", "backward_s")),
        "collectives": measure_collectives(device, COLLECTIVE_BYTES) if dist.get_world_size() > 1 else [],
        # on a CPU rank host and device are one memory: nothing to offload to
        "host": measure_host(device) if args.backend == "nccl" else None,
    }
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(raw, f, indent=1)
    from autopar.runtime import shutdown
    shutdown(exit_code=0)


if __name__ == "__main__":
    main()
