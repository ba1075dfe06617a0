"""The planner rediscovers the known optima, prices memory, and explains bad input."""
import json
import os
import pytest
import torch
from torch import nn

import autopar
from autopar.errors import InfeasibleError, LaunchError
from autopar.runtime import load_factory
from conftest import ROOT


def forward_collectives(plan):
    return [c for c in plan.collectives if c["phase"] == "forward"]


def test_mlp_small_batch_large_hidden_is_megatron_tensor_parallel():
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=8192, d_in=2048, d_out=2048)
    plan = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss)
    placements = {k: v["placements"] for k, v in plan.parameters.items()}
    assert placements["layers.0.weight"] == ["S(0)"]  # column split (out features)
    assert placements["layers.1.weight"] == ["S(1)"]  # row split (in features)
    # besides gathers of small parameters held sharded (ZeRO: bucketed, they cost their bytes and a share of
    # one call), the only forward collective is the row-parallel GEMM's all-reduce
    fwd = [c for c in forward_collectives(plan) if c["tensor"] not in plan.parameters]
    assert [c["kind"] for c in fwd] == ["all_reduce"]
    assert plan.node("linear_1").strategy == "(S(1), S(1), P) -> P"


def test_mlp_large_batch_small_hidden_is_data_parallel():
    from mlp import make
    model, inputs, loss = make(batch=65536, hidden=64, d_in=64, d_out=64)
    plan = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss)
    # every parameter is used whole: replicated, or stored ZeRO-sharded and
    # gathered (on one node the gather costs what the gradient all-reduce
    # saves, and the optimizer step shrinks), never split by tensor parallelism
    assert all(p["zero_stage"] in (0, 2, 3) for p in plan.parameters.values())
    # besides those gathers, the only forward collective is the scalar loss,
    # averaged over the batch shards
    fwd = [c for c in forward_collectives(plan) if c["tensor"] not in plan.parameters]
    assert [(c["kind"], c["bytes"]) for c in fwd] == [("all_reduce", 4.0)]
    synced = {c["tensor"] for c in plan.collectives
              if c["gradient_sync"] and c["kind"] in ("all_reduce", "reduce_scatter")}
    assert synced == set(plan.parameters)


@pytest.fixture(scope="session")  # built once per xdist worker, which interleaves modules
def megatron_plan():
    from gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=1024, seq=128, hidden=4096, heads=32, layers=2)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, cfg.vocab, (2, cfg.seq))
        tgt = torch.randint(0, cfg.vocab, (2, cfg.seq))
    return autopar.compile(model, (idx, tgt), mesh=4, cluster="dgx-a100", loss_fn=lm_loss)


@pytest.mark.parametrize("layer", [0, 1])
def test_gpt_block_small_batch_large_hidden_is_megatron(megatron_plan, layer):
    p = {k: v["placements"][0] for k, v in megatron_plan.parameters.items()}
    b = f"blocks.{layer}"
    assert [p[f"{b}.attn.{n}.weight"] for n in "qkv"] == ["S(0)"] * 3
    assert p[f"{b}.mlp.fc.weight"] == "S(0)"
    assert p[f"{b}.attn.proj.weight"] == "S(1)"
    assert p[f"{b}.mlp.proj.weight"] == "S(1)"
    sdpa = [n for n in megatron_plan.nodes if n.op == "scaled_dot_product_attention" and n.location.startswith(b)]
    assert sdpa[0].strategy == "(S(1), S(1), S(1)) -> S(1)"  # attention heads split
    # two forward reductions per block, after the row-parallel projections:
    # all-reduces, or reduce-scatters onto sequence shards (Megatron sequence
    # parallelism, Korthikanti et al. 2022) with all-gathers before q/k/v and fc
    producers = {n.name: n.location for n in megatron_plan.nodes}
    in_block = [c for c in forward_collectives(megatron_plan)
                if c["kind"] in ("all_reduce", "reduce_scatter") and producers[c["producer"]].startswith(b)]
    assert len(in_block) == 2


def test_resnet_large_batch_is_data_parallel_with_synchronised_batch_norm():
    """Training-mode batch norm may split the batch: its statistics are then
    all-reduced inside the op (SyncBatchNorm), which makes plain data
    parallelism available to CNNs."""
    import resnet
    cfg = resnet.ResNetConfig(image=32, widths=(64, 128, 256))
    with torch.device("meta"):
        model = resnet.ResNet(cfg)
        images, labels = torch.randn(256, 3, 32, 32), torch.randint(0, 10, (256,))
    plan = autopar.compile(model, (images, labels), mesh=4, cluster="dgx-a100",
                           loss_fn=torch.nn.functional.cross_entropy)
    norms = [n for n in plan.nodes if n.op == "batch_norm"]
    # input, weight, bias, running mean and variance (updated whole on every rank)
    assert norms and all(n.strategy == "(S(0), R, R, R, R) -> S(0)" for n in norms)


