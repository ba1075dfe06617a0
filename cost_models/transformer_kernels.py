"""The per-GPU kernels of one microbatch of a GPT- or Llama-style
transformer under a hand-written plan, and the step's FLOPs
(cost_models/transformer.py prices them; transformer_memory.py reads their
working sets).

Per layer: every GEMM (QKV, attention projection, MLP), the attention core
(unfused: QK^T and PV batched GEMMs, softmax and dropout over the s x s
scores; or one FlashAttention kernel) and the element-wise kernels (layer
norms, bias-dropout-add, GeLU/SwiGLU) as memory traffic, each on this GPU's
share of the tokens and of the tensor-parallel split; then the embedding and
the head with its cross entropy. FLOPs are counted as in the Megatron-LM
papers: model FLOPs (the 72-coefficient formula, used for MFU) and hardware
FLOPs, which add the recomputed forward.
"""
from __future__ import annotations

import math

from autopar.cost_models.kernels import FLASH1_SLOWDOWN, Kernel, flash_attention, gemm, stream
from autopar.cost_models.transformer_plan import AttentionKernel, Kernels, Recompute, TrainingPlan, TransformerConfig


VOCAB_PAD = 128


"""Megatron pads the vocabulary to a multiple of 128 * tp (--make-vocab-size-divisible-by 128)."""


CROSS_ENTROPY_FWD_FP32_BYTES = 32


"""Bytes per logit beyond the 16-bit read in Megatron's vocab-parallel cross
entropy forward: an fp32 upcast, max subtraction, exp and normalisation pass
(4 fp32 reads + 4 fp32 writes)."""


CROSS_ENTROPY_BWD_FP32_BYTES = 8


"""Bytes per logit beyond the 16-bit gradient write in its backward (read the
saved fp32 softmax, write the fp32 gradient)."""


TARGET_BYTES = 8


"""Bytes per token of the token ids and targets (int64, as torch's embedding and cross entropy take them)."""


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


def local_tokens(model: TransformerConfig, plan: TrainingPlan) -> float:
    """Tokens of one microbatch on one GPU: its sequences' 1/cp share."""
    return plan.microbatch * model.seq / plan.cp


def layer_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """The kernels of one layer on one GPU for one microbatch, as the plan's
    ``kernels`` run them (``Kernels``).

    Megatron-LM's fused element-wise kernels count each tensor read or
    written once (e bytes per element, 1 per dropout-mask element): layer
    norm y = f(x) and dx = f(dy, x); bias-dropout-add out = x + drop(y + b)
    writes the mask, its backward reads dy and the mask; bias-GeLU y = f(x),
    dx = f(dy, x); SwiGLU y = f(gate, up), (dgate, dup) = f(dy, gate, up).
    Eager PyTorch runs one kernel per ATen op (``eager_layer_kernels``)."""
    if plan.kernels is Kernels.EAGER:
        return eager_layer_kernels(model, plan)
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    h, f = model.hidden, model.ffn
    full = tokens * h / (t if plan.sequence_parallel else 1)  # elements of layer-norm / dropout tensors
    mask = 1 if model.dropout else 0  # dropout mask bytes per element
    norm = stream("layernorm", 2 * e * full, 3 * e * full)
    residual = stream("bias-dropout-add", (3 * e + mask) * full, (2 * e + mask) * full)
    if model.swiglu:
        act = stream("swiglu", 3 * e * tokens * f / t, 5 * e * tokens * f / t)
    else:
        act = stream("bias-gelu", 2 * e * tokens * f / t, 3 * e * tokens * f / t)
    return [
        norm,
        gemm("qkv", tokens, h, (h + 2 * model.kv_hidden) / t, e),
        *attention_kernels(model, plan),
        gemm("attention-out", tokens, h / t, h, e),
        residual,
        norm,
        gemm("mlp-in", tokens, h, model.ffn_in / t, e),
        act,
        gemm("mlp-out", tokens, f / t, h, e),
        residual,
    ]


