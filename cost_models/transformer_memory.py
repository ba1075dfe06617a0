"""Memory per GPU of a transformer training step under a hand-written plan:
model states per ZeRO stage (Rajbhandari et al., ZeRO, SC'20: parameters,
gradients and optimizer states, each sharded by its stage), activations per
recomputation mode (Korthikanti et al., MLSys'23), the working sets of the
step's kernels and the optimizer's temporaries; ``peak_memory`` adds them up
on each pipeline stage (cost_models/transformer.py's ``estimate`` reports it).
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models import optimizer as opt
from autopar.cost_models.kernels import Kernel
from autopar.cost_models.transformer_kernels import (TARGET_BYTES, embedding_kernels, head_kernels, layer_kernels,
                                                     local_tokens, padded_vocab)
from autopar.cost_models.transformer_plan import (AttentionKernel, Kernels, Recompute, TrainingPlan, TransformerConfig,
                                                  stage_layers)


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
    inputs: float = 0.0
    """The batch's token ids and targets."""
    step_temporaries: float = 0.0
    """The optimizer step's temporaries (optimizer.step_temporary_bytes)."""
    persistent_gradients: bool = True
    """Gradients live beside the activations (a contiguous gradient buffer,
    accumulation, a pipeline), not only once backward frees them."""

    @property
    def total(self) -> float:
        return opt.device_peak(self.parameters + self.optimizer_states + self.inputs, self.gradients,
                               self.activations, self.step_temporaries, self.persistent_gradients)


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


def model_state_bytes(params: float, plan: TrainingPlan) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer states) bytes of ``params`` parameters
    under the plan's ZeRO stage (Rajbhandari et al. 2020; optimizer.state_bytes,
    a compiled plan's table too): mixed precision holds 2 + 2 + 12 bytes per
    parameter for Adam (16-bit weights and gradients; fp32 master weights,
    momentum, variance), fp32 holds 4 + 4 + 8. Eager ZeRO-2 is PyTorch's
    (FSDP's SHARD_GRAD_OP, autopar's): the weights stored sharded, their
    gathered copies kept until backward (stage_activation_bytes)."""
    nd = plan.dp * plan.cp  # the gradient group, which Megatron's distributed optimizer shards over
    shards = {0: (1, 1, 1), 1: (1, 1, nd), 2: (1, nd, nd), 3: (nd, nd, nd)}[plan.zero]
    if plan.kernels is Kernels.EAGER and plan.zero == 2:
        shards = (nd, nd, nd)  # stored sharded like FSDP's SHARD_GRAD_OP; the gathered copies are activations
    held = opt.state_bytes(params, plan.precision.value, plan.optimizer, shards)
    return held["parameters"], held["gradients"], held["optimizer"]


def layer_activation_bytes(model: TransformerConfig, plan: TrainingPlan, recompute: Recompute | None = None) -> float:
    """Activation bytes one layer keeps for backward per microbatch on one GPU
    (Korthikanti et al. 2022: for the GPT block in 16-bit, s b h (34 + 5 a s / h)
    without parallelism, s b h (10 + 24/t + 5 a s/(h t)) with tensor
    parallelism, s b h (34/t + 5 a s/(h t)) with sequence parallelism, and
    2 s b h with full recomputation). Eager kernels: ``eager_layer_activation_bytes``."""
    recompute = plan.recompute if recompute is None else recompute
    if plan.kernels is Kernels.EAGER:
        return eager_layer_activation_bytes(model, plan, recompute)
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


def eager_layer_activation_bytes(model: TransformerConfig, plan: TrainingPlan, recompute: Recompute) -> float:
    """What autograd keeps of one eager layer per microbatch on one GPU, by
    the rules a compiled plan's memory follows (graph_costs.saved_outputs):
    each op keeps the inputs its backward reads (a norm and a GEMM their
    input, GeLU its input, a product both, scaled_dot_product_attention its
    q, k, v and output), an addition nothing, a view its base's storage, a
    dropout its one-byte mask; the attention's output reaches the output
    GEMM through a reshape of its transposed heads, a copy, kept too. Under tensor parallelism the inputs of the
    column-parallel GEMMs are kept whole (the all-gathered copy, under
    sequence parallelism too), the norm inputs on the sequence shard. Full
    recomputation keeps the layer's input only."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    h, f, kv = model.hidden, model.ffn, model.kv_hidden
    full = tokens * h / (t if plan.sequence_parallel else 1)
    if recompute is Recompute.FULL:
        return e * full
    norms = 2 * e * full + 2 * e * tokens * h  # the two norms' inputs (sharded) and outputs (gathered)
    # q, k, v and the attention's output, and the copy the output GEMM reads (a reshape of the
    # transposed heads copies)
    attention = e * tokens * (3 * h + 2 * kv) / t
    mlp = e * tokens * f / t * (4 if model.swiglu else 2)  # gate, up, silu, product / fc out, gelu out
    masks = 2 * full if model.dropout else 0.0
    return norms + attention + mlp + masks


