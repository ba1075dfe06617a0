"""The ``dynamic`` section of plan.json (schema autopar.plan/2), read and checked.

    "dynamic": {
      "symbols": [{"name": "batch", "lo": 1, "hi": 1024, "step": 1, "dims": [[0, 0], [1, 0]]}],
      "example": {"batch": 8},
      "pieces": [
        {"lattice": {"first": [4], "step": [4], "count": [256]},      sizes first + step * t
         "box": [[0, 59]],                                            t from .. to, per symbol
         "where": "batch 4..240 step 4 (batch = 0 mod 4)",
         "point": {"batch": 4},                                       the sizes its plan was solved at
         "plan": {...},                                               that plan (a whole plan.json body)
         "expressions": {"step_time_s": "2.8e-6*batch + 0.00036", ...}},
        ...],
      "search": {"probes": 9, "prices": 120, "lattices": 3, "wall_s": 12.1}
    }

Every declared size lies on exactly one lattice, and in at most one piece's
box there; ``Dynamic.piece`` finds it. The top-level plan is the piece of the
example sizes.
"""
from __future__ import annotations

import sympy

from autopar.dynamic.graph import Lattice
from autopar.dynamic.symbols import SymbolRange
from autopar.errors import InputError, PlanError


class Dynamic:
    """The dynamic section of ``plan`` (a Plan), with the pieces' plans parsed when first asked for."""

    def __init__(self, plan):
        obj = plan.dynamic
        if obj is None:
            raise PlanError("the plan was compiled for one size; it has no pieces (compile with dynamic=...)")
        self._read = type(plan).from_json
        self.obj = obj
        self.symbols = tuple(SymbolRange.from_json(s) for s in obj["symbols"])
        self.names = tuple(s.name for s in self.symbols)
        self.pieces = obj["pieces"]
        self.lattices = [Lattice(tuple(p["lattice"]["first"]), tuple(p["lattice"]["step"]),
                                 tuple(p["lattice"]["count"])) for p in self.pieces]
        self._plans: dict = {}

    def piece(self, values: dict) -> int:
        """The index of the piece for sizes ``values``; an InputError says why none is."""
        point = tuple(values[n] for n in self.names)
        for s, v in zip(self.symbols, point):
            if v not in s:
                raise InputError(f"{s.name} = {v} is outside the sizes this plan was compiled for "
                                 f"({s.describe()}): compile it for a range that includes {v} "
                                 "(dynamic=...), or pass fallback='compile' to compile such sizes when they come")
        for i, (p, lat) in enumerate(zip(self.pieces, self.lattices)):
            index = lat.index(point)
            if index is not None and all(lo <= t <= hi for t, (lo, hi) in zip(index, p["box"])):
                return i
        raise PlanError(f"no piece of the plan covers {values}; the plan file was edited or is corrupt: recompile it")

    def plan(self, i: int):
        """Piece ``i``'s plan."""
        if i not in self._plans:
            self._plans[i] = self._read(self.pieces[i]["plan"])
        return self._plans[i]

    def point(self, i: int) -> dict:
        return dict(self.pieces[i]["point"])

    def expression(self, i: int, component: str = "step_time_s") -> sympy.Expr:
        return sympy.sympify(self.pieces[i]["expressions"][component], locals=self.locals())

    def locals(self) -> dict:
        return {n: sympy.Symbol(n, integer=True, positive=True) for n in self.names}

    def ranges(self, i: int) -> dict:
        """Piece ``i``'s sizes, per symbol: (lowest, highest, step)."""
        p, lat = self.pieces[i], self.lattices[i]
        return {n: (f + s * lo, f + s * hi, s) for n, f, s, (lo, hi) in zip(self.names, lat.first, lat.step, p["box"])}


def check(obj, mesh, read) -> None:
    """The dynamic section is well formed: symbols, lattices and boxes that
    fit them, a plan per piece on the same mesh (``read``: Plan.from_json),
    expressions sympy reads."""
    _require(isinstance(obj, dict) and all(k in obj for k in ("symbols", "example", "pieces")),
             f"plan field 'dynamic' must be null or an object with symbols, example and pieces, got {obj!r:.80}")
    try:
        symbols = [SymbolRange.from_json(s) for s in obj["symbols"]]
    except (KeyError, TypeError) as e:
        raise PlanError(f"plan field 'dynamic.symbols' is invalid ({e}); each needs name, lo, hi, step, dims") from None
    except Exception as e:  # SymbolRange validates itself
        raise PlanError(f"plan field 'dynamic.symbols': {e}") from None
    names = [s.name for s in symbols]
    _require(isinstance(obj["pieces"], list) and obj["pieces"], "plan field 'dynamic.pieces' must be a non-empty list")
    for i, p in enumerate(obj["pieces"]):
        where = f"plan field dynamic.pieces[{i}]"
        _require(isinstance(p, dict) and all(k in p for k in ("lattice", "box", "point", "plan", "expressions")),
                 f"{where} needs lattice, box, point, plan and expressions")
        lat = p["lattice"]
        _require(isinstance(lat, dict) and all(isinstance(lat.get(k), list) and len(lat[k]) == len(names)
                                               for k in ("first", "step", "count")),
                 f"{where}.lattice needs first, step and count, one number per symbol {names}")
        _require(isinstance(p["box"], list) and len(p["box"]) == len(names)
                 and all(isinstance(b, list) and len(b) == 2 and 0 <= b[0] <= b[1] < n
                         for b, n in zip(p["box"], lat["count"])),
                 f"{where}.box must give a (first, last) index on the lattice per symbol, within its count")
        for s, f, st, n in zip(symbols, lat["first"], lat["step"], lat["count"]):
            _require(f in s and (f + st * (n - 1)) in s and st % s.step == 0,
                     f"{where}.lattice: {s.name} from {f} in steps of {st} ({n} sizes) leaves the declared "
                     f"{s.describe()}")
        _require(isinstance(p["point"], dict) and set(p["point"]) == set(names),
                 f"{where}.point must give a size for each symbol {names}")
        _require(isinstance(p["plan"], dict) and p["plan"].get("mesh", {}).get("shape") == list(mesh.shape),
                 f"{where}.plan must be a plan for the mesh {list(mesh.shape)}")
        _require(p["plan"].get("dynamic") is None, f"{where}.plan must be a plan of one size (dynamic null)")
        try:
            read(p["plan"])
        except PlanError as e:
            raise PlanError(f"{where}.plan: {e}") from None
        for k, text in p["expressions"].items():
            try:
                sympy.sympify(text, locals={n: sympy.Symbol(n) for n in names})
            except (sympy.SympifyError, TypeError, SyntaxError) as e:
                raise PlanError(f"{where}.expressions.{k} is not an expression sympy reads ({e})") from None


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise PlanError(message + "; recompile the plan rather than editing it by hand")


__all__ = ["Dynamic", "check"]
