"""The hand-off between the scheduler process, its writer supervisor and the writer processes:
messages on pipes, rows by reference.

Scheduler process to supervisor (server/writer_pool.py, writer/supervisor.py): ``hello`` (the
configuration, the pool, how many writers), then ``job`` (a finished request, below), ``outcome``
(an aborted capture's), ``stats`` (the scheduler side's counters), ``sweep``, ``query``; back:
``ready``, then per job ``copied`` and ``done`` (its outcome), and ``blocks`` (what it stored,
written to the pipe before its outcome is recorded). Messages queued while another was sent
travel as one ``many``; the scheduler side reads its pipe without blocking (``FrameReader``).

A job's message says where each captured chunk lies in the shared host pool (host_pool.py):
offset, shape and dtype, a few dozen bytes per chunk. Only rows outside the pool (it was full,
or the server has none) travel inline as bytes. Messages are length-prefixed msgpack maps.

Supervisor to each writer process: ``hello`` (configuration, pool descriptor), then per job
``write`` → ``copied`` (the rows are read out of the pool: the scheduler side may free it) →
``temp`` (the temp file's name under ``.tmp/``, removed by the supervisor if the process is
killed) → ``publishing`` (the file is whole and flushed; its device, inode, size and checksum; its
name appears next) → ``done`` (the outcome), with ``progress`` messages between them while a long file
is still being written and reaching the disk (at most one a second): the supervisor gives up
on a writer that sends nothing for ``--capture-writer-stall-timeout``. A writer that dies or stalls
after ``publishing`` may have published the file: the supervisor then judges it by that
identity. ``temp`` and ``publishing`` are absent when the file failed before them. Between jobs, ``sweep`` → ``swept`` removes old outcome
records. EOF on either side ends it.
"""
from __future__ import annotations

import collections
import mmap
import os
import queue
import select
import struct
import time
from typing import Any, Dict, List, Optional, Protocol, Sequence, Tuple

import msgpack
import numpy

from sglang_capture.core.format import HostTensor, host_tensor

_HEADER = struct.Struct(">Q")
READ_CHUNK = 1 << 20  # bytes a FrameReader asks of its descriptor at once (pipes are widened to this)


class Chunk(Protocol):
    """What the wire form needs of a request's rows (the server's ``RowChunk``)."""

    start: int  # absolute position of the first row
    rows: Any  # a host tensor
    ready: Any  # an event to wait on before the rows are read, or None


class Pool(Protocol):
    """What the wire form needs of the host pool (the server's ``HostPool``)."""

    def offset_of(self, t: Any) -> Optional[int]: ...


def _frame(message: Dict[str, Any]) -> List[memoryview]:
    """``message`` as written: its length, then its msgpack body; a large body (rows inline) is
    not copied once more to prepend the length."""
    body = msgpack.packb(message, use_bin_type=True)
    header = _HEADER.pack(len(body))
    return [memoryview(header + body)] if len(body) < (1 << 16) else [memoryview(header), memoryview(body)]


def send(fd: int, message: Dict[str, Any]) -> None:
    """Write one message (raises BrokenPipeError when the other side is gone)."""
    for part in _frame(message):
        _write_all(fd, part)


def _write_all(fd: int, data: memoryview) -> None:
    while data:
        data = data[os.write(fd, data):]


# The scheduler side's stats sent at most every few tenths of a second, not with every batch of jobs: the
# supervisor keeps their last values between sends (torch builds each whole on every call).
SLOW_STATS = ("pinned", "device_allocator")

# Messages queued while one was sent go together as one ``many`` message: under load the other side
# wakes once per batch, not per message (between the scheduler process and the writer supervisor).
MAX_BATCH = 64


def take_queued(q: "queue.Queue[Any]", first: Any) -> Tuple[List[Any], bool]:
    """``first`` and what else ``q`` holds now (at most ``MAX_BATCH`` in all), up to a ``None``
    (stop) marker; and whether that marker was taken."""
    items = [first]
    while items[-1] is not None and len(items) < MAX_BATCH:
        try:
            items.append(q.get_nowait())
        except queue.Empty:
            break
    return (items[:-1], True) if items[-1] is None else (items, False)


