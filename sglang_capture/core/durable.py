"""Durable files: the one home of how this package's files reach the disk whole.

Two ways a file appears, both through a private temporary name so that no reader ever sees a
partial file:

- ``publish_new``: a new file under a name that must not exist yet (capture files, samples moved
  out of a server's capture dir). The temp file is flushed, then *linked* into place, which
  fails instead of replacing whatever took the name meanwhile; then the directory is flushed.
- ``replace_atomic``: a file that may already exist and is replaced whole (manifests, exported
  samples, outcome records, stats), with ``os.replace`` and, unless told not to, a flush of the
  file and of its directory.

Also here: the ``sha256:<hex>`` tag every checksum in this package uses, and temp names that
say which host and process own them (a capture dir may be shared by several hosts).
"""
from __future__ import annotations

import hashlib
import os
import socket
import uuid
from typing import IO, Callable, Optional, TypeVar

T = TypeVar("T")
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
TEMP_SUFFIX = ".part"


def checksum_tag(digest: hashlib._Hash) -> str:
    """``sha256:<hex>``: how capture references, manifests and the seam table write a digest."""
    return f"{digest.name}:{digest.hexdigest()}"


def host_tag() -> str:
    """This host, as a token without dots: ``h`` and 8 hex digits of its name's SHA-256."""
    return "h" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def temp_name(name: str) -> str:
    """``<name>.<host>.<pid>.<random>.part``: host and pid say whose file it is, so a start-up
    clean-up removes only temp files of this host's dead processes (capture_dir.remove_orphans)."""
    return f"{name}.{host_tag()}.{os.getpid()}.{uuid.uuid4().hex}{TEMP_SUFFIX}"


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


def _sync_dir_of(name: str, dir_fd: Optional[int]) -> None:
    if dir_fd is not None:
        os.fsync(dir_fd)
    else:
        fsync_dir(os.path.dirname(os.path.abspath(name)))


def publish_new(name: str, write: Callable[[IO[bytes]], T], *, dir_fd: Optional[int] = None,
                tmp_dir_fd: Optional[int] = None, sync_data: Optional[Callable[[int], None]] = None,
                sync_names: Optional[Callable[[int], None]] = None) -> T:
    """Create ``name`` (in ``dir_fd``, else relative to the cwd) with what ``write`` puts into a
    binary file, never replacing an existing file; returns what ``write`` returned.

    The temp file lives in ``tmp_dir_fd`` (default: beside ``name``; it must be on the same
    filesystem). ``sync_data(fd)`` runs once the bytes are written, before the name appears
    (default: fsync of the file); ``sync_names(dir_fd)`` after (default: fsync of the directory). Raises FileExistsError
    when the name is taken; leaves nothing behind on any failure."""
    tmp_dir = tmp_dir_fd if tmp_dir_fd is not None else dir_fd
    tmp = temp_name(os.path.basename(name)) if tmp_dir is not None else temp_name(name)
    try:
        fd = os.open(tmp, CREATE_FLAGS, 0o640, dir_fd=tmp_dir)
        with os.fdopen(fd, "wb", buffering=1 << 20) as f:
            result = write(f)
            f.flush()
            (sync_data or os.fsync)(f.fileno())
        try:
            os.link(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=dir_fd, follow_symlinks=False)
        except FileExistsError:
            raise FileExistsError(f"{name} already exists") from None
        if sync_names is None:
            _sync_dir_of(name, dir_fd)
        else:
            sync_names(dir_fd)
    finally:
        unlink_quietly(tmp, tmp_dir)
    return result


def replace_atomic(name: str, write: Callable[[IO[bytes]], object], *, dir_fd: Optional[int] = None,
                   sync: bool = True) -> None:
    """Replace ``name`` (in ``dir_fd``, else relative to the cwd) whole with what ``write`` puts
    into a binary file. With ``sync`` the file and then its directory are flushed first and after,
    so a crash leaves the old file or the new one; without, only readers are protected."""
    tmp = temp_name(name)
    try:
        fd = os.open(tmp, CREATE_FLAGS, 0o640, dir_fd=dir_fd)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if sync:
            _sync_dir_of(name, dir_fd)
    finally:
        unlink_quietly(tmp, dir_fd)  # already gone after a replace; the name is unique, so no race
