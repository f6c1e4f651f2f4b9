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
``RUN_ROWS`` rows, doubling for each next run of the same request up to ``RUN_MAX_BYTES``; copying
a row costs one row's bytes of memcpy. A decode step's rows are placed
together once a step (decode_rows.py: continued runs in place, new ones through ``place``) and
copied together, on a thread of their own; a run's chunk gets its rows when the run closes (a new
run, ``seal``).
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
    # what to wait on before the rows are read: a torch.cuda.Event of a device-to-host copy, or
    # a decode_rows.CopyTicket of rows copied into a run on the copy thread
    ready: Optional[Any] = None


RUN_ROWS = 32  # a request's first run's rows, and the most rows copied into a run at once
# A run that fills doubles for the next one, up to this many bytes and 1/RUN_CAP_SHARE of the host
# memory cap (never below RUN_ROWS rows): each new run costs the scheduler thread ~15 us (pool
# block, tensor, ledger), which a verify pass's several rows a step would otherwise pay every ~10
# steps. A request's unused tail is at most its last run: below RUN_ROWS rows or these bounds.
RUN_MAX_BYTES = 2 << 20
RUN_CAP_SHARE = 256


class Run:
    """A pool block filling with one request's consecutive short rows (its facts kept as plain
    attributes: ``DecodeRows`` reads them for every decode row)."""

    __slots__ = ("buffer", "chunk", "offset", "used", "capacity", "dtype", "row_shape", "row_bytes")

    def __init__(self, buffer: torch.Tensor, start: int, offset: Optional[int]) -> None:
        self.buffer = buffer  # [capacity, width]
        self.chunk = RowChunk(start, buffer[:0])  # its chunk in the request: rows = buffer[:used], set at close
        self.offset = offset  # the buffer's byte offset in the pool region
        self.used = 0
        self.capacity = buffer.shape[0]
        self.dtype = buffer.dtype
        self.row_shape = tuple(buffer.shape[1:])
        self.row_bytes = buffer.stride(0) * buffer.element_size()

    def takes(self, position: int, n: int, dtype: torch.dtype, row_shape: Tuple[int, ...]) -> bool:
        """Whether ``n`` rows at ``position`` continue this run and fit in it."""
        return (self.chunk.start + self.used == position and self.used + n <= self.capacity
                and dtype == self.dtype and row_shape == self.row_shape)

    def reserve(self, n: int) -> int:
        """Take the next ``n`` rows (the caller checked ``takes``): the pool byte offset of the first."""
        at = self.offset + self.used * self.row_bytes
        self.used += n
        return at

    def close(self) -> None:
        """No more rows come: the chunk's rows are the ones used (reserved rows included)."""
        self.chunk.rows = self.buffer[:self.used]


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
    run: Optional[Run] = field(default=None, init=False, repr=False)  # the run being filled
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
        if rows.device.type == "cpu" and rows.shape[0] <= RUN_ROWS:
            run = self._run_for(start, rows.shape[0], rows.dtype, tuple(rows.shape[1:]))
            if run is not None:
                run.buffer[run.used:run.used + rows.shape[0]].copy_(rows)
                run.used += rows.shape[0]
                return
        ready = None
        if rows.device.type == "cuda":
            rows, ready = _to_host(rows, self.pool)
        self.keep(start, rows, ready)

    def keep(self, start: int, rows: torch.Tensor, ready: Optional[Any] = None) -> None:
        """Keep ``rows`` as they are (a view of their batch's block when they are host rows)."""
        self.ledger.hold(rows)
        self.chunks.append(RowChunk(start, rows, ready))

    def place(self, start: int, n: int, dtype: torch.dtype, row_shape: Tuple[int, ...]
              ) -> Optional[Tuple[torch.Tensor, int, RowChunk]]:
        """Room for ``n`` host rows of ``dtype`` and ``row_shape`` at position ``start`` in this
        request's run: the run's buffer, the pool byte offset of the first row, and the run's chunk
        (whose ``ready`` the caller sets while the copy is in flight). The caller has the rows
        copied there (``DecodeRows``, which keeps the buffer meanwhile). None when they cannot go
        into a run: more than ``RUN_ROWS`` rows, no pool, or no room in it for a new run (counted
        there; the caller then ``keep``s them)."""
        if n > RUN_ROWS or self.pool is None:
            return None
        run = self._run_for(start, n, dtype, row_shape)
        if run is None or run.offset is None:
            return None
        return run.buffer, run.reserve(n), run.chunk

    def _run_for(self, start: int, n: int, dtype: torch.dtype, row_shape: Tuple[int, ...]) -> Optional[Run]:
        """The run that ``n`` rows at ``start`` continue (a new one when they do not continue the
        current run), or None when the pool has no room for one (counted there)."""
        run = self.run
        if run is not None and run.takes(start, n, dtype, row_shape):
            return run
        rows = RUN_ROWS
        if run is not None:
            run.close()
            if run.chunk.start + run.used == start:  # it filled: a longer one
                most = min(RUN_MAX_BYTES, self.ledger.cap_bytes // RUN_CAP_SHARE) // max(run.row_bytes, 1)
                rows = max(RUN_ROWS, min(2 * run.capacity, most))
        buffer = self.pool.alloc((rows, *row_shape), dtype, last_try=rows == RUN_ROWS) if self.pool is not None else None
        if buffer is None and rows > RUN_ROWS:  # no room for the longer run: the first size may still fit
            buffer = self.pool.alloc((RUN_ROWS, *row_shape), dtype)
        if buffer is None:
            self.run = None
            return None
        self.ledger.hold(buffer)
        run = self.run = Run(buffer, start, self.pool.offset_of(buffer))
        self.chunks.append(run.chunk)
        return run

    def _packed(self, rows: torch.Tensor) -> torch.Tensor:
        """FP8 rows the copy hook did not pack on the device (its pool was full, or they came
        another way) are packed here, and counted: on the host this costs the scheduler thread."""
        if not self.is_fp8 or rows.element_size() == 1:
            return rows
        if self.counts is not None:
            self.counts.fp8_packed_per_request_rows += rows.shape[0]
        return pack(rows, self.fp8_block)

    def first_position(self) -> int:
        """The first position this request computed rows for (those before it came from the radix cache)."""
        return min((chunk.start for chunk in self.chunks), default=0)

    def rows_so_far(self) -> List[RowChunk]:
        """The chunks of the rows in so far, the run being filled as far as it is (a job storing
        them ahead of the request's file holds these; the request keeps its own)."""
        run = self.run
        if run is None or run.used == 0:
            return [c for c in self.chunks if c is not (run.chunk if run else None)]
        so_far = getattr(run.chunk.ready, "so_far", None)  # decode rows copied into it: those flushed so far
        ready = so_far() if so_far is not None else run.chunk.ready
        return [c if c is not run.chunk else RowChunk(c.start, run.buffer[:run.used], ready) for c in self.chunks]

    def seal(self) -> None:
        """The request finished: its rows now belong to the writer job, whatever becomes of the Req."""
        if self.run is not None:
            self.run.close()
            self.run = None
        if self.finalizer is not None:
            self.finalizer.detach()
            self.finalizer = None

    def release(self) -> None:
        """Give the rows' host memory back (after writing, or when the request is dropped)."""
        chunks, self.chunks = self.chunks, []
        self.run = None
        for chunk in chunks:
            self.ledger.release(chunk.rows)
