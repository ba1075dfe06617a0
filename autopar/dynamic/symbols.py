"""The symbols a dynamic compile plans over: a name, the sizes it takes, and
the input dims it names.

    dynamic={"batch": (1, 1024)}               every size from 1 to 1024
    dynamic={"batch": (4, 1024, 4)}            4, 8, ..., 1024 (also range(4, 1025, 4))
    dims={"seq": [(0, 1), (1, 1)]}             which (input, dim) pairs a symbol names

Without ``dims``, a symbol named ``batch`` names dim 0 and ``seq`` dim 1 of
every example input that has that dim at the size input 0 has there (the
batch-first layout of a DataLoader's batches); any other name needs ``dims``.
On the command line: ``--dynamic batch=4..1024:4`` and ``--dims seq=0.1,1.1``.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from autopar.errors import AutoparError

CONVENTIONAL_DIMS = {"batch": 0, "seq": 1}
"""The dim a symbol of this name names by default in every input (batch-first)."""


@dataclass(frozen=True)
class SymbolRange:
    """A symbolic size: ``lo, lo + step, ..., hi`` (``hi`` is on the lattice), named
    ``name``, standing for dims ``dims`` ((input index, dim) pairs)."""

    name: str
    lo: int
    hi: int
    step: int = 1
    dims: tuple = ()

    def __post_init__(self):
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", self.name):
            raise AutoparError(f"dynamic symbol name {self.name!r} must be an identifier like 'batch' or 'seq'")
        for what, v in (("lowest size", self.lo), ("highest size", self.hi), ("step", self.step)):
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise AutoparError(f"dynamic symbol {self.name!r}: the {what} must be a positive integer, "
                                   f"got {v!r}")
        if self.hi < self.lo:
            raise AutoparError(f"dynamic symbol {self.name!r}: range {self.lo}..{self.hi} is empty; "
                               "give (lowest, highest) with lowest <= highest")
        if (self.hi - self.lo) % self.step:
            raise AutoparError(f"dynamic symbol {self.name!r}: {self.hi} is not {self.lo} plus a multiple of the "
                               f"step {self.step}; the highest size on that lattice is "
                               f"{self.lo + (self.hi - self.lo) // self.step * self.step}")

    def __contains__(self, value: int) -> bool:
        return self.lo <= value <= self.hi and (value - self.lo) % self.step == 0

    @property
    def count(self) -> int:
        return (self.hi - self.lo) // self.step + 1

    def __str__(self) -> str:
        return f"{self.name}={self.lo}..{self.hi}" + (f":{self.step}" if self.step != 1 else "")

    def describe(self) -> str:
        """What sizes it takes, in words, for messages."""
        if self.step == 1:
            return f"{self.name} from {self.lo} to {self.hi}"
        return f"{self.name} from {self.lo} to {self.hi} in steps of {self.step}"

    def to_json(self) -> dict:
        return {"name": self.name, "lo": self.lo, "hi": self.hi, "step": self.step,
                "dims": [list(d) for d in self.dims]}

    @classmethod
    def from_json(cls, obj: dict) -> "SymbolRange":
        return cls(obj["name"], obj["lo"], obj["hi"], obj.get("step", 1), tuple(tuple(d) for d in obj["dims"]))


_RANGE = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*=\s*(\d+)\s*\.\.\s*(\d+)\s*(?::\s*(\d+))?\s*$")


def parse_range(text: str) -> tuple[str, tuple]:
    """``"batch=4..32"`` or ``"batch=4..1024:4"`` -> ("batch", (4, 32[, 4]))."""
    m = _RANGE.match(text)
    if not m:
        raise AutoparError(f"--dynamic {text!r} is not NAME=LOW..HIGH or NAME=LOW..HIGH:STEP, e.g. batch=4..32 "
                           "or batch=4..1024:4")
    name, lo, hi, step = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
    return name, (lo, hi) if step is None else (lo, hi, int(step))


def parse_dims(text: str) -> tuple[str, list]:
    """``"seq=0.1,1.1"`` -> ("seq", [(0, 1), (1, 1)])."""
    name, _, rest = text.partition("=")
    try:
        pairs = [tuple(int(x) for x in item.split(".")) for item in rest.split(",")]
        if not name.strip() or any(len(p) != 2 for p in pairs):
            raise ValueError
    except ValueError:
        raise AutoparError(f"--dims {text!r} is not NAME=INPUT.DIM[,INPUT.DIM...], e.g. seq=0.1,1.1 (dim 1 of "
                           "inputs 0 and 1)") from None
    return name.strip(), pairs


def resolve(dynamic, dims, example_inputs) -> tuple[SymbolRange, ...]:
    """The symbols ``dynamic`` declares, each with the input dims it names,
    checked against the example inputs (which must lie in the ranges)."""
    if not isinstance(dynamic, dict) or not dynamic:
        raise AutoparError(f"dynamic must be a dict of symbol -> (lowest, highest[, step]), like "
                           f"{{'batch': (4, 32)}}, got {dynamic!r:.80}")
    dims = dict(dims or {})
    unknown = sorted(set(dims) - set(dynamic))
    if unknown:
        raise AutoparError(f"dims names {unknown}, which dynamic does not declare ({sorted(dynamic)})")
    shapes = [tuple(x.shape) if isinstance(x, torch.Tensor) else None for x in example_inputs]
    out, taken = [], {}
    for name, spec in dynamic.items():
        lo, hi, step = _bounds(name, spec)
        where = _dims(name, dims.get(name), shapes)
        sizes = {shapes[i][d] for i, d in where}
        if len(sizes) != 1:
            raise AutoparError(f"dynamic symbol {name!r} names dims {where} whose example sizes differ "
                               f"({sorted(sizes)}); one symbol is one size")
        size = sizes.pop()
        symbol = SymbolRange(name, lo, hi, step, tuple(where))
        if size not in symbol:
            raise AutoparError(f"the example inputs have {name} = {size} (dims {where}), which is not among the "
                               f"sizes dynamic declares ({symbol.describe()}): pass example inputs of a size "
                               "in the range")
        for pair in where:
            if pair in taken:
                raise AutoparError(f"input {pair[0]} dim {pair[1]} is named by both {taken[pair]!r} and {name!r}")
            taken[pair] = name
        out.append(symbol)
    return tuple(out)


def _bounds(name: str, spec) -> tuple[int, int, int]:
    if isinstance(spec, range):
        if not spec or spec.step < 1:
            raise AutoparError(f"dynamic symbol {name!r}: {spec!r} is empty or runs backwards")
        return spec.start, spec[-1], spec.step
    if isinstance(spec, (tuple, list)) and len(spec) in (2, 3):
        return spec[0], spec[1], spec[2] if len(spec) == 3 else 1
    raise AutoparError(f"dynamic symbol {name!r}: {spec!r:.60} is not (lowest, highest), (lowest, highest, step) "
                       "or a range")


def _dims(name: str, given, shapes: list) -> list:
    if given is None:
        if name not in CONVENTIONAL_DIMS:
            raise AutoparError(
                f"dynamic symbol {name!r}: say which input dims it names, e.g. dims={{{name!r}: [(0, 1), (1, 1)]}} "
                f"(dim 1 of inputs 0 and 1; on the command line --dims {name}=0.1,1.1); only "
                f"{sorted(CONVENTIONAL_DIMS)} have a default (dims {CONVENTIONAL_DIMS} of every input)")
        d = CONVENTIONAL_DIMS[name]
        if shapes[0] is None or len(shapes[0]) <= d:
            raise AutoparError(f"dynamic symbol {name!r} names dim {d} of the inputs by default, but input 0 has "
                               f"shape {shapes[0]}; say which dims it names with dims={{{name!r}: [...]}}")
        return [(i, d) for i, s in enumerate(shapes) if s is not None and len(s) > d and s[d] == shapes[0][d]]
    where = []
    for pair in given:
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(v, int) for v in pair)):
            raise AutoparError(f"dims[{name!r}]: {pair!r} is not an (input index, dim) pair")
        i, d = pair
        if not 0 <= i < len(shapes) or shapes[i] is None:
            raise AutoparError(f"dims[{name!r}]: input {i} is not one of the {len(shapes)} tensor inputs")
        if not 0 <= d < len(shapes[i]):
            raise AutoparError(f"dims[{name!r}]: input {i} has shape {list(shapes[i])}, no dim {d}")
        where.append((i, d))
    if not where:
        raise AutoparError(f"dims[{name!r}] is empty; name at least one (input, dim) pair")
    return where


__all__ = ["SymbolRange", "resolve", "parse_range", "parse_dims", "CONVENTIONAL_DIMS"]
