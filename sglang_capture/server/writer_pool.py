"""The writer pool, scheduler side: hand finished requests to the writer supervisor process.

The writer supervisor (writer/supervisor.py) is a process of its own that runs the writer
processes, records outcomes, keeps the stats file and sweeps old records. This side is the link to
it, and it runs on SGLang's scheduler thread: ``submit`` puts a job in the outbox, and ``pump``,
called once per turn of the scheduler's loop (before it pulls new requests: hooks/prefix.py),
reads the supervisor's answers without blocking and sends the jobs whose device-to-host copies are
done, described by where their rows lie in the shared host pool (core/handoff.py), as one message.
The answers: ``copied`` frees the rows' pool blocks, ``blocks`` hands the shared-rows index what a
writer stored (``blocks_outcome``), ``done`` ends the job. A job costs a few tens of microseconds
of Python here and no thread wake-up: threads of this process doing that work would each wake
per message and take the GIL from the scheduler thread while it runs (issue 51).

Since the scheduler thread reads every answer the supervisor wrote before it pulls the next
requests, a chat's next turn, let in by an outcome recorded after its ``blocks`` were written,
finds them in the index without a reply from here. One thread (``sglang-capture-link``) pumps only
while something is due and the scheduler thread has not pumped for ``IDLE_PUMP_S`` (``IDLE_READ_S``
when only answers are due): an idle server, a long forward, a wait for host memory
(``HostMemoryLedger.hold``), tests without a scheduler. With nothing due it pumps once a second.

A supervisor that dies fails only the jobs it held (their outcomes recorded from here, the one
time this process writes one) and is started again.
"""
from __future__ import annotations

import collections
import fcntl
import itertools
import logging
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Deque, Dict, List, Optional, Sequence, Tuple, Union

from sglang_capture.core.capture_dir import STATS_MIN_INTERVAL_S, DirFds, error_text, index_path, read_outcome, record_outcome
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.durable import unlink_if_same
from sglang_capture.core.handoff import MAX_BATCH, SLOW_STATS, FrameReader, FrameWriter, describe_chunks, ids_bytes, send
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.request_capture import RequestCapture, RowChunk

if TYPE_CHECKING:
    from sglang_capture.server.host_pool import HostPool

logger = logging.getLogger(__name__)


@dataclass
class CaptureJob:
    """A finished request's rows plus everything the file records about it."""

    capture: RequestCapture
    n_rows: int
    stored: Dict[str, Tuple[int, int]]  # where each stored tensor lies in a row as the pool holds it
    input_ids: Sequence[int]  # SGLang's array('q') (or list), or numpy
    output_ids: Sequence[int]
    meta: Dict[str, Any]
    dtypes: Dict[str, str] = field(default_factory=dict)  # stored dtype per tensor, where not the rows' (FP8)
    # --capture-prefix-sharing on: the layout's root (hex), the first row computed (``computed``), the first
    # row not found stored (``start``) and the references of the rows before it (core/blocks.py); None for a
    # self-contained file
    share: Optional[Dict[str, Any]] = None
    enqueued: float = field(default_factory=time.monotonic)
    id: int = 0  # numbered by ``submit``
    outcome: Optional[Dict[str, Any]] = None
    done: threading.Event = field(default_factory=threading.Event)
    # A job that stores a sharing capture's prompt blocks ahead of its file, as soon as its prefill is done
    # (``SchedulerCapture.store_ahead``): the chunks of those rows, held here (their pool blocks stay
    # allocated) until a writer has read them, while the request goes on with its own; and its
    # ``RequestShare``, told which blocks were stored. No file and no outcome come of it.
    ahead_rows: Optional[List[RowChunk]] = None
    ahead_of: Optional[Any] = None
    written: Optional[List[int]] = None  # the rows and bytes a job ahead wrote (the rest were stored already)
    hashes: Optional[List[bytes]] = None  # its request's slot hashes known so far (server/shared_rows.RequestShare)

    @property
    def chunks(self) -> List[RowChunk]:
        return self.ahead_rows if self.ahead_rows is not None else self.capture.chunks

    def copied(self) -> bool:
        """Whether every device-to-host copy of its rows is done (never waits): only then is it sent.
        True when asking raises: its description then waits for the copy, which fails only it (the
        jobs behind it go on)."""
        try:
            return all(chunk.ready.query() for chunk in self.chunks if hasattr(chunk.ready, "query"))
        except Exception:  # noqa: BLE001 - a CUDA event's query that fails: left to describe_chunks
            return True

    def free_rows(self) -> None:
        """A writer has read the rows (or none will): their host memory may go."""
        if self.ahead_rows is None:
            self.capture.release()
            return
        rows, self.ahead_rows = self.ahead_rows, []
        for chunk in rows:  # held for this job too (``SchedulerCapture.store_ahead``): counted until here
            self.capture.ledger.release(chunk.rows)


