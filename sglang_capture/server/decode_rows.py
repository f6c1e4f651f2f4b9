"""Decode rows of one batch result, copied into their requests' runs together, off the scheduler thread.

A decode step hands every capture request of the batch a few rows (one, or an EAGLE-3 verify
pass's accepted ones). Copying each request's rows into its run as they arrive
(``RequestCapture.add``) costs the scheduler thread a few tensor operations per request and
step: 2.7 ms per 64-request step in isolation, against 0.7 ms as one scatter (measured on the
CPU test bed when the scatter was added, commit ``747aed4``).
Here the result seam only notes where each request's rows are (``note``: one list append per
request); ``flush`` places the step's rows in their runs in one loop (a continued run directly;
a new one comes from ``RequestCapture.place``) and hands the reservations to the
``RowCopier`` thread, which copies them with one ``HostPool.scatter_rows`` per source tensor while
the scheduler goes on with the next batch. Noting rather than placing per request keeps the
scheduler thread's cost per request and step to the seam's call (on the EAGLE-3 24 x 2048 pair
the chain of placing calls per request was ~4% of that thread: bench/RESULTS.md, r76).

A run that took rows this way carries a ``CopyTicket`` as its chunk's ``ready``: the link sends
its job only once it is done (``query``), as for a device copy's event, before a writer process
reads the run. The copies run in submission order; a failed copy fails only the runs that
had rows in it (their tickets), wherever it ran. The copier falls at most ``MAX_BEHIND`` flushes
behind: then the scheduler waits (``decode_copy_waits`` in the writer stats), so pending rows stay
bounded.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Deque, Dict, List, Optional, Set, Tuple

from sglang_capture.server.batch_rows import RowsMismatch
from sglang_capture.server.request_capture import RUN_ROWS

if TYPE_CHECKING:
    import torch

    from sglang_capture.server.batch_rows import ResultRows
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.request_capture import RequestCapture

logger = logging.getLogger(__name__)

MAX_BEHIND = 8  # flushes the copier may have queued before the scheduler waits for it


@dataclass
class _Source:
    """One host tensor of the step's rows, and where its reserved rows go (its facts read once a
    step: ``DecodeRows._place`` runs for every capture request of every decode step)."""

    tensor: Any
    dtype: Any
    row_shape: Tuple[int, ...]
    row_bytes: int
    batchable: bool  # a contiguous host tensor: scatter_rows can read it
    packed: bool  # FP8 rows (one byte each): what an FP8 capture takes
    rows: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    buffers: List[Any] = field(default_factory=list)  # the runs written to, kept until the copy

    @classmethod
    def of(cls, source: torch.Tensor) -> _Source:
        row_shape = tuple(source.shape[1:])
        return cls(source, source.dtype, row_shape, math.prod(row_shape) * source.element_size(),
                   source.device.type == "cpu" and source.dim() > 1 and source.is_contiguous(),
                   source.element_size() == 1)


class CopyClosed(RuntimeError):
    """The copier is closed (server exit, ``uninstrument``) or gone: rows are copied in place instead."""


class CopyTicket:
    """A run's ``ready`` once ``DecodeRows`` reserved rows in it: the copier's flushes it had rows in,
    and why a copy of them failed."""

    __slots__ = ("copier", "seqs", "error")

    def __init__(self, copier: Optional[RowCopier]) -> None:
        self.copier = copier
        self.seqs: Set[int] = set()
        self.error: Optional[str] = None

    def query(self) -> bool:
        """Whether the run's rows are all in place, or can no longer be (never waits: the link
        sends a job only then, as for a device copy's event)."""
        return self.so_far().query()

    def synchronize(self) -> None:
        """Wait until the run's rows are all in place (``describe_chunks``, as for a device copy's
        event); raises naming why when they cannot be. The copies run in order: its last flush's
        is the one to wait for."""
        self.so_far().synchronize()

    def so_far(self) -> Any:
        """This ticket as of now, for the rows in the run so far (a job storing them ahead of the
        request's file): the flushes to come fill rows that are not theirs, and are not waited for."""
        return TicketSoFar(self, max(self.seqs, default=0))


class TicketSoFar:
    """A ``CopyTicket`` up to one flush (0: none): ready once that flush is copied."""

    __slots__ = ("ticket", "upto")

    def __init__(self, ticket: CopyTicket, upto: int) -> None:
        self.ticket, self.upto = ticket, upto

    def query(self) -> bool:
        t = self.ticket
        return t.error is not None or t.copier is None or self.upto == 0 or t.copier.copied(self.upto)

    def synchronize(self) -> None:
        t = self.ticket
        if self.upto and t.copier is not None:
            t.copier.wait({self.upto})
        if t.error is not None:  # a failed flush of the run, maybe a later one: the ahead job fails alone
            raise RuntimeError(f"decode rows could not be copied into their run: {t.error}")


