"""What capture accepts and how it runs it: ops with and without a sharding
rule (and the rules' own listing, `autopar ops`), ops with several outputs
placed differently, complex tensors, random draws, in-place ops and
assignments on activations, and the models it refuses, by name."""
import copy
import json
import os
import warnings

import pytest
import torch
from torch import nn

import autopar
from autopar.runtime import load_factory
from conftest import ROOT


class BesselModel(nn.Module):
    """A modified Bessel function of the first kind: an op no rule covers."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return torch.special.i1(self.fc(x))


def test_op_without_rule_is_replicated_with_a_warning(caplog):
    model = BesselModel()
    x = torch.randn(8, 16)
    with caplog.at_level("WARNING", logger="autopar"):
        plan = autopar.compile(model, (x, torch.randn(8, 16)), mesh=2, cluster="dgx-a100",
                               loss_fn=nn.functional.mse_loss)
    assert "no sharding rule for special_i1" in caplog.text and "(node special_i1, in the top level)" in caplog.text
    assert plan.fallbacks == [{"node": "special_i1", "op": "special_i1", "location": "the top level"}]
    assert plan.node("special_i1").strategy == "(R) -> R"


def test_recurrent_layers_split_the_batch_or_say_why_they_cannot(caplog, capsys, tmp_path, monkeypatch):
    """Time-major LSTM, GRU and RNN layers split the batch (dim 1 of input,
    output and states), their weights replicated; batch-first ones too, with
    a placement per output (the output's batch is dim 0, the states' dim 1),
    which the plan file keeps. Dropout between layers cannot split: the LSTM
    runs replicated, and the warning, the plan and `--coverage` say why."""
    from autopar.runtime import load_factory
    ops = ("lstm", "gru", "rnn_tanh")
    model, inputs, loss = load_factory("tests/fixtures/recurrent.py:tagger")
    fast = os.path.join(ROOT, "tests", "fixtures", "fastnet.json")  # a model this small pays to split only there
    before = loss(model(inputs[0]), inputs[1])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autopar.compile(model, inputs, mesh=4, cluster=fast, loss_fn=loss)
    # torch.export's note that the layers re-pointed their weight cache is not
    # passed on: the model still runs as it did
    assert not [w for w in caught if "_flat_weights" in str(w.message)]
    assert torch.equal(loss(model(inputs[0]), inputs[1]), before)
    assert plan.fallbacks == []
    for op in ops:
        assert plan.node(op).strategy.startswith("(S(1), S(1)") and plan.node(op).strategy.endswith("-> S(1)")
    model, inputs, loss = load_factory("tests/fixtures/recurrent.py:batch_first")
    plan = autopar.compile(model, inputs, mesh=4, cluster=fast, loss_fn=loss)
    assert plan.fallbacks == []
    assert plan.node("lstm").strategy == f"(S(0), S(1), S(1), {', '.join(['R'] * 16)}) -> (S(0), S(1), S(1))"
    assert [plan.node(f"getitem{k}").strategy for k in ("", "_1", "_2")] == ["(S(0)) -> S(0)", "(S(1)) -> S(1)",
                                                                          "(S(1)) -> S(1)"]
    for op in ops[1:]:
        assert plan.node(op).strategy.endswith("-> (S(0), S(1))")
    assert autopar.Plan.from_json(json.loads(plan.dumps())).node("gru").item_specs == ["S(0)", "S(1)"]
    model, inputs, loss = load_factory("tests/fixtures/recurrent.py:layer_dropout")
    with caplog.at_level("WARNING", logger="autopar"):
        plan = autopar.compile(model, inputs, mesh=4, cluster=fast, loss_fn=loss)
    assert [f["node"] for f in plan.fallbacks] == ["lstm"]
    assert "dropout=0.25 between its layers" in plan.fallbacks[0]["reason"]
    assert "lstm.input (node lstm, in lstm) runs replicated on every device: dropout=0.25" in caplog.text
    assert any(w.startswith("lstm.input at lstm (node lstm) runs replicated: dropout=0.25") for w in plan.warnings)
    assert plan.node("lstm").strategy.endswith("-> R")
    from autopar.cli import main
    monkeypatch.chdir(ROOT)
    main(["compile", "tests/fixtures/recurrent.py:layer_dropout", "--mesh", "4", "--cluster", fast,
          "-o", str(tmp_path / "plan.json"), "--coverage", "-q"])
    printed = capsys.readouterr().out
    assert "1 op(s) fell back to replication:" in printed
    assert "lstm.input" in printed and "(dropout=0.25 between its layers in training" in printed


def test_per_output_placements_are_checked_in_the_plan_file():
    """A plan file's per-output placements (``item_specs``) must start with
    the node's output_spec and be a strategy the op's rule allows."""
    import copy
    from autopar.capture import capture
    from autopar.codegen import build_program
    from autopar.errors import PlanError
    model, inputs, loss = load_factory("tests/fixtures/recurrent.py:batch_first")
    fast = os.path.join(ROOT, "tests", "fixtures", "fastnet.json")
    obj = autopar.compile(model, inputs, mesh=4, cluster=fast, loss_fn=loss).to_json()
    gru = next(n for n in obj["nodes"] if n["name"] == "gru")
    assert gru["item_specs"] == ["S(0)", "S(1)"]
    edited = copy.deepcopy(obj)
    next(n for n in edited["nodes"] if n["name"] == "gru")["item_specs"] = ["S(1)", "S(1)"]
    with pytest.raises(PlanError, match=r"plan node 'gru' places its first output \['S\(1\)'\] but its "
                                        r"output_spec is 'S\(0\)'"):
        autopar.Plan.from_json(edited)
    next(n for n in edited["nodes"] if n["name"] == "gru")["item_specs"] = ["S(0)", "S(0)"]
    with pytest.raises(PlanError, match=r"plan node gru \(gru.input at gru\) has strategy \(S\(0\), S\(1\), R, R, "
                                        r"R, R\) -> \(S\(0\), S\(0\)\), which its sharding rule does not allow"):
        build_program(capture(model, inputs, loss), autopar.Plan.from_json(edited))


def test_complex_intermediates_are_priced_and_split():
    """An FFT's complex output is costed by its element size (it crashed the
    byte count once) and splits along the dims it does not transform."""
    class Spectral(nn.Module):
        def __init__(self):
            super().__init__()
            self.inp, self.out = nn.Linear(16, 64), nn.Linear(33, 4)

        def forward(self, x):
            return self.out(torch.fft.rfft(self.inp(x), dim=-1).abs())

    from autopar.capture import capture
    from autopar.cost_models.graph_costs import op_bytes
    model, x = Spectral(), torch.randn(8, 16)
    graph = capture(model, (x,))
    (fft,) = [n for n in graph.nodes.values() if n.op_name == "fft_rfft"]
    assert op_bytes(fft) == 8 * 64 * 4 + 8 * 33 * 8  # float32 in, complex64 out
    from autopar.passes.enumerate import enumerate_strategies
    strategies, fallbacks = enumerate_strategies(graph, (2,))
    assert fallbacks == [] and [str(s) for s in strategies[fft.name]] == ["(S(0)) -> S(0)", "(R) -> R"]
    assert autopar.compile(model, (x,), mesh=2, cluster="dgx-a100").fallbacks == []


def test_ops_lists_the_rules_and_docs_ops_md_is_its_output(capsys):
    """`autopar ops QUERY` names the rule of each matching op and what it
    splits; an op without one exits 1 saying it would run replicated;
    docs/ops.md is `autopar ops --markdown`, so it lists every registered op."""
    from autopar.cli import main
    from autopar.passes.rules import registered_ops
    assert main(["ops", "embedding_bag"]) == 0
    printed = capsys.readouterr().out
    assert printed.startswith("embedding.embedding_bag_rule: embedding_bag, embedding_bag.padding_idx\n")
    assert "split the embedding dim" in printed
    assert main(["ops", "special_i1"]) == 1
    assert "no op matching 'special_i1' has a sharding rule: it runs replicated" in capsys.readouterr().out
    assert main(["ops", "--markdown"]) == 0
    markdown = capsys.readouterr().out
    with open(os.path.join(ROOT, "docs", "ops.md")) as f:
        assert f.read() == markdown, "docs/ops.md is stale: autopar ops --markdown > docs/ops.md"
    assert f"{len(registered_ops())} ATen ops in " in markdown
    assert "`lstm.input`" in markdown and "`cdist`" in markdown


def test_verify_names_the_random_draws_that_keep_it_from_agreeing():
    """A model that draws random numbers in training cannot match one device
    bit for bit; `autopar verify` says which ops draw when it disagrees."""
    from autopar.capture import capture
    from autopar.verify import random_draws, random_note
    from gpt import GPT, GPTConfig, lm_loss
    idx = torch.randint(0, 64, (2, 8))
    cfg = dict(vocab=64, seq=8, hidden=16, heads=2, layers=2)
    assert random_draws(capture(GPT(GPTConfig(**cfg)), (idx, idx), lm_loss)) == []
    draws = random_draws(capture(GPT(GPTConfig(**cfg, dropout=0.3)), (idx, idx), lm_loss))
    assert draws == ["dropout at blocks.0.drop"] * 2 + ["dropout at blocks.1.drop"] * 2

    class Noisy(nn.Module):
        def forward(self, x):
            return (x + torch.randn(x.shape)).sum()

    assert random_draws(capture(Noisy(), (torch.zeros(4, 3),))) == ["randn at the top level"]

    class DropPath(nn.Module):  # timm's stochastic depth: an in-place bernoulli_ on a fresh tensor
        def forward(self, x):
            mask = x.new_empty((x.shape[0], 1)).bernoulli_(0.9).div_(0.9)
            return (x * mask).sum()

    assert random_draws(capture(DropPath(), (torch.zeros(4, 3),))) == ["bernoulli.p at the top level"]
    assert autopar.compile(DropPath(), (torch.zeros(4, 3),), mesh=2, cluster="dgx-a100").fallbacks == []
    note = random_note(draws + ["randn at the top level"])
    assert note.startswith("note: the model draws random numbers (dropout at blocks.0.drop, ")
    assert "dropout at blocks.1.drop and 1 more)" in note
    assert "check it with the draws off (dropout p=0" in note


def test_verify_tolerance_follows_the_precision_the_model_computes_in():
    """A bfloat16 model (or an autocast block) cannot agree with one device
    to 1e-5: verify checks it to assert_close's default for its dtype, says
    so, and an explicit --tol wins."""
    from autopar.capture import capture
    from autopar.verify import lowest_precision, tolerance
    half = nn.Linear(8, 4).to(torch.bfloat16)
    assert lowest_precision(capture(half, (torch.zeros(2, 8, dtype=torch.bfloat16),))) == torch.bfloat16
    mixed = capture(*load_factory("tests/fixtures/opzoo.py:mixed_precision"))
    assert lowest_precision(mixed) == torch.bfloat16
    assert lowest_precision(capture(nn.Linear(8, 4), (torch.zeros(2, 8),))) == torch.float32
    assert tolerance(None, torch.float32) == (1e-5, "")
    assert tolerance(None, torch.float64)[0] == 1e-7  # a float32 model checked in float64 (verify.widened)
    tol, why = tolerance(None, torch.bfloat16)
    assert tol == 0.016 and why == "0.016 where the model computes in bfloat16 (torch.testing.assert_close's default "\
        "for bfloat16)"
    assert tolerance(None, torch.float16)[0] == 1e-3
    assert tolerance(3e-4, torch.bfloat16) == (3e-4, "")


def test_verify_checks_a_float32_model_in_float64_on_the_same_step():
    """verify casts a float32 model and its inputs to float64 and runs the
    float32 plan on it: the same step node for node, or a PlanError. Casts the
    model writes itself stay, and the check runs at the precision they leave."""
    from autopar.capture import capture
    from autopar.codegen import same_steps
    from autopar.errors import PlanError
    from autopar.verify import lowest_precision, widened

    model, inputs, loss_fn = load_factory("examples/gpt.py:small")
    wide, wide_inputs = widened(model, inputs)
    assert all(p.dtype == torch.float64 for p in wide.parameters())
    assert all(p.dtype == torch.float32 for p in model.parameters())  # the user's model is left alone
    assert wide_inputs[1].dtype == inputs[1].dtype  # token ids stay integers
    narrow, wide_graph = capture(model, inputs, loss_fn), capture(wide, wide_inputs, loss_fn)
    same_steps(narrow, wide_graph)
    assert lowest_precision(wide_graph) == torch.float64

    class Rounds(nn.Module):  # computes in float32 whatever its parameters are
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            return self.fc(x).float().sum(-1)

    x = torch.randn(2, 8)
    assert lowest_precision(capture(*widened(Rounds(), (x,)))) == torch.float32
    with pytest.raises(PlanError, match="traces to a different step"):
        same_steps(narrow, capture(Rounds(), (x,)))


def run_captured(graph, model, x):
    """The captured step's graph run on one device: the model's parameters
    and the one input ``x`` in its placeholders; its first output."""
    fqn = {name: k for k, name in graph.params.items()}
    params = dict(model.named_parameters())
    return graph.gm(*[params[fqn[p.name]] if p.name in fqn else x
                      for p in graph.gm.graph.nodes if p.op == "placeholder"])[0]


def test_small_constants_written_in_forward_become_factories():
    """``x[..., [-2], :]`` (Falcon's head split) makes a constant index tensor
    that torch.export lifts out of forward: up to SMALL_CONSTANT elements it
    is rebuilt in the graph from its values (every rank alike), and the step
    computes what the model does; a larger one must be a registered buffer."""
    from autopar.capture import SMALL_CONSTANT, capture
    from autopar.errors import AutoparError
    from autopar.ir import NodeKind

    class Picks(nn.Module):
        def __init__(self, table: int):
            super().__init__()
            self.fc, self.table = nn.Linear(8, 8), table

        def forward(self, x):
            h = self.fc(x)[:, [-2, 0, 3], :]
            return h * torch.tensor([[1.5], [-1.0], [2.0]]) + torch.arange(self.table).float().sum()

    x = torch.randn(2, 4, 8)
    model = Picks(4)
    graph = capture(model, (x,))
    assert not [n for n in graph.nodes.values() if n.kind is NodeKind.CONSTANT]
    with torch.no_grad():
        assert torch.equal(run_captured(graph, model, x), model(x))

    class Table(Picks):
        def forward(self, x):
            return self.fc(x) * torch.tensor([float(i) for i in range(SMALL_CONSTANT + 1)]).sum()

    with pytest.raises(AutoparError, match=rf"constant tensor in forward .* of more than {SMALL_CONSTANT} elements; "
                                           r"autopar needs it as a registered buffer"):
        capture(Table(4), (x,))


def test_verify_leaves_out_what_rounding_alone_moves():
    """An attention key's bias gets a gradient the softmax cancels (zero but
    for rounding), which Adam scales to +-lr steps: verify leaves it out of
    the parameter error; and the parameters pass within the drift that the
    program's gradient differences give one device, which is zero for no
    difference and which no wrong update hides behind."""
    from autopar.verify import _drift, agrees, rounding_only

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

        def forward(self, x):
            return torch.softmax(self.q(x) @ self.k(x).transpose(1, 2), -1) @ self.v(x)

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 5, 8)
    initial = copy.deepcopy(model)
    model(x).square().mean().backward()
    grads = {k: p.grad for k, p in model.named_parameters()}
    noisy = {**grads, "k.bias": -grads["k.bias"]}  # another rounding of zero
    assert rounding_only(noisy, grads, 1e-5) == ["k.bias"]
    assert rounding_only(grads, grads, 1e-5) == []  # agreeing, even if tiny: compared
    assert rounding_only({**grads, "k.bias": torch.ones(8)}, grads, 1e-5) == []  # the program's is not noise
    inputs, loss = (x, torch.zeros(2, 5, 8)), torch.nn.functional.mse_loss
    reference = copy.deepcopy(initial)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3)
    for _ in range(2):
        loss(reference(x), inputs[1]).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    ref_state = reference.state_dict()
    keys = sorted(ref_state)
    zero = {k: torch.zeros_like(g) for k, g in grads.items()}
    assert _drift(initial, inputs, loss, 2, 1e-3, zero, 0, ref_state, keys) == 0.0
    assert _drift(initial, inputs, loss, 2, 1e-3, {k: g.abs() * 1e-6 for k, g in grads.items()}, 0, ref_state,
                  keys) > 0.0
    report = {"loss_rel": 0.0, "grad": 1e-7, "tol": 1e-5, "param": 3e-5, "param_floor": 4e-5}
    assert agrees(report) and not agrees({**report, "param_floor": 2e-5}) and not agrees({**report, "grad": 2e-5})


def test_assignments_into_activations_run_as_scatters():
    """``h[:, 0] = 0.0``, ``h[:, 1:3] += x``, ``h[..., :4] = f(...)``: the
    in-place write through a view, whose base is read afterwards, runs out
    of place and is written back (select_scatter, slice_scatter); the scalar
    torch.export lifts out of forward is a replicated factory; every op has
    a rule. A view read again after the write is still refused by name."""
    from autopar.capture import capture
    from autopar.ir import NodeKind
    from autopar.errors import AutoparError
    model, inputs, loss = load_factory("tests/fixtures/opzoo.py:editor")
    graph = capture(model, inputs, loss)
    ops = [n.op_name for n in graph.nodes.values() if n.kind is NodeKind.OP]
    assert ops.count("select_scatter") == 1 and ops.count("slice_scatter") == 3 and ops.count("index_put") == 2
    assert "copy" not in ops and "lift_fresh_copy" not in ops and ops.count("scalar_tensor") == 2
    assert not any(n.kind is NodeKind.CONSTANT for n in graph.nodes.values())
    assert autopar.compile(model, inputs, mesh=4, cluster=os.path.join(ROOT, "tests", "fixtures", "fastnet.json"),
                           loss_fn=loss).fallbacks == []

    class ReadsTheView(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            first = h[:, 0]
            first.mul_(2.0)
            h.add_(1.0)  # first, a view of h, holds h's column after this too
            return h.sum() + first.sum()

    with pytest.raises(AutoparError, match=r"in-place op aten\.mul_\.Tensor at the top level writes through a view "
                                           r"of linear, and sum_2 read its result after add_ writes in place again"):
        capture(ReadsTheView(), (torch.randn(4, 8),))

    class ReadsAnEarlierView(ReadsTheView):
        def forward(self, x):
            h = self.fc(x)
            pair = h[:, 0:2]  # taken before the write, which it sees
            h[:, 0] = 0.0
            return h.sum() + pair.sum()

    with pytest.raises(AutoparError, match=r"in-place op aten\.fill_\.Tensor at the top level overwrites linear, "
                                           r"which .* read afterwards"):
        capture(ReadsAnEarlierView(), (torch.randn(4, 8),))


def test_columns_of_a_contiguous_copy_are_written_in_place_as_beit_does():
    """BEiT (transformers) builds its relative position index with
    ``rel = diff.permute(1, 2, 0).contiguous()`` and then ``rel[:, :, 0] += k``:
    contiguous (and reshape) may alias by their schema, but here they copy,
    so the writes run as scatters into the copy; capture refused the model
    before. Trains like one device: test_distributed's op families."""
    from autopar.capture import capture
    from autopar.ir import NodeKind
    graph = capture(*load_factory("tests/fixtures/opzoo.py:relative_bias"))
    ops = [n.op_name for n in graph.nodes.values() if n.kind is NodeKind.OP]
    # ``rel[:, :, 0] += k`` is an in-place add on the view, then Python's
    # __setitem__ copies the view back into it: two write-backs per write
    assert ops.count("select_scatter") == 6 and not [o for o in ops if o.endswith("_")], ops
    assert "contiguous" in ops  # the copy the writes go into


