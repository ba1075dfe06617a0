"""Costs of a captured graph under each strategy: compute per node, resharding
per edge (forward and backward), and memory per device.

This is the one place that prices a plan; ``autopar compile`` uses it for the
ILP objective and for the plan's predictions."""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass, replace

import torch
from torch.distributed.tensor import Partial, Shard

from autopar.cost_models.cluster import Cluster
from autopar.cost_models.collectives import (
    BUCKET_BYTES, Collective, axis_links, collective_time, launch_time, step_bucket_bytes,
)
from autopar.cost_models.compute import op_time
from autopar.cost_models.kernels import FLASH_CAUSAL_WORK, Kernel, flash_attention, matmul_op, stream
from autopar.cost_models.optimizer import (  # noqa: F401  (OPTIMIZER_PASSES, OPTIMIZER_STATES: re-exported)
    OPTIMIZER_PASSES, OPTIMIZER_STATES, check_optimizer, param_bytes, step_seconds, step_temporary_bytes, update_bytes,
)
from autopar.errors import AutoparError
from autopar.cost_models.resharding import Move, grad_spec, producer_grad_spec, reads_in_place, transitions
from autopar.ir import Graph, Node, NodeKind
from autopar.passes.rules import get_rule
from autopar.passes.rules.attention import zigzag_axes
from autopar.passes.rules.experts import GROUPED_MM_FALLBACK, dispatch_axes
from autopar.passes.rules.indexing import routed_axes
from autopar.passes.rules.recurrent import RECURRENT
from autopar.passes.strategy import Strategy, shard_factor

PRECISIONS = ("fp32", "bf16", "fp16")


_aten = torch.ops.aten


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")


def op_flops(node: Node) -> float:
    """Forward FLOPs of one op on global shapes."""
    info = node.info
    if info is None:
        return 0.0
    out = info.outputs[0]
    numel = math.prod(out.shape) if out.shape else 1
    rule = get_rule(node.target)
    if rule is not None and rule.matmul:
        if node.target in RECURRENT:
            # every weight matrix (2-D; biases are 1-D) meets every token once
            tokens = math.prod(info.inputs[0].shape[:-1])
            return 2.0 * tokens * sum(math.prod(w.shape) for w in info.inputs[1:] if len(w.shape) == 2)
        if node.target is torch.ops.aten.bilinear.default:  # every output meets every (i, j) pair
            return 2.0 * numel * info.inputs[0].shape[-1] * info.inputs[1].shape[-1]
        if node.target is torch.ops.aten.scaled_dot_product_attention.default:
            # QK^T and PV: 2 * (2 * B H Sq Sk D)
            return 4.0 * _attention_scores(info) * info.inputs[0].shape[-1]
        contracted = info.inputs[0].shape[-1] if node.target is not torch.ops.aten.addmm.default \
            else info.inputs[1].shape[-1]
        if node.target is torch.ops.aten.baddbmm.default:
            contracted = info.inputs[1].shape[-1]
        return 2.0 * numel * contracted
    return float(numel)


def _attention_scores(info) -> float:
    """Score elements of a fused attention, QK^T's B H Sq Sk (global shapes)."""
    q, k = info.inputs[0].shape, info.inputs[1].shape
    return float(math.prod(q[:-1]) * k[-2])


def op_special(node: Node) -> float:
    """Special-function evaluations of one op on global shapes: fused
    attention's exponentials, one per score element."""
    if node.info is None or node.target is not torch.ops.aten.scaled_dot_product_attention.default:
        return 0.0
    return _attention_scores(node.info)


def op_bytes(node: Node) -> float:
    info = node.info
    if info is None:
        return 0.0
    return float(sum(m.nbytes for m in info.inputs) + sum(m.nbytes for m in info.outputs))


@dataclass
class CostContext:
    mesh_shape: tuple
    cluster: Cluster
    links: list  # list[AxisLinks]
    optimizer: str = "adamw"
    precision: str = "fp32"
    """Compute dtype: fp32, or bf16/fp16 mixed precision (fp32 master weights)."""
    offload: bool = True
    """Whether the planner may keep optimizer state on the host (where the
    cluster describes a host: ``can_offload``)."""
    stage: bool = False
    """Pricing a pipeline stage: its parameters' gradient all-reduces run
    once per step, after the microbatches, in ``step_bucket_bytes`` buckets
    (gradsync.GradAccumulation), not in backward in DDP's (``bucketed``)."""

    @property
    def can_offload(self) -> bool:
        return self.offload and self.cluster.host is not None

    @classmethod
    def make(cls, mesh_shape, cluster: Cluster, optimizer: str = "adamw", precision: str = "fp32",
             offload: bool = True, stage: bool = False) -> "CostContext":
        check_optimizer(optimizer)
        if precision not in PRECISIONS:
            raise AutoparError(f"precision {precision!r} is not one of {PRECISIONS}")
        return cls(tuple(mesh_shape), cluster, axis_links(cluster, tuple(mesh_shape)), optimizer, precision,
                   bool(offload), bool(stage))

    @property
    def elem_bytes(self) -> int:
        """Bytes of a floating element in the compute dtype."""
        return 4 if self.precision == "fp32" else 2

    def tensor_bytes(self, meta) -> float:
        """Bytes of a tensor in the compute dtype (floating tensors follow the precision)."""
        if self.precision != "fp32" and meta.dtype.is_floating_point:
            return meta.nbytes * 2 / max(1, meta.dtype.itemsize)
        return float(meta.nbytes)


