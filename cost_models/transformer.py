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
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from autopar.cost_models.cluster import Cluster
from autopar.cost_models.collectives import Algorithm, AxisLinks, Collective, axis_links, collective_time
from autopar.cost_models.compute import FLASH_CAUSAL_WORK, op_time
from autopar.cost_models.transformer_plan import (AttentionKernel, EstimateError, Recompute, TrainingPlan,
                                                  TransformerConfig, check_plan, stage_layers)


VOCAB_PAD = 128
"""Megatron pads the vocabulary to a multiple of 128 * tp (--make-vocab-size-divisible-by 128)."""
GRAD_BUCKET_BYTES = 25e6
"""Gradient bucket size, bytes: torch DDP's default bucket_cap_mb=25."""
FLASH1_SLOWDOWN = 2.0
"""FlashAttention's first generation takes twice FlashAttention-2's time: "around
2x speedup compared to FlashAttention" (Dao, FlashAttention-2, 2023, abstract;
25-40% of the A100's peak against 50-73%)."""
FLASH_BACKWARD_WORK = 2.5
"""FlashAttention backward / forward matmul work: 5 GEMMs against 2, since the
backward recomputes QK^T (Dao, FlashAttention-2, 2023, Sec. 3.1.2)."""
CROSS_ENTROPY_FWD_FP32_BYTES = 32
"""Bytes per logit beyond the 16-bit read in Megatron's vocab-parallel cross
entropy forward: an fp32 upcast, max subtraction, exp and normalisation pass
(4 fp32 reads + 4 fp32 writes)."""
CROSS_ENTROPY_BWD_FP32_BYTES = 8
"""Bytes per logit beyond the 16-bit gradient write in its backward (read the
saved fp32 softmax, write the fp32 gradient)."""


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
class MemoryBreakdown:
    """Bytes per GPU at the peak, on the stage that needs the most."""

    parameters: float
    """Training-precision parameters (ZeRO-3 shards them)."""
    gradients: float
    """Gradients (ZeRO-2/3 shard them)."""
    optimizer_states: float
    """fp32 master weights and Adam moments (ZeRO-1/2/3 shard them)."""
    activations: float
    """Activations saved for backward, for every microbatch in flight, plus the recomputation working set."""
    stage: int
    """Pipeline stage this breakdown is for."""

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer_states + self.activations


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


# --- FLOPs -----------------------------------------------------------------------

def step_flops(model: TransformerConfig, plan: TrainingPlan) -> tuple[float, float]:
    """(model FLOPs, hardware FLOPs) of one step of ``plan.batch`` sequences.

    For the GPT block these are exactly 72 B s l h^2 (1 + s/6h + V/12lh) and,
    with full recomputation, 96 B s l h^2 (1 + s/6h + V/16lh)."""
    per_seq = model.layers * model.layer_forward_flops() + model.head_forward_flops()
    model_flops = 3.0 * plan.batch * per_seq
    recomputed = {
        Recompute.NONE: 0.0,
        Recompute.SELECTIVE: model.layers * model.attention_core_flops(),
        Recompute.FULL: model.layers * model.layer_forward_flops(),
    }[plan.recompute]
    return model_flops, model_flops + plan.batch * recomputed


# --- per-GPU kernels of one microbatch ---------------------------------------------

