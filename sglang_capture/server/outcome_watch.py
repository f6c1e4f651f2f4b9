"""``OutcomeWatch`` (HTTP process): a capture response wakes when its writer's outcome record appears.

A client's capture request is answered only once its file is published, which the writer says by
renaming ``.index/<rid>.json`` into place (``core/capture_dir.record_outcome``; an empty
``<rid>.json.unrecorded`` when even that cannot be written). Polling for that record with a backoff
costs the HTTP process an open() per poll per waiting request, and each answer up to a poll
interval of latency. One inotify descriptor per HTTP process, read by its event loop, instead
wakes exactly the waiting response whose record was renamed in. A slow re-check (``RECHECK_S``)
covers a lost event; a dir that cannot be watched (a watch limit reached) is polled. On a network
filesystem (a capture dir shared by DP groups on several nodes, whose writers rename records in on
their own hosts) the wait also polls with the backoff it always had (2 ms doubling to 50 ms), and
where inotify is missing altogether (not Linux, or no descriptor left) it only polls.
"""
from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import errno
import json
import logging
import os
import re
import struct
import time
from typing import Any, Dict, List, Optional, Set, Tuple

from sglang_capture.core import protocol
from sglang_capture.core.capture_dir import UNRECORDED_SUFFIX

logger = logging.getLogger(__name__)

# <sys/inotify.h>
IN_CREATE, IN_MOVED_TO, IN_IGNORED, IN_Q_OVERFLOW = 0x100, 0x80, 0x8000, 0x4000
IN_NONBLOCK, IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC
_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

RECHECK_S = 1.0  # with inotify: the record is read again at least this often, for what it cannot see
POLL_FIRST_S, POLL_MAX_S = 0.002, 0.05  # without inotify, and on a network filesystem beside it
# filesystems where another host's writer (a DP group on another node) renames records in unseen by inotify here
NETWORK_FS = ("nfs", "nfs4", "cifs", "smb3", "smbfs", "lustre", "gpfs", "beegfs", "ceph", "glusterfs", "9p",
              "afs", "ocfs2", "gfs2", "pvfs2", "orangefs", "wekafs", "fuse")


_OCTAL = re.compile(r"\\([0-7]{3})")


def filesystem_type(path: str, mountinfo: str = "/proc/self/mountinfo") -> str:
    """The type of the filesystem ``path`` lies on (the longest mount point above it), '' when unknown."""
    try:
        real = os.path.realpath(path)
        best, fstype = "", ""
        with open(mountinfo) as f:
            for line in f:
                fields = line.split()
                sep = fields.index("-")
                point = _OCTAL.sub(lambda m: chr(int(m[1], 8)), fields[4])  # \040 a space, \134 a backslash...
                inside = real == point or real.startswith(point.rstrip("/") + "/")
                if inside and len(point) >= len(best):
                    best, fstype = point, fields[sep + 1]
        return fstype
    except (OSError, ValueError, IndexError):
        return ""


def is_network_fs(path: str) -> bool:
    """Whether records under ``path`` may be renamed in by another host (inotify here would not see them)."""
    fstype = filesystem_type(path)
    return fstype.split(".")[0] in NETWORK_FS


def _libc() -> Optional[ctypes.CDLL]:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.inotify_init1, libc.inotify_add_watch  # noqa: B018 - missing on a libc without inotify
        return libc
    except (OSError, AttributeError):
        return None


def _read_outcome(index_path: str) -> Optional[Dict[str, Any]]:
    """The record at ``index_path``, ``{}`` when only its ``.unrecorded`` marker is there, else None."""
    try:
        with open(index_path) as f:
            return json.load(f)
    except (FileNotFoundError, json.JSONDecodeError):
        return {} if os.path.exists(index_path + UNRECORDED_SUFFIX) else None