def needs_grad(graph: Graph) -> set:
    """Nodes whose output has a gradient (they depend on a parameter, not
    through a ``detach``)."""
    out = set()
    for n in graph.nodes.values():
        if n.kind is NodeKind.PARAM or (n.kind is NodeKind.OP and n.target is not _aten.detach.default
                                        and any(i in out for i in n.inputs)):
            out.add(n.name)
    return out


def splits(strategy: Strategy, n_axes: int) -> tuple:
    """Per axis: does a replicated input get a Partial gradient? Yes where the
    op divides its work, or where its output is Partial (each rank's local
    gradient is then one summand)."""
    return tuple(strategy.splits(a) or isinstance(strategy.output[a], Partial) for a in range(n_axes))


def node_compute(node: Node, s: Strategy, ctx: CostContext, backward: bool) -> tuple[float, float]:
    """(forward seconds, backward seconds) of a node under strategy ``s``:
    its kernel (``node_kernel``) on the device, at the device's measured
    per-element rate where it has one for the op, plus the runtime's own
    cost per call and unwrapped input (Device.runtime_overhead)."""
    inputs = runtime_inputs(node)
    if inputs is None:
        return 0.0, 0.0
    dev = ctx.cluster.device
    overhead = dev.runtime_overhead + dev.input_overhead * inputs
    if node.kind is not NodeKind.OP or is_view(node):  # a view moves no bytes
        return overhead, overhead if backward else 0.0
    kernel, dtype = node_kernel(node, s, ctx)
    fwd, bwd = kernel.seconds(dev, dtype)
    op = op_name(node)
    if op in dev.element_time and not kernel.matmul:  # a CPU rank's measured rate per element
        elements = max(math.prod(m.shape) for m in (*node.info.inputs, *node.info.outputs)) / _work(s, ctx)
        fwd = op_time(0.0, kernel.fwd_bytes, dev, dtype, measured=dev.element_seconds(op, elements))
        bwd = op_time(0.0, kernel.bwd_bytes, dev, dtype, measured=dev.element_seconds(op, elements, backward=True))
    return fwd + overhead, (bwd + overhead) if backward else 0.0


def _work(s: Strategy, ctx: CostContext) -> int:
    """Devices a strategy divides an op's work over."""
    return math.prod(ctx.mesh_shape[a] for a in range(len(ctx.mesh_shape)) if s.splits(a))


def node_kernel(node: Node, s: Strategy, ctx: CostContext) -> tuple[Kernel, str]:
    """The kernel one device runs for op ``node`` under ``s`` (its share of
    the op's work), and the dtype it computes in. A GEMM (a rule marked
    matmul) is a ``kernels.matmul_op``; PyTorch's fused attention on GPUs
    runs FlashAttention-2's kernels (``kernels.flash_attention`` on the
    scores its busiest rank computes, ``attention_share``); every other op is
    one pass over its inputs and outputs forward and again backward."""
    rule = get_rule(node.target)
    dtype = ctx.precision if node.out.dtype.is_floating_point and ctx.precision != "fp32" \
        else _dtype_name(node.out.dtype)
    work = _work(s, ctx)
    nbytes = sum(ctx.tensor_bytes(m) for m in (*node.info.inputs, *node.info.outputs))
    if node.target is _aten.scaled_dot_product_attention.default:
        # the scores the busiest rank computes: causal attention skips the masked blocks (attention_share)
        share = attention_share(node, s, ctx.mesh_shape)
        kernel = flash_attention(_attention_scores(node.info) * share, node.info.inputs[0].shape[-1], nbytes,
                                 causal=False)
    elif node.target is _aten.embedding.default:
        # a lookup reads the rows it gathers and writes them; its backward
        # (embedding_dense_backward) writes the gradient of its whole local
        # table whatever share of the batch it looked up
        ms = ctx.mesh_shape
        table, indices = (ctx.tensor_bytes(m) / shard_factor(spec, ms)
                          for m, spec in zip(node.info.inputs[:2], s.inputs[:2]))
        out = ctx.tensor_bytes(node.out) / shard_factor(s.output, ms)
        return stream("embedding", 2 * out + indices, table + out + indices), dtype
    elif rule is not None and rule.matmul:
        kernel = matmul_op(op_name(node), op_flops(node), nbytes)
    else:
        kernel = stream(op_name(node), nbytes, nbytes, flops=op_flops(node))
    return kernel.scaled(work), dtype


def _causal(node: Node) -> bool:
    return node.target is _aten.scaled_dot_product_attention.default and node.info is not None \
        and bool(node.info.arg(5, "is_causal", False))


