"""Shared rows in a writer process: a capture's new rows into blocks, and its file of references.

A capture on a server with ``--capture-prefix-sharing on`` computed rows ``[C, N)``; the blocks of
its first D >= C rows were already stored (the scheduler found them, server/block_index.py: rows
``[C, D)`` it computed again because the radix cache had let them go). Here its new rows become
blocks (core/blocks.py) and its file lists all of them, all under the shared lock of
``.blocks/.gc.lock`` (``gc`` takes it exclusively):

0. the blocks of rows ``[C, D)`` are looked up (``still_stored``): from the first one gone (or of
   another size) on, the capture stores those rows itself, and the scheduler forgets the references
   it no longer uses;
1. each planned block is looked up by its key first: one that exists whole (another request, DP
   rank, server or an earlier run of this one stored the same rows) is not written again; one that
   exists damaged (truncated, a flipped byte: its seal says so) is replaced by these rows; the others
   are written like capture files, sealed with the checksum of their content, through a temp file,
   flushed per ``--capture-durability`` and linked into place, so a block is whole or absent and
   two writers racing on one key leave one block;
2. every block the file references is touched (its mtime: ``gc`` never takes a block touched after it began) and
   found present, then the file is published. A block of this capture that is gone already (``gc``
   with a short ``--min-age`` took it) is written again; an earlier one that is gone fails the
   capture (``MissingBlocks``), naming the blocks, and the scheduler forgets them: a retry
   computes their rows again.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import numpy

from sglang_capture.core.blocks import (
    BLOCK_KIND,
    BLOCK_SUFFIX,
    BLOCKS_DIR,
    GC_LOCK,
    Block,
    BlockRef,
)
from sglang_capture.core.capture_dir import DirFds
from sglang_capture.core.checksum import UnknownChecksum
from sglang_capture.core.durable import held_lock, unlink_if_same
from sglang_capture.core.format import CaptureFileError, Codec, HostTensor, decode_array, read_records, seal_intact
from sglang_capture.writer.capture_file import write_file
from sglang_capture.writer.durability import Durability

SUBDIR_MODE = 0o750  # blocks are read by whoever reads the capture files (0640)


class MissingBlocks(RuntimeError):
    """Blocks a capture references are gone (removed by hand, or by ``gc`` with a short
    ``--min-age``): its file would hold no rows for them, so none is published."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        shown = ", ".join(self.names[:4]) + (f" and {len(self.names) - 4} more" if len(self.names) > 4 else "")
        super().__init__(f"the stored rows it reuses are gone or changed (block {shown}); retry the request: its "
                         "rows are then computed again")


@dataclass(frozen=True)
class StoredBlock:
    """A block of this capture as stored, and how many bytes this writer wrote (0: the same rows
    were stored already)."""

    block: Block
    written_bytes: int
    size: int  # of its file

    def as_list(self) -> List[Any]:
        """What the scheduler needs to index it (server/block_index.blocks_of)."""
        b = self.block
        return [b.name, b.slot_hash.hex(), b.start, b.end, self.size]


def gc_lock(dirs: DirFds) -> Any:
    """``.blocks/.gc.lock`` held shared for a ``with`` block: ``gc`` (exclusive) waits for it."""
    return held_lock(GC_LOCK, dirs.blocks, f"{BLOCKS_DIR}/{GC_LOCK} (a running sglang-capture gc holds it)",
                     shared=True, max_delay_s=0.01)


