"""``autopar calibrate``: measure this machine and write a cluster profile.

    calibrate("profile.json", nproc=4)          # gloo on CPU, NCCL with CUDA

It launches ``nproc`` local ranks with torchrun (cost_models/calibrate_worker.py),
which time GEMMs of several sizes, large copies and all-reduce / all-gather
sweeps, all ranks at once. The model's constants are then fitted by least
squares:

- GEMM:       seconds = gemm_latency + flops / rate     (rate = peak * gemm_efficiency),
              on relative error
- copy:       seconds = bytes / memory_bandwidth (DRAM-sized copies), on relative error
- op_latency: the measured time of a one-element add
- element_time: per element-wise / normalisation op, forward and backward
  seconds per element, the slope between two cache-resident sizes
- collective: seconds = steps * alpha + wire_bytes / bandwidth, with the
  steps and wire bytes the cost model gives each kind (collectives.ring_terms:
  2(n-1) and 2(n-1)/n S for a ring all-reduce, n-1 and (n-1)/n S for an
  all-gather, on gloo 1 and (n-1)/n S for the runtime's pairwise
  reduce-scatter), all kinds in one fit, on absolute seconds.

Last, the SPMD runtime's own costs are measured by running emitted programs
priced with the new profile (autopar/measure.py): ``runtime_overhead`` (per
call and pass), ``input_overhead`` (per unwrapped input and pass) and
``step_overhead`` (per step), fitted together on four chains of tiny ops, and
``collective_overhead`` (per collective call, Megatron MLP pairs with pinned
sharded weights).

The profile is a cluster JSON (docs/clusters.md) whose ``calibration`` field
keeps the raw timings and the fit residuals.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile

import numpy as np
import torch

from autopar.cost_models.cluster import Cluster, Device, Host, Link, cluster_names, get_cluster
from autopar.cost_models.collectives import ring_terms
from autopar.cost_models.graph_costs import OPTIMIZER_PASSES
from autopar.errors import ClusterError

PRESET_OF_GPU = {"A100": "dgx-a100", "H100": "dgx-h100", "H200": "h200", "V100": "p3.16xlarge"}
"""GPUs we know, by a fragment of their name, and the preset whose node they
sit in (cost_models/cluster.py): their datasheet peaks, and with one rank
their links. Other GPUs get their measured GEMM rate as peak."""


def gpu_preset(device_name: str) -> str | None:
    """The preset of a GPU named ``device_name`` (torch.cuda.get_device_name), or None."""
    return next((preset for key, preset in PRESET_OF_GPU.items() if key in device_name), None)

TIMEOUT_S = 600


def fit_proportional(x, y) -> float:
    """Slope b of y = b x minimising the squared relative error."""
    r = np.asarray(x, float) / np.asarray(y, float)
    return float(np.sum(r) / np.sum(r * r))


def fit_line(x, y) -> tuple[float, float]:
    """(intercept, slope) of y = a + b x minimising the squared *relative* error;
    a negative intercept is clamped to zero (and the slope refitted)."""
    x, y = np.asarray(x, float), np.asarray(y, float)
    design = np.stack([np.ones_like(x), x], axis=1) / y[:, None]
    (a, b), *_ = np.linalg.lstsq(design, np.ones_like(y), rcond=None)
    if a < 0:
        return 0.0, fit_proportional(x, y)
    return float(a), float(b)


def fit_alpha_beta(points: list[dict], n: int, pairwise_reduce_scatter: bool = False) -> tuple[float, float]:
    """(latency alpha in s, bandwidth in bytes/s) that best explain the
    measured collective times over ``n`` ranks, each kind with the latency
    steps and wire bytes the cost model gives it (``ring_terms``: a ring's
    all-reduce and all-gather, the runtime's reduce-scatter).

    Ordinary least squares on seconds (not relative error): the large
    collectives, which dominate a step, are fitted best, and one odd tiny
    message (gloo answers a 4-byte all-reduce far faster than its ring would)
    cannot pull alpha away from what every other size shows. The residuals are
    kept in the profile."""
    rows = [ring_terms(p["kind"], p["bytes"], n, pairwise_reduce_scatter) for p in points]
    a, y = np.asarray(rows, float), np.asarray([p["seconds"] for p in points], float)
    (alpha, inv_bw), *_ = np.linalg.lstsq(a, y, rcond=None)
    if alpha < 0:
        alpha, inv_bw = 0.0, float(a[:, 1] @ y / (a[:, 1] @ a[:, 1]))
    if not inv_bw > 0:
        raise ClusterError(f"collective timings do not fit a positive bandwidth: {points}")
    return float(alpha), float(1.0 / inv_bw)


def _relative_residuals(predicted, measured) -> list[float]:
    return [round((p - m) / m, 3) for p, m in zip(predicted, measured)]


def run_workers(nproc: int, backend: str, raw_path: str) -> dict:
    """Launch the measuring ranks under torchrun and return their raw timings."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "autopar.cost_models.calibrate_worker", "--out", raw_path, "--backend", backend]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S, env=env)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout)[-2000:]
        raise ClusterError(f"calibration ranks failed ({' '.join(cmd)}), exit {proc.returncode}:\n{tail}")
    with open(raw_path) as f:
        return json.load(f)


def _machine() -> str:
    if torch.cuda.is_available():
        return torch.cuda.get_device_name(0)
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{cpu}, {os.cpu_count()} cores"


def _host_memory() -> float:
    try:
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):
        raise ClusterError("cannot read the host memory size; calibrate on Linux") from None


