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
