"""``autopar.compile``: the front door. It plans without a pipeline
(autopar/planner.py, the flat planner) or searches pipelines around that
planner (autopar/pipeline/), and says which and why.
"""
from __future__ import annotations

from torch import nn

from autopar.cost_models.cluster import get_cluster
from autopar.errors import AutoparError
from autopar.mesh import parse_mesh
from autopar.pipeline import compile_pipelined
from autopar.plan import Plan
from autopar.planner import build_plan, plan_flat, zero_stage  # noqa: F401  (build_plan, zero_stage: re-exported)


def compile(model: nn.Module, example_inputs, *, mesh, cluster, loss_fn=None, memory: float | None = None,
            optimizer: str = "adamw", precision: str = "fp32", recompute: str = "auto", opt_level: int = 1,
            time_limit_s: float = 60.0, relative_gap: float = 1e-4, solver: str = "HIGHS",
            source: str | None = None, parameter_placements: dict | None = None,
            cluster_layers: bool | None = None, deterministic: bool = False,
            pipeline_stages: int | str | None = None, microbatches: int | None = None,
            schedule: str | None = None, cache: str | None = None, offload: bool = True,
            dynamic: dict | None = None, dims: dict | None = None, tolerance: float = 0.01) -> Plan:
    """Plan ``model`` for ``mesh`` on ``cluster`` without launching anything.

    ``example_inputs`` may be real, fake or meta tensors; with ``loss_fn`` the
    last one is the target. ``memory``: per-device budget in bytes (default:
    the device's memory). ``precision`` "bf16"/"fp16" prices mixed-precision
    training (compute-dtype activations and GEMMs, fp32 master weights); the
    emitted program computes in the model's own dtype. ``recompute``: "none",
    "selective", "full" or "auto" (passes/recompute.py). ``opt_level`` 1 clusters repeated layers (one set of ILP
    variables per layer class); 2 solves every node on its own where that is
    tractable and tries partial recomputation too. ``parameter_placements``
    pins parameters ({fqn: ["S(0)", "R"]}, one placement per mesh axis; a
    trailing "regather" pins ZeRO-3 for a sharded one). ``deterministic`` leaves wall-clock
    times out of the plan so that equal inputs give byte-identical plan.json.
    ``cache``: a directory of solved plans (autopar/plancache.py); compiling
    what was compiled before returns the stored plan without solving, and a
    pipeline search reuses the layer classes solved before (by any model
    built of the same layers).

    ``offload``: whether parameters may keep their optimizer state in host
    memory, updated there (ZeRO-Offload; where the cluster describes its
    host; plans without a pipeline), which the planner chooses per
    parameter where device memory binds.

    ``time_limit_s`` bounds the whole compile: a plan the solver has not
    proven optimal by then is the best found, and the plan
    (``solver.stopped_early``) and a warning say so.

    ``dynamic``: plan one compile for a range of sizes, ``{"batch": (4, 32),
    "seq": (128, 4096)}`` (or ``(lo, hi, step)``, or a ``range``); ``dims``
    says which input dims each names (by default ``batch`` is dim 0 and
    ``seq`` dim 1 of every input). The plan is piecewise (``plan.dynamic``,
    autopar/dynamic/): each piece's plan is within ``tolerance`` of every
    size's optimum in it, and the returned plan is the piece of the example
    sizes. Each ILP it solves has ``time_limit_s``; dynamic plans are
    planned without a pipeline and keep optimizer state on the device.

    Pipeline parallelism (autopar/pipeline/): a mesh with a ``pp`` axis, or
    ``pipeline_stages=N``, pipelines with that many stages; ``pipeline_stages=
    "auto"`` lets the planner factor the devices into pp x dp x tp and pipeline
    only where it pays, and is the default for a training step on a mesh that
    spans more than one node of the cluster; ``pipeline_stages=1`` never
    pipelines. ``microbatches`` and ``schedule`` ("gpipe", "1f1b",
    "interleaved-1f1b") pin those choices. ``plan.solver["pipelining"]`` says
    why the plan does or does not pipeline."""
    get_cluster(cluster).check_fits(parse_mesh(mesh))
    if dynamic is not None:
        return _compile_dynamic(model, example_inputs, dynamic, dims, tolerance, mesh=mesh, cluster=cluster,
                                loss_fn=loss_fn, memory=memory, optimizer=optimizer, precision=precision,
                                recompute=recompute, opt_level=opt_level, time_limit_s=time_limit_s,
                                relative_gap=relative_gap, solver=solver, source=source,
                                parameter_placements=parameter_placements, cluster_layers=cluster_layers,
                                deterministic=deterministic, pipeline_stages=pipeline_stages,
                                microbatches=microbatches, schedule=schedule, cache=cache)
    if dims is not None:
        raise AutoparError("dims names the input dims of dynamic symbols: pass dynamic={...} too")
    if cache is not None:
        from autopar.outputs import check_dir
        check_dir(cache, "cache", force=True)  # before the solve, not when storing its result
    pipelined, stages, why = _pipelining(pipeline_stages, microbatches, schedule, parse_mesh(mesh), get_cluster(cluster),
                              trains=loss_fn is not None, pinned=bool(parameter_placements))
    if not pipelined:
        plan = plan_flat(model, example_inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn, memory=memory,
                         optimizer=optimizer, precision=precision, recompute=recompute, opt_level=opt_level,
                         time_limit_s=time_limit_s, relative_gap=relative_gap, solver=solver, source=source,
                         parameter_placements=parameter_placements, cluster_layers=cluster_layers,
                         deterministic=deterministic, cache=cache, offload=offload)
        plan.solver["pipelining"] = why
        return plan
    if parameter_placements:
        raise AutoparError("parameter_placements cannot be pinned in a pipelined plan")
    plan = compile_pipelined(
        model, example_inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn,
        stages=None if stages == "auto" else stages, microbatches=microbatches,
        schedule=schedule, memory=memory, recompute=None if recompute == "auto" else recompute,
        optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver, source=source,
        cache=cache, deterministic=deterministic)
    search = plan.solver.get("pipeline_search") or {}
    if "decision" in search:
        why += f"; the search chose {search['decision']}"
        best = {k: (search[k] or {}).get("step_s") for k in ("pipelined", "flat")}
        if None not in best.values():
            why += f" (best pipelined step {best['pipelined']:.4g} s, without a pipeline {best['flat']:.4g} s)"
    plan.solver["pipelining"] = why
    return plan


