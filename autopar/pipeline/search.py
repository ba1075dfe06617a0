"""Step 4 of pipeline planning: factor the devices into pp x dp x tp, or plan
on a given pp axis (see autopar/pipeline/__init__.py)."""
from __future__ import annotations

import time
import warnings
from dataclasses import dataclass, replace

from torch import nn

from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.collectives import Collective, axis_links, collective_time
from autopar.errors import AutoparError, InfeasibleError
from autopar.mesh import Mesh, parse_mesh
from autopar.plan import Plan
from autopar.planner import plan_flat as compile_flat
from autopar.pipeline.planfile import PP_AXIS, build_pipeline_plan, inner_mesh, plan_from_candidate
from autopar.pipeline.pricing import Profile, batch_size, profiles as price
from autopar.pipeline.stages import (
    Candidate, MARGIN, Schedule, evaluate, recompute_modes, should_pipeline, _best, _schedules,
)


MICROBATCH_PER_DP_RANK = (1, 2)
"""Sequences per data-parallel rank per microbatch tried when the planner
factors the world (Megatron-LM uses 1-2, Narayanan et al. SC'21)."""
MAX_MICROBATCH_CANDIDATES = 4
"""With a given pp axis and no pinned count, the smallest divisors of the batch
that are >= p are tried as microbatch counts (each costs a capture and an ILP)."""


@dataclass
class PipelineSearch:
    """What the planner considered when it factored the world into pp x dp x tp."""

    pipelined: Candidate | None
    """Best configuration with more than one stage."""
    flat: Candidate | None
    """Best configuration without pipelining (one stage, one microbatch)."""
    evaluated: int
    feasible: int
    layers: list
    repeated: tuple | None
    """(container, layers, layers captured) when priced by repetition."""
    wall_s: float
    margin: float = MARGIN
    layer_cache: dict | None = None
    """Stage ILPs answered by the layer cache and solved ({"hits", "misses"}); None without a cache."""

    @property
    def pipeline(self) -> bool:
        return should_pipeline(self.pipelined, self.flat, margin=self.margin)

    @property
    def best(self) -> Candidate | None:
        return self.pipelined if self.pipeline else self.flat

    def mesh(self, cand: Candidate | None = None) -> Mesh:
        """A candidate's mesh, pp x dp x tp (axes of size 1 dropped, at least one kept)."""
        c = cand or self.best
        axes = [(PP_AXIS, c.stages), ("dp", c.dp), ("tp", c.submesh[-1])]
        kept = [(n, s) for n, s in axes if s > 1] or [("tp", 1)]
        return Mesh(tuple(s for _, s in kept), tuple(n for n, _ in kept))

    def summary(self) -> dict:
        return {"decision": "pipeline" if self.pipeline else "no pipeline",
                "pipelined": self.pipelined.summary() if self.pipelined else None,
                "flat": self.flat.summary() if self.flat else None, "evaluated": self.evaluated,
                "feasible": self.feasible, "wall_s": self.wall_s, "margin": self.margin,
                "priced_by_repetition": list(self.repeated) if self.repeated else None,
                "layer_cache": self.layer_cache}


def _layer_cache(solved: list) -> dict | None:
    said = [prof.solution.extra["cache"] for prof in solved]
    return None if None in said else {"hits": said.count("hit"), "misses": said.count("miss")}


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


