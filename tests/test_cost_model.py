"""Cost model primitives: collectives, compute, cluster files, calibration
fits and the optimizer step, by table (no processes, no GPU). The transformer
estimate built on them is tests/test_estimate.py."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from autopar.cost_models.calibrate import fit_alpha_beta, fit_element_time, fit_line, profile_from_raw
from autopar.cost_models.cluster import Cluster, Link, cluster_names, get_cluster
from autopar.cost_models.collectives import Algorithm, Collective, axis_links, collective_time, ring_bytes
from autopar.cost_models.compute import op_time
from autopar.errors import ClusterError

A100 = get_cluster("dgx-a100")


# --- collectives -------------------------------------------------------------------

@pytest.mark.parametrize("n", [2, 3, 4, 8, 64])
@pytest.mark.parametrize("nbytes", [1.0, 4096.0, 1e9])
def test_ring_all_reduce_moves_reduce_scatter_plus_all_gather(n, nbytes):
    assert ring_bytes(Collective.ALL_REDUCE, nbytes, n) == pytest.approx(
        ring_bytes(Collective.REDUCE_SCATTER, nbytes, n) + ring_bytes(Collective.ALL_GATHER, nbytes, n))


@pytest.mark.parametrize("n", [2, 4, 8])
def test_ring_all_reduce_time_is_reduce_scatter_plus_all_gather(n):
    (axis,) = axis_links(A100, (n,))
    nbytes = 64e6
    assert collective_time(Collective.ALL_REDUCE, nbytes, axis) == pytest.approx(
        collective_time(Collective.REDUCE_SCATTER, nbytes, axis) + collective_time(Collective.ALL_GATHER, nbytes, axis))


@pytest.mark.parametrize("kind", list(Collective))
def test_axis_across_nodes_is_slower_than_within_one(kind):
    (inside,) = axis_links(A100, (8,))
    across, _ = axis_links(A100, (8, 8))  # stride 8: every member on another node
    assert (inside.inter, across.intra) == (1, 1)
    assert collective_time(kind, 32e6, across) > collective_time(kind, 32e6, inside)


def test_axis_spanning_both_levels_is_one_flat_ring():
    """A group of 8 devices on each of 4 nodes: NCCL's one ring through all 32
    (31 steps: 28 NVLink hops, 3 network hops, each at its latency), the bytes at the
    group's share of each node's network, its 8 devices' NICs; an all-reduce
    is the faster of two such rings and the hierarchical reduction."""
    from autopar.cost_models.collectives import _hierarchical_all_reduce, node_share
    (axis,) = axis_links(A100, (32,))
    assert (axis.intra, axis.inter) == (8, 4)
    nbytes = 256e6
    assert node_share(axis) == min(A100.intra_node.bandwidth, 8 * A100.inter_node.bandwidth)
    latency = 28 * A100.intra_node.latency + 3 * A100.inter_node.latency
    assert collective_time(Collective.ALL_GATHER, nbytes, axis) == pytest.approx(
        latency + 31 / 32 * nbytes / node_share(axis))
    ring = 2 * collective_time(Collective.ALL_GATHER, nbytes, axis)
    assert collective_time(Collective.ALL_REDUCE, nbytes, axis) == pytest.approx(ring)
    assert collective_time(Collective.ALL_REDUCE, nbytes, axis, Algorithm.BEST) == pytest.approx(
        min(ring, _hierarchical_all_reduce(nbytes, axis, Algorithm.TREE)))
    flat = dataclasses.replace(axis, intra=1, inter=32)  # one device per node: one NIC's share
    assert collective_time(Collective.ALL_REDUCE, nbytes, axis) < collective_time(Collective.ALL_REDUCE, nbytes, flat)


@pytest.mark.parametrize("devices_per_group", [1, 2, 4, 8])
def test_a_group_crosses_nodes_at_its_members_share_of_the_network(devices_per_group):
    """The per-device share of a node's NICs: 8 groups of one device per node
    each cross at one NIC's share; one group of all 8 at the node's whole
    network. Bandwidth-bound all-gathers of the same bytes per device then
    take time inversely to the members per node (the ZeRO-3 group over all
    of a node's devices is 8x one over one device per node)."""
    from autopar.cost_models.collectives import node_share
    # the outer axis of (16 k, 8 / k): members 8 / k apart, k of them on each of 16 nodes
    axis = axis_links(A100, (16 * devices_per_group, 8 // devices_per_group))[0]
    assert (axis.intra, axis.inter) == (devices_per_group, 16)
    assert node_share(axis) == pytest.approx(devices_per_group * A100.inter_node.bandwidth)


@pytest.mark.parametrize("mesh_shape", [(4,), (2, 8)])
def test_collective_overhead_is_paid_once_per_call(mesh_shape):
    """A calibrated runtime cost per collective call comes on top of the
    links' alpha-beta time, once per call, also for a hierarchical one (an
    axis across nodes here for (2, 8)), and never for an axis of one rank."""
    slow = dataclasses.replace(A100, device=dataclasses.replace(A100.device, collective_overhead=1e-3))
    for plain, paid in zip(axis_links(A100, mesh_shape), axis_links(slow, mesh_shape)):
        for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER, Collective.ALL_TO_ALL):
            assert collective_time(kind, 1e6, paid) == pytest.approx(collective_time(kind, 1e6, plain) + 1e-3)
    (single,) = axis_links(slow, (1,))
    assert collective_time(Collective.ALL_REDUCE, 1e6, single) == 0.0


def test_tree_all_reduce_wins_on_latency_ring_on_bandwidth():
    (axis,) = axis_links(A100, (8,))
    small, large = 1024.0, 1e9
    assert collective_time(Collective.ALL_REDUCE, small, axis, Algorithm.TREE) < collective_time(
        Collective.ALL_REDUCE, small, axis, Algorithm.RING)
    assert collective_time(Collective.ALL_REDUCE, large, axis, Algorithm.RING) < collective_time(
        Collective.ALL_REDUCE, large, axis, Algorithm.TREE)


# --- compute -----------------------------------------------------------------------

def test_small_gemms_reach_a_smaller_fraction_of_peak():
    dev = A100.device
    curve = [dev.gemm_curve(f, "bf16") for f in (1e6, 1e8, 1e10, 1e12)]
    assert curve == sorted(curve)
    assert curve[0] < 0.5 * dev.gemm_efficiency
    assert curve[-1] == pytest.approx(dev.gemm_efficiency, rel=0.01)


def test_op_time_is_a_roofline():
    dev = A100.device
    compute_bound = op_time(1e12, 1e6, dev, "bf16", matmul=True)
    assert compute_bound == pytest.approx(dev.gemm_latency + 1e12 / (312e12 * dev.gemm_efficiency))
    memory_bound = op_time(0.0, 1e9, dev, "bf16")
    assert memory_bound == pytest.approx(dev.op_latency + 1e9 / (2039e9 * dev.memory_efficiency))


def test_presets_with_borrowed_efficiencies_say_so():
    """The A100's efficiencies are fitted on it; the other GPU presets'
    are derived from or reuse them, and their caveat says that and what it
    has cost."""
    assert get_cluster("dgx-a100").caveat == "" and get_cluster("cpu").caveat == ""
    for name in ("dgx-h100", "h200"):
        assert get_cluster(name).caveat.startswith("its GEMM efficiency and latency are its own, from published")
        assert "MosaicML's 52 published H100 runs" in get_cluster(name).caveat
    assert get_cluster("p3.16xlarge").caveat.startswith("its GEMM and memory efficiencies are the A100's fit")
    assert "no published V100 run" in get_cluster("p3.16xlarge").caveat


def test_hopper_gemm_latency_is_calculons_h100_curve():
    """The H100's fixed cost per GEMM puts the roofline's curve through
    Calculon's H100 table (1 GFLOP at 0.6 of a large GEMM's efficiency), as
    the A100's 3 us does through its A100 table."""
    from autopar.cost_models.cluster import CALCULON_HALF_POINT, _gemm_latency
    flops, fraction = CALCULON_HALF_POINT
    for name, peak in (("dgx-a100", 312e12), ("dgx-h100", 989e12), ("h200", 989e12)):
        dev = get_cluster(name).device
        assert dev.gemm_latency == pytest.approx(_gemm_latency(peak, dev.gemm_efficiency), rel=0.08)
        assert dev.gemm_curve(flops, "bf16") == pytest.approx(fraction * dev.gemm_efficiency, rel=0.05)


def test_hopper_gemm_efficiency_is_the_a100s_scaled_by_measured_matmul_fractions():
    """Best-shape bf16 matmuls reach 271.2 of 312 TFLOP/s on an A100 and
    794.5 of 989 on an H100 (the same benchmark): the H100 and H200 presets
    scale the A100's fitted whole-run fraction by that ratio, not by a fit."""
    a100 = A100.device.gemm_efficiency
    for name in ("dgx-h100", "h200"):
        dev = get_cluster(name).device
        assert dev.gemm_efficiency == pytest.approx(a100 * (794.5 / 989) / (271.2 / 312), abs=1e-3)
        assert dev.gemm_efficiency < a100 and dev.memory_efficiency == A100.device.memory_efficiency
    assert get_cluster("p3.16xlarge").device.gemm_efficiency == a100


def test_flash_attention_2_on_an_h100_prices_at_its_published_utilization():
    """FlashAttention-2 issues Ampere's mma.sync and reaches 35% of an H100's
    peak (FlashAttention-3 paper); at head dim 128 and a long sequence the
    H100 preset prices its forward there: 512 FLOPs and one exponential per
    score at the synchronous-MMA fraction of the GEMM rate. Native kernels
    (cuBLAS GEMMs, FlashAttention-3) and Ampere-native GPUs pay no fraction."""
    h100 = get_cluster("dgx-h100").device
    scores = 1e12
    flops, nbytes = 4 * 128 * scores, 1e6
    fa2 = op_time(flops, nbytes, h100, "bf16", matmul=True, special=scores, synchronous_mma=True)
    assert flops / fa2 / 989e12 == pytest.approx(0.35, abs=0.005)
    assert 0.6 < h100.synchronous_mma_fraction < 0.8
    native = op_time(flops, nbytes, h100, "bf16", matmul=True, special=scores)
    assert native < fa2
    assert A100.device.synchronous_mma_fraction == 1.0
    assert op_time(flops, nbytes, A100.device, "bf16", matmul=True, special=scores, synchronous_mma=True) == \
        op_time(flops, nbytes, A100.device, "bf16", matmul=True, special=scores)


def test_overlapped_exponentials_cost_the_larger_of_the_two():
    """FlashAttention-3 runs its exponentials beside its GEMMs: the kernel
    takes the larger of GEMM and SFU time, not their sum."""
    h100 = get_cluster("dgx-h100").device
    gemm = op_time(1e12, 1e6, h100, "bf16", matmul=True)
    for special in (1e9, 1e12):
        sfu = special / h100.special_function_rate
        overlapped = op_time(1e12, 1e6, h100, "bf16", matmul=True, special=special, overlap_special=True)
        assert overlapped == pytest.approx(h100.gemm_latency + max(gemm - h100.gemm_latency, sfu))
        assert overlapped < op_time(1e12, 1e6, h100, "bf16", matmul=True, special=special)


def test_fused_attention_waits_on_its_exponentials():
    """A GEMM kernel's special-function evaluations add at the SFU rate: 16
    per SM per clock, 3.9e12/s on an H100 (the FlashAttention-3 paper's
    figure); a device without the rate prices none."""
    h100 = get_cluster("dgx-h100").device
    assert h100.special_function_rate == pytest.approx(3.9e12, rel=0.01)
    assert A100.device.special_function_rate == pytest.approx(16 * 108 * 1.41e9)
    plain = op_time(1e12, 1e6, h100, "bf16", matmul=True)
    assert op_time(1e12, 1e6, h100, "bf16", matmul=True, special=1e10) == pytest.approx(plain + 1e10 / 3.87e12, rel=1e-3)
    none = dataclasses.replace(h100, special_function_rate=0.0)
    assert op_time(1e12, 1e6, none, "bf16", matmul=True, special=1e10) == pytest.approx(plain)


def test_a_recurrent_layer_applies_every_weight_matrix_to_every_token():
    """FLOPs of an LSTM, GRU or RNN op: 2 per weight element per token (the
    biases, 1-D, are element-wise)."""
    from autopar.cost_models.graph_costs import op_flops
    from autopar.runtime import load_factory
    model, inputs, loss = load_factory("tests/fixtures/recurrent.py:tagger")
    graph = _captured_with(model, inputs, loss)
    tokens = inputs[0].numel()
    for op, layer in (("lstm", model.lstm), ("gru", model.gru), ("rnn_tanh", model.rnn)):
        weights = sum(p.numel() for name, p in layer.named_parameters() if name.startswith("weight"))
        assert op_flops(graph.nodes[op]) == 2 * tokens * weights


def test_compiled_attention_counts_one_exponential_per_score():
    """A compiled plan prices scaled_dot_product_attention with the same
    op_time term as the estimate's FlashAttention: B H Sq Sk exponentials."""
    from autopar.cost_models.graph_costs import op_special

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v)

    q, k = torch.randn(2, 4, 16, 8), torch.randn(2, 4, 32, 8)
    graph = _captured(Attention(), q, k, k.clone(), torch.randn(2, 4, 16, 8))
    sdpa = [n for n in graph.nodes.values() if op_special(n) > 0]
    assert len(sdpa) == 1 and op_special(sdpa[0]) == 2 * 4 * 16 * 32
    fast = _compute(graph, _with_device(A100, special_function_rate=1e30))[sdpa[0].name][0]
    slow = _compute(graph, _with_device(A100, special_function_rate=1e9))[sdpa[0].name][0]
    assert slow - fast == pytest.approx(2 * 4 * 16 * 32 / 1e9, rel=1e-6)
    # PyTorch's fused attention is FlashAttention-2's kernel: on a GPU whose
    # synchronous MMA is slower its GEMM part is priced slower; a linear is not.
    big = _captured(Attention(), *(torch.randn(4, 16, 1024, 128) for _ in range(3)), torch.randn(4, 16, 1024, 128))
    node = next(n for n in big.nodes.values() if op_special(n) > 0)
    fp32 = _with_device(A100, special_function_rate=1e30, gemm_latency=0.0, op_latency=0.0)
    full, half = (_compute(big, _with_device(fp32, synchronous_mma_fraction=f))[node.name][0] for f in (1.0, 0.5))
    assert half > 1.5 * full


@pytest.mark.parametrize("seq,mesh,causal,share,exchanges", [
    (64, (1,), True, 0.5, 0),            # the masked score blocks skipped
    (64, (1,), False, 1.0, 0),
    (64, (4,), True, 0.5, 4),            # balanced chunks: the mean share, query/output halves exchanged
    (36, (4,), True, 0.5 * 7 / 4, 0),    # 9 queries a rank do not halve: contiguous, the last rank's share
    (64, (2, 2), True, 0.5, 4),          # over both axes of a 2-D mesh: balanced too
    (64, (4,), False, 1.0, 0),           # not causal: every rank the same work
])
def test_causal_attention_prices_the_busiest_ranks_share(seq, mesh, causal, share, exchanges):
    """Causal attention computes half the scores (FLASH_CAUSAL_WORK); with
    its queries' sequence split over cp ranks (context parallelism) in
    contiguous chunks the last rank computes (2cp - 1) / cp times the mean,
    so where the chunks halve the program balances them (rank j holding
    halves j and 2cp-1-j) at the price of four all-to-alls, which the plan
    lists with the op (graph_costs.attention_share, op_moves)."""
    from autopar.cost_models.graph_costs import CostContext, attention_share, op_moves
    from autopar.passes.enumerate import enumerate_strategies

    class Attention(torch.nn.Module):
        def forward(self, q, k, v):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)

    q = torch.randn(2, 4, seq, 8)
    graph = _captured(Attention(), q, q.clone(), q.clone(), q.clone())
    (node,) = [n for n in graph.nodes.values() if n.op_name == "scaled_dot_product_attention"]
    strategies, _ = enumerate_strategies(graph, mesh)
    whole = "S(2)" * len(mesh) if mesh != (1,) else "R"
    (s,) = [s for s in strategies[node.name] if "".join(map(str, s.output)) == whole]
    ctx = CostContext.make(mesh, A100)
    assert attention_share(node, s, mesh) == pytest.approx(share)
    fwd, bwd = op_moves(node, s, ctx, True)
    assert len(fwd) + len(bwd) == exchanges and all(m.kind is Collective.ALL_TO_ALL for m in fwd + bwd)