@pytest.mark.parametrize("opt_level", [1, 2])
def test_plans_are_byte_identical(opt_level, tmp_path):
    from gpt import small
    files = []
    for i in range(2):
        model, inputs, loss = small()
        plan = autopar.compile(model, inputs, mesh=(2, 2), cluster="dgx-a100", loss_fn=loss,
                               opt_level=opt_level, deterministic=True)
        plan.save(str(tmp_path / f"plan{i}.json"))
        files.append((tmp_path / f"plan{i}.json").read_bytes())
    assert files[0] == files[1]


def test_o2_is_never_worse_than_o1():
    from gpt import small
    model, inputs, loss = small()
    o1, o2 = (autopar.compile(model, inputs, mesh=(2, 2), cluster="dgx-a100", loss_fn=loss, opt_level=level)
              for level in (1, 2))
    assert not o2.solver["clustered"] and o1.solver["clustered"]
    assert o2.solver["objective"] <= o1.solver["objective"] * (1 + 1e-4)


def _meta_gpt(layers: int, hidden: int, seq: int, batch: int, heads: int = 8, vocab: int = 512):
    from gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=vocab, seq=seq, hidden=hidden, heads=heads, layers=layers)
    with torch.device("meta"):
        model = GPT(cfg)
        idx, target = torch.randint(0, vocab, (batch, seq)), torch.randint(0, vocab, (batch, seq))
    return model, (idx, target), lm_loss


def test_the_program_syncs_the_gradients_the_plan_prices():
    """A parameter's gradient is all-reduced over the mesh axes where its uses
    split their work (the batch here), where the plan prices the sum, not
    over every axis that replicates it: with Megatron's split on y the layer
    norms run whole on each rank of y, and their gradients need no sum there."""
    import re
    from autopar.capture import capture
    from autopar.codegen import build_program, program_source
    model, inputs, loss = _meta_gpt(layers=2, hidden=256, seq=64, batch=16)

    def tp(fqn):
        if fqn.endswith(("attn.q.weight", "attn.k.weight", "attn.v.weight", "mlp.fc.weight", "mlp.fc.bias")):
            return "S(0)"
        return "S(1)" if fqn.endswith(("attn.proj.weight", "mlp.proj.weight")) else "R"
    pins = {fqn: ["R", tp(fqn)] for fqn, _ in model.named_parameters()}
    plan = autopar.compile(model, inputs, mesh="2x2", cluster="dgx-a100", loss_fn=loss, parameter_placements=pins)
    graph = capture(model, inputs, loss)
    program = program_source(build_program(graph, plan), plan)
    node = graph.params  # fqn -> the program's argument
    summed = {m[1]: {int(a) for a in m[2].split(",") if a.strip()}
              for m in re.finditer(r"autopar_spmd_param\((\w+), '[^']*', \(([\d, ]*)\)\)", program)}
    priced = {node[fqn]: set() for fqn in plan.parameters}
    for c in plan.collectives:
        if c["gradient_sync"] and c["kind"] == "all_reduce":
            priced[node[c["tensor"]]].add(plan.mesh.names.index(c["mesh_axes"][0]))
    assert summed == priced
    replicated = [node[fqn] for fqn, p in plan.parameters.items() if p["placements"] == ["R", "R"]]
    assert any(summed[name] != {0, 1} for name in replicated), summed  # some are whole on y


def test_the_program_prefetches_each_zero3_module_where_it_gathers_the_one_before():
    """ZeRO-3 (every parameter pinned "S(0) regather"): one gather per module, its first all-gather started
    where the module before it is gathered (``prefetch_params``, finished by ``gather_params(...,
    ahead=)``), bias-free modules (one parameter) too; the first module's gather is not prefetched. The plan
    prices each module's gather where the program waits for it (``prefetched_gather_s``: all of them)."""
    import re

    import torch.nn as nn
    from autopar.capture import capture
    from autopar.codegen import build_program, program_source
    from autopar.pinned import compile_pinned
    model, inputs, loss = _meta_gpt(layers=2, hidden=256, seq=64, batch=16)
    tail = nn.Linear(8, 8, bias=False)  # and a model of bias-free layers, one parameter per module
    cases = ((model, inputs, loss), (nn.Sequential(nn.Linear(8, 8, bias=False), nn.ReLU(), nn.Linear(8, 8, bias=False), nn.ReLU(), tail),
                                     (torch.randn(16, 8), torch.randn(16, 8)), torch.nn.functional.mse_loss))
    for model, inputs, loss in cases:
        pins = {fqn: ["S(0)", "regather"] for fqn, _ in model.named_parameters()}
        plan = compile_pinned(model, inputs, mesh="4", cluster="dgx-a100", loss_fn=loss, parameter_placements=pins,
                              input_placements={0: ["S(0)"], 1: ["S(0)"]})
        program = program_source(build_program(capture(model, inputs, loss), plan), plan)
        gathered = re.findall(r"gathered_(\d+) = autopar_spmd_gather_params\(.*\), True(?:, whole = [^=]*)?"
                              r"(, ahead = ahead_(\d+))?\)", program)
        assert len(gathered) == len({fqn.rpartition(".")[0] for fqn in plan.parameters}) >= 3, program
        assert gathered[0][1] == "" and all(ahead == k for k, _, ahead in gathered[1:]), gathered
        lines = program.splitlines()
        for k, _, _ in gathered[1:]:  # started right after the bucket before it was gathered
            start = next(i for i, line in enumerate(lines) if f"ahead_{k} = autopar_spmd_prefetch_params(" in line)
            assert f"gathered_{int(k) - 1} = autopar_spmd_gather_params(" in lines[start - 1], lines[start - 1]
        forward = sum(c["seconds"] for c in plan.collectives if c["phase"] == "forward"
                      and c["kind"] == "all_gather" and c["tensor"] in plan.parameters)
        assert plan.predicted["prefetched_gather_s"] == pytest.approx(forward, rel=1e-9)


