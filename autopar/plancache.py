"""A cache of solved plans, so that compiling the same thing again answers at once.

    autopar.compile(model, inputs, mesh=..., cluster=..., cache="~/.cache/autopar")
    autopar compile examples/gpt.py:demo --mesh 2x2 --cluster dgx-a100 --cache ~/.cache/autopar

The key is everything the plan depends on: the traced graph's fingerprint
(ops, shapes, dtypes, module paths), the mesh, the whole cluster
description, every compile option, and a hash of the planner's own source
(autopar, its cost models and sharding rules), so a new version of autopar
never reads an old entry. An entry is a checksum line (``sha256 <hex>``)
and the plan's JSON, written atomically; ``plan.solver["cache"]`` says "hit"
or "miss". A corrupt entry, or one edited by hand (its checksum no longer
matches), is a miss and is overwritten, with a warning.

The same directory holds solved *layer classes* (``layers/``): the
intra-stage ILP a pipeline search solves per stage submesh and microbatch
size, on a copy of the model truncated to two of its repeated layers
(autopar/pipeline/pricing.py). Its key is that graph's fingerprint, the
submesh, the cluster and the options, so another model built of the same
layers (another depth, another device count, another batch) reuses it.
"""
from __future__ import annotations

import functools
import hashlib
import json
import logging
from dataclasses import asdict
from pathlib import Path

import autopar.cost_models
import autopar.passes
from autopar.errors import AutoparError, OutputError
from autopar.outputs import write_text
from autopar.plan import Plan
from autopar.solver import Solution

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
    return _read(Path(directory).expanduser() / f"{key}.json", lambda text: Plan.from_json(json.loads(text)))


def store(directory: str, key: str, plan: Plan) -> None:
    _write(Path(directory).expanduser(), key, plan.dumps())


LAYERS = "layers"
"""Subdirectory of the solved layer classes."""


def load_solution(directory: str, key: str, graph, strategies: dict) -> Solution | None:
    """A solved layer class, checked against the graph and strategies it is
    for (a node without a choice, or a choice out of range, is unreadable)."""
    def parse(text):
        sol = Solution(**json.loads(text))
        if set(sol.choice) != set(graph.nodes) or any(
                not isinstance(i, int) or not 0 <= i < len(strategies[n]) for n, i in sol.choice.items()):
            raise ValueError("its choices do not match the graph's nodes and strategies")
        sol.choice = {name: sol.choice[name] for name in graph.nodes}  # in graph order, as solved
        return sol
    return _read(Path(directory).expanduser() / LAYERS / f"{key}.json", parse)


def store_solution(directory: str, key: str, solution: Solution) -> None:
    _write(Path(directory).expanduser() / LAYERS, key, json.dumps(asdict(solution), sort_keys=True, default=str))


CHECKSUM = "sha256 "
"""An entry's first line: ``sha256 <hex digest of the rest>``."""


def _read(path: Path, parse):
    if not path.exists():
        return None
    try:
        return parse(_verified(path.read_text()))
    except (ValueError, KeyError, TypeError, AutoparError) as e:
        log.warning("autopar: plan cache entry %s is unreadable: %s; solving again and replacing it", path, e)
        return None


def _verified(text: str) -> str:
    """The entry's body, if its checksum matches (an entry edited by hand, or
    cut short, does not)."""
    first, _, body = text.partition("\n")
    if not first.startswith(CHECKSUM):
        raise ValueError("it has no checksum line")
    if hashlib.sha256(body.encode()).hexdigest() != first[len(CHECKSUM):]:
        raise ValueError("its sha256 checksum does not match its contents (edited or truncated)")
    return body


def _write(folder: Path, key: str, text: str) -> None:
    """Atomically: a reader sees the old entry or the new one, never half. A
    cache that cannot be written (a full disk) is warned about; the plan
    solved is still returned."""
    try:
        write_text(str(folder / f"{key}.json"), f"{CHECKSUM}{hashlib.sha256(text.encode()).hexdigest()}\n{text}")
    except OutputError as e:
        log.warning("autopar: the plan cache did not store this plan: %s", e)
