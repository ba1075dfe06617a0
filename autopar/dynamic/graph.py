"""The step captured once with symbolic sizes, and made concrete for any of them.

``SymbolicGraph`` traces the step with ``torch.export`` and a ``Dim`` per
symbol, so every tensor's shape is a sympy expression in the symbols
(``shape(node)``: ``(batch, 32, 64)``, ``(32*batch, 256)``). ``specialize``
substitutes sizes and returns the ``Graph`` a static capture of those sizes
gives (the same nodes, names, shapes and arguments: the same fingerprint),
whose ``gm`` is still the symbolic program, so the code emitted from it reads
its sizes from its inputs at run time (autopar/codegen.py).

``lattices`` cuts the declared sizes into the sets on which every sharding
rule offers the same strategies: a split of a dim over mesh axes of sizes
``k`` needs the dim's size to divide by ``k``, and a dim of size ``e(batch)``
divides by ``k`` according to ``batch`` modulo ``k`` alone (an integer
polynomial's value modulo ``k``), so the sizes fall into residue classes
modulo the mesh's size, grouped by which dims divide by which axis products.
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import sympy
import torch
from torch.export import Dim

from autopar.capture import capture
from autopar.dynamic.symbols import SymbolRange
from autopar.errors import AutoparError
from autopar.ir import Graph, Node, NodeKind, OpInfo, TensorArg, TensorMeta


class SymbolicGraph:
    """The step of ``model`` on inputs whose sizes ``symbols`` name."""

    def __init__(self, model, example_inputs: tuple, loss_fn, symbols: tuple[SymbolRange, ...]):
        self.symbols = tuple(symbols)
        self.sym = {s.name: sympy.Symbol(s.name, integer=True, positive=True) for s in symbols}
        specs: list = [None] * len(example_inputs)
        for s in symbols:
            d = Dim(s.name, min=s.lo, max=s.hi)
            for i, dim in s.dims:
                specs[i] = {**(specs[i] or {}), dim: d}
        try:
            self.graph = capture(model, example_inputs, loss_fn, dynamic_shapes=specs)
        except AutoparError as e:
            raise AutoparError(f"the model does not trace with symbolic sizes "
                               f"({', '.join(map(str, symbols))}): {e}") from e
        self._export = self._export_symbols()
        self._fx = {n.name: n for n in self.graph.gm.graph.nodes}
        self._shapes = {name: [self._shape(v) for v in self._values(name)] for name in self.graph.nodes}
        self.example = {s.name: self.graph.nodes[self._input(s.dims[0][0])].out.shape[s.dims[0][1]]
                        for s in symbols}
        self._degrees: dict = {}

    # --- the symbols -----------------------------------------------------
    def _input(self, index: int) -> str:
        return next(n.name for n in self.graph.nodes.values() if n.kind is NodeKind.INPUT and n.input_index == index)

    def _export_symbols(self) -> dict:
        """torch.export's symbol -> ours, read off the inputs' dims."""
        out = {}
        fx = {n.name: n for n in self.graph.gm.graph.nodes}
        for s in self.symbols:
            for i, d in s.dims:
                size = fx[self._input(i)].meta["val"].shape[d]
                expr = size.node.expr if isinstance(size, torch.SymInt) else sympy.Integer(size)
                if not isinstance(expr, sympy.Symbol):
                    raise AutoparError(
                        f"torch.export fixed input {i} dim {d} ({s.name}) to {expr}: the model's forward needs it "
                        "to be that size (a check or a branch on it), so it cannot vary; leave it out of dims")
                if out.get(expr, s.name) != s.name:
                    raise AutoparError(f"input {i} dim {d} is {out[expr]!r} in the traced step, not {s.name!r}")
                out[expr] = s.name
        return out

    def expr(self, size) -> sympy.Expr:
        """A size (int or SymInt) as an expression in our symbols."""
        if isinstance(size, torch.SymInt):
            e = sympy.sympify(size.node.expr)
            extra = e.free_symbols - set(self._export)
            if extra:
                raise AutoparError(f"a size of the traced step, {e}, depends on {sorted(map(str, extra))}, which "
                                   "are not declared symbols (a size computed from tensor values)")
            return e.xreplace({k: self.sym[v] for k, v in self._export.items()})
        return sympy.Integer(int(size))

    def _shape(self, value) -> tuple:
        return tuple(self.expr(s) for s in value.shape)

    def _values(self, name: str) -> list:
        """The fake tensors a node's outputs are (as capture read them)."""
        node = self.graph.nodes[name]
        if node.kind is NodeKind.OUTPUT:
            return [self._fx[a].meta["val"] if node.inputs else None for a in node.inputs]
        val = self._fx[name].meta["val"]
        vals = list(val) if isinstance(val, (tuple, list)) else [val]
        return [v for v in vals if isinstance(v, torch.Tensor)]

    def shape(self, name: str, k: int = 0) -> tuple:
        """Output ``k`` of node ``name``: a tuple of sympy expressions."""
        return self._shapes[name][k]

    def dim_expressions(self) -> list:
        """Every distinct size expression of the step that depends on a symbol."""
        seen = {}
        for shapes in self._shapes.values():
            for shape in shapes:
                for e in shape:
                    if e.free_symbols:
                        seen[e] = None
        return list(seen)

    def degree(self, name: str) -> int:
        """The degree in symbol ``name`` of the step's costs: of each op's FLOPs
        (``cost_models.graph_costs.op_flops``: an element count times a
        contracted size, a fused attention's queries times its keys) and of
        each tensor's size, read off their growth between sizes 2**k and 2**(k+1)
        times the example's (polynomials with nonnegative coefficients)."""
        if name not in self._degrees:
            from autopar.cost_models.graph_costs import op_flops
            base = {s.name: self.example[s.name] for s in self.symbols}
            graphs = [self.specialize({**base, name: base[name] * 2 ** k}) for k in (4, 5)]
            best = 1
            for n in self.graph.nodes:
                a, b = (g.nodes[n] for g in graphs)
                for fa, fb in ((op_flops(a), op_flops(b)) if a.kind is NodeKind.OP else (0, 0),
                               *((ma.nbytes, mb.nbytes) for ma, mb in zip(a.outputs, b.outputs))):
                    if fa > 0 and fb > fa:
                        best = max(best, math.ceil(math.log2(fb / fa) - 1e-6))
            self._degrees[name] = best
        return self._degrees[name]

    # --- concrete graphs -------------------------------------------------
    def values_of(self, inputs) -> dict:
        """The symbols' sizes in a batch of (global) inputs, and what is wrong with it, if anything."""
        values, problems = {}, []
        for s in self.symbols:
            seen = {tuple(inputs[i].shape)[d] for i, d in s.dims if i < len(inputs)
                    and isinstance(inputs[i], torch.Tensor) and inputs[i].dim() > d}
            if len(seen) != 1:
                problems.append(f"{s.name} is {sorted(seen)} in dims {list(s.dims)} (one size expected)")
                continue
            values[s.name] = seen.pop()
        return values if not problems else {"problem": "; ".join(problems)}

    def input_shapes(self, values: dict) -> list:
        """Each user input's global shape at ``values``."""
        inputs = sorted((n for n in self.graph.nodes.values() if n.kind is NodeKind.INPUT),
                        key=lambda n: n.input_index)
        env = {self.sym[k]: sympy.Integer(v) for k, v in values.items()}
        return [[int(e.xreplace(env)) for e in self.shape(n.name)] for n in inputs]

    def specialize(self, values: dict) -> Graph:
        """The step at sizes ``values`` (symbol -> int): the graph a static
        capture of those sizes gives, its ``gm`` the symbolic program."""
        missing = set(self.sym) - set(values)
        if missing:
            raise AutoparError(f"specialize needs a size for every symbol; missing {sorted(missing)}")
        env = {self.sym[k]: sympy.Integer(int(v)) for k, v in values.items()}
        cache: dict = {}

        def size(e) -> int:
            if e not in cache:
                cache[e] = int(e.xreplace(env))
            return cache[e]

        def arg(a):
            if isinstance(a, torch.SymInt):
                return size(self.expr(a))
            if isinstance(a, (tuple, list)):
                return type(a)(arg(x) for x in a)
            if isinstance(a, dict):
                return {k: arg(v) for k, v in a.items()}
            return a

        nodes: dict = {}
        for name, node in self.graph.nodes.items():
            outputs = [TensorMeta(tuple(size(e) for e in shape), meta.dtype)
                       for shape, meta in zip(self._shapes[name], node.outputs)]
            if node.kind is NodeKind.OUTPUT:
                outputs = [nodes[a].outputs[0] for a in node.inputs]
            info = None
            if node.info is not None:
                metas = [nodes[p].outputs[0] for p in node.inputs]  # what capture's OpInfo reads

                def lift(a):
                    if isinstance(a, TensorArg):
                        return TensorArg(a.index, metas[a.index])
                    if isinstance(a, (tuple, list)):
                        return type(a)(lift(x) for x in a)
                    if isinstance(a, dict):
                        return {k: lift(v) for k, v in a.items()}
                    return arg(a)

                info = OpInfo(node.info.target, lift(node.info.args), lift(node.info.kwargs), metas, outputs)
            nodes[name] = Node(node.name, node.kind, node.target, node.fqn, list(node.inputs), outputs, info,
                               node.input_index, node.state_update, node.item)
        g = self.graph
        return Graph(nodes, g.gm, g.params, g.buffers, g.n_inputs, g.has_loss, g.out_spec, dict(g.tied), g.training)


