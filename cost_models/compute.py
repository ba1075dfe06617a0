"""Compute time of one operator: a roofline over FLOPs and bytes moved, with
the device's calibrated efficiencies.

    GEMM:  gemm_latency + max(F / (peak * gemm_efficiency), B / streaming_bw)
    other: op_latency   + max(F / peak,                     B / streaming_bw)

The fixed latency is what makes a small GEMM reach a smaller fraction of peak
than a large one (``Device.gemm_curve``); both constants come from the cluster
description (datasheet, paper or ``autopar calibrate``; cost_models/cluster.py).
"""
from __future__ import annotations

from autopar.cost_models.cluster import Device


def op_time(flops: float, nbytes: float, device: Device, dtype: str = "fp32", *, matmul: bool = False,
            measured: float = 0.0) -> float:
    """Seconds for an op doing ``flops`` and moving ``nbytes`` to and from
    memory; ``measured``: what the device's measured per-element rate for
    this kind of op gives (Device.element_seconds), a third bound."""
    if flops <= 0 and nbytes <= 0:
        return 0.0
    peak = device.flops(dtype)
    memory = nbytes / device.streaming_bandwidth
    if matmul:
        return device.gemm_latency + max(flops / (peak * device.gemm_efficiency), memory)
    return device.op_latency + max(flops / peak, memory, measured)