def test_in_place_ops_on_activations_run_out_of_place_and_state_updates_stay():
    """nn.ReLU(inplace=True) and ``y += x`` on activations are captured as
    relu and add (the rules' ops, exact since nothing reads the old values);
    the buffers' in-place updates stay in place and the emitted program runs
    them as state updates (once per step, not again when recomputed)."""
    from autopar.capture import capture
    from autopar.codegen import build_program, program_source
    model, inputs, loss = load_factory("tests/fixtures/stateful.py:small")
    graph = capture(model, inputs, loss)
    ops = [n.op_name for n in graph.nodes.values() if n.kind.value == "op"]
    assert "relu_" not in " ".join(ops) and ops.count("relu") == 2 and ops.count("add.Tensor") >= 2
    in_place = sorted(n.op_name for n in graph.nodes.values() if n.kind.value == "op" and n.op_name.endswith(
        ("_.Tensor", "_.default", "_.Scalar")))
    # the step counter, each block's ema (mul_, add_) and batch norm's num_batches_tracked
    assert in_place == ["add_.Tensor"] * 5 + ["mul_.Tensor"] * 2
    plan = autopar.compile(model, inputs, mesh=2, cluster="dgx-a100", loss_fn=loss)
    source = program_source(build_program(graph, plan, False), plan)
    assert source.count("autopar_spmd_state_update(") == 7, source


