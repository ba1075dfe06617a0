"""Cluster descriptions: the physical machine a plan runs on.

A cluster is hierarchical: ``devices_per_node`` devices share an intra-node link
(NVLink/NVSwitch, or shared memory for CPU ranks); nodes are joined by an
inter-node link (InfiniBand, Ethernet). Bandwidths are per device and per
direction, in bytes/s, as the NCCL "bus bandwidth" a ring reaches on that level
(line rate less protocol overhead), not the line rate itself.

Presets live in a registry (``register_cluster`` / ``get_cluster``); a JSON file
with the same fields (see docs/clusters.md) is accepted wherever a preset name
is, and so is the profile ``autopar calibrate`` writes.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Literal

from autopar.errors import ClusterError

GB = 1e9
GiB = 2**30

DTYPES = ("fp32", "bf16", "fp16")
"""Compute dtypes a device lists peak FLOP/s for."""


def _positive(where: str, name: str, value, *, allow_zero: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value >= 0 if allow_zero else value > 0)
    if not ok:
        bound = ">= 0" if allow_zero else "> 0"
        raise ClusterError(f"{where}: {name} must be a finite number {bound}, got {value!r}")


def _fraction(where: str, name: str, value) -> None:
    _positive(where, name, value)
    if value > 1:
        raise ClusterError(f"{where}: {name} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class Link:
    """One level of the interconnect."""

    bandwidth: float
    """Bus bandwidth per device per direction that a ring collective reaches, bytes/s."""
    latency: float
    """Per-message latency (alpha) of one ring step, seconds."""

    def __post_init__(self):
        _positive("link", "bandwidth (bytes/s)", self.bandwidth)
        _positive("link", "latency (s)", self.latency, allow_zero=True)


@dataclass(frozen=True)
class Host:
    """The host memory of a node, where a plan may offload optimizer state
    and run its update (ZeRO-Offload, Ren et al. 2021)."""

    memory: float
    """Host memory per node, bytes (its devices share it)."""
    link_bandwidth: float
    """Bytes/s per direction between one device and host memory (the
    device's PCIe or chip-to-chip link), per device."""
    memory_bandwidth: float
    """Bytes/s of the node's host memory (all its sockets): the host
    optimizer streams its state through it, shared by the node's devices."""
    link_latency: float = 10e-6
    """Seconds per transfer (a copy's launch and completion)."""

    def __post_init__(self):
        _positive("host", "memory (bytes)", self.memory)
        _positive("host", "link_bandwidth (bytes/s)", self.link_bandwidth)
        _positive("host", "memory_bandwidth (bytes/s)", self.memory_bandwidth)
        _positive("host", "link_latency (s)", self.link_latency, allow_zero=True)


@dataclass(frozen=True)
class Device:
    """One accelerator (or one CPU rank).

    Compute time of an op is a roofline (cost_models/compute.py): a GEMM of F
    FLOPs takes ``gemm_latency + F / (peak * gemm_efficiency)``, so small GEMMs
    reach a smaller fraction of peak than large ones; memory-bound ops move
    bytes at ``memory_bandwidth * memory_efficiency``."""

    name: str
    peak_flops: dict
    """Dense peak FLOP/s per compute dtype: keys among 'fp32', 'bf16', 'fp16'."""
    memory: float
    """Device memory, bytes."""
    memory_bandwidth: float
    """Main-memory bandwidth, bytes/s (datasheet figure, or measured for a calibrated profile)."""
    gemm_efficiency: float = 1.0
    """Fraction of peak that a large GEMM sustains (the asymptote of the GEMM curve)."""
    gemm_latency: float = 0.0
    """Fixed seconds per GEMM (launch, pipeline fill, last partial wave): the
    intercept of GEMM time against FLOPs. It makes small GEMMs less efficient."""
    memory_efficiency: float = 1.0
    """Fraction of ``memory_bandwidth`` that streaming (element-wise) kernels reach."""
    op_latency: float = 0.0
    """Fixed seconds per non-GEMM op (kernel launch, or eager dispatch on CPU)."""
    runtime_overhead: float = 0.0
    """Seconds autopar's eager SPMD runtime adds per call and pass, whatever
    its inputs: each op (dispatch, wrapping its output as a DTensor), and the
    wrapping of each parameter, buffer and input (graph_costs.runtime_inputs);
    measured through the runtime itself by ``autopar calibrate``
    (autopar/measure.py, runtime_overheads); 0 where not measured (the GPU
    presets, where host-side dispatch overlaps with device work)."""
    input_overhead: float = 0.0
    """Seconds the runtime adds per DTensor input an op unwraps, per pass (the
    unwrapping, and in backward its autograd node and the summing of the
    gradients of a tensor read more than once), fitted with
    ``runtime_overhead`` on chains whose ops take one and two inputs; 0 where
    not measured."""
    step_overhead: float = 0.0
    """Seconds the runtime adds once per training step whatever the program
    holds (entering and leaving the program, starting the autograd engine,
    the optimizer's call), fitted with ``runtime_overhead`` and
    ``input_overhead`` as the intercept over op chains of 1 and 48 ops
    (autopar/measure.py, runtime_overheads); 0 where not measured (the GPU
    presets)."""
    element_time: dict = field(default_factory=dict)
    """Measured seconds per element of ATen ops whose arithmetic, not memory,
    can bound them, by op name: ``{"tanh": [forward, backward], ...}``. On a
    CPU rank a tanh, an exp or dropout's random numbers take several times a
    copy of the same tensor; ``autopar calibrate`` measures each listed op
    (calibrate_worker.ELEMENT_OPS) as the slope of its time over tensor size.
    An op not listed is priced by the roofline alone; empty for the GPU
    presets, whose element-wise kernels are bandwidth-bound."""
    special_function_rate: float = 0.0
    """Special-function evaluations (exp, log, reciprocal) per second: the
    GPU's SFUs, which do the softmax's exponentials outside the tensor cores.
    FlashAttention evaluates one exponential per score element it computes
    in forward and again in backward, and FlashAttention-2 does not overlap
    them with its GEMMs, so at long sequences they add to the kernel's time
    (compute.op_time's ``special`` term: ``autopar estimate``'s
    FlashAttention kernel and a compiled plan's scaled_dot_product_attention
    alike). 0 where not modelled (CPU ranks, whose exp is measured per
    element in ``element_time``)."""
    synchronous_mma_fraction: float = 1.0
    """Fraction of the GEMM rate that kernels built on the synchronous,
    warp-level tensor-core instruction of Ampere and older (``mma.sync``:
    FlashAttention-1 and -2, PyTorch's flash attention, Triton before its
    Hopper support) reach on this device. 1 where that instruction is the
    tensor cores' native one (V100, A100, CPU ranks); below 1 on Hopper, whose
    full rate needs the asynchronous warpgroup MMA (``wgmma``) that cuBLAS and
    FlashAttention-3 issue (HOPPER_SYNCHRONOUS_MMA_FRACTION)."""
    multiprocessors: int = 0
    """Streaming multiprocessors (SMs) of a GPU: what a communication kernel
    that runs beside a GEMM takes its share of (overlap of tensor-parallel
    collectives, transformer.tp_layer_comm); 0 where not known or not a GPU."""
    collective_overhead: float = 0.0
    """Seconds a collective call in an emitted program costs beyond its link's
    alpha-beta time (the DTensor redistribution around it; on a host with more
    ranks than cores, the ranks' skew when they meet), measured through the
    runtime by ``autopar calibrate`` (autopar/measure.py, collective_overhead);
    0 where not measured (the GPU presets)."""

    def __post_init__(self):
        where = f"device {self.name!r}"
        if not isinstance(self.peak_flops, dict) or not self.peak_flops:
            raise ClusterError(f"{where}: peak_flops must be a non-empty object {{dtype: FLOP/s}}, got {self.peak_flops!r}")
        for k, v in self.peak_flops.items():
            if k not in DTYPES:
                raise ClusterError(f"{where}: peak_flops key {k!r} is not one of {', '.join(DTYPES)}")
            _positive(where, f"peak_flops[{k!r}]", v)
        _positive(where, "memory (bytes)", self.memory)
        _positive(where, "memory_bandwidth (bytes/s)", self.memory_bandwidth)
        _fraction(where, "gemm_efficiency", self.gemm_efficiency)
        _fraction(where, "memory_efficiency", self.memory_efficiency)
        _positive(where, "gemm_latency (s)", self.gemm_latency, allow_zero=True)
        _positive(where, "op_latency (s)", self.op_latency, allow_zero=True)
        _positive(where, "runtime_overhead (s)", self.runtime_overhead, allow_zero=True)
        _positive(where, "input_overhead (s)", self.input_overhead, allow_zero=True)
        _positive(where, "step_overhead (s)", self.step_overhead, allow_zero=True)
        _positive(where, "collective_overhead (s)", self.collective_overhead, allow_zero=True)
        _positive(where, "special_function_rate (1/s)", self.special_function_rate, allow_zero=True)
        _fraction(where, "synchronous_mma_fraction", self.synchronous_mma_fraction)
        if not isinstance(self.multiprocessors, int) or isinstance(self.multiprocessors, bool) \
                or self.multiprocessors < 0:
            raise ClusterError(f"{where}: multiprocessors must be an integer >= 0, got {self.multiprocessors!r}")
        if not isinstance(self.element_time, dict):
            raise ClusterError(f"{where}: element_time must be an object {{op name: [forward s, backward s]}}, "
                               f"got {self.element_time!r}")
        for op, times in self.element_time.items():
            if not isinstance(times, (list, tuple)) or len(times) != 2:
                raise ClusterError(f"{where}: element_time[{op!r}] must be [forward seconds, backward seconds] "
                                   f"per element, got {times!r}")
            for i, t in enumerate(times):
                _positive(where, f"element_time[{op!r}][{i}] (s)", t, allow_zero=True)

    def element_seconds(self, op: str, elements: float, backward: bool = False) -> float:
        """Seconds the measured per-element rate of ATen op ``op`` gives
        ``elements`` elements (forward, or its backward); 0 if not measured."""
        times = self.element_time.get(op)
        return times[1 if backward else 0] * elements if times else 0.0

    def flops(self, dtype: str) -> float:
        """Peak FLOP/s for ``dtype``; dtypes the device does not list fall back to fp32."""
        if dtype in self.peak_flops:
            return self.peak_flops[dtype]
        return self.peak_flops.get("fp32", min(self.peak_flops.values()))

    def gemm_curve(self, flops: float, dtype: str = "fp32") -> float:
        """Fraction of peak a GEMM of ``flops`` FLOPs reaches (compute-bound case)."""
        if flops <= 0:
            return 0.0
        ideal = flops / (self.flops(dtype) * self.gemm_efficiency)
        return self.gemm_efficiency * ideal / (ideal + self.gemm_latency)

    @property
    def streaming_bandwidth(self) -> float:
        """Bytes/s an element-wise kernel moves."""
        return self.memory_bandwidth * self.memory_efficiency


@dataclass(frozen=True)
class Cluster:
    """A homogeneous cluster: ``nodes`` nodes of ``devices_per_node`` devices."""

    name: str
    device: Device
    """The accelerator (or CPU rank)."""
    devices_per_node: int
    """Devices that share the intra-node link."""
    intra_node: Link
    """Link between devices of one node."""
    inter_node: Link
    """Link between nodes, per device."""
    nodes: int | None = None
    """Number of nodes available; None means as many as the mesh needs."""
    oversubscription: float = 1.0
    """Inter-node fabric oversubscription (1 = full bisection bandwidth)."""
    backend: Literal["nccl", "gloo"] = "nccl"
    """torch.distributed backend the programs use on this cluster."""
    overlap_grad_sync: bool = True
    """Whether collectives started ahead run under compute: parameter-gradient
    synchronisation (the data-parallel all-reduce or ZeRO reduce-scatter)
    under the rest of the backward compute, in buckets, as PyTorch DDP and
    FSDP do on their own CUDA streams (Li et al., "PyTorch Distributed", VLDB
    2020, sec. 3.2.3), and ZeRO-3's parameter gathers in forward, one module
    ahead (timeline.GatherWindow). False for gloo on CPU ranks: the
    collectives run on the same cores as the compute."""
    source: str = ""
    """Where the numbers come from."""
    caveat: str = ""
    """What the numbers are known to get wrong or were not measured for, said
    as a warning wherever the cluster prices a plan (``autopar estimate``,
    ``autopar compile``)."""
    calibration: dict | None = None
    """Raw measurements behind a calibrated profile (informational; see cost_models/calibrate.py)."""
    host: Host | None = None
    """The nodes' host memory and the devices' links to it; None where the
    description has none: the planner then offloads nothing."""

    def __post_init__(self):
        where = f"cluster {self.name!r}"
        if not isinstance(self.devices_per_node, int) or isinstance(self.devices_per_node, bool) \
                or self.devices_per_node < 1:
            raise ClusterError(f"{where}: devices_per_node must be a positive integer, got {self.devices_per_node!r}")
        if self.nodes is not None and (not isinstance(self.nodes, int) or self.nodes < 1):
            raise ClusterError(f"{where}: nodes must be a positive integer or null, got {self.nodes!r}")
        _positive(where, "oversubscription", self.oversubscription)
        if self.oversubscription < 1:
            raise ClusterError(f"{where}: oversubscription must be >= 1, got {self.oversubscription!r}")
        if not isinstance(self.overlap_grad_sync, bool):
            raise ClusterError(f"{where}: overlap_grad_sync must be true or false, got {self.overlap_grad_sync!r}")
        if self.backend not in ("nccl", "gloo"):
            raise ClusterError(f"{where}: backend must be 'nccl' or 'gloo', got {self.backend!r}")
        for name in ("source", "caveat"):
            if not isinstance(getattr(self, name), str):
                raise ClusterError(f"{where}: {name} must be a string, got {getattr(self, name)!r}")

    def check_fits(self, mesh) -> None:
        """Raise unless ``mesh`` has at most as many devices as the cluster
        (a cluster of ``nodes: null`` has as many nodes as a mesh needs)."""
        if self.nodes is None or mesh.size <= self.nodes * self.devices_per_node:
            return
        total = self.nodes * self.devices_per_node
        raise ClusterError(
            f"mesh {mesh} needs {mesh.size:,} devices, but cluster {self.name!r} has {total:,} "
            f"({self.nodes} node(s) x {self.devices_per_node} devices per node): use a mesh of at most {total:,} "
            "devices, or a cluster description with more nodes (\"nodes\": null for as many as the mesh needs)")

    def to_json(self) -> dict:
        out = asdict(self)
        for optional in ("calibration", "host"):
            if out[optional] is None:
                del out[optional]
        return out

    @classmethod
    def from_json(cls, obj: dict) -> "Cluster":
        """Build and validate a cluster from its JSON object (docs/clusters.md)."""
        if not isinstance(obj, dict):
            raise ClusterError(f"a cluster description must be a JSON object, got {type(obj).__name__}")
        name = obj.get("name", "<unnamed>")
        top = _fields_of(cls, obj, f"cluster {name!r}")
        top["device"] = Device(**_fields_of(Device, obj["device"], f"cluster {name!r}: device"))
        for level in ("intra_node", "inter_node"):
            where = f"cluster {name!r}: {level}"
            try:
                top[level] = Link(**_fields_of(Link, obj[level], where))
            except ClusterError as e:
                raise ClusterError(f"{where}: {str(e).removeprefix('link: ')}") from None
        if top.get("host") is not None:
            where = f"cluster {name!r}: host"
            try:
                top["host"] = Host(**_fields_of(Host, top["host"], where))
            except ClusterError as e:
                raise ClusterError(f"{where}: {str(e).removeprefix('host: ')}") from None
        return cls(**top)


def _fields_of(cls, obj, where: str) -> dict:
    """``obj`` checked against the fields of dataclass ``cls``: an object, no
    unknown fields, every required field present."""
    if not isinstance(obj, dict):
        raise ClusterError(f"{where} must be a JSON object, got {obj!r}")
    known = [f.name for f in fields(cls)]
    required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise ClusterError(f"{where} has unknown field(s) {unknown}; known fields are {known}")
    missing = [k for k in required if k not in obj]
    if missing:
        raise ClusterError(f"{where} lacks required field(s) {missing}; required fields are {required}")
    return dict(obj)


_REGISTRY: dict[str, Cluster] = {}


def register_cluster(cluster: Cluster) -> Cluster:
    if cluster.name in _REGISTRY:
        raise ClusterError(f"cluster preset {cluster.name!r} is already registered")
    _REGISTRY[cluster.name] = cluster
    return cluster


def cluster_names() -> list[str]:
    return sorted(_REGISTRY)


def load_cluster_file(path: str) -> Cluster:
    """A cluster from a JSON file: a bare cluster object, or ``{"cluster": {...}}``."""
    try:
        with open(path) as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise ClusterError(f"cluster file {path}: not valid JSON ({e})") from None
    except OSError as e:
        raise ClusterError(f"cluster file {path}: cannot be read ({e.strerror})") from None
    if isinstance(obj, dict) and "cluster" in obj:
        obj = obj["cluster"]
    try:
        return Cluster.from_json(obj)
    except ClusterError as e:
        raise ClusterError(f"cluster file {path}: {e}") from None


def get_cluster(spec) -> Cluster:
    """A Cluster, a preset name, a JSON object, or the path of a JSON cluster/profile file."""
    if isinstance(spec, Cluster):
        return spec
    if isinstance(spec, dict):
        return Cluster.from_json(spec.get("cluster", spec))
    if isinstance(spec, (str, os.PathLike)):
        spec = os.fspath(spec)
        if spec in _REGISTRY:
            return _REGISTRY[spec]
        if os.path.exists(spec):
            return load_cluster_file(spec)
    raise ClusterError(
        f"unknown cluster {spec!r}; valid presets are {cluster_names()}, or give the path of a cluster JSON file"
    )


# --- presets ---------------------------------------------------------------
# Peak FLOP/s, memory and HBM bandwidth: NVIDIA datasheets (A100 SXM 80GB,
# H100 SXM, H200 SXM, V100 SXM2), as tabulated in shared/REFERENCE.md. fp32
# peaks are the non-tensor-core datasheet figures (A100 19.5, H100/H200 67,
# V100 15.7 TFLOP/s).
#
# Link bandwidths are what NCCL reaches, not line rates:
# - NVLink: line rate per direction (A100 NVLink3 600 GB/s bidirectional ->
#   300; H100/H200 NVLink4 900 -> 450; V100 NVLink2 300 -> 150) less NCCL's
#   ~20% protocol overhead: "450GB/s is the line rate. With the protocol
#   overhead (~20%) NCCL can get an effective NVLink bandwidth of 370GB/s"
#   (NCCL maintainer, github.com/NVIDIA/nccl-tests/issues/212). Hence 240, 370
#   and 120 GB/s.
# - InfiniBand, one HCA per GPU: HDR 200 Gb/s reaches 24 GB/s busbw ("you should
#   get ... 24GB/s inter-node", github.com/NVIDIA/nccl/issues/412; "DGX-A100 ...
#   8x200Gbit/s IB cards ... 192GB/s AllReduce BusBW", github.com/NVIDIA/nccl/
#   issues/812); NDR 400 Gb/s (CX-7) reaches 48 GB/s ("CX-7 NICs at NDR rate
#   should achieve up to 48-49GB/s per NIC", github.com/NVIDIA/nccl-tests/issues/267).
# - p3.16xlarge: 25 Gb/s Ethernet per instance (AWS EC2 instance page), shared
#   by the 8 GPUs, line rate (no NCCL measurement at hand).
# Latencies: ~5 us intra-node and ~10 us inter-node per ring step, the order of
# NCCL small-message times (a 16-GPU 2-node all-reduce of 4 B takes ~47 us,
# github.com/NVIDIA/nccl/issues/1244).
#
# GEMM and streaming efficiencies of the A100 are fitted once, globally, to the
# ten Megatron-LM runs of Narayanan et al. (SC'21, Table 1; shared/REFERENCE.md)
# by ``python benchmarks/validate_cost_model.py --fit`` (two constants for all
# rows, not per row; docs/validation.md reports the fit and its leave-one-out
# error). GEMM latency 3 us: the intercept implied by Calculon's A100 matrix
# efficiency table (60% of the asymptote at 1 GFLOP; Isaev et al. SC'23,
# github.com/calculon-ai/calculon systems/a100_80g.json). H100, H200 and V100
# reuse the A100's streaming fraction and V100 its GEMM fraction too (same
# cuBLAS/NCCL software stack); that is an assumption, flagged in docs/clusters.md.
#
# The H100 and H200 GEMM fraction is the A100's scaled by how far each GPU's
# own matmuls fall short of its datasheet peak in the same benchmark: the
# "Maximum Achievable Matmul FLOPS" of a bf16 torch.mm at the best shape, mean
# of 100 iterations, is 271.2 of 312 TFLOP/s on an A100 SXM (86.9%, torch 2.6
# cu126) and 794.5 of 989 on an H100 SXM (80.3%, torch 2.7 cu126; "H200 is the
# same") (S. Bekman, Machine Learning Engineering, compute/accelerator/README.md,
# "Maximum Achievable Matmul FLOPS comparison table"). The H100 runs closer to
# its power limit, so its clock drops further below the one its peak assumes.
A100_GEMM_EFFICIENCY = 0.66
"""Asymptotic GEMM fraction of peak, A100 (fit, benchmarks/validate_cost_model.py --fit)."""
MATMUL_FRACTION_A100 = 271.2 / 312
MATMUL_FRACTION_H100 = 794.5 / 989
"""Best-shape bf16 matmul throughput over datasheet peak (Bekman's MAMF table, above)."""
H100_GEMM_EFFICIENCY = round(A100_GEMM_EFFICIENCY * MATMUL_FRACTION_H100 / MATMUL_FRACTION_A100, 3)
"""Asymptotic GEMM fraction of peak, H100 and H200: the A100's, scaled by the
ratio of their measured best-shape matmul fractions."""
A100_MEMORY_EFFICIENCY = 0.78
"""Streaming-kernel fraction of HBM bandwidth, A100 (fit, benchmarks/validate_cost_model.py --fit)."""
CALCULON_HALF_POINT = (1e9, 0.6)
"""Calculon's matrix efficiency tables for the A100 80GB and the H100 (Isaev
et al. SC'23; github.com/calculon-ai/calculon systems/a100_80g.json and
systems/h100_80g_nvl8.json, "gflops_efficiency" float16): a GEMM of 1 GFLOP
runs at 0.6 of the efficiency of a large one (0.9 at 16 GFLOP, 0.95 at 128),
on each GPU alike: the same shapes, a faster GPU, a shorter fixed cost."""


def _gemm_latency(peak: float, gemm_efficiency: float) -> float:
    """The fixed seconds per GEMM at which the roofline's curve
    (Device.gemm_curve) passes through CALCULON_HALF_POINT on this GPU."""
    flops, fraction = CALCULON_HALF_POINT
    ideal = flops / (peak * gemm_efficiency)
    return ideal * (1 / fraction - 1)


GEMM_LATENCY = 3e-6
"""Seconds per GEMM on an A100 (Calculon's table, above: _gemm_latency gives 3.2 us at the fitted efficiency)."""
KERNEL_LATENCY = 3e-6
"""Seconds per CUDA kernel launch (same order as GEMM_LATENCY; CUDA launch overhead is a few us)."""
SFU_PER_SM_PER_CLOCK = 16
"""exp2/log2/rcp/rsqrt/sin/cos results per SM per clock on compute capability
7.0, 8.0 and 9.0 (CUDA C++ Programming Guide, "Arithmetic Instructions",
throughput of native arithmetic instructions). Times SMs and boost clock:
A100 SXM 108 SMs at 1.41 GHz, H100/H200 SXM 132 at 1.83 GHz (the clocks at
which 1024 and 2048 dense bf16 FMA per SM per clock give the datasheet's 312
and 989 TFLOP/s), V100 SXM2 80 at 1.53 GHz (NVIDIA A100, H100 and V100 architecture
whitepapers; the same SM counts are Device.multiprocessors). For the H100 that is 3.9e12/s, the figure FlashAttention-3 sets
against its 989 TFLOP/s of matmul (Shah et al. 2024, sec. 3)."""


def _sfu_rate(sms: int, clock_hz: float) -> float:
    return SFU_PER_SM_PER_CLOCK * sms * clock_hz


FA2_H100_UTILIZATION = 0.35
"""FlashAttention-2 reaches "only 35% utilization on the H100 GPU" (Shah et
al., FlashAttention-3, 2024, abstract), against 50-73% of the A100's peak
(Dao, FlashAttention-2, 2023, abstract)."""


def _synchronous_mma_fraction(peak: float, gemm_efficiency: float, sfu_rate: float, utilization: float,
                              head_dim: int = 128) -> float:
    """The fraction f of the GEMM rate at which this roofline prices a
    FlashAttention-2 forward at the measured ``utilization`` of ``peak``: per
    score element 4 d FLOPs at ``peak * gemm_efficiency * f`` plus one
    exponential on the SFUs, against 4 d FLOPs at ``peak * utilization``."""
    flops = 4.0 * head_dim
    return (flops / (peak * gemm_efficiency)) / (flops / (peak * utilization) - 1.0 / sfu_rate)


HOPPER_SYNCHRONOUS_MMA_FRACTION = round(
    _synchronous_mma_fraction(989e12, H100_GEMM_EFFICIENCY, _sfu_rate(132, 1.83e9), FA2_H100_UTILIZATION), 2)
"""H100/H200: what FlashAttention-2's measured utilization implies for
``mma.sync`` kernels (head dim 128, the common one), about 0.70: the same
kernel at the full GEMM rate would price at 47% of peak."""

_GPU_EFFICIENCIES = dict(gemm_efficiency=A100_GEMM_EFFICIENCY, gemm_latency=GEMM_LATENCY,
                         memory_efficiency=A100_MEMORY_EFFICIENCY, op_latency=KERNEL_LATENCY)

A100_80GB = Device("A100-SXM-80GB", {"bf16": 312e12, "fp16": 312e12, "fp32": 19.5e12}, 80 * GB, 2039 * GB,
                   special_function_rate=_sfu_rate(108, 1.41e9), multiprocessors=108, **_GPU_EFFICIENCIES)
HOPPER_GEMM_LATENCY = round(_gemm_latency(989e12, H100_GEMM_EFFICIENCY), 7)
"""Seconds per GEMM on an H100 or H200 (the same die): Calculon's H100 table
(CALCULON_HALF_POINT) at the H100's GEMM efficiency, about 1.1 us."""
_HOPPER_EFFICIENCIES = dict(_GPU_EFFICIENCIES, gemm_efficiency=H100_GEMM_EFFICIENCY, gemm_latency=HOPPER_GEMM_LATENCY,
                            synchronous_mma_fraction=HOPPER_SYNCHRONOUS_MMA_FRACTION)
H100_80GB = Device("H100-SXM-80GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 80 * GB, 3350 * GB,
                   special_function_rate=_sfu_rate(132, 1.83e9), multiprocessors=132, **_HOPPER_EFFICIENCIES)
H200 = Device("H200-SXM-141GB", {"bf16": 989e12, "fp16": 989e12, "fp32": 67e12}, 141 * GB, 4800 * GB,
              special_function_rate=_sfu_rate(132, 1.83e9), multiprocessors=132, **_HOPPER_EFFICIENCIES)
V100_32GB = Device("V100-SXM2-32GB", {"fp16": 125e12, "bf16": 125e12, "fp32": 15.7e12}, 32 * GB, 900 * GB,
                   special_function_rate=_sfu_rate(80, 1.53e9), multiprocessors=80, **_GPU_EFFICIENCIES)

BORROWED_EFFICIENCIES = (
    "its GEMM and memory efficiencies are the A100's fit, not measured on this GPU, and `autopar calibrate` on one "
    "measures its own; ")
HOPPER_EFFICIENCIES_NOTE = (
    "its GEMM efficiency and latency are its own, from published matmul benchmarks (the A100's fit scaled by the "
    "two GPUs' measured matmul fractions; Calculon's H100 efficiency curve), its memory efficiency the A100's, "
    "none measured by a calibration on this GPU (`autopar calibrate` on one measures its own); ")
H100_CHECKED = (
    "against MosaicML's 52 published H100 runs (PyTorch FSDP, 2023) predictions are 14% fast on average up to "
    "4,096 tokens (MAPE 15.2%) and 8% beyond, against Llama 3 405B -7%, -20%, -1%, against a 2026 Llama 3 70B "
    "FSDP run +6% (docs/validation.md)")
"""The caveats of the presets whose efficiencies were not measured on their GPU."""

NVLINK3 = Link(240 * GB, 5e-6)
NVLINK4 = Link(370 * GB, 5e-6)
NVLINK2 = Link(120 * GB, 5e-6)
IB_HDR = Link(24 * GB, 10e-6)
IB_NDR = Link(48 * GB, 10e-6)

# Host memory and links (offload). Links per direction: PCIe 4.0 x16 carries
# 16 GT/s x 16 lanes x 128/130 encoding = 31.5 GB/s, PCIe 5.0 x16 twice that,
# PCIe 3.0 x16 (8 GT/s) half (PCI-SIG base specifications; the A100, H100 SXM
# and V100 datasheets list their host interface as PCIe Gen4, Gen5, Gen3 x16).
# Host memory bandwidth: channels x transfer rate x 8 bytes per socket, two
# sockets: DGX A100's AMD EPYC 7742, 8 channels DDR4-3200 (204.8 GB/s each);
# DGX H100's Intel Xeon Platinum 8480C, 8 channels DDR5-4800 (307.2 GB/s each);
# p3.16xlarge's Xeon E5-2686 v4, 4 channels DDR4-2400 (76.8 GB/s each).
# Host memory: 2 TB in DGX A100 (640 GB) and DGX H100/H200 (NVIDIA DGX user
# guides), 488 GiB on p3.16xlarge (AWS instance table).
PCIE3_X16, PCIE4_X16, PCIE5_X16 = 15.75 * GB, 31.5 * GB, 63 * GB
DGX_A100_HOST = Host(2000 * GB, PCIE4_X16, 2 * 204.8 * GB)
DGX_H100_HOST = Host(2000 * GB, PCIE5_X16, 2 * 307.2 * GB)

register_cluster(Cluster(
    "dgx-a100", A100_80GB, 8, NVLINK3, IB_HDR,
    source="Selene-like DGX A100: 8 x A100 80GB on NVSwitch, 8 x HDR 200 Gb/s per node",
    host=DGX_A100_HOST,
))
register_cluster(Cluster(
    "dgx-h100", H100_80GB, 8, NVLINK4, IB_NDR,
    host=DGX_H100_HOST,
    source="DGX H100: 8 x H100 SXM on NVSwitch (NVLink4), 8 x NDR 400 Gb/s per node",
    caveat=HOPPER_EFFICIENCIES_NOTE + H100_CHECKED,
))
register_cluster(Cluster(
    "h200", H200, 8, NVLINK4, IB_NDR,
    host=DGX_H100_HOST,
    source="HGX H200: 8 x H200 SXM on NVSwitch (NVLink4), 8 x NDR 400 Gb/s per node",
    caveat=HOPPER_EFFICIENCIES_NOTE + "no H200 run has been checked; on the H100, which has the same compute, "
           + H100_CHECKED,
))
register_cluster(Cluster(
    "p3.16xlarge", V100_32GB, 8, NVLINK2, Link(25e9 / 8 / 8, 30e-6),
    host=Host(488 * 2**30, PCIE3_X16, 2 * 76.8 * GB),
    source="AWS p3.16xlarge: 8 x V100 on NVLink2 (300 GB/s bidirectional), 25 Gb/s Ethernet per instance",
    caveat=BORROWED_EFFICIENCIES + "no published V100 run has been checked",
))

PROFILES_DIR = os.path.join(os.path.dirname(__file__), "profiles")
for _file in sorted(os.listdir(PROFILES_DIR)):
    if _file.endswith(".json"):
        register_cluster(load_cluster_file(os.path.join(PROFILES_DIR, _file)))
