"""Sharding rules by table, and every registered rule checked for exactness on
simulated ranks (tests/test_examples.py: every example model has a rule for
each of its ops). The sample calls are in tests/rule_samples.py.

The exactness check takes each strategy of a rule on a 1-D mesh of 4 (and a
few two-axis combinations on a 2x2 mesh), places the inputs as it says under
LocalTensorMode (4 simulated ranks with real values, fake process group; a
Partial input is split into random summands), runs the op exactly as the
emitted program does (a plain call on the local shards, or ``autopar.spmd.op``
/ ``reshape`` / ``factory``), and requires that the output, reassembled from
the per-rank values by the planned placement, equals the single-device op,
and that the input gradients for a random cotangent (each rank given its
piece), reassembled by the placements codegen assumes they land in
(``autopar.codegen.use_grads``: a partial sum where the op splits the work
of a replicated input), equal the single-device gradients.

Rows found wrong are listed in KNOWN_WRONG with the reason (strict xfail).
"""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.ops import aten
from torch.utils import _pytree as pytree

from autopar.codegen import use_grads
from autopar.cost_models.resharding import as_sum, producer_grad_spec
from autopar.ir import OpInfo, TensorArg, TensorMeta
from autopar.passes.rules import get_rule, registered_ops
from autopar.passes.strategy import Strategy, expand_to_mesh, fmt_spec, local_shape
from rule_samples import SAMPLES, Sample, gen, idx, x  # tests/ is on sys.path under pytest

WORLD = 4

# Rows found wrong in existing rules. Each entry: (sample id, strategy) -> why.
# strict xfail: once the rule is fixed the test fails and the entry must go.
KNOWN_WRONG: dict = {}


# ---------------------------------------------------------------------------
# The harness