def _context_split(node: Node, s: Strategy, mesh_shape: tuple) -> tuple[int, int, tuple | None]:
    """Causal attention's queries' sequence split: (seq dim, ranks it is
    split over, the axes it runs balanced over or None: zigzag_axes)."""
    q = node.info.inputs[0]
    seq = q.ndim - 2
    cp = math.prod(mesh_shape[a] for a, p in enumerate(s.inputs[0]) if isinstance(p, Shard) and p.dim == seq)
    return seq, cp, zigzag_axes(s.inputs[0], seq, q.shape[seq] // cp, mesh_shape)


def attention_share(node: Node, s: Strategy, mesh_shape: tuple) -> float:
    """Of an op's FLOPs over its split (``op_flops`` counts every score of an
    attention), the share the busiest rank computes: 1, but for causal
    attention, which skips the masked score blocks (FLASH_CAUSAL_WORK); with
    its queries' sequence split over cp ranks in contiguous chunks the last
    rank computes (2cp - 1) / cp times the mean, balanced chunks the mean
    (passes/rules/attention.py, zigzag_axes; autopar/local_ops.py, _attention)."""
    if not _causal(node):
        return 1.0
    _, cp, axes = _context_split(node, s, mesh_shape)
    return FLASH_CAUSAL_WORK * (1.0 if cp == 1 or axes else (2 * cp - 1) / cp)


def op_moves(node: Node, s: Strategy, ctx: CostContext, backward: bool) -> tuple[list, list]:
    """(forward moves, backward moves) a strategy runs inside its op, which
    the plan lists with the op's node: batch norm's synchronised statistics
    (``_batch_norm_moves``), rows fetched by advanced indexing and sent to
    their experts (``_routed_index_moves``, ``_expert_parallel_moves``), and
    causal attention balanced over some
    axes (zigzag_axes) exchanges its query halves before the kernel and its
    output halves after it (an all-to-all over those axes each), in backward
    their gradients the other way. ``nbytes`` is the buffer over the group,
    as for other all-to-alls; the time is what each rank does, sending its
    chunk and receiving one (``SEND_RECV`` of the local bytes) on the
    slowest link of the group."""
    if node.kind is not NodeKind.OP:
        return [], []
    if node.target is _aten.batch_norm.default:
        return _batch_norm_moves(node, s, ctx, backward)
    if node.target in (_aten.index.Tensor, _aten._unsafe_index.Tensor):
        return _routed_index_moves(node, s, ctx, backward)
    if node.target is _aten._grouped_mm.default or str(node.target) == GROUPED_MM_FALLBACK:
        return _expert_parallel_moves(node, s, ctx, backward)
    if not _causal(node):
        return [], []
    seq, cp, axes = _context_split(node, s, ctx.mesh_shape)
    if not axes:
        return [], []
    moves = []
    for meta, spec in ((node.info.inputs[0], s.inputs[0]), (node.info.outputs[0], s.output)):
        local = ctx.tensor_bytes(meta) / shard_factor(spec, ctx.mesh_shape)
        seconds, slowest = max((collective_time(Collective.SEND_RECV, local, ctx.links[a]), a) for a in axes)
        moves.append(Move(Collective.ALL_TO_ALL, slowest, local * cp, seconds, axes if len(axes) > 1 else ()))
    return moves, (moves[::-1] if backward else [])


def _over(axes: tuple, ctx: CostContext, price) -> tuple[float, int]:
    """(seconds, the axis whose link is slowest) of a collective over ``axes``
    priced by ``price(link)`` on each of their links."""
    return max((price(ctx.links[a]), a) for a in axes)


def _routed_index_moves(node: Node, s: Strategy, ctx: CostContext, backward: bool) -> tuple[list, list]:
    """Advanced indexing that fetches rows from other ranks (passes/rules/
    indexing.py, routed_axes): one all-to-all of the result's rows, which
    for positions spread over the whole tensor come (n - 1) / n from other
    ranks, and in backward their gradients back."""
    axes = routed_axes(s.inputs[0], list(node.info.arg(1, "indices")), ctx.mesh_shape)
    if not axes:
        return [], []
    n = math.prod(ctx.mesh_shape[a] for a in axes)
    local = ctx.tensor_bytes(node.info.outputs[0]) / shard_factor(s.output, ctx.mesh_shape)
    seconds, slowest = _over(axes, ctx, lambda link: collective_time(Collective.ALL_TO_ALL, local, link))
    move = Move(Collective.ALL_TO_ALL, slowest, local * n, seconds, axes if len(axes) > 1 else ())
    return [move], ([move] if backward and node.info.inputs[0].dtype.is_floating_point else [])


def _expert_parallel_moves(node: Node, s: Strategy, ctx: CostContext, backward: bool) -> tuple[list, list]:
    """An expert-parallel grouped matmul (passes/rules/experts.py,
    dispatch_axes): its rows to their experts' ranks and the results back,
    two all-to-alls, and two in backward. How many rows move depends on the
    routing: under balanced routing a rank's piece of the sorted rows is its
    own experts' rows and none do (the token exchange proper is the
    indexing that sorts them, ``_routed_index_moves``), so each is priced at
    its launch (``launch_time``); imbalance adds bytes and compute on the
    busiest rank that no plan can know."""
    if len(node.info.inputs) < 3 or node.info.inputs[2].ndim != 1:  # a batched matmul: no offsets
        return [], []
    axes = dispatch_axes(s.inputs[0], s.inputs[1], ctx.mesh_shape)
    if not axes:
        return [], []
    seconds, slowest = _over(axes, ctx, lambda link: launch_time(Collective.ALL_TO_ALL, link))
    pair = [Move(Collective.ALL_TO_ALL, slowest, 0.0, seconds, axes if len(axes) > 1 else ())] * 2
    return pair, (pair if backward else [])


def _batch_norm_moves(node: Node, s: Strategy, ctx: CostContext, backward: bool) -> tuple[list, list]:
    """Training-mode batch norm over a split batch (or spatial dim):
    synchronised statistics, every rank's per-channel mean and sum of
    squared deviations all-gathered over the splitting axes (autopar/
    local_ops.py, _batch_norm), their gradients reduce-scattered in backward: one
    collective each way, over the flattening of those axes."""
    if not node.info.arg(5, "training", False):
        return [], []
    x = node.info.inputs[0]
    axes = tuple(a for a, p in enumerate(s.inputs[0])
                 if isinstance(p, Shard) and p.dim != 1 and ctx.mesh_shape[a] > 1)
    if not axes:
        return [], []
    channels = math.prod(ctx.mesh_shape[a] for a, p in enumerate(s.inputs[0]) if isinstance(p, Shard) and p.dim == 1)
    n = math.prod(ctx.mesh_shape[a] for a in axes)
    nbytes = n * 2 * x.shape[1] * x.dtype.itemsize / channels  # the gathered statistics of this rank's channels
    moves = []
    for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER)[: 2 if backward else 1]:
        seconds, slowest = _over(axes, ctx, lambda link: collective_time(kind, nbytes, link))
        moves.append(Move(kind, slowest, nbytes, seconds, axes if len(axes) > 1 else ()))
    return moves[:1], moves[1:]


