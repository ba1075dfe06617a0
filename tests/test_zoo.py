"""The fast part of the model-zoo check (benchmarks/model_zoo.py, whose full
run docs/coverage.md records): Hugging Face architectures that
tests/test_distributed.py does not run, each under a sharding plan (a random
valid plan that splits at least half of the parameters' elements; solved plans
for models this small keep their parameters whole) on a 2x2 mesh of 4 gloo
ranks, in one launch. They train like one device, and their parameters are
really split."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT

pytestmark = pytest.mark.launch

TOL = 1e-5
MODELS = ["hf_vit", "hf_whisper", "hf_deepseek_v3"]  # vision, speech encoder-decoder, MoE with latent attention


def test_zoo_models_under_sharding_plans_train_like_one_device(tmp_path):
    out = tmp_path / "rows.json"
    proc = subprocess.run(
        [sys.executable, "benchmarks/model_zoo.py", "--models", ",".join(MODELS), "--meshes", "2x2", "--plans",
         "random", "--min-sharded", "0.5", "--workdir", str(tmp_path), "--json", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert sorted(row["name"] for row in rows) == sorted(MODELS)
    for row in rows:
        r = row["meshes"]["2x2"]
        assert r["random_sharded"] >= 0.5, row["name"]
        with open(r["random_plan"]) as f:
            placements = [p["placements"] for p in json.load(f)["parameters"].values()]
        assert all(any(p[axis] != "R" for p in placements) for axis in (0, 1)), f"{row['name']}: an axis splits nothing"
        c = r["checks"]["random"]
        assert "error" not in c, f"{row['name']}: {c.get('error')}"
        assert c["loss_rel"] <= TOL and c["grad"] <= TOL and c["param"] <= max(TOL, c["param_floor"]), \
            f"{row['name']}: {c}"
