"""The writer supervisor: a process of its own that hands jobs to the writer processes and records their outcomes.

SGLang's scheduler process (server/writer_pool.py) sends it each finished request as one small
message (where the rows lie in the shared host pool, core/handoff.py) and hears back twice: ``copied``
(the rows are out of the pool: free it) and ``done`` (the outcome). Everything between runs here,
outside the scheduler's GIL: one hand-off thread per writer process (writer/process.py) that sends
it the job and follows its messages, replacing a process that dies or stalls (child.py); the
outcome records ``.index/<rid>.json`` (core/capture_dir.py); this server's stats file; sweeps of old
records. The ``blocks`` a job's writer stored are on the pipe to the scheduler before its outcome is
recorded: the scheduler thread reads its pipe before it pulls new requests, so the next turn of a
chat, let in by that record, finds them indexed.

A writer process that dies fails only the job in hand (status ``error``) and is restarted. EOF from
the scheduler side means it is stopping (or gone): queued jobs are finished, then the process exits.
``Supervisor`` is also used in-process by tests, with callbacks instead of messages.
"""
from __future__ import annotations

import collections
import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Union

from sglang_capture.core.capture_dir import (
    ORPHAN_MIN_AGE_S,
    STATS_MIN_INTERVAL_S,
    STATS_REFRESH_S,
    DirFds,
    StatsFile,
    error_text,
    new_writer_counters,
    record_outcome,
    remove_orphans,
    retire_stale_stats,
)
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.durable import remove_unowned, unlink_if_same
from sglang_capture.core.handoff import SLOW_STATS, recv, recv_many, send_many, take_queued
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.writer.child import NotTaken, WriterChild, WriterProcessDied, WriterStalled
from sglang_capture.writer.durability import durability_for

logger = logging.getLogger(__name__)


# What a job's message carries, as the scheduler side sends it and the writer process takes it.
JOB_FIELDS = ("id", "name", "meta", "chunks", "n_rows", "stored", "dtypes", "input_ids", "output_ids", "loss_spans", "share",
              "inline_bytes", "enqueued", "ahead")


@dataclass
class WireJob:
    """A finished request as the supervisor gets it: where its rows lie and what its file records."""

    id: int  # the scheduler side's number for it
    name: str
    meta: Dict[str, Any]
    chunks: List[list]  # core/handoff.describe_chunks
    n_rows: int
    stored: Dict[str, List[int]]  # where each stored tensor lies in a row as the pool holds it
    dtypes: Dict[str, str]  # stored dtype per tensor, where not the rows' (FP8)
    input_ids: bytes  # core/handoff.ids_bytes
    output_ids: bytes
    loss_spans: Optional[List[list]] = None
    # --capture-prefix-sharing on: the layout's root (hex), the first row computed (``start``) and the
    # references of the rows before it (core/blocks.py); None for a self-contained file
    share: Optional[Dict[str, Any]] = None
    inline_bytes: int = 0  # of the chunks, travelling in the message rather than the pool
    enqueued: float = field(default_factory=time.monotonic)  # on the scheduler side (one clock per machine)
    # a sharing capture's prompt blocks, stored ahead of its file (its own job comes at its finish):
    # blocks only, no file, no outcome record; ``written``: the rows and bytes it wrote (the rest were stored)
    ahead: bool = False
    written: Optional[List[int]] = None
    release: Callable[[], None] = lambda: None  # the rows are out of the pool (may be called twice)
    publishing: Optional[Dict[str, Any]] = None  # the writer's last word before the file's name appears
    parked: bool = False  # it waited for a job storing the rows in flight it reuses (counted once)
    outcome: Optional[Dict[str, Any]] = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def rid(self) -> str:
        return self.meta["rid"]


@dataclass
class OutcomeOnly:
    """An outcome to record with no file to write (an aborted capture), off the scheduler thread."""

    rid: str
    outcome: Dict[str, Any]


@dataclass
class SweepJob:
    """Remove outcome records older than ``--capture-index-retention``: done by a writer process,
    handed to it by whichever hand-off thread takes this from the queue."""

    removed: int = 0
    done: threading.Event = field(default_factory=threading.Event)


