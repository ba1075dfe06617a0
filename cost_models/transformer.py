"""Analytic cost of one training step of a GPT- or Llama-style transformer
under a hand-written plan (Megatron-style tensor, pipeline and data
parallelism), priced with the same primitives as compiled plans: ``op_time``
(cost_models/compute.py), ``axis_links`` and ``collective_time``
(cost_models/collectives.py).

What is counted, per GPU and per microbatch (1/cp of its tokens under context
parallelism):
- every GEMM of a layer (QKV, attention projection, MLP) and the attention core
  (unfused: QK^T and PV batched GEMMs, softmax and dropout over the s x s
  scores; or one FlashAttention kernel), forward, recomputation and backward;
- the element-wise kernels (layer norms, bias-dropout-add, GeLU/SwiGLU) as
  memory traffic; without sequence parallelism the layer norms and dropouts run
  on the full activation on every tensor-parallel rank;
- tensor-parallel all-reduces (Megatron: 2 forward, 2 backward per layer, plus
  2 when the forward is recomputed), or reduce-scatter + all-gather pairs with
  sequence parallelism;
- context parallelism's ring of keys and values, exposed where the
  attention it runs under does not cover it;
- pipeline send/recv per virtual stage and the bubble (p - 1) / v of a
  microbatch time (interleaved 1F1B, Narayanan et al. SC'21); stages may hold
  uneven layer counts (the first and last pinned), the slowest stage sets the
  pace of every microbatch;
- data-parallel gradient all-reduce / reduce-scatter (bucketed, overlapped
  with the last microbatch's backward when the plan says so), ZeRO parameter
  all-gathers, and the optimizer step as memory traffic.
Memory per GPU follows Rajbhandari et al. (ZeRO, SC'20) for model states and
Korthikanti et al. (MLSys'23) for activations.

FLOPs are counted as in the Megatron-LM papers: model FLOPs (the 72-coefficient
formula, used for MFU) and hardware FLOPs, which add the recomputed forward
(the 96-coefficient formula with full recomputation).

The kernels and FLOPs are cost_models/transformer_kernels.py's, the memory
cost_models/transformer_memory.py's; this module times them and adds up the step.
"""
from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass

from autopar.cost_models import optimizer as opt
from autopar.cost_models.cluster import Cluster
from autopar.cost_models.collectives import (
    BUCKET_BYTES, Algorithm, AxisLinks, Collective, axis_links, collective_time, flat_buffer_time,
    step_bucket_bytes,
)
from autopar.cost_models.kernels import Kernel
from autopar.cost_models.overlap import chunked_overlap, exposed_sync, prefetched, prefetched_chain
from autopar.cost_models.transformer_kernels import (attention_kernels, embedding_kernels, head_kernels, layer_kernels,
                                                     local_tokens, padded_vocab, step_flops)
from autopar.cost_models.transformer_memory import MemoryBreakdown, peak_memory, stage_params
from autopar.cost_models.transformer_plan import (EstimateError, Kernels, Recompute, TrainingPlan, TransformerConfig,
                                                  check_plan, stage_layers)


GRAD_BUCKET_BYTES = 25e6


"""Gradient bucket size, bytes: torch DDP's default bucket_cap_mb=25."""


# --- results -------------------------------------------------------------------


@dataclass(frozen=True)
class TimeBreakdown:
    """Where one step's time goes on the slowest pipeline stage; the fields sum to the step time."""

    compute_s: float
    """GEMMs, attention and element-wise kernels (forward, recomputation, backward)."""
    tp_comm_s: float
    """Exposed tensor-parallel collectives."""
    cp_comm_s: float
    """Exposed context-parallel key/value exchange (ring attention)."""
    pp_comm_s: float
    """Exposed pipeline send/recv."""
    dp_comm_s: float
    """Exposed data-parallel gradient reduction and ZeRO gathers."""
    bubble_s: float
    """Pipeline fill and drain."""
    optimizer_s: float
    """Optimizer step (memory-bound)."""

    @property
    def total_s(self) -> float:
        return (self.compute_s + self.tp_comm_s + self.cp_comm_s + self.pp_comm_s + self.dp_comm_s
                + self.bubble_s + self.optimizer_s)


