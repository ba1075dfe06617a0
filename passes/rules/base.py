"""The op-rule registry: ``register`` / ``get_rule`` and the table of rules.
The rules themselves (the other modules of this package) read the graph IR's
``OpInfo`` (autopar/ir.py) and register here; ``autopar.passes.rules``
re-exports the registry with every rule loaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from autopar.errors import AutoparError
from autopar.ir import op_label


@dataclass(frozen=True)
class Rule:
    fn: Callable
    matmul: bool = False
    """Costed as a GEMM (FLOPs at GEMM efficiency) rather than a memory-bound op."""


class ReplicatedOnly(AutoparError):
    """Raised by a rule when no split of its op is exact for the arguments
    given (the message says why): the op runs replicated, and the compiler
    warns with that reason as it does for an op without a rule."""


_RULES: dict = {}


def register(*targets, matmul: bool = False):
    """Register ``fn`` as the rule of ``targets``: ATen ops, or the names of
    ops a library defines when it is imported (``"transformers.
    grouped_mm_fallback.default"``, as ``str`` prints the op), which need not
    exist when autopar is imported."""
    def wrap(fn):
        for t in targets:
            if t in _RULES:
                raise AutoparError(f"a sharding rule for {t} is already registered ({_RULES[t].fn.__name__})")
            _RULES[t] = Rule(fn, matmul=matmul)
        return fn
    return wrap


def get_rule(target) -> Rule | None:
    rule = _RULES.get(target)
    if rule is None and isinstance(target, torch._ops.OpOverload):
        rule = _RULES.get(str(target))  # a library's op, registered by name
    return rule


def registered_ops() -> list:
    return sorted(str(t) for t in _RULES)


def rule_table() -> list:
    """(module, rule function, its ops as plans name them), by module and rule name."""
    by_fn: dict = {}
    for target, rule in _RULES.items():
        by_fn.setdefault(rule.fn, []).append(op_label(target))
    rows = [(fn.__module__.rsplit(".", 1)[-1], fn, sorted(ops)) for fn, ops in by_fn.items()]
    return sorted(rows, key=lambda r: (r[0], r[1].__name__))
