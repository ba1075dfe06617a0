"""What communication hides under compute, and what it cannot: the overlap
rules of the one accounting (``autopar estimate``'s transformer books and a
compiled plan's graph books call the same functions; autopar/timeline.py's
``SyncWindow`` is ``exposed_sync`` on the ILP's variables).

Three mechanisms:

- **Gradient sync behind backward** (``exposed_sync``): a gradient is
  reduced once backward has made it, one collective after another on its
  link, while backward computes the layers before it; what the compute left
  to run cannot cover is exposed. Other traffic on the same link in that
  window (pipeline sends between nodes beside a data-parallel sync across
  them) takes its share of the link: it adds to what must cross it.
- **Chunked overlap** (``chunked_overlap``): a collective split into n
  chunks pipelined with the GEMM it feeds or drains, as Megatron-Core's
  ``--tp-comm-overlap`` (Transformer Engine's userbuffers) and PyTorch's async
  tensor parallelism run the all-gather before a column-parallel GEMM and the
  reduce-scatter after a row-parallel one.
- **Prefetch** (``prefetched``): ZeRO-3 gathers the next layer's weights while
  this one computes; what the compute cannot cover is exposed.
"""
from __future__ import annotations


def exposed_sync(syncs: list, computes: list, busy: float = 0.0) -> float:
    """Exposed seconds of gradient syncs made in backward, in forward (program)
    order: ``syncs[k]`` is launched when backward reaches position k, and only
    the backward compute of the positions before it, ``computes[:k]``, is left
    to hide it and everything launched after it. The exposed time is the
    largest, over k, of the syncs at positions <= k less the compute before k
    (autopar/timeline.py, SyncWindow, on a chain). ``busy``: seconds the
    sync's link carries other traffic within the window (shared links), added
    to what must cross it."""
    if len(syncs) != len(computes):
        raise ValueError(f"exposed_sync needs one compute per sync, got {len(syncs)} and {len(computes)}")
    worst, running, before = 0.0, busy, 0.0
    for sync, compute in zip(syncs, computes):
        running += sync
        worst = max(worst, running - before)
        before += compute
    return worst


def chunked_overlap(comm: float, compute: float, chunks: int) -> float:
    """Exposed seconds of a collective of ``comm`` seconds split into
    ``chunks`` pieces, each pipelined with its share of a GEMM of ``compute``
    seconds (the first piece's transfer, or the last one's, cannot hide):
    c + (n - 1) max(c, g) + g - compute with c = comm / n, g = compute / n.
    When the GEMM is the longer, comm / n is exposed; when the collective is,
    comm - compute (n - 1) / n."""
    if chunks < 1:
        raise ValueError(f"chunked_overlap needs chunks >= 1, got {chunks}")
    if comm <= 0:
        return 0.0
    c, g = comm / chunks, compute / chunks
    return c + (chunks - 1) * max(c, g) + g - compute


def prefetched(comm: float, compute: float) -> float:
    """Exposed seconds of a transfer issued one step ahead, under ``compute``
    seconds of work that does not need it."""
    return max(0.0, comm - compute)


def prefetched_chain(transfers: list, compute: list) -> float:
    """Exposed seconds of a chain of transfers, each issued where the one
    before it is waited for (one ahead, one in flight: FSDP's forward
    prefetch; the emitted program's ZeRO-3 gathers in forward):
    ``transfers[i]`` is needed at point i and ``compute[i]`` is the work
    from point i - 1 up to point i; the first transfer waits whole."""
    return sum(t if i == 0 else prefetched(t, c) for i, (t, c) in enumerate(zip(transfers, compute)))
