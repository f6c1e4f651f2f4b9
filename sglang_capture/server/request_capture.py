"""Per-request capture state in the scheduler: hidden-state rows keyed by absolute token position.

The scheduler thread only appends ``(position, rows)`` pairs (``RequestCapture.add``); ordering,
overlap resolution and the completeness check happen later in a writer process
(``writer/assemble.py``). Rows arrive out of the plain prompt-then-decode order on several SGLang
paths: chunked prefill (one pair per chunk), mixed batches, and retraction (a retracted request
is prefilled again, so positions repeat: the later rows win).

Short host rows (a decode step's, a short chunk's) are copied out of their batch's block into a
run of the request's own: a decode step's block holds one row of every capture request in the
batch, so keeping views of it would keep each neighbour's rows alive until the longest of them
is written, and a long generation beside a stream of short ones would hold the batch's rows of
every step it lived through, far beyond ``--capture-max-pending-mb``. A run is a pool block of
``RUN_ROWS`` rows; copying a row costs one row's bytes of memcpy on the scheduler thread.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

from sglang_capture.core.fp8 import pack
from sglang_capture.server.host_pool import read_on_current_stream

if TYPE_CHECKING:
    import torch

    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.ledger import HostMemoryLedger


CAPTURE_ATTR = "_sglang_capture"  # the RequestCapture hung on a captured Req


@dataclass
class RowChunk:
    """Rows for positions ``start .. start+len(rows)``; ``ready`` is set when they are still in flight."""

    start: int
    rows: torch.Tensor
    ready: Optional[Any] = None  # a torch.cuda.Event for a device-to-host copy not yet waited on


RUN_ROWS = 32  # rows per run, and the most rows copied into one: a run's unused tail is below this


@dataclass
class _Run:
    """A pool block filling with one request's consecutive short rows."""

    buffer: torch.Tensor  # [capacity, width]
    chunk: RowChunk  # its chunk in the request: rows = buffer[:used]
    used: int = 0

    def takes(self, position: int, rows: torch.Tensor) -> bool:
        b = self.buffer
        return (self.chunk.start + self.used == position and self.used + rows.shape[0] <= b.shape[0]
                and rows.dtype == b.dtype and tuple(rows.shape[1:]) == tuple(b.shape[1:]))


def _to_host(rows: torch.Tensor, pool: Optional[HostPool]) -> Tuple[torch.Tensor, Any]:
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
    ledger: HostMemoryLedger
    chunks: List[RowChunk] = field(default_factory=list)
    loss_spans: Optional[List[Tuple[int, int]]] = None  # from custom_params.capture_loss_mask
    # Frees the rows if the Req is dropped unfinished (aborts); detached once the request is
    # sealed, because a finished Req is usually freed before a writer gets to its rows.
    finalizer: Optional[Any] = None
    pool: Optional[HostPool] = None  # for rows that arrive still on the device
    failure: Optional[str] = None  # why rows could not be taken; the request then gets status error
    fp8_block: Optional[int] = None  # --capture-dtype fp8: rows not yet packed are packed here (core/fp8.py)
    _run: Optional[_Run] = field(default=None, init=False, repr=False)  # the run being filled
    counts: Optional[CopyCounts] = None  # the scheduler's copy counters (FP8 rows packed here)

    @property
    def is_fp8(self) -> bool:
        """Whether this request's rows are stored as FP8 (``--capture-dtype fp8``, or its request's)."""
        return self.fp8_block is not None

    def fail(self, why: str) -> None:
        """Rows of this request could not be placed: no file will be written (the first reason is kept)."""
        if self.failure is None:
            self.failure = why

    def add(self, start: int, rows: torch.Tensor) -> None:
        """Hot path: keep the rows and account for the host memory they keep. Up to ``RUN_ROWS``
        host rows are copied into this request's run (they are a slice of a block the whole batch
        shares); longer host rows stay a view of their pool block (no copy); rows still on the
        device are packed (FP8) and copied into the pool first."""
        read_on_current_stream(rows)  # device rows of another stream are read below (pack, copy)
        rows = self._packed(rows)
        if rows.device.type == "cpu" and rows.shape[0] <= RUN_ROWS and self._append_to_run(start, rows):
            return
        ready = None
        if rows.device.type == "cuda":
            rows, ready = _to_host(rows, self.pool)
        self.ledger.hold(rows)
        self.chunks.append(RowChunk(start, rows, ready))

    def _append_to_run(self, start: int, rows: torch.Tensor) -> bool:
        """Copy host rows into the run (a new one when they do not continue it); False when the
        pool has no room for a run (counted there): the caller then keeps the view."""
        run = self._run
        if run is None or not run.takes(start, rows):
            buffer = self.pool.alloc((RUN_ROWS, *rows.shape[1:]), rows.dtype) if self.pool is not None else None
            if buffer is None:
                self._run = None
                return False
            self.ledger.hold(buffer)
            run = self._run = _Run(buffer, RowChunk(start, buffer[:0]))
            self.chunks.append(run.chunk)
        n = rows.shape[0]
        run.buffer[run.used:run.used + n].copy_(rows)
        run.used += n
        run.chunk.rows = run.buffer[:run.used]
        return True

    def _packed(self, rows: torch.Tensor) -> torch.Tensor:
        """FP8 rows the copy hook did not pack on the device (its pool was full, or they came
        another way) are packed here, and counted: on the host this costs the scheduler thread."""
        if not self.is_fp8 or rows.element_size() == 1:
            return rows
        if self.counts is not None:
            self.counts.fp8_packed_per_request_rows += rows.shape[0]
        return pack(rows, self.fp8_block)

    def seal(self) -> None:
        """The request finished: its rows now belong to the writer job, whatever becomes of the Req."""
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None

    def release(self) -> None:
        """Give the rows' host memory back (after writing, or when the request is dropped)."""
        chunks, self.chunks = self.chunks, []
        self._run = None
        for chunk in chunks:
            self.ledger.release(chunk.rows)
