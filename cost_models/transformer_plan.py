"""What ``autopar estimate`` prices: a GPT- or Llama-style transformer
(``TransformerConfig``) under a hand-written Megatron-style plan
(``TrainingPlan``: tensor, pipeline and data parallel degrees, microbatching,
recomputation, ZeRO, precision), each validating itself, and ``check_plan``,
which says why a plan cannot run a model on a cluster. The cost of a step is in
cost_models/transformer.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

from autopar.cost_models.cluster import Cluster
from autopar.cost_models.optimizer import OPTIMIZER_STATES
from autopar.errors import AutoparError


class EstimateError(AutoparError):
    """A transformer shape or parallel plan that cannot be estimated."""


class Recompute(str, Enum):
    NONE = "none"
    SELECTIVE = "selective"
    """Recompute the attention core only (Korthikanti et al. 2022)."""
    FULL = "full"
    """Keep each layer's input; recompute the whole layer in backward."""


class Precision(str, Enum):
    BF16 = "bf16"
    FP16 = "fp16"
    FP32 = "fp32"

    @property
    def elem_bytes(self) -> int:
        return 4 if self is Precision.FP32 else 2

    @property
    def mixed(self) -> bool:
        """16-bit compute with fp32 master weights and optimizer states."""
        return self is not Precision.FP32


class AttentionKernel(str, Enum):
    UNFUSED = "unfused"
    """QK^T, softmax, dropout, PV as separate kernels (Megatron-LM 2021)."""
    FLASH = "flash"
    """FlashAttention-2: one fused kernel that never stores the s x s scores
    (PyTorch's scaled_dot_product_attention on GPUs, Megatron-Core, TE)."""
    FLASH1 = "flash1"
    """FlashAttention's first generation or its Triton port (flash_attn_triton.py
    of the FlashAttention 1.x package, which MPT's ``attn_impl: triton`` runs):
    the same fused kernel and memory, at its own speed."""
    FLASH3 = "flash3"
    """FlashAttention-3 (Hopper; cuDNN's fused attention works alike): the
    same fused kernel and memory, issuing Hopper's asynchronous warpgroup MMA
    and overlapping the softmax's exponentials with the GEMMs (Shah et al.
    2024, sec. 3.1-3.2)."""

    @property
    def fused(self) -> bool:
        return self is not AttentionKernel.UNFUSED

    @property
    def synchronous_mma(self) -> bool:
        """Written for Ampere's tensor-core instructions (Device.synchronous_mma_fraction)."""
        return self in (AttentionKernel.FLASH, AttentionKernel.FLASH1)


class Kernels(str, Enum):
    """Which kernels run the layer's element-wise work."""

    MEGATRON = "megatron"
    """Megatron-LM's fused kernels: bias + GeLU, bias + dropout + residual
    add, fused layer norm, fused softmax and vocabulary-parallel cross
    entropy in fp32 (Megatron-LM, NeMo, Megatron-DeepSpeed)."""
    EAGER = "eager"
    """One kernel per ATen op, as PyTorch eager runs a module written with
    nn.Linear, nn.LayerNorm, F.gelu and F.scaled_dot_product_attention: what
    autopar's emitted programs, FSDP and torchtitan without torch.compile
    run, and what ``autopar compile`` prices op by op."""


# --- the model and the plan --------------------------------------------------

