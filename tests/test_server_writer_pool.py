"""The writer pool: hand-off threads and writer processes (server/writer_pool.py)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.writer_pool import WriterPool
from tests.jobs import make_job, write_and_wait


def test_writer_publishes_whole_files_and_records_the_outcome(tmp_path):
    import json
    import os

    from sglang_capture import load
    from sglang_capture.core.capture_dir import index_path, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=2)
    rows = torch.arange(8, dtype=torch.float32).view(2, 4)
    job, ledger = make_job(tmp_path, [(0, rows)], 2)
    writer = WriterPool(cfg, ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "req-1")))
    assert outcome["status"] == "ok" and outcome["bytes"] == os.path.getsize(outcome["path"])
    data = load(outcome["path"])
    assert torch.equal(data["aux_hidden_states"], rows[:, :2]) and torch.equal(data["last_hidden_states"], rows[:, 2:])
    assert ledger.held_bytes == 0 and os.listdir(tmp_path / ".tmp") == []
    [stats] = writer_stats(str(tmp_path)).values()
    assert stats["written"] == 1 and stats["queue"] == 0 and stats["peak_held_bytes"] == rows.numel() * 4
    assert stats["inline_bytes"] == rows.numel() * 4  # not in a host pool: the rows went down the pipe
    assert stats["cap_bytes"] == ledger.cap_bytes


@pytest.mark.parametrize("interval_ms", [1.0, 0.0])
def test_writer_shortens_the_gil_switch_interval_only_once_it_runs(tmp_path, interval_ms):
    import sys

    from sglang_capture.server.writer_pool import WriterPool

    before = sys.getswitchinterval()
    try:
        cfg = CaptureConfig(capture_dir=str(tmp_path), writers=1, switch_interval_ms=interval_ms)
        job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2)
        writer = WriterPool(cfg, ledger)
        assert sys.getswitchinterval() == before  # an idle capture server keeps Python's interval
        writer.submit(job)
        writer.close()
        assert sys.getswitchinterval() == pytest.approx(interval_ms / 1000 if interval_ms else before)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ConfigError, match="switch-interval"):
        CaptureConfig(capture_dir=str(tmp_path), switch_interval_ms=-1)


def test_writer_failure_leaves_no_file_and_an_error_outcome(tmp_path):
    import json
    import os

    from sglang_capture.core.capture_dir import index_path, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=1)
    job, ledger = make_job(tmp_path, [(0, torch.zeros(1, 4))], 3, name="short")
    writer = WriterPool(cfg, ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "short")))
    assert outcome["status"] == "error" and "rows missing at positions 1-2" in outcome["error"]
    assert not os.path.exists(outcome["path"]) and os.listdir(tmp_path / ".tmp") == []
    [stats] = writer_stats(str(tmp_path)).values()
    assert ledger.held_bytes == 0 and stats["failed"] == 1


def test_writer_processes_read_pool_rows_in_place_at_lower_priority_on_their_cpus_and_free_the_block_once_read(tmp_path):
    import os

    from sglang_capture import load
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.writer_pool import WriterPool

    pool = HostPool(1 << 20, pin=False)
    rows = torch.randn(6, 4).to(torch.bfloat16)
    block = pool.take(rows)
    job, ledger = make_job(tmp_path, [(0, block[:4]), (4, block[4:])], 6)  # two chunks of one batch block
    del block
    cpu = min(os.sched_getaffinity(0))
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=2, writer_nice=7, writer_cpus=[cpu]), ledger)
    writer.start(pool)
    try:
        outcome = write_and_wait(writer, job)
        assert outcome["status"] == "ok", outcome
        data = load(outcome["path"])
        assert torch.equal(data["aux_hidden_states"].view(torch.int16), rows[:, :2].view(torch.int16))
        assert torch.equal(data["last_hidden_states"].view(torch.int16), rows[:, 2:].view(torch.int16))
        assert writer.counters()["inline_bytes"] == 0  # only offsets crossed the pipe
        assert pool.free_segments() == [(0, 1 << 20)] and ledger.held_bytes == 0
        pids = writer.writer_pids()
        assert len(pids) == 2 and os.getpid() not in pids and writer.supervisor_pid() not in pids
        # neither the supervisor nor the writer processes load torch (a few MB each, not hundreds)
        for pid in [writer.supervisor_pid(), *pids]:
            assert "libtorch" not in open(f"/proc/{pid}/maps").read()
        lowered = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        for pid in pids:  # the writer processes yield the CPU to the server and keep to their CPUs
            deadline = time.monotonic() + 30  # the idle one lowers it when it reads its first message
            while os.getpriority(os.PRIO_PROCESS, pid) != lowered or os.sched_getaffinity(pid) != {cpu}:
                assert time.monotonic() < deadline, (f"writer process {pid} kept priority {os.getpriority(os.PRIO_PROCESS, pid)}"
                                                     f", CPUs {os.sched_getaffinity(pid)}")
                time.sleep(0.01)
    finally:
        writer.close()
    assert writer.writer_pids() == []


def test_writer_stall_timeout_must_be_positive(tmp_path):
    with pytest.raises(ConfigError, match="^--capture-writer-stall-timeout must be a positive number of seconds, got 0"):
        CaptureConfig(capture_dir=str(tmp_path), writer_stall_s=0)


def test_a_gone_quiet_side_is_stalled_while_one_sending_progress_is_waited_for():
    import os
    import select

    from sglang_capture.core.handoff import Heartbeat, Stalled, recv_reply, send

    r, w = os.pipe()
    try:
        beat = Heartbeat(w, interval=0.1)

        def slow_but_moving():  # 1.5 s of work in small steps, then the answer
            for _ in range(30):
                time.sleep(0.05)
                beat()
            send(w, {"op": "done", "n": 1})

        t = threading.Thread(target=slow_but_moving)
        t0 = time.monotonic()
        t.start()
        assert recv_reply(r, stall_s=0.5) == {"op": "done", "n": 1} and time.monotonic() - t0 >= 1.5
        t.join()
        t0 = time.monotonic()
        with pytest.raises(Stalled):
            recv_reply(r, stall_s=0.3)  # nothing comes
        assert 0.3 <= time.monotonic() - t0 < 2
        Heartbeat(w, interval=10.0)()  # within its interval: sends nothing (small files cost no wake-ups)
        assert not select.select([r], [], [], 0.1)[0]
    finally:
        os.close(r)
        os.close(w)


def test_a_writer_shows_progress_after_every_frame_payload_and_every_step_of_its_flush(tmp_path, monkeypatch):
    """Progress follows each frame's payload as it is written and each step of the file as it
    reaches the disk, also after the last write (issue 34 items 2 and 8: one fsync at the end,
    which reported nothing, used to carry the whole file)."""
    from sglang_capture.core import format as fmt
    from sglang_capture.core.format import host_tensor, write_capture
    from sglang_capture.writer import durability
    from sglang_capture.writer.durability import WriteBehind

    monkeypatch.setattr(fmt, "FRAME_BYTES", 4096)  # 16 frames of 4 KiB of rows
    events = []
    real = durability.sync_file_range
    monkeypatch.setattr(durability, "sync_file_range",
                        lambda fd, off, n, wait: (events.append(("wait" if wait else "start", off, n)), real(fd, off, n, wait)))

    class Recorded:  # the temp file, recording what is written to it
        def __init__(self, f):
            self.f = f

        def write(self, data):
            events.append(("write", memoryview(data).nbytes))
            self.f.write(data)

        def flush(self):
            self.f.flush()

        def fileno(self):
            return self.f.fileno()

    with open(tmp_path / "moving", "wb") as f:
        behind = WriteBehind(Recorded(f), lambda: events.append(("progress",)), step=16384)
        nbytes, _ = write_capture(behind, {"rid": "moving"}, {"rows": host_tensor(torch.randn(16, 1024))},
                                  CaptureConfig(capture_dir=str(tmp_path)).codec_spec())
        last_write = len(events)
        behind.finish()
    payloads = [i for i, e in enumerate(events) if e[0] == "write" and e[1] >= 2048]
    assert len(payloads) == 16
    waits = [i for i, e in enumerate(events) if e[0] == "wait"]
    assert all(events[i + 1] == ("progress",) for i in payloads + waits)
    assert any(i > last_write for i in waits)  # during the flush that follows the last write
    steps = [e[1:] for e in events if e[0] == "wait"]  # every byte waited for once, in order, a step at most each
    assert [off for off, _ in steps] == [0] + [off + n for off, n in steps[:-1]] and sum(n for _, n in steps) == nbytes
    assert max(n for _, n in steps) <= 16384
    assert os.path.getsize(tmp_path / "moving") == nbytes


def test_the_scheduler_process_only_sends_jobs_the_supervisor_records_outcomes_and_stats(tmp_path, monkeypatch):
    """Issue 51 item 1: in the scheduler process a job costs a message out and two in, sent and read
    by pumps (here the idle pump's thread, the one thread the link adds); the hand-off threads, the
    outcome records and the stats file live in the supervisor process."""
    import json

    import sglang_capture.core.capture_dir as capture_dir
    import sglang_capture.server.writer_pool as writer_pool
    from sglang_capture.core.capture_dir import index_path, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    def not_here(*a, **k):
        raise AssertionError("the scheduler process wrote a capture dir record")

    monkeypatch.setattr(capture_dir, "record_outcome", not_here)
    monkeypatch.setattr(writer_pool, "record_outcome", not_here)
    monkeypatch.setattr(capture_dir.StatsFile, "write", not_here)
    before = set(threading.enumerate())
    rows = torch.arange(8, dtype=torch.float32).view(2, 4)
    job, ledger = make_job(tmp_path, [(0, rows)], 2, name="moved")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=2), ledger)
    try:
        outcome = write_and_wait(writer, job)
        assert outcome["status"] == "ok" and ledger.held_bytes == 0
        assert json.load(open(index_path(str(tmp_path), "moved")))["status"] == "ok"
        ours = {t.name for t in set(threading.enumerate()) - before}
        assert ours == {"sglang-capture-link"}, ours
        supervisor = writer.supervisor_pid()
        assert supervisor not in (None, os.getpid()) and len(writer.writer_pids()) == 2
    finally:
        writer.close()
    [stats] = writer_stats(str(tmp_path)).values()
    assert stats["supervisor_pid"] == supervisor and stats["written"] == 1
    assert stats["peak_held_bytes"] == rows.numel() * 4  # this side's counters reach the file too


def test_the_scheduler_threads_pumps_send_each_job_once_its_copies_are_done_and_read_its_answers(tmp_path, monkeypatch):
    """Issue 51 item 1: the link runs on the thread that pumps it (SGLang's scheduler thread, once
    per turn of its loop). A job goes out only once its rows' copies are done, and the job behind
    it waits (the order kept); its answers are read by the next pumps. Here the idle pump never
    runs: nothing else moves the jobs."""
    import sglang_capture.server.writer_pool as writer_module

    monkeypatch.setattr(writer_module, "IDLE_PUMP_S", 3600.0)
    monkeypatch.setattr(writer_module, "IDLE_READ_S", 3600.0)

    class Copy:  # a device-to-host copy's event, done when the test says so
        done = False

        def query(self):
            return self.done

        def synchronize(self):
            assert self.done, "waited for a copy the link should not have sent yet"

    copy = Copy()
    first, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="first")
    first.capture.chunks[0].ready = copy
    second, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="second")
    sent = []
    real = writer_module.job_message
    monkeypatch.setattr(writer_module, "job_message", lambda job, pool: (sent.append(job.capture.name), real(job, pool))[1])
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    try:
        writer.start()  # the supervisor's ready read by start's own pumps
        writer.submit(first)
        writer.submit(second)
        writer.pump()
        assert sent == [] and writer.pending() == 2
        copy.done = True
        writer.pump()
        assert sent == ["first", "second"]
        time.sleep(0.5)
        assert not first.done.is_set() and not second.done.is_set()  # written by now, but no pump read the answers
        deadline = time.monotonic() + 30
        while not (first.done.is_set() and second.done.is_set()):
            assert time.monotonic() < deadline, "the pumps never read the answers"
            writer.pump()
            time.sleep(0.01)
        assert first.outcome["status"] == second.outcome["status"] == "ok" and writer.pending() == 0
    finally:
        writer.close()


def test_a_supervisor_that_stops_reading_never_stops_the_scheduler_threads_pump(tmp_path):
    """Jobs whose rows travel inline (outside the pool) to a supervisor stopped (SIGSTOP): each pump
    returns at once, the bytes the pipe cannot take wait for later pumps, and once it reads again
    every job is written."""
    import signal

    jobs, ledger = [], None
    for i in range(3):
        job, ledger_i = make_job(tmp_path, [(0, torch.full((1024, 1024), float(i)))], 1024, name=f"big-{i}")
        jobs.append(job)
        ledger = ledger or ledger_i
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.start()
    supervisor = writer.supervisor_pid()
    os.kill(supervisor, signal.SIGSTOP)
    try:
        for job in jobs:
            writer.submit(job)
        for _ in range(5):
            t0 = time.monotonic()
            writer.pump()
            assert time.monotonic() - t0 < 0.5
        assert writer._supervisor.out.pending_bytes > 0  # 12 MiB inline: the pipe holds 1 MiB
    finally:
        os.kill(supervisor, signal.SIGCONT)
    try:
        for job in jobs:
            assert job.done.wait(60) and job.outcome["status"] == "ok", job.outcome
    finally:
        writer.close()


def test_a_supervisor_that_dies_fails_only_the_jobs_it_held_and_another_takes_the_next(tmp_path):
    """The supervisor is killed while a writer holds a job: that job's outcome says so (recorded by
    the scheduler side), its rows are freed, its writer dies with the supervisor (nothing is
    published after the error was recorded), and a new supervisor writes the next job."""
    import json
    import signal

    from sglang_capture.core.capture_dir import index_path, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    held, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="held")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1, writer_nice=1), ledger)
    lowered = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 1)
    try:
        writer.start()
        deadline = time.monotonic() + 30
        # the writer is ready (its priority lowered after the supervisor's hello) before it is stopped
        while len(writer.writer_pids()) != 1 or os.getpriority(os.PRIO_PROCESS, writer.writer_pids()[0]) != lowered:
            assert time.monotonic() < deadline, "no writer process started"
            time.sleep(0.01)
        [pid], supervisor = writer.writer_pids(), writer.supervisor_pid()
        os.kill(pid, signal.SIGSTOP)  # the job waits in the writer's pipe
        writer.submit(held)
        while writer.counters().get("busy") != 1:
            assert time.monotonic() < deadline, "the supervisor never handed the job on"
            time.sleep(0.01)
        os.kill(supervisor, signal.SIGKILL)
        assert held.done.wait(30)
        assert held.outcome["status"] == "error" and held.outcome["error"] == (
            f"the writer supervisor process {supervisor} exited (code -9) before the file was written")
        assert json.load(open(index_path(str(tmp_path), "held"))) == held.outcome and ledger.held_bytes == 0
        while os.path.exists(f"/proc/{pid}") and open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline, "the writer outlived its supervisor"
            time.sleep(0.01)
        kept, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert write_and_wait(writer, kept)["status"] == "ok"
        assert writer.supervisor_pid() not in (None, supervisor)
        assert not os.path.exists(tmp_path / "held.capture.msgpack")
    finally:
        writer.close()
    [stats] = writer_stats(str(tmp_path)).values()  # the dead supervisor's file went to the history
    assert stats["supervisor_restarts"] == 1 and stats["failed_in_scheduler"] == 1


def test_jobs_described_while_the_supervisor_dies_go_to_the_next_one_never_failed_and_then_written(tmp_path, monkeypatch):
    """A batch being described when the supervisor dies: its jobs were not yet sent, so its death
    fails none of them; the send finds the pipe broken, they go back to the outbox, and the next
    supervisor (started once a pump reads the dead one's EOF) writes them all (a job failed by the
    death and sent to the next one anyway would have its error record overwritten by a file)."""
    import json
    import signal

    import sglang_capture.server.writer_pool as writer_module
    from sglang_capture.core.capture_dir import index_path

    first, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="A")
    second, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="B")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.start()
    dead = writer.supervisor_pid()
    real = writer_module.job_message

    def describing(job, pool):
        if job.capture.name == "A":
            time.sleep(0.3)  # B queues up behind A: one batch
        elif writer.supervisor_pid() == dead:
            os.kill(dead, signal.SIGKILL)
            writer._supervisor.proc.wait(30)  # its end of the pipe is closed before the batch is sent
        return real(job, pool)

    monkeypatch.setattr(writer_module, "job_message", describing)
    try:
        writer.submit(first)
        writer.submit(second)
        for job in (first, second):
            assert job.done.wait(30) and job.outcome["status"] == "ok", job.outcome
            assert json.load(open(index_path(str(tmp_path), job.meta["rid"])))["status"] == "ok"
        assert ledger.held_bytes == 0 and writer.pending() == 0
    finally:
        writer.close()


def test_a_job_whose_message_cannot_be_packed_fails_alone_and_the_link_goes_on(tmp_path):
    import json

    import numpy

    from sglang_capture.core.capture_dir import index_path

    bad, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="bad")
    bad.meta["extra"] = numpy.int64(3)  # msgpack cannot pack it
    good, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="good")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    try:
        writer.submit(bad)
        writer.submit(good)
        assert bad.done.wait(30) and bad.outcome["status"] == "error"
        assert "cannot be encoded" in bad.outcome["error"]
        assert json.load(open(index_path(str(tmp_path), "bad")))["status"] == "error"
        assert good.done.wait(30) and good.outcome["status"] == "ok"
        assert ledger.held_bytes == 0 and writer.pending() == 0
    finally:
        writer.close()


def test_a_job_submitted_after_close_fails_at_once_and_starts_nothing(tmp_path):
    from sglang_capture.core.capture_dir import index_path

    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="late")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.start()
    writer.close()
    writer.submit(job)
    assert job.done.is_set() and job.outcome["status"] == "error" and "stopping" in job.outcome["error"]
    assert os.path.exists(index_path(str(tmp_path), "late"))
    assert writer.supervisor_pid() is None and writer.pending() == 0 and ledger.held_bytes == 0


def test_a_file_published_by_a_dead_supervisors_writer_is_removed_when_its_outcome_says_error(tmp_path):
    """The supervisor died between its writer's publishing and the outcome: the scheduler side fails
    the job, and removes the file under the request's name if it is this request's (its metadata
    says so), so an error never stands beside a published file; another request's file is kept."""
    import json
    import types

    from sglang_capture.core.capture_dir import index_path, prepare_capture_dir
    from sglang_capture.core.format import host_tensor, write_capture

    prepare_capture_dir(str(tmp_path))
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
    dead = types.SimpleNamespace()
    for name, rid in (("mine", "mine"), ("theirs", "someone-else")):
        with open(tmp_path / f"{name}.capture.msgpack", "wb") as f:
            write_capture(f, {"rid": rid}, {"rows": host_tensor(torch.zeros(2, 4))},
                          CaptureConfig(capture_dir=str(tmp_path)).codec_spec())
        job, _ = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name=name)
        writer._jobs[job.id] = (job, dead)
        writer._open += 1
        writer._fail(job, "the writer supervisor process 1 exited (code -9) before the file was written", dead)
        recorded = json.load(open(index_path(str(tmp_path), name)))
        assert recorded == job.outcome and recorded["status"] == "error"
        if name == "mine":
            assert not (tmp_path / "mine.capture.msgpack").exists()
            assert recorded["error"].endswith("; the file its writer had published was removed")
        else:
            assert (tmp_path / "theirs.capture.msgpack").exists() and "removed" not in recorded["error"]
    assert writer.pending() == 0