class _CachesOnFirstCall(nn.Module):
    """Makes a bias table on its first forward, as x-transformers' ALiBi and
    some rotary embeddings do."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.register_buffer("table", torch.arange(8.0), persistent=False)
            self.calls = torch.zeros(())
        return self.proj(x) + self.table


def test_tracing_leaves_a_model_that_makes_state_in_forward_as_it_was():
    """torch.export runs forward on fake tensors: before autopar restored the
    modules, the model kept a FakeTensor buffer and its next eager forward
    returned a FakeTensor. The trace computes the table; the model is left
    untouched, with a warning naming what forward assigned."""
    from autopar.capture import capture
    model, x = _CachesOnFirstCall(), torch.randn(4, 8)
    with pytest.warns(UserWarning, match=r"assigned calls, table while it was traced"):
        graph = capture(model, (x,))
    assert not hasattr(model, "table") and "table" not in model._buffers and not hasattr(model, "calls")
    assert "arange" in [n.op_name.split(".")[0] for n in graph.nodes.values() if n.kind.value == "op"]
    out = model(x)
    assert type(out) is torch.Tensor and torch.equal(model.table, torch.arange(8.0))
    torch.testing.assert_close(out, model.proj(x) + torch.arange(8.0))


def test_in_place_op_whose_old_value_is_read_again_is_refused():
    """Running ``relu_`` out of place would change what a later reader of the
    overwritten tensor sees (here through a view taken before it): the model
    is refused, naming the op and readers. (torch.export already points later
    plain reads at the in-place op's result; a write through a slice whose
    base is read afterwards is written back with a slice_scatter.)"""
    from autopar.errors import AutoparError

    class ViewReadAfter(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            h = self.fc(x)
            v = h.view(4, 2, 4)
            torch.nn.functional.relu(h, inplace=True)
            return v.sum(1)

    class SliceOverwritten(ViewReadAfter):
        def forward(self, x):
            h = self.fc(x)
            torch.nn.functional.relu(h[:, :4], inplace=True)
            return h

    kw = dict(mesh=2, cluster="dgx-a100", loss_fn=torch.nn.functional.mse_loss)
    with pytest.raises(AutoparError, match=r"in-place op aten\.relu_\.default at the top level overwrites linear, "
                                           r"which sum_1 read afterwards.*inplace=False"):
        autopar.compile(ViewReadAfter(), (torch.randn(4, 8), torch.randn(4, 4)), **kw)
    # through a slice whose base is read afterwards: run out of place and written back
    plan = autopar.compile(SliceOverwritten(), (torch.randn(4, 8), torch.randn(4, 8)), **kw)
    assert [n.op for n in plan.nodes if n.op in ("relu", "slice_scatter")] == ["relu", "slice_scatter"]


def test_no_grad_regions_are_inlined_behind_detach():
    """``with torch.no_grad():`` in forward traces to a subgraph; its ops are
    inlined with their inputs detached, so no gradient is priced or flows
    through them (the teacher head of tests/fixtures/stateful.py)."""
    from autopar.capture import capture
    from autopar.cost_models.graph_costs import needs_grad
    graph = capture(*load_factory("tests/fixtures/stateful.py:small"))
    teacher = [n for n in graph.nodes.values() if n.fqn == "teacher" and n.op_name == "linear"]
    assert len(teacher) == 1
    assert all(graph.nodes[i].op_name == "detach" for i in teacher[0].inputs)
    assert teacher[0].name not in needs_grad(graph)


def test_autocast_blocks_run_with_the_casts_autocast_makes():
    """``torch.autocast`` in forward (tests/fixtures/opzoo.py:mixed_precision):
    capture writes autocast's casts out as ops, so the captured step, run on
    one device, gives the model's output bit for bit (in full precision it
    would not); a linear takes bfloat16 inputs, an einsum on float32
    inputs runs as its decomposition with the casts inside, and the block
    that turns autocast off stays in float32. A block traced on tensors
    autocast does not cast (a model built on the meta device) warns."""
    from autopar.capture import capture
    model, inputs, _ = load_factory("tests/fixtures/opzoo.py:mixed_precision")
    graph = capture(model, inputs[:-1])
    with torch.no_grad():
        out = run_captured(graph, model, inputs[0])
        assert torch.equal(out, model(inputs[0]))
        exact = copy.deepcopy(model).double()(inputs[0].double())  # autocast leaves float64 alone
        assert (out.double() - exact).abs().max() > 1e-3  # so the equality is bfloat16's, not float32's
    nodes = graph.nodes.values()
    dtype = {n.name: n.outputs[0].dtype for n in nodes if n.outputs and n.outputs[0] is not None}
    linears = [n for n in nodes if n.op_name == "linear"]
    assert len(linears) == 2 and all(dtype[i] == torch.bfloat16 for n in linears for i in n.inputs)
    assert [dtype[n.name] for n in nodes if n.op_name == "bmm"] == [torch.bfloat16]  # the first einsum, decomposed
    assert [n.op_name for n in nodes].count("einsum") == 2  # bfloat16 inputs already: kept whole
    assert {dtype[n.name] for n in nodes if n.op_name in ("pow", "rsqrt")} == {torch.float32}  # autocast off

    class Meta(nn.Module):  # autocast casts no meta tensors: a model built on meta is told so
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.fc(x)

    with torch.device("meta"):
        meta, x = Meta(), torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"torch\.autocast\('cpu', dtype=torch\.bfloat16\) at the top level was "
                                         r"traced on meta tensors, which it does not cast.*capture the model on the "
                                         r"device type it trains on"):
        graph = capture(meta, (x,))
    assert {n.outputs[0].dtype for n in graph.nodes.values() if n.outputs and n.outputs[0]} == {torch.float32}


def test_parameter_overwritten_in_forward_cond_and_data_dependent_shapes_are_refused_by_name():
    from autopar.errors import AutoparError

    class Clamps(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

        def forward(self, x):
            with torch.no_grad():
                self.fc.weight.clamp_(-0.1, 0.1)
            return self.fc(x)

    class Branches(Clamps):  # a data-dependent branch: torch.cond's subgraphs
        def forward(self, x):
            return torch.cond(x.sum() > 0, lambda t: self.fc(t), lambda t: self.fc(t) * 2, (x,))

    kw = dict(mesh=2, cluster="dgx-a100", loss_fn=torch.nn.functional.mse_loss)
    inputs = (torch.randn(4, 8), torch.randn(4, 8))
    with pytest.raises(AutoparError, match=r"in-place op aten\.clamp_\.default at the top level overwrites parameter "
                                           r"fc\.weight during the forward.*after optimizer\.step"):
        autopar.compile(Clamps(), inputs, **kw)
    with pytest.raises(AutoparError, match=r"runs a subgraph \(true_graph_0\) through cond, a higher-order op "
                                           r"autopar does not inline.*torch\.no_grad and torch\.autocast blocks"):
        autopar.compile(Branches(), inputs, **kw)

    class Selects(Clamps):  # a tensor whose size depends on values: no fixed shape to plan
        def forward(self, x):
            return self.fc(x).masked_select(x > 0).sum() * torch.ones_like(x)

    with pytest.raises(AutoparError, match=r"masked_select at the top level \(node masked_select\) makes a tensor of "
                                           r"shape \(u0\), a size that depends on the values of its input.*"
                                           r"write it with a fixed-shape op \(torch\.where"):
        autopar.compile(Selects(), inputs, **kw)
