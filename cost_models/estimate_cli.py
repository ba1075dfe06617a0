"""``autopar estimate`` and ``autopar calibrate``: argument parsing and printing.

The CLI calls ``estimate_main(argv)`` / ``calibrate_main(argv)``; both return an
exit status (0 ok, 2 bad input) and print errors as one line naming the rule.
"""
from __future__ import annotations

import argparse
import json
import sys

from autopar.cost_models.cluster import cluster_names, get_cluster
from autopar.cost_models.transformer import StepEstimate, estimate
from autopar.cost_models.optimizer import OPTIMIZER_STATES
from autopar.cost_models.transformer_plan import (AttentionKernel, Kernels, Precision, Recompute, TrainingPlan,
                                                  TransformerConfig)
from autopar.errors import AutoparError


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def estimate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autopar estimate",
        description="Predict step time, throughput and memory of a GPT/Llama-style transformer "
                    "under a hand-written plan, with the same cost model autopar compile uses.")
    model = ap.add_argument_group("model")
    model.add_argument("--layers", type=_positive_int, required=True)
    model.add_argument("--hidden", type=_positive_int, required=True)
    model.add_argument("--heads", type=_positive_int, required=True)
    model.add_argument("--kv-heads", type=_positive_int, help="key/value heads (grouped-query attention)")
    model.add_argument("--ffn-hidden", type=_positive_int, help="MLP hidden size (default 4h; 8h/3 with --swiglu)")
    model.add_argument("--swiglu", action="store_true", help="Llama block: SwiGLU MLP, no biases, no dropout")
    model.add_argument("--untied-embeddings", action="store_true",
                       help="the output layer has its own weights (Llama 2/3), not the word embeddings")
    model.add_argument("--no-dropout", action="store_true",
                       help="GPT block trained without dropout (p = 0: MPT, GPT-NeoX, Pythia)")
    model.add_argument("--seq", type=_positive_int, required=True)
    model.add_argument("--vocab", type=_positive_int, required=True)
    plan = ap.add_argument_group("plan")
    plan.add_argument("--batch", type=_positive_int, required=True, help="global batch, sequences")
    plan.add_argument("--microbatch", type=_positive_int, required=True, help="sequences per microbatch")
    plan.add_argument("--tp", type=_positive_int, required=True)
    plan.add_argument("--pp", type=_positive_int, required=True)
    plan.add_argument("--dp", type=_positive_int, required=True)
    plan.add_argument("--cp", type=_positive_int, default=1,
                      help="context-parallel size: each sequence split over cp GPUs (ring attention; default 1)")
    plan.add_argument("--virtual-stages", type=_positive_int, default=1, help="interleaved 1F1B chunks per stage")
    plan.add_argument("--first-stage-layers", type=_positive_int,
                      help="layers on the first pipeline stage (uneven stages; default: an equal share)")
    plan.add_argument("--last-stage-layers", type=_positive_int,
                      help="layers on the last pipeline stage (uneven stages; default: an equal share)")
    plan.add_argument("--sequence-parallel", action="store_true")
    plan.add_argument("--recompute", choices=[r.value for r in Recompute], default=Recompute.NONE.value)
    plan.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=0)
    plan.add_argument("--precision", choices=[p.value for p in Precision], default=Precision.BF16.value)
    plan.add_argument("--attention", choices=[a.value for a in AttentionKernel], default=AttentionKernel.FLASH.value,
                      help="attention kernel: flash (FlashAttention-2, PyTorch's; the default), flash3 "
                           "(FlashAttention-3 or cuDNN's, Hopper), flash1 (FlashAttention's first generation or "
                           "Triton port, twice as slow as flash), unfused (Megatron-LM 2021)")
    plan.add_argument("--tp-comm-overlap", action="store_true",
                      help="overlap the tensor-parallel all-gathers and reduce-scatters with the GEMMs they feed "
                           "(Megatron-Core's --tp-comm-overlap, Transformer Engine's userbuffers; needs "
                           "--sequence-parallel)")
    plan.add_argument("--no-overlap-grad-reduce", action="store_true",
                      help="reduce the gradients after the backward instead of under it")
    plan.add_argument("--no-overlap-param-gather", action="store_true",
                      help="ZeRO's parameter all-gathers are not prefetched a layer ahead in forward and backward; "
                           "as autopar's runtime runs them: ZeRO-3's forward gathers one weight's kernel ahead, "
                           "the others blocking the compute that needs them")
    plan.add_argument("--kernels", choices=[k.value for k in Kernels], default=Kernels.MEGATRON.value,
                      help="element-wise kernels: megatron (Megatron-LM's fused ones; the default) or eager (one "
                           "per ATen op, as PyTorch eager and autopar's programs run them)")
    plan.add_argument("--optimizer", choices=sorted(OPTIMIZER_STATES), default="adamw-fused",
                      help="optimizer and its update: adamw-fused (one kernel, Megatron-LM's; the default) or "
                           "adamw (torch.optim's multi-tensor passes), ...")
    hw = ap.add_argument_group("hardware")
    hw.add_argument("--cluster", required=True, metavar="NAME",
                    help=f"preset ({', '.join(cluster_names())}) or cluster/profile JSON file")
    hw.add_argument("--nodes", type=_positive_int,
                    help="nodes (default: as many as tp * pp * dp GPUs fill; part of one node is fine)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    return ap


def estimate_from_args(args: argparse.Namespace) -> StepEstimate:
    model = TransformerConfig(
        layers=args.layers, hidden=args.hidden, heads=args.heads, seq=args.seq, vocab=args.vocab,
        kv_heads=args.kv_heads, ffn_hidden=args.ffn_hidden, swiglu=args.swiglu,
        untied_embeddings=args.untied_embeddings, no_dropout=args.no_dropout)
    plan = TrainingPlan(
        batch=args.batch, microbatch=args.microbatch, tp=args.tp, pp=args.pp, dp=args.dp, cp=args.cp,
        virtual_stages=args.virtual_stages, first_stage_layers=args.first_stage_layers,
        last_stage_layers=args.last_stage_layers, sequence_parallel=args.sequence_parallel,
        recompute=args.recompute, zero=args.zero, precision=args.precision, attention=args.attention,
        tp_comm_overlap=args.tp_comm_overlap, overlap_grad_reduce=not args.no_overlap_grad_reduce,
        overlap_param_gather=not args.no_overlap_param_gather, kernels=args.kernels, optimizer=args.optimizer)
    return estimate(model, plan, get_cluster(args.cluster), args.nodes)


def _seconds(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.3f} s"


def _stage_layers(layers: tuple) -> str:
    """(7, 8, 8, 8, 7) -> '7, 8 x 3, 7'."""
    runs = []
    for n in layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ", ".join(f"{n} x {k}" if k > 1 else str(n) for n, k in runs)


def format_estimate(est: StepEstimate, cluster: str) -> str:
    t, m = est.time, est.memory
    step = est.step_time_s
    rows = [
        ("cluster", f"{cluster}, {est.world_size} GPUs, {est.microbatches} microbatches per step"),
        ("parameters", f"{est.parameters / 1e9:.2f} B"),
        *([("layers per stage", _stage_layers(est.stage_layers))] if len(set(est.stage_layers)) > 1 else []),
        ("step time", _seconds(step)),
        ("tokens/s per GPU", f"{est.tokens_per_s_per_gpu:,.0f}"),
        ("TFLOP/s per GPU", f"{est.tflops_per_gpu:.1f} model, {est.hardware_tflops_per_gpu:.1f} with recomputation"),
        ("MFU", f"{est.mfu:.1%}"),
        ("", ""),
        ("time breakdown", ""),
    ]
    parts = (("compute", t.compute_s), ("tensor-parallel comm", t.tp_comm_s),
             *([("context-parallel comm", t.cp_comm_s)] if est.context_parallel > 1 else []),
             ("pipeline comm", t.pp_comm_s), ("data-parallel comm", t.dp_comm_s), ("pipeline bubble", t.bubble_s),
             ("optimizer step", t.optimizer_s))
    for label, value in parts:
        rows.append((f"  {label}", f"{_seconds(value):>10}  {value / step:6.1%}"))
    capacity = f"of {est.memory_capacity_bytes / 2**30:.2f} GiB" + ("" if est.fits_in_memory else ": does not fit")
    rows += [("", ""), (f"memory per GPU (stage {m.stage})", f"{m.total / 2**30:.2f} GiB {capacity}")]
    for label, value in (("parameters", m.parameters), ("gradients", m.gradients),
                         ("optimizer states", m.optimizer_states), ("activations", m.activations)):
        rows.append((f"  {label}", f"{value / 2**30:10.2f} GiB"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" if k else "" for k, v in rows)


def estimate_main(argv=None) -> int:
    args = estimate_parser().parse_args(argv)
    try:
        est = estimate_from_args(args)
    except AutoparError as e:
        print(f"autopar estimate: error: {e}", file=sys.stderr)
        return 2
    if est.caveat:
        print(f"autopar estimate: warning: cluster {args.cluster}: {est.caveat}", file=sys.stderr)
    if not est.fits_in_memory:
        m = est.memory
        print(f"autopar estimate: warning: stage {m.stage} needs {m.total / 2**30:.2f} GiB per GPU, more than the "
              f"{est.memory_capacity_bytes / 2**30:.2f} GiB a device of {args.cluster} has; a larger --zero, "
              f"--recompute, --tp or --pp, or a smaller --microbatch needs less", file=sys.stderr)
    if args.json:
        print(json.dumps(est.to_json()))
    else:
        print(format_estimate(est, args.cluster))
    return 0


def calibrate_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="autopar calibrate",
        description="Measure this machine (GEMM curve, memory bandwidth, collectives over N local ranks) "
                    "and write a cluster profile that --cluster accepts.")
    ap.add_argument("-o", "--output", required=True, help="profile JSON to write")
    ap.add_argument("--nproc", type=_positive_int, default=4, help="local ranks (default 4)")
    ap.add_argument("--backend", choices=["gloo", "nccl"], help="default: nccl with CUDA, else gloo")
    ap.add_argument("--name", help="cluster name in the profile (default: 'cpu', or the GPU name)")
    ap.add_argument("--links-from", metavar="CLUSTER",
                    help="with --nproc 1 (no collectives to time): the preset or profile whose node size and links "
                         "the profile takes (default for a known GPU: its preset)")
    return ap


def calibrate_main(argv=None) -> int:
    from autopar.cost_models.calibrate import calibrate

    args = calibrate_parser().parse_args(argv)
    try:
        cluster = calibrate(args.output, nproc=args.nproc, backend=args.backend, name=args.name,
                            links_from=args.links_from)
    except AutoparError as e:
        print(f"autopar calibrate: error: {e}", file=sys.stderr)
        return 2
    dev = cluster.device
    print(f"wrote {args.output}: {cluster.name}, {args.nproc} rank(s) measured, "
          f"GEMM {max(dev.peak_flops.values()) * dev.gemm_efficiency / 1e9:.1f} GFLOP/s "
          f"(+{dev.gemm_latency * 1e6:.0f} us), memory {dev.streaming_bandwidth / 1e9:.2f} GB/s, "
          f"link {cluster.intra_node.bandwidth / 1e9:.3f} GB/s + {cluster.intra_node.latency * 1e6:.0f} us, "
          f"runtime overhead {dev.runtime_overhead * 1e3:.3f} ms per call and pass "
          f"+ {dev.input_overhead * 1e3:.3f} ms per input + {dev.step_overhead * 1e3:.3f} ms per step, "
          f"{dev.collective_overhead * 1e3:.3f} ms per collective")
    return 0


if __name__ == "__main__":
    sys.exit(estimate_main())
