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
    ClusterError, FactoryError, InputError, MeshError, OutputError, PlanError, RankMismatchError)
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
    """Seeded apart before building the model, fed different batches in
    global-batch mode, or with a compile that fails on rank 0 (caught by the
    script): every rank raises the same typed error, and the script goes on."""
    proc = torchrun(["tests/fixtures/bad_ranks.py", FASTNET], 2, timeout=300)
    assert proc.returncode == 0, first_error(proc.stderr) + proc.stdout[-2000:]
    lines = dict(re.findall(r"^case (\d rank \d): (.*)$", proc.stdout, re.M))
    assert len(lines) == 8, proc.stdout
    for rank in (0, 1):
        seeds, batches, infeasible = (lines[f"{case} rank {rank}"] for case in (1, 2, 3))
        assert seeds.startswith("RankMismatchError: rank 1 holds a different initial parameter 'layers.0.weight'")
        assert "random seed that differs per rank" in seeds and "torch.manual_seed(0)) before building" in seeds
        assert batches.startswith("RankMismatchError: rank 1 passed a different input 0 (shape [8, 32]")
        assert "sampler" in batches and "local_inputs=True" in batches and "seed the data loader alike" in batches
        assert infeasible.startswith("InfeasibleError: no plan fits in 1 B per device")
    assert lines["3 rank 1"] == lines["3 rank 0"]  # rank 0's error, word for word
    assert lines["4 rank 0"] == lines["4 rank 1"] and lines["4 rank 0"].startswith("loss ")


def test_rank_mismatch_error_is_an_autopar_error():
    assert issubclass(RankMismatchError, autopar.AutoparError)


def test_fingerprint_sees_a_permutation_and_ignores_nothing():
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
    assert sorted(os.listdir(out)) == ["plan.json", "rank_program.py", "train.py"]


def test_codegen_refuses_a_file_as_its_directory(tmp_path, capsys, plan_file):
    (tmp_path / "proj").write_text("x")
    rc, _, err = run_cli(capsys, "codegen", plan_file, "-o", str(tmp_path / "proj"))
    assert rc == 2 and "is a file, not a directory; name a directory" in err