# what a shared-rows outcome adds to the writer's counters (core/capture_dir.WRITER_COUNTERS)
SHARED_COUNTERS = ("block_bytes", "blocks_written", "blocks_reused", "rows_stored", "rows_shared", "rows_for_next_turn")

# The first sweep waits a minute after start-up; then one every quarter of the retention.
FIRST_SWEEP_S = 60.0


def _flush_names_within(durability: Any, dir_fd: int, name: str, st: os.stat_result, timeout: float) -> Optional[str]:
    """Flush the capture dir's names per ``durability`` on a thread of its own, waiting at most
    ``timeout``: None when done, else what went wrong. The file ``name`` (``st``) is then removed,
    when the flush ends: a hung mount must not hang the hand-off thread that asks."""
    lock, done = threading.Lock(), threading.Event()
    verdict: Dict[str, Optional[str]] = {}

    def flush() -> None:
        try:
            durability.sync_names(dir_fd)
            failed = None
        except OSError as e:
            failed = f"failed ({error_text(e)})"
        with lock:
            late = "verdict" in verdict
            verdict.setdefault("verdict", failed)
        if failed is not None or late:
            unlink_if_same(name, dir_fd, (st.st_dev, st.st_ino))
        done.set()

    threading.Thread(target=flush, name="sglang-capture-name-flush", daemon=True).start()
    done.wait(timeout)
    with lock:
        return verdict.setdefault("verdict", f"did not end within {timeout:g} s")


def _logged_step(doing: str, step: Callable[[], Any]) -> Any:
    """``step()``, or None when it fails with an OSError, logged as what was being done."""
    try:
        return step()
    except OSError as e:
        logger.warning("sglang_capture: %s failed: %s", doing, e)
        return None


