"""Capture attempts of ``extract`` runs: names that say which run made them, and a clean-up that
removes only attempts whose run is gone.

An attempt is a file a server published under ``<sample id>.try-<run>-<nonce>`` that its run has
not yet moved to its sample name (the run died, or the attempt was retried). Several runs may
share a server, and so its capture dir. While a run lives it holds a lock (``flock``) on
``<dir>/.extract-runs/<run>.lock`` in every capture dir it uses; the kernel drops the lock when the
run dies, however it dies. So an attempt of another run is removed only when that run's lock can
be taken, or is gone; attempts named before runs were tagged are removed as before.

On a network filesystem the locks reach other hosts only where the mount supports locking.
"""
from __future__ import annotations

import os
import uuid
from typing import Dict, Iterable, List, Optional, Tuple

from sglang_capture.core.durable import LOCK_TIMEOUT_S, lock_within, take_lock, unlink_quietly
from sglang_capture.core.names import FILE_SUFFIX

ATTEMPT_TAG = ".try-"
RUNS_DIR = ".extract-runs"


def attempt_run(name: str) -> Optional[str]:
    """The run tag in an attempt's file name; "" for an untagged (older) attempt; None if ``name``
    is no attempt."""
    if not name.endswith(FILE_SUFFIX) or ATTEMPT_TAG not in name:
        return None
    tail = name[name.rindex(ATTEMPT_TAG) + len(ATTEMPT_TAG):-len(FILE_SUFFIX)]
    run, sep, _ = tail.partition("-")
    return run if sep else ""


def _run_alive(directory: str, run: str) -> bool:
    """Whether ``run`` still holds its lock in ``directory``; a dead run's lock file is removed."""
    path = os.path.join(directory, RUNS_DIR, run + ".lock")
    fd = take_lock(path)
    if fd is False:
        return True
    if fd is not None:
        unlink_quietly(path)  # while locked: its owner re-checks the path after locking (RunLocks.acquire)
        os.close(fd)
    return False


def _identity(directory: str) -> Tuple[int, int]:
    """What makes two names of one directory (``/x/cap``, ``/x/cap/``, a symlink to it) one."""
    st = os.stat(directory)
    return st.st_dev, st.st_ino


def _unique_dirs(directories: Iterable[str]) -> List[str]:
    """``directories`` with each directory once, however it is named (unreadable names kept)."""
    seen, out = set(), []
    for d in directories:
        try:
            key: object = _identity(d)
        except OSError:
            key = d
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


class RunLocks:
    """One extract run's identity and its locks in the capture dirs it uses."""

    def __init__(self, lock_timeout_s: float = LOCK_TIMEOUT_S) -> None:
        self.run = uuid.uuid4().hex[:12]
        self.lock_timeout_s = lock_timeout_s
        self._fds: Dict[Tuple[int, int], Tuple[str, int]] = {}  # directory identity -> (its name, lock fd)

    def acquire(self, directory: str) -> None:
        """Hold this run's lock in ``directory`` (raises OSError if it cannot, LockTimeout when
        the lock stays held past its bound). A directory already locked under another name is
        recognised by its device and inode: ``flock`` locks belong to an open file description,
        so a second open of the same lock file would wait on the first."""
        key = _identity(directory)
        if key in self._fds:
            return
        runs = os.path.join(directory, RUNS_DIR)
        os.makedirs(runs, mode=0o700, exist_ok=True)
        path = os.path.join(runs, self.run + ".lock")
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:  # held for a moment by another run judging whether this run lives (_run_alive)
                lock_within(fd, path, self.lock_timeout_s)
            except BaseException:
                os.close(fd)
                raise
            try:  # another run may have judged the fresh file dead and removed it meanwhile
                if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        self._fds[key] = (directory, fd)

    def release(self) -> None:
        """Remove this run's lock files and drop the locks."""
        for d, fd in self._fds.values():
            unlink_quietly(os.path.join(d, RUNS_DIR, self.run + ".lock"))
            os.close(fd)
        self._fds.clear()

    def attempt_name(self, sample_id: str) -> str:
        """A fresh capture name for one attempt at ``sample_id``."""
        return f"{sample_id}{ATTEMPT_TAG}{self.run}-{uuid.uuid4().hex[:8]}"

    def remove_leftovers(self, directories: Iterable[str], own: bool = False) -> int:
        """Delete attempts that never became samples: those of runs that are gone (and untagged
        ones), and with ``own`` this run's (at its end); returns how many."""
        removed = 0
        for d in _unique_dirs(directories):
            try:
                names = os.listdir(d)
            except OSError:
                continue
            try:  # every other run's lock, dead ones removed (also those that left no attempt)
                locks = [n[:-len(".lock")] for n in os.listdir(os.path.join(d, RUNS_DIR)) if n.endswith(".lock")]
            except OSError:
                locks = []
            # listed after the attempts: a run with an attempt above had its lock before it
            alive = {run for run in locks if run != self.run and _run_alive(d, run)}
            for name in names:
                run = attempt_run(name)
                if run is None or run in alive or (run == self.run and not own):
                    continue
                try:
                    os.unlink(os.path.join(d, name))
                    removed += 1
                except FileNotFoundError:
                    pass
        return removed