@dataclass(frozen=True)
class Lattice:
    """Sizes ``first[i] + step[i] * t`` for ``t`` in ``0 .. count[i] - 1``, per symbol:
    one residue class of the declared sizes, on which the rules offer the same strategies."""

    first: tuple
    step: tuple
    count: tuple

    def value(self, index: tuple) -> tuple:
        return tuple(f + s * t for f, s, t in zip(self.first, self.step, index))

    def index(self, values: tuple) -> tuple | None:
        """The index of ``values`` on this lattice, or None if they are not on it."""
        out = []
        for v, f, s, n in zip(values, self.first, self.step, self.count):
            t, r = divmod(v - f, s)
            if r or not 0 <= t < n:
                return None
            out.append(t)
        return tuple(out)

    @property
    def size(self) -> int:
        return math.prod(self.count)

    def describe(self, names: tuple) -> str:
        parts = []
        for name, f, s, n in zip(names, self.first, self.step, self.count):
            last = f + s * (n - 1)
            if n == 1:
                parts.append(f"{name} = {f}")
            elif s == 1:
                parts.append(f"{name} {f}..{last}")
            else:
                parts.append(f"{name} {f}..{last} step {s} ({name} = {f % s} mod {s})")
        return ", ".join(parts)


def lattices(sg: SymbolicGraph, mesh_shape: tuple) -> list[Lattice]:
    """The declared sizes cut into lattices on which every dim's divisibility by
    every product of mesh axes is the same (see the module's docstring)."""
    modulus = math.prod(mesh_shape)
    splits = sorted({math.prod(c) for r in range(1, len(mesh_shape) + 1)
                     for c in itertools.combinations(mesh_shape, r)} - {1})
    exprs = sg.dim_expressions()
    names = [s.name for s in sg.symbols]
    for e in exprs:
        if not e.is_polynomial(*sg.sym.values()) or any(not c.is_integer for c in sympy.Poly(e, *[sg.sym[n] for n in names]).coeffs()):
            # a floor division (s // 2) or a fraction: its divisibility needs a longer period
            modulus *= _denominators(e)
    symbols = sg.symbols
    # index t of a declared size: lo + step * t; its class depends on t modulo `modulus`
    period = [modulus if s.count > modulus else s.count for s in symbols]
    fns = [sympy.lambdify([sg.sym[n] for n in names], e, "math") for e in exprs]

    def pattern(ts: tuple) -> tuple:
        vs = [s.lo + s.step * t for s, t in zip(symbols, ts)]
        sizes = [int(f(*vs)) for f in fns]
        return tuple(size % k == 0 for size in sizes for k in splits)

    classes: dict = {}
    for ts in itertools.product(*[range(p) for p in period]):
        classes.setdefault(pattern(ts), []).append(ts)
    out = []
    for members in classes.values():
        out += _cover(set(members), period, symbols)
    return sorted(out, key=lambda lat: lat.first)