@dataclass(frozen=True)
class Kernel:
    """One kernel of the forward pass and its backward, per GPU per microbatch."""

    name: str
    fwd_flops: float
    """FLOPs the forward kernel executes."""
    fwd_bytes: float
    """Bytes the forward kernel reads and writes."""
    bwd_flops: float
    """FLOPs of the backward kernels."""
    bwd_bytes: float
    """Bytes the backward kernels read and write."""
    matmul: bool
    """Runs on the GEMM units (at the device's GEMM efficiency)."""
    attention_core: bool = False
    """Part of the attention core (what selective recomputation reruns)."""
    shape: tuple = ()
    """A GEMM's (batch, m, k, n); FlashAttention's (sequences, query heads,
    key/value heads, sequence length, head dim): what a benchmark runs to time
    the kernel (benchmarks/kernel_times.py)."""
    special: float = 0.0
    """Special-function evaluations of the forward kernel, and again of its
    backward: FlashAttention's exponentials, one per score element computed
    (the backward recomputes the probabilities)."""
    slowdown: float = 1.0
    """Time over what the roofline gives it: a kernel generation known to be
    slower than the one the roofline's constants describe (FLASH1_SLOWDOWN)."""
    synchronous_mma: bool = False
    """Issues Ampere's tensor-core instructions (FlashAttention-1 and -2)."""
    overlap_special: bool = False
    """Runs its exponentials beside its GEMMs (FlashAttention-3)."""

    def seconds(self, device, dtype: str) -> tuple[float, float]:
        """(forward, backward) seconds on ``device`` in compute dtype ``dtype``."""
        return tuple(self.slowdown * op_time(flops, nbytes, device, dtype, matmul=self.matmul, special=self.special,
                                             synchronous_mma=self.synchronous_mma,
                                             overlap_special=self.overlap_special)
                     for flops, nbytes in ((self.fwd_flops, self.fwd_bytes), (self.bwd_flops, self.bwd_bytes)))


def _gemm(name: str, m: float, k: float, n: float, e: int, batch: float = 1, attention_core: bool = False) -> Kernel:
    """(m x k) @ (k x n); the backward is two GEMMs of the same size (input and weight gradients)."""
    flops = 2.0 * batch * m * k * n
    nbytes = float(e) * batch * (m * k + k * n + m * n)
    return Kernel(name, flops, nbytes, 2 * flops, 2 * nbytes, True, attention_core, (batch, m, k, n))


def _stream(name: str, fwd_bytes: float, bwd_bytes: float, attention_core: bool = False) -> Kernel:
    return Kernel(name, 0.0, fwd_bytes, 0.0, bwd_bytes, False, attention_core)


def local_tokens(model: TransformerConfig, plan: TrainingPlan) -> float:
    """Tokens of one microbatch on one GPU: its sequences' 1/cp share."""
    return plan.microbatch * model.seq / plan.cp


