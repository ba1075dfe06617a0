"""The plan: what autopar decided, as versioned JSON (never pickled).

``Plan.to_json`` / ``Plan.load`` round-trip exactly; ``load`` validates the
schema version and every field it relies on, naming the field and what is valid.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from torch.distributed.tensor import Shard

from autopar.errors import PlanError, ShardingError
from autopar.mesh import Mesh
from autopar.passes.strategy import Strategy, fmt_spec, local_shape, parse_placement, parse_spec

SCHEMA = "autopar.plan/2"
READS = ("autopar.plan/1", SCHEMA)
"""The schemas ``Plan.load`` reads: version 2 added ``dynamic`` (the pieces
of a plan compiled for a range of sizes, autopar/dynamic/planfile.py; null
for a plan of one size), which version 1 plans load without."""
PHASES = ("forward", "backward", "recompute", "optimizer")
"""When a collective runs: "recompute" is a forward collective run again in
backward (a recomputed layer, or a ZeRO-3 parameter gathered again)."""
KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")
ZERO_LABELS = {0: "replicated (DP)", 2: "ZeRO-2", 3: "ZeRO-3", None: "TP"}
"""How a parameter is held, by its ``zero_stage`` (autopar.planner.zero_stage), as show and explain say it."""


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

    def placed(self, ndim: int) -> Strategy:
        """Its placements as a ``Strategy`` on a mesh of ``ndim`` axes."""
        items = tuple(parse_spec(x, ndim) for x in self.item_specs) or None
        return Strategy(tuple(parse_spec(x, ndim) for x in self.input_specs), parse_spec(self.output_spec, ndim),
                        items=items)

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
    dynamic: dict | None = None
    """A plan compiled for a range of sizes: its symbols and pieces, each a plan
    of its own (autopar/dynamic/planfile.py); this plan is the piece of the
    example sizes. None for a plan of one size."""

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
            "dynamic": self.dynamic,
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
        if schema not in READS:
            raise PlanError(f"plan schema is {schema!r}; this autopar reads {' and '.join(map(repr, READS))} "
                            "(recompile the plan)")
        for key in ("mesh", "cluster", "model", "parameters", "inputs", "nodes", "collectives",
                    "pipeline", "predicted", "solver"):
            _require(key in obj, f"plan lacks the required field {key!r}", None)
        try:
            mesh = Mesh.from_json(obj["mesh"])
        except (KeyError, TypeError) as e:
            raise PlanError(f"plan field 'mesh' is invalid ({e}); expected {{'shape': [...], 'axis_names': [...]}}") from None
        nd = mesh.ndim
        for key in ("nodes", "collectives"):
            _require(isinstance(obj[key], list), f"plan field {key!r} must be a list, got {obj[key]!r:.80}", None)
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
        _check_topology(obj["mesh"].get("topology", []), mesh)
        _require(isinstance(obj["parameters"], dict), "plan field 'parameters' must be an object "
                 f"{{fqn: {{placements, shape, local_shape}}}}, got {obj['parameters']!r:.80}", None)
        for fqn, p in obj["parameters"].items():
            _check_tensor(f"plan parameter {fqn!r}", p, mesh)
            _require(p.get("offload", False) in (True, False), f"plan parameter {fqn!r}: 'offload' must be true or "
                     f"false (its optimizer state in host memory), got {p.get('offload')!r}", p)
        _require(isinstance(obj["inputs"], list), "plan field 'inputs' must be a list of "
                 f"{{placements, shape, local_shape}}, got {obj['inputs']!r:.80}", None)
        for i, x in enumerate(obj["inputs"]):
            _check_tensor(f"plan input #{i}", x, mesh, base="microbatch_shape")
        if obj["pipeline"] is None:
            _check_parameter_nodes(nodes, obj["parameters"])
        for c in obj["collectives"]:
            _require(isinstance(c, dict), f"plan collective {c!r:.80} must be an object", None)
            _require(c.get("kind") in KINDS, f"collective kind {c.get('kind')!r} is not one of {KINDS}", c)
            _require(c.get("phase") in PHASES, f"collective phase {c.get('phase')!r} is not one of {PHASES}", c)
            _require(isinstance(c.get("mesh_axes"), list) and set(c["mesh_axes"]) <= set(mesh.names),
                     f"collective mesh_axes {c.get('mesh_axes')!r} must be a list of the mesh's axes "
                     f"{list(mesh.names)}", c)
            for key in ("bytes", "seconds"):
                _number(f"plan collective {c.get('node', '?')!r} field {key!r}", c.get(key))
        _check_numbers("predicted", obj["predicted"], PREDICTED_REQUIRED, PREDICTED_OPTIONAL)
        _check_memory(obj["predicted"])
        _check_numbers("solver", obj["solver"], ("objective", "variables", "constraints"), ("wall_s",))
        _require(isinstance(obj["solver"].get("status"), str),
                 f"plan field 'solver.status' must be a string like 'OPTIMAL', got {obj['solver'].get('status')!r}",
                 None)
        _require(obj["pipeline"] is None or isinstance(obj["pipeline"], dict),
                 f"plan field 'pipeline' must be null or an object, got {obj['pipeline']!r:.80}", None)
        for key in ("cluster", "model"):
            _require(isinstance(obj[key], dict), f"plan field {key!r} must be an object, got {obj[key]!r:.80}", None)
        dynamic = obj.get("dynamic") if schema != "autopar.plan/1" else None
        if dynamic is not None:
            from autopar.dynamic.planfile import check
            check(dynamic, mesh, cls.from_json)
        return cls(mesh, obj["cluster"], obj["mesh"].get("topology", []), obj["model"], obj["parameters"],
                   obj["inputs"], nodes, obj["collectives"], obj["predicted"], obj["solver"], obj["pipeline"],
                   obj.get("fallbacks", []), obj.get("warnings", []),
                   obj.get("recompute", {"mode": "none", "layers": []}), dynamic)

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


PREDICTED_REQUIRED = ("step_time_s", "compute_s", "comm_s", "peak_memory_bytes")
PREDICTED_OPTIONAL = ("bubble_s", "mfu", "optimizer_s", "memory_capacity_bytes", "grad_sync_s",
                      "grad_sync_exposed_s", "prefetched_gather_s", "prefetched_gather_exposed_s", "model_flops",
                      "host_memory_bytes", "host_capacity_bytes")
"""The predicted fields that `show`, `diff` and `viz` read as numbers."""


def _number(where: str, value, *, optional: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    _require(ok or (optional and value is None),
             f"{where} must be a number{' or null' if optional else ''}, got {value!r:.80}; "
             "recompile the plan rather than editing it by hand", value)


def _check_numbers(field_name: str, obj, required: tuple, optional: tuple) -> None:
    _require(isinstance(obj, dict), f"plan field {field_name!r} must be an object of numbers like "
             f"{{{required[0]!r}: 0.01, ...}}, got {obj!r:.80}; recompile the plan", obj)
    for key in required:
        _require(key in obj, f"plan field '{field_name}.{key}' is missing; it must be a number", obj)
        _number(f"plan field '{field_name}.{key}'", obj[key])
    for key in optional:
        if key in obj:
            _number(f"plan field '{field_name}.{key}'", obj[key], optional=True)


def _check_memory(predicted: dict) -> None:
    memory = predicted.get("memory", {})
    _require(isinstance(memory, dict), "plan field 'predicted.memory' must be an object of bytes by kind, "
             f"like {{'parameters': 1e9}}, got {memory!r:.80}", memory)
    for key, value in memory.items():
        _number(f"plan field 'predicted.memory.{key}'", value)


def _check_topology(topology, mesh: Mesh) -> None:
    """The topology (one entry per mesh axis) describes the mesh it sits next to."""
    if not topology:
        return
    sizes = [t.get("size") if isinstance(t, dict) else t for t in topology]
    names = [t.get("name") if isinstance(t, dict) else t for t in topology]
    _require(sizes == list(mesh.shape) and names == list(mesh.names),
             f"plan mesh shape {list(mesh.shape)} with axes {list(mesh.names)} does not match its topology, which "
             f"maps axes {names} of sizes {sizes}; a mesh edited by hand is not a plan: compile one for the "
             f"mesh you want (autopar compile ... --mesh {'x'.join(map(str, mesh.shape))})", topology)


def _check_tensor(where: str, entry, mesh: Mesh, base: str = "shape") -> None:
    """Placements that parse, shard dims the tensor has, and a local shape that
    is the global shape divided over the mesh."""
    _require(isinstance(entry, dict) and "placements" in entry and "shape" in entry,
             f"{where} needs 'placements' and 'shape', got {entry!r:.80}", entry)
    shape = entry.get(base, entry["shape"])
    _require(isinstance(shape, list) and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                             for d in shape),
             f"{where}: shape {shape!r:.80} must be a list of non-negative integers", entry)
    placements = entry["placements"]
    _require(isinstance(placements, list) and len(placements) == mesh.ndim,
             f"{where} has {len(placements) if isinstance(placements, list) else placements!r:.80} placements; "
             f"the mesh has {mesh.ndim} axes {list(mesh.names)} and needs one per axis", entry)
    spec = []
    for axis, text in zip(mesh.names, placements):
        try:
            p = parse_placement(text) if isinstance(text, str) else parse_placement(repr(text))
        except PlanError as e:
            raise PlanError(f"{where}, mesh axis {axis!r}: {e}") from None
        _require(not isinstance(p, Shard) or 0 <= p.dim < len(shape),
                 f"{where}, mesh axis {axis!r}: placement {text!r} shards dimension "
                 f"{getattr(p, 'dim', None)}, but the tensor has shape {shape} ({len(shape)} dims); valid: "
                 f"{', '.join(f'S({d})' for d in range(len(shape)))}{', ' if shape else ''}R or P", entry)
        spec.append(p)
    if "local_shape" not in entry:
        return
    try:
        expected = list(local_shape(shape, tuple(spec), mesh.shape))
    except ShardingError as e:
        raise PlanError(f"{where} with shape {shape} and placements {placements}: {e}") from None
    _require(entry["local_shape"] == expected,
             f"{where}: local_shape {entry['local_shape']!r:.80} is not its shape {shape} divided over the mesh "
             f"{list(mesh.shape)} as placed {placements}, which is {expected}; recompile the plan "
             "rather than editing shapes by hand", entry)


def _check_parameter_nodes(nodes: list, parameters: dict) -> None:
    """A parameter's placements are its graph node's output: an edit to one
    and not the other would run ops on shards they were not planned for."""
    for node in nodes:
        info = parameters.get(node.location) if node.op == "param" else None
        if isinstance(info, dict):
            placed = "".join(info["placements"])
            _require(placed == node.output_spec,
                     f"plan parameter {node.location!r} is placed {placed} but its graph node {node.name!r} "
                     f"produces it as {node.output_spec}; they must agree (every op that reads it was planned "
                     "for the node's placement): recompile the plan rather than editing placements by hand", node)


__all__ = ["Plan", "NodePlan", "SCHEMA", "READS", "ZERO_LABELS", "fmt_spec"]