@pytest.mark.parametrize("mesh,split,collectives", [
    ((4,), "S(0)", [("x",)]),                      # the batch split: the statistics gathered, their gradients back
    ((2, 2), "S(0)S(2)", [("x", "y")]),            # both axes split it: one collective over both
    ((2, 2), "S(0)S(1)", [("x",)]),                # channels split over y: that axis needs none
    ((4,), "S(1)", []),                            # channels only: each rank normalises its own
])
def test_batch_norm_over_a_split_batch_syncs_its_statistics(mesh, split, collectives):
    """The program all-gathers a batch norm's per-channel statistics over
    the axes that split its batch or spatial dims (local_ops._batch_norm), and
    reduce-scatters their gradients in backward: collectives of the op
    itself, priced and listed with it (graph_costs.op_moves)."""
    from autopar.cost_models.graph_costs import CostContext, op_moves
    from autopar.passes.enumerate import enumerate_strategies

    graph = _captured(torch.nn.BatchNorm2d(8), torch.randn(4, 8, 6, 6), torch.randn(4, 8, 6, 6))
    (node,) = [n for n in graph.nodes.values() if n.op_name == "batch_norm"]
    strategies, _ = enumerate_strategies(graph, mesh)
    (s,) = [s for s in strategies[node.name] if "".join(map(str, s.inputs[0])) == split]
    names = ("x", "y")
    fwd, bwd = op_moves(node, s, CostContext.make(mesh, A100), True)
    assert [m.kind for m in fwd] + [m.kind for m in bwd] == \
        ([Collective.ALL_GATHER, Collective.REDUCE_SCATTER] if collectives else [])
    assert all(m.seconds > 0 and tuple(names[a] for a in (m.axes or (m.axis,))) == collectives[0] for m in fwd + bwd)