def job_message(job: CaptureJob, pool: Optional[HostPool]) -> Dict[str, Any]:
    """``job`` as the supervisor takes it (writer/supervisor.JOB_FIELDS): its rows by where they lie
    in ``pool``. Waits for any device-to-host copy of them still in flight."""
    chunks, inline = describe_chunks(job.chunks, pool)
    spans = job.capture.loss_spans
    return {"op": "job", "id": job.id, "name": job.capture.name, "meta": job.meta, "chunks": chunks,
            "n_rows": job.n_rows, "stored": {k: list(v) for k, v in job.stored.items()}, "dtypes": job.dtypes,
            "input_ids": ids_bytes(job.input_ids), "output_ids": ids_bytes(job.output_ids),
            "loss_spans": [list(s) for s in spans] if spans is not None else None, "share": job.share,
            "inline_bytes": inline, "enqueued": job.enqueued, "ahead": job.ahead_rows is not None}


class SweepJob:
    """A sweep of old outcome records asked of the supervisor; wait on ``done``."""

    def __init__(self) -> None:
        self.removed = 0
        self.done = threading.Event()


def _cuda_stats(read: str, keys: Tuple[str, ...], *device: int) -> Optional[Dict[str, Any]]:
    """``keys`` of ``torch.cuda.<read>(*device)`` for this process, once torch has initialised CUDA."""
    try:
        import torch

        if not torch.cuda.is_initialized():
            return None
        s = getattr(torch.cuda, read)(*device)
    except Exception:  # older torch, no CUDA: the stats are optional
        return None
    return {k: s[k] for k in keys if k in s}


def _current_cuda_device() -> Optional[int]:
    """The calling thread's CUDA device, or None before torch has initialised CUDA."""
    try:
        import torch

        return torch.cuda.current_device() if torch.cuda.is_initialized() else None
    except Exception:  # noqa: BLE001 - no CUDA: the stats are optional
        return None


# torch's caching host allocator: each new cudaHostAlloc stalls the thread that asks for it,
# which in the scheduler process is SGLang's scheduler thread.
_PINNED_KEYS = ("num_host_alloc", "num_host_free", "allocated_bytes.current", "allocated_bytes.peak",
                "host_alloc_time.total", "host_alloc_time.max", "host_free_time.total")
# the CUDA caching allocator: new device allocations and retries (a retry frees every cached block
# and synchronizes the device) show whether capture's transient tensors crowd the memory SGLang
# leaves for activations.
_DEVICE_ALLOCATOR_KEYS = ("num_alloc_retries", "num_device_alloc", "num_device_free", "num_sync_all_streams",
                          "allocated_bytes.all.peak", "reserved_bytes.all.current", "reserved_bytes.all.peak")

# The scheduler side's counters reach the supervisor at most this often while jobs come and go.
STATS_PUSH_S = 2 * STATS_MIN_INTERVAL_S
QUERY_TIMEOUT_S = 30.0
# The idle pump's periods while the scheduler thread does not pump: a job waiting to be sent (its
# copies finishing), answers still due, and neither (a supervisor that died is noticed then).
IDLE_PUMP_S = 0.005
IDLE_READ_S = 0.02
IDLE_CHECK_S = 1.0
CLOSE_PUMP_S = 0.002  # the period of ``start``'s and ``close``'s own pumps, while they wait for the supervisor
PIPE_BYTES = 1 << 20  # the pipes' buffers (where the kernel allows): a burst of jobs is written without waiting
READY_TIMEOUT_S = 60.0
STOPPING = "the server is stopping; the capture was not written"
YOUNG_DEATH_S = 5.0  # a supervisor that dies younger than this is replaced after a pause, not at once
# this side's counters that the history sums over stats files (core/capture_dir.WRITER_COUNTERS, LEDGER_COUNTERS)
SUMMED_HERE = ("supervisor_restarts", "failed_in_scheduler", "back_pressure_waits")


class _Supervisor:
    """One supervisor process, its answers read so far, and what was sent to it."""

    def __init__(self, proc: subprocess.Popen, started: float) -> None:
        self.proc, self.started = proc, started
        self.replies = FrameReader(proc.stdout.fileno())
        self.out = FrameWriter(proc.stdin.fileno())  # non-blocking once its hello is written
        self.gone: Optional[threading.Thread] = None  # the thread cleaning up after its EOF
        self.outcomes: Dict[str, Dict[str, Any]] = {}  # aborted captures' outcomes sent, not yet recorded


def _widen_pipe(fd: int) -> None:
    try:
        fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (OSError, AttributeError):  # above /proc/sys/fs/pipe-max-size, or not Linux: the default
        pass


