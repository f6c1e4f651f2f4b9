"""Writing: background threads that turn finished requests into published capture files.

Each job is assembled (rows by position), encoded (format.py), written to a private temp file,
made durable (durability.py), and published with ``os.link`` into its final name, which never
replaces an existing file; a reader therefore sees either no file or a whole one. The outcome of every request
(ok or error, bytes, checksum) is then recorded in ``.index/<rid>.json``, which is what the
server's HTTP process waits on before it answers the client.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import queue
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from sglang_capture.assembler import RequestCapture, assemble_rows
from sglang_capture.config import CaptureConfig
from sglang_capture.durability import durability_for
from sglang_capture.format import write_capture
from sglang_capture.ledger import HostMemoryLedger
from sglang_capture.loss_mask import mask_from_spans
from sglang_capture.naming import FILE_SUFFIX, name_for_rid

import numpy

logger = logging.getLogger(__name__)

TMP_DIR = ".tmp"
INDEX_DIR = ".index"


def index_path(capture_dir: str, rid: str) -> str:
    """Where the outcome of request ``rid`` is recorded."""
    return os.path.join(capture_dir, INDEX_DIR, name_for_rid(rid) + ".json")


UNRECORDED_SUFFIX = ".unrecorded"  # empty marker next to an outcome record that could not be written


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


@dataclass
class CaptureJob:
    """A finished request's rows plus everything the file records about it."""

    capture: RequestCapture
    n_rows: int
    splits: Dict[str, Tuple[int, int]]
    input_ids: List[int]
    output_ids: List[int]
    meta: Dict[str, Any]
    enqueued: float = field(default_factory=time.monotonic)


