"""Optimizer state in host memory (ZeRO-Offload, Ren et al. 2021, sec. 4).

A plan marks parameters ``"offload": true`` where device memory binds
(graph_costs.host_bytes, offload_time). For those, ``OffloadOptimizer`` keeps
a host copy of the rank's shard, its gradient buffer and the optimizer's
state in host memory (pinned on CUDA, so the copies are DMA transfers), and
runs the user's optimizer class there: each step copies the gradient to the
host, updates the host copy, and copies the new values back into the
device's shard. The other parameters are updated on the device by a second
instance of the same class. On a CPU rank host and device are one memory;
the same copies run, so the path is exercised and checked (verify) here too.

Built by ``ParallelModule.optimizer(torch.optim.AdamW, lr=...)``. An
ordinary optimizer built on ``pmodel.parameters()`` would keep the state of
offloaded parameters on the device: stepping one warns, once, naming the fix.
"""
from __future__ import annotations

import warnings
import weakref

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

_OFFLOADED: dict = {}
"""id -> weak reference of the device shards whose plan keeps their optimizer
state on the host (by identity: tensors compare by value)."""
_WARNED: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()
_HOOK = None


def mark_offloaded(params) -> None:
    """Register device shards the plan offloads (checked when an optimizer steps them)."""
    global _HOOK
    for p in params:
        _OFFLOADED[id(p)] = weakref.ref(p)
    if _HOOK is None:
        _HOOK = register_optimizer_step_pre_hook(_check_offloaded)


def is_offloaded(p: torch.Tensor) -> bool:
    ref = _OFFLOADED.get(id(p))
    return ref is not None and ref() is p


def _check_offloaded(optimizer, args, kwargs) -> None:
    if isinstance(optimizer, OffloadOptimizer) or optimizer in _WARNED or not _OFFLOADED:
        return
    if any(is_offloaded(p) for g in optimizer.param_groups for p in g["params"]):
        _WARNED.add(optimizer)
        warnings.warn(f"{type(optimizer).__name__} updates parameters whose plan keeps their optimizer state in "
                      "host memory (\"offload\": true) on the device instead, in device memory the plan did not "
                      "budget; build it with pmodel.optimizer(torch.optim.AdamW, lr=...)", stacklevel=3)


class OffloadOptimizer(torch.optim.Optimizer):
    """``optimizer_class`` over ``params``, with the parameters in
    ``offloaded`` updated in host memory. Its ``param_groups`` are the
    device parameters' groups, as given: a learning-rate scheduler (or
    anything else) that changes their hyperparameters changes both updates."""

    def __init__(self, params, optimizer_class, **defaults):
        """``params``: tensors or param groups, as for ``optimizer_class``;
        those registered by ``mark_offloaded`` are updated on the host."""
        super().__init__(params, defaults)
        self.optimizer_class = optimizer_class
        self._pinned = False
        self._pairs = []  # (device shard, host copy)
        host_groups, device_groups, self._inner = [], [], []
        for group in self.param_groups:
            hyper = {k: v for k, v in group.items() if k != "params"}
            host, device = [], []
            for p in group["params"]:
                if is_offloaded(p):
                    copy = self._host_copy(p)
                    self._pairs.append((p, copy))
                    host.append(copy)
                else:
                    device.append(p)
            pair = [{**hyper, "params": host}, {**hyper, "params": device}]
            host_groups.append(pair[0])
            device_groups.append(pair[1])
            self._inner.append(group)
        self.host = optimizer_class([g for g in host_groups if g["params"]], **defaults) \
            if any(g["params"] for g in host_groups) else None
        self.device = optimizer_class([g for g in device_groups if g["params"]], **defaults) \
            if any(g["params"] for g in device_groups) else None
        # each outer group's counterparts, as the inner optimizers keep them
        inner = {"host": iter(self.host.param_groups if self.host else []),
                 "device": iter(self.device.param_groups if self.device else [])}
        self._inner = [(outer, [next(inner[k]) for k, g in (("host", h), ("device", d)) if g["params"]])
                       for outer, h, d in zip(self._inner, host_groups, device_groups)]

    def _host_copy(self, p: torch.Tensor) -> torch.Tensor:
        copy = p.detach().to("cpu", copy=True)
        if p.is_cuda:
            copy = copy.pin_memory()
            self._pinned = True
        return copy

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for outer, inner in self._inner:
            for g in inner:
                g.update({k: v for k, v in outer.items() if k != "params"})
        for p, copy in self._pairs:
            if p.grad is None:
                copy.grad = None
                continue
            if copy.grad is None:
                copy.grad = torch.empty_like(copy, pin_memory=self._pinned)
            copy.grad.copy_(p.grad, non_blocking=True)
        if self._pinned:
            torch.cuda.current_stream().synchronize()  # the gradients are on the host
        if self.device is not None:
            self.device.step()
        if self.host is not None:
            self.host.step()
        for p, copy in self._pairs:
            p.copy_(copy, non_blocking=True)
        return loss

    def state_dict(self):
        return {"host": self.host.state_dict() if self.host else None,
                "device": self.device.state_dict() if self.device else None}

    def load_state_dict(self, state_dict):
        for name in ("host", "device"):
            inner = getattr(self, name)
            if (inner is None) != (state_dict.get(name) is None):
                raise ValueError(f"optimizer state has {'no' if state_dict.get(name) is None else 'a'} {name} part, "
                                 f"but this optimizer {'has' if inner is not None else 'has none'}: it was saved "
                                 "under another plan's offload choices")
            if inner is not None:
                inner.load_state_dict(state_dict[name])
