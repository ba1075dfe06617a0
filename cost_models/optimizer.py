"""The optimizer's books: what each parameter element holds (weights,
gradients, optimizer state, by precision and ZeRO stage) and what one step
of the optimizer costs, for a compiled plan (graph_costs) and for
``autopar estimate`` (transformer) alike.

An optimizer is named as ``CostContext.optimizer`` and ``TrainingPlan.
optimizer`` take it: ``sgd``, ``sgd-momentum``, ``adam``, ``adamw`` for
torch.optim's default implementation, each op of the update a separate pass
over the tensors (the multi-tensor "foreach" path torch uses on CUDA, or its
per-parameter loop on CPU), and the same names with ``-fused`` for a
one-kernel update that reads and writes each tensor once (torch.optim's
``fused=True``, apex's FusedAdam and Transformer Engine's, which Megatron-LM
runs).
"""
from __future__ import annotations

from autopar.errors import AutoparError

OPTIMIZER_STATES = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2,
                    "sgd-fused": 0, "sgd-momentum-fused": 1, "adam-fused": 2, "adamw-fused": 2}
"""fp32 optimizer state tensors per parameter (SGD none, momentum one, Adam two moments)."""

OPTIMIZER_PASSES = {"sgd": (1, 12), "sgd-momentum": (3, 32), "adam": (8, 72), "adamw": (9, 80)}
"""(ops, bytes moved per fp32 parameter element) of one torch.optim step with
its default arguments, each op a separate pass over the tensors
(torch/optim/sgd.py and adam.py, the single-tensor and foreach paths alike).
AdamW: param.mul_(1 - lr wd) 8 B, exp_avg.lerp_(grad) 12, exp_avg_sq.mul_ 8,
.addcmul_(grad, grad) 12, sqrt 8, div 8, add_(eps) 8, param.addcdiv_ 16 = 80,
and the step counter's increment; Adam the same without the weight decay (72);
SGD param.add_(grad) 12; with momentum buf.mul_ 8, buf.add_(grad) 12,
param.add_(buf) 12 = 32."""

FUSED_BYTES = {"sgd-fused": 12, "sgd-momentum-fused": 20, "adam-fused": 28, "adamw-fused": 28}
"""Bytes per parameter element of a one-kernel update, each tensor read and
written once (torch/optim/_functional fused kernels, apex FusedAdam,
Transformer Engine's FusedAdam): Adam(W) reads the weight, gradient and two
moments and writes the weight and moments, 7 x 4 B; under mixed precision it
reads the 16-bit gradient and writes the 16-bit weights beside the fp32
master (4 + 2 + 8 read, 4 + 8 + 2 written): 28 B either way. SGD with
momentum reads weight, gradient and buffer and writes two (20 B); SGD 12 B."""


def check_optimizer(optimizer: str) -> str:
    if optimizer not in OPTIMIZER_STATES:
        raise AutoparError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZER_STATES)}")
    return optimizer


def fused(optimizer: str) -> bool:
    return optimizer.endswith("-fused")


def param_bytes(precision: str, optimizer: str, itemsize: int = 4) -> dict:
    """Bytes per parameter element, by kind (Rajbhandari et al. 2020, ZeRO, sec. 3.1).

    fp32, the model as it is: weights, gradients and each optimizer state in
    the parameter's own dtype (``itemsize`` bytes: torch.optim keeps its
    states in the parameter's dtype), 4 + 4 + 8 = 16 B for Adam on float32,
    half that for a bfloat16 model. Mixed precision (bf16/fp16 compute): 2 B
    weights and 2 B gradients in the compute dtype, plus an fp32 master copy
    (4 B) with the fp32 states: 2 + 2 + 12 = 16 B for Adam."""
    states = OPTIMIZER_STATES[check_optimizer(optimizer)]
    if precision == "fp32":
        return {"parameters": itemsize, "gradients": itemsize, "optimizer": itemsize * states}
    return {"parameters": 2, "gradients": 2, "optimizer": 4 + 4 * states}


def state_bytes(elements: float, precision: str, optimizer: str, shards: tuple = (1, 1, 1),
                itemsize: int = 4) -> dict:
    """Bytes of ``elements`` parameter elements by kind, each kind divided
    over its ``shards`` (parameters, gradients, optimizer): ZeRO stage 1
    shards the optimizer state, 2 the gradients too, 3 the weights too."""
    kinds = param_bytes(precision, optimizer, itemsize)
    return {kind: kinds[kind] * elements / n for kind, n in zip(("parameters", "gradients", "optimizer"), shards)}


def step_temporary_bytes(elements: float, precision: str, optimizer: str, itemsize: int = 4) -> float:
    """Temporaries of one optimizer step over ``elements``: torch.optim's
    multi-tensor Adam/AdamW computes sqrt(v) out of place, one tensor per
    parameter in its state's dtype (torch/optim/adam.py, _multi_tensor_adam:
    torch._foreach_sqrt(exp_avg_sqs)); SGD updates in place, and a fused
    update keeps its intermediates in registers."""
    if OPTIMIZER_STATES[check_optimizer(optimizer)] < 2 or fused(optimizer):
        return 0.0
    return elements * (itemsize if precision == "fp32" else 4)  # mixed precision: fp32 states


def update_bytes(optimizer: str) -> float:
    """Bytes the update moves per parameter element (OPTIMIZER_PASSES, FUSED_BYTES)."""
    check_optimizer(optimizer)
    return FUSED_BYTES[optimizer] if fused(optimizer) else OPTIMIZER_PASSES[optimizer][1]


def update_launches(optimizer: str) -> int:
    """Kernels the update launches per parameter tensor."""
    check_optimizer(optimizer)
    return 1 if fused(optimizer) else OPTIMIZER_PASSES[optimizer][0]


def step_seconds(elements: float, optimizer: str, device, per_tensor_launches: bool = False) -> float:
    """One optimizer step over ``elements`` parameter elements on ``device``:
    ``update_bytes`` per element at its streaming bandwidth, plus each
    kernel's launch where the update runs per tensor (``per_tensor_launches``:
    torch.optim on CPU ranks loops over the parameters one by one;
    torch/optim/optimizer.py, _default_to_fused_or_foreach: the multi-tensor
    path is the default for CUDA tensors only, and launches once for many
    parameters)."""
    launches = update_launches(optimizer) * device.op_latency if per_tensor_launches else 0.0
    return launches + elements * update_bytes(optimizer) / device.streaming_bandwidth


def device_peak(state: float, gradients: float, activations: float, temporaries: float,
                persistent_gradients: bool) -> float:
    """Peak bytes of a device over a step: its ``state`` (weights, optimizer
    state, inputs) always; the ``activations`` (with backward's working set)
    peak as backward starts, and the gradients fill in as they are freed;
    the optimizer step's ``temporaries`` come with the gradients at the end.
    Where gradients persist through the step (``persistent_gradients``: a
    contiguous gradient buffer, accumulation over microbatches, a pipeline
    stage's) they sit beside the activations instead."""
    if persistent_gradients:
        return state + gradients + max(activations, temporaries)
    return state + max(activations, gradients + temporaries)
