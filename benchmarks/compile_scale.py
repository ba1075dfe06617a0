"""Compile time and peak memory of the planner at scale (issue: compile at scale).

    python benchmarks/compile_scale.py            # the table below, each size in its own process
    python benchmarks/compile_scale.py --one 175B # a single row
    python benchmarks/compile_scale.py --pipelined 175B [--layers 80] [--devices 2048] [--cache DIR]
    python benchmarks/compile_scale.py --examples  # examples/ on 2x2: wall, solver status, ILP size
    python benchmarks/compile_scale.py --hf        # Hugging Face tiny configs on 2x2, the same columns
    python benchmarks/compile_scale.py --gpt3      # GPT-3 175B on 1024 GPUs, the default command (fp16),
                                                   # against the best hand grid `autopar estimate` prices

GPT configurations from the GPT-3 paper (Brown et al. 2020, Table 2.1) and the
1T row of Narayanan et al. 2021 (Table 1), built on the meta device; meshes put
8-way groups inside dgx-a100 nodes (the last axis) and the rest across nodes.
Mixed precision (bf16) pricing. Then, on a small model, the clustered solve's
objective against the unclustered one, and what the plan cache's solved
layer classes (``--cache``) and solving the stage ILPs in parallel save.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

# name: (hidden, layers, heads, global batch, devices, mesh)
MODELS = {
    "1.3B": (2048, 24, 16, 512, 8, (1, 8)),
    "13B": (5120, 40, 40, 1024, 64, (8, 8)),
    "175B": (12288, 96, 96, 1536, 1024, (128, 8)),
    "1T": (25600, 128, 160, 3072, 3072, (384, 8)),
}
SEQ, VOCAB = 2048, 51200


def one(name: str) -> dict:
    import torch

    import autopar
    from gpt import GPT, GPTConfig, lm_loss

    hidden, layers, heads, batch, devices, mesh = MODELS[name]
    t0 = time.perf_counter()
    cfg = GPTConfig(vocab=VOCAB, seq=SEQ, hidden=hidden, heads=heads, layers=layers)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, VOCAB, (batch, SEQ))
        target = torch.randint(0, VOCAB, (batch, SEQ))
    build = time.perf_counter() - t0
    # Without recomputation or pipelining the activations of these batches do
    # not fit in 80 GB; the memory row is relaxed here to time the planner.
    plan = autopar.compile(model, (idx, target), mesh=mesh, cluster="dgx-a100", loss_fn=lm_loss,
                           precision="bf16", memory=1e18, pipeline_stages=1)  # the flat table
    total = time.perf_counter() - t0
    t = plan.solver["timings"]
    return {"model": name, "devices": devices, "mesh": "x".join(map(str, mesh)), "total_s": total,
            "build_s": build, "capture_s": t["capture_s"], "strategies_s": t["strategies_s"],
            "solve_s": t["solve_s"], "variables": plan.solver["variables"],
            "solved_nodes": plan.solver["solved_nodes"], "nodes": len(plan.nodes),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "step_s": plan.predicted["step_time_s"], "mfu": plan.predicted["mfu"]}


def pipelined(name: str, layers: int | None = None, devices: int | None = None, cache: str | None = None) -> dict:
    """The full compile with the memory row enforced: the planner factors the
    devices into pp x dp x tp and searches stages, microbatches and schedule.
    ``layers`` / ``devices`` change the depth or the device count of a row."""
    import torch

    import autopar
    from gpt import GPT, GPTConfig, lm_loss

    hidden, depth, heads, batch, world, _ = MODELS[name]
    layers, devices = layers or depth, devices or world
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, hidden=hidden, heads=heads, layers=layers))
        idx = torch.randint(0, VOCAB, (batch, SEQ))
    plan = autopar.compile(model, (idx, idx), mesh=devices, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16",
                           pipeline_stages="auto", cache=cache)
    pl = plan.pipeline or {}
    return {"model": name, "layers": layers, "devices": devices, "total_s": time.perf_counter() - t0,
            "mesh": str(plan.mesh), "schedule": pl.get("schedule", "none"), "microbatches": pl.get("microbatches", 0),
            "peak_rss_gb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6,
            "step_s": plan.predicted["step_time_s"], "memory_gib": plan.predicted["peak_memory_bytes"] / 2**30,
            "layer_cache": plan.solver["pipeline_search"].get("layer_cache")}


def stage_ilps(workers: int, cache: str | None) -> dict:
    """The example GPT on a given pp=2,dp=2,tp=2 mesh: a stage ILP on the whole
    graph per microbatch count tried, solved by ``workers`` processes."""
    env = dict(os.environ, AUTOPAR_SOLVE_WORKERS=str(workers))
    out = os.path.join(HERE, "..", "out", "compile_scale_stage_ilps.json")
    cmd = ["autopar", "compile", "examples/gpt.py:demo", "--mesh", "pp=2,dp=2,tp=2", "--cluster", "dgx-a100",
           "-q", "-o", out] + (["--cache", cache] if cache else [])
    t0 = time.perf_counter()
    subprocess.run(cmd, env=env, cwd=os.path.join(HERE, ".."), check=True, capture_output=True)
    wall = time.perf_counter() - t0
    solver = json.load(open(out))["solver"]
    return {"wall_s": wall, "planner_s": solver["wall_s"], "layer_cache": solver["pipeline_search"]["layer_cache"],
            "ilps": len(solver["pipeline_search"]["microbatches_tried"])}


# (layers, hidden, heads, seq, vocab, batch, mesh): small GPTs whose
# unclustered ILP solves in seconds to a minute here, on 1-D and 2-D meshes
GAP_MODELS = [
    (4, 1024, 16, 128, 1024, 8, (2, 4)),
    (4, 512, 8, 128, 1024, 8, (2, 4)),
    (5, 128, 4, 32, 256, 8, (2, 4)),
    (6, 256, 8, 64, 512, 16, (8,)),
    (3, 768, 12, 256, 2048, 8, (2, 2)),
    (4, 256, 8, 64, 512, 16, (4,)),
]


def clustered_vs_unclustered(layers, hidden, heads, seq, vocab, batch, mesh) -> dict:
    import torch

    import autopar
    from gpt import GPT, GPTConfig, lm_loss

    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab, (batch, cfg.seq))
        target = torch.randint(0, cfg.vocab, (batch, cfg.seq))
    out = {}
    for clustered in (True, False):
        t = time.perf_counter()
        plan = autopar.compile(model, (idx, target), mesh=mesh, cluster="dgx-a100", loss_fn=lm_loss,
                               cluster_layers=clustered, time_limit_s=300)
        out[clustered] = (plan.solver["objective"], time.perf_counter() - t, plan.solver["status"],
                          plan.solver.get("layer_classes") or [])
    return {"clustered": out[True], "unclustered": out[False], "gap": out[True][0] / out[False][0] - 1}


EXAMPLES = ["examples/" + s for s in ("mlp.py:small", "cnn.py:small", "gpt.py:small", "gpt.py:demo", "tied.py:small",
                                      "bert.py:small", "vit.py:small", "llama.py:small", "resnet.py:small",
                                      "moe.py:small")]
"""examples/ factories at the README's mesh, 2x2 of dgx-a100 (issue 28: each in 5 s, OPTIMAL)."""