@dataclass(frozen=True)
class StepEstimate:
    """Predicted cost of one training step."""

    step_time_s: float
    """Seconds per step."""
    tokens_per_s_per_gpu: float
    """Training tokens per second per GPU (global batch x sequence / step time / GPUs)."""
    tflops_per_gpu: float
    """Achieved model TFLOP/s per GPU (72-coefficient FLOPs: no recomputation counted)."""
    hardware_tflops_per_gpu: float
    """Achieved TFLOP/s per GPU counting recomputed FLOPs (96-coefficient with full recomputation)."""
    mfu: float
    """Model FLOPs utilisation: model FLOP/s over the GPUs' dense peak."""
    time: TimeBreakdown
    """Step time by component."""
    memory: MemoryBreakdown
    """Peak memory per GPU by component."""
    world_size: int
    """GPUs."""
    microbatches: int
    """Microbatches per pipeline per step."""
    stage_layers: tuple
    """Transformer layers on each pipeline stage."""
    context_parallel: int
    """GPUs each sequence is split over (cp)."""
    parameters: int
    """Model parameters."""
    memory_capacity_bytes: float
    """The device's memory, bytes."""
    caveat: str = ""
    """The cluster's caveat (Cluster.caveat): what its numbers are known to get wrong."""

    @property
    def peak_memory_bytes(self) -> float:
        return self.memory.total

    @property
    def fits_in_memory(self) -> bool:
        return self.peak_memory_bytes <= self.memory_capacity_bytes

    def to_json(self) -> dict:
        out = asdict(self)
        out["time"]["total_s"] = self.time.total_s
        out["memory"]["total"] = self.memory.total
        out["peak_memory_bytes"] = self.peak_memory_bytes
        out["fits_in_memory"] = self.fits_in_memory
        return out


# --- time -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Fabric:
    """The plan's mesh (pp, dp, cp, tp) laid on the cluster, and the all-reduce
    algorithm its backend picks (NCCL tunes between ring and tree; gloo is
    priced as a ring, the form calibration fits). ``dp`` is the group that
    reduces gradients: data x context parallel, contiguous in rank order."""

    pp: AxisLinks
    dp: AxisLinks
    cp: AxisLinks
    tp: AxisLinks
    algorithm: Algorithm
    cluster: Cluster

    @classmethod
    def make(cls, plan: "TrainingPlan", cluster: Cluster) -> "Fabric":
        pp, _, cp, tp = axis_links(cluster, plan.mesh_shape)
        grads = axis_links(cluster, (plan.pp, plan.dp * plan.cp, plan.tp))[1]
        return cls(pp, grads, cp, tp, Algorithm.BEST if cluster.backend == "nccl" else Algorithm.RING, cluster)

    def time(self, kind: Collective, nbytes: float, axis: str) -> float:
        return collective_time(kind, nbytes, getattr(self, axis), self.algorithm)


@dataclass(frozen=True)
class PassTimes:
    """Seconds of a group of kernels on one GPU for one microbatch."""

    forward: float
    recompute: float
    backward: float

    @property
    def total(self) -> float:
        return self.forward + self.recompute + self.backward

    def __add__(self, other: "PassTimes") -> "PassTimes":
        return PassTimes(self.forward + other.forward, self.recompute + other.recompute,
                         self.backward + other.backward)

    def __mul__(self, k: float) -> "PassTimes":
        return PassTimes(self.forward * k, self.recompute * k, self.backward * k)


def kernel_times(kernels: list[Kernel], plan: TrainingPlan, cluster: Cluster, recompute: bool) -> PassTimes:
    """Forward, recomputation and backward seconds of ``kernels``; ``recompute``
    says whether this group is recomputed under the plan's policy at all."""
    times = [k.seconds(cluster.device, plan.precision.value) for k in kernels]
    fwd = [f for f, _ in times]
    bwd = sum(b for _, b in times)
    rerun = 0.0
    if recompute and plan.recompute is Recompute.FULL:
        rerun = sum(fwd)
    elif recompute and plan.recompute is Recompute.SELECTIVE:
        rerun = sum(f for f, k in zip(fwd, kernels) if k.attention_core)
    return PassTimes(sum(fwd), rerun, bwd)


TP_OVERLAP_SPLITS = 4


"""Chunks a reduce-scatter overlapped with the GEMM before it is split into
(Transformer Engine's userbuffers, "pipeline" method, the default for
proj_fprop and fc2_fprop: num_splits 4); the all-gathers ("ring_exchange",
qkv_fprop, fc1_fprop, proj_dgrad, fc2_dgrad) go in tp chunks, one per peer
(transformer_engine/pytorch/module/base.py, initialize_ub, get_default_config)."""


TP_OVERLAP_SMS = 16


