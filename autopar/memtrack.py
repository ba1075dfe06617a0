"""Measure the live tensor bytes of one process over a training step.

A TorchDispatchMode sees every tensor an op creates; each storage is counted
once, from creation until it is freed (a weakref finalizer), and the peak is
kept. Tensors that existed before tracking started (the model's parameters,
the batch) are added by ``track(*tensors)``. Works on CPU, where no allocator
statistics exist; it counts what PyTorch keeps alive, not allocator slack.
"""
from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._seen: dict = {}

    def track(self, *tensors) -> None:
        for t in tree_leaves(tensors):
            if isinstance(t, torch.Tensor):
                self._add(t)

    def _add(self, t: torch.Tensor) -> None:
        if type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter):
            inner = getattr(t, "_local_tensor", None)  # DTensor: count its local shard
            if inner is not None:
                self._add(inner)
            return
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key == 0 or key in self._seen:
            return
        size = storage.nbytes()
        self._seen[key] = size
        self.live += size
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, key)

    def _free(self, key) -> None:
        self.live -= self._seen.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._add(t)
        return out
