"""Durable files: the one home of how this package's files reach the disk whole.

Two ways a file appears, both through a private temporary name so that no reader ever sees a
partial file:

- ``publish_new``: a new file under a name that must not exist yet (capture files, samples moved
  out of a server's capture dir). The temp file is flushed, then *linked* into place, which
  fails instead of replacing whatever took the name meanwhile; then the directory is flushed.
- ``replace_atomic``: a file that may already exist and is replaced whole (manifests, exported
  samples, outcome records, stats), with ``os.replace`` and, unless told not to, a flush of the
  file and of its directory.

Also here: temp files whose ownership can be proven. Each temp file is locked (``flock``) by the
process writing it from the moment it exists until its final name does, and the kernel drops the
lock when that process dies, however it dies: a temp file whose lock can be taken is an orphan.
Process ids cannot prove that: two servers in containers of one host share its host name, not
their pid namespace. Temp names still say their host (a capture dir may be shared by several
hosts, whose locks may not reach each other on a network filesystem mounted without them), and,
for people, the writing process.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import logging
import os
import socket
import time
import uuid
from typing import IO, Callable, Iterator, Optional, Tuple, TypeVar, Union

T = TypeVar("T")
logger = logging.getLogger(__name__)
CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
TEMP_SUFFIX = ".part"


def host_tag() -> str:
    """This host, as a token without dots: ``h`` and 8 hex digits of its name's SHA-256."""
    return "h" + hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


# How long a lock of this package is waited for before the wait fails with a message (every lock
# here is held for a short step: a clean-up's check, another start-up's stats retirement).
LOCK_TIMEOUT_S = 60.0


class LockTimeout(TimeoutError):
    """A lock was not had within its bound; the message says which and what holds it up."""

    def __str__(self) -> str:  # the one line users see, without "[Errno 110]"
        return self.strerror or super().__str__()


def lock_within(fd: int, what: str, timeout_s: float = LOCK_TIMEOUT_S, shared: bool = False,
                max_delay_s: float = 0.1) -> None:
    """Take the exclusive (``shared``: shared) ``flock`` of ``fd`` within ``timeout_s``, or raise
    LockTimeout naming ``what``. Never blocks unbounded: a lock held forever (a second open of a
    file this process has locked, a hung peer) becomes a one-line error instead of a silent hang.
    Logs one line when the wait passes a second, so a person watching knows what it waits for.
    ``max_delay_s``: the longest pause between tries (short where holders come and go quickly)."""
    deadline = time.monotonic() + timeout_s
    delay, told = min(0.005, max_delay_s), False
    mode = fcntl.LOCK_SH if shared else fcntl.LOCK_EX
    while True:
        try:
            fcntl.flock(fd, mode | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):  # EACCES: how some mounts say "held"
                raise
        left = deadline - time.monotonic()
        if left <= 0:
            raise LockTimeout(errno.ETIMEDOUT, f"waited {timeout_s:g} s for the lock on {what}, which another "
                                               "process holds")
        if not told and timeout_s - left >= 1.0:
            logger.warning("sglang_capture: waiting for the lock on %s (held by another process; at most %g s)",
                           what, timeout_s)
            told = True
        time.sleep(min(delay, left))
        delay = min(delay * 2, max_delay_s)


@contextlib.contextmanager
def held_lock(name: str, dir_fd: Optional[int], what: str, shared: bool = False,
              timeout_s: float = LOCK_TIMEOUT_S, max_delay_s: float = 0.1) -> Iterator[None]:
    """Hold the ``flock`` of the lock file ``name`` (in ``dir_fd``; created if missing) for the
    ``with`` block (``lock_within``). A filesystem without locks is taken as it is."""
    fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640, dir_fd=dir_fd)
    try:
        try:
            lock_within(fd, what, timeout_s, shared, max_delay_s)
        except OSError as e:
            if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
                raise
        yield
    finally:
        os.close(fd)


def create_owned(name: str, dir_fd: Optional[int] = None, mode: int = 0o640) -> int:
    """Create ``name`` (it must not exist) for writing, locked by this process until the
    descriptor is closed: proof that its writer is alive (``remove_unowned``)."""
    fd = os.open(name, CREATE_FLAGS, mode, dir_fd=dir_fd)
    try:  # only a clean-up judging the fresh file (``take_lock``) can hold it, for a moment
        lock_within(fd, f"the new file {name}")
    except BaseException as e:
        if isinstance(e, OSError) and e.errno in (errno.ENOLCK, errno.EOPNOTSUPP):
            return fd  # a mount without locks: the file is still written
        os.close(fd)
        unlink_quietly(name, dir_fd)
        raise
    return fd