def test_layer_classes_peel_instances_off_the_ends():
    from autopar.capture import capture
    from autopar.passes.layer_classes import deeper_ends, layer_classes, repeated_layers
    model, inputs, loss = _meta_gpt(layers=6, hidden=64, seq=16, batch=4, heads=4, vocab=64)
    graph = capture(model, inputs, loss)
    (blocks,) = repeated_layers(graph)
    assert len(blocks) == 6 and len({len(names) for names in blocks}) == 1
    rep = layer_classes(graph, ((1, 2),))
    owner = lambda i: {rep[n] for n in blocks[i]}  # noqa: E731
    assert owner(0) == set(blocks[0]) and owner(4) == set(blocks[4]) and owner(5) == set(blocks[5])
    assert owner(1) == owner(2) == owner(3) == set(blocks[1])
    assert {rep[n] for b in blocks for n in b} == set(blocks[0]) | set(blocks[1]) | set(blocks[4]) | set(blocks[5])
    # with nothing peeled, every block shares the first one's variables
    assert {layer_classes(graph)[n] for b in blocks for n in b} == set(blocks[0])

    same = {n: 0 for b in blocks for n in b}
    assert deeper_ends([blocks], ((0, 0),), same) == ((1, 1),)  # the ends first
    assert deeper_ends([blocks], ((1, 1),), same) == ((1, 1),)  # neighbours agree: done
    first_differs = {**same, blocks[0][3]: 1}
    assert deeper_ends([blocks], ((1, 1),), first_differs) == ((2, 1),)
    last_differs = {**same, blocks[5][3]: 1}
    assert deeper_ends([blocks], ((1, 1),), last_differs) == ((1, 2),)
    # a shared group of two would save less than solving again costs
    assert deeper_ends([blocks], ((2, 1),), {**same, blocks[1][3]: 1, blocks[0][3]: 1}) == ((6, 0),)
    assert {layer_classes(graph, ((6, 0),))[n] for b in blocks for n in b} == {n for b in blocks for n in b}


def test_clustered_solve_peels_the_layers_whose_position_changes_their_plan(monkeypatch):
    """Repeated layers share ILP variables, but the first layer's gradient
    sync has the least backward compute left to hide under: here the optimum
    data-parallelises the later layers and not the first. Forcing every layer
    to share one strategy (the clustering before the ends were peeled) is 2%
    off the unclustered optimum on this model; peeling is within 1%. (A node
    whose links have a quarter of NVLink's bandwidth, as PCIe-class links do:
    on dgx-a100 itself the bucketed sync of this GPT all but hides.)"""
    import json

    import autopar.planner
    from autopar.cost_models.cluster import get_cluster
    monkeypatch.setattr(autopar.planner, "SOLVED_ALONE", 1)  # four layers: clustered, as a longer model would be
    # the peeled solve's time cap is a policy for this machine's speed (PEEL_TIME_FACTOR, PEEL_MIN_S), not what
    # is tested here: on a machine half as fast the layer-by-layer solve ran past its 5 s and the clustered plan stood
    monkeypatch.setattr(autopar.planner, "PEEL_TIME_FACTOR", 100.0)
    cluster = json.loads(json.dumps(get_cluster("dgx-a100").to_json()))
    cluster["name"], cluster["intra_node"]["bandwidth"] = "dgx-a100-quarter-links", cluster["intra_node"]["bandwidth"] / 4
    model, inputs, loss = _meta_gpt(layers=4, hidden=512, seq=64, batch=16)
    compile_ = lambda **kw: autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, **kw)  # noqa: E731
    exact = compile_(cluster_layers=False).solver["objective"]
    peeled = compile_()
    (blocks,) = peeled.solver["layer_classes"]
    assert blocks["layers"] == [f"blocks.{i}" for i in range(4)] and blocks["solves"] >= 2
    assert peeled.solver["window_exposed_s"] > 0  # the sync window bound in the first solve
    assert peeled.solver["objective"] <= exact * 1.01
    from rich.console import Console
    from autopar.report import show
    console = Console(record=True, width=200)
    show(peeled, console=console)
    assert "layer class blocks.0 .. blocks.3 (4 layers): solved layer by layer, the gradient sync window bound " \
           f"({blocks['solves']} solves)" in console.export_text()
    monkeypatch.setattr(autopar.planner, "deeper_ends", lambda layers, ends, choice: ends)
    shared = compile_()
    assert shared.solver["layer_classes"][0]["shared"] == 4
    assert shared.solver["objective"] > exact * 1.01


