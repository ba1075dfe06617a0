"""Value types: meshes, placements, plan files."""
import copy
import json

import pytest
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.errors import MeshError, PlanError
from autopar.mesh import Mesh, parse_mesh
from autopar.passes.strategy import Strategy, fmt_spec, parse_spec


@pytest.mark.parametrize("spec, shape, names", [
    (4, (4,), ("x",)),
    ((2, 2), (2, 2), ("x", "y")),
    ("2x2", (2, 2), ("x", "y")),
    ("1x4", (1, 4), ("x", "y")),
    ("dp=2,tp=4", (2, 4), ("dp", "tp")),
    ({"dp": 8, "tp": 8}, (8, 8), ("dp", "tp")),
])
def test_parse_mesh(spec, shape, names):
    m = parse_mesh(spec)
    assert (m.shape, m.names) == (shape, names)


@pytest.mark.parametrize("spec, message", [
    ("3x0", "axis size 0 is not a positive integer"),
    ("2xa", "expected sizes joined by 'x'"),
    ((2, -1), "must be a positive integer, got -1"),
    ("dp=2,dp=2", "must be distinct"),
    ("", "expected sizes"),
])
def test_bad_mesh_names_rule_and_value(spec, message):
    with pytest.raises(MeshError, match=message):
        parse_mesh(spec)


def test_mesh_names_must_match_shape():
    with pytest.raises(MeshError, match="one name per axis"):
        Mesh((2, 2), ("x",))


@pytest.mark.parametrize("spec, text", [
    ((Shard(0), Replicate()), "S(0)R"),
    ((Partial(),), "P"),
    ((Partial("avg"), Shard(2)), "P(avg)S(2)"),
])
def test_spec_round_trip(spec, text):
    assert fmt_spec(spec) == text
    assert parse_spec(text, len(spec)) == spec


def test_strategy_prints_like_the_design():
    s = Strategy(((Shard(0),), (Replicate(),)), (Shard(0),))
    assert str(s) == "(S(0), R) -> S(0)"


@pytest.mark.parametrize("text", ["S(x)", "Q", "S(0)S(1)"])
def test_bad_spec(text):
    with pytest.raises(PlanError):
        parse_spec(text, 1)


@pytest.fixture(scope="session")  # built once per xdist worker, which interleaves modules
def plan():
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=64)
    return autopar.compile(model, inputs, mesh=4, cluster="dgx-a100", loss_fn=loss)


def test_plan_round_trips_and_has_the_contract(plan, tmp_path):
    path = tmp_path / "plan.json"
    plan.save(str(path))
    obj = json.loads(path.read_text())
    assert obj["schema"] == "autopar.plan/2"
    assert obj["dynamic"] is None  # a plan of one size
    for key in ("mesh", "parameters", "collectives", "pipeline", "predicted", "solver"):
        assert key in obj
    for key in ("step_time_s", "compute_s", "comm_s", "bubble_s", "peak_memory_bytes", "mfu"):
        assert key in obj["predicted"]
    for key in ("status", "objective", "wall_s", "variables", "constraints"):
        assert key in obj["solver"]
    again = autopar.Plan.load(str(path))
    assert again.dumps() == plan.dumps()


def test_corrupt_plan(tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"schema": "autopar.plan/1", "mesh": ')
    with pytest.raises(PlanError, match="not valid JSON"):
        autopar.Plan.load(str(path))


def test_wrong_version_plan(plan, tmp_path):
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    obj["schema"] = "autopar.plan/0"
    with pytest.raises(PlanError, match="this autopar reads 'autopar.plan/1' and 'autopar.plan/2'"):
        autopar.Plan.from_json(obj)


def test_version_1_plan_still_loads(plan):
    """Plans written before schema 2 (no "dynamic" section) load as plans of one size."""
    obj = copy.deepcopy(plan.to_json())
    obj["schema"] = "autopar.plan/1"
    del obj["dynamic"]
    old = autopar.Plan.from_json(obj)
    assert old.dynamic is None and old.nodes == plan.nodes and old.predicted == plan.predicted


def test_plan_missing_field(plan):
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    del obj["collectives"]
    with pytest.raises(PlanError, match="required field 'collectives'"):
        autopar.Plan.from_json(obj)


def test_plan_bad_collective_kind(plan):
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    obj["collectives"] = [{"kind": "broadcastish", "phase": "forward"}]
    with pytest.raises(PlanError, match="not one of"):
        autopar.Plan.from_json(obj)


def test_plan_placements_must_fit_mesh(plan):
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    fqn = next(iter(obj["parameters"]))
    obj["parameters"][fqn]["placements"] = ["R", "R"]
    with pytest.raises(PlanError, match="has 2 placements; the mesh has 1 axes"):
        autopar.Plan.from_json(obj)


def test_plan_recompute_regions_must_name_ops_of_the_model(plan):
    """A plan whose recomputed regions name nodes the model does not have
    (edited, or compiled for another model) is refused at codegen, by name."""
    from autopar.capture import capture
    from autopar.codegen import build_program
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=64)
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    obj["recompute"] = {"mode": "selective", "layers": ["layers.0"], "regions": [["no_such_node"]]}
    with pytest.raises(PlanError, match=r"recompute entry does not fit this model: .*'no_such_node'"):
        build_program(capture(model, inputs, loss), autopar.Plan.from_json(obj))


@pytest.mark.parametrize("edit, node", [
    ("output_spec", "p_model_layers_0_weight"),  # a parameter held as a partial sum
    ("input_specs", "linear"),                   # a linear whose inputs no rule pairs with its output
])
def test_plan_strategy_its_rule_does_not_allow_is_refused_at_codegen(plan, edit, node):
    """A hand-edited plan.json whose placements are valid syntax but not among
    those the op's rule allows (the local op would not be exact) is refused,
    naming the node, the strategy and valid ones."""
    from autopar.capture import capture
    from autopar.codegen import build_program
    from mlp import make
    model, inputs, loss = make(batch=8, hidden=64)
    obj = copy.deepcopy(plan.to_json())  # the fixture is shared: do not edit it
    entry = next(n for n in obj["nodes"] if n["name"] == node)
    if edit == "output_spec":  # and its parameter entry alike (they must agree, else refused on load)
        entry["output_spec"] = "P"
        obj["parameters"]["layers.0.weight"]["placements"] = ["P"]
    else:
        entry["input_specs"] = ["S(1)", "S(1)", "S(0)"]
        entry["output_spec"] = "S(0)"
    with pytest.raises(PlanError, match=rf"plan node {node} \(.*\) has strategy .*which its sharding rule does not "
                                        r"allow on mesh .*valid: .*The plan file was edited or is corrupt"):
        build_program(capture(model, inputs, loss), autopar.Plan.from_json(obj))
