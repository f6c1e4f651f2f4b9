"""A writer process (``python -m sglang_capture.writer.process``, started by child.py for the writer supervisor).

It turns jobs into published capture files: reads the request's rows out of the shared host pool
(mapped read-only), places them by position, then compresses, hashes, writes, flushes and
publishes the file. It has an interpreter of its own so that none of that competes with SGLang's
scheduler thread for the GIL and slows requests that capture nothing. It never imports torch.

Talks to its hand-off thread in the supervisor over stdin/stdout (core/handoff.py). EOF on stdin means the server is
gone or stopping: it finishes the job in hand and exits.
"""
from __future__ import annotations

import logging
import mmap
import os
import signal
import sys
import time
from typing import Any, Dict, List, Optional

import numpy

from sglang_capture.core.blocks import (
    BLOCK_TENSORS_KEY,
    BLOCK_TOKENS,
    BLOCKS_KEY,
    BlockRef,
    blocks_end,
    check_coverage,
    plan_blocks,
    refs_upto,
)
from sglang_capture.core.capture_dir import DirFds, error_text, sweep_records
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.format import SCHEMA_REFS, HostTensor
from sglang_capture.core.handoff import Heartbeat, chunk_arrays, ids_array, recv, send
from sglang_capture.core.loss_mask import mask_from_spans
from sglang_capture.writer.assemble import assemble_rows, relabel
from sglang_capture.writer.blocks import BlockStore, MissingBlocks, StoredBlock, block_meta, gc_lock, refs_of
from sglang_capture.writer.capture_file import write_capture_file
from sglang_capture.writer.durability import durability_for

logger = logging.getLogger("sglang_capture.writer.process")