HF = ["tests/fixtures/hf.py:llama", "tests/fixtures/hf.py:qwen2", "tests/fixtures/hf.py:gptj",
      "benchmarks/model_zoo.py:hf_whisper", "tests/fixtures/hf.py:mamba", "tests/fixtures/hf.py:deepseek_v3"]
"""Hugging Face transformers' tiny configs (issue 28: each in 15 s on 2x2)."""


def example(spec: str, mesh: str = "2x2", time_limit_s: float = 60.0) -> dict:
    """One model's whole compile: wall time, the solver's status and the ILP's size."""
    import warnings

    import autopar
    from autopar.runtime import load_factory

    model, inputs, loss = load_factory(os.path.join(HERE, "..", spec))
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = autopar.compile(model, inputs, mesh=mesh, cluster="dgx-a100", loss_fn=loss, time_limit_s=time_limit_s)
    s = plan.solver
    return {"model": spec.split("/")[-1], "mesh": mesh, "wall_s": time.perf_counter() - t0, "status": s["status"],
            "variables": s["variables"], "constraints": s["constraints"], "solve_s": s["timings"]["solve_s"],
            "objective_ms": s["objective"] * 1e3, "nodes": len(plan.nodes), "as_lp": s.get("solved_as_lp"),
            "load": os.getloadavg()[0]}