def test_memory_budget_too_small_says_how_much_is_needed():
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=4096, d_in=4096, d_out=4096)
    with pytest.raises(InfeasibleError) as e:
        autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, memory=1e6)
    msg = str(e.value)
    assert "no plan fits in" in msg and "needs at least" in msg and "layers.0.weight" in msg
    assert e.value.needed_bytes > 1e6


def test_dimension_no_axis_divides_is_warned():
    model = nn.Linear(5, 7)
    with pytest.warns(UserWarning, match=r"weight of shape \[7, 5\]: no dimension divides any mesh axis"):
        plan = autopar.compile(model, (torch.randn(3, 5),), mesh=4, cluster="dgx-a100")
    assert plan.parameters["weight"]["placements"] == ["R"]


def test_a_clusters_caveat_is_warned_and_kept_in_the_plan():
    """A preset whose numbers are borrowed (the V100's efficiencies are the
    A100's fit) says so when it prices a plan, and the plan keeps the warning."""
    model = nn.Linear(8, 8)
    with pytest.warns(UserWarning, match=r"cluster p3.16xlarge: its GEMM and memory efficiencies are the A100's"):
        plan = autopar.compile(model, (torch.randn(4, 8),), mesh=2, cluster="p3.16xlarge")
    assert any(w.startswith("cluster p3.16xlarge: ") for w in plan.warnings)


def test_cli_prints_autopars_warnings_as_one_line(tmp_path):
    """`autopar compile` writes a warning as "autopar: warning: ...", not with
    Python's source location and code line."""
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "autopar.cli", "compile", "examples/mlp.py:small", "--mesh", "2",
                           "--cluster", "p3.16xlarge", "-q", "-o", str(tmp_path / "plan.json")],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "autopar: warning: cluster p3.16xlarge: its GEMM and memory efficiencies" in proc.stderr
    assert "UserWarning" not in proc.stderr and "compile_plan(" not in proc.stderr


def test_autoparallelize_outside_torchrun_shows_the_command(monkeypatch):
    from mlp import make
    monkeypatch.delenv("RANK", raising=False)
    model, inputs, loss = make()
    with pytest.raises(LaunchError, match=r"torchrun --nproc-per-node 4 "):
        autopar.autoparallelize(model, inputs, loss_fn=loss, mesh=(2, 2), cluster="cpu")


def test_single_device_fallback_is_explicit_and_warned(monkeypatch):
    from mlp import make
    monkeypatch.delenv("RANK", raising=False)
    model, inputs, loss = make()
    with pytest.warns(UserWarning, match="running the model on one process"):
        pm = autopar.autoparallelize(model, inputs, loss_fn=loss, mesh=4, cluster="cpu", single_device=True)
    assert torch.allclose(pm(*inputs), loss(model(inputs[0]), inputs[1]))


def test_a_solve_out_of_time_says_so_not_infeasible():
    """A solver stopped by its time limit has proved nothing: the error (and
    a recompute option's candidate status) says TIME LIMIT and how to raise
    it. A compile without a plan from the solver by its time limit returns
    the replicated plan, saying so; where that does not fit either, the
    error stands."""
    model, inputs, loss_fn = load_factory("examples/gpt.py:small")
    with pytest.raises(InfeasibleError, match=r"no plan within the .* s left of the compile's time limit .*"
                                              r"--time-limit") as err:
        autopar.compile(model, inputs, mesh="2x2", cluster="dgx-a100", loss_fn=loss_fn, time_limit_s=0.01,
                        memory=1e6)
    assert err.value.status == "TIME LIMIT"
    with pytest.warns(UserWarning, match="no plan within the compile's time limit of 0.01 s: the plan runs every op "
                                         "replicated"):
        plan = autopar.compile(model, inputs, mesh="2x2", cluster="dgx-a100", loss_fn=loss_fn, time_limit_s=0.01)
    assert plan.solver["status"] == "TIME LIMIT" and plan.solver["stopped_early"]
    assert all(set(p["placements"]) == {"R"} for p in plan.parameters.values())
    assert plan.solver["objective"] == plan.predicted["step_time_s"] > 0


def test_the_time_limit_bounds_the_whole_compile():
    """Capture, building the ILPs and solving them all end by the compile's
    time limit (issue 28: at most 10% past it); a plan not found by then is
    the replicated one, and the plan and a warning say so. With half the
    time Llama's compile takes, it stops while solving; with a limit shorter
    than its capture, it solves nothing once capture and the strategies end."""
    import time
    import warnings
    model, inputs, loss_fn = load_factory("examples/llama.py:small")
    compile_ = lambda limit: autopar.compile(model, inputs, mesh="2x2", cluster="dgx-a100", loss_fn=loss_fn,  # noqa: E731
                                             time_limit_s=limit)
    compile_(60.0)  # warm: the first compile in a process traces slower
    t = time.perf_counter()
    whole = compile_(60.0)
    full = time.perf_counter() - t
    assert whole.solver["status"] == "OPTIMAL"
    for limit in (full / 2, 0.01):
        load = os.getloadavg()[0]
        t = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            plan = compile_(limit)
        wall = time.perf_counter() - t
        assert plan.solver["time_limit_s"] == limit and plan.solver["stopped_early"]
        assert plan.solver["status"] != "OPTIMAL"
        said = [w for w in plan.warnings if f"time limit of {limit:g} s" in w]
        assert said and any(str(w.message) == "autopar: " + said[0] for w in caught)
        timings = plan.solver["timings"]
        if limit < timings["capture_s"]:
            assert timings["solve_s"] < 0.05, timings  # not started
            continue
        # 10% past it and 0.5 s, on a machine with a core per runnable process; where the load is higher the
        # compile gets that much less of a core for the same work, so the bound stretches by the load per core
        crowded = max(1.0, load, os.getloadavg()[0]) / os.cpu_count()
        assert wall <= (1.1 * limit + 0.5) * max(1.0, crowded), (wall, load, os.getloadavg(), timings)


