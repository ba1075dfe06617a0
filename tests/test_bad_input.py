"""Bad input as a careless or unlucky user gives it (issue 27): each case ends
in a typed error whose message names the value and the fix, never a hang, a
raw traceback from inside autopar, a silent wrong result or a lost file.

Most cases run the CLI in-process (``autopar.cli.main``); the ranks that
disagree run under torchrun (tests/fixtures/bad_ranks.py, one launch)."""
import errno
import json
import os
import re
import shutil

import pytest

import autopar
from autopar import cli
from autopar.errors import (
    ClusterError, FactoryError, InputError, MeshError, OutputError, PlanError)
from conftest import ROOT, first_error, torchrun

FASTNET = os.path.join(ROOT, "tests", "fixtures", "fastnet.json")


def run_cli(capsys, *argv) -> tuple[int, str, str]:
    rc = cli.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture(scope="module")
def plan_file(tmp_path_factory) -> str:
    """A 2x2 plan of a model whose weights it shards (examples/mlp.py:wide)."""
    from mlp import wide
    model, inputs, loss = wide()
    plan = autopar.compile(model, inputs, mesh="2x2", cluster="dgx-a100", loss_fn=loss,
                           source=os.path.join(ROOT, "examples", "mlp.py") + ":wide")
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    plan.save(str(path))
    return str(path)


@pytest.fixture
def no_solve(monkeypatch):
    """Fail if the compile starts: the error must come before any solving."""
    import autopar.compiler

    def solve(*args, **kwargs):
        raise AssertionError("the compile started before the bad output path was reported")
    monkeypatch.setattr(autopar.compiler, "compile", solve)


def write_model(folder, name: str, text: str) -> str:
    path = folder / name
    path.write_text(text)
    return str(path)


# --- 1 and 3: ranks that disagree, and an error raised on rank 0 only -------

@pytest.mark.launch
def test_ranks_that_disagree_raise_the_same_error_on_every_rank():
    """Seeded apart before building the model (a flat or a pipelined plan),
    building different models, fed different batches in global-batch mode, or
    with a compile that fails on rank 0 (caught by the script): every rank
    raises the same typed error, and the script goes on."""
    proc = torchrun(["tests/fixtures/bad_ranks.py", FASTNET], 2, timeout=300)
    assert proc.returncode == 0, first_error(proc.stderr) + proc.stdout[-2000:]
    lines = dict(re.findall(r"^case (\d rank \d): (.*)$", proc.stdout, re.M))
    assert len(lines) == 20, proc.stdout
    for rank in (0, 1):
        short, shard, short_pipelined = (lines[f"{case} rank {rank}"] for case in (7, 8, 9))
        assert short == "InputError: rank 1: the plan takes 2 input(s) (model inputs then the target), got 1"
        assert re.match(r"InputError: rank 1: input 0 has shape \[(\d+), 32\]; the plan was compiled for "
                        r"\[(\d+), 32\] \(this rank's shard, local_inputs=True\)", shard), shard
        assert short_pipelined == ("InputError: rank 1: the plan takes 2 inputs (model inputs then the target), "
                                   "got 1")
        seeds, batches, infeasible, pipelined, models, pipelined_batches = (
            lines[f"{case} rank {rank}"] for case in (1, 2, 3, 4, 5, 6))
        assert pipelined_batches.startswith("RankMismatchError: rank 1 passed a different input 0 (shape [4, 8]")
        assert models == ("RankMismatchError: rank 1 holds 5 parameters and buffers, rank 0 holds 4: the ranks built "
                          "different models. Every rank must build the same model (the same code and configuration) "
                          "before it is parallelized")
        assert seeds.startswith("RankMismatchError: rank 1 holds a different initial parameter 'layers.0.weight'")
        assert pipelined.startswith("RankMismatchError: rank 1 holds a different initial parameter 'tok.weight'")
        assert "random seed that differs per rank" in seeds and "torch.manual_seed(0)) before building" in seeds
        assert batches.startswith("RankMismatchError: rank 1 passed a different input 0 (shape [8, 32]")
        assert "sampler" in batches and "local_inputs=True" in batches and "seed the data loader alike" in batches
        assert infeasible.startswith("InfeasibleError: no plan fits in 1 B per device")
    assert lines["3 rank 1"] == lines["3 rank 0"]  # rank 0's error, word for word
    assert lines["0 rank 0"] == lines["0 rank 1"] and lines["0 rank 0"].startswith("loss ")
    assert lines["0 rank 1"].endswith("scratch [0.0, 0.0, 0.0]")  # rank 0's