class Supervisor:
    """Hand-off threads, one writer process each, and what follows a job's file: its outcome, the stats."""

    def __init__(self, config: CaptureConfig, pool_fd: Optional[int] = None, pool_size: int = 0,
                 predecessors: Sequence[int] = ()) -> None:
        self.config = config
        self.predecessors = tuple(predecessors)  # supervisors of this scheduler that died: their stats files go
        self.pool_fd, self.pool_size = pool_fd, pool_size  # the host pool's memfd: rows in it travel by offset
        self.processes = config.writer_processes()
        self._queue: queue.Queue[Union[WireJob, OutcomeOnly, SweepJob, None]] = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._children: Dict[int, WriterChild] = {}
        self._lock = threading.Lock()
        self._stats_write = threading.Lock()  # one rewrite at a time: a newer file is never overwritten by an older one
        self._busy = 0
        self._dirs: Optional[DirFds] = None
        self._queued = 0  # jobs submitted and not yet picked up (the queue also holds stop markers)
        self._last_stats = 0.0
        self._stats_stale = False  # a write was skipped for the interval: the idle loop makes it
        self._stats_file: Optional[StatsFile] = None
        self._extra_stats: Dict[str, Any] = {}
        self._next_sweep = 0.0  # of old outcome records: set by ``start``
        self._orphans_again: Optional[float] = None  # when to look for killed writers' temp files once more
        self._sweeping = False  # a sweep is queued or running: the next waits for it
        self._open: set = set()  # ids of the jobs submitted and not done
        # jobs whose file reuses rows another job still stores (its share's ``after``), by that job's id
        self._parked: Dict[int, List[WireJob]] = {}
        # told of the blocks each shared-rows job stored or found missing, before its outcome is recorded
        # (SchedulerCapture.blocks_outcome, through the scheduler side): they must be known before the
        # response lets the next turn in
        self.blocks_outcome: Callable[[WireJob, List[list], List[str], bool], None] = \
            lambda job, stored, missing, ok: None
        self.finished: Callable[[WireJob], None] = lambda job: None  # after the outcome is recorded
        self.recorded: Callable[[str], None] = lambda rid: None  # after an aborted capture's outcome is recorded
        self.stats: Dict[str, Any] = new_writer_counters()

    def dirs(self) -> DirFds:
        """The capture dir's descriptors, opened on first use (raises OSError if unusable)."""
        if self._dirs is None:
            self._dirs = DirFds.open(self.config.capture_dir)
        return self._dirs

    def start(self, processes: Optional[int] = None) -> None:
        """Start the hand-off threads and their writer processes (idempotent): at model load on
        the server, so that the first capture does not wait for them. ``processes`` is this rank's
        share of the node's writers (node_budget.py)."""
        with self._lock:
            if self._threads:
                return
            self.processes = processes or self.processes
            self._next_sweep = time.monotonic() + FIRST_SWEEP_S
            self._orphans_again = time.monotonic() + ORPHAN_MIN_AGE_S + 1.0
            self._open_capture_dir()
            for i in range(self.processes):
                t = threading.Thread(target=self._run, args=(i,), name=f"sglang-capture-handoff-{i}", daemon=True)
                t.start()
                self._threads.append(t)
        self._dump_stats(min_interval_s=0.0)  # monitoring sees the server from its start

    def _open_capture_dir(self) -> None:
        """Open the capture dir's descriptors, clean up after stopped servers, start the stats
        file; each step's failure is logged for what it is, and only an unusable dir fails jobs."""
        try:
            dirs = self.dirs()  # opened once here, before several threads could race to open them
        except OSError as e:  # each job will then fail with this reason; the server keeps serving
            logger.error("sglang_capture: capture dir %s is unusable: %s", self.config.capture_dir, e)
            return
        removed = _logged_step("cleaning up stopped servers' temp files", lambda: remove_orphans(dirs))
        if removed:
            logger.info("sglang_capture: removed %d temp files left by stopped servers", removed)
        retired = _logged_step("adding stopped servers' stats to the history",
                               lambda: retire_stale_stats(dirs, gone=self.predecessors))
        if retired:
            logger.info("sglang_capture: added the stats of %d stopped servers to .index/_stats-history.json", retired)
        self._stats_file = _logged_step("starting this server's stats file", lambda: StatsFile(dirs))

    def scheduler_stats(self, doc: Dict[str, Any]) -> None:
        """The scheduler side's own counters (held host memory, its copies and seams) for the stats
        file: written with the next rewrite, within a second or two. The CUDA allocator's stats,
        which the scheduler side sends less often, keep their last values until it sends them again."""
        with self._lock:
            kept = {k: self._extra_stats[k] for k in SLOW_STATS if k in self._extra_stats}
            self._extra_stats = {**kept, **doc}
            self._stats_stale = True

    def pending(self) -> int:
        """Jobs queued or being written: memory that waiting will free."""
        with self._lock:
            return self._queued + self._busy

    def submit(self, job: WireJob) -> None:
        """Queue a job (never blocks; back-pressure happens on the scheduler side, HostMemoryLedger.hold)."""
        if not self._threads:
            self.start()
        with self._lock:
            self._queued += 1
            self.stats["max_queue"] = max(self.stats["max_queue"], self._queued)
            self._open.add(job.id)
        self._queue.put(job)

    def submit_outcome(self, rid: str, outcome: Dict[str, Any]) -> None:
        """Have a hand-off thread record ``outcome`` for ``rid`` (never blocks, no file I/O here)."""
        if not self._threads:
            self.start()
        self._queue.put(OutcomeOnly(rid, outcome))

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued jobs, stop the threads and their writer processes (shutdown, tests)."""
        with self._lock:
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._dump_stats(min_interval_s=0.0)  # the final counters
        if self._stats_file is not None:
            self._stats_file.close()
            self._stats_file = None

    def counters(self) -> Dict[str, Any]:
        """The counters now, with the queue's depth and the jobs in hand (monitoring, tests)."""
        with self._lock:
            return {**self.stats, "queue": self._queued, "busy": self._busy}

    def writer_pids(self) -> List[int]:
        """Process ids of the running writer processes (monitoring, tests)."""
        with self._lock:
            return sorted(c.pid for c in self._children.values() if c.alive())

    def _run(self, slot: int) -> None:
        self._replace_quietly(slot)
        while True:
            child = self._children.get(slot)
            if child is not None and not child.alive():  # a dead writer is replaced within a second, even idle
                self._replace_quietly(slot)
            self._sweep_when_due()
            self._orphans_when_due()
            try:
                job = self._queue.get(timeout=1.0)
            except queue.Empty:
                since = time.monotonic() - self._last_stats
                # the last counters once the jobs stop, and now and then an idle server shown alive
                if (self._stats_stale and since >= STATS_MIN_INTERVAL_S) or since >= STATS_REFRESH_S:
                    self._dump_stats(min_interval_s=0.0)
                continue
            if job is None:
                with self._lock:
                    child = self._children.pop(slot, None)
                if child is not None:
                    child.stop(30.0, self._child_exited)
                return
            if isinstance(job, SweepJob):
                self._sweep(slot, job)
                continue
            if isinstance(job, OutcomeOnly):
                self.record_outcome(job.rid, job.outcome)
                self.recorded(job.rid)
                self._dump_stats()
                continue
            todo = collections.deque([job])
            while todo:  # a job, then those parked until it was done, in the order they came
                job = todo.popleft()
                if self._parked_behind_another(job):
                    continue
                try:
                    self._handle(slot, job)
                except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
                    logger.error("sglang_capture: handing on the capture of request %s failed: %s", job.rid,
                                 error_text(e))
                finally:
                    todo.extend(self._unpark(job.id))

    def _parked_behind_another(self, job: WireJob) -> bool:
        """Park a job that reuses rows a job still in hand stores (``share["after"]``,
        server/shared_rows.py): it is written once that job is done, so that it finds their blocks
        (a job ahead checks those it references past the rows it computed, too)."""
        after = (job.share or {}).get("after")
        if not after:
            return False
        with self._lock:
            first = next((dep for dep in after if dep in self._open), None)
            if first is None:
                return False
            self._parked.setdefault(first, []).append(job)
            if not job.parked:
                job.parked = True
                self.stats["parked"] += 1
        return True

    def _unpark(self, job_id: int) -> List[WireJob]:
        """Job ``job_id`` is done: the jobs parked behind it."""
        with self._lock:
            self._open.discard(job_id)
            return self._parked.pop(job_id, [])

    def _handle(self, slot: int, job: WireJob) -> None:
        """Write one job on the slot's writer, then record and report its outcome."""
        with self._lock:
            self._queued -= 1
            self._busy += 1
            self.stats["queue_wait_s"] += time.monotonic() - job.enqueued
        try:
            outcome = self._write(slot, job)
        except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
            outcome = {"rid": job.rid, "name": job.name, "path": self._path(job),
                       "status": "error", "error": error_text(e)}
        finally:
            job.release()
            with self._lock:
                self._busy -= 1
        if outcome["status"] != "ok" and job.ahead:
            logger.warning("sglang_capture: the prompt blocks of request %s were not stored ahead of its file (its "
                           "file's job stores them): %s", job.rid, outcome["error"])
        elif outcome["status"] != "ok":
            with self._lock:
                self.stats["failed"] += 1
            logger.error("sglang_capture: capture of request %s failed: %s", job.rid, outcome["error"])
        stored = outcome.pop("blocks", [])
        cut = outcome.pop("blocks_cut", [])  # referenced by the scheduler's share, not by the file
        if job.ahead:
            job.written = [outcome.get("rows_stored", 0), outcome.get("block_bytes", 0)]
        if job.share is not None:
            try:  # ok: a file referencing the share's blocks was published (their lease is renewed)
                self.blocks_outcome(job, stored, outcome.get("missing_blocks", []) + cut,
                                    outcome["status"] == "ok" and not job.ahead)
            except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
                logger.error("sglang_capture: the blocks of request %s were not indexed: %s", job.rid, e)
        if not job.ahead:
            self.record_outcome(job.rid, outcome)
        job.outcome = outcome
        job.done.set()
        try:
            self.finished(job)
        except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
            logger.warning("sglang_capture: telling the scheduler that request %s is written failed: %s", job.rid, e)
        self._dump_stats()

    def _write(self, slot: int, job: WireJob) -> Dict[str, Any]:
        """Have the slot's writer process write ``job``; a process found gone before it took the
        job is replaced and the job handed to the new one (once). A process that dies or stalls
        with the job fails only it (a stalled one is killed and replaced first)."""
        child = self._children.get(slot)
        if child is None or not child.alive():
            child = self._replace(slot)
        try:
            try:
                return self._hand_off(child, job)
            except NotTaken:
                child = self._replace(slot)
                return self._hand_off(child, job)
        except WriterProcessDied as e:
            if isinstance(e, WriterStalled):
                self._drop(slot, stalled=True)
            return self._outcome_after_failure(job, e, child)

    def _replace(self, slot: int, stop_timeout: float = 1.0) -> WriterChild:
        """Start the slot's writer process, stopping the one it replaces (raises WriterProcessDied)."""
        with self._lock:
            old = self._children.pop(slot, None)
        if old is not None:
            old.stop(stop_timeout, self._child_exited)
        try:
            child = WriterChild(self.config, self.pool_fd, self.pool_size)
        except OSError as e:
            raise WriterProcessDied(f"cannot start a writer process: {e}") from None
        with self._lock:
            self._children[slot] = child
            self.stats["restarts"] += int(old is not None)
        return child

    def _drop(self, slot: int, stalled: bool) -> None:
        """Kill the slot's writer process at once and start another (a late reply of the old one
        must not be read as the next job's), counting a stall."""
        if stalled:
            with self._lock:
                self.stats["stalled"] += 1
        self._replace_quietly(slot, stop_timeout=0.0)

    def _replace_quietly(self, slot: int, stop_timeout: float = 1.0) -> None:
        try:
            self._replace(slot, stop_timeout)
        except WriterProcessDied as e:  # each job will retry, and fail with this reason
            logger.error("sglang_capture: %s", e)

    def _hand_off(self, child: WriterChild, job: WireJob) -> Dict[str, Any]:
        """Have ``child`` write ``job``; returns its outcome (raises WriterProcessDied)."""
        child.send({"op": "write", "name": job.name, "meta": job.meta, "chunks": job.chunks, "n_rows": job.n_rows,
                    "stored": job.stored, "dtypes": job.dtypes, "input_ids": job.input_ids,
                    "output_ids": job.output_ids, "loss_spans": job.loss_spans, "share": job.share, "ahead": job.ahead})
        child.temp = None
        child.recv()  # "copied": the process holds the rows now
        job.release()
        reply = child.recv()
        while reply.get("op") in ("temp", "publishing"):
            if reply["op"] == "temp":
                child.temp = reply["name"]
            else:
                job.publishing = reply
            reply = child.recv()
        child.temp = None  # the file has its name, or the process removed it
        result, timings = reply["result"], reply["timings"]
        outcome = {"rid": job.rid, "name": job.name, "path": self._path(job), **result}
        raw = outcome.pop("raw_bytes", 0)
        # rows its own job ahead stored: that job counted them stored, so they are not shared here
        own_ahead = outcome.pop("own_ahead", None) or [0, 0]
        if own_ahead[0]:
            outcome["rows_shared"] -= own_ahead[0]
        with self._lock:
            self.stats["inline_bytes"] += job.inline_bytes
            for k, v in timings.items():  # seconds per stage, summed over processes: which stage bounds throughput
                self.stats[k] += v
            self.stats["missing_blocks"] += len(outcome.get("missing_blocks", ()))
            if outcome["status"] == "ok" and job.ahead:
                self.stats["ahead_jobs"] += 1
                for k in SHARED_COUNTERS:
                    self.stats[k] += outcome.get(k, 0)
            elif outcome["status"] == "ok":
                self.stats["written"] += 1
                self.stats["bytes"] += outcome["bytes"]
                self.stats["raw_bytes"] += raw
                for k in SHARED_COUNTERS:
                    self.stats[k] += outcome.get(k, 0)
        if outcome["status"] == "ok":
            outcome["write_s"] = round(time.monotonic() - job.enqueued, 6)
        if own_ahead[0]:  # the request's own rows as its reference tells them (the stats counted them with that job)
            outcome.update(rows_stored=outcome["rows_stored"] + own_ahead[0], block_bytes=outcome["block_bytes"] + own_ahead[1])
        return outcome

    def _outcome_after_failure(self, job: WireJob, e: WriterProcessDied, child: WriterChild) -> Dict[str, Any]:
        """The outcome of a job whose writer process died or stalled, matching what is under the
        file's name. A process gone after ``publishing`` (in the directory's flush, say) left its
        whole, flushed file under the name: the name's flush is done here, within the stall
        timeout, and the outcome is ``ok``; if that flush fails or does not end in time, the file is
        removed (when the flush ends) and the outcome is ``error``. A process still stuck in the
        kernel may yet link the file: the outcome is ``error`` and the file is removed once the
        process is gone. A file under the name that is not the one announced is never touched."""
        outcome = {"rid": job.rid, "name": job.name, "path": self._path(job), "status": "error",
                   "error": error_text(e)}
        announced = job.publishing
        if announced is None:
            return outcome
        name = job.name + FILE_SUFFIX
        with child.exit_lock:
            if child.proc.returncode is None:
                child.unlink_on_exit = (name, announced["dev"], announced["ino"])
                outcome["error"] += "; its file, if the process names it, is removed once the process ends"
                return outcome
        try:
            dirs = self.dirs()
            st = os.stat(name, dir_fd=dirs.capture, follow_symlinks=False)
        except OSError:  # not published (the process died before the link), or the dir is unusable
            return outcome
        if (st.st_dev, st.st_ino) != (announced["dev"], announced["ino"]):
            return outcome
        failed = _flush_names_within(durability_for(self.config.durability), dirs.capture, name, st,
                                     self.config.writer_stall_s)
        if failed is not None:
            outcome["error"] += f"; then flushing its name {failed}, so the file was removed"
            return outcome
        with self._lock:
            self.stats["written"] += 1
            self.stats["bytes"] += announced["bytes"]
            self.stats["published_by_handoff"] += 1
        logger.warning("sglang_capture: %s; its file %s was already whole and named, and is kept", outcome["error"], name)
        return {"rid": outcome["rid"], "name": outcome["name"], "path": outcome["path"], "status": "ok",
                "bytes": announced["bytes"], "checksum": announced["checksum"],
                "write_s": round(time.monotonic() - job.enqueued, 6)}

    def _child_exited(self, child: WriterChild) -> None:
        """A writer process is gone: remove the temp file of the job it had in hand (cut short by a
        kill or a stall), and a file it published after its job's outcome said error."""
        with child.exit_lock:
            temp, published, child.unlink_on_exit = child.temp, child.unlink_on_exit, None
        try:
            dirs = self.dirs()
        except OSError:
            return
        if temp is not None and _logged_step(f"removing the temp file of writer process {child.pid}",
                                             lambda: remove_unowned(temp, dirs.tmp)):
            logger.info("sglang_capture: removed the temp file %s of writer process %d", temp, child.pid)
            with self._lock:
                self.stats["temp_files_removed"] += 1
        if published is not None:
            name, dev, ino = published
            unlink_if_same(name, dirs.capture, (dev, ino))

    def sweep(self) -> SweepJob:
        """Queue a sweep of old outcome records now (they are also swept every quarter of
        ``--capture-index-retention``); wait on the returned job's ``done``."""
        job = SweepJob()
        self._queue.put(job)
        return job

    def _orphans_when_due(self) -> None:
        """Once, when the temp files of writers killed just before this supervisor started (its
        predecessor died) are old enough to judge: remove them, as at start-up."""
        with self._lock:
            if self._orphans_again is None or time.monotonic() < self._orphans_again:
                return
            self._orphans_again = None
        dirs = self._dirs
        removed = dirs and _logged_step("cleaning up temp files of writers gone before this supervisor",
                                        lambda: remove_orphans(dirs))
        if removed:
            logger.info("sglang_capture: removed %d temp files of writer processes gone before this supervisor", removed)

    def _sweep_when_due(self) -> None:
        with self._lock:
            if self._sweeping or time.monotonic() < self._next_sweep:
                return
            self._sweeping = True
            self._next_sweep = time.monotonic() + max(1.0, self.config.index_retention_s / 4)
        self.sweep()

    def _sweep(self, slot: int, job: SweepJob) -> None:
        """Have the slot's writer process remove the old records; a process that fails at it is
        replaced (a late reply must not be read as the next job's)."""
        try:
            child = self._children.get(slot)
            if child is None or not child.alive():
                child = self._replace(slot)
            child.send({"op": "sweep", "max_age_s": self.config.index_retention_s})
            reply = child.recv()
            if reply.get("error"):
                logger.warning("sglang_capture: sweeping old outcome records failed: %s", reply["error"])
            job.removed = int(reply.get("removed", 0))
            with self._lock:
                self.stats["records_swept"] += job.removed
                self._stats_stale = True  # in the file within a second or two
        except Exception as e:  # noqa: BLE001 - a failed sweep must not end this hand-off thread
            logger.warning("sglang_capture: sweeping old outcome records failed: %s", e)
            self._drop(slot, stalled=isinstance(e, WriterStalled))
        finally:
            with self._lock:
                self._sweeping = False
            job.done.set()

    def _path(self, job: WireJob) -> str:
        return os.path.join(self.config.capture_dir, job.name + FILE_SUFFIX)

    def _dump_stats(self, min_interval_s: float = STATS_MIN_INTERVAL_S) -> None:
        """Write this process's ``.index/_writer-*.json`` (counters, queue depth, held and peak host memory)
        at most once per ``min_interval_s``, for monitoring and benchmarks; a write skipped for the
        interval is made by an idle hand-off thread within a second or two. Writing it whenever the
        queue drained took the hand-off threads' time (and the GIL the scheduler thread needs)
        after nearly every job under decode-heavy capture (r62 on the H200, ``git show caf6bcd``)."""
        stats_file = self._stats_file
        if stats_file is None:  # the capture dir was unusable at start, or the pool is closed
            return
        if not self._stats_write.acquire(blocking=min_interval_s == 0.0):
            self._stats_stale = True  # another thread is rewriting it; the idle loop follows up
            return
        try:
            self._write_stats(stats_file, min_interval_s)
        finally:
            self._stats_write.release()

    def _write_stats(self, stats_file: StatsFile, min_interval_s: float) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._last_stats < min_interval_s:
                self._stats_stale = True
                return
            self._last_stats = now
            self._stats_stale = False
        with self._lock:
            doc = {**self.stats, "queue": self._queued, "busy": self._busy, "durability": self.config.durability,
                   "writer_pids": sorted(c.pid for c in self._children.values() if c.alive()),
                   "supervisor_pid": os.getpid(), **self._extra_stats, "time": time.time()}
        try:
            stats_file.write(doc)
        except OSError as e:
            logger.warning("sglang_capture: cannot write writer stats: %s", e)

    def record_outcome(self, rid: str, outcome: Dict[str, Any]) -> None:
        """Write ``.index/<rid>.json`` (hand-off threads)."""
        try:
            record_outcome(self.dirs(), rid, outcome)
        except OSError as e:
            logger.error("sglang_capture: cannot record the outcome of %s: %s", rid, e)