class WriterProcess:
    """One writer process's state: the capture dir's descriptors, codec, flush policy, pool map."""

    def __init__(self, config: CaptureConfig, pool_fd: Optional[int], pool_size: int) -> None:
        self.config = config
        self.codec = config.codec_spec()
        self.durability = durability_for(config.durability)
        self.pool = None
        if pool_fd is not None:
            self.pool = mmap.mmap(pool_fd, pool_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
            os.close(pool_fd)
        self.dirs: Optional[DirFds] = None
        self.dirs_error: Optional[OSError] = None
        self.blocks: Optional[BlockStore] = None
        try:
            self.dirs = DirFds.open(config.capture_dir)
            self.blocks = BlockStore(self.dirs, self.codec, self.durability, config.checksum, config.keep_page_cache)
        except OSError as e:  # every job then fails with this reason; the server keeps serving
            self.dirs_error = e

    def _heartbeat(self, out_fd: int) -> Heartbeat:
        """``progress`` messages often enough that the stall timeout never takes a moving writer."""
        return Heartbeat(out_fd, min(1.0, self.config.writer_stall_s / 4))

    def sweep(self, max_age_s: float, out_fd: int) -> Dict[str, Any]:
        """Remove outcome records older than ``max_age_s`` (core/capture_dir.sweep_records),
        with ``progress`` messages meanwhile."""
        beat = self._heartbeat(out_fd)
        try:
            return {"op": "swept", "removed": sweep_records(self.dirs, max_age_s, beat) if self.dirs else 0}
        except OSError as e:
            return {"op": "swept", "removed": 0, "error": error_text(e)}

    def write(self, msg: Dict[str, Any], out_fd: int) -> Dict[str, Any]:
        """Publish one job; sends ``copied`` as soon as its rows are out of the pool, ``temp`` (its
        temp file's name) once that exists, ``progress`` while the file is written, and
        ``publishing`` (the whole, flushed file's identity, size and checksum) just before its name
        appears (core/handoff.py)."""
        t0 = time.monotonic()
        beat = self._heartbeat(out_fd)
        copied = False
        timings: Dict[str, float] = {}
        share = msg.get("share")
        # rows from the first one the capture computed: those it computed again although stored are
        # stored once more only where their block is gone by the time the file is written
        first = share["computed"] if share else 0
        end = blocks_end(share, msg["n_rows"])
        try:
            try:
                rows = assemble_rows(chunk_arrays(msg["chunks"], self.pool), end,
                                     {k: tuple(v) for k, v in msg["stored"].items()}, first)
            finally:
                send(out_fd, {"op": "copied"})
                copied = True
            timings["assemble_s"] = time.monotonic() - t0
            rows = relabel(rows, msg.get("dtypes") or {})
            input_ids = ids_array(msg["input_ids"])
            tensors = {"input_ids": input_ids, "output_ids": ids_array(msg["output_ids"])}
            if msg["loss_spans"] is not None:
                tensors["loss_mask"] = mask_from_spans([tuple(s) for s in msg["loss_spans"]], len(input_ids))
            if self.dirs is None or self.blocks is None:
                raise self.dirs_error or OSError("the capture dir is unusable")
            beat.restart()  # "copied" went just now

            def publishing(st: os.stat_result, nbytes: int, checksum: str) -> None:
                send(out_fd, {"op": "publishing", "dev": st.st_dev, "ino": st.st_ino, "bytes": nbytes,
                              "checksum": checksum})
                beat.restart()

            def publish(meta: Dict[str, Any], file_tensors: Dict[str, HostTensor], schema: Optional[str] = None):
                return write_capture_file(self.dirs, msg["name"], meta, file_tensors, self.codec, self.durability,
                                          self.config.keep_page_cache, beat, self.config.checksum, publishing,
                                          lambda temp: send(out_fd, {"op": "temp", "name": temp}), schema,
                                          seal_payload=schema is not None)

            if msg.get("ahead"):
                timings_extra, extra = self._store_ahead(msg, share, rows, tensors, beat)
                timings.update(timings_extra)
                return {"op": "done", "result": {"status": "ok", "bytes": 0, "checksum": None, **extra},
                        "timings": timings}
            if share is None:
                tensors.update(rows)
                nbytes, checksum, stage = publish(msg["meta"], tensors)
                extra: Dict[str, Any] = {}
            else:
                nbytes, checksum, stage, extra = self._publish_shared(msg, share, rows, tensors, publish, beat)
            timings.update(stage)
            result = {"status": "ok", "bytes": nbytes, "checksum": checksum,
                      "raw_bytes": sum(int(t.nbytes) for t in tensors.values()), **extra}
        except MissingBlocks as e:
            result = {"status": "error", "error": error_text(e), "missing_blocks": e.names}
        except Exception as e:
            if not copied:
                raise
            result = {"status": "error", "error": error_text(e)}
        return {"op": "done", "result": result, "timings": timings}

    def _store_ahead(self, msg: Dict[str, Any], share: Dict[str, Any], rows: Dict[str, HostTensor],
                     tensors: Dict[str, HostTensor], beat: Heartbeat) -> Any:
        """Store the blocks of a capture's prompt rows ``[share["start"], n_rows)`` (whole slots, as
        its file's job would cut them) while the request still decodes, so that requests sharing the
        prompt may reuse them before its file exists; returns timings and what the outcome adds (the
        blocks, for the scheduler's index; what they cost)."""
        t0 = time.monotonic()
        n_rows = msg["n_rows"]
        seq = tensors["input_ids"][:n_rows]
        with gc_lock(self.dirs):
            share, cut, stored = self._put_new(msg, share, rows, seq, n_rows, beat)
            # blocks found stored already are touched too: the index keeps them as if just stored (gc goes by mtime)
            gone = self.blocks.touch(refs_of(stored), {s.block.name: s.size for s in stored})
            stored = self._put_again(msg, share, stored, gone, rows, seq, beat)
        return {"blocks_s": time.monotonic() - t0}, {**_stored_counts(stored), "blocks_cut": cut}

    def _put_new(self, msg: Dict[str, Any], share: Dict[str, Any], rows: Dict[str, HostTensor], seq: numpy.ndarray,
                 end: int, beat: Heartbeat) -> Any:
        """Under ``gc_lock``: ``share`` as still stored (``BlockStore.still_stored``), the names it no
        longer references, and the blocks of rows ``[its start, end)``, each stored unless it is already."""
        share, cut = self.blocks.still_stored(share)
        plan = plan_blocks(seq, share["start"], end, bytes.fromhex(share["root"]))
        return share, cut, self.blocks.put(plan, rows, share["computed"], seq, block_meta(msg["meta"], share["root"]),
                                           beat)

    def _put_again(self, msg: Dict[str, Any], share: Dict[str, Any], stored: List[StoredBlock], names: List[str],
                   rows: Dict[str, HostTensor], seq: numpy.ndarray, beat: Heartbeat) -> List[StoredBlock]:
        """Under ``gc_lock``: ``stored`` with its blocks ``names``, removed since they were stored (``gc``
        with a short ``--min-age``), stored again from the rows still here."""
        if not names:
            return stored
        own = {s.block.name: s.block for s in stored}
        again = {s.block.name: s for s in self.blocks.put([own[name] for name in names], rows, share["computed"], seq,
                                                          block_meta(msg["meta"], share["root"]), beat)}
        return [again.get(s.block.name, s) for s in stored]

    def _publish_shared(self, msg: Dict[str, Any], share: Dict[str, Any], rows: Dict[str, HostTensor],
                        tensors: Dict[str, HostTensor], publish: Any, beat: Heartbeat) -> Any:
        """Store the capture's new rows (``rows`` hold positions ``share["computed"]`` on; those from
        ``share["start"]``, or from a block gone since, are stored) as blocks, then publish its file of
        references (writer/blocks.py), all under ``gc_lock``; returns the file's size, checksum and
        timings, and what the outcome adds: the blocks stored (for the scheduler's index), those of
        ``share`` the file does not reference (``blocks_cut``, for the index to forget) and what they cost."""
        t0 = time.monotonic()
        n_rows, computed, end = msg["n_rows"], share["computed"], blocks_end(share, msg["n_rows"])
        seq = numpy.concatenate([tensors["input_ids"], tensors["output_ids"]])[:end]
        with gc_lock(self.dirs):
            share, cut, stored = self._put_new(msg, share, rows, seq, end, beat)
            refs = [BlockRef.from_list(r) for r in share["refs"]] + refs_of(stored)
            file_refs = refs_upto(refs, n_rows)  # its answer's last row, if stored, is for the next turn only
            meta = {**msg["meta"], "schema": SCHEMA_REFS, BLOCKS_KEY: [r.as_list() for r in file_refs],
                    BLOCK_TENSORS_KEY: list(rows), "block_tokens": BLOCK_TOKENS, "block_layout": share["root"]}
            blocks_s = time.monotonic() - t0
            gap = check_coverage(file_refs, n_rows)
            if gap is not None:  # never a file without its rows: what the scheduler handed over does not add up
                raise RuntimeError(f"the capture's blocks do not cover its rows: {gap}")
            missing = self.blocks.touch(refs, {**share.get("sizes", {}), **{s.block.name: s.size for s in stored}})
            own = {s.block.name for s in stored}
            gone = [name for name in missing if name not in own]
            if gone:
                raise MissingBlocks(gone + [name for name in cut if name not in gone])
            stored = self._put_again(msg, share, stored, missing, rows, seq, beat)  # its own blocks, removed since
            nbytes, checksum, stage = publish(meta, tensors, SCHEMA_REFS)
        counts = _stored_counts(stored)
        all_rows = counts["rows_stored"]
        row_bytes = sum(t.nbytes for t in rows.values()) // max(end - computed, 1)
        # the file's rows this job stored, and the one past them it stored for the chat's next turn
        rows_stored = sum(max(min(s.block.end, n_rows) - s.block.start, 0) for s in stored if s.written_bytes)
        counts.update(rows_stored=rows_stored, rows_for_next_turn=all_rows - rows_stored)
        extra = {**counts, "rows_shared": n_rows - rows_stored, "blocks_cut": cut,
                 # the rows and bytes its own job ahead stored, referenced here (none when a block of them
                 # was gone: then the references after it were cut and this job stored those rows itself)
                 "own_ahead": share["ahead"] if share.get("ahead") and not cut else None,
                 "raw_bytes": sum(t.nbytes for t in tensors.values()) + row_bytes * all_rows}
        return nbytes, checksum, {**stage, "blocks_s": blocks_s}, extra


def _stored_counts(stored: List[StoredBlock]) -> Dict[str, Any]:
    """What a job's blocks add to its outcome: the blocks (for the scheduler's index), and what this
    writer wrote of them (a block found stored already costs nothing)."""
    written = [s for s in stored if s.written_bytes]
    return {"blocks": [s.as_list() for s in stored], "block_bytes": sum(s.written_bytes for s in written),
            "blocks_written": len(written), "blocks_reused": len(stored) - len(written),
            "rows_stored": sum(s.block.end - s.block.start for s in written)}


def _die_with_parent() -> bool:
    """Be killed when the supervisor that started this process dies (Linux's parent-death signal):
    the scheduler side has then recorded this job's outcome as an error, and a file published
    after that would contradict it. False where that cannot be asked (the process still exits at
    its pipe's EOF)."""
    try:
        import ctypes

        return ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL) == 0
    except (OSError, AttributeError):
        return False


