"""Solves in forked processes: independent ILPs at once (``in_parallel``:
the recomputation options, a pipeline search's stage submeshes), and one
call beside the caller whose answer may be waited for or dropped
(``Background``: the ILP's rival solve, solver._ILP.solve). Forked, not
spawned: the children inherit the traced graph and the built model instead
of pickling them."""
from __future__ import annotations

import multiprocessing
import os
import sys

from autopar.errors import InfeasibleError

SOLVE_WORKERS = int(os.environ.get("AUTOPAR_SOLVE_WORKERS", os.cpu_count() or 1))
"""Processes that solve independent ILPs at once, and above 1 the rival
solve beside the first (solver._ILP.solve); ``AUTOPAR_SOLVE_WORKERS=1``
solves them one after another."""

_FORKED: dict = {}  # what forked workers solve: set before the fork, read in the child


def may_fork(workers: int) -> bool:
    """Whether ``workers`` processes may solve at once here: fork only where
    it is the platform's default (Linux: macOS frameworks do not survive it),
    and never a process in a process group."""
    import torch.distributed as dist
    return workers >= 2 and sys.platform.startswith("linux") and not (dist.is_available() and dist.is_initialized())


def in_parallel(fn, items: list) -> list:
    """``[fn(x) for x in items]``, in forked worker processes where more than
    one core is free; ``fn`` returns a Solution or an InfeasibleError. The
    results are in order, the same as solving them one by one."""
    workers = min(SOLVE_WORKERS, len(items))
    if not may_fork(workers):
        return [fn(x) for x in items]
    from concurrent.futures import ProcessPoolExecutor
    _FORKED["fn"], _FORKED["items"] = fn, items
    try:
        with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
            out = list(pool.map(_forked_solve, range(len(items))))
    finally:
        _FORKED.clear()
    return [InfeasibleError(r[1], needed_bytes=r[2]) if isinstance(r, tuple) else r for r in out]


def _forked_solve(i: int):
    _FORKED["worker"] = True  # a worker starts no Background of its own: the cores are taken
    out = _FORKED["fn"](_FORKED["items"][i])
    if isinstance(out, InfeasibleError):  # sent back as plain values
        return ("infeasible", str(out), out.needed_bytes)
    return out


class Background:
    """``target(*args)`` run in a forked process at ``nice`` 5 (speculative
    work: where the cores are oversubscribed, the caller's goes first), its
    return value sent back. Started only where ``may_fork`` allows
    ``SOLVE_WORKERS`` processes, and not inside an ``in_parallel`` worker."""

    def __init__(self, process, conn):
        self.process, self.conn = process, conn

    @classmethod
    def start(cls, target, *args) -> "Background | None":
        if _FORKED.get("worker") or not may_fork(SOLVE_WORKERS):
            return None
        ctx = multiprocessing.get_context("fork")
        ours, theirs = ctx.Pipe(duplex=False)
        process = ctx.Process(target=_run, args=(target, args, theirs), daemon=True)
        process.start()
        theirs.close()
        return cls(process, ours)

    def answer(self, timeout_s: float):
        """Its return value, waited for at most ``timeout_s`` (None if it has none by then); then stopped."""
        try:
            ready = self.conn.poll(max(timeout_s, 0.0))
            got = self.conn.recv() if ready else None
        except (EOFError, OSError):
            got = None
        self.stop()
        return got

    def stop(self) -> None:
        if self.process.is_alive():
            self.process.terminate()
        self.process.join()
        self.conn.close()


def _run(target, args, conn) -> None:
    os.nice(5)
    conn.send(target(*args))
    conn.close()