def take_lock(name: str, dir_fd: Optional[int] = None) -> Union[int, None, bool]:
    """A descriptor of ``name`` with its lock taken by this process; None when there is no such
    file; False when a live process holds the lock, or it cannot be judged (no permission, a
    filesystem without locks): such a file is kept. Opened for writing: NFS emulates ``flock``
    with byte-range locks, which need it."""
    try:
        fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # BlockingIOError: its owner lives
        os.close(fd)
        return False
    return fd


def remove_unowned(name: str, dir_fd: Optional[int] = None, min_age_s: float = 0.0) -> bool:
    """Remove ``name`` if no process holds its lock and it is at least ``min_age_s`` old (a file
    is unlocked for the moment between its creation and its lock); returns whether it was removed."""
    fd = take_lock(name, dir_fd)
    if fd is None or fd is False:  # gone, or its writer runs
        return False
    try:
        if time.time() - os.fstat(fd).st_mtime < min_age_s:
            return False
        os.unlink(name, dir_fd=dir_fd)  # temp names are unique: this name is still the file locked
        return True
    except FileNotFoundError:
        return False
    finally:
        os.close(fd)


def temp_name(name: str) -> str:
    """``<name>.<host>.<pid>.<random>.part``: the host whose start-up clean-up may judge it
    (capture_dir.remove_orphans), the writing process's id for people reading the folder."""
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
                sync_names: Optional[Callable[[int], None]] = None,
                created: Optional[Callable[[str], None]] = None,
                before_link: Optional[Callable[[int, T], None]] = None) -> T:
    """Create ``name`` (in ``dir_fd``, else relative to the cwd) with what ``write`` puts into a
    binary file, never replacing an existing file; returns what ``write`` returned.

    The temp file lives in ``tmp_dir_fd`` (default: beside ``name``; it must be on the same
    filesystem); ``created(temp name)`` is called just before it is created. ``sync_data(fd)`` runs once the
    bytes are written, before the name appears (default: fsync of the file); ``before_link(fd,
    result)`` last before the name appears, when the file is whole and flushed; ``sync_names(dir_fd)``
    after (default: fsync of the directory). Raises FileExistsError when the name is taken; leaves
    nothing behind on any failure, the name included when its flush fails. The temp file stays
    locked (``create_owned``) until it has its name."""
    tmp_dir = tmp_dir_fd if tmp_dir_fd is not None else dir_fd
    tmp = temp_name(os.path.basename(name)) if tmp_dir is not None else temp_name(name)
    if created is not None:
        # said before it exists: one who stops this process the moment the file appears still knows its name
        created(tmp)
    try:
        with os.fdopen(create_owned(tmp, tmp_dir), "wb", buffering=1 << 20) as f:
            result = write(f)
            f.flush()
            (sync_data or os.fsync)(f.fileno())
            if before_link is not None:
                before_link(f.fileno(), result)
            st = os.fstat(f.fileno())
            try:
                os.link(tmp, name, src_dir_fd=tmp_dir, dst_dir_fd=dir_fd, follow_symlinks=False)
            except FileExistsError:
                raise FileExistsError(f"{name} already exists") from None
        try:
            if sync_names is None:
                _sync_dir_of(name, dir_fd)
            else:
                sync_names(dir_fd)
        except BaseException:
            unlink_if_same(name, dir_fd, (st.st_dev, st.st_ino))  # an outcome of error never beside a file
            raise
    finally:
        unlink_quietly(tmp, tmp_dir)
    return result


def unlink_if_same(name: str, dir_fd: Optional[int], identity: Tuple[int, int]) -> None:
    """Remove ``name`` if it is still the file of that (device, inode): never another one that took the name."""
    try:
        now = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == identity:
            os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


def replace_atomic(name: str, write: Callable[[IO[bytes]], object], *, dir_fd: Optional[int] = None,
                   sync: bool = True) -> None:
    """Replace ``name`` (in ``dir_fd``, else relative to the cwd) whole with what ``write`` puts
    into a binary file. With ``sync`` the file and then its directory are flushed first and after,
    so a crash leaves the old file or the new one; without, only readers are protected."""
    tmp = temp_name(name)
    try:
        with os.fdopen(create_owned(tmp, dir_fd), "wb") as f:
            write(f)
            f.flush()
            if sync:
                os.fsync(f.fileno())
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        if sync:
            _sync_dir_of(name, dir_fd)
    finally:
        unlink_quietly(tmp, dir_fd)  # already gone after a replace; the name is unique, so no race