def _together(messages: List[Dict[str, Any]]) -> Dict[str, Any]:
    """``messages`` as one message (``many``; a single one as itself)."""
    return messages[0] if len(messages) == 1 else {"op": "many", "messages": messages}


def _apart(message: Dict[str, Any]) -> List[Dict[str, Any]]:
    """The messages ``message`` carries: those sent together, or itself."""
    return message["messages"] if message.get("op") == "many" else [message]


def send_many(fd: int, messages: List[Dict[str, Any]]) -> None:
    """Send ``messages`` as one (nothing when there are none)."""
    if messages:
        send(fd, _together(messages))


def recv_many(fd: int) -> Optional[List[Dict[str, Any]]]:
    """The next message, or the messages sent together as one; None when the other side is gone."""
    try:
        message = recv(fd)
    except OSError:
        return None
    return None if message is None else _apart(message)


class FrameReader:
    """Messages from a non-blocking descriptor as they arrive, never waiting: whole messages only,
    a message still being written kept for the next ``read``."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._buf = bytearray()

    def read(self) -> Tuple[List[Dict[str, Any]], bool]:
        """Every whole message written so far (those sent together, apart), and whether the other
        side closed its end (EOF)."""
        eof = False
        while True:
            try:
                data = os.read(self.fd, READ_CHUNK)
            except BlockingIOError:
                break
            except OSError:  # closed here, or the other side is gone
                eof = True
                break
            if not data:
                eof = True
                break
            self._buf += data
            if len(data) < READ_CHUNK:  # the pipe is drained: no second system call to hear so
                break
        messages, at, buf = [], 0, self._buf
        with memoryview(buf) as view:  # released before the bytearray is cut below
            while len(buf) - at >= _HEADER.size:
                n = _HEADER.unpack_from(buf, at)[0]
                if len(buf) - at - _HEADER.size < n:
                    break
                messages.extend(_apart(msgpack.unpackb(view[at + _HEADER.size:at + _HEADER.size + n], raw=False,
                                                       strict_map_key=False)))
                at += _HEADER.size + n
        if at:
            del buf[:at]
        return messages, eof


class FrameWriter:
    """Messages to a non-blocking descriptor, never waiting: what the pipe cannot take now is kept,
    in order, and written by the next ``flush`` (the scheduler thread writes to the supervisor so,
    and a supervisor that stops reading never stops it)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._pending: collections.deque = collections.deque()  # bytes (views) not written yet, in order
        self.pending_bytes = 0
        self.broken = False  # the other side is gone (or ``close``d here): nothing more is written

    def send_many(self, messages: List[Dict[str, Any]]) -> bool:
        """Queue ``messages`` as one and write what the pipe takes now. False when the other side
        is gone (none of them will be read); raises ValueError, TypeError or OverflowError (nothing
        queued) when msgpack cannot pack them."""
        parts = _frame(_together(messages))
        if self.broken:
            return False
        had_pending, size = bool(self._pending), sum(len(p) for p in parts)
        self._pending.extend(parts)
        self.pending_bytes += size
        try:
            self.flush()
        except OSError:  # gone: a message cut short is the reader's EOF, one not begun is not sent
            return had_pending or self.pending_bytes < size  # behind others, it is lost with the rest
        return True

    def flush(self, timeout: Optional[float] = None) -> None:
        """Write what is pending that the pipe takes now; with ``timeout``, wait up to that long for
        it to take all of it. Raises OSError when the other side is gone."""
        deadline = None if timeout is None else time.monotonic() + timeout
        poller = None
        while self._pending and not self.broken:
            chunk = self._pending[0]
            try:
                n = os.write(self.fd, chunk)
            except BlockingIOError:
                left = None if deadline is None else deadline - time.monotonic()
                if left is None or left <= 0:
                    return
                if poller is None:
                    poller = select.poll()  # not select(): a server's descriptors go past 1024
                    poller.register(self.fd, select.POLLOUT)
                poller.poll(left * 1000)
                continue
            except OSError:
                self.broken = True
                raise
            self.pending_bytes -= n
            if n == len(chunk):
                self._pending.popleft()
            else:
                self._pending[0] = chunk[n:]

    def close(self) -> None:
        """Write nothing more (the descriptor is about to be closed); what is pending is dropped."""
        self.broken = True
        self._pending.clear()
        self.pending_bytes = 0