def test_rows_fetched_from_other_ranks_and_sent_to_experts_are_priced_with_their_ops():
    """Advanced indexing with x split by the rows it is indexed by fetches
    its positions' rows by one all-to-all ((n-1)/n of them from other ranks,
    gradients back in backward); an expert-parallel grouped matmul sends
    its rows to their experts and back, which under balanced routing moves
    nothing but costs each all-to-all's launch (graph_costs.op_moves)."""
    from autopar.cost_models.collectives import launch_time
    from autopar.cost_models.graph_costs import CostContext, op_moves
    from autopar.passes.enumerate import enumerate_strategies

    class Experts(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(4, 8, 16, dtype=torch.bfloat16))  # traced in bf16 (meta)

        def forward(self, x, order, offs):
            return torch._grouped_mm(x[order], self.w, offs)

    x, order = torch.randn(16, 8, dtype=torch.bfloat16), torch.randperm(16)
    offs = torch.tensor([4, 8, 12, 16], dtype=torch.int32)
    graph = _captured(Experts(), x, order, offs, torch.randn(16, 16, dtype=torch.bfloat16))
    strategies, _ = enumerate_strategies(graph, (4,))
    ctx = CostContext.make((4,), A100)
    (index,) = [n for n in graph.nodes.values() if n.op_name == "index.Tensor"]
    (routed,) = [s for s in strategies[index.name] if str(s) == "(S(0), R) -> S(0)"]
    fwd, bwd = op_moves(index, routed, ctx, True)
    local = 4 * 8 * 2  # each rank's 4 rows of 8 bfloat16s
    assert [(m.kind, m.nbytes) for m in fwd + bwd] == [(Collective.ALL_TO_ALL, 4 * local)] * 2
    assert fwd[0].seconds == collective_time(Collective.ALL_TO_ALL, local, ctx.links[0])
    assert op_moves(index, next(s for s in strategies[index.name] if str(s) == "(R, S(0)) -> S(0)"), ctx, True) \
        == ([], [])  # x whole: each rank looks up its own chunk of positions
    (mm,) = [n for n in graph.nodes.values() if n.op_name == "_grouped_mm"]
    (parallel,) = [s for s in strategies[mm.name] if str(s) == "(S(0), S(0), R) -> S(0)"]
    fwd, bwd = op_moves(mm, parallel, ctx, True)
    assert len(fwd) == len(bwd) == 2
    assert all(m.seconds == launch_time(Collective.ALL_TO_ALL, ctx.links[0]) for m in fwd + bwd)
    assert op_moves(mm, next(s for s in strategies[mm.name] if str(s) == "(R, S(0), R) -> P"), ctx, True) == ([], [])