def layer_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """The kernels of one layer on one GPU for one microbatch.

    Element-wise kernels are Megatron-LM's fused ones; their bytes count each
    tensor read or written once (e bytes per element, 1 per dropout-mask
    element): layer norm y = f(x) and dx = f(dy, x); bias-dropout-add
    out = x + drop(y + b) writes the mask, its backward reads dy and the mask;
    bias-GeLU y = f(x), dx = f(dy, x); SwiGLU y = f(gate, up), (dgate, dup) =
    f(dy, gate, up)."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    h, f = model.hidden, model.ffn
    full = tokens * h / (t if plan.sequence_parallel else 1)  # elements of layer-norm / dropout tensors
    mask = 1 if model.dropout else 0  # dropout mask bytes per element
    norm = _stream("layernorm", 2 * e * full, 3 * e * full)
    residual = _stream("bias-dropout-add", (3 * e + mask) * full, (2 * e + mask) * full)
    if model.swiglu:
        act = _stream("swiglu", 3 * e * tokens * f / t, 5 * e * tokens * f / t)
    else:
        act = _stream("bias-gelu", 2 * e * tokens * f / t, 3 * e * tokens * f / t)
    return [
        norm,
        _gemm("qkv", tokens, h, (h + 2 * model.kv_hidden) / t, e),
        *attention_kernels(model, plan),
        _gemm("attention-out", tokens, h / t, h, e),
        residual,
        norm,
        _gemm("mlp-in", tokens, h, model.ffn_in / t, e),
        act,
        _gemm("mlp-out", tokens, f / t, h, e),
        residual,
    ]


def attention_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """The attention core on one GPU (a/t heads) for one microbatch. Under
    context parallelism a GPU's queries (s/cp of them, in two load-balanced
    chunks) meet every key, so it does 1/cp of the causal work and reads all
    keys and values as they come round the ring."""
    e, s, d = plan.precision.elem_bytes, model.seq, model.head_dim
    heads = plan.microbatch * model.heads // plan.tp  # (sequence, head) pairs on this GPU
    if plan.attention.fused:
        scores = heads * s * s * FLASH_CAUSAL_WORK / plan.cp
        nbytes = float(e) * plan.microbatch * (2 * model.hidden * s / plan.cp + 2 * model.kv_hidden * s) / plan.tp
        shape = (plan.microbatch, model.heads // plan.tp, model.n_kv_heads // plan.tp, s, d) if plan.cp == 1 else ()
        slowdown = FLASH1_SLOWDOWN if plan.attention is AttentionKernel.FLASH1 else 1.0
        return [Kernel("flash-attention", 4.0 * d * scores, nbytes, FLASH_BACKWARD_WORK * 4.0 * d * scores,
                       2 * nbytes, True, True, shape, special=scores, slowdown=slowdown,
                       synchronous_mma=plan.attention.synchronous_mma,
                       overlap_special=plan.attention is AttentionKernel.FLASH3)]
    # Fused scale-mask-softmax: y = f(x), dx = f(y, dy); dropout as above.
    scores = heads * s * s  # elements of the s x s score matrices
    mask = 1 if model.dropout else 0
    kernels = [_gemm("qk^T", s, d, s, e, batch=heads, attention_core=True),
               _stream("softmax", 2 * e * scores, 3 * e * scores, attention_core=True)]
    if model.dropout:
        kernels.append(_stream("attention-dropout", (2 * e + mask) * scores, (2 * e + mask) * scores, True))
    kernels.append(_gemm("pv", s, s, d, e, batch=heads, attention_core=True))
    return kernels


def padded_vocab(model: TransformerConfig, plan: TrainingPlan) -> int:
    step = VOCAB_PAD * plan.tp
    return step * math.ceil(model.vocab / step)


def head_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """Final norm, logits GEMM and cross entropy (last stage), per GPU per microbatch."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    full = tokens * model.hidden / (t if plan.sequence_parallel else 1)
    logits = tokens * padded_vocab(model, plan) / t
    return [
        _stream("final-norm", 2 * e * full, 3 * e * full),
        _gemm("logits", tokens, model.hidden, padded_vocab(model, plan) / t, e),
        _stream("cross-entropy", (e + CROSS_ENTROPY_FWD_FP32_BYTES) * logits,
                (e + CROSS_ENTROPY_BWD_FP32_BYTES) * logits),
    ]


def embedding_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """Token (and position) embedding lookup and dropout (first stage)."""
    e = plan.precision.elem_bytes
    n = local_tokens(model, plan) * model.hidden
    mask = 1 if model.dropout else 0
    return [_stream("embedding", (4 * e + mask) * n, (3 * e + mask) * n)]


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

    @classmethod
    def make(cls, plan: "TrainingPlan", cluster: Cluster) -> "Fabric":
        pp, _, cp, tp = axis_links(cluster, plan.mesh_shape)
        grads = axis_links(cluster, (plan.pp, plan.dp * plan.cp, plan.tp))[1]
        return cls(pp, grads, cp, tp, Algorithm.BEST if cluster.backend == "nccl" else Algorithm.RING)

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


def tp_layer_comm(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric) -> PassTimes:
    """Tensor-parallel collectives of one layer per microbatch: an all-reduce of
    the b x s x h activation after the attention and MLP blocks (forward) and
    before them (backward); with sequence parallelism each is a reduce-scatter
    plus an all-gather of the same buffer (Korthikanti et al. 2022)."""
    nbytes = plan.precision.elem_bytes * local_tokens(model, plan) * model.hidden
    if plan.sequence_parallel:
        one = (fabric.time(Collective.REDUCE_SCATTER, nbytes, "tp")
               + fabric.time(Collective.ALL_GATHER, nbytes, "tp"))
    else:
        one = fabric.time(Collective.ALL_REDUCE, nbytes, "tp")
    rerun = 2 * one if plan.recompute is Recompute.FULL else 0.0
    return PassTimes(2 * one, rerun, 2 * one)


