"""Optimizer state in host memory (ZeRO-Offload) as a planner choice: the ILP
takes it where device memory binds, prices its transfers and host update,
counts host memory apart; the runtime's OffloadOptimizer updates on the host
exactly as the optimizer would on the device. (tests/test_distributed.py runs
offloading plans on 4 gloo ranks against one device.)"""
import json
import math
import warnings

import pytest
import torch

import autopar
from autopar.cost_models.cluster import ClusterError, get_cluster
from autopar.cost_models.graph_costs import OPTIMIZER_PASSES
from autopar.errors import InfeasibleError, PlanError
from autopar.offload import OffloadOptimizer, mark_offloaded
from autopar.plan import Plan
from autopar.runtime import load_factory
from conftest import ROOT

HOSTNET = f"{ROOT}/tests/fixtures/hostnet.json"
FASTNET = f"{ROOT}/tests/fixtures/fastnet.json"
BUDGET = 8e5  # bytes per device: examples/gpt.py:small on 4 devices needs 811 KiB without offload


@pytest.fixture(scope="module")
def gpt():
    return load_factory(f"{ROOT}/examples/gpt.py:small")


def test_planner_offloads_where_device_memory_binds(gpt):
    model, inputs, loss = gpt
    plan = autopar.compile(model, inputs, mesh="4", cluster=HOSTNET, loss_fn=loss, memory=BUDGET)
    offloaded = [k for k, p in plan.parameters.items() if p.get("offload")]
    assert offloaded and plan.predicted["peak_memory_bytes"] <= BUDGET
    pred = plan.predicted
    host = get_cluster(HOSTNET).host
    # the host holds each offloaded shard's AdamW state, values and gradient: 16 B per fp32 element
    elements = sum(math.prod(plan.parameters[k]["local_shape"]) for k in offloaded)
    assert pred["host_memory_bytes"] == pytest.approx(16 * elements)
    assert pred["host_capacity_bytes"] == host.memory / 8
    # its update: gradient down and values up over the host link, AdamW's passes through host memory
    priced = 2 * host.link_latency + 8 * elements / host.link_bandwidth \
        + elements * OPTIMIZER_PASSES["adamw"][1] / (host.memory_bandwidth / 8)
    on_device = autopar.compile(model, inputs, mesh="4", cluster=HOSTNET, loss_fn=loss)
    assert not any(p.get("offload") for p in on_device.parameters.values())  # memory does not bind: none
    assert "offload choices: memory cannot bind" in " ".join(on_device.solver["pruned"])
    assert pred["optimizer_s"] > priced  # the device updates the others
    assert plan.solver["status"] == "OPTIMAL"

    with pytest.raises(InfeasibleError, match=r"offloading optimizer state to the host is off.*may fit") as e:
        autopar.compile(model, inputs, mesh="4", cluster=HOSTNET, loss_fn=loss, memory=BUDGET, offload=False)
    assert e.value.needed_bytes > BUDGET
    with pytest.raises(InfeasibleError, match=r"describes no host memory to offload optimizer state to"):
        autopar.compile(model, inputs, mesh="4", cluster=FASTNET, loss_fn=loss, memory=BUDGET)


def test_offload_is_pinned_and_shown(gpt, tmp_path):
    model, inputs, loss = gpt
    # the token table's lookup runs on its row shards where that is cheaper than gathering it (a lookup
    # reads only its rows): the ZeRO-3 pin goes on a GEMM's weight, which the batch-split GEMM gathers
    fc = "blocks.0.mlp.fc.weight"
    pins = {"head.weight": ["S(0)", "offload"], fc: ["S(1)", "regather", "offload"]}
    plan = autopar.compile(model, inputs, mesh="4", cluster=HOSTNET, loss_fn=loss, parameter_placements=pins)
    assert plan.parameters["head.weight"]["offload"] and plan.parameters[fc]["offload"]
    assert plan.parameters[fc]["zero_stage"] == 3
    path = tmp_path / "plan.json"
    plan.save(path)
    from autopar.report import parameter_rows
    rows = {r[0]: r[2] for r in parameter_rows(Plan.load(path), all_rows=True)}
    assert rows["head.weight"] == "ZeRO-2, optimizer on host" and rows[fc] == "ZeRO-3, optimizer on host"
    with pytest.raises(autopar.AutoparError, match="then 'offload' for its optimizer state in host memory"):
        autopar.compile(model, inputs, mesh="4", cluster=HOSTNET, loss_fn=loss,
                        parameter_placements={"head.weight": ["offload", "S(0)"]})
    obj = json.loads(path.read_text())
    obj["parameters"]["head.weight"]["offload"] = "yes"
    path.write_text(json.dumps(obj))
    with pytest.raises(PlanError, match="'offload' must be true or false"):
        Plan.load(path)