def op_name(node: Node) -> str:
    """The ATen op's name without namespace or overload ("tanh", "_softmax")."""
    packet = getattr(node.target, "overloadpacket", None)
    return packet.__name__ if packet is not None else getattr(node.target, "__name__", str(node.target))


def runtime_inputs(node: Node) -> int | None:
    """How many DTensors the SPMD runtime unwraps when it runs ``node``, or
    None where it runs nothing: an op unwraps each tensor input; a parameter,
    buffer or input is one call with none (spmd.param / shard_input wrap it as a
    DTensor); a getitem, a constant or the output is no runtime call of its own."""
    if node.kind is NodeKind.OP:
        return None if node.target is operator.getitem else len(node.inputs)
    return 0 if node.kind in (NodeKind.PARAM, NodeKind.BUFFER, NodeKind.INPUT) else None


def runtime_passes(graph: Graph) -> tuple[int, int]:
    """(call passes, unwrapped-input passes) of one training step: how many
    times ``node_compute`` charges ``runtime_overhead`` and ``input_overhead``
    (every runtime call forward, and backward where its output has a gradient)."""
    grad = needs_grad(graph)
    calls = [(1 + (n.name in grad), k) for n in graph.nodes.values() if (k := runtime_inputs(n)) is not None]
    return sum(p for p, _ in calls), sum(p * k for p, k in calls)


VIEW_OPS = {
    _aten.view.default, _aten._unsafe_view.default, _aten.reshape.default, _aten.flatten.using_ints,
    _aten.unflatten.int, _aten.squeeze.dim, _aten.squeeze.dims, _aten.unsqueeze.default, _aten.expand.default,
    _aten.transpose.int, _aten.permute.default, _aten.t.default, _aten.alias.default, _aten.detach.default,
    _aten.slice.Tensor, _aten.select.int, _aten.narrow.default, _aten.split.Tensor,
    _aten.split_with_sizes.default, _aten.chunk.default, _aten.unbind.int, operator.getitem,
    _aten.view_as_complex.default, _aten.view_as_real.default,
}
"""Ops whose output shares its input's storage: they hold no memory of their own."""


SAVES_NOTHING = {
    _aten.add.Tensor, _aten.sub.Tensor, _aten.neg.default, _aten.cat.default, _aten.sum.dim_IntList,
    _aten.sum.default, _aten.mean.dim, _aten.mean.default, _aten.clone.default, _aten.contiguous.default,
    _aten._to_copy.default, _aten.to.dtype, _aten.broadcast_tensors.default, _aten.ne.Scalar,
    _aten.arange.default, _aten.arange.start, _aten.one_hot.default, _aten.zeros.default, _aten.ones.default,
    _aten.masked_fill.Scalar, _aten.where.self,
}
"""Ops whose backward needs none of their floating-point inputs or outputs
(derivatives.yaml: the gradient passes through, is negated, split or
broadcast; masked_fill and where keep only their boolean mask)."""
SAVES_OUTPUT = {
    _aten.relu.default, _aten.tanh.default, _aten.sigmoid.default, _aten.exp.default, _aten.rsqrt.default,
    _aten.sqrt.default, _aten.softmax.int, _aten._softmax.default, _aten.log_softmax.int,
    _aten._log_softmax.default,
}
"""Ops whose backward needs only their output (derivatives.yaml: relu, tanh,
sigmoid, exp, rsqrt, sqrt and softmax are differentiated through the result)."""
SAVES_INPUTS = {
    _aten.linear.default, _aten.mm.default, _aten.bmm.default, _aten.matmul.default, _aten.addmm.default,
    _aten.einsum.default, _aten.conv2d.default, _aten.embedding.default, _aten.gelu.default, _aten.silu.default,
    _aten.layer_norm.default, _aten.batch_norm.default, _aten.mul.Tensor, _aten.div.Tensor,
    _aten.pow.Tensor_Scalar, _aten.cross_entropy_loss.default, _aten.nll_loss.default, _aten.mse_loss.default,
    _aten.adaptive_avg_pool2d.default,
}
"""Ops whose backward needs their inputs but not their output (products,
GELU/SiLU, the norms: mean and rstd are per-row and small; cross entropy
keeps its log-softmax, the size of its input). Any other op is assumed to
keep its inputs and its output (an upper bound)."""
_PRODUCTS = {_aten.mul.Tensor, _aten.div.Tensor}
DROPOUT_MASK_BYTES = 1
"""aten.native_dropout keeps a bool mask, one byte per element, for backward."""


