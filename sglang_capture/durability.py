"""Durability: how a written capture file, and then its published name, reach stable storage.

A writer process calls ``sync_data(fd)`` after a file's bytes are written and before its final
name appears, and ``sync_names(dir_fd)`` after the name appears and before the request's outcome
says ``ok``. Three policies:

- ``file`` (default): ``fsync`` the file, then the capture directory: two flushes per file, each
  waiting on the disk.
- ``group``: the same guarantees through ``syncfs(2)``, one flush shared by every caller waiting
  when it starts (group commit, as databases do for their logs). Callers are the threads of one
  process, and a writer process writes one file at a time, so since the writers became
  processes each file pays its own ``syncfs``; it still helps where ``fsync`` itself is slow.
  It also flushes whatever else is dirty on that filesystem, which is why it is not the default.
- ``none``: no flush. Files are still whole when they appear and survive the server being
  killed, but a power loss or kernel crash can lose or truncate the last files written, and
  under live traffic the kernel's writeback bursts stalled other requests (bench/RESULTS.md,
  fifth round). For tmpfs or data that is cheap to re-capture.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import os
import platform
import threading
from typing import Callable, Optional

logger = logging.getLogger(__name__)

DURABILITY_MODES = ("group", "file", "none")


class Durability:
    """Per-file flushes (policy ``file``); the base the other policies override."""

    name = "file"

    def sync_data(self, fd: int) -> None:
        """Make the bytes written to ``fd`` durable (called before the file gets its name)."""
        os.fsync(fd)

    def sync_names(self, dir_fd: int) -> None:
        """Make names just linked into the directory ``dir_fd`` durable."""
        os.fsync(dir_fd)


class NoSync(Durability):
    """Leave flushing to the kernel's writeback (policy ``none``)."""

    name = "none"

    def sync_data(self, fd: int) -> None:
        pass

    def sync_names(self, dir_fd: int) -> None:
        pass


def _load_syncfs() -> Optional[Callable[[int], None]]:
    """libc's syncfs(2), or None where it is missing or does not report writeback errors
    (Linux before 5.8 returned success even when writeback had failed)."""
    if platform.system() != "Linux":
        return None
    try:
        major, minor = (int(x) for x in platform.release().split(".")[:2])
    except ValueError:
        return None
    if (major, minor) < (5, 8):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int

    def syncfs(fd: int) -> None:
        if fn(fd) != 0:  # ctypes drops the GIL for the call
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return syncfs


class _Batch:
    __slots__ = ("done", "error")

    def __init__(self) -> None:
        self.done = False
        self.error: Optional[OSError] = None


class GroupSync(Durability):
    """Group commit: callers that arrive while a flush runs wait for it to end, and the first of
    them then runs one flush for all of them together.

    A caller only returns after a flush that *started after it arrived* has completed, so its own
    writes (or links) are covered; a failed flush fails every caller of that batch. ``flush`` is
    any call that makes the whole filesystem of its descriptor durable (syncfs(2) by default).
    """

    name = "group"

    def __init__(self, flush: Callable[[int], None]) -> None:
        self._flush = flush
        self._cond = threading.Condition()
        self._running = False
        self._pending = _Batch()
        self.flushes = 0  # for benchmarks and tests: how many flushes served the callers

    def _sync(self, fd: int) -> None:
        with self._cond:
            batch = self._pending
            while not batch.done:
                if self._running:
                    self._cond.wait()
                    continue
                self._running = True
                self._pending = _Batch()  # later arrivals wait for the next flush
                self._cond.release()
                try:
                    self._flush(fd)
                except Exception as e:  # every caller of the batch must learn of it, whatever it is
                    batch.error = e if isinstance(e, OSError) else OSError(errno.EIO, str(e))
                finally:
                    self._cond.acquire()
                    self.flushes += 1
                    batch.done = True
                    self._running = False
                    self._cond.notify_all()
            if batch.error is not None:
                raise OSError(batch.error.errno, f"flushing the capture filesystem failed: {batch.error.strerror}")

    sync_data = _sync
    sync_names = _sync


def durability_for(mode: str) -> Durability:
    """The policy named ``mode``; ``group`` falls back to ``file`` where syncfs(2) cannot be trusted."""
    if mode == "none":
        return NoSync()
    if mode == "group":
        syncfs = _load_syncfs()
        if syncfs is not None:
            return GroupSync(syncfs)
        logger.warning("sglang_capture: syncfs(2) with error reporting needs Linux >= 5.8; "
                       "flushing each file instead (--capture-durability file)")
    if mode not in DURABILITY_MODES:
        raise ValueError(f"unknown durability {mode!r}; choose one of {', '.join(DURABILITY_MODES)}")
    return Durability()