def tp_head_comm(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric) -> PassTimes:
    """The vocab-parallel output layer: three all-reduces of b x s fp32 scalars in
    the cross entropy (max, sum, target logit), and the input-gradient all-reduce
    (sequence parallel: an all-gather forward, a reduce-scatter backward)."""
    tokens = local_tokens(model, plan)
    scalars = 3 * fabric.time(Collective.ALL_REDUCE, 4 * tokens, "tp")
    nbytes = plan.precision.elem_bytes * tokens * model.hidden
    if plan.sequence_parallel:
        return PassTimes(scalars + fabric.time(Collective.ALL_GATHER, nbytes, "tp"), 0.0,
                         fabric.time(Collective.REDUCE_SCATTER, nbytes, "tp"))
    return PassTimes(scalars, 0.0, fabric.time(Collective.ALL_REDUCE, nbytes, "tp"))


def cp_layer_comm(model: TransformerConfig, plan: TrainingPlan, attention: PassTimes,
                  fabric: Fabric) -> PassTimes:
    """Context parallelism's ring attention in one layer per microbatch: cp - 1
    steps, each passing a chunk of keys and values (b s/cp kv_hidden/t each)
    to the next GPU while attention computes on the chunk in hand, so only
    what the attention (``attention``: its own times) leaves uncovered is
    exposed; backward passes the keys and values again and their gradients."""
    if plan.cp == 1:
        return PassTimes(0.0, 0.0, 0.0)
    chunk = 2 * plan.precision.elem_bytes * local_tokens(model, plan) * model.kv_hidden / plan.tp
    ring = (plan.cp - 1) * fabric.time(Collective.SEND_RECV, chunk, "cp")
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

    @property
    def total(self) -> float:
        return self.compute.total + self.tp_comm.total + self.cp_comm.total + self.pp_comm


def stage_times(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster, fabric: Fabric) -> list[StageTime]:
    """Per-microbatch time of every pipeline stage (the first adds the embedding, the last the output layer)."""
    layers = stage_layers(model, plan)
    layer = kernel_times(layer_kernels(model, plan), plan, cluster, recompute=True)
    layer_comm = tp_layer_comm(model, plan, fabric)
    ring = cp_layer_comm(model, plan, kernel_times(attention_kernels(model, plan), plan, cluster, recompute=True),
                         fabric)
    embed = kernel_times(embedding_kernels(model, plan), plan, cluster, recompute=False)
    head = kernel_times(head_kernels(model, plan), plan, cluster, recompute=False)
    head_comm = tp_head_comm(model, plan, fabric)
    # Each virtual chunk receives its input and sends its output once forward
    # and once backward per microbatch.
    p2p = 2 * plan.virtual_stages * pp_transfer(model, plan, fabric)
    out = []
    for i, n in enumerate(layers):
        compute, comm = layer * n, layer_comm * n
        if i == 0:
            compute = compute + embed
        if i == plan.pp - 1:
            compute, comm = compute + head, comm + head_comm
        out.append(StageTime(compute, comm, p2p, ring * n))
    return out


# --- data parallelism and optimizer -------------------------------------------------------

def stage_params(model: TransformerConfig, plan: TrainingPlan, stage: int) -> float:
    """Parameters held by one GPU of pipeline stage ``stage`` (before ZeRO sharding)."""
    sharded, replicated = model.layer_params()
    n = stage_layers(model, plan)[stage] * (sharded / plan.tp + replicated)
    word = padded_vocab(model, plan) * model.hidden / plan.tp
    if stage == 0:
        n += word + (model.embedding_params() - model.vocab * model.hidden)
    if stage == plan.pp - 1:
        n += model.hidden if model.swiglu else 2 * model.hidden  # final norm
        if plan.pp > 1 or model.untied_embeddings:
            n += word  # the output layer: its own weights, or a copy of the tied embedding on the last stage
    return n


