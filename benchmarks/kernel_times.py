"""Predicted vs measured kernel times: GEMMs and attention at transformer shapes.

    python benchmarks/kernel_times.py [--cluster NAME] [--write]     # on a CUDA GPU
    python benchmarks/kernel_times.py --device cpu                   # the same code, small shapes

Every matmul kernel of one transformer layer on one GPU, as ``autopar
estimate`` prices it (cost_models/transformer.py ``layer_kernels``: the QKV,
attention-output, MLP-in and MLP-out GEMMs and FlashAttention), is run at the
shapes of SHAPES, timed forward and backward (the GEMM's backward: its input-
and weight-gradient GEMMs; attention: ``scaled_dot_product_attention``'s
backward), the median of ``--repeats`` runs after warm-up, and set against
the cost model's ``op_time`` on ``--cluster`` (default: the preset of this
GPU, ``cpu`` on the CPU). ``--write`` puts the table into docs/validation.md
as its section 3 (GPU only; benchmarks/validate_cost_model.py keeps it when it
rewrites the rest). Nothing else in the project needs a GPU.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from autopar.cost_models.calibrate import gpu_preset
from autopar.cost_models.cluster import Cluster, get_cluster
from autopar.cost_models.kernels import Kernel
from autopar.cost_models.transformer_kernels import layer_kernels
from autopar.cost_models.transformer_plan import TrainingPlan, TransformerConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "validation.md")
SECTION = "## 3. Kernel times on a GPU"
"""The heading that starts this script's part of docs/validation.md (to its end)."""

GPU_SHAPES = (
    ("GPT-3 175B, t = 8", TransformerConfig(96, 12288, 96, 2048, 51200), TrainingPlan(batch=1, microbatch=1, tp=8)),
    ("GPT 1.3B, t = 1, b = 4", TransformerConfig(24, 2048, 16, 2048, 51200), TrainingPlan(batch=4, microbatch=4)),
    ("Llama 3 8B, t = 1", TransformerConfig(32, 4096, 32, 8192, 128256, kv_heads=8, ffn_hidden=14336, swiglu=True),
     TrainingPlan(batch=1, microbatch=1)),
    ("Llama 3 70B, t = 8", TransformerConfig(80, 8192, 64, 8192, 128256, kv_heads=8, ffn_hidden=28672, swiglu=True),
     TrainingPlan(batch=1, microbatch=1, tp=8)),
)
"""Layers of published models on one GPU of their tensor-parallel group, bf16."""

CPU_SHAPES = (
    ("GPT h = 256, b = 2", TransformerConfig(2, 256, 4, 128, 512), TrainingPlan(batch=2, microbatch=2, precision="fp32")),
    ("Llama h = 256, GQA, t = 2", TransformerConfig(2, 256, 4, 128, 512, kv_heads=2, ffn_hidden=512, swiglu=True),
     TrainingPlan(batch=1, microbatch=1, tp=2, precision="fp32")),
)
"""The same kernels at sizes a CPU runs in moments (fp32), for tests."""

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def default_cluster(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device)
    preset = gpu_preset(name)
    if preset:
        return preset
    raise SystemExit(f"no preset for GPU {name!r}; give --cluster (a preset, or a profile from autopar calibrate)")


def _median_seconds(fn, device: torch.device, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
    return statistics.median(times)


def measure(kernel: Kernel, dtype: torch.dtype, device: torch.device, repeats: int) -> tuple[float, float]:
    """(forward, backward) seconds of ``kernel`` run at its shape."""
    make = lambda *shape: torch.randn(*shape, dtype=dtype, device=device)  # noqa: E731
    if kernel.name == "flash-attention":
        b, hq, hkv, s, d = kernel.shape
        # grouped key/value heads are repeated for every query head beforehand
        # (outside the timing), so that every backend runs its fused kernel
        q, k, v = (make(b, hq, s, d).requires_grad_() for _ in range(3))
        grad = make(b, hq, s, d)

        def forward():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # the graph its backward runs over
        backward = lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True)  # noqa: E731
        return _median_seconds(forward, device, repeats), _median_seconds(backward, device, repeats)
    batch, m, k, n = (int(x) for x in kernel.shape)
    x, w, dy = make(batch, m, k), make(batch, k, n), make(batch, m, n)
    fwd = _median_seconds(lambda: torch.bmm(x, w), device, repeats)
    bwd = _median_seconds(lambda: (torch.bmm(dy, w.transpose(1, 2)), torch.bmm(x.transpose(1, 2), dy)),
                          device, repeats)
    return fwd, bwd