def saves_input(consumer: Node) -> bool:
    """Whether autograd keeps a consumer's (floating-point) inputs for its backward."""
    target = consumer.target
    if target in _PRODUCTS and len(consumer.inputs) < 2:
        return False  # a product with a Python number keeps nothing (derivatives.yaml: mul.Scalar)
    return consumer.kind is NodeKind.OP and target not in SAVES_NOTHING and target not in SAVES_OUTPUT \
        and target not in VIEW_OPS and target is not _aten.dropout.default


def saved_outputs(graph: Graph) -> dict:
    """Per node, the share of its output's bytes kept for backward: 1 when its
    own backward needs it or a consumer's does (through views, which share its
    storage), plus a bool mask's share for a dropout, 0 when nothing needs it
    (an add, an unused dropout output). A consumer that saves its input keeps
    the tensor it reads: the producer's own, or a resharded copy of it
    (``kept_outputs`` tells them apart)."""
    return _saved(graph)[0]


def kept_outputs(graph: Graph) -> tuple[dict, set]:
    """(per node, the share of its output kept whatever its consumers'
    placements; the nodes kept only for consumers that save their input,
    directly or through views). A node of the second kind is kept only if
    one of those consumers reads its output as it is: one that takes a
    resharded copy keeps the copy (a reduce-scattered partial sum is freed
    once scattered). A view of the second kind is priced where a consumer
    that saves it reads it in place: its storage is what it views, the
    producer's tensor or a resharded copy of it (logits gathered into the
    view cross entropy saves keep the gathered copy, not the shard), and a
    producer kept only through views is priced there, not again. Memory pricing
    counts it on those edges (``edge_memory`` with ``read``), once per
    producer (``SharedReshards.keeps``, the solver's shared copies)."""
    kept, read = _saved(graph)
    return {n: k - 1.0 if n in read else k for n, k in kept.items()}, read


def _saved(graph: Graph) -> tuple[dict, set]:
    grad = needs_grad(graph)
    consumers = graph.consumers()
    kept: dict = {}
    read: set = set()
    for name in reversed(list(graph.nodes)):
        node = graph.nodes[name]
        if node.kind is not NodeKind.OP or name not in grad:
            continue
        own = node.target not in SAVES_NOTHING and node.target not in SAVES_INPUTS \
            and node.target not in VIEW_OPS and node.target is not _aten.dropout.default
        users = [graph.nodes[c] for c, _ in consumers.get(name, []) if c in grad]
        by_view = any(kept.get(c.name, 0.0) and is_view(c) for c in users)
        by_saving = any(saves_input(c) for c in users)
        mask = _dropout_mask_share(node)
        if own or by_view or by_saving:
            kept[name] = 1.0 + mask
            if not own:  # kept for what reads it (through views too), as it reads it: priced on those edges
                read.add(name)
        elif mask:
            kept[name] = mask
    # a view shares its base's storage: priced where it is read only if its base is
    return kept, {name for name in read if not is_view(graph.nodes[name]) or storage(graph, name) in read}


def storage(graph: Graph, name: str) -> str:
    """The node whose storage ``name`` shares (itself unless it is a view)."""
    node = graph.nodes[name]
    while node.kind is NodeKind.OP and is_view(node) and node.inputs:
        node = graph.nodes[node.inputs[0]]
    return node.name


def is_view(node: Node) -> bool:
    """Whether an op's output shares its input's storage: a view, or a dropout
    that drops nothing (p = 0 or eval, where ATen returns its input)."""
    return node.target in VIEW_OPS or (node.target is _aten.dropout.default and not _dropout_mask_share(node))


def _dropout_mask_share(node: Node) -> float:
    """A training dropout with p > 0 keeps its mask (ATen's CPU dropout returns
    its input untouched for p = 0, keeping nothing)."""
    if node.target is not _aten.dropout.default or node.info is None:
        return 0.0
    if not node.info.arg(1, "p", 0.0) or not node.info.arg(2, "train", True):
        return 0.0
    return DROPOUT_MASK_BYTES / max(1, node.out.dtype.itemsize)