def test_plan_for_another_model_is_rejected():
    from autopar.capture import capture
    from autopar.codegen import build_program
    from mlp import make
    model, inputs, loss = make(hidden=64)
    plan = autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss)
    other, other_inputs, _ = make(hidden=128)
    with pytest.raises(autopar.PlanError, match="compiled for a different model"):
        build_program(capture(other, other_inputs, loss), plan)


def test_unknown_cluster_lists_presets():
    from mlp import make
    model, inputs, loss = make()
    with pytest.raises(autopar.ClusterError, match=r"valid presets are \['cpu', 'dgx-a100'"):
        autopar.compile(model, inputs, mesh=2, cluster="dgx-z9000", loss_fn=loss)


def test_tied_weights_get_one_placement():
    from tied import small
    model, inputs, loss = small()
    plan = autopar.compile(model, inputs, mesh=(2, 2), cluster="tests/fixtures/fastnet.json", loss_fn=loss)
    assert plan.parameters["tok.weight"]["placements"] == plan.parameters["head.weight"]["placements"]


def test_plan_cache_answers_a_repeated_compile_without_solving(tmp_path, monkeypatch, caplog):
    import copy

    import autopar.planner
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=256, d_in=64, d_out=64)
    cache = str(tmp_path / "plans")
    first = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, cache=cache)
    assert first.solver["cache"] == "miss"

    def no_solve(*args, **kwargs):
        raise AssertionError("a cached plan was solved again")

    monkeypatch.setattr(autopar.planner, "_solve_with_recompute", no_solve)
    again = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, cache=cache)
    assert again.solver.pop("cache") == "hit" and first.solver.pop("cache") == "miss"
    assert again.dumps() == first.dumps()
    # anything the plan depends on changes the key: another option is solved
    with pytest.raises(AssertionError, match="solved again"):
        autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, cache=cache, precision="bf16")
    with pytest.raises(AssertionError, match="solved again"):
        autopar.compile(model, inputs, mesh=2, cluster="dgx-a100", loss_fn=loss, cache=cache)
    # so does the model's dtype (a bf16 copy holds half the bytes) ...
    with pytest.raises(AssertionError, match="solved again"):
        autopar.compile(copy.deepcopy(model).to(torch.bfloat16), inputs, mesh=4, cluster="dgx-a100", loss_fn=loss,
                        cache=cache)
    # ... but not the device: the same model on meta is the same graph
    on_meta = autopar.compile(copy.deepcopy(model).to("meta"), [x.to("meta") for x in inputs], mesh=4,
                              cluster="dgx-a100", loss_fn=loss, cache=cache)
    assert on_meta.solver.pop("cache") == "hit"
    # a corrupt entry is a miss, with a warning (and is replaced)
    monkeypatch.undo()
    (entry,) = (tmp_path / "plans").glob("*.json")
    entry.write_text("{not json")
    with caplog.at_level("WARNING", logger="autopar"):
        replaced = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, cache=cache)
    assert replaced.solver["cache"] == "miss" and "unreadable" in caplog.text
    body = entry.read_text().partition("\n")[2]  # after the checksum line
    assert autopar.Plan.from_json(json.loads(body)).nodes == first.nodes


def test_sync_window_exposes_what_the_backward_left_cannot_hide():
    """A gradient made after op k's backward is reduced while backward
    computes the ops before k, one collective after another: the first op's
    parameters' sync has nothing left to hide under."""
    from types import SimpleNamespace
    from autopar.timeline import SyncWindow
    window = SyncWindow(SimpleNamespace(nodes=dict.fromkeys(["embed", "mid", "head"])))
    for op in ("embed", "mid", "head"):
        window.compute(op, None, 1.0)
    window.sync("embed", None, 2.0, {"intra"})
    window.sync("head", None, 0.5, {"intra"})
    # the total (2.5) is less than the backward compute (3), yet 2 cannot hide
    assert window.exposed() == pytest.approx(2.0)
    late = SyncWindow(SimpleNamespace(nodes=dict.fromkeys(["embed", "mid", "head"])))
    for op in ("embed", "mid", "head"):
        late.compute(op, None, 1.0)
    late.sync("head", None, 2.5, {"intra"})  # made first, hidden under mid and embed but for 0.5
    assert late.exposed() == pytest.approx(0.5)
    # on another link it does not wait for the first: each link is its own stream
    window.sync("head", None, 2.5, {"inter"})
    assert window.exposed() == pytest.approx(2.0)
    window.sync("head", None, 3.0, {"intra", "inter"})  # hierarchical: on both, behind each link's queue
    assert window.exposed() == pytest.approx(2.0 + 0.5 + 3.0 - 2.0)


