"""Checks that the ranks of a job agree where they must: the model's initial
parameters and buffers, and in global-batch mode the batch.

Every rank builds the model and passes the batch itself; a rank seeded apart
before building the model, or fed by a sampler shuffled with its own seed,
would otherwise train on without a word and report a loss that matches no
single-device run (DDP broadcasts module state at construction for the same
reason). The check compares a fingerprint of each tensor with rank 0's: one
broadcast of every fingerprint, one all-gather of each rank's first mismatch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from autopar.errors import InputError, RankMismatchError

SAMPLE = 4096
"""Elements of a tensor weighted by position in its fingerprint (strided over it)."""

CHUNK = 1 << 24
"""Elements summed at a time."""

FIELDS = ("sum", "sum of squares", "position-weighted sample")


def fingerprint(t: torch.Tensor) -> torch.Tensor:
    """Three float64 numbers that differ between two tensors unless they are
    (almost surely) equal: the sum, the sum of squares, and a strided sample
    weighted by position (which sees a permutation). Summed in chunks, so a
    large embedding never has a float64 copy of itself."""
    if t.device.type == "meta" or t.numel() == 0:
        return torch.zeros(3, dtype=torch.float64)
    x = t.detach().reshape(-1)
    if x.is_complex():
        x = torch.view_as_real(x).reshape(-1)
    total = torch.zeros(2, dtype=torch.float64, device=x.device)
    for start in range(0, x.numel(), CHUNK):
        chunk = x[start:start + CHUNK].to(torch.float64)
        total += torch.stack([chunk.sum(), (chunk * chunk).sum()])
    sample = x[::max(1, x.numel() // SAMPLE)].to(torch.float64)
    weights = torch.arange(1, sample.numel() + 1, dtype=torch.float64, device=x.device)
    return torch.cat([total, (sample * weights).sum().reshape(1)]).cpu()


def same_state(model: torch.nn.Module, device: torch.device) -> None:
    """Raise ``RankMismatchError`` on every rank unless each holds rank 0's
    initial parameters and (persistent) buffers; non-persistent buffers take
    rank 0's values instead (``share_scratch``)."""
    scratch = scratch_buffers(model)
    entries = [(f"parameter {fqn!r}", p) for fqn, p in model.named_parameters()]
    entries += [(f"buffer {fqn!r}", b) for fqn, b in model.named_buffers() if fqn not in scratch]
    _check(entries, device, _state_advice)
    share_scratch(model, device, scratch)


def scratch_buffers(model: torch.nn.Module) -> set:
    """The non-persistent buffers (``register_buffer(..., persistent=False)``):
    left out of checkpoints, often scratch space or a cache made with
    ``torch.empty``, whose initial values may differ between ranks harmlessly."""
    return {f"{prefix}.{name}" if prefix else name
            for prefix, module in model.named_modules() for name in module._non_persistent_buffers_set}


def share_scratch(model: torch.nn.Module, device: torch.device, scratch: set) -> None:
    """Non-persistent buffers take rank 0's values, as DDP broadcasts module
    state: the ranks then agree whether the buffer is scratch or not."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    for fqn, b in model.named_buffers():
        if fqn in scratch and b.device.type != "meta":
            shared = b.detach().to(device).contiguous()
            dist.broadcast(shared, src=0)
            with torch.no_grad():
                b.copy_(shared)


def agree(problem: str | None) -> None:
    """Raise ``InputError`` on every rank if any rank found ``problem`` with
    the batch it was given (its own check, e.g. the number of inputs or their
    shapes). A rank that raised alone would leave the others waiting in the
    step's first collective until the process group's timeout."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        if problem:
            raise InputError(problem)
        return
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, problem)
    bad = [rank for rank, p in enumerate(everyone) if p]
    if bad:
        also = f" (rank(s) {', '.join(map(str, bad[1:]))} too)" if len(bad) > 1 else ""
        raise InputError(f"rank {bad[0]}: {everyone[bad[0]]}{also}")