class OutcomeWatch:
    """The HTTP process's one inotify descriptor on the ``.index/`` dirs its responses wait on.

    Made in the event loop that answers requests; every waiter is a future of that loop, keyed by
    the record's watch descriptor and name."""

    def __init__(self, loop: asyncio.AbstractEventLoop, use_inotify: bool = True) -> None:
        self.loop = loop
        self._libc = _libc() if use_inotify else None
        self._fd: Optional[int] = None
        if self._libc is not None:
            fd = self._libc.inotify_init1(IN_NONBLOCK | IN_CLOEXEC)
            if fd >= 0:
                try:
                    loop.add_reader(fd, self._on_events)
                    self._fd = fd
                except Exception:  # noqa: BLE001 - a loop that cannot watch descriptors: poll
                    os.close(fd)
        self._dirs: Dict[bytes, int] = {}  # watched dir -> its watch descriptor
        self._wd_dirs: Dict[int, bytes] = {}
        self._remote: Dict[str, bool] = {}  # dir -> on a network filesystem
        self._waiters: Dict[Tuple[int, str], Set[asyncio.Future]] = {}
        self.watch_failures = 0  # dirs inotify would not watch (each such wait polls once, then asks again)

    @property
    def event_driven(self) -> bool:
        """Whether waits are woken by inotify (else they poll)."""
        return self._fd is not None

    def _watch(self, directory: str) -> Optional[int]:
        """The watch descriptor of ``directory``, added on first use; None when it cannot be watched."""
        if self._fd is None:
            return None
        key = os.fsencode(directory)
        wd = self._dirs.get(key)
        if wd is None:
            wd = self._libc.inotify_add_watch(self._fd, key, IN_MOVED_TO | IN_CREATE)
            if wd < 0:  # ENOSPC (watch limit), EACCES, ENOENT: the wait polls, and tries again next pass
                self.watch_failures += 1
                if self.watch_failures == 1:
                    err = ctypes.get_errno()
                    logger.warning("sglang_capture: cannot watch %s for capture outcomes (%s); responses waiting on it "
                                   "poll instead%s", directory, os.strerror(err),
                                   " (raise fs.inotify.max_user_watches)" if err == errno.ENOSPC else "")
                return None
            self._dirs[key], self._wd_dirs[wd] = wd, key
        return wd

    def _on_events(self) -> None:
        try:
            data = os.read(self._fd, 65536)
        except BlockingIOError:
            return
        except OSError as e:
            if e.errno != errno.EINTR:
                self._wake_all()
            return
        at = 0
        while at + _EVENT.size <= len(data):
            wd, mask, _cookie, size = _EVENT.unpack_from(data, at)
            name = data[at + _EVENT.size:at + _EVENT.size + size].split(b"\0", 1)[0].decode(errors="replace")
            at += _EVENT.size + size
            if mask & IN_Q_OVERFLOW:
                self._wake_all()
            elif mask & IN_IGNORED:  # the dir went away: the next wait watches it again
                self._dirs.pop(self._wd_dirs.pop(wd, b""), None)
                self._wake_all()
            else:
                if name.endswith(UNRECORDED_SUFFIX):
                    name = name[:-len(UNRECORDED_SUFFIX)]
                self._wake(self._waiters.get((wd, name), ()))

    @staticmethod
    def _wake(futures: Any) -> None:
        for fut in list(futures):
            if not fut.done():
                fut.set_result(None)

    def _wake_all(self) -> None:
        for futures in list(self._waiters.values()):
            self._wake(futures)

    async def wait(self, ref: Dict[str, Any], timeout_s: float) -> Dict[str, Any]:
        """``ref`` completed from its outcome record once the writer has written it; after
        ``timeout_s`` still ``pending``, saying where the file will appear."""
        path = ref["index"]
        deadline = time.monotonic() + timeout_s
        delay = POLL_FIRST_S
        directory, name = os.path.split(path)
        remote = self._remote.get(directory)
        if remote is None:
            remote = self._remote[directory] = is_network_fs(directory)
        key: Optional[Tuple[int, str]] = None
        fut: Optional[asyncio.Future] = None
        try:
            while True:
                # looked up on every pass: after close() or the dir's removal the watch is gone
                wd = self._watch(directory) if asyncio.get_running_loop() is self.loop else None
                key = (wd, name) if wd is not None else None
                fut = None
                if key is not None:
                    fut = self.loop.create_future()  # registered before the read: no rename falls between
                    self._waiters.setdefault(key, set()).add(fut)
                outcome = _read_outcome(path)
                if outcome is not None:
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    return {**ref, "status": "pending",
                            "error": f"not written after {timeout_s:g} s; the file appears at 'path' when done"}
                if fut is None:
                    await asyncio.sleep(min(delay, left))
                else:
                    try:
                        await asyncio.wait_for(fut, min(delay if remote else RECHECK_S, left))
                    except asyncio.TimeoutError:
                        pass
                    self._forget(key, fut)
                delay = min(delay * 2, POLL_MAX_S)
        finally:
            if fut is not None:
                self._forget(key, fut)
        if not outcome:
            return {**ref, "status": "error", "error": "the writer could not record this capture's outcome "
                    "(capture dir's filesystem full or unwritable): check whether 'path' exists"}
        return protocol.with_outcome(ref, outcome)

    def _forget(self, key: Tuple[int, str], fut: asyncio.Future) -> None:
        futures = self._waiters.get(key)
        if futures is not None:
            futures.discard(fut)
            if not futures:
                del self._waiters[key]

    def waiting(self) -> List[str]:
        """The record names responses are waiting on now (for tests and diagnostics)."""
        return sorted(name for (_wd, name), futures in self._waiters.items() if futures)

    def close(self) -> None:
        """Stop reading the descriptor and close it; waits in progress go on polling. From the
        loop's own thread, or once that loop is closed."""
        if self._fd is not None:
            if not self.loop.is_closed():
                self.loop.remove_reader(self._fd)
            os.close(self._fd)
            self._fd = None
        self._dirs.clear()
        self._wd_dirs.clear()
        if not self.loop.is_closed():
            self._wake_all()
