"""Dynamic shapes (autopar/dynamic): one compile for a range of sizes.

Symbols and their dims by table; the step captured with symbolic sizes is,
specialized, the static capture of those sizes; the lattices of sizes that
divide alike; prices and their expressions are the planner's own. The
acceptance: one compile of a GPT for batch 1..1024 against static compiles
at 1, 8, 64 and 1024, its boundaries against static compiles on both sides,
and (one torchrun launch) a training loop whose batch size changes every
step on 4 gloo ranks against one device. Then the plan file, the command
line and the refusals.
"""
from __future__ import annotations

import copy
import json

import numpy as np
import pytest
import sympy
import torch
from torch import nn

import autopar
from autopar.capture import capture
from autopar.dynamic import Assignment, Dynamic, Pricer, SymbolicGraph, parse_dims, parse_range, resolve
from autopar.dynamic.graph import lattices
from autopar.errors import AutoparError, InputError, PlanError
from autopar.mesh import parse_mesh
from autopar.cost_models.cluster import get_cluster
from conftest import ROOT, first_error, torchrun
from gpt import GPT, GPTConfig, lm_loss, medium


def gpt(batch: int, cfg=GPTConfig()):
    torch.manual_seed(0)
    model = GPT(cfg)
    idx = torch.randint(0, cfg.vocab, (batch, cfg.seq), generator=torch.Generator().manual_seed(1))
    return model, (idx, idx.roll(1, dims=1))


# --------------------------------------------------------------------------- symbols

@pytest.mark.parametrize("text, parsed", [
    ("batch=4..32", ("batch", (4, 32))),
    ("seq=128..4096:128", ("seq", (128, 4096, 128))),
    (" batch = 1 .. 1024 ", ("batch", (1, 1024))),
])
def test_cli_ranges_parse(text, parsed):
    assert parse_range(text) == parsed


@pytest.mark.parametrize("text", ["batch=4", "batch=a..b", "4..32", "batch=4..32:", "batch=-1..4"])
def test_bad_ranges_say_what_is_valid(text):
    with pytest.raises(AutoparError, match="NAME=LOW..HIGH"):
        parse_range(text)


def test_dims_parse():
    assert parse_dims("seq=0.1,1.1") == ("seq", [(0, 1), (1, 1)])
    with pytest.raises(AutoparError, match="INPUT.DIM"):
        parse_dims("seq=0,1")


def test_batch_and_seq_name_batch_first_dims_by_default():
    x, mask, pos = torch.zeros(8, 32), torch.zeros(8, 32), torch.zeros(32)
    (batch, seq) = resolve({"batch": (1, 64), "seq": (16, 64)}, None, (x, mask, pos))
    assert batch.dims == ((0, 0), (1, 0)) and seq.dims == ((0, 1), (1, 1))  # pos (32,) is no batch
    assert str(batch) == "batch=1..64" and 8 in batch and 65 not in batch
    stepped = resolve({"batch": range(4, 65, 4)}, None, (x,))[0]
    assert (stepped.lo, stepped.hi, stepped.step, 6 in stepped, 12 in stepped) == (4, 64, 4, False, True)


@pytest.mark.parametrize("dynamic, dims, message", [
    ({"tokens": (1, 64)}, None, "say which input dims it names"),
    ({"batch": (16, 64)}, None, "example inputs have batch = 8 .* of a size in the range"),
    ({"batch": (4, 60, 8)}, None, r"example inputs have batch = 8 \(dims .*\), which is not among"),
    ({"batch": (64, 4)}, None, "is empty"),
    ({"batch": (4, 30, 4)}, None, "highest size on that lattice is 28"),
    ({"batch": (0, 8)}, None, "positive integer"),
    ({"batch": (1, 64)}, {"batch": [(0, 2)]}, "no dim 2"),
    ({"batch": (1, 64), "rows": (1, 64)}, {"rows": [(0, 0)]}, "named by both"),
    ({"batch": (1, 64)}, {"seq": [(0, 1)]}, "which dynamic does not declare"),
    ([("batch", 1, 64)], None, "must be a dict"),
])
def test_bad_symbols_say_the_rule_and_what_is_valid(dynamic, dims, message):
    with pytest.raises(AutoparError, match=message):
        resolve(dynamic, dims, (torch.zeros(8, 32), torch.zeros(8, 32)))


# --------------------------------------------------------------------------- the symbolic step

@pytest.fixture(scope="module")
def symbolic():
    model, inputs = gpt(8)
    return SymbolicGraph(model, inputs, lm_loss, resolve({"batch": (1, 1024), "seq": (2, 32)}, None, inputs))


