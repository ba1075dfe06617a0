"""Compute time of one operator: a roofline over FLOPs and bytes moved, with
the device's calibrated efficiencies.

    GEMM:  gemm_latency + max(F / (peak * gemm_efficiency * m), B / streaming_bw) + X / sfu_rate
    other: op_latency   + max(F / peak,                         B / streaming_bw)

X counts the special-function evaluations (exponentials) a fused kernel such as
FlashAttention does between its GEMMs, on units that run beside the tensor
cores but, in FlashAttention-2, not at the same time (``Device.special_function_rate``);
a kernel that overlaps them with its GEMMs (FlashAttention-3) takes the larger
of the two instead of their sum. m is 1, or ``Device.synchronous_mma_fraction``
for a kernel written for Ampere's tensor-core instructions.

The fixed latency is what makes a small GEMM reach a smaller fraction of peak
than a large one (``Device.gemm_curve``); both constants come from the cluster
description (datasheet, paper or ``autopar calibrate``; cost_models/cluster.py).
"""
from __future__ import annotations

from autopar.cost_models.cluster import Device

FLASH_CAUSAL_WORK = 0.5
"""Fraction of score blocks a causal FlashAttention kernel computes (the upper triangle is skipped)."""


def op_time(flops: float, nbytes: float, device: Device, dtype: str = "fp32", *, matmul: bool = False,
            measured: float = 0.0, special: float = 0.0, synchronous_mma: bool = False,
            overlap_special: bool = False) -> float:
    """Seconds for an op doing ``flops`` and moving ``nbytes`` to and from
    memory; ``measured``: what the device's measured per-element rate for
    this kind of op gives (Device.element_seconds), a third bound;
    ``special``: special-function evaluations of a fused GEMM kernel, priced
    where the device gives their rate, after its GEMMs or, with
    ``overlap_special``, beside them; ``synchronous_mma``: the kernel issues
    Ampere's tensor-core instructions (Device.synchronous_mma_fraction)."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    peak = device.flops(dtype)
    memory = nbytes / device.streaming_bandwidth
    if matmul:
        rate = peak * device.gemm_efficiency * (device.synchronous_mma_fraction if synchronous_mma else 1.0)
        sfu = special / device.special_function_rate if special and device.special_function_rate else 0.0
        if overlap_special:
            return device.gemm_latency + max(flops / rate, sfu, memory)
        return device.gemm_latency + max(flops / rate, memory) + sfu
    return device.op_latency + max(flops / peak, memory, measured)

