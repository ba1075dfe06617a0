"""Kernels: one GPU (or CPU) kernel of a training step's forward and its
backward, priced by the roofline of cost_models/compute.py.

The one place that says what a kernel costs, for both books: a compiled
plan prices each ATen op of its graph as a ``Kernel`` (graph_costs.node_kernel)
and ``autopar estimate`` prices a transformer layer as a list of them
(transformer_kernels.layer_kernels), so a GEMM, a fused attention or an element-wise
pass costs the same whichever front end asks.

Backward rules (the same for both): a GEMM's backward is two GEMMs of its
size (the input and the weight gradients); FlashAttention's backward is one
kernel doing 2.5 times the forward's matmul work and moving twice its bytes
(it recomputes QK^T: Dao, FlashAttention-2, 2023, sec. 3.1.2); an
element-wise op's backward is one pass, over the bytes its backward reads and
writes.
"""
from __future__ import annotations

from dataclasses import dataclass

from autopar.cost_models.compute import op_time

FLASH_CAUSAL_WORK = 0.5
"""Fraction of score blocks a causal FlashAttention kernel computes (the
blocks above the diagonal are skipped: Dao, FlashAttention-2, 2023, sec. 3.1)."""
FLASH1_SLOWDOWN = 2.0
"""FlashAttention's first generation takes twice FlashAttention-2's time: "around
2x speedup compared to FlashAttention" (Dao, FlashAttention-2, 2023, abstract;
25-40% of the A100's peak against 50-73%)."""
FLASH_BACKWARD_WORK = 2.5
"""FlashAttention backward / forward matmul work: 5 GEMMs against 2, since the
backward recomputes QK^T (Dao, FlashAttention-2, 2023, Sec. 3.1.2)."""


@dataclass(frozen=True)
class Kernel:
    """One kernel of the forward pass and its backward, on one device."""

    name: str
    fwd_flops: float
    """FLOPs the forward kernel executes."""
    fwd_bytes: float
    """Bytes the forward kernel reads and writes."""
    bwd_flops: float
    """FLOPs of the backward kernels (all of them)."""
    bwd_bytes: float
    """Bytes the backward kernels read and write (all of them)."""
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
    bwd_kernels: int = 1
    """Kernels the backward launches, each doing an equal share of its work
    (a GEMM's two: the input and the weight gradients)."""

    def seconds(self, device, dtype: str) -> tuple[float, float]:
        """(forward, backward) seconds on ``device`` in compute dtype ``dtype``."""
        fwd = op_time(self.fwd_flops, self.fwd_bytes, device, dtype, matmul=self.matmul, special=self.special,
                      synchronous_mma=self.synchronous_mma, overlap_special=self.overlap_special)
        k = self.bwd_kernels
        bwd = k * op_time(self.bwd_flops / k, self.bwd_bytes / k, device, dtype, matmul=self.matmul,
                          special=self.special / k, synchronous_mma=self.synchronous_mma,
                          overlap_special=self.overlap_special)
        return self.slowdown * fwd, self.slowdown * bwd

    def scaled(self, k: float) -> "Kernel":
        """The same kernel on ``1/k`` of its work (a shard of it)."""
        return Kernel(self.name, self.fwd_flops / k, self.fwd_bytes / k, self.bwd_flops / k, self.bwd_bytes / k,
                      self.matmul, self.attention_core, self.shape, self.special / k, self.slowdown,
                      self.synchronous_mma, self.overlap_special, self.bwd_kernels)


def gemm(name: str, m: float, k: float, n: float, e: float, batch: float = 1, attention_core: bool = False,
         extra_bytes: float = 0.0) -> Kernel:
    """(m x k) @ (k x n) in ``e``-byte elements; the backward is two GEMMs of
    the same size (input and weight gradients). ``extra_bytes``: read and
    written beside the three matrices (a bias)."""
    flops = 2.0 * batch * m * k * n
    nbytes = float(e) * batch * (m * k + k * n + m * n) + extra_bytes
    return Kernel(name, flops, nbytes, 2 * flops, 2 * nbytes, True, attention_core, (batch, m, k, n), bwd_kernels=2)


def matmul_op(name: str, flops: float, nbytes: float) -> Kernel:
    """A GEMM-like op given its forward FLOPs and bytes (a captured linear,
    matmul, convolution): its backward is two such GEMMs."""
    return Kernel(name, flops, nbytes, 2 * flops, 2 * nbytes, True, bwd_kernels=2)


def stream(name: str, fwd_bytes: float, bwd_bytes: float, attention_core: bool = False, flops: float = 0.0) -> Kernel:
    """A memory-bound (element-wise, reduction, copy) kernel and its backward pass."""
    return Kernel(name, flops, fwd_bytes, flops, bwd_bytes, False, attention_core)


def flash_attention(scores: float, head_dim: int, nbytes: float, *, causal: bool, slowdown: float = 1.0,
                    synchronous_mma: bool = True, overlap_special: bool = False, shape: tuple = ()) -> Kernel:
    """A fused attention of ``scores`` query-key pairs (B H Sq Sk) at
    ``head_dim``, reading and writing ``nbytes`` (Q, K, V and the output):
    QK^T and PV, 4 d FLOPs per score element it computes (half of them under
    a causal mask), one exponential each; the backward does
    FLASH_BACKWARD_WORK times the matmul work, moves twice the bytes and
    evaluates the exponentials again."""
    computed = scores * (FLASH_CAUSAL_WORK if causal else 1.0)
    flops = 4.0 * head_dim * computed
    return Kernel("flash-attention", flops, nbytes, FLASH_BACKWARD_WORK * flops, 2 * nbytes, True, True, shape,
                  special=computed, slowdown=slowdown, synchronous_mma=synchronous_mma,
                  overlap_special=overlap_special)