def batch_problem(inputs, shapes: list, takes: str, shape_note: str) -> str | None:
    """What is wrong with a batch for a plan compiled for ``shapes``, if
    anything: the number of inputs (``takes`` says what the plan takes),
    a non-tensor, a shape (``shape_note`` follows the shape it was
    compiled for)."""
    if len(inputs) != len(shapes):
        return f"the plan takes {takes}, got {len(inputs)}"
    for i, (x, shape) in enumerate(zip(inputs, shapes)):
        if not isinstance(x, torch.Tensor):
            return f"input {i} is a {type(x).__name__}; the plan takes tensors"
        if list(x.shape) != list(shape):
            return f"input {i} has shape {list(x.shape)}; the plan was compiled for {list(shape)} {shape_note}"
    return None


def same_inputs(inputs, device: torch.device) -> None:
    """Raise ``RankMismatchError`` on every rank unless each passed rank 0's batch."""
    entries = [(f"input {i} (shape {list(x.shape)}, {x.dtype})", x)
               for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)]
    _check(entries, device, _input_advice)


def _state_advice(what: str, rank: int, values: str, more: str) -> str:
    return (f"rank {rank} holds a different initial {what} than rank 0 ({values}){more}. Every rank must "
            "start from the same parameters and buffers; the likely cause is a random seed that differs per rank "
            "when the model is built (e.g. torch.manual_seed(rank) before creating it). Fix: seed every rank alike "
            "(torch.manual_seed(0)) before building the model and seed per-rank things such as data "
            "augmentation afterwards, or load the same checkpoint on every rank")


def _input_advice(what: str, rank: int, values: str, more: str) -> str:
    return (f"rank {rank} passed a different {what} than rank 0 ({values}){more}. In global-batch mode "
            "(local_inputs=False, the default) every rank passes the whole global batch and the plan splits it; "
            "the likely cause is a data loader or sampler shuffled with a different seed per rank (e.g. a "
            "DistributedSampler, which gives each rank its own shard). Fix: pass local_inputs=True with each "
            "rank's own shard of the batch, or seed the data loader alike on every rank so that all pass the "
            "same batch")


def _check(entries: list, device: torch.device, advice) -> None:
    if not dist.is_initialized() or dist.get_world_size() == 1 or not _same_count(entries, device, advice):
        return
    mine = torch.stack([fingerprint(t) for _, t in entries]).to(device)
    ref = mine.clone()
    dist.broadcast(ref, src=0)
    differs = ~torch.isclose(mine, ref, rtol=1e-9, atol=1e-12, equal_nan=True).all(dim=1)
    bad = torch.nonzero(differs).flatten()
    first = int(bad[0]) if bad.numel() else -1
    row = mine[first] if first >= 0 else torch.zeros(3, dtype=torch.float64, device=device)
    report = torch.cat([torch.tensor([first, bad.numel()], dtype=torch.float64, device=device), row])
    gathered = [torch.empty_like(report) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, report)
    for rank, r in enumerate(gathered):
        index, count = int(r[0]), int(r[1])
        if index < 0:
            continue
        name = entries[index][0]
        values = "; ".join(f"{f} {a:.9g} on rank 0, {b:.9g} on rank {rank}"
                           for f, a, b in zip(FIELDS, ref[index].tolist(), r[2:].tolist()))
        more = f"; {count - 1} more tensor(s) differ on rank {rank}" if count > 1 else ""
        raise RankMismatchError(advice(name, rank, values, more))


def _same_count(entries: list, device: torch.device, advice) -> bool:
    """Whether there is anything to compare: raise on every rank unless each
    has as many tensors as rank 0 (else the fingerprints would not line up)."""
    counts = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(counts, torch.tensor([len(entries)], dtype=torch.int64, device=device))
    counts = [int(c) for c in counts]
    for rank, n in enumerate(counts):
        if n != counts[0] and advice is _state_advice:
            raise RankMismatchError(
                f"rank {rank} holds {n} parameters and buffers, rank 0 holds {counts[0]}: the ranks built different "
                "models. Every rank must build the same model (the same code and configuration) before it is "
                "parallelized")
        if n != counts[0]:
            raise RankMismatchError(
                f"rank {rank} passed {n} tensor inputs, rank 0 passed {counts[0]}. In global-batch mode "
                "(local_inputs=False, the default) every rank passes the same whole batch")
    return counts[0] > 0