@pytest.mark.parametrize("error, expected_type, expected", [
    (autopar.InfeasibleError("no plan fits in 1 B", needed_bytes=64.0, status="INFEASIBLE"), autopar.InfeasibleError,
     "no plan fits in 1 B"),
    (PlanError("plan field 'predicted' ..."), PlanError, "plan field 'predicted' ..."),
    (RuntimeError("CUDA out of memory"), autopar.AutoparError,
     "compiling the plan on rank 0 raised RuntimeError: CUDA out of memory"),
])
def test_rank_0s_compile_error_as_the_other_ranks_raise_it(error, expected_type, expected):
    """What ranks 1..N raise for the error payload rank 0 broadcasts in the plan's place."""
    from autopar.runtime import _error_payload, _remote_error
    raised = _remote_error(_error_payload(error))
    assert type(raised) is expected_type and str(raised) == expected
    if isinstance(error, autopar.InfeasibleError):
        assert (raised.needed_bytes, raised.status) == (64.0, "INFEASIBLE")


def test_fingerprint_sees_a_permutation_and_a_small_change():
    import torch

    from autopar.rankcheck import fingerprint
    x = torch.arange(10.0)
    assert torch.equal(fingerprint(x), fingerprint(x.clone()))
    assert not torch.equal(fingerprint(x), fingerprint(x.flip(0)))  # same sum and sum of squares
    assert not torch.equal(fingerprint(x), fingerprint(x + 1e-3))


# --- 2: output files -------------------------------------------------------

def test_compile_refuses_to_overwrite_the_model_file(tmp_path, capsys, no_solve):
    model = shutil.copy(os.path.join(ROOT, "examples", "mlp.py"), tmp_path / "mymodel.py")
    before = open(model).read()
    rc, _, err = run_cli(capsys, "compile", f"{model}:small", "--mesh", "2", "--cluster", "cpu", "-o", str(model))
    assert rc == 2 and open(model).read() == before
    assert f"compile -o {str(model)!r} exists and is not an autopar plan" in err
    assert "will not overwrite it: name another file" in err


@pytest.mark.parametrize("case", ["directory", "under a file", "unwritable", "cache is a file"])
def test_compile_output_is_checked_before_solving(tmp_path, capsys, no_solve, case):
    (tmp_path / "afile").write_text("x")
    args = ["-o", str(tmp_path / "plan.json")]
    if case == "directory":
        args, expected = ["-o", str(tmp_path)], rf"compile -o '{tmp_path}' is a directory; name a file in it instead"
    elif case == "under a file":
        args = ["-o", str(tmp_path / "afile" / "plan.json")]
        expected = rf"goes under '{tmp_path / 'afile'}', which is a file, not a directory"
    elif case == "unwritable":
        if not os.path.isdir("/proc/self"):
            pytest.skip("needs Linux's /proc, where nobody can create files (not even root)")
        args, expected = ["-o", "/proc/plan.json"], r"cannot be written: '/proc' refuses new files \(.+\)"
    else:
        args += ["--cache", str(tmp_path / "afile")]
        expected = rf"--cache '{tmp_path / 'afile'}' is a file, not a directory"
    rc, _, err = run_cli(capsys, "compile", "examples/mlp.py:small", "--mesh", "2", "--cluster", "cpu", *args)
    assert rc == 2 and re.search(expected, err), err
    assert "choose" in err or "name" in err  # and what to do


def test_compile_cache_naming_a_file_is_refused_before_tracing(tmp_path, monkeypatch):
    import autopar.planner

    def no_capture(*args, **kwargs):
        raise AssertionError("the model was traced before the bad cache was reported")
    monkeypatch.setattr(autopar.planner, "capture", no_capture)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(OutputError, match=r"cache '.*afile' is a file, not a directory; name a directory"):
        autopar.compile(None, (), mesh=2, cluster="cpu", cache=str(tmp_path / "afile"))


def test_a_cache_that_cannot_be_written_is_warned_about(tmp_path, monkeypatch, caplog):
    """A full disk when storing the solved plan: a warning, and the plan."""
    import autopar.outputs
    from mlp import small

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(autopar.outputs.os, "replace", full)
    model, inputs, loss = small()
    with caplog.at_level("WARNING", logger="autopar"):
        plan = autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss, cache=str(tmp_path / "plans"))
    assert plan.solver["cache"] == "miss" and os.listdir(tmp_path / "plans") == []
    assert "the plan cache did not store this plan: cannot write" in caplog.text
    assert "No space left on device" in caplog.text