def _compile_dynamic(model, example_inputs, dynamic, dims, tolerance, *, pipeline_stages, microbatches, schedule,
                     mesh, cluster, **options) -> Plan:
    from autopar.dynamic import plan_dynamic
    asked = {"pipeline_stages": pipeline_stages not in (None, 1), "microbatches": microbatches not in (None, 1),
             "schedule": schedule is not None, "a pp mesh axis": "pp" in parse_mesh(mesh).names}
    if any(asked.values()):
        raise AutoparError(f"dynamic shapes are planned without a pipeline, but {', '.join(k for k, v in asked.items() if v)} "
                           "asks for one: leave it out (or compile a pipelined plan for one size)")
    plan = plan_dynamic(model, example_inputs, dynamic=dynamic, dims=dims, tolerance=tolerance, mesh=mesh,
                        cluster=cluster, **options)
    plan.solver["pipelining"] = "dynamic shapes: planned without a pipeline"
    return plan


def _pipelining(stages, microbatches, schedule, mesh, cluster, *, trains: bool, pinned: bool) -> tuple:
    """(whether the pipeline planner runs, its stages: a count, "auto" or None
    (the mesh's pp axis says), why)."""
    if stages is not None:
        if stages == 1 and microbatches in (None, 1) and schedule is None and "pp" not in mesh.names:
            return False, None, "pipeline_stages=1: pipelining forbidden"
        return True, stages, f"pipeline_stages={stages!r} given"
    if "pp" in mesh.names:
        return True, None, f"the mesh has a pp axis ({mesh})"
    if microbatches is not None or schedule is not None:
        return True, None, "microbatches or a schedule given"
    nodes = -(-mesh.size // cluster.devices_per_node)
    where = f"the mesh's {mesh.size} devices"
    if nodes == 1:
        return False, None, (f"{where} fit in one node of {cluster.name} ({cluster.devices_per_node} devices): "
                             "planned without a pipeline")
    spans = f"{where} span {nodes} nodes of {cluster.name}"
    for reason, cannot in (("an inference step (no loss_fn)", not trains),
                           ("parameter_placements pinned", pinned)):
        if cannot:
            return False, None, f"{spans}, but {reason} is planned without a pipeline"
    return True, "auto", f"{spans}: pipelines searched (pipeline_stages=1 forbids them)"


__all__ = ["compile", "AutoparError"]