def copy_sources(pool: HostPool, counts: CopyCounts, sources: List[_Source]) -> None:
    """One ``scatter_rows`` per source tensor: every reserved row to its place in its run."""
    for src in sources:
        pool.scatter_rows(src.tensor, src.rows, src.offsets)
        counts.decode_rows_scattered += len(src.rows)
        counts.decode_scatters += 1


class RowCopier:
    """A thread copying flushed decode rows into their runs, one flush after another."""

    def __init__(self, pool: HostPool, counts: CopyCounts, max_behind: int = MAX_BEHIND) -> None:
        self.pool = pool
        self.counts = counts
        self.max_behind = max_behind  # flushes handed over and not yet copied, the one in hand included
        self._cond = threading.Condition()
        self._queue: Deque[Optional[Tuple[int, List[_Source], List[CopyTicket]]]] = collections.deque()
        self._submitted = 0  # sequence number of the last flush handed over
        self._done = 0  # of the last one copied (or failed)
        self._closed: Optional[str] = None  # why no more copies are taken
        self._thread = threading.Thread(target=self._loop, name="sglang-capture-rows", daemon=True)
        self._thread.start()

    def submit(self, sources: List[_Source], tickets: List[CopyTicket]) -> int:
        """Queue one flush's copies (scheduler thread); its sequence number. Waits while the
        copier is ``max_behind`` flushes behind. Raises ``CopyClosed`` once closed or gone."""
        with self._cond:
            if self._submitted - self._done >= self.max_behind and self._closed is None:
                self.counts.decode_copy_waits += 1
                while self._submitted - self._done >= self.max_behind and self._closed is None:
                    if not self._thread.is_alive():
                        self._closed = "the capture's row copier died"
                        break
                    self._cond.wait(1.0)
            if self._closed is not None:
                raise CopyClosed(self._closed)
            self._submitted += 1
            self._queue.append((self._submitted, sources, tickets))
            self._cond.notify_all()
            return self._submitted

    def copied(self, seq: int) -> bool:
        """Whether flush ``seq`` is copied or failed, or the copier is gone (never waits)."""
        return self._done >= seq or not self._thread.is_alive()

    def wait(self, seqs: Set[int], poll_s: float = 1.0) -> None:
        """Return once every flush in ``seqs`` is copied or failed (the writer link, before a
        writer reads the runs; a failure is on the tickets); raises when one can no longer be copied."""
        last = max(seqs)
        with self._cond:
            while self._done < last:
                if not self._thread.is_alive():
                    raise RuntimeError(f"decode rows were not copied: the copy thread is gone ({self._closed or 'it died'})")
                self._cond.wait(poll_s)

    def close(self, timeout_s: float = 30.0) -> None:
        """Copy what is queued, then stop (idempotent): later flushes are copied in place."""
        with self._cond:
            if self._closed is None:
                self._closed = "the capture's row copier was closed"
                self._queue.append(None)
                self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def _loop(self) -> None:
        failures = 0
        while True:
            with self._cond:
                while not self._queue:
                    self._cond.wait()
                item = self._queue.popleft()
            if item is None:
                return
            seq, sources, tickets = item
            item = None  # the step's block and the runs go back to the pool once copied, not at the next flush
            error = None
            try:
                copy_sources(self.pool, self.counts, sources)
            except Exception as e:  # noqa: BLE001 - a failed copy fails its runs, never this thread
                error = f"{type(e).__name__}: {e}"
                failures += 1
                if failures == 1 or failures % 1000 == 0:
                    logger.error("sglang_capture: decode rows not copied (%d flush(es) so far): %s", failures, error)
            sources = None
            with self._cond:
                if error is not None:
                    for ticket in tickets:
                        ticket.error = ticket.error or error
                self._done = seq
                self._cond.notify_all()
            tickets = None


