"""The layout of a capture dir, which the HTTP process, the schedulers, the writer processes and
the offline tools all read or write.

- ``<name>.capture.msgpack``: published capture files (writer/capture_file.py).
- ``.tmp/``: files being written, under temp names that say their host and process, each locked
  by its writer (core/durable.py) until it has its final name.
- ``.index/<rid-name>.json``: each request's outcome (ok or error, bytes, checksum), which the
  HTTP process waits on before it answers; ``.unrecorded`` beside it when even that failed.
- ``.index/writer-<pid>.json``: the stats of each scheduler process that writes, for monitoring.
"""
from __future__ import annotations

import glob
import json
import os
from dataclasses import dataclass
from typing import Any, Dict

from sglang_capture.core.durable import CREATE_FLAGS, TEMP_SUFFIX, host_tag, remove_unowned, replace_atomic
from sglang_capture.core.names import name_for_rid

TMP_DIR = ".tmp"
INDEX_DIR = ".index"
UNRECORDED_SUFFIX = ".unrecorded"  # empty marker next to an outcome record that could not be written
STATS_PREFIX = "writer-"


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


@dataclass(frozen=True)
class DirFds:
    """The capture dir and its private folders, opened once: every later create, link and
    rename goes through these descriptors, so a symlink planted in the capture dir after start
    cannot redirect a write (and ``O_NOFOLLOW`` refuses one planted before)."""

    capture: int
    tmp: int
    index: int

    @classmethod
    def open(cls, capture_dir: str) -> DirFds:
        prepare_capture_dir(capture_dir)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        top = os.open(capture_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(top, os.open(TMP_DIR, flags, dir_fd=top), os.open(INDEX_DIR, flags, dir_fd=top))


# A temp file is unlocked for a moment after its creation; a rank's peer marker (server/peers.py)
# lives unlocked until global rank 0 has seen it, within the 60 s the ranks wait for each other.
ORPHAN_MIN_AGE_S = 120.0


def remove_orphans(dirs: DirFds, min_age_s: float = ORPHAN_MIN_AGE_S) -> int:
    """Remove temp files left in ``.tmp/`` and ``.index/`` by this host's processes that died
    mid-write (a killed server); returns how many. Proof of death is the file's lock, which its
    writer holds (core/durable.create_owned), not its process id: servers in containers share a
    host name but not pid namespaces. Locked files, files younger than ``min_age_s`` and other
    hosts' files are kept."""
    removed, here = 0, host_tag()
    for dir_fd in (dirs.tmp, dirs.index):
        for entry in os.listdir(dir_fd):
            parts = entry.split(".")
            if len(parts) < 5 or "." + parts[-1] != TEMP_SUFFIX or parts[-4] != here:
                continue
            removed += remove_unowned(entry, dir_fd, min_age_s)
    return removed


def _write_json(doc: Dict[str, Any]):
    return lambda f: f.write(json.dumps(doc).encode())


def record_outcome(dirs: DirFds, rid: str, outcome: Dict[str, Any]) -> None:
    """Write ``.index/<rid>.json``. When even that fails (a full filesystem), leave an empty
    ``.unrecorded`` marker, which may still fit: it ends the waiting response's wait at once
    (it would otherwise wait --capture-wait-timeout). Raises the record's OSError.

    Not flushed: the record only tells the waiting response what happened; the file it reports
    was made durable before (per ``--capture-durability``), and a lost record costs no data."""
    name = name_for_rid(rid) + ".json"
    try:
        replace_atomic(name, _write_json(outcome), dir_fd=dirs.index, sync=False)
    except OSError:
        try:
            os.close(os.open(name + UNRECORDED_SUFFIX, CREATE_FLAGS, 0o640, dir_fd=dirs.index))
        except OSError:
            pass
        raise


def error_text(e: BaseException) -> str:
    """``Type: reason`` for an outcome record (OSError's strerror without the errno noise)."""
    reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"{type(e).__name__}: {reason}"


def write_stats(dirs: DirFds, doc: Dict[str, Any]) -> None:
    """Replace this process's ``.index/writer-<pid>.json`` (monitoring; not flushed)."""
    replace_atomic(f"{STATS_PREFIX}{os.getpid()}.json", _write_json(doc), dir_fd=dirs.index, sync=False)


def writer_stats(capture_dir: str) -> Dict[str, Dict[str, Any]]:
    """Every writer stats file in ``capture_dir``, by path: one per writer rank (DP ranks and
    nodes sharing the dir each keep their own)."""
    out = {}
    for path in glob.glob(os.path.join(capture_dir, INDEX_DIR, STATS_PREFIX + "*.json")):
        with open(path) as f:
            out[path] = json.load(f)
    return out


def read_stats(capture_dir: str) -> Dict[str, Any]:
    """The newest writer stats file in ``capture_dir`` ({} before the first file; a server that
    ran there before may have left its own)."""
    files = glob.glob(os.path.join(capture_dir, INDEX_DIR, STATS_PREFIX + "*.json"))
    if not files:
        return {}
    with open(max(files, key=os.path.getmtime)) as f:
        return json.load(f)
