"""Pipeline parallelism: layers and cuts, the stage search, the plan's pipeline
section, planner decisions at scale, and equivalence with single-device
training on gloo ranks (loss, gradients, parameters after 2 AdamW steps)."""
import itertools
import json
import math
import os
import sys
from types import SimpleNamespace

import pytest
import torch

import autopar
from autopar.capture import capture
from autopar.errors import AutoparError
from autopar.mesh import Mesh
from autopar.pipeline import (
    Schedule, bubble_fraction, compile_pipelined, evaluate, group_layers, profile, search_pipeline,
    should_pipeline,
)
from autopar.pipeline_runtime import stage_graph
from autopar.plan import Plan
from autopar.runtime import load_factory
from conftest import ROOT, torchrun

sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))

FAST = "tests/fixtures/fastnet.json"
TOL = 1e-5


# --- bubble and decision ------------------------------------------------------------------

@pytest.mark.parametrize("schedule, p, m, v, expected", [
    ("1f1b", 4, 8, 1, 3 / 8),
    ("gpipe", 4, 8, 1, 3 / 8),
    ("1f1b", 2, 4, 1, 1 / 4),
    ("interleaved-1f1b", 4, 8, 2, 3 / 16),
    ("interleaved-1f1b", 8, 96, 3, 7 / 288),
    ("1f1b", 1, 1, 1, 0.0),
])
def test_bubble_fraction(schedule, p, m, v, expected):
    assert bubble_fraction(schedule, p, m, v) == pytest.approx(expected)


def test_bubble_fraction_rejects_bad_values():
    with pytest.raises(AutoparError, match="p, m, v >= 1"):
        bubble_fraction("1f1b", 0, 4)
    with pytest.raises(ValueError):
        bubble_fraction("zero-bubble", 2, 4)


@pytest.mark.parametrize("pipelined, flat, expected", [
    (None, 1.0, False),      # nothing pipelined fits
    (1.0, None, True),       # nothing fits without pipelining
    (0.90, 1.0, True),       # 10% faster
    (0.97, 1.0, False),      # inside the 5% margin
    (1.10, 1.0, False),
])
def test_should_pipeline(pipelined, flat, expected):
    as_cand = lambda t: None if t is None else SimpleNamespace(step_s=t)  # noqa: E731
    assert should_pipeline(as_cand(pipelined), as_cand(flat)) is expected


# --- layers and cuts ------------------------------------------------------------------------

def _gpt_graph(batch=2):
    from gpt import small
    model, (idx, target), loss_fn = small()
    return capture(model, (idx[:batch], target[:batch]), loss_fn)


def test_gpt_layers_and_cuts():
    graph = _gpt_graph()
    layers = group_layers(graph)
    assert layers.names == ["tok", "pos", "blocks.0", "blocks.1", "ln", "head"]
    assert layers.container == "blocks"
    # the residual stream is the one tensor crossing each cut
    assert [len(c) for c in layers.crossing] == [0, 1, 1, 1, 1, 1]
    # arange (positions) and the flattened target depend on no parameter: each stage recomputes them
    ops = {graph.nodes[n].op_name for n in layers.floating}
    assert ops == {"arange", "flatten.using_ints"}
    assert not layers.forbidden


def test_skip_connections_cross_cuts_and_are_relayed():
    from skipnet import small
    model, (x, y), loss_fn = small()
    graph = capture(model, (x[:2], y[:2]), loss_fn)
    layers = group_layers(graph)
    assert layers.names == ["inp", "layers.0", "layers.1", "layers.2", "layers.3", "layers.4", "layers.5", "out"]
    # before layers.3: the long residual, two U-Net skips and the running activation (the innermost
    # skip-add is a top-level op, so it joins layers.2, the latest layer among its inputs)
    ops = [graph.nodes[n].op_name for n in layers.crossing[4]]
    assert ops == ["tanh", "relu", "relu", "add.Tensor"]
    (x0,) = layers.crossing[1]  # used again by the final top-level add, which joins layers.5
    assert all(x0 in layers.crossing[c] for c in range(1, layers.n - 1)) and x0 not in layers.crossing[-1]
    middle = stage_graph(graph, layers, 2, 5)
    relayed = set(middle.recv) & set(middle.sends)
    assert x0 in relayed, "the long residual passes through the middle stage untouched"
    last = stage_graph(graph, layers, 5, layers.n)
    assert last.sends is None and last.graph.has_loss