class DecodeRows:
    """A decode step's rows, noted per request and reserved and copied per step (scheduler thread)."""

    def __init__(self, pool: HostPool, counts: CopyCounts, copier: Optional[RowCopier] = None) -> None:
        self.pool = pool
        self.counts = counts
        self.copier = copier  # None: each flush copies on the scheduler thread
        self._notes: List[Tuple[RequestCapture, int, torch.Tensor, int, int, ResultRows]] = []

    def note(self, capture: RequestCapture, position: int, hidden: torch.Tensor, offset: int, n: int,
             processing: ResultRows) -> None:
        """Hot path, once per capture request and decode step: ``capture``'s ``n`` rows at batch
        offset ``offset`` of ``hidden`` (the result of ``processing``'s batch) are its positions from
        ``position``. Nothing else happens here: ``flush`` places the step's rows together, in one
        loop instead of a chain of calls per request."""
        self._notes.append((capture, position, hidden, offset, n, processing))

    def flush(self) -> None:
        """Place every noted row in its request's run and hand the copies to the copier (before
        the requests are sealed, and at the step's end); without one, or once it is closed, copy
        them here. Never raises: a row that cannot be found or placed fails its capture, and a
        copy that fails fails the runs it was for (their tickets), not the scheduler."""
        notes, self._notes = self._notes, []
        if not notes:
            return
        sources, tickets = self._place(notes)
        if not sources:
            return
        if self.copier is not None:
            try:
                seq = self.copier.submit(sources, tickets)
            except Exception:  # noqa: BLE001 - closed, or gone: copied here below
                pass
            else:
                for ticket in tickets:
                    ticket.seqs.add(seq)
                return
        try:
            copy_sources(self.pool, self.counts, sources)
        except Exception as e:  # noqa: BLE001 - on the scheduler thread: fail the runs, never the server
            for ticket in tickets:
                ticket.error = ticket.error or f"{type(e).__name__}: {e}"

    def _place(self, notes: List[Tuple[RequestCapture, int, torch.Tensor, int, int, ResultRows]]
               ) -> Tuple[List[_Source], List[CopyTicket]]:
        """Reserve each note's rows in its request's run: a continued run directly (the common
        case: ``Run.takes``, ``Run.reserve``), a new one through ``RequestCapture.place``. Rows
        that cannot be scattered are added by their capture itself. A note that fails (its rows
        not in the batch, or an error placing them) fails its capture only: the rows reserved for
        the others are still handed on."""
        pending: Dict[int, _Source] = {}
        tickets: List[CopyTicket] = []
        last, src, batch, packed, row_map, width = None, None, None, None, None, -1
        for capture, position, hidden, offset, n, processing in notes:
            if capture.failure is not None:
                continue
            if processing is not batch:
                batch = processing
                kept = processing.rows
                packed = kept.packed if kept is not None else None  # ResultRows.source's choice
                row_map = kept.row_map if kept is not None else None
            try:
                if row_map is None and hidden is last:  # the common case, ResultRows.row inlined
                    if offset + n > width:
                        raise RowsMismatch(f"rows {offset}-{offset + n - 1} asked of {width}")
                    row = offset
                else:
                    row = processing.row(hidden, offset, n)
                source = packed if packed is not None and capture.fp8_block is not None else hidden
                if source is not last:
                    last, width = source, (source.shape[0] if source is hidden else -1)
                    src = pending.get(id(source))
                    if src is None:
                        src = pending[id(source)] = _Source.of(source)
                if not src.batchable or n > RUN_ROWS or (capture.fp8_block is not None and not src.packed):
                    capture.add(position, source[row:row + n])
                    continue
                run = capture.run
                # a continued run (Run.takes, Run.reserve inlined: once per capture request and step)
                if run is not None and run.offset is not None and run.chunk.start + run.used == position \
                        and run.used + n <= run.capacity and run.dtype is src.dtype and run.row_shape == src.row_shape:
                    at = run.offset + run.used * run.row_bytes
                    run.used += n
                    buffer, chunk = run.buffer, run.chunk
                else:
                    placed = capture.place(position, n, src.dtype, src.row_shape)
                    if placed is None:  # no room in the pool for a run (counted there): the view of the step's block
                        capture.keep(position, source[row:row + n])
                        continue
                    buffer, at, chunk = placed
            except RowsMismatch as e:
                capture.fail(str(e))
                continue
            except Exception as e:  # noqa: BLE001 - on the scheduler thread: fail this capture, never the server
                capture.fail(f"decode rows at position {position} could not be placed: {type(e).__name__}: {e}")
                continue
            if n == 1:
                src.rows.append(row)
                src.offsets.append(at)
            else:
                src.rows.extend(range(row, row + n))
                src.offsets.extend(range(at, at + n * src.row_bytes, src.row_bytes))
            src.buffers.append(buffer)
            ticket = chunk.ready
            if ticket.__class__ is not CopyTicket:
                ticket = chunk.ready = CopyTicket(self.copier)
            tickets.append(ticket)
        return [s for s in pending.values() if s.rows], tickets
