"""A cache of solved plans, so that compiling the same thing again answers at once.

    autopar.compile(model, inputs, mesh=..., cluster=..., cache="~/.cache/autopar")
    autopar compile examples/gpt.py:demo --mesh 2x2 --cluster dgx-a100 --cache ~/.cache/autopar

The key is everything the plan depends on: the traced graph's fingerprint
(ops, shapes, dtypes, module paths), the mesh, the whole cluster
description, every compile option, and a hash of the planner's own source
(autopar, its cost models and sharding rules), so a new version of autopar
never reads an old entry. An entry is the plan's JSON, written atomically;
``plan.solver["cache"]`` says "hit" or "miss". A corrupt entry is a miss and
is overwritten, with a warning.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

import autopar.cost_models
import autopar.passes
from autopar.plan import Plan

log = logging.getLogger("autopar")


@functools.lru_cache(maxsize=1)
def code_version() -> str:
    """sha256 of the planner's Python sources (autopar, its cost models and rules)."""
    digest = hashlib.sha256()
    for package in (Path(__file__).parent, Path(autopar.cost_models.__file__).parent,
                    Path(autopar.passes.__file__).parent):
        for path in sorted(package.rglob("*.py")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes())
    return digest.hexdigest()


def cache_key(fingerprint: str, mesh, cluster, options: dict) -> str:
    what = {"fingerprint": fingerprint, "mesh": mesh.to_json(), "cluster": cluster.to_json(),
            "options": options, "code": code_version()}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:32]


def load(directory: str, key: str) -> Plan | None:
    path = Path(directory).expanduser() / f"{key}.json"
    if not path.exists():
        return None
    try:
        return Plan.from_json(json.loads(path.read_text()))
    except (ValueError, KeyError, TypeError) as e:
        log.warning("autopar: plan cache entry %s is unreadable (%s); solving again and replacing it", path, e)
        return None


def store(directory: str, key: str, plan: Plan) -> None:
    folder = Path(directory).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(plan.dumps())
    os.replace(tmp, folder / f"{key}.json")