def test_tied_weights_cannot_be_split():
    from gpt import GPT, GPTConfig, lm_loss
    torch.manual_seed(0)
    model = GPT(GPTConfig(layers=2))
    model.head.weight = model.tok.weight
    idx = torch.randint(0, 256, (8, 32))
    layers = group_layers(capture(model, (idx[:2], idx[:2]), lm_loss))
    assert layers.forbidden == set(range(1, layers.n))
    with pytest.raises(AutoparError, match="tied weights"):
        compile_pipelined(model, (idx, idx), mesh="pp=2", cluster=FAST, loss_fn=lm_loss, microbatches=4)


# --- the stage search ---------------------------------------------------------------------------

def test_unequal_layers_get_balanced_stages():
    """A big vocabulary makes the LM head cost 1.5 blocks: the search gives its
    stage fewer blocks than an equal split would, and it is optimal."""
    from gpt import GPT, GPTConfig, lm_loss
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=32768, seq=256, hidden=256, heads=4, layers=8)).to(torch.bfloat16)
        idx = torch.zeros(16, 256, dtype=torch.long)
    prof = profile(model, (idx, idx), lm_loss, Mesh((1,), ("tp",)), "dgx-a100", microbatch=2)
    assert prof.names[-1] == "head" and prof.layers[-1].time_s > 1.3 * prof.layers[2].time_s
    kw = dict(p=4, m=8, schedule=Schedule.ONE_F_ONE_B, v=1, recompute="none", budget=math.inf)
    best = evaluate(prof, **kw)
    blocks = [sum(1 for k in range(i, j) if prof.names[k].startswith("blocks.")) for i, j in best.ranges]
    assert blocks[-1] < blocks[1], f"the head's stage keeps as many blocks ({blocks}) as a middle one"
    equal = evaluate(prof, **kw, ranges=[(0, 4), (4, 6), (6, 8), (8, 12)])  # two blocks each
    assert max(best.chunk_time_s) < 0.9 * max(equal.chunk_time_s)
    assert best.step_s < equal.step_s
    # the dynamic program finds the optimal bottleneck among all contiguous 4-way splits
    n = len(prof.layers)
    brute = min(max(evaluate(prof, **kw, ranges=list(zip((0, *cuts), (*cuts, n)))).chunk_time_s)
                for cuts in itertools.combinations(range(1, n), 3))
    assert max(best.chunk_time_s) == pytest.approx(brute)


def test_pinned_pipeline_plan():
    from gpt import small
    model, inputs, loss_fn = small()
    plan = compile_pipelined(model, inputs, mesh="pp=2,tp=2", cluster=FAST, loss_fn=loss_fn, microbatches=4,
                             schedule="1f1b")
    pipe = plan.pipeline
    assert (pipe["schedule"], pipe["microbatches"], pipe["virtual_stages"], pipe["axis"]) == ("1f1b", 4, 1, "pp")
    assert pipe["bubble_fraction"] == pytest.approx(1 / 4)
    stages = pipe["stages"]
    assert [s["devices"] for s in stages] == [[0, 1], [2, 3]]
    assert [s["submesh"] for s in stages] == [[2], [2]]
    assert sum((s["layers"] for s in stages), []) == ["tok", "pos", "blocks.0", "blocks.1", "ln", "head"]
    assert all(s["time_s"] > 0 and s["memory_bytes"] > 0 and s["nodes"] for s in stages)
    assert {p["stage"] for p in plan.parameters.values()} == {0, 1}
    # inside a stage the plan splits the work over tp (the weights, or on these nearly free links
    # perhaps the batch: the stage's sync is one bucketed all-reduce); pp is never a parameter's axis
    assert plan.parameters["blocks.0.attn.q.weight"]["placements"][0] == "R"
    assert any(n.op == "linear" and "S(" in n.output_spec for n in plan.nodes), "nothing split over tp in a stage"
    sends = [c for c in plan.collectives if c["kind"] == "send_recv"]
    assert {(c["phase"], c["from_stage"], c["to_stage"]) for c in sends} == {("forward", 0, 1), ("backward", 1, 0)}
    # a 2x32x64 fp32 microbatch; each rank sends its own shard of it (the producer's placement on tp)
    specs = {n.name: n.output_spec for n in plan.nodes}
    for c in sends:
        sharded = "S(" in specs[c["tensor"]]  # (pp, tp) placements; pp is always R
        assert c["mesh_axes"] == ["pp"] and c["bytes"] == 2 * 32 * 64 * 4 / (2 if sharded else 1), (c, specs)
    again = Plan.from_json(json.loads(plan.dumps()))
    assert again.pipeline == plan.pipeline