@pytest.mark.parametrize("batch, seq", [(1, 32), (3, 32), (8, 16), (64, 5), (1024, 2)])
def test_the_specialized_step_is_the_static_capture(symbolic, batch, seq):
    model, inputs = gpt(batch)
    static = capture(model, tuple(x[:, :seq] for x in inputs), lm_loss)
    assert symbolic.specialize({"batch": batch, "seq": seq}).fingerprint() == static.fingerprint()


def test_shapes_are_expressions_in_the_symbols(symbolic):
    b, s = symbolic.sym["batch"], symbolic.sym["seq"]
    logits = next(n for n in symbolic.graph.nodes.values() if n.op_name == "flatten.using_ints")
    assert symbolic.shape(logits.name) == (b * s, 256)
    assert set(symbolic.dim_expressions()) == {b, s, b * s}
    assert symbolic.degree("batch") == 1 and symbolic.degree("seq") == 2  # attention: queries x keys


def test_a_dim_the_model_fixes_is_refused():
    class Fixed(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).reshape(8, 4)  # only a batch of 8

    x = torch.zeros(8, 4)
    with pytest.raises(AutoparError, match="does not trace with symbolic sizes"):
        SymbolicGraph(Fixed(), (x,), None, resolve({"batch": (1, 64)}, None, (x,)))


@pytest.mark.parametrize("mesh, dynamic, expected", [
    ((4,), {"batch": (1, 1024)}, [((1,), (2,), (512,)), ((2,), (4,), (256,)), ((4,), (4,), (256,))]),
    ((2, 2), {"batch": (1, 1024)}, [((1,), (2,), (512,)), ((2,), (4,), (256,)), ((4,), (4,), (256,))]),
    ((8,), {"batch": (8, 1024, 8)}, [((8,), (8,), (128,))]),  # every size divides alike
    ((2, 3), {"batch": (1, 12)}, [((1,), (6,), (2,)), ((2,), (6,), (2,)), ((3,), (6,), (2,)), ((4,), (6,), (2,)),
                                  ((5,), (6,), (2,)), ((6,), (6,), (2,))]),
])
def test_sizes_fall_into_lattices_that_divide_alike(mesh, dynamic, expected):
    model, inputs = gpt(8)
    sg = SymbolicGraph(model, inputs, lm_loss, resolve(dynamic, None, inputs))
    assert [(lat.first, lat.step, lat.count) for lat in lattices(sg, mesh)] == expected


def test_a_price_is_the_static_compiles_prediction_and_its_expression_exact():
    mesh, cluster = parse_mesh(4), get_cluster("dgx-a100")
    model, inputs = gpt(24)
    sg = SymbolicGraph(model, inputs, lm_loss, resolve({"batch": (1, 1024)}, None, inputs))
    plan = autopar.compile(model, inputs, mesh=mesh, cluster=cluster, loss_fn=lm_loss)
    pricer = Pricer(sg, mesh, cluster, optimizer="adamw", precision="fp32", budget=cluster.device.memory, source=None)
    lat = next(lat for lat in lattices(sg, mesh.shape) if lat.index((24,)) is not None)
    a = Assignment.of(plan)
    priced = pricer.price(a, lat, (24,))
    assert priced == {k: plan.predicted[k] for k in priced}
    expr = pricer.curve(a, lat, ((0, lat.count[0] - 1),)).expression((sg.sym["batch"],))
    for t in np.linspace(0, lat.count[0] - 1, 9).round().astype(int):
        b = lat.value((t,))[0]
        want = pricer.price(a, lat, (b,))["step_time_s"]
        assert float(expr.subs(sg.sym["batch"], b)) == pytest.approx(want, rel=1e-9)


# --------------------------------------------------------------------------- acceptance: a GPT, batch 1..1024

@pytest.fixture(scope="module")
def over_batch():
    """One compile of examples/gpt.py:medium (hidden 256: its best plan on two
    A100s changes over the range) for batch 1..1024 with tolerance 0: every
    piece's plan within the solver's gap of each size's optimum."""
    model, inputs, loss_fn = medium(8)
    plan = autopar.compile(model, inputs, mesh=2, cluster="dgx-a100", loss_fn=loss_fn,
                           dynamic={"batch": (1, 1024)}, tolerance=0)
    sg = SymbolicGraph(model, inputs, loss_fn, Dynamic(plan).symbols)
    cluster = get_cluster("dgx-a100")
    pricer = Pricer(sg, plan.mesh, cluster, optimizer="adamw", precision="fp32", budget=cluster.device.memory,
                    source=None)
    return plan, pricer


def static(batch: int) -> autopar.Plan:
    model, inputs, loss_fn = medium(batch)
    return autopar.compile(model, inputs, mesh=2, cluster="dgx-a100", loss_fn=loss_fn)