def eager_layer_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """One layer as PyTorch eager runs it, one kernel per ATen op, each priced
    as ``autopar compile`` prices the op (graph_costs.node_kernel): an
    element-wise op or a norm is one pass over its inputs and outputs forward
    and again backward; q, k and v are separate GEMMs (biases read beside
    them); views (the head reshapes, transposes) and a dropout of p = 0 move
    nothing. Under tensor parallelism the norms run on the whole activation
    (sequence parallelism: on its shard of the sequence)."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    h, f, kv = model.hidden, model.ffn, model.kv_hidden
    full = tokens * h / (t if plan.sequence_parallel else 1)
    bias = (lambda n: e * n) if model.biases else (lambda n: 0.0)  # noqa: E731
    norm_params = h if model.swiglu else 2 * h
    norm = stream("layer-norm", e * (2 * full + norm_params), e * (2 * full + norm_params))
    add = stream("add", 3 * e * full, 3 * e * full)
    dropout = [stream("dropout", 2 * e * full, 2 * e * full)] if model.dropout else []
    attention = [
        norm,
        gemm("q", tokens, h, h / t, e, extra_bytes=bias(h / t)),
        gemm("k", tokens, h, kv / t, e, extra_bytes=bias(kv / t)),
        gemm("v", tokens, h, kv / t, e, extra_bytes=bias(kv / t)),
        *attention_kernels(model, plan),
        gemm("attention-out", tokens, h / t, h, e, extra_bytes=bias(h)),
        *dropout, add,
    ]
    inner = tokens * f / t
    if model.swiglu:
        mlp = [gemm("mlp-gate", tokens, h, f / t, e), gemm("mlp-up", tokens, h, f / t, e),
               stream("silu", 2 * e * inner, 2 * e * inner), stream("mul", 3 * e * inner, 3 * e * inner)]
    else:
        mlp = [gemm("mlp-in", tokens, h, f / t, e, extra_bytes=bias(f / t)),
               stream("gelu", 2 * e * inner, 2 * e * inner)]
    return attention + [norm, *mlp, gemm("mlp-out", tokens, f / t, h, e, extra_bytes=bias(h)), *dropout, add]


def attention_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """The attention core on one GPU (a/t heads) for one microbatch. Under
    context parallelism a GPU's queries (s/cp of them, in two load-balanced
    chunks) meet every key, so it does 1/cp of the causal work and reads all
    keys and values as they come round the ring."""
    e, s, d = plan.precision.elem_bytes, model.seq, model.head_dim
    heads = plan.microbatch * model.heads // plan.tp  # (sequence, head) pairs on this GPU
    if plan.attention.fused:
        nbytes = float(e) * plan.microbatch * (2 * model.hidden * s / plan.cp + 2 * model.kv_hidden * s) / plan.tp
        shape = (plan.microbatch, model.heads // plan.tp, model.n_kv_heads // plan.tp, s, d) if plan.cp == 1 else ()
        slowdown = FLASH1_SLOWDOWN if plan.attention is AttentionKernel.FLASH1 else 1.0
        return [flash_attention(heads * s * s / plan.cp, d, nbytes, causal=True, slowdown=slowdown,
                                synchronous_mma=plan.attention.synchronous_mma,
                                overlap_special=plan.attention is AttentionKernel.FLASH3, shape=shape)]
    # Fused scale-mask-softmax: y = f(x), dx = f(y, dy); dropout as above.
    scores = heads * s * s  # elements of the s x s score matrices
    mask = 1 if model.dropout else 0
    kernels = [gemm("qk^T", s, d, s, e, batch=heads, attention_core=True),
               stream("softmax", 2 * e * scores, 3 * e * scores, attention_core=True)]
    if model.dropout:
        kernels.append(stream("attention-dropout", (2 * e + mask) * scores, (2 * e + mask) * scores, True))
    kernels.append(gemm("pv", s, s, d, e, batch=heads, attention_core=True))
    return kernels


def padded_vocab(model: TransformerConfig, plan: TrainingPlan) -> int:
    """The vocabulary as the output layer holds it: Megatron pads it to a
    multiple of 128 tp; an eager model keeps its own size."""
    if plan.kernels is Kernels.EAGER:
        return model.vocab
    step = VOCAB_PAD * plan.tp
    return step * math.ceil(model.vocab / step)


def head_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """Final norm, logits GEMM and cross entropy (last stage), per GPU per
    microbatch. Megatron's vocabulary-parallel cross entropy works in fp32
    (CROSS_ENTROPY_*_FP32_BYTES); PyTorch's reads the 16-bit logits and the
    targets once forward and again backward."""
    e, t = plan.precision.elem_bytes, plan.tp
    tokens = local_tokens(model, plan)
    full = tokens * model.hidden / (t if plan.sequence_parallel else 1)
    logits = tokens * padded_vocab(model, plan) / t
    if plan.kernels is Kernels.EAGER:  # cross entropy on the whole vocabulary (tp_head_comm)
        norm_params = model.hidden if model.swiglu else 2 * model.hidden
        norm = e * (2 * full + norm_params)
        ce = e * logits * t + TARGET_BYTES * tokens
        return [stream("final-norm", norm, norm), gemm("logits", tokens, model.hidden, padded_vocab(model, plan) / t, e),
                stream("cross-entropy", ce, ce)]
    return [
        stream("final-norm", 2 * e * full, 3 * e * full),
        gemm("logits", tokens, model.hidden, padded_vocab(model, plan) / t, e),
        stream("cross-entropy", (e + CROSS_ENTROPY_FWD_FP32_BYTES) * logits,
               (e + CROSS_ENTROPY_BWD_FP32_BYTES) * logits),
    ]


def embedding_kernels(model: TransformerConfig, plan: TrainingPlan) -> list[Kernel]:
    """Token (and position) embedding lookup and dropout (first stage). In
    eager PyTorch (graph_costs.node_kernel) a lookup reads its rows and
    writes them, and its backward writes the whole table's gradient; the
    learned positions are looked up once for the batch and added."""
    e = plan.precision.elem_bytes
    tokens = local_tokens(model, plan)
    n = tokens * model.hidden
    mask = 1 if model.dropout else 0
    if plan.kernels is Kernels.EAGER:
        table = padded_vocab(model, plan) * model.hidden / plan.tp
        out = [stream("embedding", 2 * e * n + TARGET_BYTES * tokens, e * (table + n) + TARGET_BYTES * tokens)]
        if not model.swiglu:  # learned positions, added to every sequence
            pos = model.seq / plan.cp * model.hidden
            out += [stream("position-embedding", 2 * e * pos, 2 * e * pos),
                    stream("add", e * (2 * n + pos), e * (2 * n + pos))]
        if model.dropout:
            out.append(stream("dropout", 2 * e * n, 2 * e * n))
        return out
    return [stream("embedding", (4 * e + mask) * n, (3 * e + mask) * n)]
