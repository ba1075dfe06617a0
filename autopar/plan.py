"""The plan: what autopar decided, as versioned JSON (never pickled).

``Plan.to_json`` / ``Plan.load`` round-trip exactly; ``load`` validates the
schema version and every field it relies on, naming the field and what is valid.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from autopar.errors import PlanError
from autopar.mesh import Mesh
from autopar.passes.strategy import fmt_spec, parse_spec

SCHEMA = "autopar.plan/1"
PHASES = ("forward", "backward", "recompute", "optimizer")
"""When a collective runs: "recompute" is a forward collective run again in
backward (a recomputed layer, or a ZeRO-3 parameter gathered again)."""
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


@dataclass
class NodePlan:
    name: str
    op: str
    location: str
    inputs: list  # list[str]: producer names
    input_specs: list  # list[str]: spec per tensor input, e.g. "S(0)R"
    output_spec: str
    compute_s: float = 0.0
    memory_bytes: float = 0.0
    candidates: int = 1
    item_specs: list = field(default_factory=list)
    """A spec per output where an op's outputs are placed differently
    (``Strategy.items``; ``output_spec`` is the first); empty otherwise."""

    @property
    def strategy(self) -> str:
        out = f"({', '.join(self.item_specs)})" if self.item_specs else self.output_spec
        return f"({', '.join(self.input_specs)}) -> {out}"

    def item_spec(self, k: int) -> str:
        """The spec of output ``k``."""
        return self.item_specs[k] if self.item_specs else self.output_spec

    def to_json(self) -> dict:
        items = {"item_specs": self.item_specs} if self.item_specs else {}
        return {"name": self.name, "op": self.op, "location": self.location, "inputs": self.inputs,
                "strategy": self.strategy, "input_specs": self.input_specs, "output_spec": self.output_spec,
                "compute_s": self.compute_s, "memory_bytes": self.memory_bytes, "candidates": self.candidates,
                **items}


@dataclass
class Plan:
    mesh: Mesh
    cluster: dict
    topology: list  # per mesh axis: {"name", "size", "intra", "inter", "level"}
    model: dict  # {"source", "fingerprint", "inputs": [{"shape", "dtype"}], "has_loss"}
    parameters: dict  # fqn -> {"placements": [...], "shape": [...], "local_shape": [...]}
    inputs: list  # per user input: {"placements": [...], "shape": [...], "local_shape": [...]}
    nodes: list  # list[NodePlan]
    collectives: list
    predicted: dict
    solver: dict
    pipeline: dict | None = None
    fallbacks: list = field(default_factory=list)
    warnings: list = field(default_factory=list)
    recompute: dict = field(default_factory=lambda: {"mode": "none", "layers": []})
    """Activation recomputation: {"mode": "none"|"full", "layers": ["blocks.0", ...]}."""

    # --- derived views -------------------------------------------------
    def node(self, name: str) -> NodePlan:
        for n in self.nodes:
            if n.name == name:
                return n
        raise PlanError(f"plan has no node named {name!r}")

    def node_specs(self) -> dict:
        """name -> (input specs, output spec) as placement tuples."""
        nd = self.mesh.ndim
        return {n.name: ([parse_spec(s, nd) for s in n.input_specs], parse_spec(n.output_spec, nd))
                for n in self.nodes}

    def count(self, kind: str | None = None, phase: str | None = None, axis: str | None = None) -> int:
        return sum(1 for c in self.collectives
                   if (kind is None or c["kind"] == kind) and (phase is None or c["phase"] == phase)
                   and (axis is None or axis in c["mesh_axes"]))

    # --- JSON ------------------------------------------------------------
    def to_json(self) -> dict:
        return {
            "schema": SCHEMA,
            "mesh": {**self.mesh.to_json(), "topology": self.topology},
            "cluster": self.cluster,
            "model": self.model,
            "parameters": self.parameters,
            "inputs": self.inputs,
            "nodes": [n.to_json() for n in self.nodes],
            "collectives": self.collectives,
            "pipeline": self.pipeline,
            "predicted": self.predicted,
            "solver": self.solver,
            "fallbacks": self.fallbacks,
            "warnings": self.warnings,
            "recompute": self.recompute,
        }

    def dumps(self) -> str:
        return json.dumps(self.to_json(), indent=1, sort_keys=True) + "\n"

    def save(self, path: str) -> None:
        """Write the plan atomically (autopar/outputs.py)."""
        from autopar.outputs import write_text
        write_text(path, self.dumps())

    @classmethod
    def from_json(cls, obj) -> "Plan":
        _require(isinstance(obj, dict), "the plan must be a JSON object", obj)
        schema = obj.get("schema")
        if schema != SCHEMA:
            raise PlanError(f"plan schema is {schema!r}; this autopar reads {SCHEMA!r} (recompile the plan)")
        for key in ("mesh", "cluster", "model", "parameters", "inputs", "nodes", "collectives",
                    "pipeline", "predicted", "solver"):
            _require(key in obj, f"plan lacks the required field {key!r}", None)
        try:
            mesh = Mesh.from_json(obj["mesh"])
        except (KeyError, TypeError) as e:
            raise PlanError(f"plan field 'mesh' is invalid ({e}); expected {{'shape': [...], 'axis_names': [...]}}") from None
        nd = mesh.ndim
        nodes = []
        for i, n in enumerate(obj["nodes"]):
            try:
                node = NodePlan(n["name"], n["op"], n["location"], list(n["inputs"]), list(n["input_specs"]),
                                n["output_spec"], float(n.get("compute_s", 0)), float(n.get("memory_bytes", 0)),
                                int(n.get("candidates", 1)), list(n.get("item_specs", [])))
            except (KeyError, TypeError) as e:
                raise PlanError(f"plan node #{i} is invalid: missing or wrong field {e}") from None
            _require(all(isinstance(x, str) for x in node.item_specs),
                     f"plan node {node.name!r}: item_specs must be a list of specs like 'S(0)R'", n)
            for spec in (*node.input_specs, node.output_spec, *node.item_specs):
                parse_spec(spec, nd)
            _require(not node.item_specs or node.item_specs[0] == node.output_spec,
                     f"plan node {node.name!r} places its first output {node.item_specs[:1]} but its "
                     f"output_spec is {node.output_spec!r}; they must agree", n)
            nodes.append(node)
        for fqn, p in obj["parameters"].items():
            _require(isinstance(p, dict) and "placements" in p and "shape" in p,
                     f"plan parameter {fqn!r} needs 'placements' and 'shape'", p)
            _require(len(p["placements"]) == nd,
                     f"plan parameter {fqn!r} has {len(p['placements'])} placements; the mesh has {nd} axes", p)
        for c in obj["collectives"]:
            _require(c.get("kind") in KINDS, f"collective kind {c.get('kind')!r} is not one of {KINDS}", c)
            _require(c.get("phase") in PHASES, f"collective phase {c.get('phase')!r} is not one of {PHASES}", c)
        return cls(mesh, obj["cluster"], obj["mesh"].get("topology", []), obj["model"], obj["parameters"],
                   obj["inputs"], nodes, obj["collectives"], obj["predicted"], obj["solver"], obj["pipeline"],
                   obj.get("fallbacks", []), obj.get("warnings", []),
                   obj.get("recompute", {"mode": "none", "layers": []}))

    @classmethod
    def load(cls, path: str) -> "Plan":
        if not os.path.exists(path):
            raise PlanError(f"plan file {path!r} does not exist")
        with open(path) as f:
            text = f.read()
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"plan file {path!r} is not valid JSON ({e}); it may be truncated or corrupt") from None
        return cls.from_json(obj)


def _require(ok: bool, message: str, value) -> None:
    if not ok:
        raise PlanError(message)


__all__ = ["Plan", "NodePlan", "SCHEMA", "fmt_spec"]