def piece_price(plan, pricer, i: int, batch: int) -> float:
    dyn = Dynamic(plan)
    return pricer.cost(Assignment.of(dyn.plan(i)), dyn.lattices[i], (batch,))


@pytest.mark.parametrize("batch", [1, 8, 64, 1024])
def test_one_compile_gives_the_static_compiles_plans(over_batch, batch):
    plan, pricer = over_batch
    dyn, gap = Dynamic(plan), plan.solver["relative_gap"]
    i = dyn.piece({"batch": batch})
    mine = float(dyn.expression(i).subs(dyn.locals()["batch"], batch))  # the piece's own expression
    assert mine == pytest.approx(piece_price(plan, pricer, i, batch), rel=1e-9)
    best = static(batch).predicted["step_time_s"]
    assert best * (1 - gap) <= mine <= best * (1 + gap), (batch, mine, best, dyn.pieces[i]["where"])


def test_boundaries_are_where_the_static_compiles_plans_change(over_batch):
    """At the first two boundaries of the largest lattice (sizes that divide
    alike, here every other batch): the lower piece's plan is the optimum (within the
    gap) at its last two sizes and not at the upper piece's first size,
    where the static compile's plan is another; the upper piece's plan is
    the optimum at its first two sizes; the sizes in between (the other
    lattice) get their own pieces' plans."""
    plan, pricer = over_batch
    dyn, gap = Dynamic(plan), plan.solver["relative_gap"]
    lattice = max(set(dyn.lattices), key=lambda lat: lat.size)
    pieces = sorted((i for i, lat in enumerate(dyn.lattices) if lat == lattice), key=lambda i: dyn.ranges(i)["batch"])
    assert len(pieces) >= 3, [dyn.pieces[i]["where"] for i in pieces]
    checked = 0
    for below, above in list(zip(pieces, pieces[1:]))[:2]:
        lo, last, step = dyn.ranges(below)["batch"]
        first, hi, _ = dyn.ranges(above)["batch"]
        assert first == last + step
        compiled = {b: static(b) for b in {max(lo, last - step), last, last + 1, first, min(hi, first + step)}}
        for b, p in compiled.items():
            owner = dyn.piece({"batch": b})
            assert piece_price(plan, pricer, owner, b) <= p.predicted["step_time_s"] * (1 + gap), (b, owner)
        a = Assignment.of(dyn.plan(below))
        assert piece_price(plan, pricer, below, first) > compiled[first].predicted["step_time_s"] * (1 + gap)
        assert Assignment.of(compiled[first]) != a  # the static compile's plan changes there
        checked += 1
    assert checked == 2


def test_each_boundary_says_why(over_batch):
    plan, _ = over_batch
    from autopar.dynamic.explain import describe, reason
    text = describe(plan)
    for p in plan.dynamic["pieces"]:
        if p["boundary"]:
            assert reason(p["boundary"]) in text and "the plan below would take" in reason(p["boundary"])


# --------------------------------------------------------------------------- the plan file

@pytest.fixture(scope="module")
def small_plan():
    model, inputs = gpt(8, GPTConfig(vocab=256, seq=16, hidden=128, heads=4, layers=2))
    return autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=lm_loss, memory=8e6,
                           dynamic={"batch": (4, 16, 4)}, source=None)


def test_dynamic_plan_round_trips(small_plan, tmp_path):
    path = tmp_path / "plan.json"
    small_plan.save(str(path))
    obj = json.loads(path.read_text())
    assert obj["schema"] == "autopar.plan/2" and len(obj["dynamic"]["pieces"]) >= 2
    again = autopar.Plan.load(str(path))
    assert again.dumps() == small_plan.dumps()
    dyn = Dynamic(again)
    for i in range(len(dyn.pieces)):
        lo, hi, step = dyn.ranges(i)["batch"]
        assert all(dyn.piece({"batch": b}) == i for b in range(lo, hi + 1, step))
        sympy.sympify(dyn.pieces[i]["expressions"]["peak_memory_bytes"])


@pytest.mark.parametrize("edit, message", [
    (lambda d: d["pieces"][0].update(box=[[0, 99]]), "box must give"),
    (lambda d: d["pieces"][0]["expressions"].update(step_time_s="2 *"), "not an expression sympy reads"),
    (lambda d: d.update(pieces=[]), "non-empty list"),
    (lambda d: d["pieces"][0]["lattice"].update(first=[2]), "leaves the declared"),
    (lambda d: d["pieces"][0]["plan"]["predicted"].update(step_time_s="fast"), r"pieces\[0\].plan: .*step_time_s"),
    (lambda d: d["symbols"][0].update(hi=2), "dynamic.symbols"),
])
def test_an_edited_dynamic_section_is_refused(small_plan, edit, message):
    obj = copy.deepcopy(small_plan.to_json())
    edit(obj["dynamic"])
    with pytest.raises(PlanError, match=message):
        autopar.Plan.from_json(obj)