def test_exposed_sync_in_the_model_gives_the_every_bound_optimum(monkeypatch):
    """Where the plan solved with gradient sync free leaves some exposed, the
    solver puts the exposed sync into the model as running sums (one
    variable and row per sync point) and solves again: the optimum of the
    model with every point's bound written out in full."""
    import autopar.solver as solver
    # wide and short: gradient bytes grow with the width, the backward compute of few tokens barely does
    model, inputs, loss = _meta_gpt(layers=2, hidden=1024, seq=64, batch=16)
    compile_ = lambda: autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss)  # noqa: E731
    added = []
    running = solver._ILP.exposed_sync_rows
    monkeypatch.setattr(solver._ILP, "exposed_sync_rows", lambda self: added.append(1) or running(self))
    lazy = compile_()
    assert added, "the first plan's sync hides: this model does not test the exposed-sync rows"

    def every_bound(self):
        model, exposed = self.model, self.model.NumVar(0.0, self.model.infinity(), "exposed_sync")
        self.obj.SetCoefficient(exposed, 1.0)
        bound, current = {}, None
        for link, syncs, compute in self.window.points():
            if link != current:
                bound, current = {}, link
            for v, c in syncs.items():
                bound[v] = bound.get(v, 0.0) + c
            for v, c in compute.items():
                bound[v] = bound.get(v, 0.0) - c
            row = model.Constraint(0.0, model.infinity())  # exposed >= syncs - compute up to this point
            row.SetCoefficient(exposed, 1.0)
            for v, c in bound.items():
                row.SetCoefficient(v, -c)

    monkeypatch.setattr(solver._ILP, "exposed_sync_rows", every_bound)
    full = compile_()
    assert lazy.solver["status"] == full.solver["status"] == "OPTIMAL"
    assert lazy.solver["objective"] == pytest.approx(full.solver["objective"], rel=2e-4)
    assert lazy.solver["objective"] == pytest.approx(lazy.predicted["step_time_s"])
    assert lazy.solver["window_exposed_s"] > 0 and lazy.predicted["grad_sync_exposed_s"] <= lazy.solver["window_exposed_s"]


def test_the_model_with_its_exposed_sync_is_solved_beside_the_sync_free_one_for_the_same_plan(monkeypatch):
    """The model with its exposed sync is solved in a forked process from the
    start (solver._rival_solve): where the sync-free optimum leaves sync exposed,
    its answer is the plan, the same plan that solving the two models one
    after the other gives."""
    import autopar.forks as forks
    model, inputs, loss = _meta_gpt(layers=2, hidden=1024, seq=64, batch=16)
    compile_ = lambda: autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss)  # noqa: E731
    answers = []
    answer = forks.Background.answer
    monkeypatch.setattr(forks.Background, "answer", lambda self, t: answers.append(answer(self, t)) or answers[-1])
    monkeypatch.setattr(forks, "SOLVE_WORKERS", 2)
    raced = compile_()
    assert len(answers) == 1 and answers[0] is not None and answers[0].status == 0  # OPTIMAL, from the rival
    monkeypatch.setattr(forks, "SOLVE_WORKERS", 1)
    one_by_one = compile_()
    assert raced.solver["window_exposed_s"] > 0 and len(answers) == 1
    assert raced.solver["status"] == one_by_one.solver["status"] == "OPTIMAL"
    assert raced.solver["objective"] == one_by_one.solver["objective"]
    assert raced.solver["variables"] == one_by_one.solver["variables"]
    assert raced.solver["solved_as_lp"] == one_by_one.solver["solved_as_lp"]
    assert raced.nodes == one_by_one.nodes and raced.predicted == one_by_one.predicted


def test_sync_exposed_within_the_gap_asked_for_is_priced_not_solved_again(monkeypatch):
    """The first solve (sync free) bounds the full model from below: when its
    plan, priced with the sync it leaves exposed, is within the relative gap
    asked for, the solver adds no rows and solves no more, and the plan's
    objective counts the exposure."""
    import autopar.solver as solver
    import autopar.forks as forks
    # (at seq 64 and batch 16 the sync left exposed is now most of the step: views cost nothing, so less
    # compute is left to hide it, and its exposure is beyond the gap)
    model, inputs, loss = _meta_gpt(layers=4, hidden=256, seq=128, batch=32)
    here, rows = os.getpid(), solver._ILP.exposed_sync_rows  # the forked rival builds them (and is stopped)
    monkeypatch.setattr(solver._ILP, "exposed_sync_rows",
                        lambda self: rows(self) if os.getpid() != here else pytest.fail("solved again"))
    monkeypatch.setattr(forks.Background, "answer", lambda self, timeout_s: pytest.fail("waited for the rival"))
    plan = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, relative_gap=0.5)
    assert plan.solver["window_exposed_s"] > 0
    assert plan.solver["objective"] == pytest.approx(plan.predicted["step_time_s"])
    assert plan.solver["gap"] <= 0.5