"""Multiprocessors a "pipeline" or "bulk" overlap takes from the GEMM beside
it (num_sm 16, with the GEMM launched on the rest: set_sm_margin; same
source); the ring exchanges copy with the copy engines (use_ce) on 1 SM."""


def tp_layer_comm(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric, gemms: dict | None = None,
                  device=None) -> PassTimes:
    """Exposed tensor-parallel collectives of one layer per microbatch: an
    all-reduce of the b x s x h activation after the attention and MLP blocks
    (forward) and before them (backward); with sequence parallelism each is a
    reduce-scatter plus an all-gather of the same buffer (Korthikanti et al.
    2022). With ``tp_comm_overlap`` (``gemms``: the layer's forward GEMM times
    by kernel name) each of those collectives is pipelined with the GEMM it
    feeds or drains (overlap.chunked_overlap): forward, the all-gathers before
    the QKV and MLP-in GEMMs in tp chunks and the reduce-scatters after the
    attention-out and MLP-out GEMMs in TP_OVERLAP_SPLITS; backward, the
    all-gathers of the output gradient before the row-parallel GEMMs' input
    gradients, and the reduce-scatters of the column-parallel GEMMs' input
    gradients beside their weight-gradient GEMMs. A GEMM that shares its
    multiprocessors with a reduce-scatter (TP_OVERLAP_SMS of
    Device.multiprocessors) runs that much slower, which is exposed too."""
    nbytes = plan.precision.elem_bytes * local_tokens(model, plan) * model.hidden
    if not plan.sequence_parallel:
        one = fabric.time(Collective.ALL_REDUCE, nbytes, "tp")
        rerun = 2 * one if plan.recompute is Recompute.FULL else 0.0
        return PassTimes(2 * one, rerun, 2 * one)
    ag, rs = (fabric.time(kind, nbytes, "tp") for kind in (Collective.ALL_GATHER, Collective.REDUCE_SCATTER))
    if not plan.tp_comm_overlap:
        fwd = bwd = 2 * (ag + rs)
    else:
        sms = getattr(device, "multiprocessors", 0)
        margin = TP_OVERLAP_SMS / (sms - TP_OVERLAP_SMS) if sms > TP_OVERLAP_SMS else 0.0
        t = plan.tp
        fwd = bwd = 0.0
        for into, out in (("qkv", "attention-out"), ("mlp-in", "mlp-out")):
            g_in, g_out = gemms[into], gemms[out]
            fwd += chunked_overlap(ag, g_in, t) + chunked_overlap(rs, g_out * (1 + margin), TP_OVERLAP_SPLITS) \
                + g_out * margin
            bwd += chunked_overlap(ag, g_out, t) + prefetched(rs, g_in * (1 + margin)) + g_in * margin
    rerun = fwd if plan.recompute is Recompute.FULL else 0.0
    return PassTimes(fwd, rerun, bwd)


def tp_head_comm(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric) -> PassTimes:
    """The vocab-parallel output layer: three all-reduces of b x s fp32 scalars in
    the cross entropy (max, sum, target logit), and the input-gradient all-reduce
    (sequence parallel: an all-gather forward, a reduce-scatter backward).
    Eager PyTorch has no vocabulary-parallel cross entropy: the logits are
    all-gathered for it (its gradient is sliced back, no collective)."""
    if plan.tp == 1:
        return PassTimes(0.0, 0.0, 0.0)
    tokens = local_tokens(model, plan)
    nbytes = plan.precision.elem_bytes * tokens * model.hidden
    if plan.kernels is Kernels.EAGER:
        scalars = fabric.time(Collective.ALL_GATHER, plan.precision.elem_bytes * tokens * padded_vocab(model, plan),
                              "tp")
    else:
        scalars = 3 * fabric.time(Collective.ALL_REDUCE, 4 * tokens, "tp")
    if plan.sequence_parallel:
        return PassTimes(scalars + fabric.time(Collective.ALL_GATHER, nbytes, "tp"), 0.0,
                         fabric.time(Collective.REDUCE_SCATTER, nbytes, "tp"))
    return PassTimes(scalars, 0.0, fabric.time(Collective.ALL_REDUCE, nbytes, "tp"))


