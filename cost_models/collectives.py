"""Alpha-beta cost of collectives on one mesh axis of a cluster.

A mesh axis is mapped onto the cluster's levels (``axis_links``): ranks are
row-major, so axis ``i`` connects ranks ``stride = prod(shape[i+1:])`` apart.
If the whole group fits in a node it uses the intra-node link; if every member
sits on a different node it uses the inter-node link at one device's share of
its node's network; otherwise an all-gather or reduce-scatter is one flat ring
through every member (``_flat_ring``: its NVLink and network hops each at
their latency, the bytes at the group's share of each node's network,
``node_share``), and an all-reduce the faster of two such rings and a
hierarchical (tree-like) reduction.

Ring costs follow the NCCL bus-bandwidth factors (nccl-tests PERFORMANCE.md):
all-reduce moves 2(n-1)/n of the bytes, all-gather / reduce-scatter /
all-to-all (n-1)/n of the full (gathered) buffer. An all-reduce may also run as
a (double binary) tree, 2 ceil(log2 n) latency steps and 2S/B on the wire;
``collective_time(..., algorithm=Algorithm.BEST)`` takes the faster of the two
on the inter-node level, as NCCL's tuner does (its trees span nodes; inside a
node NCCL runs rings). The default is the ring, which is also the form
``autopar calibrate`` fits to measured gloo/NCCL times.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from autopar.cost_models.cluster import Cluster, Link


class Algorithm(str, Enum):
    RING = "ring"
    TREE = "tree"
    """All-reduce only; other collectives always use the ring."""
    BEST = "best"
    """The faster of ring and tree for an all-reduce between nodes; ring inside a node."""


class Collective(str, Enum):
    ALL_REDUCE = "all_reduce"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_TO_ALL = "all_to_all"
    SEND_RECV = "send_recv"


@dataclass(frozen=True)
class AxisLinks:
    """How one mesh axis of size ``size`` sits on the cluster."""

    size: int
    intra: int
    """Members of the group that share a node (1 if the axis only spans nodes)."""
    inter: int
    """Nodes the group spans (1 if the axis fits in a node)."""
    intra_link: Link
    inter_link: Link
    call_overhead: float = 0.0
    """Seconds each collective call adds beyond the links (Device.collective_overhead)."""
    pairwise_reduce_scatter: bool = False
    """The program's reduce-scatters are one pairwise exchange (an
    all-to-all and a local sum: autopar.spmd runs them so on gloo, whose own
    reduce-scatter is a whole all-reduce): one latency, the ring's bytes."""

    @property
    def spans_nodes(self) -> bool:
        return self.inter > 1

    @property
    def levels(self) -> frozenset:
        """The links its collectives occupy: "intra" (inside a node), "inter"
        (between nodes), both for a hierarchical group, none for size 1."""
        return frozenset(level for level, n in (("intra", self.intra), ("inter", self.inter)) if n > 1)

    def shares_link(self, other: "AxisLinks") -> bool:
        """Whether collectives on the two axes compete for the same link (run
        at once, each gets part of its bandwidth; one behind the other here)."""
        return bool(self.levels & other.levels)