def _captured_with(model, inputs, loss_fn):
    from autopar.capture import capture
    return capture(model, inputs, loss_fn=loss_fn)


def _captured(model, *inputs):
    import torch
    from autopar.capture import capture
    return capture(model, inputs, loss_fn=torch.nn.functional.mse_loss)


def _replicated(node):
    from autopar.passes.strategy import R, Strategy
    return Strategy(tuple((R,) for _ in node.inputs), (R,))


def _compute(graph, cluster):
    from autopar.cost_models.graph_costs import CostContext, needs_grad, node_compute
    ctx, grad = CostContext.make((1,), cluster), needs_grad(graph)
    return {n.name: node_compute(n, _replicated(n), ctx, n.name in grad) for n in graph.nodes.values()}


def _with_device(cluster, **fields):
    return dataclasses.replace(cluster, device=dataclasses.replace(cluster.device, **fields))


def test_runtime_overhead_is_per_call_and_per_unwrapped_input():
    """The SPMD runtime's cost: ``runtime_overhead`` per call and pass (ops,
    and the wrapping of parameters and inputs), ``input_overhead`` per DTensor
    input an op unwraps; backward only where a gradient flows; a getitem is no
    call. The step's total is what ``runtime_passes`` counts, which is what
    ``autopar calibrate`` fits the two constants against."""
    import torch
    from autopar.cost_models.graph_costs import runtime_passes
    torch.manual_seed(0)
    graph = _captured(torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Tanh()), torch.randn(2, 4), torch.randn(2, 4))
    cpu = get_cluster("cpu")
    base = _compute(graph, _with_device(cpu, runtime_overhead=0.0, input_overhead=0.0))
    per_call = _compute(graph, _with_device(cpu, runtime_overhead=1e-3, input_overhead=0.0))
    per_input = _compute(graph, _with_device(cpu, runtime_overhead=0.0, input_overhead=1e-3))
    nodes = graph.nodes
    linear = next(n for n in nodes.values() if "linear" in n.name)
    tanh = next(n for n in nodes.values() if "tanh" in n.name)
    weight = next(n for n in nodes.values() if n.kind.value == "param")
    x = next(n for n in nodes.values() if n.kind.value == "input")
    extra = lambda costs, name: tuple(round(c - b, 9) for c, b in zip(costs[name], base[name]))  # noqa: E731
    assert extra(per_call, linear.name) == extra(per_call, tanh.name) == (1e-3, 1e-3)
    assert extra(per_input, linear.name) == (3e-3, 3e-3) and extra(per_input, tanh.name) == (1e-3, 1e-3)
    assert extra(per_call, weight.name) == (1e-3, 1e-3) and extra(per_input, weight.name) == (0.0, 0.0)
    assert extra(per_call, x.name) == (1e-3, 0.0)  # wrapped forward, no gradient
    calls, inputs = runtime_passes(graph)
    total = lambda costs: sum(f + b for f, b in costs.values())  # noqa: E731
    assert total(per_call) - total(base) == pytest.approx(calls * 1e-3)
    assert total(per_input) - total(base) == pytest.approx(inputs * 1e-3)


def test_fit_runtime_overheads_separates_calls_inputs_and_steps():
    from autopar.measure import fit_runtime_overheads
    a, b, c = 40e-6, 30e-6, 4e-4
    passes = ((294, 296), (106, 108), (106, 202), (7, 9))
    rows = [(calls, inputs, a * calls + b * inputs + c) for calls, inputs in passes]
    assert fit_runtime_overheads(rows) == pytest.approx((a, b, c))
    # without a fixed cost the intercept comes out 0, not a small negative number
    rows = [(calls, inputs, a * calls + b * inputs) for calls, inputs in passes]
    assert fit_runtime_overheads(rows) == pytest.approx((a, b, 0.0), abs=1e-12)
    # a term the data make negative is dropped and the others refitted without it
    rows = [(100, 100, 1e-3), (100, 200, 1e-3), (10, 10, 1e-4)]
    assert fit_runtime_overheads(rows) == pytest.approx((1e-5, 0.0, 0.0))


def test_step_overhead_is_charged_once_per_step():
    """The calibrated fixed cost per step adds to the predicted compute and
    step time of a compiled plan, whatever the plan."""
    from autopar.compiler import compile as compile_plan
    from torch import nn
    model, inputs = nn.Sequential(nn.Linear(8, 8)), (torch.randn(8, 8), torch.randn(8, 8))
    cpu = get_cluster("cpu")
    plans = [compile_plan(model, inputs, mesh="2", cluster=_with_device(cpu, step_overhead=t),
                          loss_fn=torch.nn.functional.mse_loss) for t in (0.0, 1e-3)]
    base, more = (p.predicted for p in plans)
    assert more["compute_s"] - base["compute_s"] == pytest.approx(1e-3)
    assert more["step_time_s"] - base["step_time_s"] == pytest.approx(1e-3)


def test_measured_element_rates_bound_the_ops_they_name():
    """An op ``element_time`` lists costs at least its measured seconds per
    element, forward and backward each at its own rate; an op it does not
    list keeps the roofline."""
    import torch
    torch.manual_seed(0)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(64, 64)

        def forward(self, x):
            h = self.fc(x)
            return torch.tanh(h) + torch.relu(h)

    graph = _captured(Net(), torch.randn(32, 64), torch.randn(32, 64))
    cpu = _with_device(get_cluster("cpu"), runtime_overhead=0.0, input_overhead=0.0, element_time={})
    fwd_s, bwd_s = 1e-6, 2e-7  # far above the roofline for 2048 elements
    slow = _with_device(cpu, element_time={"tanh": [fwd_s, bwd_s]})
    plain, measured = _compute(graph, cpu), _compute(graph, slow)
    name = lambda op: next(n for n in graph.nodes if n.startswith(op))  # noqa: E731
    lat = cpu.device.op_latency
    assert measured[name("tanh")] == pytest.approx((lat + 2048 * fwd_s, lat + 2048 * bwd_s))
    assert plain[name("tanh")][0] < measured[name("tanh")][0] / 10
    assert measured[name("relu")] == plain[name("relu")]


def test_fit_element_time_takes_the_slope():
    rows = [{"op": "tanh", "elements": n, "forward_s": 5e-6 + 4e-9 * n, "backward_s": 3e-6 + 1e-9 * n}
            for n in (16384, 131072)]
    rows += [{"op": "sum", "elements": n, "forward_s": 5e-6, "backward_s": 6e-6 - 1e-12 * n} for n in (16384, 131072)]
    fitted = fit_element_time(rows)
    assert fitted["tanh"] == pytest.approx([4e-9, 1e-9])
    assert fitted["sum"] == [0.0, 0.0]  # a flat or falling time is no per-element cost


