"""Step 3 of pipeline planning: stages, schedules and the step time of one
configuration (see autopar/pipeline/__init__.py)."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import numpy as np

from autopar.cost_models.collectives import Collective, bucketed_time, step_bucket_bytes
from autopar.cost_models.graph_costs import optimizer_step_bytes
from autopar.cost_models.optimizer import param_bytes, step_seconds
from autopar.errors import AutoparError
from autopar.pipeline.pricing import Profile


MARGIN = 0.05
"""Pipelining must predict a step at least this much faster than the best
non-pipelined plan to be chosen: a pipeline adds memory imbalance, schedule
complexity and point-to-point traffic the model prices only roughly."""


VIRTUAL_STAGES = (2, 3, 4, 6, 8)
"""Model chunks per device tried for the interleaved schedule."""


class Schedule(str, Enum):
    GPIPE = "gpipe"
    """All forwards, then all backwards: every stage holds all m microbatches."""
    ONE_F_ONE_B = "1f1b"
    """One forward, one backward in steady state: stage s holds min(m, p - s) microbatches."""
    INTERLEAVED = "interleaved-1f1b"
    """1F1B over v model chunks per device: the bubble shrinks v times, transfers grow v times."""


def bubble_fraction(schedule, p: int, m: int, v: int = 1) -> float:
    """Idle time of a pipeline step relative to its useful work: (p - 1)/m for
    GPipe and 1F1B, (p - 1)/(v m) for interleaved 1F1B (Narayanan et al. SC'21)."""
    schedule = Schedule(schedule)
    if p < 1 or m < 1 or v < 1:
        raise AutoparError(f"bubble_fraction needs p, m, v >= 1, got p={p}, m={m}, v={v}")
    if schedule is Schedule.INTERLEAVED:
        return (p - 1) / (v * m)
    return (p - 1) / m


@dataclass
class Candidate:
    """One pipeline configuration and its predicted cost."""

    stages: int
    """Pipeline stages p (devices along the pp axis)."""
    submesh: tuple
    """Shape of each stage's submesh (the axes other than pp)."""
    dp: int
    """Data parallelism outside the submesh (priced analytically), 1 when the submesh holds it."""
    microbatches: int
    microbatch: int
    """Sequences per microbatch on one submesh."""
    schedule: Schedule
    virtual_stages: int
    recompute: str
    """"none", "selective" or "full" (``RECOMPUTE``)."""
    ranges: list
    """[start, stop) layer ranges, one per chunk (p x v chunks; chunk c runs on pp rank c mod p)."""
    chunk_time_s: list
    device_time_s: list
    """Per pp rank, seconds per microbatch (all its chunks)."""
    device_memory: list
    """Per pp rank, bytes per device."""
    device_memory_parts: list
    """Per pp rank: parameters, gradients, optimizer and activations bytes."""
    step_s: float
    compute_s: float
    comm_s: float
    bubble_s: float
    sync_s: float
    flops: float
    """Model FLOPs per step."""
    profile: Profile | None = field(default=None, repr=False)
    """The layer costs it was priced with."""
    optimizer_s: float = 0.0
    """The optimizer step of the device that updates the most (in ``step_s``)."""

    @property
    def memory_bytes(self) -> float:
        return max(self.device_memory)

    def summary(self) -> dict:
        return {"stages": self.stages, "submesh": list(self.submesh), "dp": self.dp,
                "microbatches": self.microbatches, "microbatch": self.microbatch,
                "schedule": self.schedule.value, "virtual_stages": self.virtual_stages,
                "recompute": self.recompute, "step_s": self.step_s,
                "bubble_s": self.bubble_s, "memory_bytes": self.memory_bytes}


def _in_flight(schedule: Schedule, p: int, m: int, v: int, rank: int) -> float:
    if schedule is Schedule.GPIPE:
        return float(m)
    held = float(min(m, p - rank))
    if schedule is Schedule.INTERLEAVED:
        held *= 1 + (p - 1) / (p * v)
    return held


RECOMPUTE = ("none", "selective", "full")
"""Activation recomputation a pipeline's stages may run (passes/recompute.py's
modes): none; selective (each numbered layer's regions that free the most
memory per recomputed second, ``Profile.selective``); full (each numbered
layer keeps only its input, as codegen checkpoints it)."""


def recompute_modes(prof: Profile, recompute: str | None) -> list:
    """The recomputation modes to try on ``prof``: the one asked for, or all it can take."""
    if recompute is not None:
        if recompute not in RECOMPUTE:
            raise AutoparError(f"recompute {recompute!r} is not one of {RECOMPUTE}")
        return [recompute]
    return [m for m in RECOMPUTE if m != "selective" or prof.selective is not None]


def _layer_arrays(prof: Profile, recompute: str, pipelined: bool, dp: int = 1):
    """Per layer: time per microbatch, state bytes, activation bytes kept per
    microbatch in flight, its working set in backward (its activations again
    when recomputed, plus its largest gradient working set), and the bytes of
    parameters its devices update. In a pipeline, optimizer states are
    sharded over the submesh (``zero1_axis``) and over ``dp`` replicas."""
    L, C = prof.layers, prof.cuts
    if recompute == "selective":
        if prof.selective is None:
            raise AutoparError("selective recomputation is not an option for this model's layers")
        L = prof.selective
        t = np.array([lc.time_s for lc in L])  # the regions' forward is in their backward already
        kept = np.array([lc.act_bytes for lc in L])
        work = np.array([lc.recomputed_bytes + lc.transient_bytes for lc in L])
    else:
        rc = [recompute == "full" and lc.recomputable for lc in L]
        t = np.array([lc.time_s + (lc.fwd_s if r else 0.0) for lc, r in zip(L, rc)])
        kept = np.array([(C[i].held_bytes if i > 0 else 0.0) if r else lc.act_bytes
                         for i, (lc, r) in enumerate(zip(L, rc))])
        work = np.array([(lc.act_bytes if r else 0.0) + lc.transient_bytes for lc, r in zip(L, rc)])
    if pipelined:
        state = np.array([lc.param_bytes + lc.sharded_optimizer_bytes / dp for lc in L])
        updated = np.array([lc.updated_bytes / dp for lc in L])
    else:
        state = np.array([lc.param_bytes + lc.optimizer_bytes for lc in L])
        updated = np.array([lc.param_bytes for lc in L])
    grads = np.array([lc.grad_bytes for lc in L])
    return t, state, grads, kept, work, updated


def _step_temp(prof: Profile, param_bytes: float) -> float:
    return optimizer_step_bytes(param_bytes, prof.ctx) if prof.ctx is not None else 0.0


def _sync_temp(prof: Profile, grad_bytes, dp: int):
    """Bytes the end-of-step gradient sync holds besides the gradients: one
    bucket's flat copy and its reduced piece (``gradsync.in_buckets``), of the
    bucket of the largest group it reduces over (``step_bucket_bytes``), or
    of the gradients where they are fewer. It runs after the activations
    are freed and before the optimizer step, so it peaks with neither."""
    n = max([dp, *prof.submesh.shape])
    if prof.ctx is None or n <= 1:
        return 0.0 * grad_bytes
    return np.minimum(grad_bytes, step_bucket_bytes(n, prof.ctx.elem_bytes)) * (1.0 + 1.0 / n)


def _optimizer_s(prof: Profile, updated_bytes: float) -> float:
    """The optimizer step over parameter shards of ``updated_bytes`` (their
    weights), as a flat plan prices it (cost_models/optimizer.step_seconds)."""
    ctx = prof.ctx
    if ctx is None:
        return 0.0
    elements = updated_bytes / param_bytes(ctx.precision, ctx.optimizer)["parameters"]
    return step_seconds(elements, ctx.optimizer, ctx.cluster.device, ctx.cluster.backend == "gloo")


def _device_memory(state, grads, acts, temp, p: int) -> float:
    """Peak bytes of a device: parameters and optimizer states always; with one
    stage the activations are freed as gradients build up (autopar.compile's
    rule); in a pipeline gradients coexist with the microbatches in flight."""
    if p == 1:
        return state + np.maximum(acts, grads + temp)
    return state + grads + np.maximum(acts, temp)


def partition(prof: Profile, chunks: int, *, p: int, m: int, schedule: Schedule, v: int, recompute: str,
              budget: float, dp: int = 1) -> list | None:
    """Contiguous layer ranges for ``chunks`` chunks minimising the slowest
    chunk's time per microbatch, each chunk inside its share of the memory
    budget (budget / v: a device holds v chunks); None if none fits."""
    n = len(prof.layers)
    if chunks > n:
        return None
    C = prof.cuts
    t, state, grads, kept, work, updated = _layer_arrays(prof, recompute, p > 1, dp)
    pt, ps, pg, pk, pp_ = (np.concatenate([[0.0], np.cumsum(x)]) for x in (t, state, grads, kept, updated))
    p2p_in = np.array([C[i].p2p_fwd_s if 0 < i < n else 0.0 for i in range(n + 1)])
    out = np.array([C[j].p2p_bwd_s + C[j].to_cut_s if 0 < j < n else 0.0 for j in range(n + 1)])
    i_idx = np.arange(n + 1)[:, None]
    j_idx = np.arange(n + 1)[None, :]
    valid = i_idx < j_idx
    T = np.where(valid, pt[None, :] - pt[:, None] + p2p_in[:, None] + out[None, :], np.inf)
    S = ps[None, :] - ps[:, None]
    G = pg[None, :] - pg[:, None]
    K = pk[None, :] - pk[:, None]
    temp = np.maximum(_step_temp(prof, 1.0) * (pp_[None, :] - pp_[:, None]), _sync_temp(prof, G, dp))
    W = np.zeros((n + 1, n + 1))
    for i in range(n):
        W[i, i + 1:] = np.maximum.accumulate(work[i:])
    allowed = np.ones(n + 1, bool)
    for c in prof.forbidden:
        if 0 < c < n:
            allowed[c] = False
    share = budget / v
    F = np.full(n + 1, np.inf)
    F[0] = 0.0
    back = []
    for k in range(chunks):
        acts = _in_flight(schedule, p, m, v, k % p) * K + W
        mem = _device_memory(S, G, acts, temp, p)
        cost = np.where(valid & (mem <= share), T, np.inf)
        if k > 0:
            cost = np.where(allowed[:, None], cost, np.inf)
        M = np.maximum(F[:, None], cost)
        back.append(M.argmin(axis=0))
        F = M.min(axis=0)
    if not np.isfinite(F[n]):
        return None
    ranges, j = [], n
    for k in reversed(range(chunks)):
        i = int(back[k][j])
        ranges.append((i, j))
        j = i
    return list(reversed(ranges))


def even_ranges(prof: Profile, chunks: int, recompute: str) -> list | None:
    """Contiguous ranges of about equal time (cuts at the quantiles of the
    cumulative time per microbatch, on allowed cuts): with v chunks per device
    in an interleaved schedule, a device's time is the sum of its chunks, which
    ``partition``'s min-max over chunks leaves unbalanced when one layer (an
    LM head) is heavy. None if the layers cannot be cut that many times."""
    n = len(prof.layers)
    if chunks > n:
        return None
    t = _layer_arrays(prof, recompute, True)[0]
    cum = np.concatenate([[0.0], np.cumsum(t)])
    allowed = [c for c in range(1, n) if c not in prof.forbidden]  # increasing
    cuts, first = [], 0  # first: index in ``allowed`` of the earliest position the next cut may take
    for k in range(1, chunks):
        # leave an allowed position after this cut for each of the chunks - k - 1 cuts still to place
        options = range(first, len(allowed) - (chunks - k - 1))
        if not options:
            return None
        target = cum[-1] * k / chunks
        i = min(options, key=lambda j: (abs(cum[allowed[j]] - target), j))
        cuts.append(allowed[i])
        first = i + 1
    bounds = [0, *cuts, n]
    return list(zip(bounds[:-1], bounds[1:]))


def evaluate(prof: Profile, *, p: int, m: int, schedule: Schedule, v: int, recompute: str, budget: float,
             dp: int = 1, dp_link=None, ranges: list | None = None) -> Candidate | None:
    """Partition (unless ``ranges`` is given) and price one configuration; None
    if it does not fit in ``budget`` bytes per device."""
    schedule = Schedule(schedule)
    chunks = p * v
    if ranges is None:
        options = [partition(prof, chunks, p=p, m=m, schedule=schedule, v=v, recompute=recompute, budget=budget,
                             dp=dp)]
        if v > 1:  # a device runs v chunks: balance their sums, not only the slowest chunk
            options.append(even_ranges(prof, chunks, recompute))
        found = [evaluate(prof, p=p, m=m, schedule=schedule, v=v, recompute=recompute, budget=budget, dp=dp,
                          dp_link=dp_link, ranges=r) for r in options if r is not None]
        return _best(found)
    C = prof.cuts
    L = prof.selective if recompute == "selective" else prof.layers
    n = len(L)
    t, state, grads, kept, work, updated = _layer_arrays(prof, recompute, p > 1, dp)
    params = np.array([lc.param_bytes for lc in L])
    compute_of = np.array([lc.fwd_s + lc.bwd_s + (lc.fwd_s if recompute == "full" and lc.recomputable else 0.0)
                           for lc in L])
    chunk_time = []
    dev = [dict(time=0.0, compute=0.0, state=0.0, grads=0.0, params=0.0, updated=0.0, acts=0.0, work=0.0, sync=0.0)
           for _ in range(p)]
    for c, (i, j) in enumerate(ranges):
        r = c % p
        comm = (C[i].p2p_fwd_s if i > 0 else 0.0) + (C[j].p2p_bwd_s + C[j].to_cut_s if j < n else 0.0)
        chunk_time.append(float(t[i:j].sum()) + comm)
        d = dev[r]
        d["time"] += chunk_time[-1]
        d["compute"] += float(compute_of[i:j].sum())
        d["state"] += float(state[i:j].sum())
        d["grads"] += float(grads[i:j].sum())
        d["params"] += float(params[i:j].sum())
        d["updated"] += float(updated[i:j].sum())
        d["acts"] += _in_flight(schedule, p, m, v, r) * float(kept[i:j].sum())
        d["work"] = max(d["work"], float(work[i:j].max()))
        d["sync"] += sum(lc.sync_s for lc in L[i:j])
    memory, parts = [], []
    for d in dev:
        if dp > 1 and dp_link is not None:
            d["sync"] += _outer_sync(d["grads"], dp_link, step_bucket_bytes(dp, prof.ctx.elem_bytes))
        acts = d["acts"] + d["work"]
        temp = max(_step_temp(prof, d["updated"]), float(_sync_temp(prof, d["grads"], dp)))
        memory.append(float(_device_memory(d["state"], d["grads"], acts, temp, p)))
        parts.append({"parameters": d["params"], "gradients": d["grads"], "optimizer": d["state"] - d["params"],
                      "activations": acts, "inputs": 0.0, "optimizer_step": temp})
    if max(memory) > budget:
        return None
    slow = max(range(p), key=lambda r: dev[r]["time"])
    per_mb = dev[slow]["time"]
    bubble = (p - 1) / v * per_mb
    sync = max(d["sync"] for d in dev)
    # the optimizer state sharded over the data-parallel replicas and the submesh as a pipeline's is
    # (ZeRO-1, the all-reduce's bytes), without a pipeline too: the flat plan may shard it likewise (ZeRO-2)
    updated = [sum(lc.updated_bytes for c, (i, j) in enumerate(ranges) if c % p == r for lc in L[i:j]) / dp
               for r in range(p)]
    optimizer = max(_optimizer_s(prof, u) for u in updated)
    step = m * per_mb + bubble + sync + optimizer
    flops = m * dp * sum(lc.flops for lc in L)
    return Candidate(p, tuple(prof.submesh.shape), dp, m, prof.microbatch, schedule, v, recompute, list(ranges),
                     chunk_time, [d["time"] for d in dev], memory, parts, step, m * dev[slow]["compute"],
                     m * (per_mb - dev[slow]["compute"]) + sync, bubble, sync, flops, prof, optimizer)


def _outer_sync(grad_bytes: float, link, bucket: float) -> float:
    """Seconds of the step's gradient sync over the data-parallel replicas
    outside the submesh, as the pipeline runtime runs it: ZeRO-1
    (``gradsync.OptimizerShard``), the stage's gradients reduce-scattered and
    its updated shards all-gathered, blocking, each as one flat buffer in
    ``bucket``-byte pieces (``step_bucket_bytes``, ``gradsync.in_buckets``)."""
    return (bucketed_time(Collective.REDUCE_SCATTER, grad_bytes, link, bucket)
            + bucketed_time(Collective.ALL_GATHER, grad_bytes, link, bucket))


def _schedules(schedule, p: int, m: int, n: int) -> list:
    """(schedule, v) pairs to try."""
    if p == 1:
        return [(Schedule.ONE_F_ONE_B, 1)]
    if schedule is not None:
        schedule = Schedule(schedule)
        if schedule is not Schedule.INTERLEAVED:
            return [(schedule, 1)]
        return [(schedule, v) for v in VIRTUAL_STAGES if p * v <= n and m % p == 0]
    out = [(Schedule.ONE_F_ONE_B, 1)]
    if m % p == 0:
        out += [(Schedule.INTERLEAVED, v) for v in VIRTUAL_STAGES if p * v <= n]
    return out


def _best(cands):
    cands = [c for c in cands if c is not None]
    return min(cands, key=lambda c: (c.step_s, c.memory_bytes)) if cands else None


def should_pipeline(pipelined: Candidate | None, flat: Candidate | None, *, margin: float = MARGIN) -> bool:
    """Whether to pipeline: when nothing fits without it, or when the best pipelined
    plan is predicted at least ``margin`` faster than the best plan without."""
    if pipelined is None:
        return False
    if flat is None:
        return True
    return pipelined.step_s < (1.0 - margin) * flat.step_s