def test_cluster_host_section_is_validated():
    obj = json.load(open(HOSTNET))
    obj["host"]["link_bandwidth"] = 0
    with pytest.raises(ClusterError, match="host: link_bandwidth"):
        get_cluster(obj)
    obj["host"] = {"memory": 1e12}
    with pytest.raises(ClusterError, match="lacks required field"):
        get_cluster(obj)
    assert get_cluster("dgx-a100").host.link_bandwidth == 31.5e9  # PCIe 4.0 x16, per direction


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))


def _train(model, opt, scheduler=None, steps=3):
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(5, 8, generator=g)
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
        if scheduler is not None:
            scheduler.step()


def test_offload_optimizer_updates_like_the_optimizer_on_the_device():
    """Offloaded parameters (some of them, in two param groups) with a
    learning-rate schedule: the same parameters as AdamW on the device, the
    state on the host copies, and a state_dict that loads back."""
    ref, mine = _model(), _model()
    groups = lambda m: [{"params": list(m[0].parameters()), "weight_decay": 0.1},  # noqa: E731
                        {"params": list(m[2].parameters())}]
    ref_opt = torch.optim.AdamW(groups(ref), lr=1e-2)
    mark_offloaded([mine[0].weight, mine[2].bias])
    opt = OffloadOptimizer(groups(mine), torch.optim.AdamW, lr=1e-2)
    assert len(opt.host.param_groups) == len(opt.device.param_groups) == 2
    _train(ref, ref_opt, torch.optim.lr_scheduler.StepLR(ref_opt, 1, gamma=0.5))
    _train(mine, opt, torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    for a, b in zip(ref.parameters(), mine.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    host_weight = opt.host.param_groups[0]["params"][0]
    assert host_weight is not mine[0].weight and torch.equal(host_weight, mine[0].weight)
    assert all(p is not mine[0].weight for g in opt.device.param_groups for p in g["params"])
    again = OffloadOptimizer(groups(mine), torch.optim.AdamW, lr=1e-2)
    again.load_state_dict(opt.state_dict())
    assert again.host.state_dict()["state"][0]["step"] == 3
    with pytest.raises(ValueError, match="another plan's offload choices"):
        OffloadOptimizer(list(ref.parameters()), torch.optim.AdamW).load_state_dict(opt.state_dict())


def test_a_plain_optimizer_on_offloaded_parameters_warns():
    model = _model()
    mark_offloaded([model[0].weight])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 8)).sum().backward()
    with pytest.warns(UserWarning, match=r"pmodel.optimizer\(torch.optim.AdamW"):
        opt.step()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        opt.step()  # once per optimizer


def test_gpt3_6_7b_fits_one_8_gpu_node_in_10_gb_by_offloading():
    """GPT-3 6.7B (examples/gpt.py:gpt3_6_7b), fp32 AdamW, one DGX A100 node,
    10 GB per GPU: 16 B per parameter sharded 8 ways is 13.4 GB before any
    activation, so no plan fits on the devices alone (the error says so and
    that offloading is off); with offload the planner keeps the largest
    weights' optimizer state on the host and states the step it predicts."""
    model, inputs, loss = load_factory(f"{ROOT}/examples/gpt.py:gpt3_6_7b")
    options = dict(mesh="8", cluster="dgx-a100", loss_fn=loss, memory=10e9)
    with pytest.raises(InfeasibleError, match="offloading optimizer state to the host is off") as e:
        autopar.compile(model, inputs, offload=False, **options)
    assert e.value.needed_bytes > 10e9
    plan = autopar.compile(model, inputs, **options)
    offloaded = [k for k, p in plan.parameters.items() if p.get("offload")]
    assert any(k.endswith("mlp.fc.weight") for k in offloaded)
    assert plan.predicted["peak_memory_bytes"] <= 10e9 < plan.predicted["peak_memory_bytes"] \
        + plan.predicted["host_memory_bytes"]
    assert plan.predicted["host_memory_bytes"] <= plan.predicted["host_capacity_bytes"]
    assert plan.predicted["step_time_s"] > plan.predicted["optimizer_s"] > 0
