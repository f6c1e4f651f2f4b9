"""The layout of a capture dir, which the HTTP process, the schedulers, the writer processes and
the offline tools all read or write.

- ``<name>.capture.msgpack``: published capture files (writer/capture_file.py).
- ``.blocks/<2 hex>/<key>.block.msgpack``: shared rows that capture files of schema v3 reference
  (core/blocks.py), and ``.blocks/.gc.lock`` (writer/blocks.py, tools/gc.py).
- ``.tmp/``: files being written, under temp names that say their host and process, each locked
  by its writer (core/durable.py) until it has its final name.
- ``.index/<rid-name>.json``: each request's outcome (ok or error, bytes, checksum), which the
  HTTP process waits on before it answers; ``.unrecorded`` beside it when even that failed. Kept
  for ``--capture-index-retention`` seconds, then swept by a writer process (``sweep_records``).
- ``.index/_writer-<host>.<pid>.<nonce>.json``: the stats of each scheduler process that writes,
  for monitoring, beside a ``.lock`` its process holds while it lives. At start-up the stats of
  processes that are gone (and whose file was not rewritten for ``STATS_STALE_S``) are added into
  ``.index/_stats-history.json`` and removed. No request's
  record can take these names: a safe request id never starts with ``_`` (core/names.py).
"""
from __future__ import annotations

import glob
import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Collection, Dict, Optional

from sglang_capture.core.blocks import BLOCKS_DIR
from sglang_capture.core.durable import (
    CREATE_FLAGS,
    TEMP_SUFFIX,
    create_owned,
    host_tag,
    lock_within,
    remove_unowned,
    replace_atomic,
    take_lock,
    unlink_quietly,
)
from sglang_capture.core.names import name_for_rid

TMP_DIR = ".tmp"
INDEX_DIR = ".index"
UNRECORDED_SUFFIX = ".unrecorded"  # empty marker next to an outcome record that could not be written
STATS_PREFIX = "_writer-"
STATS_HISTORY = "_stats-history.json"  # the summed counters of stats files whose process is gone
_LOCK = ".lock"
# stats files named before the "_" prefix (writer-<host>.<pid>.<nonce>.json): stats, not records
_LEGACY_STATS = re.compile(r"writer-h[0-9a-f]{8}\.\d+\.[0-9a-f]{8}$")
# A live server rewrites its stats file at least every STATS_REFRESH_S (writer/supervisor.py); one not
# rewritten for STATS_STALE_S is retired even when its lock can be taken, which on a mount whose
# locks stay on each machine does not prove its server gone (two machines may share a host name).
STATS_REFRESH_S = 60.0
STATS_MIN_INTERVAL_S = 0.25  # and at most once per this; the last counters follow the last job within ~1.5 s
STATS_SETTLE_S = 3.0  # by this long after the newest outcome record, every rank's file counts it
STATS_STALE_S = 600.0
# The counters of a stats file, declared once: how the history combines each over processes ("sum"
# or "peak"). The writer supervisor counts the first table itself (writer/supervisor.py, ``stats``) and
# adds the second from the host-memory ledger; times end in "_s".
WRITER_COUNTERS = {
    "written": "sum", "failed": "sum", "bytes": "sum", "raw_bytes": "sum", "inline_bytes": "sum",
    "restarts": "sum", "stalled": "sum", "records_swept": "sum", "published_by_handoff": "sum",
    "temp_files_removed": "sum", "queue_wait_s": "sum", "assemble_s": "sum", "encode_write_s": "sum",
    "fsync_publish_s": "sum", "max_queue": "peak", "supervisor_restarts": "sum",
    "failed_in_scheduler": "sum",  # jobs the scheduler side failed itself: their supervisor died, or never took them
    # shared rows (--capture-prefix-sharing on): blocks written and their bytes (each block counted once,
    # by the writer that stored it), blocks found stored already, rows written and rows referenced, and
    # answers' last rows written for the chat's next turn (server/answer_tail.py)
    "block_bytes": "sum", "blocks_written": "sum", "blocks_reused": "sum", "rows_stored": "sum",
    "rows_shared": "sum", "rows_for_next_turn": "sum", "blocks_s": "sum", "missing_blocks": "sum",
    "ahead_jobs": "sum",  # prompt blocks stored as soon as a capture's prefill was done, ahead of its file
    "parked": "sum",  # files that waited for another job to store the rows in flight they reuse
}
LEDGER_COUNTERS = {"back_pressure_waits": "sum", "peak_held_bytes": "peak"}
_SUMMED = tuple(k for k, how in {**WRITER_COUNTERS, **LEDGER_COUNTERS}.items() if how == "sum")
_PEAKS = tuple(k for k, how in {**WRITER_COUNTERS, **LEDGER_COUNTERS}.items() if how == "peak")


def new_writer_counters() -> Dict[str, Any]:
    """The writer pool's counters at start: every one of ``WRITER_COUNTERS`` at zero."""
    return {k: 0.0 if k.endswith("_s") else 0 for k in WRITER_COUNTERS}