@dataclass(frozen=True)
class TransformerConfig:
    """A decoder-only transformer. GPT style by default (GeLU MLP with biases,
    dropout, learned positions); ``swiglu`` selects the Llama style (SwiGLU MLP,
    no biases, no dropout, rotary positions)."""

    layers: int
    """Transformer layers, l."""
    hidden: int
    """Hidden size, h."""
    heads: int
    """Attention (query) heads, a."""
    seq: int
    """Sequence length, s."""
    vocab: int
    """Vocabulary size, V."""
    kv_heads: int | None = None
    """Key/value heads for grouped-query attention (default: ``heads``)."""
    ffn_hidden: int | None = None
    """MLP hidden size (default 4h; with SwiGLU 2/3 of 4h rounded up to 256, as in Llama)."""
    swiglu: bool = False
    """Llama-style block (see class docstring)."""
    untied_embeddings: bool = False
    """The output layer has its own weights (Llama 2 and 3; Megatron's
    ``--untie-embeddings-and-output-weights``) instead of reusing the word
    embeddings (GPT, Megatron's default): V h more parameters, and without
    pipelining a second V h on the one stage."""
    no_dropout: bool = False
    """A GPT block without dropout (MPT, GPT-NeoX and Pythia train with p = 0,
    which PyTorch skips): no masks written, kept or read. The Llama block has
    none either way."""

    def __post_init__(self):
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            _require_positive_int(name, getattr(self, name))
        for name in ("kv_heads", "ffn_hidden"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        if self.hidden % self.heads:
            raise EstimateError(f"hidden ({self.hidden}) must be divisible by heads ({self.heads})")
        if self.heads % self.n_kv_heads:
            raise EstimateError(f"heads ({self.heads}) must be divisible by kv-heads ({self.n_kv_heads})")

    @property
    def n_kv_heads(self) -> int:
        return self.kv_heads or self.heads

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_hidden(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def ffn(self) -> int:
        if self.ffn_hidden is not None:
            return self.ffn_hidden
        if self.swiglu:
            return 256 * math.ceil(2 * 4 * self.hidden / 3 / 256)
        return 4 * self.hidden

    @property
    def ffn_in(self) -> int:
        """Output width of the first MLP GEMM (gate and up projections for SwiGLU)."""
        return 2 * self.ffn if self.swiglu else self.ffn

    @property
    def dropout(self) -> bool:
        return not (self.swiglu or self.no_dropout)

    @property
    def biases(self) -> bool:
        return not self.swiglu

    def layer_params(self) -> tuple[int, int]:
        """(tensor-parallel-sharded, replicated) parameters of one layer."""
        h, hq = self.hidden, self.hidden + 2 * self.kv_hidden
        sharded = h * hq + h * h + h * self.ffn_in + self.ffn * h
        replicated = 2 * h if self.swiglu else 4 * h  # RMSNorm weight / LayerNorm weight+bias, x2
        if self.biases:
            sharded += hq + self.ffn_in  # column-parallel biases
            replicated += 2 * h  # row-parallel biases
        return sharded, replicated

    def embedding_params(self) -> int:
        positions = 0 if self.swiglu else self.seq * self.hidden
        return self.vocab * self.hidden + positions

    def parameters(self) -> int:
        """Total parameters (the output layer's own only when untied)."""
        final_norm = self.hidden if self.swiglu else 2 * self.hidden
        output = self.vocab * self.hidden if self.untied_embeddings else 0
        return self.layers * sum(self.layer_params()) + self.embedding_params() + final_norm + output

    def layer_forward_flops(self) -> float:
        """Forward FLOPs of one layer for one sequence (GEMMs and attention)."""
        s, h = self.seq, self.hidden
        gemms = 2 * s * h * (h + 2 * self.kv_hidden) + 2 * s * h * h + 2 * s * h * self.ffn_in + 2 * s * self.ffn * h
        return gemms + 4 * s * s * h

    def attention_core_flops(self) -> float:
        """Forward FLOPs of QK^T and PV for one sequence (what selective recompute reruns)."""
        return 4.0 * self.seq * self.seq * self.hidden

    def head_forward_flops(self) -> float:
        """Forward FLOPs of the output (logits) GEMM for one sequence."""
        return 2.0 * self.seq * self.hidden * self.vocab


@dataclass(frozen=True)
class TrainingPlan:
    """A hand-written parallel plan for one training step (Megatron terms)."""

    batch: int
    """Global batch, sequences per step."""
    microbatch: int
    """Sequences per microbatch, b."""
    tp: int = 1
    """Tensor-parallel size, t."""
    pp: int = 1
    """Pipeline stages, p."""
    dp: int = 1
    """Data-parallel size, d."""
    cp: int = 1
    """Context-parallel size: each sequence split over cp GPUs in 2 cp
    load-balanced chunks, keys and values passed round a ring (Megatron-Core
    with Transformer Engine's attention; Llama 3 trained at 131K tokens
    with cp = 16, Dubey et al. 2024, sec. 3.3.2). Weights are replicated
    over cp: gradients reduce over dp x cp."""
    virtual_stages: int = 1
    """Model chunks per pipeline stage, v (interleaved 1F1B when > 1)."""
    first_stage_layers: int | None = None
    """Layers on the first pipeline stage, when it holds fewer (or more) than
    the rest, as Megatron-Core's ``--decoder-first-pipeline-num-layers``
    (Llama 3 405B took one layer off the first and the last stage: Dubey et
    al. 2024, sec. 3.3.2). None: the layers split evenly."""
    last_stage_layers: int | None = None
    """Layers on the last pipeline stage (Megatron-Core's
    ``--decoder-last-pipeline-num-layers``); None: split evenly."""
    sequence_parallel: bool = False
    """Shard layer norms and dropouts along the sequence over the tp group."""
    recompute: Recompute = Recompute.NONE
    """Activation recomputation."""
    zero: int = 0
    """ZeRO stage over the dp group: 0 none, 1 optimizer states, 2 + gradients, 3 + parameters."""
    precision: Precision = Precision.BF16
    """Compute precision; 16-bit means mixed precision with fp32 master weights."""
    attention: AttentionKernel = AttentionKernel.FLASH
    """Attention kernel."""
    overlap_grad_reduce: bool = True
    """Overlap the data-parallel gradient reduction with the last microbatch's backward."""
    overlap_param_gather: bool = True
    """Prefetch ZeRO's parameter all-gathers under compute: ZeRO-3 gathers a
    layer's weights while the previous layer computes (FSDP's prefetching,
    DeepSpeed's), ZeRO-1/2 gather the updated weights under the next
    forward (Megatron-LM's ``--overlap-param-gather``). False: each gather
    blocks the compute that needs it (autopar's runtime today)."""
    tp_comm_overlap: bool = False
    """Overlap tensor-parallel collectives with the GEMMs next to them
    (Megatron-Core's ``--tp-comm-overlap``, Transformer Engine's userbuffers;
    PyTorch's async TP): each all-gather and reduce-scatter is split into
    chunks that pipeline with the GEMM they feed or drain
    (overlap.chunked_overlap). Needs sequence parallelism."""
    kernels: Kernels = Kernels.MEGATRON
    """The element-wise kernels the layer runs (``Kernels``)."""
    optimizer: str = "adamw-fused"
    """The optimizer and its implementation (cost_models/optimizer.py):
    Megatron-LM's fused Adam by default; ``adamw`` for torch.optim's
    multi-tensor AdamW."""

    def __post_init__(self):
        for name in ("batch", "microbatch", "tp", "pp", "dp", "cp", "virtual_stages"):
            _require_positive_int(name, getattr(self, name))
        for name in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, name) is not None:
                _require_positive_int(name, getattr(self, name))
        object.__setattr__(self, "recompute", _enum(Recompute, self.recompute, "recompute"))
        object.__setattr__(self, "precision", _enum(Precision, self.precision, "precision"))
        object.__setattr__(self, "attention", _enum(AttentionKernel, self.attention, "attention"))
        object.__setattr__(self, "kernels", _enum(Kernels, self.kernels, "kernels"))
        if self.optimizer not in OPTIMIZER_STATES:
            raise EstimateError(f"optimizer must be one of {sorted(OPTIMIZER_STATES)}, got {self.optimizer!r}")
        for name in ("overlap_grad_reduce", "overlap_param_gather", "tp_comm_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise EstimateError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.zero not in (0, 1, 2, 3):
            raise EstimateError(f"zero must be one of 0, 1, 2, 3, got {self.zero!r}")

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def degrees(self) -> str:
        """'tp(8) * pp(2) * dp(4)', with cp(2) after tp when there is context parallelism."""
        cp = f" * cp({self.cp})" if self.cp > 1 else ""
        return f"tp({self.tp}){cp} * pp({self.pp}) * dp({self.dp})"

    @property
    def microbatches(self) -> int:
        """Microbatches per pipeline per step, m."""
        return self.batch // (self.microbatch * self.dp)

    @property
    def mesh_shape(self) -> tuple[int, int, int, int]:
        """(pp, dp, cp, tp), tp fastest: Megatron's rank order, so tp (then cp) stays inside a node."""
        return (self.pp, self.dp, self.cp, self.tp)


def _require_positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise EstimateError(f"{name} must be a positive integer, got {value!r}")


def _enum(cls, value, name: str):
    try:
        return cls(value)
    except ValueError:
        raise EstimateError(f"{name} must be one of {[m.value for m in cls]}, got {value!r}") from None


def check_plan(model: TransformerConfig, plan: TrainingPlan, cluster: Cluster, nodes: int) -> None:
    """Raise EstimateError, naming the rule and the values, if ``plan`` cannot run ``model`` on ``nodes`` nodes."""
    _require_positive_int("nodes", nodes)
    dpn = cluster.devices_per_node
    if cluster.nodes is not None and nodes > cluster.nodes:
        raise EstimateError(f"cluster {cluster.name!r} has {cluster.nodes} node(s); {nodes} requested")
    if plan.world != nodes * dpn and not (nodes == 1 and plan.world < dpn):
        raise EstimateError(
            f"{plan.degrees} = {plan.world} != "
            f"nodes({nodes}) * devices_per_node({dpn}) = {nodes * dpn} on cluster {cluster.name!r} "
            f"(a plan uses whole nodes, or part of one)")
    rules = [
        (model.heads % plan.tp == 0, f"heads ({model.heads}) must be divisible by tp ({plan.tp})"),
        (model.n_kv_heads % plan.tp == 0, f"kv-heads ({model.n_kv_heads}) must be divisible by tp ({plan.tp})"),
        (model.ffn % plan.tp == 0, f"ffn-hidden ({model.ffn}) must be divisible by tp ({plan.tp})"),
        (plan.batch % (plan.microbatch * plan.dp) == 0,
         f"batch ({plan.batch}) must be divisible by microbatch ({plan.microbatch}) * dp ({plan.dp})"),
        (plan.virtual_stages == 1 or plan.pp > 1, "virtual-stages > 1 needs pp > 1"),
        (plan.virtual_stages == 1 or plan.microbatches % plan.pp == 0,
         f"the interleaved schedule needs microbatches ({plan.microbatches} = batch / (microbatch * dp)) "
         f"divisible by pp ({plan.pp})"),
        (not plan.sequence_parallel or model.seq % (plan.tp * plan.cp) == 0,
         f"sequence parallelism needs seq ({model.seq}) divisible by tp ({plan.tp})"
         + (f" * cp ({plan.cp})" if plan.cp > 1 else "")),
        (plan.cp == 1 or model.seq % (2 * plan.cp) == 0,
         f"context parallelism splits each sequence in 2 * cp load-balanced chunks: seq ({model.seq}) must be "
         f"divisible by 2 * cp ({2 * plan.cp})"),
        (not plan.tp_comm_overlap or plan.tp > 1 and plan.sequence_parallel,
         f"--tp-comm-overlap overlaps the all-gathers and reduce-scatters of sequence parallelism with their "
         f"GEMMs: it needs tp > 1 (tp is {plan.tp}) and --sequence-parallel"),
        (plan.cp == 1 or plan.attention is AttentionKernel.FLASH,
         f"context parallelism needs --attention flash (ring attention over FlashAttention-2); "
         f"--attention {plan.attention.value} has none"),
    ]
    for ok, message in rules:
        if not ok:
            raise EstimateError(message)
    stage_layers(model, plan)


def stage_layers(model: TransformerConfig, plan: TrainingPlan) -> tuple[int, ...]:
    """Layers on each pipeline stage (all its virtual chunks together): the
    first and last as the plan pins them, the others an equal share of the
    rest. Raises EstimateError, naming the counts, where they do not add up.
    Without pins the layers must split into pp * v equal chunks (Megatron's
    rule); with pins each stage needs at least v layers, and a stage whose
    layers v does not divide has chunks one layer apart."""
    p, v, first, last = plan.pp, plan.virtual_stages, plan.first_stage_layers, plan.last_stage_layers
    if first is None and last is None:
        if model.layers % (p * v):
            raise EstimateError(
                f"layers ({model.layers}) must be divisible by pp ({p}) * virtual-stages ({v}), "
                f"or give first-stage-layers / last-stage-layers for uneven stages")
        return (model.layers // p,) * p
    if p == 1:
        raise EstimateError("first-stage-layers / last-stage-layers need pp > 1")
    pinned = {i: n for i, n in ((0, first), (p - 1, last)) if n is not None}
    rest, free = model.layers - sum(pinned.values()), p - len(pinned)
    if rest < free or (free and rest % free) or (not free and rest):
        given = " + ".join(f"{'first' if i == 0 else 'last'}-stage-layers ({n})" for i, n in pinned.items())
        share = f"the other {free} stage(s) an equal share of at least one" if free else "no other stages"
        raise EstimateError(f"layers ({model.layers}) = {given} + {rest} left, which cannot give {share}")
    counts = tuple(pinned.get(i, rest // free if free else 0) for i in range(p))
    if min(counts) < v:
        raise EstimateError(f"every stage needs at least virtual-stages ({v}) layers; the stages have {list(counts)}")
    return counts
