"""Durability: how a written capture file, and then its published name, reach stable storage.

A writer process calls ``sync_data(fd)`` after a file's bytes are written and before its final
name appears, and ``sync_names(dir_fd)`` after the name appears and before the request's outcome
says ``ok``. Two policies:

- ``file`` (default): ``fsync`` the file, then the capture directory: two flushes per file, each
  waiting on the disk.
- ``none``: no flush. Files are still whole when they appear and survive the server being
  killed, but a power loss or kernel crash can lose or truncate the last files written, and
  under live traffic the kernel's writeback bursts stalled other requests (bench/RESULTS.md,
  "Design choices"). For tmpfs or data that is cheap to re-capture.
"""
from __future__ import annotations

import os

from sglang_capture.core.config import DURABILITY_MODES


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