class BlockStore:
    """The capture dir's ``.blocks/`` as one writer process uses it: fan-out folders opened once."""

    def __init__(self, dirs: DirFds, codec: Codec, durability: Durability, checksum: str,
                 keep_page_cache: bool) -> None:
        self.dirs = dirs
        self.codec = codec
        self.durability = durability
        self.checksum = checksum
        self.keep_page_cache = keep_page_cache
        self._subdirs: Dict[str, int] = {}

    def subdir(self, name: str) -> int:
        """The fan-out folder of block ``name``, made (and its entry flushed) on first use."""
        sub = name[:2]
        fd = self._subdirs.get(sub)
        if fd is None:
            try:
                os.mkdir(sub, SUBDIR_MODE, dir_fd=self.dirs.blocks)
                self.durability.sync_names(self.dirs.blocks)
            except FileExistsError:
                pass
            fd = os.open(sub, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=self.dirs.blocks)
            self._subdirs[sub] = fd
        return fd

    def _size(self, name: str) -> Optional[int]:
        """The size of block ``name``'s file, None when it is not stored."""
        try:
            return os.stat(name + BLOCK_SUFFIX, dir_fd=self.subdir(name), follow_symlinks=False).st_size
        except FileNotFoundError:
            return None

    def _stored_whole(self, block: Block, layout: str, tokens: numpy.ndarray) -> Optional[int]:
        """The size of ``block``'s file when it is stored whole, sealed and of these tokens and layout;
        None when it is not stored, or is damaged (then it is removed, that file and no other that took
        the name meanwhile: the caller has the rows to store it again)."""
        name, sub = block.name, self.subdir(block.name)
        try:
            fd = os.open(name + BLOCK_SUFFIX, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sub)
        except FileNotFoundError:
            return None
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            buf = f.read()
        try:
            meta, recs = read_records(buf, name)
            whole = (meta.get("key") == name and meta.get("layout") == layout and meta.get("start") == block.start
                     and meta.get("end") == block.end and seal_intact(meta, recs)
                     and numpy.array_equal(decode_array("tokens", recs["tokens"], name), tokens[block.slot_start:block.end]))
        except (CaptureFileError, UnknownChecksum, KeyError, ValueError):
            whole = False
        if whole:
            return len(buf)
        unlink_if_same(name + BLOCK_SUFFIX, sub, (st.st_dev, st.st_ino))
        return None

    def put(self, blocks: Sequence[Block], rows: Mapping[str, HostTensor], first_row: int, tokens: numpy.ndarray,
            meta: Mapping[str, Any], progress: Callable[[], None]) -> List[StoredBlock]:
        """Store ``blocks``, whose rows are ``rows`` from position ``first_row`` on, unless stored already
        (``meta``: ``block_meta``'s, which names the layout)."""
        out = []
        for block in blocks:
            written = 0
            size = self._stored_whole(block, meta["layout"], tokens)
            if size is None:
                lo, hi = block.start - first_row, block.end - first_row
                tensors = {"tokens": HostTensor("int64", numpy.ascontiguousarray(tokens[block.slot_start:block.end])),
                           **{k: HostTensor(t.dtype, t.array[lo:hi]) for k, t in rows.items()}}
                block_meta = {**meta, "kind": BLOCK_KIND, "key": block.name, "slot_start": block.slot_start,
                              "start": block.start, "end": block.end, "created": time.time()}
                try:
                    size = written = write_file(self.subdir(block.name), block.name + BLOCK_SUFFIX, self.dirs.tmp,
                                                block_meta, tensors, self.codec, self.durability,
                                                self.keep_page_cache, progress, self.checksum, seal_payload=True)[0]
                except FileExistsError:  # another writer stored the same rows meanwhile
                    size = self._size(block.name)
                    if size is None:
                        raise
            out.append(StoredBlock(block, written, size))
            progress()
        return out

    def still_stored(self, share: Dict[str, Any]) -> Tuple[Dict[str, Any], List[str]]:
        """``share`` (server/shared_rows.py ``share_of``) with its references to rows the capture computed
        itself (from ``computed`` on) cut at the first block gone, or of another size, since the
        scheduler's index saw it: the capture stores those rows itself instead. Returns it and the
        names of the blocks it no longer references, the gone one and those after it (for the index
        to forget: their lease is renewed only where a file touched them). Call under ``gc_lock``."""
        computed = share["computed"]
        refs = [BlockRef.from_list(v) for v in share["refs"]]
        gone = set(self.touch([r for r in refs if r.last > computed], share["sizes"]))
        for i, ref in enumerate(refs):
            if ref.name in gone:
                start = max(computed, ref.first)
                kept = share["refs"][:i] + ([[ref.name, ref.start, ref.first, start]] if start > ref.first else [])
                return {**share, "start": start, "refs": kept}, [r.name for r in refs[i:]]
        return share, []

    def touch(self, refs: Sequence[BlockRef], sizes: Mapping[str, int]) -> List[str]:
        """Mark every referenced block as in use now (``gc`` keeps it); returns the names of those
        gone, or whose size is not the one ``sizes`` says (truncated or replaced since). Call under
        ``gc_lock``."""
        missing = []
        for ref in refs:
            name = ref.name + BLOCK_SUFFIX
            try:
                size = os.stat(name, dir_fd=self.subdir(ref.name), follow_symlinks=False).st_size
                os.utime(name, dir_fd=self.subdir(ref.name), follow_symlinks=False)
            except FileNotFoundError:
                missing.append(ref.name)
                continue
            if sizes.get(ref.name, size) != size:
                missing.append(ref.name)
        return missing


def block_meta(meta: Mapping[str, Any], root_hex: str) -> Dict[str, Any]:
    """What every block of a capture records about where its rows come from: the capture's own
    metadata, without what belongs to one request."""
    drop = {"rid", "capture_name", "num_prompt_tokens", "num_output_tokens", "finish_reason", "created"}
    return {**{k: v for k, v in meta.items() if k not in drop}, "layout": root_hex}


def refs_of(stored: Sequence[StoredBlock]) -> List[BlockRef]:
    return [BlockRef(s.block.name, s.block.start, s.block.start, s.block.end) for s in stored]