def _denominators(e) -> int:
    out = 1
    for a in sympy.preorder_traversal(e):
        if isinstance(a, sympy.Rational) and not a.is_integer:
            out = math.lcm(out, int(a.q))
        elif getattr(a, "func", None) is not None and a.func.__name__ in ("FloorDiv", "CleanDiv", "Mod", "PythonMod"):
            d = a.args[1]
            if d.is_Integer:
                out = math.lcm(out, int(d))
            else:
                raise AutoparError(f"a size of the step divides by a symbol ({e}); autopar plans sizes that are "
                                   "polynomials in the symbols, or divide them by constants")
    return out


def _cover(members: set, period: list, symbols) -> list[Lattice]:
    """The fewest coarse lattices (a residue modulo a divisor of the period, per
    symbol) that make up one class of index residues."""
    choices = [[(r, m) for m in _divisors(p) for r in range(m)] for p in period]
    candidates = sorted(itertools.product(*choices), key=lambda c: math.prod(m for _, m in c))
    out, left = [], set(members)
    for combo in candidates:
        if not left:
            break
        cells = set(itertools.product(*[range(r, p, m) for (r, m), p in zip(combo, period)]))
        if cells <= members and cells & left and cells <= left:
            left -= cells
            first, step, count = [], [], []
            for (r, m), s in zip(combo, symbols):
                first.append(s.lo + s.step * r)
                step.append(s.step * m)
                count.append(len(range(r, s.count, m)))
            if all(count):
                out.append(Lattice(tuple(first), tuple(step), tuple(count)))
    return out


def _divisors(n: int) -> list:
    return [d for d in range(1, n + 1) if n % d == 0]


__all__ = ["SymbolicGraph", "Lattice", "lattices"]