def index_path(capture_dir: str, rid: str) -> str:
    """Where the outcome of request ``rid`` is recorded."""
    return os.path.join(capture_dir, INDEX_DIR, name_for_rid(rid) + ".json")


def prepare_capture_dir(capture_dir: str) -> None:
    """Create the private temp and index folders and the blocks folder (read by whoever reads the
    files), refusing ones that are symlinks or not folders."""
    for sub, mode in ((TMP_DIR, 0o700), (INDEX_DIR, 0o700), (BLOCKS_DIR, 0o750)):
        path = os.path.join(capture_dir, sub)
        try:
            os.mkdir(path, mode)
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
    blocks: int

    @classmethod
    def open(cls, capture_dir: str) -> DirFds:
        prepare_capture_dir(capture_dir)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        top = os.open(capture_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(top, *(os.open(sub, flags, dir_fd=top) for sub in (TMP_DIR, INDEX_DIR, BLOCKS_DIR)))


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


class StatsFile:
    """This process's stats file, and the lock that shows it is alive (held until ``close``)."""

    def __init__(self, dirs: DirFds) -> None:
        self.dirs = dirs
        self.name = f"{STATS_PREFIX}{host_tag()}.{os.getpid()}.{uuid.uuid4().hex[:8]}"
        self._fd: Optional[int] = create_owned(self.name + _LOCK, dirs.index, 0o600)

    def write(self, doc: Dict[str, Any]) -> None:
        """Replace the stats (monitoring; not flushed)."""
        replace_atomic(self.name + ".json", _write_json(doc), dir_fd=self.dirs.index, sync=False)

    def close(self) -> None:
        """Drop the lock: the next start-up adds these stats into the history."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _stats_stem(entry: str) -> Optional[str]:
    """The stem of a stats file's name (``.json`` cut off), current or legacy; None for other names."""
    if not entry.endswith(".json"):
        return None
    stem = entry[:-len(".json")]
    return stem if stem.startswith(STATS_PREFIX) or _LEGACY_STATS.match(stem) else None


def _stats_host(stem: str) -> str:
    return stem.split("-", 1)[1].split(".")[0]


def _stats_pid(stem: str) -> Optional[int]:
    parts = stem.split(".")
    return int(parts[1]) if len(parts) > 2 and parts[1].isdigit() else None


def retire_stale_stats(dirs: DirFds, min_age_s: float = STATS_STALE_S, gone: Collection[int] = ()) -> int:
    """Add the counters of stats files whose process is gone (its lock can be taken, or it never
    had one) and that were not rewritten for ``min_age_s`` into ``_stats-history.json`` and remove
    them; returns how many. ``gone``: process ids on this host known dead (a writer supervisor's
    predecessor), whose files go whatever their age. Start-ups of several ranks on one dir take turns
    (a lock on the history), so nothing is counted twice. Stats files named before the ``_`` prefix
    count too."""
    retired = 0
    guard = os.open(STATS_HISTORY + _LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dirs.index)
    try:
        lock_within(guard, f"{INDEX_DIR}/{STATS_HISTORY}{_LOCK} (another server starting on this capture dir)")
        history = _read_json(STATS_HISTORY, dirs.index)
        if history is None:
            try:  # a torn history is kept aside, not overwritten
                os.replace(STATS_HISTORY, STATS_HISTORY + ".unreadable", src_dir_fd=dirs.index, dst_dir_fd=dirs.index)
            except FileNotFoundError:
                pass
            history = {"processes": 0, "totals": {}, "peaks": {}}
        entries = sorted(os.listdir(dirs.index))
        for entry in entries:  # a lock whose process died before writing any stats
            stats = entry[:-len(_LOCK)] + ".json" if entry.endswith(_LOCK) else None
            if stats and _stats_stem(stats) and stats not in entries:
                remove_unowned(entry, dirs.index, ORPHAN_MIN_AGE_S)
        for entry in entries:
            stem = _stats_stem(entry)
            if stem is None or _stats_host(stem) != host_tag():  # another host's: its own start-ups judge it
                continue
            lock = take_lock(stem + _LOCK, dirs.index)
            if lock is False:  # its process lives
                continue
            try:
                if _stats_pid(stem) not in gone and not _older_than(entry, dirs.index, min_age_s):
                    continue  # rewritten lately: perhaps a live server whose lock does not reach here
                doc = _read_json(entry, dirs.index)
                if doc is not None:
                    _add_to_history(history, doc)
                    retired += 1
                for name in (entry, stem + _LOCK):
                    unlink_quietly(name, dirs.index)
            finally:
                if lock is not None:
                    os.close(lock)
        if retired:
            replace_atomic(STATS_HISTORY, _write_json(history), dir_fd=dirs.index)  # rare: flushed
    finally:
        os.close(guard)
    return retired


def _older_than(name: str, dir_fd: int, seconds: float) -> bool:
    try:
        return time.time() - os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mtime >= seconds
    except FileNotFoundError:
        return False


def read_outcome(dirs: DirFds, rid: str) -> Optional[Dict[str, Any]]:
    """The outcome recorded for ``rid`` (``record_outcome``), or None when there is none to read."""
    try:
        return _read_json(name_for_rid(rid) + ".json", dirs.index)
    except OSError:
        return None


def _read_json(name: str, dir_fd: int) -> Optional[Dict[str, Any]]:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    with os.fdopen(fd) as f:
        try:
            doc = json.load(f)
        except ValueError:  # a torn file of an older version: nothing to add
            return None
    return doc if isinstance(doc, dict) else None


def _add_to_history(history: Dict[str, Any], doc: Dict[str, Any]) -> None:
    history["processes"] += 1
    for k in _SUMMED:
        if isinstance(doc.get(k), (int, float)):
            history["totals"][k] = history["totals"].get(k, 0) + doc[k]
    for k in _PEAKS:
        if isinstance(doc.get(k), (int, float)):
            history["peaks"][k] = max(history["peaks"].get(k, 0), doc[k])
    if isinstance(doc.get("time"), (int, float)):
        history["first_time"] = min(history.get("first_time", doc["time"]), doc["time"])
        history["last_time"] = max(history.get("last_time", doc["time"]), doc["time"])


def is_record(name: str) -> bool:
    """Whether ``name`` in ``.index/`` is an outcome record or its ``.unrecorded`` marker."""
    if name.endswith(UNRECORDED_SUFFIX):
        return True
    return name.endswith(".json") and not name.startswith("_") and _stats_stem(name) is None


def sweep_records(dirs: DirFds, max_age_s: float, progress: Callable[[], None] = lambda: None) -> int:
    """Remove outcome records (and markers) older than ``max_age_s``; returns how many. Run by a
    writer process, so the directory walk costs the scheduler's interpreter nothing; it calls
    ``progress`` as it goes (a large directory on a network mount takes a while)."""
    removed, cutoff = 0, time.time() - max_age_s
    with os.scandir(dirs.index) as entries:
        for entry in entries:
            progress()
            try:
                if is_record(entry.name) and entry.stat(follow_symlinks=False).st_mtime < cutoff:
                    os.unlink(entry.name, dir_fd=dirs.index)
                    removed += 1
            except FileNotFoundError:
                pass
    return removed


def writer_stats(capture_dir: str, settled: bool = False, timeout_s: float = 15.0) -> Dict[str, Dict[str, Any]]:
    """Every writer stats file in ``capture_dir``, by path: one per writer rank (DP ranks and
    nodes sharing the dir each keep their own). ``settled``: as in ``read_stats``, wait up to
    ``timeout_s`` until each was written after the newest outcome record, or that record is
    ``STATS_SETTLE_S`` old, so that the counts cover every request answered so far."""
    deadline = time.monotonic() + timeout_s
    index = os.path.join(capture_dir, INDEX_DIR)
    while True:
        out = {}
        try:
            for path in glob.glob(os.path.join(index, STATS_PREFIX + "*.json")):
                with open(path) as f:
                    out[path] = json.load(f)
        except (OSError, ValueError):  # retired or being replaced at this moment: read again
            if not settled:
                raise
            out = {}
        if not settled or time.monotonic() > deadline:
            return out
        newest = _newest_record_mtime(index)
        # a rank that wrote none of the newest records rewrites its file only when its own jobs stop
        if out and (all(doc.get("time", 0.0) >= newest for doc in out.values())
                    or time.time() - newest >= STATS_SETTLE_S):
            return out
        time.sleep(0.1)


def read_stats(capture_dir: str, settled: bool = False, timeout_s: float = 15.0) -> Dict[str, Any]:
    """The newest writer stats file in ``capture_dir`` ({} before the first file; a server that
    ran there before may have left its own). ``settled``: wait up to ``timeout_s`` for one written
    after the newest outcome record, so that it counts every request answered so far (a live
    server rewrites the file at most once per ``STATS_MIN_INTERVAL_S``, and once more within a
    second or two of its last outcome)."""
    deadline = time.monotonic() + timeout_s
    index = os.path.join(capture_dir, INDEX_DIR)
    while True:
        doc: Dict[str, Any] = {}
        try:
            files = glob.glob(os.path.join(index, STATS_PREFIX + "*.json"))
            if files:
                with open(max(files, key=os.path.getmtime)) as f:
                    doc = json.load(f)
        except (OSError, ValueError):  # retired or being replaced at this moment: read again
            if not settled:
                raise
        if not settled or time.monotonic() > deadline:
            return doc
        if doc.get("time", 0.0) >= _newest_record_mtime(index):
            return doc
        time.sleep(0.1)


def _newest_record_mtime(index: str) -> float:
    """The newest outcome record's modification time in ``index`` (0 without one). A file's
    time comes from a clock a few milliseconds coarse: a record written just after a stats file
    can look as old as it, which only matters for the writer counters of that one record."""
    newest = 0.0
    try:
        entries = list(os.scandir(index))
    except OSError:
        return newest
    for entry in entries:
        if is_record(entry.name):
            try:
                newest = max(newest, entry.stat().st_mtime)
            except OSError:  # swept or retired meanwhile
                pass
    return newest