def axis_links(cluster: Cluster, mesh_shape: tuple[int, ...]) -> list[AxisLinks]:
    out = []
    dpn = cluster.devices_per_node
    inter_bw = cluster.inter_node.bandwidth / cluster.oversubscription
    inter_link = Link(inter_bw, cluster.inter_node.latency)
    for i, size in enumerate(mesh_shape):
        stride = math.prod(mesh_shape[i + 1:])
        if stride * size <= dpn:
            intra, inter = size, 1
        elif stride >= dpn:
            intra, inter = 1, size
        else:
            intra = max(1, dpn // stride)
            inter = max(1, size // intra)
        out.append(AxisLinks(size, intra, inter, cluster.intra_node, inter_link, cluster.device.collective_overhead,
                             pairwise_reduce_scatter=cluster.backend == "gloo"))
    return out


def ring_bytes(kind: Collective, nbytes: float, n: int) -> float:
    """Bytes each rank sends in the ring algorithm for a buffer of ``nbytes``
    (the full buffer for gathers/scatters)."""
    kind = Collective(kind)
    if n <= 1:
        return 0.0
    if kind is Collective.ALL_REDUCE:
        return 2 * (n - 1) / n * nbytes
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) / n * nbytes
    return float(nbytes)


def ring_terms(kind: Collective, nbytes: float, n: int, pairwise_reduce_scatter: bool = False) -> tuple:
    """(latency steps, bytes on the wire per rank) of one collective over
    ``n`` ranks of one node as ``collective_time`` prices it: its time is
    steps x alpha + bytes / bandwidth (what ``autopar calibrate`` fits)."""
    def seconds(latency: float) -> float:
        link = Link(1.0, latency)
        return _links_time(Collective(kind), nbytes, AxisLinks(n, n, 1, link, link, 0.0, pairwise_reduce_scatter),
                           Algorithm.RING)
    wire = seconds(0.0)
    return seconds(1.0) - wire, wire


def _tree_all_reduce(nbytes: float, n: int, link: Link) -> float:
    """Reduce up and broadcast down a pipelined binary tree."""
    if n <= 1 or nbytes <= 0:
        return 0.0
    return 2 * math.ceil(math.log2(n)) * link.latency + 2 * nbytes / link.bandwidth


def _ring(kind: Collective, nbytes: float, n: int, link: Link, algorithm: Algorithm = Algorithm.RING) -> float:
    if n <= 1 or nbytes <= 0:
        return 0.0
    if kind is Collective.ALL_REDUCE:
        ring = 2 * (n - 1) * link.latency + ring_bytes(kind, nbytes, n) / link.bandwidth
        if algorithm is Algorithm.RING:
            return ring
        tree = _tree_all_reduce(nbytes, n, link)
        return tree if algorithm is Algorithm.TREE else min(ring, tree)
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER, Collective.ALL_TO_ALL):
        return (n - 1) * link.latency + ring_bytes(kind, nbytes, n) / link.bandwidth
    if kind is Collective.SEND_RECV:
        return link.latency + nbytes / link.bandwidth
    raise ValueError(f"unknown collective {kind!r}")


def collective_time(kind: Collective, nbytes: float, axis: AxisLinks,
                    algorithm: Algorithm = Algorithm.RING) -> float:
    """Seconds for one collective over ``nbytes`` (the full, unsharded buffer for
    gather/scatter kinds; the buffer each rank holds for all-reduce)."""
    kind, algorithm = Collective(kind), Algorithm(algorithm)
    if axis.size <= 1:
        return 0.0
    return axis.call_overhead + _links_time(kind, nbytes, axis, algorithm)


BUCKET_BYTES = 25 * 2**20
"""The bucket cap of the emitted program's gathers and gradient reductions:
DistributedDataParallel's default ``bucket_cap_mb``, 25 MiB (autopar.gradsync's
``GradSync`` and spmd's ``gather_params`` cut at it; graph_costs.bucketed prices them)."""


STEP_BUCKET_ELEMENTS = 40_000_000
STEP_BUCKET_ELEMENTS_PER_RANK = 1_000_000
"""Megatron-Core's default gradient bucket, max(40M, 1M x dp) parameters
(``DistributedDataParallelConfig.bucket_size``, megatron/core/distributed/
distributed_data_parallel_config.py, v0.7: "larger DP sizes need larger
buckets to ensure collectives do not become latency-bound")."""


def step_bucket_bytes(ranks: int, elem_bytes: int) -> int:
    """The bucket of a pipeline step's once-per-step gradient reductions and
    ZeRO-1 gathers over ``ranks`` (gradsync.GradAccumulation.reduce): blocking,
    after the microbatches, so only the calls' latency and the bucket's copy
    count, and Megatron-Core's size, growing with the group, keeps the
    ring's (ranks - 1) latencies per call from adding up; a tensor's
    gradient may straddle two."""
    return max(STEP_BUCKET_ELEMENTS, STEP_BUCKET_ELEMENTS_PER_RANK * ranks) * elem_bytes


def flat_buffer_time(seconds_of, nbytes: float, bucket: float) -> float:
    """Seconds for ``nbytes`` laid end to end as one flat buffer and cut in
    ``bucket``-byte pieces, one blocking collective each (``seconds_of``:
    one collective's seconds for its bytes): the end of a pipeline step's
    gradient sync and ZeRO-1 gathers (gradsync.in_buckets), ceil(nbytes /
    bucket) calls."""
    if nbytes <= 0:
        return 0.0
    full, rest = divmod(float(nbytes), float(bucket))
    return full * seconds_of(bucket) + (seconds_of(rest) if rest else 0.0)


def bucketed_time(kind: Collective, nbytes: float, axis: AxisLinks, bucket: float) -> float:
    """``flat_buffer_time`` of collectives over ``axis``."""
    return flat_buffer_time(lambda b: collective_time(kind, b, axis), nbytes, bucket)


