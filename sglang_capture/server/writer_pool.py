"""The writer pool, scheduler side: hand finished requests to writer processes.

``submit`` (the only call made on SGLang's scheduler thread) queues a job. Each writer process
(writer/process.py) has one hand-off thread here, which sends it the job's description (where
the rows lie in the shared host pool, see core/handoff.py), frees the rows' pool blocks once the
process has read them, and records the request's outcome in ``.index/<rid>.json`` when the
file is published (core/capture_dir.py). In this process a job costs a few small messages; the
compression, hashing and file I/O run in the writer processes' own interpreters.

A writer process that dies fails only the job in hand (status ``error``) and is restarted (the
process handle and its errors: writer_child.py).
"""
from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple, Union

from sglang_capture.core.capture_dir import (
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
from sglang_capture.core.handoff import describe_chunks, ids_bytes
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.request_capture import RequestCapture
from sglang_capture.server.writer_child import NotTaken, WriterChild, WriterProcessDied, WriterStalled
from sglang_capture.writer.durability import durability_for

if TYPE_CHECKING:
    from sglang_capture.server.host_pool import HostPool

logger = logging.getLogger(__name__)


@dataclass
class CaptureJob:
    """A finished request's rows plus everything the file records about it."""

    capture: RequestCapture
    n_rows: int
    stored: Dict[str, Tuple[int, int]]  # where each stored tensor lies in a row as the pool holds it
    input_ids: List[int]
    output_ids: List[int]
    meta: Dict[str, Any]
    dtypes: Dict[str, str] = field(default_factory=dict)  # stored dtype per tensor, where not the rows' (FP8)
    # --capture-prefix-sharing on: the layout's root (hex), the first row computed (``start``) and the
    # references of the rows before it (core/blocks.py); None for a self-contained file
    share: Optional[Dict[str, Any]] = None
    enqueued: float = field(default_factory=time.monotonic)
    publishing: Optional[Dict[str, Any]] = None  # the writer's last word before the file's name appears
    outcome: Optional[Dict[str, Any]] = None
    done: threading.Event = field(default_factory=threading.Event)


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
SHARED_COUNTERS = ("block_bytes", "blocks_written", "blocks_reused", "rows_stored", "rows_shared")

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


def _cuda_stats(read: str, keys: Tuple[str, ...]) -> Optional[Dict[str, Any]]:
    """``keys`` of ``torch.cuda.<read>()`` for this process, once torch has initialised CUDA."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        s = getattr(torch.cuda, read)()
    except Exception:  # older torch, no CUDA: the stats are optional
        return None
    return {k: s[k] for k in keys if k in s}


# torch's caching host allocator: each new cudaHostAlloc stalls the thread that asks for it,
# which in the scheduler process is SGLang's scheduler thread.
_PINNED_KEYS = ("num_host_alloc", "num_host_free", "allocated_bytes.current", "allocated_bytes.peak",
                "host_alloc_time.total", "host_alloc_time.max", "host_free_time.total")
# the CUDA caching allocator: new device allocations and retries (a retry frees every cached block
# and synchronizes the device) show whether capture's transient tensors crowd the memory SGLang
# leaves for activations.
_DEVICE_ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                          "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak")


class WriterPool:
    """Hand-off threads, one writer process each; ``submit`` is the only call made on the scheduler thread."""

    def __init__(self, config: CaptureConfig, ledger: HostMemoryLedger) -> None:
        self.config = config
        self.ledger = ledger
        self.pool: Optional[HostPool] = None  # rows in it travel by offset (given to ``start``)
        self.processes = config.writer_processes()
        ledger.draining = lambda: self.pending() > 0
        self._queue: queue.Queue[Union[CaptureJob, OutcomeOnly, SweepJob, None]] = queue.Queue()
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
        self._next_sweep = 0.0  # of old outcome records: set by ``start``
        self._sweeping = False  # a sweep is queued or running: the next waits for it
        self._extra_stats: Callable[[], Dict[str, Any]] = dict
        # told of the blocks each shared-rows job stored or found missing, before its outcome is recorded
        # (SchedulerCapture.blocks_outcome): they must be known before the response lets the next turn in
        self.blocks_outcome: Callable[[CaptureJob, List[list], List[str], bool], None] = \
            lambda job, stored, missing, ok: None
        self.stats: Dict[str, Any] = new_writer_counters()

    def dirs(self) -> DirFds:
        """The capture dir's descriptors, opened on first use (raises OSError if unusable)."""
        if self._dirs is None:
            self._dirs = DirFds.open(self.config.capture_dir)
        return self._dirs

    def start(self, pool: Optional[HostPool] = None, processes: Optional[int] = None,
              extra_stats: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        """Start the hand-off threads and their writer processes (idempotent): at model load on
        the server, so that the first capture does not wait for them. ``pool`` is the host pool the
        rows lie in, ``processes`` this rank's share of the node's writers (node_budget.py), and
        ``extra_stats`` the scheduler's counters for the stats file."""
        with self._lock:
            if self._threads:
                return
            self.pool = pool
            self.processes = processes or self.processes
            self._extra_stats = extra_stats or dict
            self._next_sweep = time.monotonic() + FIRST_SWEEP_S
            self._open_capture_dir()
            if self.config.switch_interval_ms > 0:
                # Hand-off threads wake on pipe replies; behind SGLang's busy scheduler thread each
                # wake-up waits up to a whole switch interval (5 ms by default) for the GIL.
                sys.setswitchinterval(self.config.switch_interval_ms / 1000.0)
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
        retired = _logged_step("adding stopped servers' stats to the history", lambda: retire_stale_stats(dirs))
        if retired:
            logger.info("sglang_capture: added the stats of %d stopped servers to .index/_stats-history.json", retired)
        self._stats_file = _logged_step("starting this server's stats file", lambda: StatsFile(dirs))

    def pending(self) -> int:
        """Jobs queued or being written: memory that waiting will free."""
        with self._lock:
            return self._queued + self._busy

    def submit(self, job: CaptureJob) -> None:
        """Queue a job (never blocks; back-pressure happens in ``HostMemoryLedger.hold``)."""
        if not self._threads:
            self.start()
        with self._lock:
            self._queued += 1
            self.stats["max_queue"] = max(self.stats["max_queue"], self._queued)
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
                self._dump_stats()
                continue
            with self._lock:
                self._queued -= 1
                self._busy += 1
                self.stats["queue_wait_s"] += time.monotonic() - job.enqueued
            try:
                outcome = self._write(slot, job)
            except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
                outcome = {"rid": job.meta["rid"], "name": job.capture.name, "path": self._path(job),
                           "status": "error", "error": error_text(e)}
            finally:
                job.capture.release()
                with self._lock:
                    self._busy -= 1
            if outcome["status"] != "ok":
                with self._lock:
                    self.stats["failed"] += 1
                logger.error("sglang_capture: capture of request %s failed: %s", job.meta["rid"], outcome["error"])
            stored = outcome.pop("blocks", [])
            if job.share is not None:
                try:
                    self.blocks_outcome(job, stored, outcome.get("missing_blocks", []), outcome["status"] == "ok")
                except Exception as e:  # noqa: BLE001 - no failure may end this hand-off thread
                    logger.error("sglang_capture: the blocks of request %s were not indexed: %s", job.meta["rid"], e)
            self.record_outcome(job.meta["rid"], outcome)
            job.outcome = outcome
            job.done.set()
            self._dump_stats()

    def _write(self, slot: int, job: CaptureJob) -> Dict[str, Any]:
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
            child = WriterChild(self.config, self.pool)
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

    def _hand_off(self, child: WriterChild, job: CaptureJob) -> Dict[str, Any]:
        """Have ``child`` write ``job``; returns its outcome (raises WriterProcessDied)."""
        chunks, inline = describe_chunks(job.capture.chunks, self.pool)
        spans = job.capture.loss_spans
        child.send({"op": "write", "name": job.capture.name, "meta": job.meta, "chunks": chunks, "n_rows": job.n_rows,
                    "stored": {k: list(v) for k, v in job.stored.items()}, "dtypes": job.dtypes,
                    "input_ids": ids_bytes(job.input_ids),
                    "output_ids": ids_bytes(job.output_ids),
                    "loss_spans": [list(s) for s in spans] if spans is not None else None, "share": job.share})
        child.temp = None
        child.recv()  # "copied": the process holds the rows now
        job.capture.release()
        reply = child.recv()
        while reply.get("op") in ("temp", "publishing"):
            if reply["op"] == "temp":
                child.temp = reply["name"]
            else:
                job.publishing = reply
            reply = child.recv()
        child.temp = None  # the file has its name, or the process removed it
        result, timings = reply["result"], reply["timings"]
        outcome = {"rid": job.meta["rid"], "name": job.capture.name, "path": self._path(job), **result}
        raw = outcome.pop("raw_bytes", 0)
        with self._lock:
            self.stats["inline_bytes"] += inline
            for k, v in timings.items():  # seconds per stage, summed over processes: which stage bounds throughput
                self.stats[k] += v
            self.stats["missing_blocks"] += len(outcome.get("missing_blocks", ()))
            if outcome["status"] == "ok":
                self.stats["written"] += 1
                self.stats["bytes"] += outcome["bytes"]
                self.stats["raw_bytes"] += raw
                for k in SHARED_COUNTERS:
                    self.stats[k] += outcome.get(k, 0)
        if outcome["status"] == "ok":
            outcome["write_s"] = round(time.monotonic() - job.enqueued, 6)
        return outcome

    def _outcome_after_failure(self, job: CaptureJob, e: WriterProcessDied, child: WriterChild) -> Dict[str, Any]:
        """The outcome of a job whose writer process died or stalled, matching what is under the
        file's name. A process gone after ``publishing`` (in the directory's flush, say) left its
        whole, flushed file under the name: the name's flush is done here, within the stall
        timeout, and the outcome is ``ok``; if that flush fails or does not end in time, the file is
        removed (when the flush ends) and the outcome is ``error``. A process still stuck in the
        kernel may yet link the file: the outcome is ``error`` and the file is removed once the
        process is gone. A file under the name that is not the one announced is never touched."""
        outcome = {"rid": job.meta["rid"], "name": job.capture.name, "path": self._path(job), "status": "error",
                   "error": error_text(e)}
        announced = job.publishing
        if announced is None:
            return outcome
        name = job.capture.name + FILE_SUFFIX
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
        except Exception as e:  # noqa: BLE001 - a failed sweep must not end this hand-off thread
            logger.warning("sglang_capture: sweeping old outcome records failed: %s", e)
            self._drop(slot, stalled=isinstance(e, WriterStalled))
        finally:
            with self._lock:
                self._sweeping = False
            job.done.set()

    def _path(self, job: CaptureJob) -> str:
        return os.path.join(self.config.capture_dir, job.capture.name + FILE_SUFFIX)

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
        try:
            extra = self._extra_stats()
        except Exception as e:  # noqa: BLE001 - monitoring must never end a hand-off thread
            extra = {"extra_stats_error": error_text(e)}
        with self._lock:
            doc = {**self.stats, "queue": self._queued, "busy": self._busy,
                   "held_bytes": self.ledger.held_bytes, "peak_held_bytes": self.ledger.peak_bytes,
                   "cap_bytes": self.ledger.cap_bytes, "back_pressure_waits": self.ledger.waits,
                   "durability": self.config.durability,
                   "writer_pids": sorted(c.pid for c in self._children.values() if c.alive()),
                   **extra,
                   "pinned": _cuda_stats("host_memory_stats", _PINNED_KEYS),
                   "device_allocator": _cuda_stats("memory_stats", _DEVICE_ALLOCATOR_KEYS),
                   "time": time.time()}
        try:
            stats_file.write(doc)
        except OSError as e:
            logger.warning("sglang_capture: cannot write writer stats: %s", e)

    def record_outcome(self, rid: str, outcome: Dict[str, Any]) -> None:
        """Write ``.index/<rid>.json`` (hand-off threads; the scheduler thread uses ``submit_outcome``)."""
        try:
            record_outcome(self.dirs(), rid, outcome)
        except OSError as e:
            logger.error("sglang_capture: cannot record the outcome of %s: %s", rid, e)