# --- cluster files ------------------------------------------------------------------------

def _valid_cluster() -> dict:
    return A100.to_json()


@pytest.mark.parametrize("edit, message", [
    (lambda c: c.update(color="red"), r"unknown field\(s\) \['color'\]"),
    (lambda c: c["device"].update(tflops=1), r"device has unknown field\(s\) \['tflops'\]"),
    (lambda c: c["intra_node"].update(bandwidth=-1.0), r"intra_node.*bandwidth \(bytes/s\) must be a finite number > 0, got -1.0"),
    (lambda c: c["device"].update(memory_bandwidth="fast"), r"memory_bandwidth .* must be a finite number > 0, got 'fast'"),
    (lambda c: c.pop("inter_node"), r"lacks required field\(s\) \['inter_node'\]"),
    (lambda c: c["device"].pop("memory"), r"device lacks required field\(s\) \['memory'\]"),
    (lambda c: c["device"].update(gemm_efficiency=1.5), r"gemm_efficiency must be in \(0, 1\], got 1.5"),
    (lambda c: c["device"]["peak_flops"].update(int4=1e15), r"peak_flops key 'int4' is not one of"),
    (lambda c: c.update(devices_per_node=0), r"devices_per_node must be a positive integer, got 0"),
    (lambda c: c["device"].update(collective_overhead=-1e-3), r"collective_overhead \(s\) must be a finite number >= 0"),
    (lambda c: c["device"].update(input_overhead=float("nan")), r"input_overhead \(s\) must be a finite number >= 0"),
    (lambda c: c["device"].update(step_overhead=-1e-3), r"step_overhead \(s\) must be a finite number >= 0, got -0.001"),
    (lambda c: c.update(caveat=3), r"caveat must be a string, got 3"),
    (lambda c: c["device"].update(special_function_rate=-1.0), r"special_function_rate \(1/s\) must be a finite number >= 0"),
    (lambda c: c["device"].update(synchronous_mma_fraction=1.5), r"synchronous_mma_fraction must be in \(0, 1\], got 1.5"),
    (lambda c: c["device"].update(element_time={"tanh": 4e-9}), r"element_time\['tanh'\] must be \[forward seconds, "
                                                                 r"backward seconds\] per element, got 4e-09"),
    (lambda c: c["device"].update(element_time={"tanh": [4e-9, -1]}), r"element_time\['tanh'\]\[1\] \(s\) must be"),
])
def test_invalid_cluster_files_give_clear_errors(tmp_path, edit, message):
    obj = _valid_cluster()
    edit(obj)
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(ClusterError, match=message):
        get_cluster(str(path))