def fit_element_time(rows: list[dict]) -> dict:
    """Per op, [forward, backward] seconds per element: the slope of the
    measured time between the smallest and the largest size (the per-call
    cost cancels), never below 0."""
    by_op: dict = {}
    for r in rows:
        by_op.setdefault(r["op"], []).append(r)
    out = {}
    for op, runs in by_op.items():
        small, large = min(runs, key=lambda r: r["elements"]), max(runs, key=lambda r: r["elements"])
        span = large["elements"] - small["elements"]
        if span > 0:
            out[op] = [max(0.0, (large[k] - small[k]) / span) for k in ("forward_s", "backward_s")]
    return out


def fit_host(raw_host: dict | None, host_memory: float | None, devices_per_node: int) -> Host | None:
    """The host section from ``measure_host``'s timings (None where none were
    taken: CPU ranks, whose host is their device): the link at the slower
    direction's fitted bandwidth, and the node's host memory bandwidth as the
    rate AdamW streamed its 80 B per element (graph_costs.OPTIMIZER_PASSES)
    on each rank, times the node's devices, so that offload_time's per-device
    share is what one rank measured beside the others."""
    if not raw_host or host_memory is None:
        return None
    link = raw_host["link"]
    inv = fit_proportional([c["bytes"] for c in link], [max(c["to_host_s"], c["to_device_s"]) for c in link])
    per_rank = raw_host["adamw_elements"] * OPTIMIZER_PASSES["adamw"][1] / raw_host["adamw_s"]
    return Host(host_memory, 1.0 / inv, per_rank * devices_per_node)