def tp_embedding_comm(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric) -> PassTimes:
    """The vocab-parallel embedding: each rank looks up the tokens its share of
    the vocabulary holds and the partial sums are all-reduced (sequence
    parallel: reduce-scattered to the sequence shards, their gradient
    all-gathered back)."""
    if plan.tp == 1:
        return PassTimes(0.0, 0.0, 0.0)
    nbytes = plan.precision.elem_bytes * local_tokens(model, plan) * model.hidden
    if plan.sequence_parallel:
        return PassTimes(fabric.time(Collective.REDUCE_SCATTER, nbytes, "tp"), 0.0,
                         fabric.time(Collective.ALL_GATHER, nbytes, "tp"))
    return PassTimes(fabric.time(Collective.ALL_REDUCE, nbytes, "tp"), 0.0, 0.0)


def cp_layer_comm(model: TransformerConfig, plan: TrainingPlan, attention: PassTimes,
                  fabric: Fabric, raw: bool = False) -> PassTimes:
    """Context parallelism's ring attention in one layer per microbatch: cp - 1
    steps, each passing a chunk of keys and values (b s/cp kv_hidden/t each)
    to the next GPU while attention computes on the chunk in hand, so only
    what the attention (``attention``: its own times) leaves uncovered is
    exposed; backward passes the keys and values again and their gradients."""
    if plan.cp == 1:
        return PassTimes(0.0, 0.0, 0.0)
    chunk = 2 * plan.precision.elem_bytes * local_tokens(model, plan) * model.kv_hidden / plan.tp
    ring = (plan.cp - 1) * fabric.time(Collective.SEND_RECV, chunk, "cp")
    if raw:  # the ring's traffic, hidden or not
        return PassTimes(ring, ring if plan.recompute is not Recompute.NONE else 0.0, 2 * ring)
    exposed = lambda comm, under: max(0.0, comm - under)  # noqa: E731
    return PassTimes(exposed(ring, attention.forward),
                     exposed(ring, attention.recompute) if attention.recompute else 0.0,
                     exposed(2 * ring, attention.backward))


def pp_transfer(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric) -> float:
    """One send/recv of a microbatch's activation (or its gradient) between stages.

    With tp > 1 each rank sends its 1/t slice and the receiving group
    all-gathers it over the fast intra-node link (Megatron's scatter/gather
    optimisation); with sequence parallelism the activation is already sliced."""
    if plan.pp == 1:
        return 0.0
    nbytes = plan.precision.elem_bytes * local_tokens(model, plan) * model.hidden
    seconds = fabric.time(Collective.SEND_RECV, nbytes / plan.tp, "pp")
    if plan.tp > 1 and not plan.sequence_parallel:
        seconds += fabric.time(Collective.ALL_GATHER, nbytes, "tp")
    return seconds


@dataclass(frozen=True)
class StageTime:
    """One pipeline stage, one microbatch (all its virtual chunks)."""

    compute: PassTimes
    tp_comm: PassTimes
    pp_comm: float
    cp_comm: PassTimes = PassTimes(0.0, 0.0, 0.0)
    tp_hidden: PassTimes = PassTimes(0.0, 0.0, 0.0)
    """Tensor-parallel traffic that runs under the GEMMs (``tp_comm_overlap``):
    off the critical path, but on its link."""
    cp_hidden: PassTimes = PassTimes(0.0, 0.0, 0.0)
    """Context-parallel traffic that runs under the attention."""

    @property
    def total(self) -> float:
        return self.compute.total + self.tp_comm.total + self.cp_comm.total + self.pp_comm


