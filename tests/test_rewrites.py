"""Capture's rewrites (passes/rewrites.py), each a GraphModule -> PassResult
fx pass, run alone on the graph torch.export makes of a small module: what
it rewrites, that it says so, and that the graph still computes what the
module does."""
from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

from autopar.capture import tag_placeholders
from autopar.errors import AutoparError
from autopar.passes import rewrites

aten = torch.ops.aten


def exported(module: nn.Module, *inputs):
    """The exported graph module, its placeholders tagged as capture tags them."""
    ep = torch.export.export(module, inputs, strict=False)
    tag_placeholders(ep)
    return ep.graph_module


def targets(gm) -> list:
    return [n.target for n in gm.graph.nodes if n.op == "call_function"]


def run(gm, module: nn.Module, *inputs):
    """The rewritten graph on the module's own parameters and ``inputs``
    (constants inlined, so its placeholders are parameters, then inputs)."""
    return gm(*module.parameters(), *inputs)


class _Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(3, 3)

    def forward(self, x):
        return self.fc(x) * torch.tensor([1.0, 2.0, 3.0])


def test_inline_constants_rebuilds_a_small_constant_from_its_values():
    module, x = _Scaled(), torch.randn(2, 3)
    gm = exported(module, x)
    assert any(n.meta.get(rewrites.CONSTANT) is not None for n in gm.graph.nodes if n.op == "placeholder")
    result = rewrites.inline_constants(gm)
    assert result.modified
    gm = result.graph_module
    assert not [n for n in gm.graph.nodes if n.op == "placeholder" and rewrites.CONSTANT in n.meta]
    assert targets(gm).count(aten.scalar_tensor.default) == 3 and aten.stack.default in targets(gm)
    assert not rewrites.inline_constants(gm).modified
    # torch.export detaches the lifted constant in place (detach_ on a view), which out_of_place makes a detach
    gm = rewrites.out_of_place(gm).graph_module
    torch.testing.assert_close(run(gm, module, x)[0], module(x), rtol=0, atol=0)


class _Autocast(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            y = self.fc(x)
        return y.float().sum()


def test_inline_autocast_writes_out_the_casts_autocast_makes():
    module, x = _Autocast(), torch.randn(2, 4)
    gm = exported(module, x)
    assert torch.ops.higher_order.wrap_with_autocast in targets(gm)
    result = rewrites.inline_autocast(gm)
    assert result.modified
    gm = result.graph_module
    assert torch.ops.higher_order.wrap_with_autocast not in targets(gm)
    casts = [n for n in gm.graph.nodes if n.target is aten._to_copy.default
             and n.kwargs.get("dtype") is torch.bfloat16]
    assert len(casts) == 3, gm.code  # x, the weight and the bias
    torch.testing.assert_close(run(gm, module, x)[0], module(x), rtol=0, atol=0)  # bit for bit


class _NoGrad(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        with torch.no_grad():
            scale = y.abs().amax()
        return (y / scale).sum()


def test_inline_no_grad_detaches_the_block_inputs():
    module, x = _NoGrad(), torch.randn(2, 4)
    gm = exported(module, x)
    assert torch.ops.higher_order.wrap_with_set_grad_enabled in targets(gm)
    result = rewrites.inline_no_grad(gm)
    assert result.modified
    gm = result.graph_module
    assert torch.ops.higher_order.wrap_with_set_grad_enabled not in targets(gm)
    detach = [n for n in gm.graph.nodes if n.target is aten.detach.default]
    assert len(detach) == 1 and detach[0].args[0].target is aten.linear.default
    torch.testing.assert_close(run(gm, module, x)[0], module(x))


def test_drop_device_moves_keeps_only_the_dtype_conversion():
    graph = fx.Graph()
    x = graph.placeholder("x")
    moved = graph.call_function(aten.to.device, (x, torch.device("cpu"), torch.float64))
    copied = graph.call_function(aten._to_copy.default, (moved,), {"dtype": torch.float32, "device": "cpu"})
    graph.output(copied)
    gm = fx.GraphModule(nn.Module(), graph)
    result = rewrites.drop_device_moves(gm)
    assert result.modified
    assert targets(gm) == [aten.to.dtype, aten._to_copy.default]
    assert moved.args[1:] == (torch.float64,) and copied.kwargs == {"dtype": torch.float32}
    assert not rewrites.drop_device_moves(gm).modified


class _Assigns(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        h = self.fc(x)
        h[:, 1:3] += x[:, :2]
        return h * 2


def test_scatter_write_back_writes_an_assignment_back_through_its_view():
    module, x = _Assigns(), torch.randn(3, 4)
    gm = exported(module, x)
    assert aten.add_.Tensor in targets(gm)
    result = rewrites.scatter_write_back(gm)
    assert result.modified
    gm = result.graph_module
    assert aten.slice_scatter.default in targets(gm) and aten.add_.Tensor not in targets(gm)
    (mul,) = [n for n in gm.graph.nodes if n.target is aten.mul.Tensor]
    assert mul.args[0].target is aten.slice_scatter.default  # the reader reads the written-back tensor
    torch.testing.assert_close(run(gm, module, x)[0], module(x))


class _InPlace(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.act(self.fc(x))
        y += x
        return y.sum()


def test_out_of_place_runs_in_place_ops_on_activations_as_their_functional_forms():
    module, x = _InPlace(), torch.randn(2, 4)
    gm = exported(module, x)
    assert {aten.relu_.default, aten.add_.Tensor} <= set(targets(gm))
    result = rewrites.out_of_place(gm)
    assert result.modified
    gm = result.graph_module
    assert {aten.relu.default, aten.add.Tensor} <= set(targets(gm))
    assert not [t for t in targets(gm) if rewrites.writes_first_input(t)]
    torch.testing.assert_close(run(gm, module, x)[0], module(x))


class _OverwritesWeight(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        self.fc.weight.mul_(0.5)
        return self.fc(x).sum()


def test_out_of_place_refuses_a_parameter_overwritten_in_forward():
    module, x = _OverwritesWeight(), torch.randn(2, 4)
    with torch.no_grad():
        gm = exported(module, x)
    with pytest.raises(AutoparError, match=r"overwrites parameter fc\.weight during the forward"):
        rewrites.out_of_place(gm)