class Stalled(TimeoutError):
    """The other side sent nothing for the whole allowed time."""


def _read_exact(fd: int, n: int, deadline: Optional[float]) -> Optional[bytearray]:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise Stalled()
        k = os.readv(fd, [view[got:]])
        if not k:
            return None
        got += k
    return buf


def recv(fd: int, timeout: Optional[float] = None) -> Optional[Dict[str, Any]]:
    """Read one message; None when the other side closed its end (or died). With ``timeout``,
    raises Stalled when the message is not whole within that many seconds."""
    deadline = None if timeout is None else time.monotonic() + timeout
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(header)[0], deadline)
    return None if body is None else msgpack.unpackb(body, raw=False, strict_map_key=False)


def recv_reply(fd: int, stall_s: float) -> Optional[Dict[str, Any]]:
    """The next message that is not ``progress``; raises Stalled after ``stall_s`` seconds
    without any message (each ``progress`` starts the time again)."""
    while True:
        message = recv(fd, stall_s)
        if message is None or message.get("op") != "progress":
            return message


class Heartbeat:
    """Sends ``progress`` on ``fd`` when called, at most once per ``interval`` seconds: the
    writer calls it after every write to its file and after each flush, so a writer stuck in
    the kernel (a hung mount) goes silent while one that is slow but moving does not."""

    def __init__(self, fd: int, interval: float) -> None:
        self.fd, self.interval = fd, interval
        self.last = time.monotonic()

    def restart(self) -> None:
        self.last = time.monotonic()

    def __call__(self) -> None:
        now = time.monotonic()
        if now - self.last >= self.interval:
            send(self.fd, {"op": "progress"})
            self.last = now


def describe_chunks(chunks: Sequence[Chunk], pool: Optional[Pool]) -> Tuple[List[list], int]:
    """Wire form of a request's chunks, and how many bytes of them travel inline.

    Waits for any device-to-host copy still in flight (the writer process cannot see CUDA events).
    """
    wire, inline = [], 0
    for chunk in chunks:
        if chunk.ready is not None:
            chunk.ready.synchronize()
        ht = host_tensor(chunk.rows)
        offset = pool.offset_of(chunk.rows) if pool is not None else None
        data = None
        if offset is None:
            data = numpy.ascontiguousarray(ht.array).tobytes()
            inline += len(data)
        wire.append([chunk.start, ht.dtype, ht.array.dtype.str, list(ht.array.shape), offset, data])
    return wire, inline


def chunk_arrays(wire: List[list], pool: Optional[mmap.mmap]) -> List[Tuple[int, HostTensor]]:
    """``(start, rows)`` chunks for ``assemble_rows``: views of the mapped pool, or inline bytes."""
    chunks = []
    for start, dtype, np_dtype, shape, offset, data in wire:
        if offset is None:
            array = numpy.frombuffer(data, dtype=np_dtype).reshape(shape)
        else:
            if pool is None:
                raise RuntimeError("rows in the host pool were handed to a writer process without the pool")
            array = numpy.ndarray(shape, dtype=np_dtype, buffer=pool, offset=offset)
        chunks.append((start, HostTensor(dtype, array)))
    return chunks


def ids_bytes(ids: List[int]) -> bytes:
    return numpy.asarray(ids, dtype=numpy.int64).tobytes()


def ids_array(data: bytes) -> numpy.ndarray:
    return numpy.frombuffer(data, dtype=numpy.int64)