def predict(kernel: Kernel, cluster: Cluster, precision: str) -> tuple[float, float]:
    return kernel.seconds(cluster.device, precision)


def rows(shapes, cluster: Cluster, device: torch.device, repeats: int) -> list[dict]:
    out = []
    for label, model, plan in shapes:
        for kernel in layer_kernels(model, plan):
            if not kernel.matmul:
                continue  # element-wise kernels: timed by autopar calibrate per op, not here
            measured = measure(kernel, DTYPES[plan.precision.value], device, repeats)
            predicted = predict(kernel, cluster, plan.precision.value)
            out.append({"shape": label, "kernel": kernel.name, "dims": kernel.shape,
                        "predicted": predicted, "measured": measured})
    return out


def _error(predicted: float, measured: float) -> float:
    return (predicted - measured) / measured


def mape(table: list[dict]) -> float:
    errors = [abs(_error(p, m)) for r in table for p, m in zip(r["predicted"], r["measured"]) if m > 0]
    return sum(errors) / len(errors)


def report(table: list[dict], cluster: Cluster, device_name: str, repeats: int, gpu: bool = True) -> str:
    dev = cluster.device
    timer = "CUDA events" if gpu else "time.perf_counter"
    lines = [
        SECTION, "",
        f"Written by `python benchmarks/kernel_times.py --write` on {device_name}, against the `{cluster.name}` "
        f"cluster (GEMM efficiency {dev.gemm_efficiency}, GEMM latency {dev.gemm_latency * 1e6:.0f} us, "
        f"memory {dev.streaming_bandwidth / 1e9:.0f} GB/s). Each time is the median of {repeats} runs after "
        f"warm-up, timed with {timer}; a GEMM's backward is its input- and weight-gradient GEMMs, the "
        "attention's is `scaled_dot_product_attention`'s backward (causal; grouped key/value heads repeated "
        "for every query head before timing).", "",
        "| layer | kernel | shape | predicted fwd (ms) | measured fwd (ms) | error | predicted bwd (ms) "
        "| measured bwd (ms) | error |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in table:
        (pf, pb), (mf, mb) = r["predicted"], r["measured"]
        dims = " x ".join(str(int(x)) for x in r["dims"])
        lines.append(f"| {r['shape']} | {r['kernel']} | {dims} | {pf * 1e3:.3f} | {mf * 1e3:.3f} | "
                     f"{_error(pf, mf):+.1%} | {pb * 1e3:.3f} | {mb * 1e3:.3f} | {_error(pb, mb):+.1%} |")
    lines += ["", f"**MAPE {mape(table):.1%}** over forward and backward.", ""]
    return "\n".join(lines)


def write_section(text: str, path: str = DOC) -> None:
    """Replace section 3 of docs/validation.md (from its heading to the end), or append it."""
    with open(path) as f:
        doc = f.read()
    head = doc.split(SECTION)[0].rstrip("\n")
    with open(path, "w") as f:
        f.write(head + "\n\n" + text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--cluster", help="preset or profile JSON (default: this GPU's preset, or cpu)")
    ap.add_argument("--repeats", type=int, help="timed runs per kernel (default 20 on a GPU, 3 on the CPU)")
    ap.add_argument("--write", action="store_true", help="write section 3 of docs/validation.md (GPU only)")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    gpu = device.type == "cuda"
    if args.write and not gpu:
        raise SystemExit("--write records GPU kernel times; on the CPU the table is printed only")
    cluster = get_cluster(args.cluster or default_cluster(device))
    repeats = args.repeats or (20 if gpu else 3)
    table = rows(GPU_SHAPES if gpu else CPU_SHAPES, cluster, device, repeats)
    name = torch.cuda.get_device_name(device) if gpu else "the CPU"
    text = report(table, cluster, name, repeats, gpu)
    print(text)
    if not gpu:
        print("(on the CPU: the cpu profile describes one of the ranks `autopar calibrate` ran at once, "
              "sharing the cores; one process here has them all, so it runs faster than predicted)")
    if args.write:
        write_section(text)
        print(f"wrote section 3 of {os.path.relpath(DOC, REPO)}: MAPE {mape(table):.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