def test_while_no_supervisor_can_start_jobs_fail_at_once_and_close_keeps_its_time(tmp_path, monkeypatch):
    """A supervisor dies and none can be started in its place (no processes left, say): jobs fail at
    once instead of holding their rows (which would stall the scheduler on back-pressure), restarts
    are retried with pauses, and close() returns within its timeout."""
    import signal

    import sglang_capture.server.writer_pool as writer_module

    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="nowhere")
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.start()
    dead = writer.supervisor_pid()

    class NoProcesses:
        def __init__(self, *a, **k):
            raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(writer_module.subprocess, "Popen", NoProcesses)
    os.kill(dead, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while writer.supervisor_pid() is not None or writer._supervisor is not None:
        assert time.monotonic() < deadline, "the dead supervisor was never noticed"
        time.sleep(0.01)
    writer.submit(job)
    assert job.done.wait(10) and job.outcome["status"] == "error", job.outcome
    assert writer.pending() == 0 and ledger.held_bytes == 0
    t0 = time.monotonic()
    writer.close(timeout=5)
    assert time.monotonic() - t0 < 6


def test_the_cuda_allocator_stats_go_at_most_once_per_push_interval_and_the_stats_file_keeps_them(tmp_path, monkeypatch):
    """The scheduler side's counters are pushed ahead of every batch of jobs; torch builds its whole
    allocator dict per call, so those go at most every STATS_PUSH_S, and the supervisor keeps the
    last ones in the stats file meanwhile."""
    import sglang_capture.server.writer_pool as writer_pool
    from sglang_capture.core.capture_dir import writer_stats

    calls = []

    def fake_cuda_stats(read, keys):
        calls.append(read)
        return {"reads": len(calls)}

    monkeypatch.setattr(writer_pool, "_cuda_stats", fake_cuda_stats)
    monkeypatch.setattr(writer_pool, "STATS_PUSH_S", 30.0)
    jobs = []
    for i in range(4):
        job, ledger = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name=f"s{i}")
        jobs.append((job, ledger))
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), jobs[0][1])
    try:
        for job, _ in jobs:  # four batches of jobs, each pushed the counters ahead of it
            assert write_and_wait(writer, job)["status"] == "ok"
    finally:
        writer.close()
    # the start and close pushes are forced too: the first carried them, none after within 30 s
    assert calls == ["host_memory_stats", "memory_stats"]
    [stats] = writer_stats(str(tmp_path)).values()
    assert stats["written"] == 4 and stats["device_allocator"] == {"reads": 2} and stats["pinned"] == {"reads": 1}


def test_a_server_that_captures_nothing_still_reports_its_scheduler_counters_as_they_change(tmp_path):
    """The scheduler's own counters (its seams) reach the stats file within seconds of changing,
    with no job in between: a plain server's seams are the other side of a capture comparison.
    While they do not change, nothing is pushed."""
    from sglang_capture.core.capture_dir import writer_stats

    seams = {"calls": 0}
    pushes = []
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
    real_send = writer._send_locked

    def counted(messages):
        pushes.extend(m for m in messages if m["op"] == "stats")
        return real_send(messages)

    writer._send_locked = counted
    try:
        writer.start(extra_stats=lambda: {"scheduler_thread": dict(seams)})

        def file_says(calls):
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline:
                stats = list(writer_stats(str(tmp_path)).values())
                if stats and stats[0].get("scheduler_thread") == {"calls": calls}:
                    return True
                time.sleep(0.1)
            return False

        assert file_says(0)
        seams["calls"] = 3
        assert file_says(3)
        settled = len(pushes)
        time.sleep(1.5)  # three push intervals with nothing changed
        assert len(pushes) == settled
    finally:
        writer.close()