def test_compile_overwrites_its_own_plan(tmp_path, capsys, plan_file):
    target = tmp_path / "plan.json"
    shutil.copy(plan_file, target)
    rc, out, _ = run_cli(capsys, "compile", "examples/mlp.py:small", "--mesh", "2", "--cluster", "cpu", "-q",
                         "-o", str(target))
    assert rc == 0 and "plan written to" in out
    assert autopar.Plan.load(str(target)).mesh.shape == (2,)
    assert os.listdir(tmp_path) == ["plan.json"]  # no temporary file left behind


def test_a_failed_write_leaves_the_old_file(tmp_path, monkeypatch, plan_file):
    """A full disk (ENOSPC at the rename) is an OutputError; the old plan stays
    whole and no temporary file is left."""
    import autopar.outputs
    target = tmp_path / "plan.json"
    shutil.copy(plan_file, target)
    before = target.read_text()

    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    monkeypatch.setattr(autopar.outputs.os, "replace", full)
    with pytest.raises(OutputError, match=r"cannot write .*No space left on device; the file is left as it was"):
        autopar.Plan.load(plan_file).save(str(target))
    assert target.read_text() == before and os.listdir(tmp_path) == ["plan.json"]


def test_codegen_refuses_a_non_empty_directory_without_force(tmp_path, capsys, plan_file):
    out = tmp_path / "proj"
    out.mkdir()
    (out / "train.py").write_text("# my own training script\n")
    rc, _, err = run_cli(capsys, "codegen", plan_file, "-o", str(out))
    assert rc == 2 and (out / "train.py").read_text() == "# my own training script\n"
    assert f"codegen -o {str(out)!r} is not empty (train.py)" in err and "pass --force" in err
    rc, stdout, _ = run_cli(capsys, "codegen", plan_file, "-o", str(out), "--force")
    assert rc == 0 and "wrote" in stdout
    assert "autopar plan in plan.json" in (out / "train.py").read_text()
    assert sorted(os.listdir(out)) == [".autopar-written", "plan.json", "rank_program.py", "train.py"]


def test_codegen_replaces_its_own_output_but_not_a_file_edited_since(tmp_path, capsys, plan_file):
    """Running the README's quick start twice writes into the same directory:
    files codegen wrote (its manifest: a sha256 per file) are replaced; one
    the user edited since is not."""
    out = tmp_path / "proj"
    for _ in range(2):
        rc, stdout, _ = run_cli(capsys, "codegen", plan_file, "-o", str(out))
        assert rc == 0 and "wrote" in stdout
    (out / "train.py").write_text((out / "train.py").read_text() + "# my change\n")
    rc, _, err = run_cli(capsys, "codegen", plan_file, "-o", str(out))
    assert rc == 2 and f"is not empty (train.py)" in err and "# my change" in (out / "train.py").read_text()


def test_codegen_refuses_a_file_as_its_directory(tmp_path, capsys, plan_file):
    (tmp_path / "proj").write_text("x")
    rc, _, err = run_cli(capsys, "codegen", plan_file, "-o", str(tmp_path / "proj"))
    assert rc == 2 and "is a file, not a directory; name a directory" in err


def test_viz_refuses_to_overwrite_what_it_did_not_write(tmp_path, capsys, plan_file):
    plan = shutil.copy(plan_file, tmp_path / "plan.json")
    before = open(plan).read()
    rc, _, err = run_cli(capsys, "viz", str(plan), "-o", str(plan))
    assert rc == 2 and open(plan).read() == before
    assert f"viz -o {str(plan)!r} exists and is not a page autopar viz wrote; autopar will not overwrite it" in err
    for _ in range(2):  # its own page it replaces
        rc, out, _ = run_cli(capsys, "viz", str(plan), "-o", str(tmp_path / "plan.html"))
        assert rc == 0 and out.startswith("wrote")
    assert sorted(os.listdir(tmp_path)) == ["plan.html", "plan.json"]


# --- 4: plans validated on load --------------------------------------------

def _set(path: list, value):
    def edit(obj):
        for key in path[:-1]:
            obj = obj[key]
        obj[path[-1]] = value
    return edit


def _drop(path: list):
    def edit(obj):
        for key in path[:-1]:
            obj = obj[key]
        del obj[path[-1]]
    return edit