def _bucketed(kind: Collective, nbytes: float, fabric: Fabric) -> tuple[float, float]:
    """(total seconds, seconds of the last bucket) to reduce ``nbytes`` over dp in GRAD_BUCKET_BYTES buckets."""
    if nbytes <= 0:
        return 0.0, 0.0
    full, rest = divmod(nbytes, GRAD_BUCKET_BYTES)
    last = fabric.time(kind, rest or GRAD_BUCKET_BYTES, "dp")
    return full * fabric.time(kind, GRAD_BUCKET_BYTES, "dp") + (last if rest else 0.0), last


def dp_exposed(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric, stage: StageTime) -> float:
    """Exposed data-parallel communication of one step on the first stage (the
    last to finish its backward).

    ZeRO 0: all-reduce the gradients; 1-2: reduce-scatter them, then all-gather
    the updated parameters after the optimizer step (not overlapped); 3: per
    microbatch, all-gather each layer's parameters for forward (and recompute)
    and backward and reduce-scatter its gradients, each prefetched under the
    previous layer's compute. With overlap the buckets hide under the
    backward compute, and under the tensor-parallel collectives where those
    run on another link (AxisLinks.shares_link). Without overlap the
    gradients go in one collective over the whole flat buffer after the
    backward."""
    e = plan.precision.elem_bytes
    if plan.dp * plan.cp == 1:
        return 0.0
    params = stage_params(model, plan, 0)
    if plan.zero == 3:
        return _zero3_exposed(model, plan, fabric, stage)
    kind = Collective.ALL_REDUCE if plan.zero == 0 else Collective.REDUCE_SCATTER
    if plan.overlap_grad_reduce:
        total, last = _bucketed(kind, params * e, fabric)
        window = stage.compute.backward + stage.compute.recompute
        if not fabric.tp.shares_link(fabric.dp):  # e.g. tp on NVLink, dp between nodes: both run at once
            window += stage.tp_comm.backward + stage.tp_comm.recompute
        exposed = max(total - window, last)
    else:
        exposed = fabric.time(kind, params * e, "dp")
    if plan.zero in (1, 2):
        exposed += fabric.time(Collective.ALL_GATHER, params * e, "dp")
    return exposed


def _zero3_exposed(model: TransformerConfig, plan: TrainingPlan, fabric: Fabric, stage: StageTime) -> float:
    sharded, replicated = model.layer_params()
    layer_bytes = (sharded / plan.tp + replicated) * plan.precision.elem_bytes
    gather = fabric.time(Collective.ALL_GATHER, layer_bytes, "dp")
    scatter = fabric.time(Collective.REDUCE_SCATTER, layer_bytes, "dp")
    n = stage_layers(model, plan)[0]
    fwd, rec, bwd = (stage.compute.forward / n, stage.compute.recompute / n, stage.compute.backward / n)
    exposed = max(0.0, gather - fwd) + max(0.0, gather + scatter - bwd)
    if plan.recompute is Recompute.FULL:
        exposed += max(0.0, gather - rec)
    return n * plan.microbatches * exposed


def optimizer_time(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster) -> float:
    """Adam step on the largest stage's (ZeRO-sharded) parameters, memory-bound:
    it reads the fp32 state (master weights, two moments: 12 bytes) and the
    gradient and writes the state back, plus the 16-bit weights when mixed."""
    e = plan.precision.elem_bytes
    largest = max(stage_params(model, plan, i) for i in range(plan.pp))
    params = largest / (plan.dp * plan.cp if plan.zero >= 1 else 1)
    per_param = 12 + e + 12 + (e if plan.precision.mixed else 0)
    return op_time(0.0, params * per_param, cluster.device, plan.precision.value)


# --- memory ------------------------------------------------------------------------------