def test_bad_json_and_unknown_presets(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"name": "x", ')
    with pytest.raises(ClusterError, match=r"broken.json: not valid JSON"):
        get_cluster(str(path))
    with pytest.raises(ClusterError, match=r"unknown cluster 'dgx-z9'; valid presets are \["):
        get_cluster("dgx-z9")


@pytest.mark.parametrize("name", ["dgx-a100", "dgx-h100", "h200", "p3.16xlarge", "cpu"])
def test_presets_round_trip_through_json(name, tmp_path):
    assert name in cluster_names()
    cluster = get_cluster(name)
    path = tmp_path / "c.json"
    path.write_text(json.dumps({"cluster": cluster.to_json()}))
    assert get_cluster(str(path)) == cluster
    assert cluster.source


# --- calibration fits ----------------------------------------------------------------------

def test_fits_recover_synthetic_constants():
    alpha, bw, n = 300e-6, 0.7e9, 4
    steps = {"all_reduce": 2 * (n - 1), "all_gather": n - 1, "reduce_scatter": n - 1}
    points = [{"kind": k, "bytes": b, "seconds": alpha * steps[k] + ring_bytes(Collective(k), b, n) / bw}
              for k in steps for b in (4.0, 1e4, 1e6, 1.6e7)]
    assert fit_alpha_beta(points, n) == pytest.approx((alpha, bw), rel=1e-9)
    # gloo: the runtime's reduce-scatter is one pairwise exchange, one latency
    pairwise = [dict(p, seconds=p["seconds"] - (n - 2) * alpha) if p["kind"] == "reduce_scatter" else p
                for p in points]
    assert fit_alpha_beta(pairwise, n, pairwise_reduce_scatter=True) == pytest.approx((alpha, bw), rel=1e-9)
    assert fit_alpha_beta(pairwise, n)[0] != pytest.approx(alpha, rel=1e-3)  # priced as a ring, it fits worse
    assert fit_line([1, 2, 4], [3.5, 4.0, 5.0]) == pytest.approx((3.0, 0.5))


def test_a_gloo_clusters_reduce_scatter_is_priced_as_the_runtime_runs_it():
    """autopar.spmd runs a reduce-scatter on gloo as one all-to-all and a
    local sum (gloo's own all-reduces the whole buffer): one latency and the
    ring's bytes, where NCCL's ring waits n - 1 latencies."""
    link = Link(1e9, 1e-3)
    nbytes, n = 4e6, 4
    gloo = Cluster("g", get_cluster("cpu").device, devices_per_node=4, intra_node=link, inter_node=link, nodes=1,
                   backend="gloo")
    nccl = dataclasses.replace(gloo, backend="nccl")
    (g,), (c,) = axis_links(gloo, (n,)), axis_links(nccl, (n,))
    wire = (n - 1) / n * nbytes / link.bandwidth
    assert collective_time(Collective.REDUCE_SCATTER, nbytes, g) == pytest.approx(g.call_overhead + 1e-3 + wire)
    assert collective_time(Collective.REDUCE_SCATTER, nbytes, c) == pytest.approx(c.call_overhead + 3e-3 + wire)
    for kind in (Collective.ALL_REDUCE, Collective.ALL_GATHER):  # gloo's own, rings
        assert collective_time(kind, nbytes, g) == pytest.approx(collective_time(kind, nbytes, c))


def test_profile_from_raw_is_a_valid_cluster():
    raw = {"world_size": 4, "backend": "gloo", "dtype": "float32",
           "gemm": [{"flops": f, "seconds": 5e-6 + f / 40e9} for f in (1e6, 1e8, 2e9)],
           "copy": [{"bytes_moved": b, "seconds": b / 5e9} for b in (6.4e7, 2.6e8)],
           "op_latency": 4e-6,
           "elements": [{"op": "tanh", "elements": n, "forward_s": 2e-6 + 4e-9 * n, "backward_s": 1e-9 * n}
                        for n in (1000, 9000)],
           "collectives": [{"kind": "all_reduce", "bytes": b, "seconds": 6 * 2e-4 + 1.5 * b / 1e9}
                           for b in (4.0, 1e6, 1.6e7)]}
    cluster = profile_from_raw(raw, name="cpu-test", source="test", device_name="cpu-rank", memory=6e9,
                               known_peaks=None)
    assert isinstance(cluster, Cluster) and cluster.backend == "gloo" and cluster.devices_per_node == 4
    assert cluster.device.flops("fp32") == pytest.approx(40e9)
    assert cluster.device.gemm_latency == pytest.approx(5e-6)
    assert cluster.device.memory_bandwidth == pytest.approx(5e9)
    assert (cluster.intra_node.latency, cluster.intra_node.bandwidth) == pytest.approx((2e-4, 1e9))
    assert cluster.device.element_time["tanh"] == pytest.approx([4e-9, 1e-9])
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster


def test_one_rank_profile_takes_node_and_links_from_a_cluster(capsys):
    """One GPU (or one CPU rank) times GEMMs, copies and element-wise ops but
    no collective: the profile keeps its own compute and takes the node
    size, the links and the per-collective cost from the cluster named."""
    raw = {"world_size": 1, "backend": "nccl", "dtype": "bfloat16",
           "gemm": [{"flops": f, "seconds": 4e-6 + f / 700e12} for f in (1e9, 1e11, 1e12)],
           "copy": [{"bytes_moved": b, "seconds": b / 4e12} for b in (2e9, 8e9)],
           "op_latency": 3e-6, "elements": [], "collectives": []}
    h200 = get_cluster("h200")
    cluster = profile_from_raw(raw, name="h200-one", source="test", device_name="NVIDIA H200", memory=141e9,
                               known_peaks=dict(h200.device.peak_flops), links=h200,
                               synchronous_mma_fraction=h200.device.synchronous_mma_fraction)
    assert cluster.device.synchronous_mma_fraction == h200.device.synchronous_mma_fraction < 1.0
    assert Cluster.from_json(cluster.to_json()) == cluster  # the profile file keeps it
    assert cluster.devices_per_node == 8 and cluster.nodes is None
    assert (cluster.intra_node, cluster.inter_node) == (h200.intra_node, h200.inter_node)
    assert cluster.device.gemm_efficiency == pytest.approx(700e12 / 989e12)
    assert cluster.device.memory_bandwidth == pytest.approx(4e12) and cluster.backend == "nccl"
    with pytest.raises(ClusterError, match="one rank timed no collectives"):
        profile_from_raw(raw, name="x", source="test", device_name="x", memory=1e9, known_peaks=None)
    from autopar.cost_models.estimate_cli import calibrate_main
    assert calibrate_main(["-o", "unused.json", "--nproc", "1", "--backend", "gloo"]) == 2
    assert "with nproc=1 no collective can be timed: give --links-from PRESET" in capsys.readouterr().err



def test_gpu_profile_measures_the_host_it_offloads_to():
    """A GPU profile's host section comes from calibrate's host timings
    (calibrate_worker.measure_host): the link at the slower direction, and
    host memory bandwidth such that each device's share is the AdamW rate
    one rank measured beside the others; CPU ranks get none (their host is
    their device)."""
    h200 = get_cluster("h200")
    raw = {"world_size": 8, "backend": "nccl", "dtype": "bfloat16",
           "gemm": [{"flops": f, "seconds": 4e-6 + f / 700e12} for f in (1e9, 1e11, 1e12)],
           "copy": [{"bytes_moved": b, "seconds": b / 4e12} for b in (2e9, 8e9)],
           "op_latency": 3e-6, "elements": [],
           "collectives": [{"kind": "all_reduce", "bytes": b, "seconds": 14 * 5e-6 + 1.75 * b / 300e9}
                           for b in (4.0, 1e6, 1.6e7)],
           "host": {"link": [{"bytes": b, "to_host_s": b / 50e9, "to_device_s": b / 40e9} for b in (1.6e7, 2.6e8)],
                    "adamw_elements": 2**24, "adamw_s": 2**24 * 80 / 20e9}}
    cluster = profile_from_raw(raw, name="gpu-test", source="test", device_name="NVIDIA H200", memory=141e9,
                               known_peaks=dict(h200.device.peak_flops), host_memory=2e12)
    assert cluster.host.memory == 2e12
    assert cluster.host.link_bandwidth == pytest.approx(40e9)
    assert cluster.host.memory_bandwidth / cluster.devices_per_node == pytest.approx(20e9)
    assert Cluster.from_json(json.loads(json.dumps(cluster.to_json()))) == cluster
    assert profile_from_raw(dict(raw, host=None), name="gpu-test", source="test", device_name="x", memory=1e9,
                            known_peaks=None, host_memory=2e12).host is None


def test_cpu_profile_is_calibrated():
    cpu = get_cluster("cpu")
    assert cpu.backend == "gloo" and cpu.nodes == 1
    assert "autopar calibrate" in cpu.source
    assert math.isfinite(cpu.intra_node.bandwidth)


# --- the optimizer step of emitted programs -----------------------------------------------------

@pytest.mark.parametrize("optimizer, ops, nbytes", [("adamw", 9, 80), ("adam", 8, 72), ("sgd", 1, 12),
                                                    ("sgd-momentum", 3, 32), ("adamw-fused", 1, 28),
                                                    ("sgd-momentum-fused", 1, 20)])
@pytest.mark.parametrize("cluster", ["cpu", "dgx-a100"])
def test_optimizer_step_is_torch_optims_passes(optimizer, ops, nbytes, cluster):
    """torch.optim runs each op of its update as a pass over the tensors (AdamW:
    80 bytes per fp32 element, not the 28 of one fused read-modify-write,
    ``adamw-fused``); on CPU ranks it launches them parameter by parameter.
    Both books price it with the same function (cost_models/optimizer.py)."""
    import torch
    from torch import nn
    import autopar
    from autopar.cost_models.optimizer import FUSED_BYTES, OPTIMIZER_PASSES, OPTIMIZER_STATES
    assert set(OPTIMIZER_PASSES) | set(FUSED_BYTES) == set(OPTIMIZER_STATES)
    model = nn.Linear(1000, 1000, bias=False)
    plan = autopar.compile(model, (torch.randn(4, 1000), torch.randn(4, 1000)), mesh="2", cluster=cluster,
                           loss_fn=torch.nn.functional.mse_loss, optimizer=optimizer,
                           parameter_placements={"weight": ["R"]})
    dev = get_cluster(cluster).device
    launches = ops * dev.op_latency if cluster == "cpu" else 0.0
    assert plan.predicted["optimizer_s"] == pytest.approx(launches + 1e6 * nbytes / dev.streaming_bandwidth)


# --- overlap -----------------------------------------------------------------------------

@pytest.mark.parametrize("chunks", [1, 2, 4, 8])
def test_chunked_overlap_hides_all_but_one_chunk_of_the_shorter(chunks):
    """A collective of C seconds in n chunks pipelined with a GEMM of G: when
    the GEMM is the longer, C / n shows; when the collective is, all of it
    but G (n - 1) / n; one chunk hides nothing."""
    from autopar.cost_models.overlap import chunked_overlap
    assert chunked_overlap(2.0, 8.0, chunks) == pytest.approx(2.0 / chunks)
    assert chunked_overlap(8.0, 2.0, chunks) == pytest.approx(8.0 - 2.0 * (chunks - 1) / chunks)
    assert chunked_overlap(3.0, 0.0, chunks) == pytest.approx(3.0) and chunked_overlap(0.0, 5.0, chunks) == 0.0


def test_exposed_sync_is_the_running_sum_and_shared_traffic_adds_to_it():
    """Syncs launched as backward reaches each position hide under the
    compute of the positions before it (timeline.SyncWindow's bound on a
    chain); traffic that takes the same link (``busy``) adds to what must
    cross it, second for second once the link is what bounds."""
    from autopar.cost_models.overlap import exposed_sync
    assert exposed_sync([1.0, 1.0, 1.0], [5.0, 5.0, 5.0]) == pytest.approx(1.0)  # the first layer's: nothing left
    assert exposed_sync([4.0, 4.0, 4.0], [1.0, 1.0, 1.0]) == pytest.approx(12.0 - 2.0)
    assert exposed_sync([4.0, 4.0, 4.0], [1.0, 1.0, 1.0], busy=3.0) == pytest.approx(12.0 - 2.0 + 3.0)
    with pytest.raises(ValueError):
        exposed_sync([1.0], [])



# --- buckets: a parameter's gathers and gradient reductions as the program runs them ----------------------

def _mlp_plan(placement: list, cluster: str = "cpu"):
    """The runtime benchmark's MLP (benchmarks/runtime_vs_torch.py: 256 wide, 4 layers, batch 2048) as a hand
    plan on 4 ranks, every parameter pinned to ``placement`` (["R"]: data parallel; ["S(0)"]: ZeRO-2;
    ["S(0)", "regather"]: ZeRO-3), the batch split."""
    import importlib.util

    from autopar.pinned import compile_pinned
    spec = importlib.util.spec_from_file_location("mlp_example", "examples/mlp.py")
    mlp = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mlp)
    model, inputs, loss = mlp.make(batch=2048, hidden=256, d_in=256, d_out=256, layers=4)
    plan = compile_pinned(model, inputs, mesh="4", cluster=cluster, loss_fn=loss,
                          parameter_placements={fqn: placement for fqn, _ in model.named_parameters()},
                          input_placements={0: ["S(0)"], 1: ["S(0)"]})
    return model, plan