def test_plan_prices_the_sync_that_cannot_hide():
    """The planned step pays the exposed gradient sync (the solver prices it
    the same way); without overlap it pays all of it. Data parallelism
    (every parameter pinned replicated): the whole sync is shorter than the
    backward compute (about two thirds of the compute: twice the forward's
    FLOPs), yet the first layer's gradients, made last, leave part of their
    sync exposed. (Left free, the planner finds a plan whose sync all hides.) A GPT wide for its batch:
    its gradients' bytes grow with the width, the backward compute of 256 tokens barely does."""
    model, inputs, loss = _meta_gpt(layers=2, hidden=1024, seq=32, batch=8)
    replicated = {fqn: "R" for fqn, _ in model.named_parameters()}
    plan = autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, parameter_placements=replicated)
    p = plan.predicted
    assert plan.solver["objective"] == pytest.approx(p["step_time_s"])
    assert p["grad_sync_s"] < p["compute_s"] * 2 / 3 and 0 < p["grad_sync_exposed_s"] < p["grad_sync_s"]
    assert p["step_time_s"] == pytest.approx(p["compute_s"] + p["comm_s"] + p["optimizer_s"])
    serial = {**plan.cluster, "name": "no-overlap", "overlap_grad_sync": False}
    plan = autopar.compile(model, inputs, mesh=4, cluster=serial, loss_fn=loss, parameter_placements=replicated)
    assert plan.predicted["grad_sync_exposed_s"] == plan.predicted["grad_sync_s"] > 0


def test_recomputation_options_solved_in_parallel_give_the_same_plan(monkeypatch):
    """The options after the first (selective, full) are solved at once in
    forked workers; the plan is byte-identical to solving them one by one."""
    import autopar.forks
    model, inputs, loss = load_factory("examples/gpt.py:explicit")
    kw = dict(mesh=2, cluster="tests/fixtures/fastnet.json", loss_fn=loss, memory=8 * 2**20, deterministic=True)
    plans = {}
    for workers in (1, 2):
        monkeypatch.setattr(autopar.forks, "SOLVE_WORKERS", workers)
        plans[workers] = autopar.compile(model, inputs, **kw)
    assert [c["status"] for c in plans[2].recompute["candidates"]].count("OPTIMAL") >= 2
    assert plans[1].dumps() == plans[2].dumps()


def test_dtensors_per_axis_hint_is_dropped_and_nothing_else():
    """The runtime drops DTensor's warning that a redistribute over two mesh
    axes runs one collective per axis (that is the plan, priced per axis);
    the logger's other records pass."""
    import importlib
    import logging
    importlib.import_module("autopar.spmd")  # which installs the filter
    logger = logging.getLogger("torch.distributed.tensor._redistribute")

    def record(msg):
        return logging.LogRecord(logger.name, logging.WARNING, __file__, 1, msg, (), None)

    assert not logger.filter(record("While redistributing from %s to %s, %s sequential %s operations ..."))
    assert logger.filter(record("something else"))


def test_a_plan_runs_only_in_the_mode_it_was_compiled_in():
    """The program bakes in dropout and batch norm's mode: the plan records
    it, and a ParallelModule switched to the other mode refuses to run."""
    from autopar.errors import AutoparError
    from autopar.runtime import check_mode
    model, inputs, loss = load_factory("examples/resnet.py:small")
    train = autopar.compile(model, inputs, mesh=2, cluster="dgx-a100", loss_fn=loss)
    evaluation = autopar.compile(model.eval(), inputs, mesh=2, cluster="dgx-a100", loss_fn=loss)
    assert train.model["training"] is True and evaluation.model["training"] is False
    assert train.model["fingerprint"] != evaluation.model["fingerprint"]
    check_mode(True, train)
    with pytest.raises(AutoparError, match=r"the module is in eval mode but its plan was compiled from the model in "
                                           r"train mode.*model\.eval\(\) before autopar\.compile"):
        check_mode(False, train)