@pytest.mark.parametrize("kwargs, message", [
    ({"mesh": "pp=2,tp=2", "stages": 3}, "disagrees with the mesh"),
    ({"mesh": "pp=2", "microbatches": 3}, "dividing the batch size"),
    ({"mesh": "pp=2", "schedule": "zb"}, "is not one of"),
    ({"mesh": "pp=2", "stages": 0}, "positive integer"),
])
def test_pipeline_arguments_are_checked(kwargs, message):
    from gpt import small
    model, inputs, loss_fn = small()
    with pytest.raises(AutoparError, match=message):
        compile_pipelined(model, inputs, cluster=FAST, loss_fn=loss_fn, **kwargs)


# --- decisions at scale (meta device; priced by repetition) ---------------------------------------

def _meta_gpt(layers, hidden, heads, seq, vocab, batch):
    from gpt import GPT, GPTConfig
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers)).to(torch.bfloat16)
        idx = torch.zeros(batch, seq, dtype=torch.long)
    return model, (idx, idx)


def test_no_pipeline_for_a_1_3b_gpt_on_one_node():
    from gpt import lm_loss
    model, inputs = _meta_gpt(24, 2048, 16, 2048, 51200, 32)
    found = search_pipeline(model, inputs, world=8, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    assert found.repeated == ("blocks", 24, 2)
    assert found.pipelined is not None and found.flat is not None
    assert not found.pipeline, found.summary()
    assert found.best.stages == 1


def test_gpt3_175b_pipelines_across_nodes_with_tp_inside():
    from gpt import lm_loss
    model, inputs = _meta_gpt(96, 12288, 96, 2048, 51200, 1536)
    plan = compile_pipelined(model, inputs, mesh=128 * 8, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    assert plan.solver["pipeline_search"]["decision"] == "pipeline"
    axes = {t["name"]: t for t in plan.topology}
    assert axes["pp"]["size"] > 1 and axes["pp"]["level"] == "inter-node"
    assert axes["tp"]["size"] > 1 and axes["tp"]["level"] == "intra-node"
    pipe = plan.pipeline
    assert pipe["stages"][0]["layers"][:2] == ["tok", "pos"] and pipe["stages"][-1]["layers"][-1] == "head"
    assert sum(len(s["layers"]) for s in pipe["stages"]) == 96 + 4
    assert plan.predicted["peak_memory_bytes"] <= 80e9
    # Megatron-LM reaches 138-148 TFLOP/s per A100 at this scale (Narayanan et al. SC'21, Table 1)
    tflops = plan.predicted["model_flops"] / plan.predicted["step_time_s"] / 1024 / 1e12
    assert 100 < tflops < 250
    assert plan.parameters["blocks.50.mlp.fc.weight"]["placements"] == ["R", "R", "S(0)"]
    # at least as fast as every hand-written grid `autopar estimate` prices that fits in 80 GB
    assert plan.predicted["step_time_s"] <= _best_hand_grid(96, 12288, 96, 2048, 51200, 1536, nodes=128)


def test_solved_layer_classes_serve_another_depth_and_device_count(tmp_path, monkeypatch, caplog):
    """The stage ILPs a search solves for a 24-layer GPT on 16 GPUs answer the
    search for a 16-layer GPT of the same layers on 32 GPUs: nothing is solved
    again and the search decides what it decides without the cache (where
    the stage ILPs are solved one by one, not in parallel)."""
    import autopar.forks
    import autopar.planner
    from gpt import lm_loss
    cache = str(tmp_path / "plans")
    kw = dict(cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    deep, inputs = _meta_gpt(24, 1024, 16, 512, 8192, 64)
    first = search_pipeline(deep, inputs, world=16, cache=cache, **kw)
    assert first.layer_cache == {"hits": 0, "misses": 8}  # tp 1, 2, 4, 8 x 1, 2 sequences per microbatch
    shallow, inputs = _meta_gpt(16, 1024, 16, 512, 8192, 64)
    monkeypatch.setattr(autopar.forks, "SOLVE_WORKERS", 1)  # the cache was filled by parallel solves
    fresh = search_pipeline(shallow, inputs, world=32, **kw)
    assert fresh.layer_cache is None

    solve = autopar.planner.Problem.solve

    def no_solve(self, **options):
        if self.stage:
            raise AssertionError("a cached layer class was solved again")
        return solve(self, **options)

    monkeypatch.setattr(autopar.planner.Problem, "solve", no_solve)
    again = search_pipeline(shallow, inputs, world=32, cache=cache, **kw)
    assert again.layer_cache == {"hits": 8, "misses": 0}
    same = lambda found: {k: v for k, v in found.summary().items() if k not in ("wall_s", "layer_cache")}  # noqa: E731
    assert same(again) == same(fresh)
    # the plan says where its stage ILPs came from
    plan = compile_pipelined(shallow, inputs, mesh=32, cache=cache, **kw)
    assert plan.solver["pipeline_search"]["layer_cache"] == {"hits": 8, "misses": 0}
    from rich.console import Console

    from autopar.report import show
    console = Console(record=True, width=200)
    show(plan, console=console)
    assert "stage ILPs: 8 solved layer classes from the plan cache, 0 solved now" in console.export_text()
    # another submesh is another key: solved, not guessed
    with pytest.raises(AssertionError, match="solved again"):
        search_pipeline(shallow, inputs, world=32, cache=cache, cluster="dgx-h100", loss_fn=lm_loss,
                        precision="bf16")
    # a corrupt entry is a miss, with a warning, and is solved and replaced
    monkeypatch.undo()
    entry = sorted((tmp_path / "plans" / "layers").glob("*.json"))[0]
    entry.write_text('{"choice": {"no such node": 0}}')
    with caplog.at_level("WARNING", logger="autopar"):
        mended = search_pipeline(shallow, inputs, world=32, cache=cache, **kw)
    assert mended.layer_cache == {"hits": 7, "misses": 1} and "unreadable" in caplog.text
    assert same(mended) == same(fresh)


def _best_hand_grid(layers, hidden, heads, seq, vocab, batch, *, nodes):
    """The fastest TP x PP x DP x microbatch x recomputation x sequence parallelism x
    virtual stages plan of ``autopar estimate`` on dgx-a100 (no distributed
    optimizer) that fits in 80 GB per GPU."""
    from autopar.cost_models.cluster import get_cluster
    from autopar.cost_models.transformer import estimate
    from autopar.cost_models.transformer_plan import TrainingPlan, TransformerConfig
    from autopar.errors import AutoparError
    model = TransformerConfig(layers=layers, hidden=hidden, heads=heads, seq=seq, vocab=vocab)
    cluster, world = get_cluster("dgx-a100"), nodes * 8
    best = float("inf")
    for tp in (1, 2, 4, 8):
        for pp in (p for p in (1, 2, 4, 8, 16, 32, 64) if layers % p == 0 and world % (tp * p) == 0):
            dp = world // (tp * pp)
            for mb in (b for b in (1, 2, 4, 8) if batch % (dp * b) == 0):
                for v in (1, 2, 3, 4, 6, 8):
                    if v > 1 and (pp == 1 or layers % (pp * v)):
                        continue
                    for recompute in ("none", "selective", "full"):
                        for sp in (False, True):
                            try:
                                est = estimate(model, TrainingPlan(
                                    batch=batch, microbatch=mb, tp=tp, pp=pp, dp=dp, virtual_stages=v,
                                    recompute=recompute, sequence_parallel=sp, precision="bf16"), cluster, nodes)
                            except AutoparError:
                                continue
                            if est.fits_in_memory:
                                best = min(best, est.step_time_s)
    return best


# --- equivalence on gloo ranks --------------------------------------------------------------

def _check(tmp_path, nproc, mesh, sources, schedules, recompute="none"):
    """``autopar verify`` (autopar/verify.py) of the pipelined plans: in float64, loss, gradients,
    parameters, the evaluation loss and the reloaded state equal one device's."""
    out = tmp_path / "report.json"
    proc = torchrun(["-m", "autopar.verify", *sources, "--mesh", mesh, "--cluster", FAST, "--microbatches", "4",
                     "--schedule", schedules, "--recompute", recompute, "--json", str(out)], nproc)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    reports = json.loads(out.read_text())
    for r in reports:
        label = f"{r['source']} {r['plan']['pipeline']['schedule']}"
        assert max(r["loss_rel"], r["grad"], r["eval_loss_rel"], r["reload"]) <= r["tol"], label
        assert r["param"] <= max(r["tol"], r["param_floor"]) and r["dtype"] == "torch.float64", label
    return reports


@pytest.mark.launch
def test_two_stages_on_two_ranks(tmp_path):
    reports = _check(tmp_path, 2, "pp=2", ["examples/gpt.py:small", "tests/fixtures/skipnet.py:small"],
                     "1f1b,gpipe,interleaved-1f1b")
    pipes = [r["plan"]["pipeline"] for r in reports]
    assert [(r["source"].split("/")[-1], p["schedule"]) for r, p in zip(reports, pipes)] == [
        (s, k) for s in ("gpt.py:small", "skipnet.py:small") for k in ("1f1b", "gpipe", "interleaved-1f1b")]
    assert pipes[0]["microbatches"] == 4
    # each rank holds (and its optimizer updates) only its own stage's parameters
    rank0, rank1 = pipes[0]["local_parameters_by_rank"]
    assert "tok.weight" in rank0 and "head.weight" in rank1 and not set(rank0) & set(rank1)
    interleaved = [p for p in pipes if p["schedule"] == "interleaved-1f1b"]
    assert all(p["virtual_stages"] > 1 for p in interleaved)


@pytest.mark.launch
def test_two_stages_times_two_way_tensor_parallel_on_four_ranks(tmp_path):
    """Also with every block recomputed in backward (checkpointed inside its
    stage), and with each block's selective regions recomputed (the attention
    core: passes/recompute.py; the explicit attention's scores and softmax),
    as the search may choose."""
    r, selective, recomputed = _check(tmp_path, 4, "pp=2,tp=2", ["examples/gpt.py:explicit"], "1f1b",
                                      "none,selective,full")
    assert (recomputed["plan"]["recompute_mode"], recomputed["plan"]["recompute"]) == ("full", ["blocks.0", "blocks.1"])
    assert (selective["plan"]["recompute_mode"], selective["plan"]["recompute"]) == ("selective", ["blocks.0", "blocks.1"])
    pipe = r["plan"]["pipeline"]
    # the selective regions run under checkpoints in the stage programs
    assert sum(selective["plan"]["pipeline"]["programs"].values()) > sum(pipe["programs"].values())
    assert [s["devices"] for s in pipe["stages"]] == [[0, 1], [2, 3]]
    assert any(p[1] != "R" for p in r["plan"]["parameters"].values()), "no tensor parallelism inside the stages"
    # what crosses the cut travels as shards of the submesh, each rank to its peer
    assert pipe["sent"] and all(spec != "R" for spec in pipe["sent"].values()), pipe["sent"]
    # gradients replicated over tp accumulate over the 4 microbatches and are reduced once, in buckets
    assert pipe["deferred_reductions"] > 0
    # and their optimizer states are ZeRO-1 shards: the optimizer sees 1/2 of each
    assert pipe["zero1_parameters"] and pipe["optimizer_sharding"] == "zero-1"
    by_rank = pipe["local_parameters_by_rank"]
    assert by_rank[0] == by_rank[1] and by_rank[2] == by_rank[3] and not set(by_rank[0]) & set(by_rank[2])


@pytest.mark.launch
def test_gradient_accumulation_without_a_pipeline_on_four_ranks(tmp_path):
    """pp=1: the one stage runs 4 microbatches on a 2x2 submesh, accumulates
    gradients, reduces them once per step and shards the optimizer states
    over the replicated axes (ZeRO-1): the same training as one device."""
    (r,) = _check(tmp_path, 4, "pp=1,dp=2,tp=2", ["examples/gpt.py:small"], "1f1b")
    pipe = r["plan"]["pipeline"]
    assert [s["devices"] for s in pipe["stages"]] == [[0, 1, 2, 3]] and pipe["microbatches"] == 4
    assert pipe["deferred_reductions"] > 0 and pipe["zero1_parameters"]


def test_microbatches_without_stages_accumulate_gradients():
    """``microbatches`` on a mesh without pipelining is honoured (it used to
    be dropped): a one-stage plan whose microbatches accumulate gradients."""
    model, inputs, loss = load_factory("examples/gpt.py:small")
    plan = autopar.compile(model, inputs, mesh=4, cluster=FAST, loss_fn=loss, microbatches=4, pipeline_stages=1)
    assert plan.pipeline["microbatches"] == 4 and len(plan.pipeline["stages"]) == 1
    assert plan.pipeline["optimizer_sharding"] == "zero-1" and plan.pipeline["bubble_fraction"] == 0.0
    searched = autopar.compile(model, inputs, mesh=4, cluster=FAST, loss_fn=loss, microbatches=4)
    assert searched.pipeline["microbatches"] == 4


@pytest.mark.launch
def test_pipeline_times_data_times_tensor_parallel_on_eight_ranks(tmp_path):
    """pp=2 x dp=2 x tp=2: each stage runs the intra-stage plan on a 2x2
    submesh; what crosses the cut is sent as shards, each rank to its peer."""
    (r,) = _check(tmp_path, 8, "pp=2,dp=2,tp=2", ["examples/gpt.py:small"], "1f1b")
    pipe = r["plan"]["pipeline"]
    assert [s["devices"] for s in pipe["stages"]] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert pipe["sent"] and all("S(" in spec for spec in pipe["sent"].values()), pipe
    # (the stages' plans may run an axis's work replicated: gradients are then whole on every rank there and
    # nothing is deferred; ZeRO-1 takes its piece of them; equal to one device all the same)
    assert pipe["zero1_parameters"]


def test_batch_norm_over_microbatches_is_warned_and_kept_in_the_plan():
    """Training-mode batch norm normalises each microbatch by its own
    statistics: a pipelined plan with several microbatches says so."""
    model, inputs, loss_fn = load_factory("examples/resnet.py:small")
    with pytest.warns(UserWarning, match=r"batch norm in training mode \(stem_bn, blocks\.0\.bn1, blocks\.0\.bn2, "
                                         r"\.\.\.\) normalises each of the 2 microbatches with its own statistics"):
        plan = compile_pipelined(model, inputs, mesh="pp=2", cluster=FAST, loss_fn=loss_fn, microbatches=2)
    assert any("normalises each of the 2 microbatches" in w for w in plan.warnings)


def test_pipelines_are_searched_by_default_where_the_mesh_spans_nodes():
    """Issue 28: without ``pipeline_stages``, a training step on a mesh that
    spans more than one node of the cluster searches pipelines
    (``pipeline_stages="auto"``); one that fits in a node, or
    ``pipeline_stages=1``, plans without. The plan says why."""
    from gpt import lm_loss
    model, inputs = _meta_gpt(4, 256, 4, 64, 512, 32)
    kw = dict(cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    searched = autopar.compile(model, inputs, mesh=16, **kw)
    assert "pipeline_search" in searched.solver
    assert searched.solver["pipelining"].startswith(
        "the mesh's 16 devices span 2 nodes of dgx-a100: pipelines searched (pipeline_stages=1 forbids them); "
        f"the search chose {searched.solver['pipeline_search']['decision']}")
    forbidden = autopar.compile(model, inputs, mesh=16, pipeline_stages=1, **kw)
    assert forbidden.pipeline is None and "pipeline_search" not in forbidden.solver
    assert forbidden.solver["pipelining"] == "pipeline_stages=1: pipelining forbidden"
    one_node = autopar.compile(model, inputs, mesh=8, **kw)
    assert one_node.pipeline is None and "pipeline_search" not in one_node.solver
    assert one_node.solver["pipelining"] == ("the mesh's 8 devices fit in one node of dgx-a100 (8 devices): "
                                             "planned without a pipeline")


def test_deterministic_pipelined_compiles_are_byte_identical():
    """--deterministic leaves the wall-clock times out of a pipelined plan too
    (the planner's and the pipeline search's): two compiles of the same
    model write the same plan.json."""
    from gpt import lm_loss
    model, inputs = _meta_gpt(48, 8192, 64, 2048, 51200, 1536)  # GPT-3 39B shapes (Narayanan et al. Table 1)
    kw = dict(mesh=512, cluster="dgx-a100", loss_fn=lm_loss, precision="bf16")
    plans = [autopar.compile(model, inputs, deterministic=True, **kw) for _ in range(2)]
    assert plans[0].pipeline is not None and plans[0].solver["pipeline_search"]["decision"] == "pipeline"
    assert plans[0].solver["wall_s"] is None and plans[0].solver["pipeline_search"]["wall_s"] is None
    assert plans[0].dumps() == plans[1].dumps()
    timed = autopar.compile(model, inputs, **kw)
    assert timed.solver["wall_s"] > 0 and timed.solver["pipeline_search"]["wall_s"] > 0


def test_selective_recomputation_is_a_pipeline_option():
    """Stages may recompute each block's selective regions (the explicit
    attention's scores and softmax, passes/recompute.py), priced on the same
    plan by the flat planner's accounting: less kept than without
    recomputation, less time than recomputing whole blocks. Under a budget
    that the plan without recomputation exceeds, the search takes selective
    over full recomputation."""
    from gpt import GPT, GPTConfig, lm_loss
    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=1024, seq=512, hidden=256, heads=8, layers=8, attention="explicit"))
        idx = torch.zeros(16, 512, dtype=torch.long)
    prof = profile(model, (idx, idx), lm_loss, Mesh((2,), ("tp",)), "dgx-a100", microbatch=2)
    assert prof.selective is not None and prof.selective_rc.regions
    block = prof.names.index("blocks.3")
    none, sel = prof.layers[block], prof.selective[block]
    assert sel.act_bytes < 0.7 * none.act_bytes and sel.recomputed_bytes > 0
    assert none.time_s < sel.time_s < none.time_s + none.fwd_s  # cheaper than recomputing the whole block
    kw = dict(p=2, m=8, schedule=Schedule.ONE_F_ONE_B, v=1)
    plans = {mode: evaluate(prof, **kw, recompute=mode, budget=math.inf) for mode in ("none", "selective", "full")}
    assert plans["none"].step_s < plans["selective"].step_s < plans["full"].step_s
    assert plans["full"].memory_bytes < plans["selective"].memory_bytes < plans["none"].memory_bytes
    budget = plans["selective"].memory_bytes * 1.02  # no split of the blocks fits it without recomputation
    assert evaluate(prof, **kw, recompute="none", budget=budget) is None
    assert evaluate(prof, **kw, recompute="selective", budget=budget).step_s < \
        evaluate(prof, **kw, recompute="full", budget=budget).step_s


def test_stage_pricing_sums_the_flat_planners_accounting():
    """One accounting: the per-layer costs a pipeline prices a stage with
    (pricing._price) add up to the totals the flat planner's plan of the same
    strategies predicts (planner.build_plan): compute, communication (the
    gradient syncs included), parameters, gradients and optimizer state; on
    a random plan (every node a random strategy), which communicates."""
    import random

    from autopar.pipeline.pricing import _price
    from autopar.planner import Solved, build_plan, prepare
    from autopar.solver import Solution
    model, inputs, loss = load_factory("examples/gpt.py:small")
    graph = capture(model, inputs, loss)
    problem = prepare(graph, "2x2", "dgx-a100", stage=True)
    rng = random.Random(0)
    choice = {name: rng.randrange(len(ss)) for name, ss in problem.strategies.items()}
    solved = Solved(problem, Solution(choice, "RANDOM", 0.0, 0.0, 0, 0, 0.0))
    plan = build_plan(graph, solved.chosen, problem.strategies, problem.ctx, problem.mesh, solved.solution, None)
    layers, _ = _price(graph, group_layers(graph), solved.chosen, problem.ctx, None)
    p, overhead = plan.predicted, problem.ctx.cluster.device.step_overhead
    assert p["comm_s"] > p["grad_sync_s"] > 0
    assert sum(lc.fwd_s + lc.bwd_s for lc in layers) == pytest.approx(p["compute_s"] - overhead)
    assert sum(lc.comm_s + lc.sync_s for lc in layers) == pytest.approx(p["comm_s"])
    assert sum(lc.sync_s for lc in layers) <= p["grad_sync_s"] * (1 + 1e-9)
    for part, field in (("parameters", "param_bytes"), ("gradients", "grad_bytes"), ("optimizer", "optimizer_bytes")):
        assert sum(getattr(lc, field) for lc in layers) == pytest.approx(p["memory"][part])