def _parameter_moves(plan, phase: str, kind: str) -> list:
    return [c for c in plan.collectives if c["phase"] == phase and c["kind"] == kind
            and c["tensor"] in plan.parameters]


@pytest.mark.parametrize("placement, moves", [
    (["R"], [("backward", "all_reduce")]),
    (["S(0)"], [("forward", "all_gather"), ("backward", "reduce_scatter")]),
])
def test_bucketed_collectives_share_one_call(placement, moves):
    """Each of a parameter's bucketed collectives costs its bytes and its bytes' share of one call
    (graph_costs.bucketed) in a bucket of the model's parameters: DDP's one all-reduce of the MLP's
    1 MiB of gradients (FSDP2's one gather and one reduce-scatter), not one call per tensor."""
    from autopar.cost_models.collectives import launch_time
    model, plan = _mlp_plan(placement)
    links = axis_links(get_cluster("cpu"), (4,))[0]
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    for phase, kind in moves:
        listed = _parameter_moves(plan, phase, kind)
        assert len(listed) == 8  # four weights and four biases
        launch = launch_time(Collective(kind), links)
        for c in listed:
            whole = collective_time(Collective(kind), c["bytes"], links)
            assert c["seconds"] == pytest.approx(whole - launch * (1 - c["bytes"] / model_bytes), rel=1e-12)
        bytes_only = sum(collective_time(Collective(kind), c["bytes"], links) - launch for c in listed)
        assert sum(c["seconds"] for c in listed) == pytest.approx(bytes_only + launch, rel=1e-9)  # one call
    # the ILP priced the calls as the plan does (its objective leaves out the step's fixed overhead)
    step_overhead = get_cluster("cpu").device.step_overhead
    assert plan.solver["objective"] + step_overhead == pytest.approx(plan.predicted["step_time_s"], rel=1e-6)


def test_parameters_beyond_a_bucket_pay_a_call_per_bucket():
    """Past 25 MiB of parameters each pays its share of a full bucket's call: n bytes, n / 25 MiB calls."""
    from autopar.cost_models.collectives import BUCKET_BYTES, launch_time
    from autopar.cost_models.graph_costs import CostContext, bucketed
    from autopar.cost_models.resharding import Move
    ctx = CostContext.make((4,), get_cluster("cpu"))
    launch = launch_time(Collective.ALL_REDUCE, ctx.links[0])
    moves = [Move(Collective.ALL_REDUCE, 0, n, collective_time(Collective.ALL_REDUCE, n, ctx.links[0]))
             for n in (10 * 2**20, 40 * 2**20)]
    priced = bucketed(moves, "backward", float(BUCKET_BYTES), ctx)
    assert priced[0].seconds == pytest.approx(moves[0].seconds - launch * (1 - 10 / 25), rel=1e-12)
    assert priced[1].seconds == moves[1].seconds  # a tensor beyond the cap is a bucket of its own


def test_a_regathered_modules_parameters_share_one_call():
    """ZeRO-3 buckets stay within a module (codegen, as FSDP2 shards per module): a module's weight and
    bias pay one call between them in each gather and reduce-scatter."""
    from autopar.cost_models.collectives import launch_time
    model, plan = _mlp_plan(["S(0)", "regather"])
    links = axis_links(get_cluster("cpu"), (4,))[0]
    modules = {fqn.rpartition(".")[0] for fqn, _ in model.named_parameters()}
    for phase, kind in (("forward", "all_gather"), ("recompute", "all_gather"), ("backward", "reduce_scatter")):
        listed = _parameter_moves(plan, phase, kind)
        assert {c["tensor"].rpartition(".")[0] for c in listed} == modules
        for module in modules:
            mine = [c for c in listed if c["tensor"].rpartition(".")[0] == module]
            bytes_only = sum(collective_time(Collective(kind), c["bytes"], links) for c in mine) \
                - len(mine) * launch_time(Collective(kind), links)
            assert sum(c["seconds"] for c in mine) == pytest.approx(
                bytes_only + launch_time(Collective(kind), links), rel=1e-9)


def test_a_prefetched_gather_is_exposed_by_what_the_compute_since_the_gather_before_leaves():
    """timeline.GatherWindow: the first gather point waits for its gathers whole; each later one's all-gather
    started where the point before gathered, so the forward compute from that point up to this one hides it."""
    from types import SimpleNamespace

    from autopar.timeline import GatherWindow
    window = GatherWindow(SimpleNamespace(nodes=dict.fromkeys("abcdef")))
    for name, seconds in zip("abcdef", (1.0, 1.5, 0.2, 5.0, 0.5, 0.1)):
        window.compute(name, None, seconds)
    window.gather("b", None, 3.0)
    window.gather("d", None, 2.0)  # hidden by b and c: 1.7 s
    window.point("e")  # a point with no gather chosen: later ones start there
    window.gather("f", None, 0.4)  # hidden by e alone
    assert window.exposed() == pytest.approx(3.0 + (2.0 - 1.7) + 0.0)
    window.gather("f", None, 0.3)
    assert window.exposed() == pytest.approx(3.0 + 0.3 + (0.7 - 0.5))