def launch_time(kind: Collective, axis: AxisLinks) -> float:
    """Seconds of a collective that moves (almost) nothing, one byte: its
    call overhead and link latencies, what every call pays whatever it carries."""
    return collective_time(kind, 1.0, axis)


def _links_time(kind: Collective, nbytes: float, axis: AxisLinks, algorithm: Algorithm) -> float:
    if kind is Collective.REDUCE_SCATTER and axis.pairwise_reduce_scatter:
        return _pairwise(nbytes, axis)
    if axis.inter == 1:
        intra_algorithm = Algorithm.RING if algorithm is Algorithm.BEST else algorithm
        return _ring(kind, nbytes, axis.size, axis.intra_link, intra_algorithm)
    if axis.intra == 1:
        return _ring(kind, nbytes, axis.size, axis.inter_link, algorithm)
    if kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER):
        return _flat_ring(kind, nbytes, axis)
    if kind is Collective.ALL_REDUCE:
        ring = _flat_ring(Collective.REDUCE_SCATTER, nbytes, axis) + _flat_ring(Collective.ALL_GATHER, nbytes, axis)
        if algorithm is Algorithm.RING:
            return ring
        tree = _hierarchical_all_reduce(nbytes, axis, Algorithm.TREE)
        return tree if algorithm is Algorithm.TREE else min(ring, tree)
    # all-to-all and point-to-point: bound by the slowest (inter-node) level.
    return _ring(kind, nbytes, axis.size, axis.inter_link)


def _pairwise(nbytes: float, axis: AxisLinks) -> float:
    """A reduce-scatter as one pairwise exchange (``pairwise_reduce_scatter``):
    every rank sends its n - 1 pieces at once, so one latency of the slowest
    level it crosses and (n - 1)/n of the buffer at the group's share of it."""
    if axis.inter == 1:
        link, share = axis.intra_link, axis.intra_link.bandwidth
    else:
        link, share = axis.inter_link, axis.inter_link.bandwidth if axis.intra == 1 else node_share(axis)
    return link.latency + ring_bytes(Collective.REDUCE_SCATTER, nbytes, axis.size) / share


def node_share(axis: AxisLinks) -> float:
    """Bytes/s a collective over ``axis`` gets across nodes per node: the
    network share of its members there. A node's NICs are shared by its
    devices (the inter-node bandwidth is per device: a node's NICs over its
    devices), so a group with ``intra`` members on each node crosses at
    ``intra`` shares, however many other groups cross at once beside it; the
    ring's NVLink hops inside the node cap it (NCCL runs one ring per NIC
    through every node: nccl-tests doc/PERFORMANCE.md, bus bandwidth)."""
    return min(axis.intra_link.bandwidth, axis.intra * axis.inter_link.bandwidth)


def _flat_ring(kind: Collective, nbytes: float, axis: AxisLinks) -> float:
    """An all-gather or reduce-scatter over a group of ``intra`` devices on
    each of ``inter`` nodes, as NCCL runs it: one ring through every member,
    its n - 1 steps n - inter hops inside nodes and inter - 1 between them,
    each at its link's latency (NCCL's own model: latency = base + (nsteps
    - nInterSteps) intraLat + nInterSteps interLat, src/graph/tuning.cc,
    ncclTopoTuneModel), the bytes at the group's share of each node's
    network (``node_share``). At scale the steps add up: 1,024 devices on
    128 nodes wait 896 NVLink hops and 127 network hops per collective."""
    n = axis.size
    latency = (n - axis.inter) * axis.intra_link.latency + (axis.inter - 1) * axis.inter_link.latency
    return latency + ring_bytes(kind, nbytes, n) / node_share(axis)


def _hierarchical_all_reduce(nbytes: float, axis: AxisLinks, algorithm: Algorithm) -> float:
    """An all-reduce as a reduce-scatter inside each node, an all-reduce
    between nodes of each device's 1/intra slice, an all-gather inside the
    node (NCCL's tree algorithm crosses nodes on a tree of the nodes and
    chains inside each; this is its bandwidth and latency shape)."""
    return (
        _ring(Collective.REDUCE_SCATTER, nbytes, axis.intra, axis.intra_link)
        + _ring(Collective.ALL_REDUCE, nbytes / axis.intra, axis.inter, axis.inter_link, algorithm)
        + _ring(Collective.ALL_GATHER, nbytes, axis.intra, axis.intra_link)
    )
