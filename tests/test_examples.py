"""Every example model captures with a sharding rule for every op, and its
factory is deterministic and trains (the models the other tests and the
docs run)."""
from __future__ import annotations

import importlib
import operator

import pytest
import torch

from autopar.passes.rules import get_rule

MODELS = ["bert", "cnn", "gpt", "llama", "mlp", "moe", "resnet", "vit"]


def _factory(name: str, attr: str = "small"):
    return getattr(importlib.import_module(name), attr)  # conftest puts examples/ on sys.path


@pytest.mark.parametrize("name", MODELS)
def test_example_captures_with_a_rule_for_every_op(name):
    from autopar.capture import capture
    from autopar.ir import NodeKind

    model, inputs, loss_fn = _factory(name)(batch=8)
    graph = capture(model, inputs, loss_fn)
    ops = [n for n in graph.nodes.values() if n.kind is NodeKind.OP and n.target is not operator.getitem]
    assert ops, f"{name}: no ops captured"
    # a buffer's in-place update (batch norm's num_batches_tracked) runs where the buffer is, replicated
    missing = sorted({n.op_name for n in ops if get_rule(n.target) is None and not n.state_update})
    assert missing == [], f"{name}: ops without a sharding rule: {missing}"


@pytest.mark.parametrize("name", MODELS)
def test_example_factory_is_deterministic_and_trains(name):
    model, inputs, loss_fn = _factory(name)(batch=4)
    again, inputs2, _ = _factory(name)(batch=4)
    for (k, a), (_, b) in zip(model.state_dict().items(), again.state_dict().items()):
        assert torch.equal(a, b), f"{name}: parameter {k} differs between two calls of the factory"
    assert all(torch.equal(a, b) for a, b in zip(inputs, inputs2))
    loss = loss_fn(model(*inputs[:-1]), inputs[-1])
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    assert all(p.grad is not None for p in model.parameters()), f"{name}: a parameter gets no gradient"


def test_mlp_make_is_configurable():
    model, (x, y), _ = _factory("mlp", "make")(batch=6, hidden=24, d_in=10, d_out=3, layers=3)
    assert x.shape == (6, 10) and y.shape == (6, 3) and model(x).shape == (6, 3)
    assert [layer.out_features for layer in model.layers] == [24, 24, 3]


def test_resnet_batch_norm_keeps_running_stats_unless_told_not_to():
    import resnet
    model, _, _ = _factory("resnet")()
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    assert norms and all(m.running_mean is not None for m in norms)
    plain = resnet.ResNet(resnet.ResNetConfig(track_running_stats=False))
    assert all(m.running_mean is None for m in plain.modules() if isinstance(m, torch.nn.BatchNorm2d))
