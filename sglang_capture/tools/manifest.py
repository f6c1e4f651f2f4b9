"""The manifest of a sample directory: one JSON line per finished sample.

``manifest.jsonl`` lines are ``{"id", "file", "tokens", "bytes", "checksum", "line"}``
(``file`` relative to the directory, ``checksum`` = ``<algorithm>:<hex>`` of the file's bytes, core/checksum.py,
``line`` = the sample's line in the input). A line is appended, flushed and fsynced only after
its file is published, so a line always names a complete file; a line torn by a crash is
dropped on the next run.
"""
from __future__ import annotations

import json
import os
import threading
from dataclasses import asdict, dataclass
from typing import List, Tuple

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
    """Appends entries durably; safe to call from several threads.

    ``append`` returns once its line is on disk. Appenders that arrive while an fsync runs share
    the next one (group commit): an fsync per appender, made one at a time, would cap extract
    at the disk's rate of serial fsyncs, whatever the server's speed."""

    def __init__(self, directory: str) -> None:
        self._f = open(os.path.join(directory, MANIFEST), "a", encoding="utf-8")
        self._write_lock = threading.Lock()  # guards the file object and ``_written``
        self._sync_lock = threading.Lock()  # one fsync at a time; guards ``_synced``
        self._written = 0  # lines written and flushed to the kernel
        self._synced = 0  # lines known to be on disk

    def append(self, entry: Entry) -> None:
        with self._write_lock:
            self._f.write(json.dumps(asdict(entry), sort_keys=True) + "\n")
            self._f.flush()
            self._written += 1
            mine = self._written
        with self._sync_lock:
            if self._synced >= mine:  # an fsync that began after this line was flushed covered it
                return
            with self._write_lock:
                upto = self._written
            os.fsync(self._f.fileno())
            self._synced = upto

    def close(self) -> None:
        self._f.close()


def sample_files(directory: str) -> List[str]:
    """A directory's sample files: manifest order when there is one, else sorted file names."""
    if os.path.exists(os.path.join(directory, MANIFEST)):
        entries, _ = read_manifest(directory)
        return [os.path.join(directory, e.file) for e in entries]
    return [os.path.join(directory, f) for f in sorted(os.listdir(directory))
            if f.endswith(FILE_SUFFIX) and not f.startswith(".")]
