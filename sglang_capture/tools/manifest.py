"""The manifest of a sample directory: one JSON line per finished sample.

``manifest.jsonl`` lines are ``{"id", "file", "tokens", "bytes", "checksum", "line"}``
(``file`` relative to the directory, ``checksum`` = ``<algorithm>:<hex>`` of the file's bytes, core/checksum.py,
``line`` = the sample's line in the input). A line is appended only after its file is published,
so a line always names a complete file; a line torn by a crash is dropped on the next run, and a
published file whose line a crash lost is adopted by it (tools/extract.py: ``_resume``).
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import List, Optional, Tuple

from sglang_capture.core.durable import replace_atomic
from sglang_capture.core.names import FILE_SUFFIX

MANIFEST = "manifest.jsonl"


@dataclass(frozen=True)
class Entry:
    id: str
    file: str
    tokens: int
    bytes: int
    checksum: str
    line: int = 0


def read_manifest(directory: str) -> Tuple[List[Entry], List[str]]:
    """Entries in file order (duplicates kept, for ``verify``) and one line per unreadable line."""
    path = os.path.join(directory, MANIFEST)
    entries: List[Entry] = []
    problems: List[str] = []
    try:
        with open(path, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except FileNotFoundError:
        return entries, problems
    for number, text in enumerate(lines, start=1):
        if not text.strip():
            continue
        try:
            doc = json.loads(text)
            entries.append(Entry(str(doc["id"]), str(doc["file"]), int(doc["tokens"]), int(doc["bytes"]),
                                 str(doc["checksum"]), int(doc.get("line", 0))))
        except (ValueError, KeyError, TypeError):
            problems.append(f"{MANIFEST} line {number} is not a manifest entry"
                            + (" (torn by an interrupted run)" if number == len(lines) else ""))
    return entries, problems


def rewrite_manifest(directory: str, entries: List[Entry]) -> None:
    """Replace the manifest atomically (used when resuming, to drop torn or stale lines)."""
    text = "".join(json.dumps(asdict(e), sort_keys=True) + "\n" for e in entries)
    replace_atomic(os.path.join(directory, MANIFEST), lambda f: f.write(text.encode("utf-8")))


class ManifestWriter:
    """Appends entries, and a thread of its own puts them on disk; safe to call from several threads.

    ``append`` only queues its line and returns: extract's workers go on with their next sample.
    The committer writes whatever was appended since its last turn and fsyncs it, many lines at
    once. Neither the write nor the fsync happens in ``append``: under a load of concurrent file
    writes an fsync waits for their writeback, and a write to the manifest waits for the fsync
    running on it (r103's SmolLM2 ``extract`` on an H100 spent 65% of its workers' time waiting
    for fsyncs when each append waited for one; r105, with the fsync apart but the write still in
    ``append``, 70% waiting for the writes). ``close`` returns once every line is on disk, and
    raises when one could not be put there. A line queued or written but not yet on disk when the
    process dies is lost; its file is published and the next run adopts it (tools/extract.py)."""

    def __init__(self, directory: str) -> None:
        self._f = open(os.path.join(directory, MANIFEST), "a", encoding="utf-8")
        self._cond = threading.Condition()  # guards the queue and the flags below, never held for I/O
        self._queued: List[str] = []  # lines appended, not yet taken by the committer
        self._closing = False
        self._error: Optional[Tuple[int, str]] = None  # a write or fsync that failed (errno, why): raised by ``append``, ``close``
        self._committer = threading.Thread(target=self._commit_loop, name="manifest-fsync", daemon=True)
        self._committer.start()

    def append(self, entry: Entry) -> None:
        """Queue ``entry``'s line (never waits for the disk); raises when an earlier write or fsync failed."""
        line = json.dumps(asdict(entry), sort_keys=True) + "\n"
        with self._cond:
            self._raise_error()
            if self._closing:
                raise ValueError("the manifest is closed: no line can be added")
            self._queued.append(line)
            self._cond.notify()

    def _commit_loop(self) -> None:
        while True:
            with self._cond:
                while not self._queued and not self._closing:
                    self._cond.wait()
                if not self._queued:
                    return
                lines, self._queued = self._queued, []
            try:
                self._f.write("".join(lines))
                self._f.flush()
                os.fsync(self._f.fileno())
            except BaseException as e:  # noqa: BLE001 - whatever ends this thread must reach append and close
                with self._cond:
                    self._error = _failure(e)
                    self._cond.notify_all()
                return

    def close(self) -> None:
        """Return once every appended line is on disk (raises OSError naming why when it cannot be)."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._committer.join()
        try:
            self._f.close()
        except OSError as e:  # a line the failed commit left buffered: its error is the one raised
            if self._error is None:
                self._error = _failure(e)
        self._raise_error()

    def _raise_error(self) -> None:
        if self._error is not None:  # a new exception each time: no traceback keeps another thread's frames
            raise OSError(*self._error)


def _failure(e: BaseException) -> Tuple[int, str]:
    """(errno, why) of what kept the manifest off the disk: the OSError ``close`` and ``append`` raise."""
    return getattr(e, "errno", None) or 0, f"the manifest could not be put on disk: {getattr(e, 'strerror', None) or e}"


def sample_files(directory: str) -> List[str]:
    """A directory's sample files: manifest order when there is one, else sorted file names."""
    if os.path.exists(os.path.join(directory, MANIFEST)):
        entries, _ = read_manifest(directory)
        return [os.path.join(directory, e.file) for e in entries]
    return [os.path.join(directory, f) for f in sorted(os.listdir(directory))
            if f.endswith(FILE_SUFFIX) and not f.startswith(".")]