def memory_breakdown(node: Node, s: Strategy, ctx: CostContext, kept: float) -> dict:
    """Bytes per device this node holds over the step under strategy ``s``, by
    kind; ``kept`` is the share of its output kept for backward (``saved_outputs``)."""
    ms = ctx.mesh_shape
    if node.kind is NodeKind.PARAM:
        elements = math.prod(node.out.shape) / shard_factor(s.output, ms)
        held = {k: b * elements for k, b in param_bytes(ctx.precision, ctx.optimizer, node.out.dtype.itemsize).items()}
        if s.offload:  # on the host (host_bytes)
            held["optimizer"] = 0.0
        return held
    if node.kind in (NodeKind.BUFFER, NodeKind.CONSTANT, NodeKind.INPUT):
        return {"inputs": node.out.nbytes / shard_factor(s.output, ms)}
    if node.kind is NodeKind.OP and kept and not is_view(node):
        mask = min(kept, _dropout_mask_share(node))  # one byte per element whatever the precision
        priced = sum(ctx.tensor_bytes(m) / shard_factor(s.item(k), ms) for k, m in enumerate(node.outputs))
        return {"activations": (kept - mask) * priced + mask * node.out.nbytes / shard_factor(s.output, ms)}
    return {}


def optimizer_step_bytes(param_bytes_local: float, ctx: CostContext, itemsize: int = 4) -> float:
    """Temporaries of one optimizer step over parameters whose local
    weights take ``param_bytes_local`` (optimizer.step_temporary_bytes)."""
    elements = param_bytes_local / param_bytes(ctx.precision, ctx.optimizer, itemsize)["parameters"]
    return step_temporary_bytes(elements, ctx.precision, ctx.optimizer, itemsize)


def step_temporaries(node: Node, s: Strategy, ctx: CostContext) -> float:
    """``optimizer_step_bytes`` of one parameter's local shard (none on the
    device where its update runs on the host)."""
    if node.kind is not NodeKind.PARAM or s.offload:
        return 0.0
    return optimizer_step_bytes(memory_breakdown(node, s, ctx, 1.0)["parameters"], ctx, node.out.dtype.itemsize)


def optimizer_time(node: Node, s: Strategy, ctx: CostContext) -> float:
    """The optimizer's update of one parameter's local shard (fp32 masters
    under mixed precision), as ``optimizer.step_seconds`` prices it: per
    tensor launches on CPU ranks (gloo), where torch.optim loops over the
    parameters; on the host where the shard is offloaded."""
    if node.kind is not NodeKind.PARAM:
        return 0.0
    elements = math.prod(node.out.shape) / shard_factor(s.output, ctx.mesh_shape)
    if s.offload:
        return offload_time(elements, node.out.dtype.itemsize, ctx)
    return step_seconds(elements, ctx.optimizer, ctx.cluster.device, ctx.cluster.backend == "gloo")


def host_bytes(node: Node, s: Strategy, ctx: CostContext) -> float:
    """Host memory an offloaded parameter's shard takes: its optimizer state,
    and the host's copy of its values and of its gradient, which the update
    reads and writes there (autopar/runtime.py, OffloadOptimizer)."""
    if node.kind is not NodeKind.PARAM or not s.offload:
        return 0.0
    elements = math.prod(node.out.shape) / shard_factor(s.output, ctx.mesh_shape)
    kinds = param_bytes(ctx.precision, ctx.optimizer, node.out.dtype.itemsize)
    return elements * (kinds["optimizer"] + kinds["parameters"] + kinds["gradients"])


def offload_time(elements: float, itemsize: int, ctx: CostContext) -> float:
    """One step of an offloaded shard of ``elements``: its gradient to the
    host and its new values back over the device's host link, and
    torch.optim's update there (``OPTIMIZER_PASSES`` bytes per element
    through the node's host memory, shared by its devices). Priced on the
    step's critical path: the update needs the whole gradient and the next
    forward its result (ZeRO-Offload's one-step-delayed update, which hides
    it, changes the training and is not done). Where the cluster describes
    no host (a CPU rank's own memory), at the device's streaming bandwidth."""
    host, device = ctx.cluster.host, ctx.cluster.device
    kinds = param_bytes(ctx.precision, ctx.optimizer, itemsize)
    moved = elements * (kinds["gradients"] + kinds["parameters"])
    nbytes = update_bytes(ctx.optimizer)
    if host is None:
        return (moved + elements * nbytes) / device.streaming_bandwidth
    share = host.memory_bandwidth / ctx.cluster.devices_per_node
    return 2 * host.link_latency + moved / host.link_bandwidth + elements * nbytes / share


def node_memory(node: Node, s: Strategy, ctx: CostContext, kept: float) -> float:
    return sum(memory_breakdown(node, s, ctx, kept).values())


def produced(graph: Graph, src: str, consumer: Node, s: Strategy) -> tuple:
    """(placement, TensorMeta) of what the edge from ``src``, run under ``s``,
    carries to ``consumer``: its output, or the output a ``getitem`` takes."""
    if consumer.target is operator.getitem and consumer.item >= 0:
        return s.item(consumer.item), graph.nodes[src].outputs[consumer.item]
    return s.output, graph.nodes[src].outputs[0]