def _eager_working(model: TransformerConfig, plan: TrainingPlan, kernels: list[Kernel]) -> float:
    """The largest working set of one eager kernel's backward among
    ``kernels`` (graph_costs.backward_working_set): the gradient of its output
    and of each floating input, the size of what the forward read and wrote;
    cross entropy's twice the whole logits (its log-softmax's gradient and
    its input's), the embedding's its table's gradient. A weight's gradient
    reduced by an all-reduce is copied where it is reduced
    (graph_costs.gradient_transient); a ZeRO weight's gathered gradient, and
    for ZeRO-3 its regathered copy, is held at its GEMM too
    (graph_costs.gather_transient)."""
    e, nd = plan.precision.elem_bytes, plan.dp * plan.cp
    tokens = local_tokens(model, plan)
    best = 0.0
    for k in kernels:
        if k.name == "cross-entropy":  # on the whole vocabulary (tp_head_comm)
            best = max(best, 2 * e * tokens * padded_vocab(model, plan))
        elif k.name == "embedding":
            best = max(best, k.bwd_bytes - TARGET_BYTES * tokens)
        elif k.matmul and not k.attention_core:
            weight = e * k.shape[2] * k.shape[3]
            own = k.fwd_bytes + (weight if nd > 1 and plan.zero == 0 else 0.0)
            gathered = weight * (2 if plan.zero == 3 else 1) if nd > 1 and plan.zero >= 2 else 0.0
            best = max(best, own, gathered)
        elif not k.attention_core or k.matmul:
            best = max(best, k.fwd_bytes)
    return best


def _eager_peak(model: TransformerConfig, plan: TrainingPlan, stage: int) -> float:
    """What the eager activations add at their peak on ``stage``, on top of
    every layer's kept activations, the largest over the points backward
    passes (autopar/timeline.py): cross entropy's backward on the last stage
    (the final norm's input and output and the gathered logits it keeps,
    with its working set), the output GEMM's (the logits freed), or a
    layer's (its working set; under full recomputation also the layer's
    activations, rebuilt)."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    full = tokens * model.hidden / (t if plan.sequence_parallel else 1)
    layer = _eager_working(model, plan, layer_kernels(model, plan))
    if plan.recompute is Recompute.FULL:
        layer += eager_layer_activation_bytes(model, plan, Recompute.NONE)
        if plan.zero == 2 and plan.dp * plan.cp > 1:  # its weights, gathered again for its recomputation
            sharded, replicated = model.layer_params()
            layer += e * (sharded / t + replicated)
    extra = 0.0
    if stage == 0:  # the embedding dropout's mask; the table's gradient, written whole
        extra = full if model.dropout else 0.0
        layer = max(layer, _eager_working(model, plan, embedding_kernels(model, plan)))
    if stage != plan.pp - 1:
        return extra + layer
    norm, logits, ce = head_kernels(model, plan)
    base = e * full + e * tokens * model.hidden  # the final norm's input and output
    at_loss = base + e * tokens * padded_vocab(model, plan) + _eager_working(model, plan, [ce])
    at_logits = base + _eager_working(model, plan, [logits])
    return extra + max(layer, at_loss, at_logits)


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
    if plan.kernels is Kernels.EAGER:
        if plan.zero == 2 and plan.dp * plan.cp > 1:  # gathered weights, kept by the ops that read them
            gathered = stage_params(model, plan, stage)  # (a recomputed layer's are gathered again for it)
            if plan.recompute is Recompute.FULL:
                sharded, replicated = model.layer_params()
                gathered -= stage_layers(model, plan)[stage] * (sharded / plan.tp + replicated)
            held += plan.precision.elem_bytes * gathered
        return held + _eager_peak(model, plan, stage)
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
    uneven ones it can be a middle stage. Gradients take their memory beside
    the activations where they persist through the step (Megatron's
    contiguous gradient buffer, accumulation over microbatches, a pipeline),
    and as the activations are freed otherwise (optimizer.device_peak)."""
    persistent = plan.kernels is Kernels.MEGATRON or plan.microbatches > 1 or plan.pp > 1
    inputs = 2 * TARGET_BYTES * local_tokens(model, plan) if plan.kernels is Kernels.EAGER else 0.0
    best = None
    for stage in range(plan.pp):
        local = stage_params(model, plan, stage)
        params, grads, state = model_state_bytes(local, plan)
        updated = local / (plan.dp * plan.cp if plan.zero >= 1 else 1)
        temp = opt.step_temporary_bytes(updated, plan.precision.value, plan.optimizer)
        m = MemoryBreakdown(params, grads, state, stage_activation_bytes(model, plan, stage), stage, inputs, temp,
                            persistent)
        if best is None or m.total > best.total:
            best = m
    return best