def profile_from_raw(raw: dict, *, name: str, source: str, device_name: str, memory: float,
                     known_peaks: dict | None, links: Cluster | None = None,
                     special_function_rate: float = 0.0, synchronous_mma_fraction: float = 1.0,
                     host_memory: float | None = None, multiprocessors: int = 0) -> Cluster:
    """Fit the cost model's constants to raw timings (see module docstring).
    ``known_peaks``: datasheet peak FLOP/s per dtype, when the device is known;
    ``special_function_rate``, ``synchronous_mma_fraction``: its SFU rate and
    what Ampere-style kernels reach of the measured GEMM rate, from the same
    preset (not measured: the GEMMs timed are cuBLAS's, native on any GPU);
    ``links``: where the node size and the links come from when one rank
    measured no collectives (the raw timings then list none); ``multiprocessors``:
    the GPU's SM count (torch.cuda.get_device_properties), 0 for CPU ranks."""
    n = raw["world_size"]
    gemm = raw["gemm"]
    gemm_latency, inv_rate = fit_line([g["flops"] for g in gemm], [g["seconds"] for g in gemm])
    rate = 1.0 / inv_rate
    dtype = "fp32" if raw["dtype"] == "float32" else "bf16"
    peaks = dict(known_peaks or {})
    if peaks.get(dtype, 0.0) < rate:  # unknown device, or faster than its datasheet
        peaks = {dtype: rate} if dtype == "fp32" else {"bf16": rate, "fp16": rate}
    peak = peaks[dtype]
    copy = raw["copy"]
    inv_bw = fit_proportional([c["bytes_moved"] for c in copy], [c["seconds"] for c in copy])
    op_latency = raw["op_latency"]
    element_time = fit_element_time(raw.get("elements", []))
    device = Device(device_name, peaks, memory, 1.0 / inv_bw, gemm_efficiency=min(1.0, rate / peak),
                    gemm_latency=gemm_latency, memory_efficiency=1.0, op_latency=op_latency,
                    element_time=element_time, special_function_rate=special_function_rate,
                    synchronous_mma_fraction=synchronous_mma_fraction, multiprocessors=multiprocessors)
    fit = {
        "gemm_rate_flops": rate, "gemm_latency_s": gemm_latency,
        "gemm_residuals": _relative_residuals([gemm_latency + g["flops"] / rate for g in gemm],
                                              [g["seconds"] for g in gemm]),
        "memory_bandwidth": 1.0 / inv_bw,
        "copy_residuals": _relative_residuals([c["bytes_moved"] * inv_bw for c in copy],
                                              [c["seconds"] for c in copy]),
    }
    if raw["collectives"]:  # the ranks' one node, both levels the measured link
        pairwise = raw["backend"] == "gloo"  # as axis_links prices the profile's reduce-scatters
        alpha, bandwidth = fit_alpha_beta(raw["collectives"], n, pairwise)
        terms = [ring_terms(c["kind"], c["bytes"], n, pairwise) for c in raw["collectives"]]
        fit.update(alpha_s=alpha, bandwidth=bandwidth, collective_residuals=_relative_residuals(
            [alpha * steps + wire / bandwidth for steps, wire in terms], [c["seconds"] for c in raw["collectives"]]))
        link = Link(bandwidth, alpha)
        node = dict(devices_per_node=n, intra_node=link, inter_node=link, nodes=1)
    else:  # one rank: the node, its links and the per-collective cost as the given cluster has them
        if links is None:
            raise ClusterError("one rank timed no collectives: give the cluster to take the links from")
        device = dataclasses.replace(device, collective_overhead=links.device.collective_overhead)
        node = dict(devices_per_node=links.devices_per_node, intra_node=links.intra_node,
                    inter_node=links.inter_node, nodes=None, oversubscription=links.oversubscription)
    host = fit_host(raw.get("host"), host_memory, node["devices_per_node"])
    return Cluster(name, device, backend=raw["backend"], source=source, overlap_grad_sync=raw["backend"] == "nccl",
                   calibration=dict(raw, fit=fit), host=host, **node)


