"""Publishing: one capture file into the capture dir, and each request's outcome record.

A file is encoded (format.py) into a private temp file under ``.tmp/``, made durable
(durability.py) and published with ``os.link`` into its final name, which never replaces an
existing file: a reader sees either no file or a whole one. The outcome of every request (ok or
error, bytes, checksum) then goes to ``.index/<rid>.json``, which the server's HTTP process waits
on before it answers the client. Files are written by the writer processes
(writer_process.py); outcome records by the scheduler process (writer.py).
"""
from __future__ import annotations

import errno
import hashlib
import json
import os
import socket
import time
import uuid
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from sglang_capture.durability import Durability
from sglang_capture.format import Codec, HostTensor, write_capture
from sglang_capture.naming import FILE_SUFFIX, name_for_rid

TMP_DIR = ".tmp"
INDEX_DIR = ".index"
UNRECORDED_SUFFIX = ".unrecorded"  # empty marker next to an outcome record that could not be written

_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def index_path(capture_dir: str, rid: str) -> str:
    """Where the outcome of request ``rid`` is recorded."""
    return os.path.join(capture_dir, INDEX_DIR, name_for_rid(rid) + ".json")


def prepare_capture_dir(capture_dir: str) -> None:
    """Create the private temp and index folders, refusing ones that are symlinks or not folders."""
    for sub in (TMP_DIR, INDEX_DIR):
        path = os.path.join(capture_dir, sub)
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        if os.path.islink(path) or not os.path.isdir(path):
            raise OSError(f"{path} must be a real directory (found a symlink or a file)")


def fsync_dir(path: str) -> None:
    """Make a rename or link inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def unlink_quietly(name: str, dir_fd: Optional[int] = None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def host_tag() -> str:
    """This host, as a token without dots: ``h`` and 8 hex digits of its name's SHA-256."""
    return "h" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def _temp_name(name: str) -> str:
    """``<name>.<host>.<pid>.<random>.part``: host and pid tell ``remove_orphans`` whose file it is
    (a capture dir may be shared by several hosts, whose pids mean nothing here)."""
    return f"{name}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex}.part"


def _pid_running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def remove_orphans(dirs: DirFds) -> int:
    """Remove temp files left in ``.tmp/`` and ``.index/`` by this host's processes that no longer
    run (a server killed mid-write); returns how many. Files of a live process, or of another host
    sharing the directory, are kept."""
    removed, here = 0, host_tag()
    for dir_fd in (dirs.tmp, dirs.index):
        for entry in os.listdir(dir_fd):
            parts = entry.split(".")
            if (len(parts) < 5 or parts[-1] != "part" or parts[-4] != here or not parts[-3].isdigit()
                    or _pid_running(int(parts[-3]))):
                continue
            try:
                os.unlink(entry, dir_fd=dir_fd)
                removed += 1
            except FileNotFoundError:
                pass
    return removed


def write_json_atomic(dir_fd: int, name: str, doc: Dict[str, Any]) -> None:
    """Write ``doc`` as ``name`` in ``dir_fd`` so that no reader sees a partial document."""
    tmp = _temp_name(name)
    fd = os.open(tmp, _CREATE, 0o640, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    finally:
        unlink_quietly(tmp, dir_fd)  # already gone after a replace; the name is unique, so no race


@dataclass(frozen=True)
class DirFds:
    """The capture dir and its private folders, opened once: every later create, link and
    rename goes through these descriptors, so a symlink planted in the capture dir after start
    cannot redirect a write (and ``O_NOFOLLOW`` refuses one planted before)."""

    capture: int
    tmp: int
    index: int

    @classmethod
    def open(cls, capture_dir: str) -> "DirFds":
        prepare_capture_dir(capture_dir)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        top = os.open(capture_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(top, os.open(TMP_DIR, flags, dir_fd=top), os.open(INDEX_DIR, flags, dir_fd=top))


def record_outcome(dirs: DirFds, rid: str, outcome: Dict[str, Any]) -> None:
    """Write ``.index/<rid>.json``. When even that fails (a full filesystem), leave an empty
    ``.unrecorded`` marker, which may still fit: it ends the waiting response's wait at once
    (it would otherwise wait --capture-wait-timeout). Raises the record's OSError."""
    name = name_for_rid(rid) + ".json"
    try:
        write_json_atomic(dirs.index, name, outcome)
    except OSError:
        try:
            os.close(os.open(name + UNRECORDED_SUFFIX, _CREATE, 0o640, dir_fd=dirs.index))
        except OSError:
            pass
        raise


def error_text(e: BaseException) -> str:
    """``Type: reason`` for an outcome record (OSError's strerror without the errno noise)."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"{type(e).__name__}: {reason}"


def publish(dirs: DirFds, name: str, meta: Mapping[str, Any], tensors: Mapping[str, HostTensor], codec: Codec,
            durability: Durability, keep_page_cache: bool = False) -> Tuple[int, str, Dict[str, float]]:
    """Encode ``tensors`` into ``<name>.capture.msgpack`` and publish it; returns its size,
    checksum and stage timings. Raises on failure, leaving no file behind.

    Unless ``keep_page_cache``, the file's pages leave the page cache once flushed: at 1.4 GB/s
    of captures the cache otherwise grows until the kernel must reclaim memory for every other
    allocation on the host, the server's included, and nothing reads these files back soon."""
    tmp = _temp_name(name)
    t0 = time.monotonic()
    try:
        fd = os.open(tmp, _CREATE, 0o640, dir_fd=dirs.tmp)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            nbytes, checksum = write_capture(f, meta, tensors, codec)
            f.flush()
            t_encoded = time.monotonic()
            durability.sync_data(f.fileno())
            if not keep_page_cache:
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)  # flushed pages go; dirty ones start writeback
        try:
            os.link(tmp, name + FILE_SUFFIX, src_dir_fd=dirs.tmp, dst_dir_fd=dirs.capture, follow_symlinks=False)
        except FileExistsError:
            raise FileExistsError(errno.EEXIST, f"a capture file named {name!r} already exists") from None
        durability.sync_names(dirs.capture)
    finally:
        unlink_quietly(tmp, dirs.tmp)
    return nbytes, checksum, {"encode_write_s": t_encoded - t0, "fsync_publish_s": time.monotonic() - t_encoded}
