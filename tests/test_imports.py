"""autopar's modules import each other without a cycle (issue 28).

The graph is read from the source (ast), every import counted, also those
inside functions: a cycle hidden behind a function-level import is still two
modules that cannot be understood, tested or moved one without the other.
Every module is imported too, each in a fresh interpreter's order of its own.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"autopar": ROOT / "autopar", "autopar.passes": ROOT / "passes",
            "autopar.cost_models": ROOT / "cost_models"}
"""The package-dir mapping of pyproject.toml."""


def modules() -> dict[str, Path]:
    """module name -> file, for every module of autopar."""
    out = {}
    for package, folder in PACKAGES.items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if name.startswith("autopar.") and name.split(".")[1] in ("passes", "cost_models") \
                    and package == "autopar":
                continue
            out[name] = path
    return out


def imports(name: str, path: Path, known: set) -> set[str]:
    """The autopar modules ``name`` imports, wherever in the file."""
    is_package = path.name == "__init__.py"
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names]
        else:
            continue
        for t in targets:
            while t and t not in known:  # `import autopar.x.y` of a name inside a module
                t = t.rpartition(".")[0]
            if t and t != name:
                out.add(t)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    return {name: imports(name, path, set(mods)) for name, path in mods.items()}


def cycles(graph: dict) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    graph = import_graph()
    assert "autopar.compiler" in graph and "autopar.passes.layer_classes" in graph
    found = cycles(graph)
    assert not found, "import cycles among autopar's modules: " + "; ".join(" <-> ".join(c) for c in found)


@pytest.mark.parametrize("name", sorted(modules()))
def test_every_module_imports(name):
    importlib.import_module(name)


def test_no_module_calls_a_collective_torch_deprecates():
    """torch 2.13 deprecates all_gather_into_tensor and reduce_scatter_tensor
    (a FutureWarning on every rank of every run); autopar calls what replaces
    them, where this torch has it."""
    import re
    import warnings

    import torch.distributed as dist
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # reading dist.reduce_op warns
        deprecated = {n for n in dir(dist) if getattr(getattr(dist, n), "__deprecated__", None)}
    assert "all_gather_into_tensor" in deprecated or not hasattr(dist, "all_gather_single")
    calls = {(path.name, name) for path in modules().values()
             for name in re.findall(r"(?:torch\.distributed|\bdist)\.(\w+)\(", path.read_text())
             if name in deprecated}
    assert not calls, f"calls to deprecated torch.distributed functions: {sorted(calls)}"