def calibrate(out_path: str, nproc: int = 4, backend: str | None = None, name: str | None = None,
              links_from: str | None = None) -> Cluster:
    """Measure this machine with ``nproc`` local ranks and write a profile to
    ``out_path``. With one rank no collective can be timed: the node size,
    the links and the per-collective overhead come from ``links_from`` (a
    preset or profile; for a known GPU its preset by default)."""
    cuda = torch.cuda.is_available()
    backend = backend or ("nccl" if cuda else "gloo")
    if backend == "nccl" and not cuda:
        raise ClusterError("backend nccl needs CUDA, and torch.cuda.is_available() is False; use --backend gloo")
    links = None
    if nproc < 2:
        links_from = links_from or (gpu_preset(torch.cuda.get_device_name(0)) if backend == "nccl" else None)
        if links_from is None:
            raise ClusterError(f"with nproc={nproc} no collective can be timed: give --links-from PRESET (one of "
                               f"{cluster_names()}, or a profile) to take the links from, or --nproc 2 or more")
        links = get_cluster(links_from)
    if backend == "nccl" and torch.cuda.device_count() < nproc:
        raise ClusterError(f"nproc={nproc} NCCL ranks need {nproc} GPUs; this machine has "
                           f"{torch.cuda.device_count()}")
    machine = _machine()
    if backend == "nccl":
        props = torch.cuda.get_device_properties(0)
        memory, device_name = float(props.total_memory), props.name
        preset = gpu_preset(props.name)
        datasheet = get_cluster(preset).device if preset else None
        known = dict(datasheet.peak_flops) if datasheet else None
        sfu = datasheet.special_function_rate if datasheet else 0.0
        mma = datasheet.synchronous_mma_fraction if datasheet else 1.0
    else:
        memory, device_name, known, sfu, mma = _host_memory() / nproc, "cpu-rank", None, 0.0, 1.0
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        raw = run_workers(nproc, backend, os.path.join(tmp, "raw.json"))
    raw["load_average_before"] = load_before  # other work on the machine skews the timings
    today = datetime.date.today().isoformat()
    peak_note = ("peak, special_function_rate and synchronous_mma_fraction = the preset's figures" if known else
                 "peak_flops = the measured asymptotic GEMM rate of one rank (no datasheet figure)")
    sweeps = (f"all_reduce + all_gather + reduce_scatter sweeps {raw['collectives'][0]['bytes']:.0f} B.."
              f"{raw['collectives'][-1]['bytes'] / 2**20:.0f} MiB" if raw["collectives"] else
              f"one rank, no collectives: devices_per_node, links and collective_overhead from {links.name!r}")
    source = (f"autopar calibrate --nproc {nproc} --backend {backend}, {today}, on {machine}, "
              f"with torch {torch.__version__}: {raw['dtype']} GEMMs "
              f"{'with 1 torch thread per rank ' if backend == 'gloo' else ''}and copies on all ranks at once, "
              f"{sweeps}; least-squares fits; {peak_note}; "
              f"memory = {'device memory' if backend == 'nccl' else 'host memory / ranks'}; "
              + ("host: this machine's memory, pinned copies each way and a torch.optim.AdamW step of "
                 "2^24 host elements on every rank at once (the cores split among the ranks), the node's host bandwidth that per-rank rate times "
                 "the node's devices (optimistic where fewer ranks than devices ran); " if backend == "nccl" else "")
              + f"1-min load average before: {load_before:.2f}")
    cluster = profile_from_raw(raw, name=name or ("cpu" if backend == "gloo" else device_name.lower().replace(" ", "-")),
                               source=source, device_name=device_name, memory=memory, known_peaks=known,
                               links=links, special_function_rate=sfu, synchronous_mma_fraction=mma,
                               host_memory=_host_memory() if backend == "nccl" else None,
                               multiprocessors=props.multi_processor_count if backend == "nccl" else 0)
    _write(cluster, out_path)
    # The runtime's own costs are measured by running emitted programs priced
    # with this profile less the overheads being measured: per call, per
    # unwrapped input and per step first (four chains without collectives),
    # then per collective (priced with the first three).
    from autopar.measure import TP_PAIRS, collective_overhead, runtime_overheads
    per_call, per_input, per_step, rows = runtime_overheads(nproc, cluster=out_path, runs=OVERHEAD_RUNS)
    source += (f"; runtime_overhead, input_overhead, step_overhead: non-negative least squares over "
               f"{OVERHEAD_RUNS} runs of the linear, unary, product and single-op chains of autopar.measure "
               f"(excess over the cost model: "
               f"{', '.join(f'{1e3 * r[2]:.2f} ms for {r[0]} call passes with {r[1]} inputs' for r in rows)})")
    cluster = dataclasses.replace(cluster, source=source, device=dataclasses.replace(
        cluster.device, runtime_overhead=round(per_call, 7), input_overhead=round(per_input, 7),
        step_overhead=round(per_step, 7)))
    _write(cluster, out_path)
    if nproc < 2:  # nothing to meet: collective_overhead stays as the links' cluster has it
        return cluster
    runs = [collective_overhead(nproc, cluster=out_path) for _ in range(OVERHEAD_RUNS)]
    source += (f"; collective_overhead: mean of {OVERHEAD_RUNS} autopar.measure.collective_overhead({nproc}) runs "
               f"({', '.join(f'{1e3 * r:.3f}' for r in runs)} ms), {TP_PAIRS} Megatron MLP pairs with pinned sharded weights through the "
               "emitted program (step time beyond the cost model, per collective)")
    cluster = dataclasses.replace(cluster, source=source, device=dataclasses.replace(
        cluster.device, collective_overhead=round(statistics.mean(runs), 6)))
    _write(cluster, out_path)
    return cluster


OVERHEAD_RUNS = 3


def _write(cluster: Cluster, path: str) -> None:
    with open(path, "w") as f:
        json.dump(cluster.to_json(), f, indent=2)
        f.write("\n")