class WriterPool:
    """The link to the writer supervisor; ``submit`` and ``pump`` run on the scheduler thread.

    Locks: ``_pump_lock`` (one pump at a time) before ``_send_lock`` (the supervisor in hand, what is
    sent to it, replacing it) before ``_lock`` (the counters and the jobs in flight), never after."""

    def __init__(self, config: CaptureConfig, ledger: HostMemoryLedger) -> None:
        self.config = config
        self.ledger = ledger
        self.pool: Optional[HostPool] = None  # rows in it travel by offset (given to ``start``)
        self.processes = config.writer_processes()
        ledger.draining = lambda: self.pending() > 0
        # the scheduler thread waits for memory: the idle pump reads what frees it, from now
        ledger.on_wait = lambda: self._due(urgent=True)
        # jobs and messages for the supervisor, in order, until a pump sends them
        self._outbox: Deque[Union[CaptureJob, Dict[str, Any]]] = collections.deque()
        self._lock = threading.Lock()
        self._pump_lock = threading.Lock()
        self._last_pump = 0.0  # when the last pump ended (monotonic)
        self._send_lock = threading.Lock()
        self._start_lock = threading.Lock()
        self._submit_lock = threading.Lock()  # the closed flag and what goes into the queue, together
        self._ids = itertools.count(1)
        self._open = 0  # jobs submitted and not done: memory that waiting will free
        self._jobs: Dict[int, Tuple[CaptureJob, _Supervisor]] = {}  # sent, not done: the job and where it went
        self._asked: Dict[int, Tuple[threading.Event, Dict[str, Any]]] = {}  # queries and sweeps, by id
        self._supervisor: Optional[_Supervisor] = None
        self._ready = threading.Event()  # the first supervisor said it runs
        self._idle: Optional[threading.Thread] = None  # the idle pump (started by ``start``)
        self._stop_idle = threading.Event()
        self._wake = threading.Condition(threading.Lock())  # the idle pump sleeps on it
        self._idle_resting = False  # it sleeps because nothing is due (a submit wakes it)
        self._closed = False  # close() began: nothing more is taken
        self._closing = False  # the supervisor is being stopped: its EOF is not a death
        self._dirs_lock = threading.Lock()
        self._dirs: Optional[DirFds] = None
        self._extra_stats: Callable[[], Dict[str, Any]] = dict
        self._last_push = 0.0
        self._last_cuda_push = float("-inf")  # CUDA allocator stats: monitoring only, sent at most every STATS_PUSH_S
        self._cuda_device: Optional[int] = None  # the GPU of the thread that started the link (the scheduler's)
        self._changed = False  # since the last push of this side's counters
        self._pushed_extra: Dict[str, Any] = {}  # the scheduler's counters as last pushed
        # told of the blocks each shared-rows job stored or found missing, before its outcome is recorded
        # (SchedulerCapture.blocks_outcome): they must be known before the response lets the next turn in
        self.blocks_outcome: Callable[[CaptureJob, List[list], List[str], bool], None] = \
            lambda job, stored, missing, ok: None
        # told of each job once it is numbered, before any writer can answer for it, and of each job done
        # without ``blocks_outcome`` (server/shared_rows.py: the blocks it will store are in flight until then)
        self.job_queued: Callable[[CaptureJob], None] = lambda job: None
        self.job_settled: Callable[[CaptureJob], None] = lambda job: None
        # this side's counters (the supervisor has the rest); each supervisor's stats file gets what
        # accrued since it started, so that the files' sums are the totals
        self.stats: Dict[str, Any] = {"supervisor_restarts": 0, "failed_in_scheduler": 0}
        self._baseline: Dict[str, float] = {}  # the summed counters when the supervisor in hand started
        self._pushed: Dict[str, float] = {}  # the summed counters last pushed
        self._dead: List[int] = []  # supervisors that died (their stats files are retired by the next)
        self._young_deaths = 0  # supervisors in a row that died within YOUNG_DEATH_S of their start

    def start(self, pool: Optional[HostPool] = None, processes: Optional[int] = None,
              extra_stats: Optional[Callable[[], Dict[str, Any]]] = None) -> None:
        """Start the supervisor and its writer processes (idempotent): at model load on the server,
        so that the first capture does not wait for them. ``pool`` is the host pool the rows lie in,
        ``processes`` this rank's share of the node's writers (node_budget.py), and ``extra_stats``
        the scheduler's counters for the stats file."""
        with self._start_lock:
            if self._idle is not None or self._closed:
                return
            self.pool = pool
            self.processes = processes or self.processes
            self._cuda_device = _current_cuda_device()
            self._extra_stats = extra_stats or dict
            if self.config.switch_interval_ms > 0:
                # Capture's threads here (the row copier, the idle pump) wake now and then; behind SGLang's
                # busy scheduler thread each wake-up waits up to a whole switch interval (5 ms by default) for the GIL.
                sys.setswitchinterval(self.config.switch_interval_ms / 1000.0)
            with self._send_lock:
                self._supervisor = self._spawn()
            self._idle = threading.Thread(target=self._idle_loop, name="sglang-capture-link", daemon=True)
            self._idle.start()
        self._push_stats(force=True)  # monitoring sees the server's counters from its start
        # Ready: the capture dir checked and cleaned up after stopped servers, as before the first job.
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not self._ready.is_set() and time.monotonic() < deadline:
            self.pump()  # its answer read here (the scheduler thread, at model load), not by the idle pump
            self._ready.wait(CLOSE_PUMP_S)
        if not self._ready.is_set():
            logger.warning("sglang_capture: the writer supervisor did not start within %g s; jobs queue for it",
                           READY_TIMEOUT_S)

    def _spawn(self) -> _Supervisor:
        """Start a supervisor process (the caller holds the send lock); raises OSError when no
        process can be started."""
        pool = self.pool
        proc = subprocess.Popen([sys.executable, "-m", "sglang_capture.writer.supervisor"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, pass_fds=(pool.fd,) if pool is not None else ())
        for fd in (proc.stdin.fileno(), proc.stdout.fileno()):
            _widen_pipe(fd)
        os.set_blocking(proc.stdout.fileno(), False)  # read by pumps, which never wait
        sup = _Supervisor(proc, time.monotonic())
        with self._lock:  # what the last supervisor's file counted already
            self._baseline = {k: self._pushed.get(k, 0) for k in SUMMED_HERE}
        try:
            send(proc.stdin.fileno(), {"op": "hello", "config": self.config.to_env(),
                                       "pool_fd": pool.fd if pool is not None else None,
                                       "pool_size": pool.size_bytes if pool is not None else 0,
                                       "processes": self.processes, "predecessors": self._dead})
        except OSError as e:  # gone at once: the pump that reads its EOF fails what is sent to it, starts another
            logger.error("sglang_capture: the writer supervisor process %d did not start: %s", proc.pid, e)
        os.set_blocking(proc.stdin.fileno(), False)  # written by pumps, which never wait
        return sup

    def pending(self) -> int:
        """Jobs submitted and not yet written: memory that waiting will free."""
        with self._lock:
            return self._open

    def submit(self, job: CaptureJob) -> None:
        """Queue a job (never blocks; back-pressure happens in ``HostMemoryLedger.hold``); the next
        pump sends it once its rows are copied."""
        if self._idle is None:
            self.start()
        job.id = next(self._ids)
        try:
            self.job_queued(job)
        except Exception as e:  # noqa: BLE001 - its blocks are then not in flight: later captures compute them
            logger.error("sglang_capture: the blocks of request %s were not posted in flight: %s", job.meta["rid"],
                         error_text(e))
        with self._lock:
            self._open += 1
        with self._submit_lock:
            if not self._closed:
                self._outbox.append(job)
                self._due()
                return
        self._fail(job, STOPPING, None)  # the server is stopping: no writer will take it

    def submit_outcome(self, rid: str, outcome: Dict[str, Any]) -> None:
        """Have the supervisor record ``outcome`` for ``rid`` (never blocks, no file I/O here)."""
        if self._idle is None:
            self.start()
        with self._submit_lock:
            if not self._closed:
                self._outbox.append({"op": "outcome", "rid": rid, "outcome": outcome})
                self._due()
                return
        self._record_here(rid, outcome)  # the server is stopping: recorded here, the last time it matters

    def sweep(self) -> SweepJob:
        """Have the supervisor sweep old outcome records now (it also does every quarter of
        ``--capture-index-retention``); wait on the returned job's ``done``."""
        job = SweepJob()
        job_id = next(self._ids)
        event, answer = self._ask(job_id)
        threading.Thread(target=lambda: (event.wait(), setattr(job, "removed", answer.get("removed", 0)),
                                         job.done.set()), daemon=True, name="sglang-capture-sweep-wait").start()
        self._outbox.append({"op": "sweep", "id": job_id})
        self._due()
        return job

    def writer_pids(self) -> List[int]:
        """Process ids of the running writer processes (monitoring, tests); [] once closed."""
        return self._query().get("pids", [])

    def counters(self) -> Dict[str, Any]:
        """The supervisor's counters now (core/capture_dir.WRITER_COUNTERS, queue and busy: tests)."""
        return self._query().get("counters", {})

    def supervisor_pid(self) -> Optional[int]:
        sup = self._supervisor
        return sup.proc.pid if sup is not None and sup.proc.poll() is None else None

    def _ask(self, job_id: int) -> Tuple[threading.Event, Dict[str, Any]]:
        event, answer = threading.Event(), {}
        with self._lock:
            self._asked[job_id] = (event, answer)
        self._due()
        return event, answer

    def _due(self, urgent: bool = False) -> None:
        """Something is due from the supervisor or for it: wake the idle pump if it rests (nothing
        was due), or at once when ``urgent`` (the scheduler thread waits for host memory, or the
        link is closing); a pump then comes within its period anyway."""
        with self._wake:
            if urgent or self._idle_resting:
                self._wake.notify()

    def _query(self) -> Dict[str, Any]:
        if self._supervisor is None or self._closing:
            return {}
        job_id = next(self._ids)
        event, answer = self._ask(job_id)
        if self._send([{"op": "query", "id": job_id}]):
            event.wait(QUERY_TIMEOUT_S)
        with self._lock:
            self._asked.pop(job_id, None)
        return answer

    def close(self, timeout: float = 60.0) -> None:
        """Finish queued jobs, then stop the supervisor and its writer processes (shutdown, tests);
        a job submitted from now on fails at once."""
        with self._start_lock, self._submit_lock:
            self._closed = True
            idle = self._idle
        if idle is None:
            return
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:  # the outbox sent as copies finish, the answers read
                self.pump()
                with self._pump_lock, self._lock:  # not between a pump's taking items and sending them
                    done = not self._jobs and not self._outbox
                if done:
                    break
                time.sleep(CLOSE_PUMP_S)
            self._fail_queued()
            self._push_stats(force=True)  # the final counters, written by the supervisor as it stops
            with self._send_lock:
                self._closing = True
                sup = self._supervisor
                if sup is None:
                    return
                try:
                    sup.out.flush(max(0.1, deadline - time.monotonic()))
                except OSError:  # gone: its jobs are failed below
                    pass
                sup.out.close()  # nothing more is written to the descriptor closed next
                try:
                    sup.proc.stdin.close()  # EOF: it finishes what it holds and exits
                except OSError:
                    pass
            try:
                sup.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                sup.proc.kill()
                sup.proc.wait(5.0)
            self.pump()  # its last answers, up to its EOF
            with self._lock:
                left = [job for job, where in self._jobs.values() if where is sup]
            for job in left:  # not answered in time: what the supervisor recorded, or an error
                self._fail(job, "the server stopped before the file was written", sup)
        finally:
            self._stop_idle.set()
            self._due(urgent=True)
            idle.join(5.0)

    def _fail_queued(self) -> None:
        """What is still in the outbox once ``close`` ran out of time: failed or recorded here."""
        while True:
            try:
                with self._pump_lock:
                    item = self._outbox.popleft()
            except IndexError:
                return
            if isinstance(item, CaptureJob):
                self._fail(item, STOPPING, None)
            elif isinstance(item, dict) and item.get("op") == "outcome":
                self._record_here(item["rid"], item["outcome"])

    def _send(self, messages: List[Dict[str, Any]], jobs: Sequence[CaptureJob] = ()) -> Optional[bool]:
        """Send ``messages`` as one to the supervisor in hand, ``jobs`` (theirs) counted as sent to it
        in the same step: a supervisor replaced meanwhile never gets a job its death already failed.
        False when there is none, or the messages cannot be packed (the caller ends the jobs); None
        when it is gone (the caller may send them to the next one)."""
        with self._send_lock:
            return self._send_locked(messages, jobs)

    def _send_locked(self, messages: List[Dict[str, Any]], jobs: Sequence[CaptureJob] = ()) -> Optional[bool]:
        sup = self._supervisor
        if sup is None or self._closing:
            return False
        with self._lock:
            for job in jobs:
                self._jobs[job.id] = (job, sup)
                self._changed = True
            for message in messages:
                if message["op"] == "outcome":
                    sup.outcomes[message["rid"]] = message["outcome"]
        error = None
        try:
            if sup.out.send_many(messages):  # what the pipe cannot take now goes with the next pump
                return True
        except (ValueError, TypeError, OverflowError) as e:  # a value msgpack cannot pack
            error = e
        with self._lock:
            for job in jobs:
                self._jobs.pop(job.id, None)
            for message in messages:
                if message["op"] == "outcome":
                    sup.outcomes.pop(message["rid"], None)
        if error is None:
            return None  # gone before any of it was written
        logger.error("sglang_capture: a message to the writer supervisor could not be packed: %s", error)
        return False

    def pump(self) -> None:
        """Scheduler thread, once per turn of its loop (and the idle pump): apply the supervisor's
        answers that arrived, then send what the outbox holds up to the first job whose rows are
        still being copied, as one message per ``MAX_BATCH``. Never waits for the supervisor."""
        with self._pump_lock:
            try:
                sup = self._supervisor
                if sup is not None and sup.gone is None:
                    self._read_answers(sup)
                    with self._send_lock:
                        try:
                            sup.out.flush()  # what the pipe could not take at the last send
                        except OSError:  # gone: its EOF is read
                            pass
                self._send_ready()
                self._push_stats()
            except Exception as e:  # noqa: BLE001 - never the scheduler's failure: the next pump goes on
                logger.error("sglang_capture: the link to the writer supervisor failed a step: %s", error_text(e))
            finally:
                self._last_pump = time.monotonic()

    def _idle_loop(self) -> None:
        """Pump while the scheduler thread does not (idle, in a long forward, waiting for host memory),
        as long as anything is due; else once a second, or when something is (``_due``)."""
        while not self._stop_idle.is_set():
            with self._wake:
                period = self._idle_period()
                self._idle_resting = period is None
                woken = self._wake.wait(IDLE_CHECK_S if period is None else period)
                self._idle_resting = False
            if self._stop_idle.is_set():
                return
            if woken and period is None:
                continue  # something came: pumped at its period from now
            if woken or time.monotonic() - self._last_pump >= (period or IDLE_CHECK_S):
                self.pump()  # with nothing due, once a second: a supervisor that died meanwhile is replaced

    def _idle_period(self) -> Optional[float]:
        """How often the idle pump pumps now: None while nothing is due."""
        if self._outbox or self.ledger.waiting:
            return IDLE_PUMP_S
        sup = self._supervisor
        with self._lock:
            waiting = bool(self._jobs or self._asked or (sup is not None and sup.outcomes))
        return IDLE_READ_S if waiting or not self._ready.is_set() else None

    def _send_ready(self) -> None:
        outbox = self._outbox
        while outbox:
            items: List[Union[CaptureJob, Dict[str, Any]]] = []
            while outbox and len(items) < MAX_BATCH:
                item = outbox[0]
                if isinstance(item, CaptureJob) and not item.copied():
                    break
                items.append(outbox.popleft())
            if not items or not self._send_items(items):
                return

    def _send_items(self, items: List[Union[CaptureJob, Dict[str, Any]]]) -> bool:
        """Send a batch; when it cannot go as one, each item alone, so that one unpackable job
        fails only itself. False when the supervisor is gone: what was not sent is back at the front
        of the outbox, for a later pump (once its EOF is read and another one runs; until then each
        pump finds it gone again)."""
        described: List[Tuple[Dict[str, Any], Optional[CaptureJob]]] = []
        for item in items:
            if isinstance(item, CaptureJob):
                message = self._describe(item)
                if message is not None:
                    described.append((message, item))
            else:
                described.append((item, None))
        if any(job is not None for _, job in described):
            # this side's counters as of these jobs, ahead of them: the stats file written after their
            # outcomes counts everything the scheduler did for them (the batches they ran in)
            self._push_stats(force=True)
        if not described:
            return True
        sent = self._send([m for m, _ in described], [j for _, j in described if j is not None])
        if sent is None:
            return self._back_to_outbox(described)
        if sent:
            return True
        for k, (message, job) in enumerate(described if len(described) > 1 else []):
            try:
                sent = self._send([message], [job] if job is not None else [])
                if sent is None:
                    return self._back_to_outbox(described[k:])
                if not sent:
                    self._unsent(message, job)
            except Exception as e:  # noqa: BLE001 - one item's failure must not drop the rest
                logger.error("sglang_capture: a message to the writer supervisor was lost: %s", error_text(e))
        if len(described) == 1:
            self._unsent(*described[0])
        return True

    def _back_to_outbox(self, described: List[Tuple[Dict[str, Any], Optional[CaptureJob]]]) -> bool:
        """Items the gone supervisor never got, back at the front of the outbox in order; False."""
        self._outbox.extendleft(reversed([job if job is not None else message for message, job in described]))
        return False

    def _unsent(self, message: Dict[str, Any], job: Optional[CaptureJob]) -> None:
        """A message no supervisor took: its job fails, an outcome is recorded from here."""
        if job is not None:
            self._fail(job, "the writer supervisor did not take the job (it exited, or the job's metadata "
                            "cannot be encoded)", None)
        elif message["op"] == "outcome":
            self._record_here(message["rid"], message["outcome"])

    def _describe(self, job: CaptureJob) -> Optional[Dict[str, Any]]:
        """``job``'s message; None (the job failed) when its rows cannot be handed on."""
        try:
            return job_message(job, self.pool)
        except Exception as e:  # noqa: BLE001 - a copy that failed fails only its job
            self._fail(job, f"its rows could not be handed to the writers: {error_text(e)}", None)
            return None

    def _take(self, job_id: int, sup: _Supervisor) -> Optional[CaptureJob]:
        """The job ``sup`` answers for, taken out of the jobs in flight (None if it is not there)."""
        with self._lock:
            entry = self._jobs.get(job_id)
            if entry is None or entry[1] is not sup:
                return None
            del self._jobs[job_id]
            self._open -= 1
            self._changed = True
        return entry[0]

    def _fail(self, job: CaptureJob, why: str, sup: Optional[_Supervisor]) -> None:
        """End a job no supervisor will answer for: free its rows, record its outcome from here.
        ``sup``: the dead supervisor it was sent to (it is taken out of the jobs in flight only if
        still there); None: a job never sent."""
        if sup is not None and self._take(job.id, sup) is None:
            return
        if sup is None:
            with self._lock:
                self._open -= 1
                self._changed = True
        self.job_settled(job)
        if job.ahead_rows is not None:  # its capture's own job stores the blocks with its file
            job.free_rows()
            job.outcome = {"status": "error", "error": why}
            job.done.set()
            return
        with self._lock:
            self.stats["failed_in_scheduler"] += 1
        job.capture.release()
        name = job.capture.name
        path = os.path.join(self.config.capture_dir, name + FILE_SUFFIX)
        outcome = self._recorded(job.meta["rid"], name)
        if outcome is None:
            outcome = {"rid": job.meta["rid"], "name": name, "path": path, "status": "error", "error": why}
            submitted = time.time() - (time.monotonic() - job.enqueued)
            if sup is not None and self._remove_published(path, job.meta["rid"], submitted):
                outcome["error"] += "; the file its writer had published was removed"
            self._record_here(job.meta["rid"], outcome)
            logger.error("sglang_capture: capture of request %s failed: %s", job.meta["rid"], outcome["error"])
        job.outcome = outcome
        job.done.set()

    def _remove_published(self, path: str, rid: str, submitted_wall: float) -> bool:
        """A writer of a dead supervisor may have published its file before the outcome was
        recorded: remove the file if it is this request's (an outcome never says error beside a
        file it published)."""
        from sglang_capture.core.reader import read_meta

        try:
            st = os.stat(path)
            if st.st_mtime < submitted_wall - 1.0 or read_meta(path).get("rid") != rid:
                return False  # older than the job (a reused name and rid), or another request's
            unlink_if_same(os.path.basename(path), self._capture_dirs().capture, (st.st_dev, st.st_ino))
            return not os.path.exists(path)
        except Exception:  # noqa: BLE001 - not there, or not readable as a capture: not this job's
            return False

    def _recorded(self, rid: str, name: str) -> Optional[Dict[str, Any]]:
        """The outcome a supervisor recorded for this very job before it died, if it did."""
        try:
            doc = read_outcome(self._capture_dirs(), rid)
        except OSError:  # the capture dir is unusable
            return None
        return doc if doc is not None and doc.get("name") == name else None

    def _capture_dirs(self) -> DirFds:
        with self._dirs_lock:
            if self._dirs is None:
                self._dirs = DirFds.open(self.config.capture_dir)
            return self._dirs

    def _record_here(self, rid: str, outcome: Dict[str, Any]) -> None:
        try:
            record_outcome(self._capture_dirs(), rid, outcome)
        except Exception as e:  # noqa: BLE001 - an unwritable dir, or an outcome JSON cannot hold
            logger.error("sglang_capture: cannot record the outcome of %s: %s", rid, error_text(e))

    def _read_answers(self, sup: _Supervisor) -> None:
        """Apply every answer ``sup`` has written so far; at its EOF, clean up after it on a thread of its own."""
        messages, eof = sup.replies.read()
        for message in messages:
            try:
                self._answer(message, sup)
            except Exception as e:  # noqa: BLE001 - one answer's failure must not drop the rest
                logger.error("sglang_capture: handling the writer supervisor's %r failed: %s", message.get("op"), e)
        if eof:
            sup.gone = threading.Thread(target=self._gone, args=(sup,), daemon=True, name="sglang-capture-link-gone")
            sup.gone.start()

    def _gone(self, sup: _Supervisor) -> None:
        """``sup`` closed its end (it exited, or is exiting): fail what it held and start another,
        unless the link is closing."""
        sup.proc.wait()
        sup.proc.stdout.close()
        with self._send_lock:
            if self._closing or self._supervisor is not sup:
                return
            self._supervisor = None  # until another runs, jobs fail at once rather than wait
            try:
                self._after_death(sup)
            except Exception as e:  # noqa: BLE001 - another supervisor must start whatever happened
                logger.error("sglang_capture: cleaning up after the writer supervisor failed: %s", error_text(e))
            self._young_deaths = self._young_deaths + 1 if time.monotonic() - sup.started < YOUNG_DEATH_S else 0
            # at once unless the last one died young too: no job sees it missing
            if self._young_deaths <= 1 and self._start_another():
                return
        self._restart()

    def _start_another(self) -> bool:
        """Start a supervisor in place of a dead one (the caller holds the send lock)."""
        try:
            self._supervisor = self._spawn()
        except OSError as e:
            logger.error("sglang_capture: cannot start a writer supervisor: %s", e)
            return False
        with self._lock:
            self._changed = True
        return True

    def _restart(self) -> None:
        """Start another supervisor after a pause, doubling with each one in a row that died young (or
        failed to start); the send lock is free while waiting, and jobs meanwhile fail at once."""
        delay = min(2.0 ** max(self._young_deaths - 2, 0), 30.0)
        while True:
            logger.error("sglang_capture: starting another writer supervisor in %g s", delay)
            time.sleep(delay)
            with self._send_lock:
                if self._closing or self._closed or self._start_another():
                    return
            delay = min(2 * delay, 30.0)

    def _after_death(self, sup: _Supervisor) -> None:
        """The supervisor in hand died (the caller holds the send lock): fail what it held and record
        the aborted captures' outcomes it had not."""
        code = sup.proc.returncode
        with self._lock:
            held = [job for job, where in self._jobs.values() if where is sup]
            asked, self._asked = list(self._asked.values()), {}
            outcomes = dict(sup.outcomes)
        for event, _ in asked:
            event.set()
        why = f"the writer supervisor process {sup.proc.pid} exited (code {code}) before the file was written"
        for job in held:
            self._fail(job, why, sup)
        for rid, outcome in outcomes.items():
            if not os.path.exists(index_path(self.config.capture_dir, rid)):
                self._record_here(rid, outcome)
        logger.error("sglang_capture: %s; %d capture(s) failed with it, starting another", why, len(held))
        with self._lock:
            self.stats["supervisor_restarts"] += 1
            self._dead.append(sup.proc.pid)

    def _answer(self, message: Dict[str, Any], sup: _Supervisor) -> None:
        op = message["op"]
        if op == "copied":
            with self._lock:
                entry = self._jobs.get(message["id"])
            if entry is not None:
                entry[0].free_rows()
        elif op == "blocks":
            with self._lock:
                entry = self._jobs.get(message["id"])
            if entry is not None:
                entry[0].written = message.get("written")
                self.blocks_outcome(entry[0], message["stored"], message["missing"], message["ok"])
        elif op == "done":
            job = self._take(message["id"], sup)
            if job is not None:
                job.free_rows()
                job.outcome = message["outcome"]
                job.done.set()
                self.job_settled(job)
        elif op == "recorded":
            with self._lock:
                sup.outcomes.pop(message["rid"], None)
        elif op == "ready":  # it retired its predecessors' stats files
            with self._lock:
                self._dead = []
            self._ready.set()
        elif op in ("answer", "swept"):
            with self._lock:
                event, answer = self._asked.pop(message["id"], (None, {}))
            answer.update(message)
            if event is not None:
                event.set()

    def _summed(self) -> Dict[str, float]:
        return {**self.stats, "back_pressure_waits": self.ledger.waits}

    def _push_stats(self, force: bool = False) -> None:
        """This side's counters to the supervisor, for its stats file: at most once per
        ``STATS_PUSH_S`` while jobs come and go or the scheduler's own counters (its seams) move,
        not at all while nothing changes; ``force``d ahead of every batch of jobs, then without the
        CUDA allocator's stats unless they are due. A server that captures nothing still reports
        its scheduler thread's seams: the plain side of a capture-against-none comparison."""
        now = time.monotonic()
        with self._lock:
            if not force and now - self._last_push < STATS_PUSH_S:
                return
            self._last_push, changed, self._changed = now, self._changed, False
            # none while no supervisor is up to take them (every batch of jobs pushes, forced)
            cuda = self._supervisor is not None and now - self._last_cuda_push >= STATS_PUSH_S
        try:
            extra = self._extra_stats()
        except Exception as e:  # noqa: BLE001 - monitoring must never end the link
            extra = {"extra_stats_error": error_text(e)}
        if not (force or changed or extra != self._pushed_extra):
            return
        doc = {"held_bytes": self.ledger.held_bytes, "peak_held_bytes": self.ledger.peak_bytes,
               "cap_bytes": self.ledger.cap_bytes, **extra}
        if cuda:  # torch builds its whole allocator dict per call: not once per batch of jobs (the supervisor keeps the last)
            # the scheduler's GPU, named: this thread's current device is the process's first
            device = () if self._cuda_device is None else (self._cuda_device,)
            slow = (_cuda_stats("host_memory_stats", _PINNED_KEYS),
                    _cuda_stats("memory_stats", _DEVICE_ALLOCATOR_KEYS, *device))
            doc.update(zip(SLOW_STATS, slow))
        with self._send_lock:  # the counts since the supervisor in hand started, and no restart in between
            with self._lock:
                summed = self._summed()
                own = {k: v - self._baseline.get(k, 0) for k, v in summed.items()}
            if self._send_locked([{"op": "stats", "stats": {**own, **doc}}]):
                self._pushed_extra = extra  # as sent, in the order sent: a push out of order is corrected by the next
                with self._lock:
                    self._pushed = summed
                    if cuda:  # a failed send (a supervisor restarting) sends them with the next push
                        self._last_cuda_push = max(self._last_cuda_push, now)
