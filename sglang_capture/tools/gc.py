"""``sglang-capture gc DIR``: remove the shared blocks no capture file references any more.

Deleting a capture file never breaks another: the blocks it referenced stay until ``gc`` finds
that no file in DIR references them. It is safe beside a running server writing to DIR:

1. Under the exclusive lock of ``.blocks/.gc.lock`` it touches ``.blocks/.gc-epoch`` and takes
   that file's mtime as the start (the filesystem's clock, as every block's mtime). A writer
   holds the same lock shared while it touches every block a new file references and publishes
   the file (writer/blocks.py), so each such step lies wholly before the start, and its file is
   seen below, or wholly after, and its blocks are newer than the start.
2. It reads the metadata of every capture file in DIR and notes the blocks they reference.
3. It removes, again under the exclusive lock and re-checking each one's mtime, the blocks that no
   file references and that were last touched more than ``--min-age`` before the start (default
   an hour: a block just stored for a capture still being written, or one a server's index may
   hand to its next capture, is kept). A capture that still reuses a removed block fails with a
   message, and its retry computes the rows again: never a file without its rows.

Every block is counted once, so the report is also the directory's disk use.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Set, Tuple

from sglang_capture.core.blocks import BLOCK_LEASE_S, BLOCKS_DIR, GC_LOCK, is_block_name
from sglang_capture.core.durable import held_lock
from sglang_capture.core.format import SCHEMA_REFS, CaptureFileError
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import block_names, check_seal, load_records, read_meta

EPOCH = ".gc-epoch"
REMOVE_BATCH = 256  # blocks removed under one hold of the lock
BATCH_PAUSE_S = 0.03  # the lock left free between batches, longer than a writer's pause between tries
LOCK_WAIT_S = 600.0
DEFAULT_MIN_AGE_S = 2 * BLOCK_LEASE_S


class GcError(RuntimeError):
    """gc cannot judge the directory safely; nothing was removed."""


@dataclass
class GcReport:
    files: int = 0
    file_bytes: int = 0
    referencing_files: int = 0
    blocks: int = 0
    block_bytes: int = 0
    referenced: int = 0
    young: int = 0  # unreferenced, but touched within --min-age
    removed: int = 0
    removed_bytes: int = 0
    dry_run: bool = False
    problems: List[str] = field(default_factory=list)


def _locked(blocks: str) -> Any:
    """The exclusive lock of ``.blocks/.gc.lock``: writers hold it shared for a moment at a time, so
    it is tried often (a writer waits for it at most ``LOCK_TIMEOUT_S``: gc holds it for a batch)."""
    return held_lock(os.path.join(blocks, GC_LOCK), None, os.path.join(blocks, GC_LOCK), timeout_s=LOCK_WAIT_S,
                     max_delay_s=0.002)


def _start(blocks: str) -> float:
    """The mtime of a file touched now, under the exclusive lock (step 1)."""
    with _locked(blocks):
        path = os.path.join(blocks, EPOCH)
        with open(path, "ab"):
            pass
        os.utime(path)
        return os.stat(path).st_mtime


def _referenced(directory: str, report: GcReport) -> Set[str]:
    """Every block a capture file of ``directory`` references (step 2); a file that cannot be read
    stops gc, since the blocks it references cannot be known."""
    names: Set[str] = set()
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith(FILE_SUFFIX) or entry.startswith("."):
            continue
        path = os.path.join(directory, entry)
        try:
            st = os.stat(path)
            meta = read_meta(path)
            if meta.get("schema") == SCHEMA_REFS:  # its list of blocks must be the one it was sealed with
                meta, recs = load_records(path)
                check_seal(meta, recs, path)
            refs = block_names(meta, path)
        except FileNotFoundError:
            continue  # deleted meanwhile: its blocks are no longer referenced by it
        except (OSError, CaptureFileError) as e:
            raise GcError(f"{str(e)}; gc removed nothing (the blocks an unreadable file references cannot be "
                          "known): fix or remove that file first") from None
        report.files += 1
        report.file_bytes += st.st_size
        report.referencing_files += bool(refs)
        names.update(refs)
    return names


def _blocks(blocks: str) -> Dict[str, Tuple[str, os.stat_result]]:
    """Every block under ``blocks``: name -> (path, stat)."""
    out = {}
    for sub in sorted(os.listdir(blocks)):
        subdir = os.path.join(blocks, sub)
        if len(sub) != 2 or not os.path.isdir(subdir) or os.path.islink(subdir):
            continue
        for entry in os.listdir(subdir):
            if is_block_name(entry):
                path = os.path.join(subdir, entry)
                try:
                    out[entry.split(".", 1)[0]] = (path, os.stat(path, follow_symlinks=False))
                except FileNotFoundError:
                    pass
    return out


def collect(directory: str, min_age_s: float = DEFAULT_MIN_AGE_S, dry_run: bool = False) -> GcReport:
    """Remove the unreferenced blocks of ``directory`` (see the module docstring); with ``dry_run``
    only count them."""
    if not os.path.isdir(directory):
        raise GcError(f"{directory} is not a directory")
    if min_age_s < 0:
        raise GcError(f"--min-age must be zero or positive, got {min_age_s:g}")
    report = GcReport(dry_run=dry_run)
    blocks = os.path.join(directory, BLOCKS_DIR)
    if not os.path.isdir(blocks) or os.path.islink(blocks):
        _referenced(directory, report)
        return report
    start = _start(blocks)
    referenced = _referenced(directory, report)
    found = _blocks(blocks)
    report.blocks = len(found)
    report.block_bytes = sum(st.st_size for _, st in found.values())
    report.referenced = len(referenced & set(found))
    missing = sorted(referenced - set(found))
    if missing:
        report.problems.append(f"{len(missing)} referenced blocks are missing (run sglang-capture verify {directory}), "
                               f"e.g. {missing[0]}")
    unreferenced = {name: v for name, v in found.items() if name not in referenced}
    doomed = {name: v for name, v in unreferenced.items() if v[1].st_mtime < start - min_age_s}
    report.young = len(unreferenced) - len(doomed)
    if dry_run or not doomed:
        report.removed, report.removed_bytes = len(doomed), sum(st.st_size for _, st in doomed.values())
        return report
    doomed_paths = [path for path, _ in doomed.values()]
    for i in range(0, len(doomed_paths), REMOVE_BATCH):
        if i:
            time.sleep(BATCH_PAUSE_S)  # writers, who retry every 10 ms, take the lock between batches
        with _locked(blocks):
            for path in doomed_paths[i:i + REMOVE_BATCH]:
                try:
                    now = os.stat(path, follow_symlinks=False)
                    if now.st_mtime >= start - min_age_s:
                        report.young += 1  # touched since: a new file references it
                        continue
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                report.removed += 1
                report.removed_bytes += now.st_size
    return report