@pytest.mark.parametrize("factory", ["mixtral_experts", "deepseek_v3_experts"])
def test_experts_that_dominate_are_split(factory):
    """Hugging Face MoE models whose expert weights are most of the model
    (tests/fixtures/hf.py, 96% and 88%) on a mesh of 4 A100s: the planner
    splits every expert weight (the grouped matmuls have rules,
    passes/rules/experts.py; without them the experts ran replicated)."""
    model, inputs, loss_fn = load_factory(f"{ROOT}/tests/fixtures/hf.py:{factory}")
    experts = [n for n, _ in model.named_parameters() if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    plan = autopar.compile(model, inputs, mesh="4", cluster="dgx-a100", loss_fn=loss_fn)
    assert not plan.fallbacks
    assert experts and all(plan.parameters[n]["placements"] != ["R"] for n in experts), plan.parameters


def test_many_tokens_take_expert_parallelism():
    """With 1,024 tokens (batch 64) through Mixtral's dominant experts on 4
    A100s, the planner runs a grouped matmul expert parallel: its expert
    weight held split over its experts, each rank's sorted rows sent to their
    experts' ranks by all-to-alls (passes/rules/experts.py, dispatch_axes),
    which the plan lists with the op; with 128 tokens (the test above) their
    launches cost more than gathering the tokens."""
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests", "fixtures"))
    import hf

    model, inputs, loss_fn = hf.mixtral_experts(batch=64)
    plan = autopar.compile(model, inputs, mesh="4", cluster="dgx-a100", loss_fn=loss_fn)
    routed = [n for n in plan.nodes if n.op == "transformers.grouped_mm_fallback"
              and n.strategy == "(S(0), S(0), R) -> S(0)"]
    assert routed, [n.strategy for n in plan.nodes if n.op == "transformers.grouped_mm_fallback"]
    assert any(plan.parameters[f]["placements"] == ["S(0)"] for f in plan.parameters if f.endswith("gate_up_proj"))
    exchanges = [c for c in plan.collectives if c["node"] in {n.name for n in routed} and c["kind"] == "all_to_all"]
    assert len(exchanges) == 4 * len(routed)  # rows out and results back, and their gradients


def test_a_trailing_regather_pins_zero_3():
    """``parameter_placements`` pins a sharded parameter's ZeRO-2 strategy
    (gathered copies kept for backward) unless the pin ends in "regather"
    (ZeRO-3: gathered again in backward); a pin that is no strategy says
    which are. (benchmarks/runtime_vs_torch.py's zero3 case pins every
    parameter so and checks that the plan is ZeRO-3.)"""
    from autopar.capture import capture
    from autopar.passes.layer_classes import layer_classes
    from autopar.passes.enumerate import enumerate_strategies
    from autopar.planner import _pins
    model, inputs, loss = load_factory(f"{ROOT}/examples/mlp.py:small")
    graph = capture(model, inputs, loss)
    strategies, _ = enumerate_strategies(graph, (2,), warn=False)
    classes = layer_classes(graph)
    for pin, regather in ((["S(0)"], False), (["S(0)", "regather"], True)):
        pins = _pins(graph, strategies, {"layers.0.weight": pin}, classes)
        name = graph.params["layers.0.weight"]
        chosen = strategies[name][pins[name]]
        assert str(chosen) == "() -> S(0)" + (" regather" if regather else ""), pin
    with pytest.raises(autopar.AutoparError, match=r"cannot pin layers.0.weight to S\(7\): valid placements for "
                       r"it are \[.*'S\(0\) regather'.*a trailing 'regather' asks for ZeRO-3"):
        _pins(graph, strategies, {"layers.0.weight": ["S(7)"]}, classes)


def test_long_context_llama_picks_context_parallelism():
    """Qwen2.5-7B's layer (a Llama with 28 query / 4 key-value heads,
    examples/llama.py, qwen_long_context) at a 32k-token sequence on one
    8-GPU node as 2x4: 28 heads do not split 8 ways, so the planner splits
    attention's heads over the second axis and its sequence over the first
    (context parallelism: keys and values gathered, the causal chunks
    balanced), because in its cost model that beats the best plan whose
    attention splits heads only (over the second axis, whole on the first:
    solved with attention pinned so), and ``autopar explain`` says so in
    those words."""
    import importlib.util

    from autopar.capture import capture
    from autopar.cost_models.cluster import get_cluster
    from autopar.cost_models.graph_costs import CostContext
    from autopar.explain import explain
    from autopar.passes.enumerate import enumerate_strategies
    from autopar.solver import solve

    spec = importlib.util.spec_from_file_location("llama_example", os.path.join(ROOT, "examples", "llama.py"))
    llama = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(llama)
    model, inputs, loss = llama.qwen_long_context(layers=1)
    plan = autopar.compile(model, inputs, mesh="2x4", cluster="dgx-a100", loss_fn=loss, precision="bf16")
    (attention,) = [n for n in plan.nodes if n.name.startswith("scaled_dot_product_attention")]
    assert attention.strategy == "(S(2)S(1), RS(1), RS(1)) -> S(2)S(1)"
    assert [c["kind"] for c in plan.collectives if c["node"] == attention.name and c["producer"] == attention.name] \
        == ["all_to_all"] * 4  # query halves in, output halves back; their gradients in backward

    graph = capture(model, inputs, loss)
    strategies, _ = enumerate_strategies(graph, (2, 4))
    heads = [str(s) for s in strategies[attention.name]].index("(RS(1), RS(1), RS(1)) -> RS(1)")
    ctx = CostContext.make((2, 4), get_cluster("dgx-a100"), precision="bf16")
    tensor_parallel = solve(graph, strategies, ctx, pinned={attention.name: heads},
                            memory_budget=get_cluster("dgx-a100").device.memory)
    assert tensor_parallel.status == "OPTIMAL"
    assert plan.solver["objective"] < tensor_parallel.objective_s * (1 - plan.solver["relative_gap"])

    text = explain(plan, attention.name, graph=graph)
    chosen = text.split("chosen:")[1].split("next best")[0]
    assert ("x: sequence split, keys and values gathered (context parallel), causal work balanced (query halves "
            "exchanged); y: heads split") in chosen