def _param(field, value):
    return _set(["parameters", "layers.0.weight", field], value)


EDITS = {
    "placement Q": (_param("placements", ["Q", "R"]),
                    r"plan parameter 'layers.0.weight', mesh axis 'x': placement 'Q' is not valid; "
                    r"expected S\(<dim>\), R, P"),
    "S(7) of a matrix": (_param("placements", ["S(7)", "R"]),
                         r"placement 'S\(7\)' shards dimension 7, but the tensor has shape \[1024, 256\] \(2 dims\); "
                         r"valid: S\(0\), S\(1\), R or P"),
    "shape edited": (_param("shape", [7, 3]),
                     r"plan parameter 'layers.0.weight' with shape \[7, 3\] .* does not divide mesh axis"),
    "local shape edited": (_param("local_shape", [1024, 256]),
                           r"local_shape \[1024, 256\] is not its shape \[1024, 256\] divided over the mesh "
                           r"\[2, 2\] .* which is \[\d+, \d+\]; recompile the plan"),
    "mesh edited, topology not": (_set(["mesh", "shape"], [4, 1]),
                                  r"plan mesh shape \[4, 1\] .* does not match its topology, which maps axes "
                                  r"\['x', 'y'\] of sizes \[2, 2\].* --mesh 4x1"),
    "predicted null": (_set(["predicted"], None),
                       r"plan field 'predicted' must be an object of numbers .* got None; recompile the plan"),
    "predicted step missing": (_drop(["predicted", "step_time_s"]),
                               r"plan field 'predicted.step_time_s' is missing; it must be a number"),
    "predicted step a string": (_set(["predicted", "comm_s"], "fast"),
                                r"plan field 'predicted.comm_s' must be a number, got 'fast'"),
    "predicted memory a list": (_set(["predicted", "memory"], [1, 2]),
                                r"plan field 'predicted.memory' must be an object of bytes by kind"),
    "solver null": (_set(["solver"], None), r"plan field 'solver' must be an object"),
    "collective on no axis": (lambda o: o["collectives"].append(
        {"kind": "all_reduce", "phase": "backward", "mesh_axes": ["z"], "bytes": 4, "seconds": 0.0}),
        r"collective mesh_axes \['z'\] must be a list of the mesh's axes \['x', 'y'\]"),
}


def _placement_edit(obj):
    """Change a weight's placement (and its local shape alike) but not the
    graph node that produces it: every rank would fail in a matmul."""
    entry = obj["parameters"]["layers.0.weight"]
    entry["placements"], entry["local_shape"] = ["R", "R"], entry["shape"]


EDITS["placement edited, node not"] = (
    _placement_edit, r"plan parameter 'layers.0.weight' is placed RR but its graph node '\w+' produces it as "
                     r"\S+; they must agree .* recompile the plan")


@pytest.mark.parametrize("case", list(EDITS))
def test_hand_edited_plans_are_refused_by_every_command(tmp_path, capsys, plan_file, case):
    edit, expected = EDITS[case]
    obj = json.load(open(plan_file))
    edit(obj)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(obj))
    with pytest.raises(PlanError, match=expected):
        autopar.Plan.load(str(bad))
    for argv in (["show", str(bad)], ["diff", plan_file, str(bad)], ["viz", str(bad), "-o", str(tmp_path / "v.html")],
                 ["codegen", str(bad), "-o", str(tmp_path / "proj")]):
        rc, _, err = run_cli(capsys, *argv)
        assert rc == 2 and err.startswith("autopar: error: ") and re.search(expected, err), (argv, err)
        assert "Traceback" not in err


def test_truncated_plan_is_refused(tmp_path, plan_file):  # worked before issue 27
    bad = tmp_path / "cut.json"
    bad.write_text(open(plan_file).read()[:500])
    with pytest.raises(PlanError, match=r"is not valid JSON .*; it may be truncated or corrupt"):
        autopar.Plan.load(str(bad))


def test_hand_edited_cache_entry_is_solved_again(tmp_path, caplog):
    """An entry edited by hand (valid JSON, its predicted step set to 0) no
    longer matches its checksum: a miss, with a warning, solved and replaced."""
    from mlp import small
    model, inputs, loss = small()
    cache = str(tmp_path / "plans")
    first = autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss, cache=cache)
    (entry,) = (tmp_path / "plans").glob("*.json")
    text = entry.read_text()
    step = first.predicted["step_time_s"]
    assert text.startswith("sha256 ") and repr(step) in text
    entry.write_text(text.replace(repr(step), "0.0"))
    with caplog.at_level("WARNING", logger="autopar"):
        again = autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss, cache=cache)
    assert again.solver["cache"] == "miss" and again.predicted["step_time_s"] == step
    assert "checksum does not match its contents (edited or truncated); solving again" in caplog.text
    assert autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss, cache=cache).solver["cache"] == "hit"