def edge_moves(src_spec: tuple, consumer: Strategy, index: int, meta, ctx: CostContext, backward: bool,
               bucket: float | None = None):
    """(forward moves, backward moves) on the edge into input ``index`` of a
    consumer; from a parameter, as its ``bucket`` runs them (``bucket_bytes``,
    ``bucketed``)."""
    nbytes = ctx.tensor_bytes(meta)
    fwd = transitions(src_spec, consumer.inputs[index], nbytes, ctx.mesh_shape, ctx.links)
    bwd = []
    if backward:
        bwd = transitions(input_grad_spec(consumer, index, len(ctx.mesh_shape)), producer_grad_spec(src_spec),
                          nbytes, ctx.mesh_shape, ctx.links)
    return bucketed(fwd, "forward", bucket, ctx), bucketed(bwd, "backward", bucket, ctx)


def bucket_bytes(graph: Graph, src: str, regather: bool, ctx: CostContext) -> float | None:
    """The bytes a parameter's collectives share buckets with, None for
    another value: the model's parameters (the program fills its buckets
    with them in order), a regathered (ZeRO-3) parameter's only its own
    module's (codegen keeps such buckets within a module, as FSDP2 shards
    per module). ``bucketed`` caps them at the bucket's size."""
    node = graph.nodes[src]
    if node.kind is not NodeKind.PARAM:
        return None
    model, modules = _param_bytes(graph, ctx)
    return (modules[src] if regather else model) or float(BUCKET_BYTES)


def _param_bytes(graph: Graph, ctx: CostContext) -> tuple:
    """(bytes of all the parameters, {parameter node: bytes of its module's parameters}), kept on the graph."""
    cached = graph.__dict__.get("_param_bytes")
    if cached is None or cached[0] != ctx.precision:
        total: dict = {}
        owner = {ph: fqn.rpartition(".")[0] for fqn, ph in graph.params.items()}
        for ph, module in owner.items():
            total[module] = total.get(module, 0.0) + ctx.tensor_bytes(graph.nodes[ph].out)
        cached = (ctx.precision, sum(total.values()), {ph: total[m] for ph, m in owner.items()})
        graph.__dict__["_param_bytes"] = cached
    return cached[1], cached[2]


def bucketed(moves: list, phase: str, bucket: float | None, ctx: CostContext) -> list:
    """A parameter's moves as the program runs them: its gathers in forward
    and its gradient reductions in backward are each one part of a bucket of
    ``bucket`` bytes (``bucket_bytes``) up to the program's cap (DDP's
    ``BUCKET_BYTES``; in a pipeline stage a once-per-step all-reduce's
    ``step_bucket_bytes``), one call per bucket. Each pays its
    bytes and the share of a call's fixed cost (``launch_time``: call
    overhead and link latencies) that its bytes are of the bucket, so the
    parameters of one bucket pay one call between them: linear in the
    choices, as the ILP needs, and exact where every parameter's collective
    of a phase is in it (fewer pay less than their bucket's call). Other
    moves are unchanged."""
    if bucket is None:
        return moves
    kinds = (Collective.ALL_GATHER,) if phase == "forward" else (Collective.ALL_REDUCE, Collective.REDUCE_SCATTER)

    def share(m) -> float:
        once = ctx.stage and m.kind is Collective.ALL_REDUCE
        cap = step_bucket_bytes(ctx.mesh_shape[m.axis], ctx.elem_bytes) if once else BUCKET_BYTES
        return min(1.0, m.nbytes / min(bucket, cap))

    return [replace(m, seconds=m.seconds - launch_time(m.kind, ctx.links[m.axis]) * (1.0 - share(m)))
            if m.kind in kinds else m for m in moves]


def input_grad_spec(consumer: Strategy, index: int, n_axes: int) -> tuple:
    """The placement of the gradient the consumer's backward makes for input ``index``."""
    return grad_spec(consumer.inputs[index], splits(consumer, n_axes))


def reshard_key(index: int, s: Strategy, n_axes: int, backward: bool) -> tuple:
    """What consumers of one producer share a reshard by: the placement they
    want and the placement their gradient comes back in. Codegen emits one
    reshard per producer and key, and the consumers' gradients meet there and
    go back in one collective, so it is paid once (the ILP, ``build_plan`` and
    the pipeline's stage pricing all group edges by this key)."""
    return s.inputs[index], grad_spec(s.inputs[index], splits(s, n_axes)) if backward else None


def shares_reshard(consumer: Node) -> bool:
    """Tuple items (``getitem``) are different tensors: each has its own reshard."""
    return consumer.target is not operator.getitem


class SharedReshards:
    """Walks a chosen plan's edges and says which of them pay for their reshard
    (the first consumer of each producer and ``reshard_key``) and what each
    adds to the resharded copy kept for backward (one copy per reshard, kept
    if any of its consumers keeps it)."""

    def __init__(self, n_axes: int):
        self.n_axes = n_axes
        self.paid: set = set()
        self.held: dict = {}

    def _key(self, consumer: Node, index: int, src: str, s: Strategy, backward: bool):
        if not shares_reshard(consumer):
            return None
        return src, reshard_key(index, s, self.n_axes, backward)

    def pays(self, consumer: Node, index: int, src: str, s: Strategy, backward: bool) -> bool:
        key = self._key(consumer, index, src, s, backward)
        if key is None:
            return True
        if key in self.paid:
            return False
        self.paid.add(key)
        return True

    def keeps(self, consumer: Node, index: int, src: str, src_spec: tuple, s: Strategy, backward: bool,
              nbytes: float) -> float:
        """The bytes this edge adds to the kept copies, given that it alone
        would keep ``nbytes`` (consumers that read the producer's own tensor
        keep that one tensor)."""
        key = (src, "as read") if reads_in_place(src_spec, s.inputs[index]) \
            else self._key(consumer, index, src, s, backward)
        if key is None:
            return nbytes
        before = self.held.get(key, 0.0)
        self.held[key] = max(before, nbytes)
        return self.held[key] - before