def op_info(target, args, kwargs) -> OpInfo:
    """The OpInfo capture would build for this call (tensors become TensorArg)."""
    metas = []

    def lift(a):
        if isinstance(a, torch.Tensor):
            m = TensorMeta(tuple(a.shape), a.dtype)
            metas.append(m)
            return TensorArg(len(metas) - 1, m)
        return a

    largs = pytree.tree_map(lift, args)
    lkwargs = pytree.tree_map(lift, kwargs)
    out = target(*args, **kwargs)
    outs = [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
    return OpInfo(target, largs, lkwargs, metas, [TensorMeta(tuple(t.shape), t.dtype) for t in outs])


def strategies_for(sample: Sample, mesh_shape) -> list:
    info = op_info(sample.target, sample.args, sample.kwargs)
    rows = get_rule(sample.target).fn(info)
    return expand_to_mesh(rows, mesh_shape, [m.shape for m in info.inputs], [m.shape for m in info.outputs])


def _coords(mesh_shape) -> list[tuple]:
    """Mesh coordinate of each rank (row-major, as DeviceMesh numbers them)."""
    return list(itertools.product(*(range(n) for n in mesh_shape)))


def _summands(v: torch.Tensor, op: str, n: int, g: torch.Generator) -> list[torch.Tensor]:
    """n local values that reduce with ``op`` to ``v``."""
    if v.dtype == torch.bool:
        raise AssertionError("a Partial placement on a bool tensor")

    def noise():
        if v.dtype.is_floating_point:
            return torch.randn(v.shape, generator=g, dtype=v.dtype)
        return torch.randint(-5, 5, v.shape, generator=g, dtype=v.dtype)

    if op == "sum":
        parts = [noise() for _ in range(n - 1)]
        return parts + [v - sum(parts)]
    if op == "avg":
        offsets = [noise() for _ in range(n - 1)]
        return [v + o for o in offsets] + [v - sum(offsets)]
    owner = torch.randint(0, n, v.shape, generator=g)  # max / min: one rank holds the value
    sign = -1 if op == "max" else 1
    return [torch.where(owner == k, v, v + sign * (torch.rand(v.shape, generator=g, dtype=v.dtype) + 0.1))
            for k in range(n)]


def place(t: torch.Tensor, spec, mesh_shape, seed: int) -> dict:
    """rank -> local value of ``t`` placed as ``spec`` (Partial values are random summands)."""
    coords = _coords(mesh_shape)
    vals = {r: t for r in range(len(coords))}
    g = gen(seed)
    for axis, p in enumerate(spec):
        n = mesh_shape[axis]
        if isinstance(p, Shard):
            vals = {r: torch.chunk(v, n, p.dim)[coords[r][axis]] for r, v in vals.items()}
        elif isinstance(p, Partial):
            groups: dict = {}
            for r, c in enumerate(coords):
                groups.setdefault(c[:axis] + c[axis + 1:], []).append(r)
            for members in groups.values():
                parts = _summands(vals[members[0]], p.reduce_op, n, g)
                for r in members:
                    vals[r] = parts[coords[r][axis]]
    return vals


def assemble(vals: dict, spec, mesh_shape) -> torch.Tensor:
    """The global value that per-rank local values stand for under ``spec``
    (the inverse of ``place``; raises if a Replicate axis holds different values)."""
    cur = {c: vals[r] for r, c in enumerate(_coords(mesh_shape))}
    for axis in reversed(range(len(mesh_shape))):
        p = spec[axis]
        groups: dict = {}
        for c, v in sorted(cur.items()):
            groups.setdefault(c[:axis], []).append(v)
        nxt = {}
        for key, parts in groups.items():
            if isinstance(p, Shard):
                nxt[key] = torch.cat(parts, p.dim)
            elif isinstance(p, Replicate):
                for k, v in enumerate(parts[1:], 1):
                    if not torch.equal(v, parts[0]):
                        raise AssertionError(f"a Replicate value differs between coordinates 0 and {k} of axis {axis}")
                nxt[key] = parts[0]
            else:
                st = torch.stack(parts)
                nxt[key] = {"sum": st.sum(0), "avg": st.mean(0) if st.is_floating_point() else st.sum(0) // len(parts),
                            "max": st.amax(0), "min": st.amin(0)}[p.reduce_op]
        cur = nxt
    return cur[()]


def _differs(local_vals: dict, placements, mesh_shape, want: torch.Tensor, label: str) -> list[str]:
    """What is wrong with the per-rank ``local_vals`` placed ``placements`` as
    the single-device ``want``: replicas that disagree, or the reassembled
    value off (empty when they agree)."""
    try:
        full = assemble(local_vals, placements, mesh_shape)
    except AssertionError as e:
        return [f"{label}: {e}"]
    if not _close(full, want):
        err = (full.double() - want.double()).abs().max().item() if full.shape == want.shape else "shape"
        return [f"{label}: differs from the single-device value (max abs error {err})"]
    return []


def _global_shape(shape, placements, mesh_shape) -> tuple:
    """The global shape a local shard of ``shape`` placed ``placements`` stands for."""
    out = list(shape)
    for axis, p in enumerate(placements):
        if isinstance(p, Shard):
            out[p.dim] *= mesh_shape[axis]
    return tuple(out)


def _local_values(t) -> dict:
    from torch.distributed._local_tensor import LocalTensor

    return dict(t._local_tensors) if isinstance(t, LocalTensor) else {r: t for r in range(WORLD)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if not (a.dtype.is_floating_point or a.dtype.is_complex):
        return torch.equal(a, b)
    tol = dict(rtol=1e-6, atol=1e-8) if a.dtype in (torch.float64, torch.complex128) else dict(rtol=1e-5, atol=1e-5)
    return torch.allclose(a, b, equal_nan=True, **tol)


def _call(sample: Sample, strategy, args: list, spec, mesh, mesh_shape):
    """Run the op as the emitted program does (autopar.codegen / autopar.spmd), on local shards."""
    from autopar import local_ops, spmd
    from autopar.codegen import RESHAPES
    from autopar.passes.rules.factory import FACTORIES, RANDOM_FACTORIES

    a, kw = pytree.tree_unflatten(args, spec)
    with spmd.use_mesh(mesh):
        if sample.target in FACTORIES:
            return spmd.factory(sample.target, *a, **kw)
        if sample.target in RANDOM_FACTORIES:
            return spmd.random_factory("node", sample.target, *a, **kw)
        if sample.target in RESHAPES:
            ref_shape = sample.target(*sample.args, **sample.kwargs).shape
            shape = list(local_shape(ref_shape, strategy.output, mesh_shape))
            return spmd.reshape("node", sample.target, a[0], shape)
        if local_ops.runs_as_is(sample.target) and "avg" not in str(strategy):
            return sample.target(*a, **kw)
        return spmd.op("node", sample.target, str(strategy), *a, **kw)


def _real(t: torch.Tensor) -> torch.Tensor:
    """A complex output enters the test loss by the real part of its product with a complex cotangent."""
    return t.real if t.is_complex() else t


def _reference(sample: Sample, flat, spec, tensors):
    """Single-device outputs, cotangents, the input gradients they give, and
    the inputs the op updated in place (by flat position), after the call."""
    differentiable = [i for k, i in enumerate(tensors) if flat[i].dtype.is_floating_point and k not in sample.frozen]
    mutated = [tensors[k] for k in sample.mutated]
    ref_flat = list(flat)
    for i in differentiable:
        ref_flat[i] = flat[i].clone().requires_grad_()
    for i in mutated:
        ref_flat[i] = flat[i].clone()
    a, kw = pytree.tree_unflatten(ref_flat, spec)
    refs = [t for t in pytree.tree_leaves(sample.target(*a, **kw)) if isinstance(t, torch.Tensor)]
    cots = [torch.randn(r.shape, generator=gen(100 + k), dtype=r.dtype)
            if r.dtype.is_floating_point or r.dtype.is_complex else None
            for k, r in enumerate(refs)]
    grads = {}
    if any(r.requires_grad for r in refs):
        sum(_real(r * c).sum() for r, c in zip(refs, cots) if c is not None and r.requires_grad).backward()
        grads = {i: ref_flat[i].grad for i in differentiable if ref_flat[i].grad is not None}
    return [r.detach() for r in refs], cots, grads, {i: ref_flat[i] for i in mutated}


def run_strategy(sample: Sample, strategy, mesh_shape=(WORLD,)) -> list[str]:
    """Run ``sample`` with its inputs placed as ``strategy`` says on simulated
    ranks (LocalTensorMode), through autopar.spmd (the emitted program's
    runtime); back-propagate a random cotangent; return what differs from the
    single-device op, in value, output placement or input gradient."""
    from torch.distributed._local_tensor import LocalTensor, LocalTensorMode
    from torch.distributed.device_mesh import init_device_mesh

    flat, spec = pytree.tree_flatten((sample.args, sample.kwargs))
    tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    refs, cots, ref_grads, ref_updated = _reference(sample, flat, spec, tensors)
    local_in = {i: place(flat[i], s, mesh_shape, seed=1000 + k)
                for k, (i, s) in enumerate(zip(tensors, strategy.inputs))}
    for i in ref_updated:  # each rank its own copy to update
        local_in[i] = {r: v.clone() for r, v in local_in[i].items()}

    leaves = {}
    outputs = [strategy.item(k) for k in range(len(refs))]
    with LocalTensorMode(WORLD):
        mesh = init_device_mesh("cpu", tuple(mesh_shape))
        args = list(flat)
        for i in tensors:
            args[i] = LocalTensor(local_in[i])
            if i in ref_grads:
                args[i] = args[i].detach().requires_grad_()
                leaves[i] = args[i]
        outs = [t for t in pytree.tree_leaves(_call(sample, strategy, args, spec, mesh, mesh_shape))
                if isinstance(t, torch.Tensor)]
        got = [(as_sum(p), _global_shape(t.shape, p, mesh_shape), _local_values(t)) for t, p in zip(outs, outputs)]
        got_grads = {}
        if leaves:
            # each rank's cotangent is its piece of the whole one (a partial output's is the whole)
            terms = [_real(o * LocalTensor(place(c, producer_grad_spec(p), mesh_shape, 0))).sum()
                     for o, c, p in zip(outs, cots, outputs) if c is not None and o.requires_grad]
            if terms:
                sum(terms).backward()
            grads = use_grads(strategy)
            got_grads = {i: (_local_values(leaf.grad), grads[tensors.index(i)]) if leaf.grad is not None else None
                         for i, leaf in leaves.items()}

    if len(got) != len(refs):
        return [f"{len(got)} outputs, expected {len(refs)}"]
    # spmd turns a planned Partial(avg) into Partial(sum) of local means / n
    problems = []
    for k, ((placements, shape, local_vals), r) in enumerate(zip(got, refs)):
        if tuple(shape) != tuple(r.shape):
            problems.append(f"output {k}: global shape {tuple(shape)}, expected {tuple(r.shape)}")
            continue
        if not sample.values:
            continue
        problems += _differs(local_vals, placements, mesh_shape, r, f"output {k}")
    for i, want_grad in ref_grads.items():
        have = got_grads.get(i)
        if have is None:
            problems.append(f"input {tensors.index(i)}: no gradient")
            continue
        local_grads, placed = have
        problems += _differs(local_grads, placed, mesh_shape, want_grad,
                             f"input {tensors.index(i)}: gradient placed {fmt_spec(placed)}")
    for i, want_value in ref_updated.items():
        wrong = [r for r, v in sorted(local_in[i].items()) if not _close(v, want_value)]
        if wrong:
            problems.append(f"input {tensors.index(i)}: updated in place differently on ranks {wrong}")
    return problems


class _RankMesh:
    """The little of a DeviceMesh a local implementation asks: this rank's coordinate."""

    device_type = "cpu"

    def __init__(self, coord: tuple, mesh_shape):
        self.coord, self.shape, self.ndim = coord, tuple(mesh_shape), len(mesh_shape)

    def get_coordinate(self):
        return list(self.coord)

    def size(self, axis: int = 0) -> int:
        return self.shape[axis]


# Local implementations that read the rank's coordinate as a Python int, which
# LocalTensorMode cannot simulate: checked rank by rank instead.
RANK_BY_RANK = {aten.rand_like.default, aten.randn_like.default, aten.randint_like.default,
                aten.randint_like.low_dtype, aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli.Tensor,
                aten.uniform.default, aten.normal_functional.default, aten.exponential.default,
                aten.scaled_dot_product_attention.default}
"""Ops whose local implementation computes with the rank's coordinate as an
int: the random ops seed each shard's draw by it, causal attention with its
queries' sequence split (context parallelism) narrows the keys to those its
chunk sees. The masked embedding lookup computes with the coordinate only in
tensor arithmetic, which LocalTensorMode carries: it gets the LocalTensorMode check."""


def run_local_impl(sample: Sample, strategy, mesh_shape=(WORLD,)) -> list[str]:
    """Check of an op that has its own local implementation in autopar.spmd,
    rank by rank on plain tensors: such implementations compute with the
    rank's coordinate, which LocalTensorMode cannot carry into Python
    integers. Outputs, and for deterministic ops the input gradients of a
    random cotangent (each rank given its piece), reassembled by the
    placements codegen assumes, equal the single-device op's."""
    case = local_impl_case(sample, strategy, mesh_shape)
    runs = [local_impl_rank(case, r, _RankMesh(c, mesh_shape)) for r, c in enumerate(_coords(mesh_shape))]
    return local_impl_problems(case, [o for o, _ in runs], [g for _, g in runs])


def local_impl_case(sample: Sample, strategy, mesh_shape) -> dict:
    """What ``run_local_impl`` runs and compares with: the single-device
    outputs and input gradients, each rank's inputs and cotangent."""
    flat, spec = pytree.tree_flatten((sample.args, sample.kwargs))
    tensors = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    refs, cots, ref_grads, _ = _reference(sample, flat, spec, tensors)
    if not sample.values:
        ref_grads = {}
    local_in = {i: place(flat[i], s, mesh_shape, seed=1000 + k)
                for k, (i, s) in enumerate(zip(tensors, strategy.inputs))}
    cot = place(cots[0], producer_grad_spec(strategy.output), mesh_shape, 0) if ref_grads else {}
    return dict(sample=sample, strategy=strategy, mesh_shape=tuple(mesh_shape), flat=flat, spec=spec,
                tensors=tensors, ref=refs[0], ref_grads=ref_grads, local_in=local_in, cot=cot)


def local_impl_rank(case: dict, r: int, mesh) -> tuple:
    """Rank ``r``'s output and input gradients (index -> gradient), run
    through the op's local implementation on ``mesh`` (a ``_RankMesh``, or
    the real DeviceMesh of a torchrun job, where the implementation
    communicates: tests/fixtures/cp_ranks.py)."""
    from autopar import local_ops, spmd

    sample, strategy, ref_grads, local_in = case["sample"], case["strategy"], case["ref_grads"], case["local_in"]
    mine = {i: local_in[i][r].detach().requires_grad_() if i in ref_grads else local_in[i][r] for i in local_in}
    a, kw = pytree.tree_unflatten([mine.get(i, v) for i, v in enumerate(case["flat"])], case["spec"])
    out = local_ops._local_impl(sample.target)(sample.target, mesh,
                                               spmd._strategy(str(strategy), len(case["mesh_shape"])), a, kw)
    grads = {}
    if ref_grads:
        _real(out * case["cot"][r]).sum().backward()
        grads = {i: mine[i].grad for i in ref_grads}
    return out.detach(), grads


def local_impl_problems(case: dict, outs: list, grads: list) -> list[str]:
    """What differs from the single-device op, given every rank's output and gradients."""
    strategy, mesh_shape, ref = case["strategy"], case["mesh_shape"], case["ref"]
    out_spec = tuple(Partial() if isinstance(p, Partial) and p.reduce_op == "avg" else p for p in strategy.output)
    try:
        full = assemble(dict(enumerate(outs)), out_spec, mesh_shape)  # replicas must agree
    except AssertionError as e:
        return [f"output: {e}"]
    if not case["sample"].values:  # random draws: the shape, and replicas alike
        return [] if full.shape == ref.shape else [f"output: shape {tuple(full.shape)}, expected {tuple(ref.shape)}"]
    if not _close(full, ref):
        return [f"output: values differ from the single-device op (max abs error {(full - ref).abs().max().item()})"]
    problems = []
    placed = use_grads(strategy)
    for i, want in case["ref_grads"].items():
        k = case["tensors"].index(i)
        problems += _differs({r: g[i] for r, g in enumerate(grads)}, placed[k], mesh_shape, want,
                             f"input {k}: gradient placed {fmt_spec(placed[k])}")
    return problems


def communicates(sample: Sample, strategy, mesh_shape) -> bool:
    """Whether the op's local implementation exchanges data between ranks
    under this strategy, which a rank-by-rank check cannot run: causal
    attention whose sequence split runs balanced (passes/rules/attention.py,
    zigzag_axes), advanced indexing that fetches rows from other ranks
    (indexing.py, routed_axes) and expert-parallel grouped matmuls
    (experts.py, dispatch_axes). tests/fixtures/cp_ranks.py checks these on
    real ranks, with this module's case, run and comparison."""
    from autopar.passes.rules.attention import zigzag_axes
    from autopar.passes.rules.experts import GROUPED_MM_FALLBACK, dispatch_axes
    from autopar.passes.rules.indexing import routed_axes

    target, mesh_shape = sample.target, tuple(mesh_shape)
    if target in (aten.index.Tensor, aten._unsafe_index.Tensor):
        return bool(routed_axes(strategy.inputs[0], list(sample.args[1]), mesh_shape))
    if target is aten._grouped_mm.default or str(target) == GROUPED_MM_FALLBACK:
        return len(sample.args) > 2 and bool(dispatch_axes(strategy.inputs[0], strategy.inputs[1], mesh_shape))
    if target is not aten.scaled_dot_product_attention.default or not sample.kwargs.get("is_causal"):
        return False
    q, seq = sample.args[0], sample.args[0].ndim - 2
    local = local_shape(q.shape, strategy.inputs[0], mesh_shape)
    return zigzag_axes(strategy.inputs[0], seq, local[seq], mesh_shape) is not None


def real_rank_cases(mesh_shape) -> list:
    """(sample, strategy) pairs whose local implementation communicates on
    this mesh (``communicates``), every strategy of every sample: the rule
    tests leave them (those they sample) to real ranks."""
    return [(sample, st) for sample in SAMPLES if get_rule(sample.target) is not None
            for st in strategies_for(sample, mesh_shape) if communicates(sample, st, mesh_shape)]


def check(sample: Sample, strategy, mesh_shape) -> list[str]:
    if sample.target in RANK_BY_RANK and any(
            not isinstance(p, Replicate) for s in strategy.inputs for p in s):
        return run_local_impl(sample, strategy, mesh_shape)
    return run_strategy(sample, strategy, mesh_shape)


def _axis_rows(strategy) -> list[str]:
    """The single-axis rows a strategy combines, printed."""
    return [str(Strategy(tuple((s[a],) for s in strategy.inputs), (strategy.output[a],),
                         items=tuple((s[a],) for s in strategy.items) if strategy.items else None))
            for a in range(len(strategy.output))]


MESH_2D = (2, 2)
PER_SAMPLE_2D = 2


def _sampled_strategies(mesh_shape) -> list:
    """(sample, strategy) pairs the rule tests check on this mesh: every
    strategy on a 1-D mesh; on a 2-D one the genuinely 2-D combinations, a
    few per op (strategy None: no rule)."""
    pairs = []
    for sample in SAMPLES:
        if get_rule(sample.target) is None:
            pairs.append((sample, None))
            continue
        strategies = strategies_for(sample, mesh_shape)
        if len(mesh_shape) > 1:
            mixed = [st for st in strategies
                     if all(any(not isinstance(p[a], Replicate) for p in (*st.inputs, st.output)) for a in range(2))]
            strategies = mixed[:: max(1, len(mixed) // PER_SAMPLE_2D)][:PER_SAMPLE_2D]
        pairs += [(sample, st) for st in strategies]
    return pairs


def _strategy_params(mesh_shape):
    params = []
    for sample, st in _sampled_strategies(mesh_shape):
        if st is None:
            params.append(pytest.param(sample, None, id=f"{sample.id}-NO_RULE"))
            continue
        if communicates(sample, st, mesh_shape):
            continue  # checked on real ranks: real_rank_cases, tests/test_distributed.py
        wrong = [KNOWN_WRONG[(sample.id, r)] for r in _axis_rows(st) if (sample.id, r) in KNOWN_WRONG]
        marks = [pytest.mark.xfail(strict=True, reason=wrong[0])] if wrong else []
        params.append(pytest.param(sample, st, id=f"{sample.id}-{st}", marks=marks))
    return params


@pytest.fixture(scope="module")
def fake_world():
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        if dist.get_world_size() != WORLD:
            pytest.skip(f"a process group of world size {dist.get_world_size()} is already initialised")
        yield
        return
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=WORLD)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sample,strategy", _strategy_params((WORLD,)))
def test_row_is_exact(fake_world, sample, strategy):
    """Every row of every registered rule, on a 1-D mesh of 4."""
    assert strategy is not None, f"no rule registered for {sample.target}"
    problems = check(sample, strategy, (WORLD,))
    assert not problems, f"{sample.id} {strategy}: " + "; ".join(problems)


@pytest.mark.parametrize("sample,strategy", _strategy_params(MESH_2D))
def test_rows_combine_on_2d_mesh(fake_world, sample, strategy):
    """A few two-axis combinations of different rows per op, on a 2x2 mesh."""
    assert strategy is not None, f"no rule registered for {sample.target}"
    problems = check(sample, strategy, MESH_2D)
    assert not problems, f"{sample.id} {strategy}: " + "; ".join(problems)


def test_every_registered_op_has_a_sample():
    sampled = {str(s.target) for s in SAMPLES}
    assert [op for op in registered_ops() if op not in sampled] == []


# ---------------------------------------------------------------------------
# The new rules by table: sample -> strategies on a 1-D mesh of 4, printed.

_BY_ID = {s.id: s for s in SAMPLES}

RULE_TABLE = [
    # a batch-first recurrent layer: its output and its final states split the batch on different dims
    ("gru.input[batch_first]", ["(R, R, R, R) -> R", "(S(0), S(1), R, R) -> (S(0), S(1))"]),
    # column-split bags: the other outputs come from the indices (replicated); max mode's argmax splits too
    ("embedding_bag.padding_idx[max_last_offset]", ["(R, R, R) -> R", "(S(1), R, R) -> (S(1), R, R, S(1))"]),
    ("prelu.default", ["(S(0), R) -> S(0)", "(S(1), S(0)) -> S(1)", "(S(2), R) -> S(2)", "(R, R) -> R"]),
    ("cdist.default", ["(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(R, S(1)) -> S(2)", "(R, R) -> R"]),
    ("grid_sampler.default", ["(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(R, S(1)) -> S(2)", "(R, S(2)) -> S(3)",
                              "(R, R) -> R"]),
    ("cross_entropy_loss.default[unbatched]", ["(R, R) -> R"]),
    ("conv2d.default", ["(S(0), R, R) -> S(0)", "(R, S(0), S(0)) -> S(1)", "(S(1), S(1), P) -> P", "(R, R, R) -> R"]),
    ("conv2d.default[nobias_stride]", ["(S(0), R) -> S(0)", "(R, S(0)) -> S(1)", "(S(1), S(1)) -> P", "(R, R) -> R"]),
    ("conv2d.default[groups]", ["(S(0), R, R) -> S(0)", "(R, R, R) -> R"]),
    ("conv2d.default[unbatched]", ["(R, S(0), S(0)) -> S(0)", "(S(0), S(1), P) -> P", "(R, R, R) -> R"]),
    ("conv_transpose2d.input", ["(S(0), R, R) -> S(0)", "(R, S(1), S(0)) -> S(1)", "(S(1), S(0), P) -> P",
                                "(R, R, R) -> R"]),
    ("convolution.default[transposed]", ["(S(0), R, R) -> S(0)", "(R, S(1), S(0)) -> S(1)", "(S(1), S(0), P) -> P",
                                         "(R, R, R) -> R"]),
    ("batch_norm.default[train]", ["(S(1), S(0), S(0)) -> S(1)", "(S(0), R, R) -> S(0)", "(R, R, R) -> R"]),
    ("batch_norm.default[train_noaffine]", ["(S(1)) -> S(1)", "(S(0)) -> S(0)", "(R) -> R"]),
    ("batch_norm.default[train_running]", ["(S(1), S(0), S(0), R, R) -> S(1)", "(S(0), R, R, R, R) -> S(0)",
                                           "(R, R, R, R, R) -> R"]),
    ("batch_norm.default[eval]", ["(S(1), S(0), S(0), S(0), S(0)) -> S(1)", "(S(0), R, R, R, R) -> S(0)",
                                  "(R, R, R, R, R) -> R"]),
    ("group_norm.default", ["(S(0), R, R) -> S(0)", "(R, R, R) -> R"]),
    ("max_pool2d.default", ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(R) -> R"]),
    ("max_pool2d.default[unbatched]", ["(S(0)) -> S(0)", "(R) -> R"]),
    ("adaptive_avg_pool2d.default[global]", ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(P) -> P", "(R) -> R"]),
    ("einsum.default[moe_up]", ["(R, S(0)) -> S(0)", "(S(0), R) -> S(1)", "(R, S(2)) -> S(2)", "(S(1), S(1)) -> P",
                                "(R, R) -> R"]),
    ("einsum.default[moe_combine]", ["(S(0), S(1)) -> S(0)", "(R, S(2)) -> S(1)", "(S(1), S(0)) -> P", "(R, R) -> R"]),
    ("einsum.default[ellipsis]", ["(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(R, S(1)) -> S(2)", "(S(2), S(0)) -> P",
                                  "(R, R) -> R"]),
    ("einsum.default[diagonal]", ["(R) -> R"]),
    ("einsum.default[sum_all]", ["(S(0)) -> P", "(S(1)) -> P", "(R) -> R"]),
    ("topk.default", ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(R) -> R"]),
    ("topk.default[dim1]", ["(S(0)) -> S(0)", "(S(2)) -> S(2)", "(R) -> R"]),
    ("one_hot.default", ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(R) -> R"]),
    ("cumsum.default", ["(S(0)) -> S(0)", "(S(2)) -> S(2)", "(P) -> P", "(R) -> R"]),
    ("cumsum.default[int]", ["(S(0)) -> S(0)", "(R) -> R"]),
    ("broadcast_tensors.default", ["(S(0), R) -> S(0)", "(S(1), R) -> S(1)", "(S(2), S(0)) -> S(2)", "(R, R) -> R"]),
    ("broadcast_tensors.default[same]", ["(S(0), S(0)) -> S(0)", "(S(1), S(1)) -> S(1)", "(S(2), S(2)) -> S(2)",
                                         "(R, R) -> R", "(P, P) -> P"]),
    ("gather.default[short_index]", ["(S(0), S(0)) -> S(0)", "(S(2), S(2)) -> S(2)", "(R, R) -> R"]),
    ("scatter.src", ["(S(0), S(0), S(0)) -> S(0)", "(S(1), S(1), S(1)) -> S(1)", "(R, R, R) -> R"]),
    ("index_select.default", ["(S(0), R) -> S(0)", "(S(2), R) -> S(2)", "(R, S(0)) -> S(1)", "(R, R) -> R"]),
    # grouped matmuls: the sorted tokens, the experts (Partial: other experts' rows are zero), both (expert
    # parallelism: rows sent to their experts' ranks), the features; the offsets whole. torch's kernel keeps
    # K and N whole (16-byte strides).
    ("transformers.grouped_mm_fallback.default", ["(S(0), R, R) -> S(0)", "(R, S(0), R) -> P",
                                                  "(S(0), S(0), R) -> S(0)", "(R, S(2), R) -> S(1)",
                                                  "(S(1), S(1), R) -> P", "(R, R, R) -> R"]),
    ("_grouped_mm.default", ["(S(0), R, R) -> S(0)", "(R, S(0), R) -> P", "(S(0), S(0), R) -> S(0)",
                             "(R, R, R) -> R"]),
    # rows by position (6 columns do not split 4 ways): a Partial, the positions split (x whole), or x
    # split by the rows it is indexed by (each rank fetching its positions' rows)
    ("index.Tensor[rows]", ["(P, R) -> P", "(R, S(0)) -> S(0)", "(S(0), R) -> S(0)", "(R, R) -> R"]),
    ("_grouped_mm.default[batched]", ["(S(0), S(0)) -> S(0)", "(S(1), R) -> S(1)", "(R, R) -> R"]),
]


@pytest.mark.parametrize("sample_id,expected", RULE_TABLE, ids=[t[0] for t in RULE_TABLE])
def test_rule_table(sample_id, expected):
    strategies = strategies_for(_BY_ID[sample_id], (WORLD,))
    assert [str(s) for s in strategies] == expected


def test_grouped_mm_with_a_bias_is_replicated_with_the_reason():
    from autopar.passes.rules import ReplicatedOnly

    metas = [TensorMeta((16, 8), torch.float32), TensorMeta((4, 8, 16), torch.float32),
             TensorMeta((4,), torch.int32), TensorMeta((4, 16), torch.float32)]  # CPU's kernel takes no bias yet
    info = OpInfo(aten._grouped_mm.default, tuple(TensorArg(i, m) for i, m in enumerate(metas)), {}, metas,
                  [TensorMeta((16, 16), torch.float32)])
    with pytest.raises(ReplicatedOnly, match="bias"):
        get_rule(aten._grouped_mm.default).fn(info)


def test_feature_dropout_in_training_splits_only_samples_and_channels():
    """Dropout2d draws one mask per (sample, channel): a split spatial dim
    would draw one per shard. In eval (tested with the samples) every dim splits."""
    sample = Sample(aten.feature_dropout.default, (x(4, 8, 6, 6), 0.5, True), {})
    assert [str(s) for s in strategies_for(sample, (WORLD,))] == ["(S(0)) -> S(0)", "(S(1)) -> S(1)", "(R) -> R"]


def test_one_hot_with_inferred_classes_is_replicated():
    sample = Sample(aten.one_hot.default, (idx(8, 4, high=6),), {})
    assert [str(s) for s in strategies_for(sample, (WORLD,))] == ["(R) -> R"]


def test_conv_rules_are_costed_as_matmuls():
    for op in (aten.conv2d.default, aten.convolution.default, aten.einsum.default):
        assert get_rule(op).matmul


EINSUM_FORMS = [
    ("bij,bjk", [3, 3], "bij,bjk->ik"),  # implicit output: letters seen once, sorted
    ("ij,jk -> ik", [2, 2], "ij,jk->ik"),
    ("...ij,jk->...ik", [4, 2], "ABij,jk->ABik"),
    ("...ij,...jk", [3, 4], "Bij,ABjk->ABik"),
    ("ba", [2], "ba->ab"),
]


@pytest.mark.parametrize("equation,ndims,expected", EINSUM_FORMS)
def test_normalize_equation(equation, ndims, expected):
    from autopar.passes.rules.matmul import normalize_equation

    assert normalize_equation(equation, ndims) == expected


def test_normalize_equation_rejects_wrong_operand_count():
    from autopar.errors import AutoparError
    from autopar.passes.rules.matmul import normalize_equation

    with pytest.raises(AutoparError, match="names 2 operands; the call passes 1"):
        normalize_equation("ij,jk->ik", [2])


@pytest.mark.parametrize("target, args", [
    (aten.dropout.default, (0.5, True)),
    (aten.native_dropout.default, (0.5, True)),
    (aten.bernoulli.p, (0.5,)),
    (aten.rand_like.default, ()),
])
def test_random_ops_draw_per_shard_and_alike_per_replica(target, args):
    """A random op on a split tensor must not give every shard the same draw
    (every rank's generator is in the same state), nor the replicas of a
    replicated one different draws (a script may seed its ranks apart): with
    the step's shared seed, shards of a split axis draw differently, ranks of
    a replicating axis alike whatever their own generators, and a node draws
    the same again (a recomputation); without one (a unit test), every rank's
    generator advances alike."""
    from autopar import local_ops, moves, spmd
    impl = local_ops.LOCAL_IMPLS[target]
    x = torch.ones(4, 64)

    def draw(coord, spec, own_seed=0, node="dropout_1", step=None):
        torch.manual_seed(own_seed)
        with moves._scoped("step_seed", step), moves._scoped("node", node):
            out = impl(target, _RankMesh(coord, (2, 2)), spmd.OpStrategy((spec,), spec, (), ()), [x, *args], {})
        out = out[0] if isinstance(out, tuple) else out
        return out, torch.rand(1).item()

    step = local_ops.StepSeed()
    step.seed = 1234  # what rank 0 would have broadcast
    split, whole = (Shard(0), Replicate()), (Replicate(), Replicate())
    coords = ((0, 0), (1, 0), (0, 1))
    a, b, c = (draw(coord, split, own_seed=k, step=step)[0] for k, coord in enumerate(coords))
    assert not torch.equal(a, b) and torch.equal(a, c)
    r0, r1 = draw((0, 0), whole, own_seed=1, step=step)[0], draw((1, 1), whole, own_seed=2, step=step)[0]
    assert torch.equal(r0, r1)
    assert torch.equal(draw((1, 1), whole, step=step)[0], r0)  # the same node again: the same draw
    assert not torch.equal(draw((0, 0), whole, node="dropout_2", step=step)[0], r0)
    (a, after_a), (b, after_b) = draw((0, 0), split), draw((1, 0), split)
    assert not torch.equal(a, b) and after_a == after_b