# --- 5: raw tracebacks -----------------------------------------------------

FAILING_FACTORY = '''import torch


def width():
    raise ValueError("width must come from the config")


def make():
    return torch.nn.Linear(width(), 4), (torch.randn(2, 4),)
'''


def test_a_factory_that_raises_shows_the_users_frames(tmp_path, capsys):
    path = write_model(tmp_path, "failing.py", FAILING_FACTORY)
    with pytest.raises(FactoryError) as info:
        autopar.runtime.load_factory(f"{path}:make")
    message = str(info.value)
    assert message.startswith(f"factory {path}:make raised ValueError: width must come from the config")
    assert f'File "{path}", line 9, in make' in message and f'File "{path}", line 5, in width' in message
    assert "autopar/runtime.py" not in message and "fix the error in your code" in message
    rc, _, err = run_cli(capsys, "compile", f"{path}:make", "--mesh", "2", "--cluster", "cpu",
                         "-o", str(tmp_path / "p.json"))
    assert rc == 2 and "raised ValueError: width must come from the config" in err and "Traceback" not in err


def test_a_factory_file_with_a_syntax_error(tmp_path):
    path = write_model(tmp_path, "broken.py", "import torch\n\ndef make(:\n    pass\n")
    with pytest.raises(FactoryError, match=rf"importing model file {re.escape(path)} failed: SyntaxError: .*\n"
                                           rf'  File "{re.escape(path)}", line 3\n    def make\(:\n'
                                           r"fix the syntax error"):
        autopar.runtime.load_factory(f"{path}:make")


def test_a_factory_file_that_fails_on_import(tmp_path):
    path = write_model(tmp_path, "importfail.py", "import torch\nSIZE = int('wide')\n")
    with pytest.raises(FactoryError, match=rf"importing model file .* raised ValueError: invalid literal .*\n"
                                           rf'in your code \(most recent call last\):\n'
                                           rf'  File "{re.escape(path)}", line 2, in <module>'):
        autopar.runtime.load_factory(f"{path}:make")


BAD_MODELS = '''import torch
import torch.nn.functional as F
from torch import nn


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x, scale):
        return self.a(x) * scale


def with_int():
    return Scaled(), (torch.randn(4, 8), 3, torch.randn(4, 8)), F.mse_loss


def with_none_target():
    return Scaled(), (torch.randn(4, 8), torch.ones(()), None), F.mse_loss


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        if h.sum() > 0:
            return h * 2
        return h


def branchy():
    return Branchy(), (torch.randn(4, 8),), None
'''


@pytest.mark.parametrize("factory, expected", [
    ("with_int", r"example input 1 is 3 of type int, not a tensor; .*pass it as a tensor \(e.g. torch.tensor"),
    ("with_none_target", r"the target is None of type NoneType, not a tensor; .*leave it out of example_inputs"),
])
def test_non_tensor_example_inputs(tmp_path, factory, expected):
    path = write_model(tmp_path, "bad_models.py", BAD_MODELS)
    model, inputs, loss = autopar.runtime.load_factory(f"{path}:{factory}")
    with pytest.raises(InputError, match=expected):
        autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss)


def test_data_dependent_control_flow_names_the_line_and_the_fix(tmp_path):
    path = write_model(tmp_path, "bad_models.py", BAD_MODELS)
    model, inputs, loss = autopar.runtime.load_factory(f"{path}:branchy")
    with pytest.raises(autopar.AutoparError) as info:
        autopar.compile(model, inputs, mesh=2, cluster="cpu", loss_fn=loss)
    message = str(info.value)
    assert message.startswith(f"the forward depends on a tensor's value at {path}:30 (if h.sum() > 0:)")
    assert "move the branch out of the traced step" in message and "torch.where(cond, a, b)" in message
    assert "torch.cond" in message


# --- 6: a mesh larger than the cluster --------------------------------------