def fsync_dir(path: str) -> None:
    """Make a rename or link inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def _write_json_atomic(dir_fd: int, name: str, doc: Dict[str, Any]) -> None:
    tmp = f"{name}.{uuid.uuid4().hex}.part"
    fd = os.open(tmp, _CREATE, 0o640, dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        _unlink_quietly(tmp, dir_fd)
        raise


def _unlink_quietly(name: str, dir_fd: Optional[int] = None) -> None:
    try:
        os.unlink(name, dir_fd=dir_fd)
    except OSError:
        pass


@dataclass(frozen=True)
class _DirFds:
    """The capture dir and its private folders, opened once: every later create, link and
    rename goes through these descriptors, so a symlink planted in the capture dir after start
    cannot redirect a write (and ``O_NOFOLLOW`` refuses one planted before)."""

    capture: int
    tmp: int
    index: int

    @classmethod
    def open(cls, capture_dir: str) -> "_DirFds":
        prepare_capture_dir(capture_dir)
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        top = os.open(capture_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        return cls(top, os.open(TMP_DIR, flags, dir_fd=top), os.open(INDEX_DIR, flags, dir_fd=top))


def _pinned_stats() -> Optional[Dict[str, Any]]:
    """Pinned host allocations by this process (torch's caching host allocator), when torch has
    initialised CUDA: each new cudaHostAlloc stalls the thread that asks for it, which in the
    scheduler process is SGLang's scheduler thread."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        s = torch.cuda.host_memory_stats()
    except Exception:  # older torch, no CUDA: the stats are optional
        return None
    keys = ("num_host_alloc", "num_host_free", "allocated_bytes.current", "allocated_bytes.peak",
            "host_alloc_time.total", "host_alloc_time.max", "host_free_time.total")
    return {k: s[k] for k in keys if k in s}


class CaptureWriter:
    """A bounded pool of writer threads; ``submit`` is the only call made on the scheduler thread."""

    def __init__(self, config: CaptureConfig, ledger: HostMemoryLedger) -> None:
        self.config = config
        self.ledger = ledger
        ledger.draining = lambda: self.pending() > 0
        self._queue: "queue.Queue[Optional[CaptureJob]]" = queue.Queue()
        self._threads: List[threading.Thread] = []
        self._lock = threading.Lock()
        self._busy = 0
        self._dirs: Optional[_DirFds] = None
        self.durability = durability_for(config.durability)
        self._queued = 0  # jobs submitted and not yet picked up (the queue also holds stop markers)
        self._last_stats = 0.0
        self.extra_stats: Callable[[], Dict[str, Any]] = dict  # more counters for the stats file (the sidecar's)
        self.stats: Dict[str, Any] = {"written": 0, "failed": 0, "bytes": 0, "raw_bytes": 0, "max_queue": 0,
                                      "queue_wait_s": 0.0, "assemble_s": 0.0, "encode_write_s": 0.0,
                                      "fsync_publish_s": 0.0}

    def dirs(self) -> _DirFds:
        """The capture dir's descriptors, opened on first use (raises OSError if unusable)."""
        if self._dirs is None:
            self._dirs = _DirFds.open(self.config.capture_dir)
        return self._dirs

    def _start(self) -> None:
        try:
            self.dirs()  # opened once here, before several threads could race to open them
        except OSError as e:  # each job will then fail with this reason; the server keeps serving
            logger.error("sglang_capture: capture dir %s is unusable: %s", self.config.capture_dir, e)
        if self.config.switch_interval_ms > 0:
            # Writer threads re-take the GIL after each compress/hash/write call; behind SGLang's busy
            # scheduler thread every re-take waits a full switch interval (5 ms by default), which
            # made writers 2-4x slower under load. A shorter interval only matters while writers run.
            sys.setswitchinterval(self.config.switch_interval_ms / 1000.0)
        for i in range(self.config.threads_for_writing()):
            t = threading.Thread(target=self._run, name=f"sglang-capture-writer-{i}", daemon=True)
            t.start()
            self._threads.append(t)

    def pending(self) -> int:
        """Jobs queued or being written: memory that waiting will free."""
        with self._lock:
            return self._queued + self._busy

    def submit(self, job: CaptureJob) -> None:
        """Queue a job (never blocks; back-pressure happens in ``HostMemoryLedger.hold``)."""
        with self._lock:
            if not self._threads:
                self._start()
            self._queued += 1
            self.stats["max_queue"] = max(self.stats["max_queue"], self._queued)
        self._queue.put(job)

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued jobs and stop the threads (used on graceful shutdown and in tests)."""
        for _ in self._threads:
            self._queue.put(None)
        deadline = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._threads = []

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            with self._lock:
                self._queued -= 1
                self._busy += 1
            try:
                self._record(job, self.write(job))
            except Exception:  # never let one request kill the writer thread
                logger.exception("sglang_capture: failed to record the outcome of %s", job.meta.get("rid"))
            finally:
                job.capture.release()
                with self._lock:
                    self._busy -= 1
                self._dump_stats()

    def _dump_stats(self, min_interval_s: float = 1.0) -> None:
        """Write ``.index/writer-<pid>.json`` (counters, queue depth, held and peak host memory)
        at most once a second, and whenever the queue drains, for monitoring and benchmarks."""
        now = time.monotonic()
        with self._lock:
            if now - self._last_stats < min_interval_s and self._queued:
                return
            self._last_stats = now
            doc = {**self.stats, "queue": self._queued, "busy": self._busy,
                   "held_bytes": self.ledger.held_bytes, "peak_held_bytes": self.ledger.peak_bytes,
                   "cap_bytes": self.ledger.cap_bytes, "back_pressure_waits": self.ledger.waits,
                   "durability": self.durability.name, "flushes": getattr(self.durability, "flushes", None),
                   **self.extra_stats(),
                   "pinned": _pinned_stats(),
                   "time": time.time()}
        try:
            _write_json_atomic(self.dirs().index, f"writer-{os.getpid()}.json", doc)
        except OSError as e:
            logger.warning("sglang_capture: cannot write writer stats: %s", e)

    def write(self, job: CaptureJob) -> Dict[str, Any]:
        """Assemble, encode and publish one job; returns its outcome (never raises)."""
        cfg = self.config
        final = os.path.join(cfg.capture_dir, job.capture.name + FILE_SUFFIX)
        outcome: Dict[str, Any] = {"rid": job.meta["rid"], "name": job.capture.name, "path": final}
        tmp = f"{job.capture.name}.{os.getpid()}.{uuid.uuid4().hex}.part"
        t_start = time.monotonic()
        dirs: Optional[_DirFds] = None
        try:
            dirs = self.dirs()
            tensors = assemble_rows(job.capture.chunks, job.n_rows, job.splits)
            job.capture.release()
            t_assembled = time.monotonic()
            tensors = {
                "input_ids": numpy.asarray(job.input_ids, dtype=numpy.int64),
                "output_ids": numpy.asarray(job.output_ids, dtype=numpy.int64),
                **tensors,
            }
            if job.capture.loss_spans is not None:
                tensors["loss_mask"] = mask_from_spans(job.capture.loss_spans, len(job.input_ids))
            fd = os.open(tmp, _CREATE, 0o640, dir_fd=dirs.tmp)
            with os.fdopen(fd, "wb", buffering=1 << 20) as f:
                nbytes, checksum = write_capture(f, job.meta, tensors, cfg.codec_spec())
                f.flush()
                t_encoded = time.monotonic()
                self.durability.sync_data(f.fileno())
            try:
                os.link(tmp, os.path.basename(final), src_dir_fd=dirs.tmp, dst_dir_fd=dirs.capture,
                        follow_symlinks=False)
            except FileExistsError:
                raise FileExistsError(errno.EEXIST, f"a capture file named {job.capture.name!r} already exists") from None
            self.durability.sync_names(dirs.capture)
            raw = sum(t.nbytes for t in tensors.values())
            with self._lock:
                self.stats["written"] += 1
                self.stats["bytes"] += nbytes
                self.stats["raw_bytes"] += raw
                # seconds spent per stage, summed over threads: which stage bounds throughput
                self.stats["queue_wait_s"] += t_start - job.enqueued
                self.stats["assemble_s"] += t_assembled - t_start
                self.stats["encode_write_s"] += t_encoded - t_assembled
                self.stats["fsync_publish_s"] += time.monotonic() - t_encoded
            outcome.update(status="ok", bytes=nbytes, checksum=checksum,
                           write_s=round(time.monotonic() - job.enqueued, 6))
        except Exception as e:
            with self._lock:
                self.stats["failed"] += 1
            reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
            outcome.update(status="error", error=f"{type(e).__name__}: {reason}")
            logger.error("sglang_capture: capture of request %s failed: %s", job.meta["rid"], outcome["error"])
        finally:
            if dirs is not None:
                _unlink_quietly(tmp, dirs.tmp)
        return outcome

    def _record(self, job: CaptureJob, outcome: Dict[str, Any]) -> None:
        self.record_outcome(job.meta["rid"], outcome)

    def record_outcome(self, rid: str, outcome: Dict[str, Any]) -> None:
        """Write ``.index/<rid>.json`` (also called on the scheduler thread for aborts, which are rare)."""
        name = os.path.basename(index_path(self.config.capture_dir, rid))
        try:
            _write_json_atomic(self.dirs().index, name, outcome)
        except OSError as e:
            logger.error("sglang_capture: cannot record the outcome of %s: %s", rid, e)
            # On a full filesystem an empty file may still fit where the record did not: it tells the
            # waiting response to stop waiting (it would otherwise wait --capture-wait-timeout).
            try:
                os.close(os.open(name + UNRECORDED_SUFFIX, _CREATE, 0o640, dir_fd=self.dirs().index))
            except OSError:
                pass
