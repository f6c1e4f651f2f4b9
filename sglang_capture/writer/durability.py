"""Durability: how a written capture file, and then its published name, reach stable storage.

While a file is written its bytes go to the disk behind it (``WriteBehind``), a step at a time,
whatever the policy. Then a writer process calls ``sync_data(fd)`` before the file's final name
appears, and ``sync_names(dir_fd)`` after the name appears and before the request's outcome says
``ok``. Two policies:

- ``file`` (default): ``fsync`` the file, then the capture directory: two flushes per file, each
  waiting on the disk (for the file, only its last steps and its metadata are left by then).
- ``none``: no flush. Files are still whole when they appear and survive the server being
  killed, but a power loss or kernel crash can lose or truncate the last files written. For tmpfs
  or data that is cheap to re-capture.
"""
from __future__ import annotations

import ctypes
import errno
import os
from typing import IO, Any, Callable, Optional

from sglang_capture.core.config import DURABILITY_MODES

# Bytes per write-behind step: the unit of progress a writer reports while its file reaches the
# disk. At 8 MiB a writer is judged stalled only when its disk moves less than 8 MiB in
# --capture-writer-stall-timeout (70 KB/s at the default 120 s).
WRITEBACK_STEP = 8 << 20
_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
# sync_file_range(2) flags
_WAIT_BEFORE, _WRITE, _WAIT_AFTER = 1, 2, 4
# errors that say the file or system cannot write back by range: the file is then flushed whole at the end
_NO_RANGES = (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP)


def _bind_sync_file_range() -> Optional[Callable[..., int]]:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


_SYNC_FILE_RANGE = _bind_sync_file_range()


def sync_file_range(fd: int, offset: int, nbytes: int, wait: bool) -> None:
    """Start writeback of ``nbytes`` at ``offset`` of ``fd`` and, with ``wait``, wait until they
    are on the disk (not its cache, nor the file's metadata: ``fsync`` still does those). Raises
    OSError; ENOSYS where the call does not exist."""
    if _SYNC_FILE_RANGE is None:
        raise OSError(errno.ENOSYS, "sync_file_range is not available")
    flags = _WAIT_BEFORE | _WRITE | _WAIT_AFTER if wait else _WRITE
    if _SYNC_FILE_RANGE(fd, offset, nbytes, flags) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


class WriteBehind:
    """A file being written whose bytes go to the disk while it grows, ``step`` bytes at a time.

    Each time a step's worth has been written, the new bytes are handed to writeback and the bytes
    handed over the time before are waited for, one ``step`` at a time, each followed by
    ``progress()``. Why: with one flush at the end, all of a large file's disk work happens inside
    one ``fsync`` that reports nothing, on hosts whose page cache takes the whole file at once, and
    on slow storage a healthy writer then looks hung (issue 34 item 2). This way the disk works
    while the next frame is compressed, at most two steps are dirty when the file ends, and a
    writer reports progress for every step that reaches the disk, while one stuck on a hung mount
    still goes silent. Steps already on the disk leave the page cache unless ``keep_page_cache``.
    """

    def __init__(self, f: IO[bytes], progress: Callable[[], None], keep_page_cache: bool = False,
                 step: Optional[int] = None) -> None:
        self._f, self._progress, self._keep = f, progress, keep_page_cache
        self._step = step or WRITEBACK_STEP
        self._fd = f.fileno()
        self.written = 0  # bytes written so far
        self._handed = 0  # [0, handed) handed to writeback
        self._on_disk = 0  # [0, on_disk) waited for
        self._ranges = True  # the file takes range writeback (set False on its first refusal)

    def write(self, data: Any) -> None:
        view = memoryview(data).cast("B")
        for at in range(0, len(view), self._step):  # a 64 MiB frame goes a step at a time too
            piece = view[at:at + self._step]
            self._f.write(piece)
            self.written += len(piece)
            self._progress()
            if self.written - self._handed >= self._step:
                self._advance()

    def finish(self) -> None:
        """Wait until every byte written is on the disk (before the file's flush and name)."""
        self._advance(last=True)
        self._wait_for(self._handed)

    def _advance(self, last: bool = False) -> None:
        """Hand the bytes written since the last step to writeback, then wait for the step before.
        Until the last, only whole pages are handed: a page handed twice is written twice, the
        second time behind everything queued meanwhile."""
        if not self._ranges:
            return
        self._f.flush()  # the buffered bytes into the kernel
        previous = self._handed
        end = self.written if last else self.written - self.written % _PAGE
        if self._call(previous, end - previous, wait=False):
            self._handed = end
            self._wait_for(previous)

    def _wait_for(self, end: int) -> None:
        while self._ranges and self._on_disk < end:
            n = min(self._step, end - self._on_disk)
            if not self._call(self._on_disk, n, wait=True):
                return
            if not self._keep:
                os.posix_fadvise(self._fd, self._on_disk, n, os.POSIX_FADV_DONTNEED)
            self._on_disk += n
            self._progress()

    def _call(self, offset: int, nbytes: int, wait: bool) -> bool:
        if nbytes <= 0:
            return True
        try:
            sync_file_range(self._fd, offset, nbytes, wait)
        except OSError as e:
            if e.errno not in _NO_RANGES:
                raise  # EIO, ENOSPC: the file fails now rather than at its flush
            self._ranges = False  # flushed whole by the policy's sync_data, as before
            return False
        return True


class Durability:
    """Per-file flushes (policy ``file``)."""

    def sync_data(self, fd: int) -> None:
        """Make the bytes written to ``fd`` durable (called before the file gets its name)."""
        os.fsync(fd)

    def sync_names(self, dir_fd: int) -> None:
        """Make names just linked into the directory ``dir_fd`` durable."""
        os.fsync(dir_fd)


class NoSync(Durability):
    """Leave flushing to the kernel's writeback (policy ``none``)."""

    def sync_data(self, fd: int) -> None:
        pass

    def sync_names(self, dir_fd: int) -> None:
        pass


def durability_for(mode: str) -> Durability:
    """The policy named ``mode``."""
    if mode not in DURABILITY_MODES:
        raise ValueError(f"unknown durability {mode!r}; choose one of {', '.join(DURABILITY_MODES)}")
    return NoSync() if mode == "none" else Durability()
