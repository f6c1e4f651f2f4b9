"""Per-request assembly: hidden-state rows keyed by absolute token position.

The scheduler thread only appends ``(position, rows)`` pairs (``RequestCapture.add``); ordering,
overlap resolution and the completeness check happen later in a writer process
(``assemble_rows``, which needs numpy only). Rows arrive out of the plain prompt-then-decode order on several SGLang
paths: chunked prefill (one pair per chunk), mixed batches, and retraction (a retracted request
is prefilled again, so positions repeat: the later rows win).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy

from sglang_capture.format import HostTensor

if TYPE_CHECKING:
    import torch

    from sglang_capture.host_pool import HostPool
    from sglang_capture.ledger import HostMemoryLedger


@dataclass
class RowChunk:
    """Rows for positions ``start .. start+len(rows)``; ``ready`` is set when they are still in flight."""

    start: int
    rows: "torch.Tensor"
    ready: Optional[Any] = None  # a torch.cuda.Event for a device-to-host copy not yet waited on


def _to_host(rows: "torch.Tensor", pool: Optional["HostPool"]) -> Tuple["torch.Tensor", Any]:
    """Queue a copy of device rows to the host on the current stream (stream order keeps a
    CUDA-graph output buffer from being overwritten before the copy has read it): into the pool,
    or into pinned memory of its own when the pool is full."""
    import torch

    host = pool.take(rows) if pool is not None else None
    if host is None:
        host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
        host.copy_(rows, non_blocking=True)
    event = torch.cuda.Event()
    event.record()
    return host, event


@dataclass
class RequestCapture:
    """Capture state of one request inside the scheduler process."""

    rid: str
    name: str
    ledger: "HostMemoryLedger"
    chunks: List[RowChunk] = field(default_factory=list)
    loss_spans: Optional[List[Tuple[int, int]]] = None  # from custom_params.capture_loss_mask
    # Frees the rows if the Req is dropped unfinished (aborts); detached once the request is
    # sealed, because a finished Req is usually freed before a writer gets to its rows.
    finalizer: Optional[Any] = None
    pool: Optional["HostPool"] = None  # for rows that arrive still on the device
    failure: Optional[str] = None  # why rows could not be taken; the request then gets status error

    def fail(self, why: str) -> None:
        """Rows of this request could not be placed: no file will be written (the first reason is kept)."""
        if self.failure is None:
            self.failure = why

    def add(self, start: int, rows: "torch.Tensor") -> None:
        """Hot path: keep a reference to the rows (a view of the batch's host buffer, no copy)
        and account for the host memory it keeps."""
        ready = None
        if rows.device.type == "cuda":
            rows, ready = _to_host(rows, self.pool)
        self.ledger.hold(rows)
        self.chunks.append(RowChunk(start, rows, ready))

    def seal(self) -> None:
        """The request finished: its rows now belong to the writer job, whatever becomes of the Req."""
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None

    def release(self) -> None:
        """Give the rows' host memory back (after writing, or when the request is dropped)."""
        chunks, self.chunks = self.chunks, []
        for chunk in chunks:
            self.ledger.release(chunk.rows)


class IncompleteCapture(RuntimeError):
    """Some positions of the request never received a row: the file would be wrong, so none is written."""


def _gaps(spans: List[Tuple[int, int]], n_rows: int) -> List[Tuple[int, int]]:
    """The inclusive position ranges in ``[0, n_rows)`` that no ``[start, end)`` span covers."""
    gaps: List[Tuple[int, int]] = []
    reached = 0
    for start, end in sorted(spans):
        if start > reached:
            gaps.append((reached, start - 1))
        reached = max(reached, end)
    if reached < n_rows:
        gaps.append((reached, n_rows - 1))
    return gaps


def assemble_rows(pieces: List[Tuple[int, HostTensor]], n_rows: int,
                  splits: Dict[str, Tuple[int, int]]) -> Dict[str, HostTensor]:
    """Place every ``(start, rows)`` piece by position into fresh arrays, one per column range
    in ``splits``.

    Later pieces overwrite earlier ones (re-prefill after retraction), rows past ``n_rows`` are
    dropped (the step that sampled the last token also computed rows nobody fed back), and a
    position left uncovered raises IncompleteCapture. One copy per piece and column range; once
    this returns, nothing reads the pieces' memory any more.
    """
    if not pieces:
        if n_rows:
            raise IncompleteCapture(f"no rows were captured for {n_rows} positions")
        return {name: HostTensor("float32", numpy.empty((0, hi - lo), dtype=numpy.float32))
                for name, (lo, hi) in splits.items()}
    dtype = pieces[0][1].dtype
    out = {name: numpy.empty((n_rows, hi - lo), dtype=pieces[0][1].array.dtype) for name, (lo, hi) in splits.items()}
    spans: List[Tuple[int, int]] = []
    for start, src in pieces:
        end = min(start + src.array.shape[0], n_rows)
        if end <= start:
            continue
        part = src.array[: end - start]
        for name, (lo, hi) in splits.items():
            out[name][start:end] = part[:, lo:hi]
        spans.append((start, end))
    gaps = _gaps(spans, n_rows)
    if gaps:
        where = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:8])
        raise IncompleteCapture(f"rows missing at positions {where} of {n_rows}")
    return {name: HostTensor(dtype, arr) for name, arr in out.items()}