def test_zero3_gathers_in_forward_are_priced_prefetched_where_the_cluster_overlaps():
    """The emitted program starts each ZeRO-3 module's all-gather where the module before it is gathered
    (codegen ``_prefetch``); on a cluster that runs collectives under compute the plan and the ILP price
    the forward gathers at what the compute between leaves exposed (at least the first module's), and on one
    that does not (gloo on CPU ranks) whole. Between the two the step differs by exactly the hidden gathers
    and the hidden gradient sync."""
    model, plan = _mlp_plan(["S(0)", "regather"], cluster="dgx-a100")
    p = plan.predicted
    gathers = _parameter_moves(plan, "forward", "all_gather")
    first = [c for c in gathers if c["tensor"].startswith("layers.0.")]
    assert len(gathers) == 8 and len(first) == 2
    assert p["prefetched_gather_s"] == pytest.approx(sum(c["seconds"] for c in gathers), rel=1e-9)
    assert sum(c["seconds"] for c in first) <= p["prefetched_gather_exposed_s"] * (1 + 1e-9)
    assert p["prefetched_gather_exposed_s"] < p["prefetched_gather_s"]  # some hidden under the MLP's GEMMs
    step_overhead = get_cluster("dgx-a100").device.step_overhead
    assert plan.solver["objective"] + step_overhead == pytest.approx(p["step_time_s"], rel=1e-6)
    serial = dataclasses.replace(get_cluster("dgx-a100"), overlap_grad_sync=False)
    assert isinstance(serial, Cluster)
    _, flat = _mlp_plan(["S(0)", "regather"], cluster=serial)
    q = flat.predicted
    assert q["prefetched_gather_s"] == q["prefetched_gather_exposed_s"] == 0.0
    hidden = (p["prefetched_gather_s"] - p["prefetched_gather_exposed_s"]) + (p["grad_sync_s"] - p["grad_sync_exposed_s"])
    assert q["step_time_s"] - p["step_time_s"] == pytest.approx(hidden, rel=1e-6)
    assert flat.solver["objective"] + step_overhead == pytest.approx(q["step_time_s"], rel=1e-6)


def test_pipeline_stages_price_their_once_per_step_reductions_in_buckets():
    """A pipeline stage reduces its accumulated gradients once per step in buckets
    (gradsync.GradAccumulation.reduce), so the stage ILP prices them as the flat program's: each
    parameter's all-reduce its bytes and its bytes' share of one call in a bucket of the model's
    parameters; the small GPT's stages pay one call between them, not one per parameter (on links
    nearly free, where the stages split their batch over dp)."""
    from autopar.cost_models.collectives import axis_links, launch_time
    from autopar.pipeline import compile_pipelined
    from autopar.runtime import load_factory
    FAST = "tests/fixtures/fastnet.json"
    model, inputs, loss = load_factory("examples/gpt.py:small")
    plan = compile_pipelined(model, inputs, mesh="pp=2,dp=2", cluster=FAST, loss_fn=loss, microbatches=4,
                             schedule="1f1b")
    once = [c for c in plan.collectives if c["gradient_sync"] and c["per_step"] == 1 and c["kind"] == "all_reduce"]
    assert len(once) > 8, plan.collectives
    link = axis_links(get_cluster(FAST), (2, 2))[1]
    launch = launch_time(Collective.ALL_REDUCE, link)
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    bytes_only = sum(collective_time(Collective.ALL_REDUCE, c["bytes"], link) - launch for c in once)
    shares = sum(c["bytes"] for c in once) / model_bytes
    assert sum(c["seconds"] for c in once) == pytest.approx(bytes_only + launch * shares, rel=1e-9)
    assert shares <= 1 + 1e-9


def test_data_parallelism_outside_a_pipeline_syncs_the_stage_in_buckets():
    """The pipeline search prices the replicas' sync as the pipeline runtime runs it (ZeRO-1,
    gradsync.OptimizerShard): the stage's gradients reduce-scattered and its parameters all-gathered as
    one flat buffer cut in Megatron-Core's buckets (max(40M, 1M x dp) elements), ceil(bytes / bucket)
    calls each, however many tensors; larger groups take larger buckets."""
    from autopar.cost_models.collectives import axis_links, step_bucket_bytes
    from autopar.pipeline.stages import _outer_sync
    link = axis_links(get_cluster("dgx-a100"), (4, 64, 4))[1]
    bucket = step_bucket_bytes(64, 2)
    assert bucket == 64e6 * 2 and step_bucket_bytes(8, 4) == 40e6 * 4
    nbytes = 3.5 * bucket
    buckets = [bucket] * 3 + [0.5 * bucket]
    expected = sum(collective_time(Collective.REDUCE_SCATTER, b, link) + collective_time(Collective.ALL_GATHER, b, link)
                   for b in buckets)
    assert _outer_sync(nbytes, link, bucket) == pytest.approx(expected, rel=1e-9)
    assert _outer_sync(nbytes, link, bucket) > collective_time(Collective.ALL_REDUCE, nbytes, link)  # 8 calls, not 1
    assert _outer_sync(nbytes, link, bucket / 4) > _outer_sync(nbytes, link, bucket)
    assert _outer_sync(0.0, link, bucket) == 0.0


def test_a_pipeline_steps_sync_holds_one_bucket_besides_the_gradients():
    """The end-of-step sync copies one bucket at a time (gradsync.in_buckets), so the stage search charges
    a device one bucket of its largest sync group (or its gradients, if fewer) next to the optimizer
    step's temporaries, not a copy of every gradient."""
    from autopar.cost_models.collectives import step_bucket_bytes
    from autopar.cost_models.graph_costs import CostContext
    from autopar.mesh import Mesh
    from autopar.pipeline.pricing import Profile
    from autopar.pipeline.stages import _sync_temp
    cluster = get_cluster("dgx-a100")
    prof = Profile([], [], set(), Mesh((4,), ("tp",)), 1, ctx=CostContext.make((4,), cluster, precision="bf16"))
    assert _sync_temp(prof, 1e9, 64) == pytest.approx(step_bucket_bytes(64, 2) * (1 + 1 / 64))
    assert _sync_temp(prof, 1e7, 64) == pytest.approx(1e7 * (1 + 1 / 64))
    assert _sync_temp(prof, 1e9, 1) == pytest.approx(step_bucket_bytes(4, 2) * (1 + 1 / 4))  # over tp alone
    alone = Profile([], [], set(), Mesh((1,), ("tp",)), 1, ctx=prof.ctx)
    assert _sync_temp(alone, 1e9, 1) == 0.0  # nothing to reduce over