def model_state_bytes(params: float, plan: TrainingPlan) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes of ``params`` parameters
    under the plan's ZeRO stage (Rajbhandari et al. 2020): mixed precision holds
    2 + 2 + 12 bytes per parameter (16-bit weights and gradients; fp32 master
    weights, momentum, variance), fp32 holds 4 + 4 + 8."""
    e = plan.precision.elem_bytes
    optimizer = 12 if plan.precision.mixed else 8
    nd = plan.dp * plan.cp  # the gradient group, which Megatron's distributed optimizer shards over
    shard = {0: (1, 1, 1), 1: (1, 1, nd), 2: (1, nd, nd), 3: (nd, nd, nd)}[plan.zero]
    return e * params / shard[0], e * params / shard[1], optimizer * params / shard[2]


def layer_activation_bytes(model: TransformerConfig, plan: TrainingPlan, recompute: Recompute | None = None) -> float:
    """Activation bytes one layer keeps for backward per microbatch on one GPU
    (Korthikanti et al. 2022: for the GPT block in 16-bit, s b h (34 + 5 a s / h)
    without parallelism, s b h (10 + 24/t + 5 a s/(h t)) with tensor
    parallelism, s b h (34/t + 5 a s/(h t)) with sequence parallelism, and
    2 s b h with full recomputation)."""
    recompute = plan.recompute if recompute is None else recompute
    e, t = plan.precision.elem_bytes, plan.tp
    s, b, h, f = model.seq / plan.cp, plan.microbatch, model.hidden, model.ffn  # this GPU's share of a sequence
    r = t if plan.sequence_parallel else 1
    if recompute is Recompute.FULL:
        return e * s * b * h / r
    mask = 1 if model.dropout else 0
    # Replicated over tp (unless sequence parallel): both norm inputs, the QKV
    # and MLP-in GEMM inputs, and the two residual dropout masks.
    replicated = (4 * e + 2 * mask) * s * b * h / r
    # Sharded over tp: Q, K, V, the attention-out input, and the MLP
    # activation's input(s) and output.
    act_in = 2 if model.swiglu else 1
    sharded = e * s * b * (2 * h + 2 * model.kv_hidden + (act_in + 1) * f) / t
    scores = 0.0
    if recompute is Recompute.NONE and plan.attention is AttentionKernel.UNFUSED:
        # softmax output, dropout mask, dropout output
        scores = (e + mask + e * mask) * model.heads * s * s * b / t
    elif plan.attention.fused:
        scores = 4.0 * model.heads * s * b / t  # fp32 log-sum-exp per row
    return replicated + sharded + scores


def stage_activation_bytes(model: TransformerConfig, plan: TrainingPlan, stage: int) -> float:
    """Activations held at the peak by one GPU of ``stage`` under 1F1B: stage i
    keeps p - i microbatches in flight (the first stage p), the interleaved
    schedule adds a factor 1 + (p-1)/(p v) on the first stage (Korthikanti et
    al. 2022, Sec. 4.2.3); recomputation adds the working set of one layer."""
    p, v = plan.pp, plan.virtual_stages
    in_flight = min(plan.microbatches, p - stage)
    held = in_flight * stage_layers(model, plan)[stage] * layer_activation_bytes(model, plan)
    if stage == 0 and v > 1:
        held *= 1 + (p - 1) / (p * v)
    if plan.recompute is not Recompute.NONE:
        held += layer_activation_bytes(model, plan, Recompute.NONE) - \
            (layer_activation_bytes(model, plan) if plan.recompute is Recompute.SELECTIVE else 0.0)
    e, tokens = plan.precision.elem_bytes, local_tokens(model, plan)
    if stage == 0:  # embedding output + dropout mask, scattered over tp under sequence parallelism
        shards = plan.tp if plan.sequence_parallel else 1
        held += in_flight * (e + (1 if model.dropout else 0)) * tokens * model.hidden / shards
    if stage == p - 1:
        held += (e + 4) * tokens * padded_vocab(model, plan) / plan.tp  # logits and fp32 softmax
    return held


def peak_memory(model: TransformerConfig, plan: TrainingPlan) -> MemoryBreakdown:
    """The stage that needs the most: with even stages the first (most
    microbatches in flight, embedding) or the last (output layer); with
    uneven ones it can be a middle stage."""
    best = None
    for stage in range(plan.pp):
        params, grads, opt = model_state_bytes(stage_params(model, plan, stage), plan)
        m = MemoryBreakdown(params, grads, opt, stage_activation_bytes(model, plan, stage), stage)
        if best is None or m.total > best.total:
            best = m
    return best


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