class SchedulerLink:
    """The supervisor's side of its pipes to the scheduler process: jobs in, ``copied``, ``blocks`` and
    ``done`` out. Any hand-off thread may send; one thread writes, and what queued up meanwhile goes
    as one message (``many``), read by the scheduler thread's next pump."""

    def __init__(self, out_fd: int) -> None:
        self.out_fd = out_fd
        # messages, and events set once everything queued before them is written
        self._out: queue.Queue[Union[Dict[str, Any], threading.Event, None]] = queue.Queue()
        self._writer = threading.Thread(target=self._write_loop, name="sglang-capture-to-scheduler", daemon=True)
        self._writer.start()

    def send(self, message: Dict[str, Any]) -> None:
        self._out.put(message)

    def _write_loop(self) -> None:
        while True:
            items, stop = take_queued(self._out, self._out.get())
            try:
                send_many(self.out_fd, [m for m in items if isinstance(m, dict)])
            except OSError:  # the scheduler process is gone: its EOF ends the main loop
                pass
            for item in items:
                if isinstance(item, threading.Event):
                    item.set()
            if stop:
                return

    def flush(self) -> None:
        """Send what is queued, then stop the writing thread (the process is exiting)."""
        self._out.put(None)
        self._writer.join(30.0)

    def job(self, message: Dict[str, Any]) -> WireJob:
        """A job from its message; its ``release`` tells the scheduler side (once) to free the rows."""
        told = threading.Event()
        job_id = message["id"]

        def release() -> None:
            if not told.is_set():
                told.set()
                self.send({"op": "copied", "id": job_id})

        return WireJob(**{k: message[k] for k in JOB_FIELDS}, release=release)

    def blocks(self, job: WireJob, stored: List[list], missing: List[str], ok: bool) -> None:
        """Tell the scheduler side the blocks ``job`` stored (or found gone), and return once the
        message is on the pipe: its outcome record, written next, lets the chat's next turn in, and
        the scheduler thread reads the pipe before it pulls that turn."""
        message = {"op": "blocks", "id": job.id, "stored": stored, "missing": missing, "ok": ok}
        if job.ahead:
            message["written"] = job.written
        written = threading.Event()
        self._out.put(message)
        self._out.put(written)
        if not written.wait(BLOCKS_WRITE_S):
            logger.warning("sglang_capture: the blocks of request %s were not written to the scheduler within %g s",
                           job.rid, BLOCKS_WRITE_S)

    def finished(self, job: WireJob) -> None:
        self.send({"op": "done", "id": job.id, "outcome": job.outcome})