def stage_times(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster, fabric: Fabric) -> list[StageTime]:
    """Per-microbatch time of every pipeline stage (the first adds the embedding, the last the output layer)."""
    layers = stage_layers(model, plan)
    kernels = layer_kernels(model, plan)
    layer = kernel_times(kernels, plan, cluster, recompute=True)
    gemms = {k.name: k.seconds(cluster.device, plan.precision.value)[0] for k in kernels if k.matmul}
    if "q" in gemms:  # eager: q, k, v as three GEMMs; SwiGLU's gate and up as two
        gemms["qkv"] = gemms["q"] + gemms["k"] + gemms["v"]
    if "mlp-gate" in gemms:
        gemms["mlp-in"] = gemms["mlp-gate"] + gemms["mlp-up"]
    layer_comm = tp_layer_comm(model, plan, fabric, gemms, cluster.device)
    tp_raw = tp_layer_comm(model, dataclasses.replace(plan, tp_comm_overlap=False), fabric)
    attention = kernel_times(attention_kernels(model, plan), plan, cluster, recompute=True)
    ring = cp_layer_comm(model, plan, attention, fabric)
    ring_raw = cp_layer_comm(model, plan, PassTimes(0.0, 0.0, 0.0), fabric, raw=True)
    embed = kernel_times(embedding_kernels(model, plan), plan, cluster, recompute=False)
    head = kernel_times(head_kernels(model, plan), plan, cluster, recompute=False)
    head_comm = tp_head_comm(model, plan, fabric)
    # Each virtual chunk waits for what it receives once forward (its input)
    # and once backward (its output's gradient) per microbatch; the first
    # chunk receives no input and the last no gradient (the send is the
    # receiver's wait, counted once: pipeline/stages.py prices a stage alike).
    transfer = pp_transfer(model, plan, fabric)
    out = []
    for i, n in enumerate(layers):
        compute, comm = layer * n, layer_comm * n
        if i == 0:
            compute, comm = compute + embed, comm + tp_embedding_comm(model, plan, fabric)
        if i == plan.pp - 1:
            compute, comm = compute + head, comm + head_comm
        hidden = lambda raw, exposed: PassTimes(*(max(0.0, a - b) for a, b in zip(  # noqa: E731
            (raw.forward, raw.recompute, raw.backward), (exposed.forward, exposed.recompute, exposed.backward))))
        p2p = (2 * plan.virtual_stages - (i == 0) - (i == plan.pp - 1)) * transfer
        out.append(StageTime(compute, comm, p2p, ring * n, hidden(tp_raw, layer_comm) * n, hidden(ring_raw, ring) * n))
    return out


# --- data parallelism and optimizer -------------------------------------------------------


def _grad_sync(kind: Collective, nbytes: float, fabric: Fabric) -> float:
    """Seconds to reduce ``nbytes`` of gradients over dp in GRAD_BUCKET_BYTES
    buckets (a share of a bucket for less than one)."""
    if nbytes <= 0:
        return 0.0
    if nbytes < GRAD_BUCKET_BYTES:
        return nbytes / GRAD_BUCKET_BYTES * fabric.time(kind, GRAD_BUCKET_BYTES, "dp")
    full, rest = divmod(nbytes, GRAD_BUCKET_BYTES)
    return full * fabric.time(kind, GRAD_BUCKET_BYTES, "dp") + (fabric.time(kind, rest, "dp") if rest else 0.0)


def _collectives(kind: Collective, tensors: list, e: int, plan: TrainingPlan, fabric: Fabric,
                 model_bytes: float = 0.0) -> float:
    """Seconds to gather or reduce ``tensors`` (parameters each) over dp: in
    eager PyTorch as a compiled plan prices them (graph_costs.bucketed), each
    tensor its bytes and its share of a call in a bucket of the stage's
    parameters (``model_bytes``) up to collectives.BUCKET_BYTES (a ZeRO-3
    kernel's tensors: of their module's bytes, one call between them); in
    GRAD_BUCKET_BYTES buckets where the kernels are Megatron-LM's."""
    if plan.kernels is not Kernels.EAGER:
        return _grad_sync(kind, sum(tensors) * e, fabric)
    bucket = min(BUCKET_BYTES, sum(tensors) * e if plan.zero == 3 else model_bytes) or BUCKET_BYTES
    launch = fabric.time(kind, 1.0, "dp")
    return sum(fabric.time(kind, k * e, "dp") - launch * (1.0 - min(1.0, k * e / bucket)) for k in tensors)


def _flat_buffer(kind: Collective, nbytes: float, plan: TrainingPlan, fabric: Fabric) -> float:
    """Seconds for ``nbytes`` as one flat buffer cut in ``step_bucket_bytes``
    pieces, one blocking collective each (the pipeline runtime's end-of-step
    sync, gradsync.in_buckets), priced on the fabric's dp link."""
    return flat_buffer_time(lambda b: fabric.time(kind, b, "dp"), nbytes,
                            step_bucket_bytes(plan.dp * plan.cp, plan.precision.elem_bytes))


def _flat_program(plan: TrainingPlan) -> bool:
    """Whether eager kernels run as autopar's flat program (one stage, one
    microbatch), which gathers each ZeRO weight where it is used; otherwise
    as its pipeline runtime, which reduces a stage's gradients after the
    last microbatch and gathers its ZeRO-1 shards once per step, blocking,
    in buckets of the flat buffer (``_flat_buffer``)."""
    return plan.kernels is Kernels.EAGER and plan.pp == 1 and plan.microbatches == 1