def search_pipeline(model: nn.Module, example_inputs, *, world: int, cluster, loss_fn, stages: int | None = None,
                    microbatches: int | None = None, schedule=None, memory: float | None = None,
                    recompute: str | None = None, optimizer: str = "adamw", precision: str = "fp32",
                    time_limit_s: float = 60.0, solver: str = "HIGHS", reuse_layers: bool | None = None,
                    margin: float = MARGIN, max_tp: int | None = None, cache: str | None = None,
                    deadline: float | None = None) -> PipelineSearch:
    """Factor ``world`` devices into pp x dp x tp and choose layers, microbatches,
    schedule and recomputation for each factorisation.

    tp stays inside a node (it divides ``devices_per_node``); the intra-stage
    ILP runs on the tp submesh at 1 and 2 sequences per data-parallel rank
    (``MICROBATCH_PER_DP_RANK``; other sizes by affine interpolation of the
    layer costs); dp replicates the pipeline and adds, once per step, a
    reduce-scatter of a stage's gradients and an all-gather of its
    parameters, in buckets (its ZeRO-1, ``stages._outer_sync``). ``stages=1`` or a single stage candidate
    is "no pipeline": one microbatch of the whole local batch. ``cache``: a
    plan cache directory (autopar/plancache.py) whose solved layer classes
    answer the stage ILPs solved before. The stage ILPs end by ``deadline``
    (time.perf_counter(); default ``time_limit_s`` from now)."""
    t0 = time.perf_counter()
    deadline = deadline if deadline is not None else t0 + time_limit_s
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    if schedule is not None:
        schedule = _schedule_arg(schedule)
    B = batch_size(example_inputs)
    budget = memory if memory is not None else cluster.device.memory
    tps = [t for t in _divisors(cluster.devices_per_node) if world % t == 0 and (max_tp is None or t <= max_tp)]
    points = [b for b in MICROBATCH_PER_DP_RANK if b <= B] or [1]
    pairs = [(t, b) for t in tps for b in points]
    solved = price(model, example_inputs, loss_fn, [(Mesh((t,), ("tp",)), b) for t, b in pairs], cluster,
                   optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver,
                   reuse_layers=reuse_layers is not False, cache=cache, deadline=deadline)
    profiles = dict(zip(pairs, solved))
    first = solved[0]
    n = len(first.layers)
    evaluated = feasible = 0
    pipelined, flat = [], []
    for t in tps:
        for p in _divisors(world // t):
            if p > n or (stages is not None and p != stages):
                continue
            d = world // (t * p)
            links = axis_links(cluster, (p, d, t))
            per_rank = d * (microbatches or 1)  # without a pipeline: one microbatch unless pinned
            sizes = points if p > 1 else ([B // per_rank] if B % per_rank == 0 else [])
            for b0 in sizes:
                if B % (d * b0):
                    continue
                m = B // (d * b0)
                if p > 1 and microbatches is not None and m != microbatches:
                    continue
                prof = _with_pp_link(_profile_at(profiles, t, b0, points), links[0] if p > 1 else None)
                for sched, v in _schedules(schedule, p, m, n):
                    for rc in recompute_modes(prof, recompute):
                        evaluated += 1
                        c = evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget, dp=d,
                                     dp_link=links[1])
                        if c is not None:
                            feasible += 1
                            (pipelined if p > 1 else flat).append(c)
    result = PipelineSearch(_best(pipelined), _best(flat), evaluated, feasible, first.names, first.repeated,
                            time.perf_counter() - t0, margin, _layer_cache(solved))
    if result.best is None:
        raise InfeasibleError(
            f"no configuration of {world} devices fits in {budget / 2**30:.2f} GiB per device (tried {evaluated} "
            "combinations of stages x tp x microbatches x schedule x recomputation)")
    return result


def _profile_at(profiles: dict, t: int, b0: int, points: list) -> Profile:
    if (t, b0) in profiles:
        return profiles[t, b0]
    a = profiles[t, points[0]]
    if len(points) == 1:
        return replace(a, microbatch=b0)
    return a.scaled(profiles[t, points[-1]], b0)


def _with_pp_link(prof: Profile, pp_link) -> Profile:
    """The same profile with its cut transfers priced on ``pp_link`` (none without one)."""
    cuts = []
    for cut in prof.cuts:
        if pp_link is None or cut.tensors == 0:
            cuts.append(replace(cut, p2p_fwd_s=0.0, p2p_bwd_s=0.0))
            continue
        t = cut.tensors * collective_time(Collective.SEND_RECV, cut.nbytes / cut.tensors, pp_link)
        cuts.append(replace(cut, p2p_fwd_s=t, p2p_bwd_s=t))
    return replace(prof, cuts=cuts)



def _microbatch_statistics(model: nn.Module, microbatches: int) -> list[str]:
    """Training-mode batch norm over microbatches normalises each with its own
    statistics (as in GPipe, Huang et al. 2019), not the whole batch's: the
    step is then not one device's step on the batch. Warned, and kept in the plan."""
    norms = [name for name, m in model.named_modules()
             if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.training]
    if microbatches == 1 or not norms:
        return []
    msg = (f"batch norm in training mode ({', '.join(norms[:3])}{', ...' if len(norms) > 3 else ''}) normalises "
           f"each of the {microbatches} microbatches with its own statistics, not the batch's: the pipelined step "
           "differs from one device's (pass microbatches=1, or use a norm that is per sample)")
    warnings.warn("autopar: " + msg, stacklevel=3)
    return [msg]


def compile_pipelined(model: nn.Module, example_inputs, *, mesh, cluster, loss_fn, stages: int | None = None,
                      microbatches: int | None = None, schedule=None, memory: float | None = None,
                      recompute: str | None = None, optimizer: str = "adamw", precision: str = "fp32",
                      time_limit_s: float = 60.0, solver: str = "HIGHS", source: str | None = None,
                      margin: float = MARGIN, reuse_layers: bool | None = None, cache: str | None = None,
                      deterministic: bool = False) -> Plan:
    """Plan ``model`` with pipeline parallelism where it pays.

    * ``mesh`` with a ``pp`` axis ("pp=2,tp=2"): the pipeline has that many
      stages (``stages``, if given, must agree); each stage runs the
      intra-operator plan on the other axes.
    * ``mesh`` without one (a device count, "dp=128,tp=8", ...): the planner
      factors the devices into pp x dp x tp (tp inside a node, at most the
      mesh's last axis) and pipelines only when ``should_pipeline`` says so;
      ``stages=`` pins the stage count (``stages=1`` never pipelines).
      Otherwise it returns ``autopar.compile``'s plan on ``mesh``; or, with
      ``microbatches`` > 1, a one-stage pipeline: gradient accumulation over
      the microbatches, reduced once per step, ZeRO-1 over data parallelism.
    ``microbatches`` / ``schedule`` ("gpipe", "1f1b", "interleaved-1f1b") pin
    those choices; ``recompute`` pins the stages' activation recomputation
    ("none", "selective" or "full"; by default the search tries each). The plan's ``pipeline`` section is
    None when it does not pipeline. A model on the meta device with many
    identical layers gets a planning-only plan (stages and costs, no per-node
    strategies); ``reuse_layers=False`` captures it whole instead.
    ``cache``: a plan cache directory (autopar/plancache.py): the stage ILPs
    reuse its solved layer classes, a plan without a pipeline its plans.
    ``deterministic`` leaves the wall-clock times out of the plan (equal
    inputs give byte-identical plan.json)."""
    plan = _compile_pipelined(model, example_inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn, stages=stages,
                              microbatches=microbatches, schedule=schedule, memory=memory, recompute=recompute,
                              optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver,
                              source=source, margin=margin, reuse_layers=reuse_layers, cache=cache,
                              deterministic=deterministic)
    if deterministic:
        plan.solver["wall_s"] = None
        plan.solver.pop("timings", None)
        if isinstance(plan.solver.get("pipeline_search"), dict):
            plan.solver["pipeline_search"]["wall_s"] = None
    return plan


def _compile_pipelined(model, example_inputs, *, mesh, cluster, loss_fn, stages, microbatches, schedule, memory,
                       recompute, optimizer, precision, time_limit_s, solver, source, margin, reuse_layers, cache,
                       deterministic) -> Plan:
    t0 = time.perf_counter()
    mesh = parse_mesh(mesh)
    cluster = get_cluster(cluster)
    example_inputs = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    if schedule is not None:
        schedule = _schedule_arg(schedule)
    if stages is not None and (not isinstance(stages, int) or isinstance(stages, bool) or stages < 1):
        raise AutoparError(f"stages must be a positive integer, got {stages!r}")
    options = dict(optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver)
    deadline = t0 + time_limit_s  # the whole compile's

    def compile_flat_(model, inputs, mesh):
        """The flat planner in what is left of the time limit."""
        return compile_flat(model, inputs, mesh=mesh, cluster=cluster, loss_fn=loss_fn, memory=memory, source=source,
                            cache=cache, deterministic=deterministic, optimizer=optimizer, precision=precision,
                            solver=solver, time_limit_s=max(deadline - time.perf_counter(), 1e-3))

    accumulate = dict(microbatches=microbatches, schedule=schedule, memory=memory, recompute=recompute,
                      source=source, reuse_layers=bool(reuse_layers), t0=t0, cache=cache, **options)
    accumulates = microbatches not in (None, 1)  # without a pipeline: a pipeline of one stage
    if PP_AXIS in mesh.names:
        p = mesh.shape[mesh.names.index(PP_AXIS)]
        if stages is not None and stages != p:
            raise AutoparError(f"stages={stages} disagrees with the mesh ({mesh}): the pipeline has one stage per "
                               f"coordinate of its pp axis; use a mesh with pp={stages}")
        if p == 1 and not accumulates:
            return compile_flat_(model, example_inputs, inner_mesh(mesh))
        return _plan_on_mesh(model, example_inputs, loss_fn, mesh, cluster, **accumulate)
    if stages == 1 and not accumulates:
        return compile_flat_(model, example_inputs, mesh)
    if stages == 1:
        return _plan_on_mesh(model, example_inputs, loss_fn, _with_pp(mesh), cluster, **accumulate)
    found = search_pipeline(model, example_inputs, world=mesh.size, cluster=cluster, loss_fn=loss_fn,
                            stages=stages, microbatches=microbatches, schedule=schedule, memory=memory,
                            recompute=recompute, reuse_layers=reuse_layers, margin=margin,
                            max_tp=mesh.shape[-1] if mesh.ndim > 1 else None, cache=cache, deadline=deadline,
                            **options)
    if not found.pipeline:
        plan = _plan_on_mesh(model, example_inputs, loss_fn, _with_pp(mesh), cluster, **accumulate) \
            if accumulates else compile_flat_(model, example_inputs, mesh)
        plan.solver["pipeline_search"] = found.summary()
        return plan
    best = found.pipelined
    if found.repeated and _on_meta(model):
        plan = plan_from_candidate(best, found.mesh(best), cluster, source)
        plan.solver["wall_s"] = time.perf_counter() - t0
    else:
        plan = _plan_on_mesh(model, example_inputs, loss_fn, found.mesh(best), cluster,
                             microbatches=best.microbatches, schedule=best.schedule,
                             virtual_stages=best.virtual_stages, memory=memory, recompute=best.recompute,
                             source=source, reuse_layers=bool(reuse_layers), t0=t0, cache=cache, **options)
    plan.solver["pipeline_search"] = found.summary()
    return plan


def _on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _schedule_arg(schedule) -> Schedule:
    try:
        return Schedule(schedule)
    except ValueError:
        raise AutoparError(f"schedule {schedule!r} is not one of {[s.value for s in Schedule]}") from None


def _with_pp(mesh: Mesh) -> Mesh:
    """``mesh`` with a pp axis of size 1 in front: one stage, its microbatches
    accumulating gradients (and ZeRO-1 over its data-parallel axes)."""
    return Mesh((1, *mesh.shape), (PP_AXIS, *mesh.names))


def _plan_on_mesh(model, example_inputs, loss_fn, mesh: Mesh, cluster, *, microbatches=None, schedule=None,
                  virtual_stages: int | None = None, memory=None, recompute=None, optimizer="adamw",
                  precision="fp32", time_limit_s=60.0, solver="HIGHS", source=None, reuse_layers: bool = False,
                  t0=None, cache: str | None = None) -> Plan:
    """The pp axis is given: choose layers, microbatches, schedule; the submesh
    plan is the ILP's on the whole microbatch graph."""
    t0 = t0 if t0 is not None else time.perf_counter()
    if loss_fn is None:
        raise AutoparError("pipelining trains the model: give loss_fn (the last example input is the target)")
    B = batch_size(example_inputs)
    pp_index = mesh.names.index(PP_AXIS)
    p = mesh.shape[pp_index]
    inner = inner_mesh(mesh)
    budget = memory if memory is not None else cluster.device.memory
    pp_link = axis_links(cluster, mesh.shape)[pp_index]
    if microbatches is not None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1 \
                or B % microbatches:
            raise AutoparError(f"microbatches={microbatches!r} must be a positive integer dividing the batch "
                               f"size ({B})")
        ms = [microbatches]
    else:
        ms = [m for m in _divisors(B) if m >= min(p, B)][:MAX_MICROBATCH_CANDIDATES]
    solved = price(model, example_inputs, loss_fn, [(inner, B // m) for m in ms], cluster, pp_link=pp_link,
                   optimizer=optimizer, precision=precision, time_limit_s=time_limit_s, solver=solver,
                   reuse_layers=reuse_layers, cache=cache, deadline=t0 + time_limit_s)
    cands, evaluated = [], 0
    for m, prof in zip(ms, solved):
        pairs = _schedules(schedule, p, m, len(prof.layers))
        if virtual_stages is not None:
            pairs = [(s, v) for s, v in pairs if v == virtual_stages]
        for sched, v in pairs:
            for rc in recompute_modes(prof, recompute):
                evaluated += 1
                cands.append(evaluate(prof, p=p, m=m, schedule=sched, v=v, recompute=rc, budget=budget))
    best = _best(cands)
    if best is None and prof.forbidden:
        free = [c for c in range(1, len(prof.layers)) if c not in prof.forbidden]
        if len(free) < p - 1:
            raise AutoparError(
                f"a pipeline of {p} stages needs {p - 1} cut(s) between layers, but parameters shared by several "
                f"layers (tied weights) leave only {len(free)}: {[prof.names[c] for c in free]} can start a "
                "stage; untie them or use fewer stages")
    if best is None:
        raise InfeasibleError(
            f"no pipeline of {p} stages on {mesh} fits in {budget / 2**30:.2f} GiB per device (tried microbatches "
            f"{ms}, schedules {[schedule.value] if schedule else [s.value for s in Schedule]}); give more memory, "
            "more stages or a larger submesh")
    if best.profile.repeated:
        plan = plan_from_candidate(best, mesh, cluster, source)
    else:
        plan = build_pipeline_plan(best, mesh, cluster, source)
    plan.warnings += _microbatch_statistics(model, best.microbatches)
    plan.solver["wall_s"] = time.perf_counter() - t0
    plan.solver["pipeline_search"] = {"evaluated": evaluated, "microbatches_tried": ms, "chosen": best.summary(),
                                      "layer_cache": _layer_cache(solved)}
    return plan