def examples(specs: list = EXAMPLES) -> None:
    """Each model in its own process; load: the 1-minute load average when it ended."""
    print(f"{'model':>20} {'mesh':>5} {'wall s':>7} {'solve s':>8} {'status':>9} {'vars':>7} {'constr.':>8} "
          f"{'objective ms':>13} {'LP':>3} {'load':>5}")
    for spec in specs:
        r = _row("--example", spec)
        if r is not None:
            print(f"{r['model']:>20} {r['mesh']:>5} {r['wall_s']:>7.1f} {r['solve_s']:>8.1f} {r['status']:>9} "
                  f"{r['variables']:>7} {r['constraints']:>8} {r['objective_ms']:>13.4f} {r['as_lp'] or 0:>3} "
                  f"{r['load']:>5.1f}", flush=True)


def gpt3() -> dict:
    """GPT-3 175B (Brown et al. 2020) on 1024 A100s, the default command
    (no pipeline flag: the search runs since the mesh spans 128 nodes), fp16
    pricing; and the fastest hand grid `autopar estimate` prices that fits in
    80 GB: TP x PP x DP x microbatch x recomputation x virtual stages x
    sequence parallelism x ZeRO-1."""
    import torch

    import autopar
    from autopar.cost_models.cluster import get_cluster
    from autopar.cost_models.transformer import estimate
    from autopar.cost_models.transformer_plan import TrainingPlan, TransformerConfig
    from autopar.errors import AutoparError
    from gpt import GPT, GPTConfig, lm_loss

    hidden, layers, heads, batch, world, _ = MODELS["175B"]
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=VOCAB, seq=SEQ, hidden=hidden, heads=heads, layers=layers))
        idx = torch.randint(0, VOCAB, (batch, SEQ))
    plan = autopar.compile(model, (idx, idx), mesh=world, cluster="dgx-a100", loss_fn=lm_loss, precision="fp16")
    wall = time.perf_counter() - t0
    chosen = plan.solver["pipeline_search"]["pipelined"] or {}
    cfg = TransformerConfig(layers=layers, hidden=hidden, heads=heads, seq=SEQ, vocab=VOCAB)
    cluster = get_cluster("dgx-a100")

    def priced(tp, pp, dp, mb, v, rc, sp, zero, runtime):
        try:
            est = estimate(cfg, TrainingPlan(batch=batch, microbatch=mb, tp=tp, pp=pp, dp=dp, virtual_stages=v,
                                             recompute=rc, sequence_parallel=sp, zero=zero, precision="fp16",
                                             **runtime), cluster, world // 8)
        except AutoparError:
            return None
        return est.step_time_s if est.fits_in_memory else None

    def grid(runtime):
        best = None
        for tp in (1, 2, 4, 8):
            for pp in (p for p in (1, 2, 4, 8, 12, 16, 24, 32, 48, 96) if layers % p == 0 and world % (tp * p) == 0):
                dp = world // (tp * pp)
                for mb in (b for b in (1, 2, 4, 8) if batch % (dp * b) == 0):
                    for v in (1, 2, 3, 4, 6, 8, 12):
                        if v > 1 and (pp == 1 or layers % (pp * v)):
                            continue
                        for rc in ("none", "selective", "full"):
                            for sp in (False, True):
                                for zero in (0, 1):
                                    t = priced(tp, pp, dp, mb, v, rc, sp, zero, runtime)
                                    if t is not None and (best is None or t < best[0]):
                                        best = (t, f"tp={tp} pp={pp} dp={dp} mb={mb} v={v} {rc}"
                                                   f"{' sp' if sp else ''}{' zero-1' if zero else ''}")
        return best

    megatron = grid({})
    ours = grid(AUTOPAR_RUNTIME)
    # the planner's plan priced by the estimate for the runtime that runs it (ZeRO-1: the pipeline's
    # optimizer shards); its stage ILP chooses sequence parallelism op by op, so the better of the two
    tp, pp, dp = chosen["submesh"][-1], chosen["stages"], chosen["dp"]
    again = [t for sp in (False, True) if (t := priced(tp, pp, dp, chosen["microbatch"], chosen["virtual_stages"],
                                                       chosen["recompute"], sp, 1, AUTOPAR_RUNTIME)) is not None]
    return {"wall_s": wall, "mesh": str(plan.mesh), "step_s": plan.predicted["step_time_s"],
            "schedule": f"{chosen.get('schedule')} x{chosen.get('virtual_stages')}",
            "recompute": chosen.get("recompute"), "hand_s": megatron[0], "hand": megatron[1],
            "ours_hand_s": ours[0], "ours_hand": ours[1], "plan_estimate_s": min(again) if again else None,
            "load": os.getloadavg()[0]}


AUTOPAR_RUNTIME = dict(kernels="eager", optimizer="adamw", overlap_param_gather=False, overlap_grad_reduce=False)
"""``autopar estimate``'s switches for what autopar's pipelined program runs: one ATen kernel per op,
torch.optim's AdamW, the ZeRO-1 shards all-gathered at the start of the next step and the gradients
reduce-scattered once after the last microbatch (autopar/pipeline_runtime.py), not under compute."""


def _row(flag: str, name: str, *extra: str) -> dict | None:
    """One benchmark row in a fresh process (so that its peak RSS is its own)."""
    proc = subprocess.run([sys.executable, __file__, flag, name, *extra], capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"{name:>6} failed: {proc.stderr.strip().splitlines()[-1]}")
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--one", choices=sorted(MODELS))
    ap.add_argument("--pipelined", choices=sorted(MODELS))
    ap.add_argument("--layers", type=int, help="with --pipelined: another depth")
    ap.add_argument("--devices", type=int, help="with --pipelined: another device count")
    ap.add_argument("--cache", help="with --pipelined: a plan cache directory")
    ap.add_argument("--gaps", action="store_true", help="only the clustered-vs-unclustered table")
    ap.add_argument("--flat", action="store_true", help="only the flat (no pipeline) table")
    ap.add_argument("--examples", action="store_true", help="only the examples/ table (2x2, dgx-a100)")
    ap.add_argument("--example", help="one model, FILE.py:FACTORY from the repository's root")
    ap.add_argument("--hf", action="store_true", help="only the Hugging Face table (2x2, dgx-a100)")
    ap.add_argument("--gpt3", action="store_true", help="only GPT-3 175B's default command against the hand grids")
    args = ap.parse_args()
    if args.example:
        print(json.dumps(example(args.example)))
        return
    if args.examples:
        examples()
        return
    if args.hf:
        examples(HF)
        return
    if args.gpt3:
        r = gpt3()
        again = f"{r['plan_estimate_s']:.3f} s" if r["plan_estimate_s"] is not None else \
            "n/a: its chunks hold unequal layer counts, which estimate does not price"
        print(f"GPT-3 175B, 1024 GPUs, default command, fp16: {r['wall_s']:.1f} s, {r['mesh']} {r['schedule']} "
              f"recompute {r['recompute']}: {r['step_s']:.3f} s (priced by `estimate` for autopar's runtime: "
              f"{again}); load {r['load']:.1f}")
        print(f"best hand grid, autopar's runtime (eager kernels, torch AdamW, blocking ZeRO-1 gathers and "
              f"reductions): {r['ours_hand']}: {r['ours_hand_s']:.3f} s")
        print(f"best hand grid, Megatron-LM's runtime (fused kernels and Adam, overlapped reductions and "
              f"gathers): {r['hand']}: {r['hand_s']:.3f} s")
        return
    if args.gaps:
        gaps()
        return
    if args.one:
        print(json.dumps(one(args.one)))
        return
    if args.pipelined:
        print(json.dumps(pipelined(args.pipelined, args.layers, args.devices, args.cache)))
        return
    print(f"{'model':>6} {'GPUs':>5} {'mesh':>7} {'total s':>8} {'capture':>8} {'strat.':>7} {'solve':>7} "
          f"{'nodes':>6} {'solved':>6} {'vars':>7} {'RSS GB':>7} {'pred. step s':>12} {'MFU':>6}")
    for name in MODELS:
        r = _row("--one", name)
        if r is None:
            continue
        print(f"{r['model']:>6} {r['devices']:>5} {r['mesh']:>7} {r['total_s']:>8.1f} {r['capture_s']:>8.1f} "
              f"{r['strategies_s']:>7.1f} {r['solve_s']:>7.1f} {r['nodes']:>6} {r['solved_nodes']:>6} "
              f"{r['variables']:>7} {r['peak_rss_gb']:>7.2f} {r['step_s']:>12.2f} {r['mfu']:>6.1%}")
    if args.flat:
        return
    print("\nexamples/ at the README's mesh (2x2, dgx-a100; wall: the whole compile, load: the 1-minute load average):")
    examples()
    print("\nwith pipeline parallelism (pipeline_stages='auto', memory row enforced, 80 GB):")
    print(f"{'model':>6} {'GPUs':>5} {'total s':>8} {'RSS GB':>7}  {'plan':28} {'schedule':>17} {'step s':>7} {'GiB':>6}")
    for name in ("175B", "1T"):
        r = _row("--pipelined", name)
        if r is None:
            continue
        print(f"{r['model']:>6} {r['devices']:>5} {r['total_s']:>8.1f} {r['peak_rss_gb']:>7.2f}  {r['mesh']:28} "
              f"{r['schedule'] + ' x' + str(r['microbatches']):>17} {r['step_s']:>7.2f} {r['memory_gib']:>6.1f}")
    print("\nsolved layer classes (--cache DIR), GPT-3 175B shapes, pipeline_stages='auto':")
    print(f"{'compile':46} {'total s':>8} {'stage ILPs from the cache':>26}  plan")
    with tempfile.TemporaryDirectory() as cache:
        for label, extra in (("175B, 96 layers, 1024 GPUs, empty cache", []),
                             ("175B, 96 layers, 1024 GPUs, again", []),
                             ("same layers, 80 layers, 2048 GPUs", ["--layers", "80", "--devices", "2048"])):
            r = _row("--pipelined", "175B", "--cache", cache, *extra)
            if r is not None:
                hits = r["layer_cache"]
                print(f"{label:46} {r['total_s']:>8.2f} {hits['hits']:>14} of {hits['hits'] + hits['misses']:<9}  "
                      f"{r['mesh']}")
    print("\nexample GPT on pp=2,dp=2,tp=2 (one whole-graph stage ILP per microbatch count tried):")
    with tempfile.TemporaryDirectory() as cache:
        for label, workers, where in (("one process", 1, None), ("solved in parallel", os.cpu_count() or 1, None),
                                      ("parallel, empty cache", os.cpu_count() or 1, cache),
                                      ("from the cache", os.cpu_count() or 1, cache)):
            r = stage_ilps(workers, where)
            hits = r["layer_cache"]
            print(f"{label:24} planner {r['planner_s']:>5.2f} s (command {r['wall_s']:.2f} s), {r['ilps']} ILPs"
                  + (f", {hits['hits']} from the cache" if hits else ""))
    gaps()


def gaps():
    print("\nclustered solve against the unclustered optimum (compile s; peeled: layers at the ends of the class "
          "solved on their own, solves):")
    print(f"{'GPT':>22} {'mesh':>6} {'clustered ms':>13} {'s':>6} {'peeled':>7} {'solves':>6} {'unclustered ms':>15} "
          f"{'s':>6} {'gap':>8}")
    for layers, hidden, heads, seq, vocab, batch, mesh in GAP_MODELS:
        c = clustered_vs_unclustered(layers, hidden, heads, seq, vocab, batch, mesh)
        (cobj, cs, _, classes), (uobj, us, _, _) = c["clustered"], c["unclustered"]
        peeled = sum(k["own_front"] + k["own_back"] for k in classes)
        solves = max((k["solves"] for k in classes), default=1)
        print(f"{f'{layers}x{hidden} seq {seq} b {batch}':>22} {'x'.join(map(str, mesh)):>6} {cobj * 1e3:>13.4f} "
              f"{cs:>6.1f} {peeled:>7} {solves:>6} {uobj * 1e3:>15.4f} {us:>6.1f} {c['gap']:>+8.3%}", flush=True)


if __name__ == "__main__":
    main()