def test_a_size_outside_every_piece_is_refused_with_the_declared_sizes(small_plan):
    dyn = Dynamic(small_plan)
    for batch in (2, 6, 28):
        with pytest.raises(InputError, match=r"outside the sizes this plan was compiled for \(batch from 4 to 16 "
                                             r"in steps of 4\).*fallback='compile'"):
            dyn.piece({"batch": batch})


def test_a_size_no_plan_fits_is_named():
    model, inputs = gpt(8)
    with pytest.raises(autopar.InfeasibleError, match=r"at batch = 256, one of the sizes dynamic declares: no plan "
                                                      r"fits in 1.91 MiB per device"):
        autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=lm_loss, memory=2e6,
                        dynamic={"batch": (4, 256, 4)})


def test_dynamic_is_planned_without_a_pipeline():
    model, inputs = gpt(8)
    with pytest.raises(AutoparError, match="planned without a pipeline.*pipeline_stages"):
        autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=lm_loss, dynamic={"batch": (4, 8)},
                        pipeline_stages=2)
    with pytest.raises(AutoparError, match="tolerance"):
        autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=lm_loss, dynamic={"batch": (4, 8)},
                        tolerance=1.5)
    with pytest.raises(AutoparError, match="pass dynamic"):
        autopar.compile(model, inputs, mesh=4, cluster="cpu", loss_fn=lm_loss, dims={"batch": [(0, 0)]})


# --------------------------------------------------------------------------- the command line

def test_cli_compile_show_explain_codegen(tmp_path, capsys):
    from autopar.cli import main
    plan_path, out = tmp_path / "plan.json", tmp_path / "prog"

    def run(*args) -> tuple:
        code = main(list(args))
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, text, err = run("compile", f"{ROOT}/examples/gpt.py:small", "--mesh", "4", "--cluster", "cpu", "--memory", "8MB",
                          "--dynamic", "batch=4..16:4", "-o", str(plan_path))
    assert code == 0, err[-2000:]
    assert "pieces over batch=4..16:4" in text and "*batch + " in text
    code, text, err = run("explain", str(plan_path), "--over", "batch=4..8")
    assert code == 0 and "pieces over batch=4..16:4" in text, err[-2000:]
    code, text, err = run("explain", str(plan_path), "--over", "batch=2..8:2")  # beyond the plan: compiled for it
    assert code == 0, err[-2000:]
    assert "compiled for batch=2..8:2" in text and "pieces over batch=2..8:2" in text
    code, text, err = run("codegen", str(plan_path), "-o", str(out))
    pieces = len(json.loads(plan_path.read_text())["dynamic"]["pieces"])
    assert code == 0 and sorted(p.name for p in out.glob("piece_*.py")) == [f"piece_{i}.py" for i in range(pieces)]
    code, _, err = run("compile", "examples/gpt.py:small", "--mesh", "4", "--cluster", "cpu", "--dynamic", "batch=4..")
    assert code == 2 and "NAME=LOW..HIGH" in err


# --------------------------------------------------------------------------- running it

@pytest.mark.launch
def test_training_with_a_new_batch_size_every_step_matches_one_device():
    """tests/fixtures/dynamic_ranks.py on 4 gloo ranks: one compile, pieces that
    place the parameters differently, the batch changing every step; loss and
    gradients every step and the parameters at the end as one device's
    (float64); the decorator form compiles once for its range and once more
    for a size off it (fallback="compile"); a size outside the plan is
    refused alike on every rank; a second model whose batch and sequence
    length both change every step trains like one device too."""
    proc = torchrun(["tests/fixtures/dynamic_ranks.py"], 4)
    assert proc.returncode == 0, proc.stdout[-3000:] + first_error(proc.stderr)
    report = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("{")))
    assert report["compile_count"] == 1 and report["pieces"] >= 3 and report["layouts"] >= 3
    assert len(set(report["ran"])) >= 3 and all(a != b for a, b in zip(report["ran"], report["ran"][1:]))
    assert max(report["worst"].values()) < 1e-12, report["worst"]
    assert "outside the sizes this plan was compiled for" in report["refused"]
    assert report["decorated_counts"] == [1, 1, 1, 1, 2] and report["decorated_error"] < 1e-12
    assert report["pieces2"] >= 2  # batch and sequence length both changing: the two-symbol losses and gradients