# How long a job's outcome waits for its blocks' message to be written (the scheduler side reads its pipe
# every few milliseconds, and its pipe holds a megabyte; a write to a gone side fails at once).
BLOCKS_WRITE_S = 120.0


def serve(supervisor: Supervisor, link: SchedulerLink, in_fd: int) -> None:
    """Take the scheduler side's messages until EOF, then finish what is queued."""
    supervisor.blocks_outcome = link.blocks
    supervisor.finished = link.finished
    supervisor.recorded = lambda rid: link.send({"op": "recorded", "rid": rid})
    while (messages := recv_many(in_fd)) is not None:
        for message in messages:
            _take(supervisor, link, message)
    supervisor.close()
    link.flush()


def _take(supervisor: Supervisor, link: SchedulerLink, message: Dict[str, Any]) -> None:
    """One message from the scheduler side."""
    op = message.get("op")
    if op == "job":
        supervisor.submit(link.job(message))
    elif op == "outcome":
        supervisor.submit_outcome(message["rid"], message["outcome"])
    elif op == "stats":
        supervisor.scheduler_stats(message["stats"])
    elif op == "sweep":
        job, job_id = supervisor.sweep(), message["id"]
        threading.Thread(target=lambda: (job.done.wait(), link.send({"op": "swept", "id": job_id,
                                                                       "removed": job.removed})),
                         name="sglang-capture-sweep-reply", daemon=True).start()
    elif op == "query":
        link.send({"op": "answer", "id": message["id"], "pids": supervisor.writer_pids(),
                   "counters": supervisor.counters()})


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="[sglang_capture supervisor %(process)d] %(message)s", stream=sys.stderr)
    in_fd = sys.stdin.fileno()
    out_fd = os.dup(sys.stdout.fileno())
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())  # a stray print must not corrupt the protocol
    hello = recv(in_fd)
    if hello is None or hello.get("op") != "hello":
        return 2
    config = CaptureConfig.from_json(hello["config"])
    if config.writer_cpus:  # off the scheduler's cores, with its writers (they set their own affinity too)
        try:
            os.sched_setaffinity(0, config.writer_cpus)
        except OSError as e:
            logger.warning("cannot run on --capture-writer-cpus %s (%s); running on the server's CPUs", config.writer_cpus, e)
    supervisor = Supervisor(config, hello["pool_fd"], hello["pool_size"], hello.get("predecessors", ()))
    supervisor.start(hello["processes"])
    link = SchedulerLink(out_fd)
    link.send({"op": "ready", "pid": os.getpid()})
    serve(supervisor, link, in_fd)
    return 0


if __name__ == "__main__":
    sys.exit(main())
