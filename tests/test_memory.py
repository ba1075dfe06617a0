"""Memory-aware planning: parameter/optimizer bytes, recomputation, the budget."""
import pytest
import torch

import autopar
from autopar.cost_models.cluster import get_cluster
from autopar.cost_models.graph_costs import CostContext, memory_breakdown, param_bytes
from autopar.capture import NodeKind
from autopar.passes.strategy import R, S, Strategy


@pytest.mark.parametrize("precision, optimizer, total", [
    ("bf16", "adamw", 16),   # ZeRO paper: 2 + 2 + 12 bytes per parameter, mixed-precision Adam
    ("fp16", "adam", 16),
    ("fp32", "adamw", 16),   # 4 + 4 + 8
    ("fp32", "sgd", 8),
    ("bf16", "sgd-momentum", 12),  # 2 + 2 + fp32 master 4 + momentum 4
])
def test_bytes_per_parameter(precision, optimizer, total):
    assert sum(param_bytes(precision, optimizer).values()) == total


@pytest.fixture(scope="module")
def gpt_graph():
    from autopar.capture import capture
    from gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=512, seq=64, hidden=128, heads=4, layers=2)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, 512, (8, 64))
    return capture(model, (idx, idx), lm_loss), sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("nd", [2, 4, 8])
def test_zero_stage_0_and_3_formulas(gpt_graph, nd):
    """Stage 0 (replicated): 16 psi per device; stage 3 (every parameter sharded
    over the Nd data-parallel devices): 16 psi / Nd (Rajbhandari et al. 2020)."""
    graph, psi = gpt_graph
    ctx = CostContext.make((nd,), get_cluster("dgx-a100"), "adamw", "bf16")
    replicated = sharded = 0.0
    for node in graph.nodes.values():
        if node.kind is not NodeKind.PARAM:
            continue
        replicated += sum(memory_breakdown(node, Strategy((), (R,)), ctx, True).values())
        dim = next(d for d, size in enumerate(node.out.shape) if size % nd == 0)
        sharded += sum(memory_breakdown(node, Strategy((), (S(dim),)), ctx, True).values())
    assert replicated == 16 * psi
    assert sharded == pytest.approx(16 * psi / nd)


def sweep_model():
    from gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=1024, seq=256, hidden=256, heads=4, layers=4)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, 1024, (64, 256))
    return model, (idx, idx), lm_loss


def parameter_heavy():
    """GPT whose parameter state outweighs its activations (small batch, wide
    layers), on four single-GPU A100 nodes: data parallelism crosses nodes, so
    a ZeRO all-gather costs more than the optimizer step it saves."""
    from gpt import GPT, GPTConfig, lm_loss
    cfg = GPTConfig(vocab=1024, seq=128, hidden=512, heads=8, layers=4)
    with torch.device("meta"):
        model = GPT(cfg)
        idx = torch.randint(0, 1024, (8, 128))
    cluster = {**get_cluster("dgx-a100").to_json(), "name": "a100-one-per-node", "devices_per_node": 1}
    return model, (idx, idx), lm_loss, cluster


# budget (MB), ZeRO stages that must appear, stages that must not, recomputation
SWEEP = [
    (None, {0}, {2, 3}, "none"),   # plain data parallelism
    (150, {0, 2}, {3}, "none"),    # ZeRO-2 for some parameters
    (100, {3}, set(), "none"),     # ZeRO-3
    (70, set(), set(), "full"),    # full recomputation
]


def test_budget_sweep_moves_from_data_parallel_to_zero_stages_and_recomputation():
    """Lower budgets never give a faster plan (the ILP's objective); they move
    parameters from replicated to ZeRO-2 to ZeRO-3 and turn on
    recomputation; then no plan fits and the error says exactly how much the
    smallest plan needs (a budget just above it compiles)."""
    model, inputs, loss, cluster = parameter_heavy()
    times = []
    for budget, present, absent, recompute in SWEEP:
        plan = autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16",
                               memory=budget and budget * 1e6)
        stages = {p["zero_stage"] for p in plan.parameters.values()}
        assert present <= stages and not (absent & stages), (budget, stages)
        assert plan.recompute["mode"] == recompute, budget
        if budget:
            assert plan.predicted["peak_memory_bytes"] <= budget * 1e6
        times.append(plan.solver["objective"])
    assert times == sorted(times), times
    with pytest.raises(autopar.InfeasibleError, match=r"smallest plan needs at least \d+\.\d+ MiB") as info:
        autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16", memory=50e6)
    need = info.value.needed_bytes
    assert 50e6 < need < 70e6
    plan = autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16",
                           memory=need * 1.001)
    assert plan.predicted["peak_memory_bytes"] <= need * 1.001


def test_regather_choices_are_pruned_only_where_memory_cannot_bind():
    """Without a binding budget a ZeRO-3 choice costs its ZeRO-2 twin's time
    plus an all-gather: the solver fixes those off before solving and the plan
    says how many; under a tight budget they stay in play."""
    model, inputs, loss, cluster = parameter_heavy()
    free = autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16", memory=1e12)
    (count,) = free.solver["pruned"].values()
    assert count > 0 and not any(p["regather"] for p in free.parameters.values())
    tight = autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16", memory=100e6)
    assert tight.solver["pruned"] == {} and any(p["regather"] for p in tight.parameters.values())


def test_zero_3_trades_communication_for_memory():
    """The same parameter sharded: regathering in backward (ZeRO-3) holds no
    full copy until backward and pays one more all-gather (phase recompute)."""
    model, inputs, loss, cluster = parameter_heavy()
    plan = autopar.compile(model, inputs, mesh=4, cluster=cluster, loss_fn=loss, precision="bf16", memory=100e6)
    regathered = {fqn for fqn, p in plan.parameters.items() if p["zero_stage"] == 3}
    again = {c["tensor"] for c in plan.collectives if c["phase"] == "recompute" and c["kind"] == "all_gather"}
    assert regathered and regathered <= again
    assert all(plan.parameters[f]["regather"] for f in regathered)


def test_recompute_trades_time_for_memory():
    model, inputs, loss = sweep_model()
    plans = {mode: autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, recompute=mode)
             for mode in ("none", "full")}
    assert plans["full"].recompute["layers"] == [f"blocks.{i}" for i in range(4)]
    assert plans["full"].predicted["memory"]["activations"] < plans["none"].predicted["memory"]["activations"]
    assert plans["full"].predicted["compute_s"] > plans["none"].predicted["compute_s"]


def test_bad_precision_is_named():
    model, inputs, loss = sweep_model()
    with pytest.raises(autopar.AutoparError, match="precision 'fp8' is not one of"):
        autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss, precision="fp8")