def test_a_mesh_larger_than_the_cluster():
    from autopar.cost_models.cluster import get_cluster
    from autopar.mesh import parse_mesh
    with pytest.raises(ClusterError, match=r"mesh x=1000000000000 needs 1,000,000,000,000 devices, but cluster "
                                           r"'cpu' has 4 \(1 node\(s\) x 4 devices per node\): use a mesh of at "
                                           r"most 4 devices, or a cluster description with more nodes"):
        get_cluster("cpu").check_fits(parse_mesh(10**12))
    get_cluster("dgx-a100").check_fits(parse_mesh(10**12))  # nodes: null, as many as the mesh needs


def test_compile_refuses_a_mesh_larger_than_the_cluster(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "compile", "examples/mlp.py:small", "--mesh", str(10**12), "--cluster", "cpu",
                         "-o", str(tmp_path / "p.json"))
    assert rc == 2 and "needs 1,000,000,000,000 devices, but cluster 'cpu' has 4" in err


# --- cases that already worked before issue 27 ------------------------------

@pytest.mark.parametrize("argv, expected", [
    (["--mesh", "2x0"], r"mesh '2x0': axis size 0 is not a positive integer"),
    (["--mesh", "2", "--cluster", "dgx-z"], r"valid presets are"),
    (["--mesh", "2", "--memory", "lots"], r"memory 'lots' is not a size; write e.g. 80GB"),
])
def test_bad_compile_arguments(capsys, tmp_path, argv, expected):
    argv = argv if "--cluster" in argv else [*argv, "--cluster", "cpu"]
    rc, _, err = run_cli(capsys, "compile", "examples/mlp.py:small", *argv, "-o", str(tmp_path / "p.json"))
    assert rc == 2 and re.search(expected, err), err


def test_a_factory_returning_the_wrong_tuple(tmp_path):
    path = write_model(tmp_path, "wrong.py", "import torch\n\ndef make():\n    return torch.nn.Linear(2, 2)\n")
    with pytest.raises(autopar.AutoparError, match=r"must return \(model, example_inputs\) or"):
        autopar.runtime.load_factory(f"{path}:make")


def test_a_negative_mesh_axis():
    with pytest.raises(MeshError, match=r"every axis size must be a positive integer"):
        autopar.Mesh((2, -1), ("x", "y"))


@pytest.mark.parametrize("flag, value, valid", [("--schedule", "1f1b,zb", "gpipe, 1f1b, interleaved-1f1b"),
                                                ("--recompute", "some", "auto, none, selective, full")])
def test_verify_refuses_an_unknown_schedule_or_recomputation_before_launching(capsys, flag, value, valid):
    """`autopar verify` names the bad value and the valid ones before it starts torchrun."""
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "examples/gpt.py:small", "--mesh", "pp=2,tp=2", flag, value])
    message = str(e.value)
    assert f"{flag} {value.split(',')[-1]!r}" in message and valid in message, message
    assert "$ torchrun" not in capsys.readouterr().out  # nothing was launched


@pytest.mark.parametrize("mesh", ["4", "2x4"])
def test_verify_refuses_a_mesh_the_plan_was_not_compiled_for(plan_file, capsys, mesh):
    """`autopar verify --plan` with another --mesh: the 2x2 plan on a 1-D mesh of 4 failed inside the
    program ('placement spec ... has 2 placements'), a pipelined one ran under the other mesh's label;
    now it is refused before launching, naming the mesh to pass."""
    with pytest.raises(SystemExit) as e:
        cli.main(["verify", "examples/mlp.py:wide", "--mesh", mesh, "--plan", plan_file])
    assert f"--mesh {mesh} does not match the plan's mesh " in str(e.value) and "pass --mesh " in str(e.value)
    assert "$ torchrun" not in capsys.readouterr().out


def test_verify_refuses_a_pipelined_plan_under_other_axis_names(tmp_path, capsys):
    """A pipelined plan's axes are named for what they carry: --mesh dp=2,tp=2 does not run pp=2,tp=2."""
    from autopar.runtime import load_factory
    model, inputs, loss = load_factory("examples/gpt.py:small")
    path = str(tmp_path / "pp.json")
    autopar.compile(model, inputs, mesh="pp=2,tp=2", cluster=FASTNET, loss_fn=loss, microbatches=4).save(path)
    with pytest.raises(SystemExit, match=r"--mesh dp=2,tp=2 does not match the plan's mesh pp=2,tp=2 \(4 devices\): "
                                         r"pass --mesh pp=2,tp=2"):
        cli.main(["verify", "examples/gpt.py:small", "--mesh", "dp=2,tp=2", "--plan", path])
