"""The graph IR every pass reads: the captured step as ``Graph`` of ``Node``s,
each op's ``OpInfo`` (its tensor inputs' and outputs' ``TensorMeta`` and its
other arguments). Capture (autopar/capture.py) builds it; the sharding rules
(passes/rules/), the cost model, the solver and codegen read it. It imports
nothing of autopar, so none of them import each other for it.
"""
from __future__ import annotations

import hashlib
import operator
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.fx as fx


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple
    dtype: torch.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


class TensorArg:
    """Stands for the i-th tensor input inside ``OpInfo.args``."""

    __slots__ = ("index", "meta")

    def __init__(self, index: int, meta: TensorMeta):
        self.index, self.meta = index, meta

    def __repr__(self):
        return f"TensorArg({self.index}, {self.meta.shape})"


@dataclass
class OpInfo:
    target: object
    args: tuple
    kwargs: dict
    inputs: list  # list[TensorMeta], tensor inputs in order of appearance
    outputs: list  # list[TensorMeta]

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]

    def arg(self, i: int, name: str, default=None):
        """Positional argument i, or keyword ``name``, or ``default``."""
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)


def op_label(target) -> str:
    """How plans name an op: "linear", "transpose.int", "getitem"."""
    if target is operator.getitem:
        return "getitem"
    return str(target).replace("aten.", "").replace(".default", "")


class NodeKind(str, Enum):
    PARAM = "param"
    BUFFER = "buffer"
    INPUT = "input"
    CONSTANT = "constant"
    OP = "op"
    OUTPUT = "output"


@dataclass
class Node:
    name: str
    kind: NodeKind
    target: object = None
    fqn: str = ""
    """Parameter/buffer name, or the module path the op was called from."""
    inputs: list = field(default_factory=list)
    """Producer node names, one per tensor input (in argument order)."""
    outputs: list = field(default_factory=list)
    """TensorMeta of each tensor output (one, or several for split-like ops)."""
    info: OpInfo | None = None
    input_index: int = -1
    """Position among the user inputs, for INPUT nodes."""
    state_update: bool = False
    """An in-place op on a buffer (``updates_state``)."""
    item: int = -1
    """For a ``getitem``: which output of its producer it takes."""

    @property
    def op_name(self) -> str:
        return op_label(self.target) if self.kind is NodeKind.OP else self.kind.value

    @property
    def out(self) -> TensorMeta:
        return self.outputs[0]


_PLACEMENT_KWARGS = ("device", "pin_memory", "layout")
"""Arguments of a factory op (``arange``, ``full``) that say where a tensor
lives, not what it is: the same model on meta or on a device is one graph."""


@dataclass
class Graph:
    nodes: dict  # name -> Node, in topological order
    gm: fx.GraphModule
    params: dict  # fqn -> placeholder name
    buffers: dict
    n_inputs: int
    has_loss: bool
    out_spec: str = ""
    """The output pytree structure (torch.utils._pytree.treespec_dumps)."""
    tied: dict = field(default_factory=dict)
    """Parameter placeholder -> the placeholder of the same tensor under its
    first name (tied weights, e.g. an LM head sharing the embedding)."""
    training: bool = True
    """The model's mode when traced: the graph bakes it in (dropout, batch norm)."""

    def fingerprint(self) -> str:
        """What a plan depends on, node by node: op, module path or parameter
        name, inputs, output shapes and dtypes, and the op's other arguments
        (dims, scalars); not the device a tensor lives on (meta, cpu, cuda)."""
        h = hashlib.sha256()
        for n in self.nodes.values():
            args = ""
            if n.info is not None:
                kwargs = {k: v for k, v in n.info.kwargs.items() if k not in _PLACEMENT_KWARGS}
                args = f"{n.info.args!r}|{sorted(kwargs.items())!r}"
            outs = [(m.shape, str(m.dtype)) for m in n.outputs]
            h.update(f"{n.name}|{n.op_name}|{n.fqn}|{n.inputs}|{outs}|{args}\n".encode())
        return h.hexdigest()[:16]

    def consumers(self) -> dict:
        out = {name: [] for name in self.nodes}
        for n in self.nodes.values():
            for i, src in enumerate(n.inputs):
                out[src].append((n.name, i))
        return out
