"""The logical device mesh a plan uses: a shape and one name per axis."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from autopar.errors import MeshError

_DEFAULT_NAMES = ("x", "y", "z", "w")


@dataclass(frozen=True)
class Mesh:
    """An N-D logical mesh. Ranks are laid out row-major: the last axis is the
    innermost (consecutive ranks), so it is the one that lands inside a node."""

    shape: tuple[int, ...]
    names: tuple[str, ...]

    def __post_init__(self):
        if not self.shape:
            raise MeshError("mesh shape is empty; give at least one axis, e.g. (4,) or '2x2'")
        for size in self.shape:
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise MeshError(
                    f"mesh shape {self.shape!r}: every axis size must be a positive integer, got {size!r}"
                )
        if len(self.names) != len(self.shape):
            raise MeshError(
                f"mesh names {self.names!r} do not match shape {self.shape!r}: one name per axis"
            )
        if len(set(self.names)) != len(self.names):
            raise MeshError(f"mesh axis names {self.names!r} must be distinct")
        for name in self.names:
            if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
                raise MeshError(f"mesh axis name {name!r} must be an identifier like 'dp' or 'tp'")

    @property
    def size(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __str__(self) -> str:
        return " x ".join(f"{n}={s}" for n, s in zip(self.names, self.shape))

    def to_json(self) -> dict:
        return {"shape": list(self.shape), "axis_names": list(self.names)}

    @classmethod
    def from_json(cls, obj: dict) -> "Mesh":
        return cls(tuple(obj["shape"]), tuple(obj["axis_names"]))


def parse_mesh(spec, names=None) -> Mesh:
    """Accepts (2, 2), 4, '2x2', 'dp=2,tp=2', {'dp': 2, 'tp': 2} or a Mesh."""
    if isinstance(spec, Mesh):
        return spec
    if isinstance(spec, dict):
        return Mesh(tuple(spec.values()), tuple(spec.keys()))
    if isinstance(spec, int) and not isinstance(spec, bool):
        spec = (spec,)
    if isinstance(spec, str):
        text = spec.strip()
        if "=" in text:
            pairs = [p.split("=", 1) for p in text.split(",")]
            try:
                sizes = tuple(int(v) for _, v in pairs)
            except ValueError:
                raise MeshError(f"mesh {spec!r}: expected 'name=size,...' like 'dp=2,tp=4'") from None
            return Mesh(sizes, tuple(k.strip() for k, _ in pairs))
        parts = re.split(r"[x,*]", text.lower())
        try:
            spec = tuple(int(p) for p in parts)
        except ValueError:
            raise MeshError(
                f"mesh {spec!r}: expected sizes joined by 'x' like '4' or '2x2', or 'dp=2,tp=2'"
            ) from None
        for size in spec:
            if size < 1:
                raise MeshError(
                    f"mesh {text!r}: axis size {size} is not a positive integer; "
                    "every axis needs at least 1 device, e.g. '2x2'"
                )
    if isinstance(spec, (tuple, list)):
        shape = tuple(spec)
        if names is None:
            if len(shape) > len(_DEFAULT_NAMES):
                raise MeshError(f"mesh {shape!r} has more than {len(_DEFAULT_NAMES)} axes; name them")
            names = _DEFAULT_NAMES[: len(shape)]
        return Mesh(shape, tuple(names))
    raise MeshError(f"mesh {spec!r}: expected a tuple of sizes, a string like '2x2', or a dict")