def replays(regather: bool, recomputed: bool, saved: bool) -> bool:
    """Whether an edge's forward collectives run again in backward: in a
    recomputed consumer, or for a regathered (ZeRO-3) parameter whose consumer
    would otherwise keep the gathered copy."""
    return recomputed or (regather and saved)


def edge_memory(src_spec: tuple, dst_spec: tuple, meta, ctx: CostContext, saved: bool, read: bool = False) -> float:
    """Bytes a consumer that saves its input (``saved``) keeps for backward
    on this edge: a resharded copy; or, reading the producer's own storage
    (``reads_in_place``), 0 unless the producer is kept only for such
    consumers (``read``, from ``kept_outputs``): then the producer's tensor."""
    if not saved:
        return 0.0
    if reads_in_place(src_spec, dst_spec):
        return ctx.tensor_bytes(meta) / shard_factor(src_spec, ctx.mesh_shape) if read else 0.0
    return ctx.tensor_bytes(meta) / shard_factor(dst_spec, ctx.mesh_shape)


def gathers(moves: list[Move]) -> bool:
    """Whether an edge's moves include an all-gather (a sharded tensor made whole)."""
    return any(m.kind is Collective.ALL_GATHER for m in moves)


def gather_transient(fwd: list[Move], dst_spec: tuple, meta, ctx: CostContext, regather: bool,
                     backward: bool) -> float:
    """Bytes alive for a moment in backward on an edge that gathers a sharded
    parameter: its gradient at the gathered size until the reduce-scatter
    shards it, plus the full copy gathered again for a regathered (ZeRO-3)
    parameter. One such edge is in flight at a time, so the plan's peak adds
    the largest, on top of the activations."""
    if not backward or not gathers(fwd):
        return 0.0
    return ctx.tensor_bytes(meta) / shard_factor(dst_spec, ctx.mesh_shape) * (2 if regather else 1)


def backward_working_set(graph: Graph, node: Node, s: Strategy, ctx: CostContext, grad: set) -> float:
    """Bytes alive for a moment while autograd runs one op's backward, on top
    of the activations still kept: the gradient of its output and the
    gradients it makes for its inputs, local under ``s``. Cross entropy is a
    log-softmax then an NLL loss (aten's composite), so its backward also
    holds the log-softmax's gradient, the size of its input. The plan's peak
    adds the largest (with ``gather_transient``'s)."""
    if node.kind is not NodeKind.OP or node.name not in grad or node.target in VIEW_OPS:
        return 0.0
    ms = ctx.mesh_shape
    total = ctx.tensor_bytes(node.out) / shard_factor(s.output, ms)
    for idx, src in enumerate(node.inputs):
        meta = graph.nodes[src].outputs[0]
        if src in grad and meta.dtype.is_floating_point:
            local = ctx.tensor_bytes(meta) / shard_factor(s.inputs[idx], ms)
            total += local * (2 if node.target is _aten.cross_entropy_loss.default else 1)
    return total


def gradient_transient(bwd: list[Move], src_spec: tuple, consumer: Strategy, index: int, meta,
                       ctx: CostContext) -> float:
    """Bytes alive during a consumer's backward on top of its working set when
    its input's gradient is resharded to the producer's placement (``bwd``,
    the edge's backward moves from ``edge_moves``): the new gradient the
    collectives make, and, where a tensor dim other than the first is
    all-gathered, the gathered buffer as well (DTensor gathers into a stack
    along dim 0, then concatenates along the sharded dim: both alive at
    once)."""
    if not bwd:
        return 0.0
    ms = ctx.mesh_shape
    g_in, g_out = input_grad_spec(consumer, index, len(ms)), producer_grad_spec(src_spec)
    made = ctx.tensor_bytes(meta) / shard_factor(g_out, ms)
    stacked = any(isinstance(a, Shard) and a.dim != 0 and not isinstance(b, Shard) and ms[axis] > 1
                  for axis, (a, b) in enumerate(zip(g_in, g_out)))
    return made * (2 if stacked else 1)


def param_transient(node: Node, s: Strategy, ctx: CostContext) -> float:
    """The most ``gather_transient`` can be for a parameter placed by ``s``: a
    full gradient on the axes it is sharded over (and a regathered copy)."""
    if node.kind is not NodeKind.PARAM or not any(isinstance(p, Shard) for p in s.output):
        return 0.0
    return ctx.tensor_bytes(node.out) * (2 if s.regather else 1)


def seconds(moves: list[Move]) -> float:
    return sum(m.seconds for m in moves)