def _param_chain(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster) -> tuple[list, list, list]:
    """(the weight tensors' parameters, backward seconds, forward seconds) of the first pipeline
    stage's kernels in forward order, one microbatch: each weight GEMM's
    matrix and bias, each norm's scale and shift, the embedding's tables,
    the output layer's own weights (a tied one's gradient joins the
    embedding's). A gradient is made, and can be reduced, once its
    kernel's backward has run; the kernels before it are what is left to
    hide it (overlap.exposed_sync)."""
    t, h = plan.tp, model.hidden
    device, dtype = cluster.device, plan.precision.value
    norm = h if model.swiglu else 2 * h
    bias = model.biases

    def weights(k: Kernel) -> list:
        """The weight tensors a kernel reads: a GEMM's matrix and bias, a norm's scale and shift."""
        if k.matmul and not k.attention_core and len(k.shape) == 4 and k.name != "logits":
            _, _, rows, cols = k.shape
            return [rows * cols] + ([cols] if bias else [])
        return [h] * (norm // h) if "norm" in k.name else []

    params, seconds, forward = [], [], []

    def timed(k: Kernel, recomputed: bool) -> None:
        """The kernel's forward seconds, and its backward's (with the forward again where recomputed)."""
        f, b = k.seconds(device, dtype)
        forward.append(f)
        seconds.append(b + (f if recomputed else 0.0))

    full = plan.recompute is Recompute.FULL
    table = padded_vocab(model, plan) * h / t
    for i, k in enumerate(embedding_kernels(model, plan)):
        params.append([table] if i == 0 else [])
        timed(k, False)
    if not model.swiglu:  # learned positions
        params[1 if len(params) > 1 else 0].append(model.seq * h)
    layer = layer_kernels(model, plan)
    for _ in range(stage_layers(model, plan)[0]):
        for k in layer:
            params.append(weights(k))
            timed(k, full or (plan.recompute is Recompute.SELECTIVE and k.attention_core))
    if plan.pp == 1:
        for k in head_kernels(model, plan):
            params.append(weights(k) if "norm" in k.name else
                          ([table] if k.name == "logits" and model.untied_embeddings else []))
            timed(k, False)
    return params, seconds, forward


def dp_exposed(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric, stage: StageTime) -> float:
    """Exposed data-parallel communication of one step on the first stage (the
    last to finish its backward).

    ZeRO 0: all-reduce the gradients; 1-2: reduce-scatter them, then all-gather
    the updated parameters after the optimizer step (under the next forward
    with ``overlap_param_gather``); 3: per microbatch, all-gather each layer's
    parameters for forward (and recompute) and backward and reduce-scatter its
    gradients (``zero3_exposed``). With ``overlap_grad_reduce`` each layer's
    gradients go in buckets as the last microbatch's backward makes them and
    hide under the backward compute of the layers before it
    (overlap.exposed_sync); the time another link's collectives stall the
    compute counts as hiding time (tensor parallelism on NVLink while the
    gradients cross nodes), and traffic on the same link takes its share of it
    (shared links: tensor-parallel collectives on one node's NVSwitch, or the
    pipeline's transfers between nodes). Without overlap the gradients go in
    one collective over the whole flat buffer after the backward (in autopar's
    pipeline runtime, that buffer in ``step_bucket_bytes`` pieces: ``_flat_buffer``)."""
    e = plan.precision.elem_bytes
    if plan.dp * plan.cp == 1:
        return 0.0
    if plan.zero == 3:
        return zero3_exposed(model, plan, fabric, stage)
    params = stage_params(model, plan, 0)
    kind = Collective.ALL_REDUCE if plan.zero == 0 else Collective.REDUCE_SCATTER
    if plan.overlap_grad_reduce:
        pieces, bwd, _ = _param_chain(model, plan, fabric.cluster)
        syncs = [_collectives(kind, k, e, plan, fabric, params * e) for k in pieces]
        busy, stalled = _dp_link_traffic(plan, fabric, stage)
        busy_at = [b > 0 for b in bwd]  # other links' collectives stall the compute, not the sync, all along
        bwd = [b + stalled / max(1, sum(busy_at)) * at for b, at in zip(bwd, busy_at)]
        exposed = exposed_sync(syncs, bwd, busy)
    elif plan.kernels is Kernels.EAGER and not _flat_program(plan):
        exposed = _flat_buffer(kind, params * e, plan, fabric)
    else:
        exposed = fabric.time(kind, params * e, "dp")
    if plan.zero in (1, 2) and plan.kernels is Kernels.EAGER and not _flat_program(plan):
        return exposed + _flat_buffer(Collective.ALL_GATHER, params * e, plan, fabric)  # once per step, in buckets
    if plan.zero in (1, 2) and plan.kernels is Kernels.EAGER:  # each weight gathered where it is used,
        pieces = _param_chain(model, plan, fabric.cluster)[0]  # a recomputed layer's again for it
        again = 2 if plan.recompute is Recompute.FULL else 1
        return exposed + sum(_collectives(Collective.ALL_GATHER, k, e, plan, fabric, params * e)
                             * (again if inside else 1) for k, inside in zip(pieces, _in_layers(model, plan, pieces)))
    if plan.zero in (1, 2):
        gather = _grad_sync(Collective.ALL_GATHER, params * e, fabric)
        first = min(gather, fabric.time(Collective.ALL_GATHER, min(GRAD_BUCKET_BYTES, params * e), "dp"))
        exposed += max(first, prefetched(gather, stage.compute.forward)) if plan.overlap_param_gather else gather
    return exposed


def _dp_link_traffic(plan: TrainingPlan, fabric: Fabric, stage: StageTime) -> tuple[float, float]:
    """(seconds the data-parallel sync's link carries other traffic that runs
    under the compute, seconds other links' collectives stall the compute)
    in the last microbatch's backward. A collective on the critical path
    (tensor-parallel ones without overlap, the pipeline's transfers) stalls
    the compute: on another link the sync goes on meanwhile, which is hiding
    time; on the same link it does not, which is no hiding time. One that
    runs under the compute (tensor-parallel traffic overlapped with the
    GEMMs, context parallelism's ring under the attention) takes its share
    of its link: on the sync's, its seconds are the sync's to wait (several
    mesh axes driving one link at once)."""
    busy = stalled = 0.0
    for axis, exposed, hidden in (
            ("tp", stage.tp_comm.backward + stage.tp_comm.recompute, stage.tp_hidden.backward + stage.tp_hidden.recompute),
            ("cp", stage.cp_comm.backward + stage.cp_comm.recompute, stage.cp_hidden.backward + stage.cp_hidden.recompute),
            ("pp", stage.pp_comm / 2, 0.0)):
        if fabric.dp.shares_link(getattr(fabric, axis)):
            busy += hidden
        else:
            stalled += exposed
    return busy, stalled


def zero3_exposed(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric, stage: StageTime) -> float:
    """ZeRO-3's exposed gathers and reductions on the first stage: per layer
    and microbatch an all-gather of its weights for forward, another for
    backward (which a recomputed forward shares), and a reduce-scatter of its
    gradients. With ``overlap_param_gather`` each is prefetched one layer
    ahead, under the compute of the layer before (FSDP's forward and backward
    prefetch); in backward the all-gather and the reduce-scatter of the layer
    behind cross the same link at once. Without it the gathers block the
    compute that needs them and only the reduce-scatters hide, behind the
    backward compute left to run (``exposed_sync``), as autopar's runtime
    runs them. At fixed global batch the bytes per GPU do not shrink as data
    parallelism grows while the compute per GPU does, so past the point
    where they cross the step stops shrinking: the communication floor."""
    e = plan.precision.elem_bytes
    n = stage_layers(model, plan)[0]
    if plan.overlap_param_gather:  # a layer's weights in one gather, one layer ahead (FSDP's unit: a block)
        sharded, replicated = model.layer_params()
        layer = (sharded / plan.tp + replicated) * e
        g, r = fabric.time(Collective.ALL_GATHER, layer, "dp"), fabric.time(Collective.REDUCE_SCATTER, layer, "dp")
        fwd, bwd = stage.compute.forward / n, (stage.compute.backward + stage.compute.recompute) / n
        per_mb = n * (prefetched(g, fwd) + prefetched(g + r, bwd))
        rest = stage_params(model, plan, 0) * e - n * layer  # embedding and head: gathered first, reduced last
        per_mb += fabric.time(Collective.ALL_GATHER, rest, "dp") + fabric.time(Collective.REDUCE_SCATTER, rest, "dp")
        return plan.microbatches * per_mb
    pieces, bwd_chain, fwd_chain = _param_chain(model, plan, fabric.cluster)
    gathers = [_collectives(Collective.ALL_GATHER, k, e, plan, fabric) for k in pieces]
    scatter = [_collectives(Collective.REDUCE_SCATTER, k, e, plan, fabric) for k in pieces]
    recomputed = [inside and plan.recompute is Recompute.FULL for inside in _in_layers(model, plan, pieces)]
    return plan.microbatches * (_forward_gathers(gathers, fwd_chain, pieces, recomputed, fabric.cluster)
                                + sum(gathers)) + (plan.microbatches - 1) * sum(scatter) + exposed_sync(scatter, bwd_chain)


def _in_layers(model: TransformerConfig, plan: TrainingPlan, pieces: list) -> list:
    """Per kernel of ``_param_chain``: whether it is inside a transformer layer (not the embedding or head)."""
    before = len(embedding_kernels(model, plan))
    after = len(head_kernels(model, plan)) if plan.pp == 1 else 0
    return [before <= i < len(pieces) - after for i in range(len(pieces))]


def _forward_gathers(gathers: list, forward: list, pieces: list, recomputed: list, cluster: Cluster) -> float:
    """ZeRO-3's forward gathers as autopar's program runs them: each kernel's
    weights' all-gather started where the kernel before it with weights
    gathered its own, so under the forward compute from there up to it
    (overlap.prefetched_chain, timeline.GatherWindow: the planner's rule);
    inside a recomputed layer blocking, and all of them blocking where the
    cluster does not run collectives under compute."""
    if not cluster.overlap_grad_sync:
        return sum(gathers)
    chain, compute, since, blocking = [], [], 0.0, 0.0
    for g, f, weights, again in zip(gathers, forward, pieces, recomputed):
        if again:
            blocking += g
        elif weights:
            chain.append(g)
            compute.append(since)
            since = 0.0
        since += f
    return blocking + prefetched_chain(chain, compute)


def optimizer_time(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster) -> float:
    """The optimizer step on the largest stage's (ZeRO-sharded) parameters,
    as optimizer.step_seconds prices it for a compiled plan too (fp32 state;
    the fused update reads and writes each tensor once, torch.optim's
    default makes a pass per op)."""
    largest = max(stage_params(model, plan, i) for i in range(plan.pp))
    params = largest / (plan.dp * plan.cp if plan.zero >= 1 else 1)
    return opt.step_seconds(params, plan.optimizer, cluster.device, cluster.backend == "gloo")


# --- the estimate -----------------------------------------------------------------------


def nodes_for(plan: TrainingPlan, cluster: Cluster) -> int:
    """Nodes the plan's tp * cp * pp * dp GPUs fill: part of one, or whole nodes."""
    whole, part = divmod(plan.world, cluster.devices_per_node)
    if whole and part:
        raise EstimateError(
            f"{plan.degrees} = {plan.world} GPUs do not fill whole nodes of "
            f"devices_per_node({cluster.devices_per_node}) on cluster {cluster.name!r}, nor fit in one")
    return max(1, whole)


def estimate(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster, nodes: int | None = None) -> StepEstimate:
    """Predicted step time, throughput and memory of ``plan`` for ``model`` on
    ``nodes`` nodes of ``cluster`` (default: as many as its GPUs fill)."""
    nodes = nodes_for(plan, cluster) if nodes is None else nodes
    check_plan(model, plan, cluster, nodes)
    fabric = Fabric.make(plan, cluster)
    stages = stage_times(model, plan, cluster, fabric)
    slowest = max(stages, key=lambda st: st.total)
    m, p, v = plan.microbatches, plan.pp, plan.virtual_stages
    time = TimeBreakdown(
        compute_s=m * slowest.compute.total,
        tp_comm_s=m * slowest.tp_comm.total,
        cp_comm_s=m * slowest.cp_comm.total,
        pp_comm_s=m * slowest.pp_comm,
        dp_comm_s=dp_exposed(model, plan, fabric, stages[0]),
        bubble_s=(p - 1) / v * slowest.total,
        optimizer_s=optimizer_time(model, plan, cluster),
    )
    step = time.total_s
    model_flops, hardware_flops = step_flops(model, plan)
    n = plan.world
    return StepEstimate(
        step_time_s=step,
        tokens_per_s_per_gpu=plan.batch * model.seq / step / n,
        tflops_per_gpu=model_flops / step / n / 1e12,
        hardware_tflops_per_gpu=hardware_flops / step / n / 1e12,
        mfu=model_flops / step / n / cluster.device.flops(plan.precision.value),
        time=time,
        memory=peak_memory(model, plan),
        world_size=n,
        microbatches=m,
        stage_layers=stage_layers(model, plan),
        context_parallel=plan.cp,
        parameters=model.parameters(),
        memory_capacity_bytes=cluster.device.memory,
        caveat=cluster.caveat,
    )