PR_SET_PDEATHSIG = 1


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[sglang_capture writer %(process)d] %(message)s", stream=sys.stderr)
    in_fd = sys.stdin.fileno()
    out_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the protocol
    dies_with_parent = _die_with_parent()
    hello = recv(in_fd)
    if hello is None or hello.get("op") != "hello":
        return 2
    if dies_with_parent and hello.get("parent") not in (None, os.getppid()):
        return 0  # the supervisor died before the signal was asked for
    config = CaptureConfig.from_json(hello["config"])
    os.nice(config.writer_nice)  # relative to the scheduler process that started it
    if config.writer_cpus:
        try:
            os.sched_setaffinity(0, config.writer_cpus)
        except OSError as e:  # CPUs taken away since the launcher checked them: run where the server runs
            logger.warning("cannot run on --capture-writer-cpus %s (%s); running on the server's CPUs", config.writer_cpus, e)
    writer = WriterProcess(config, hello["pool_fd"], hello["pool_size"])
    while True:
        msg = recv(in_fd)
        op = None if msg is None else msg.get("op")
        try:
            if op == "write":
                send(out_fd, writer.write(msg, out_fd))
            elif op == "sweep":
                send(out_fd, writer.sweep(msg["max_age_s"], out_fd))
            else:
                return 0
        except BrokenPipeError:
            return 0


if __name__ == "__main__":
    sys.exit(main())
