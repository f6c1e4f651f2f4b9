"""The writer supervisor's hand-off (writer/supervisor.py), run in-process: writer processes that die,
stall or are ended mid-flush, and the outcomes that follow."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from sglang_capture.core.config import CaptureConfig
from tests.jobs import make_wire_job, write_and_wait


def _one_writer(tmp_path, **config):
    """A started supervisor with one writer process, and that process's pid."""
    from sglang_capture.writer.supervisor import Supervisor

    writer = Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=1, **config))
    writer.start()
    deadline = time.monotonic() + 30
    while not writer.writer_pids():
        assert time.monotonic() < deadline, "no writer process started"
        time.sleep(0.01)
    return writer, writer.writer_pids()[0]


def test_a_writer_process_that_dies_fails_only_its_job_and_is_replaced(tmp_path):
    import os
    import signal

    first, ledger = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="lost")
    writer, pid = _one_writer(tmp_path)
    try:
        os.kill(pid, signal.SIGSTOP)  # the job waits in its pipe ...
        writer.submit(first)
        deadline = time.monotonic() + 30
        while writer.pending() and writer._busy == 0:
            assert time.monotonic() < deadline, "the job was never handed to the writer"
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)  # ... and the process dies holding it
        assert first.done.wait(30)
        assert first.outcome["status"] == "error" and f"writer process {pid} exited" in first.outcome["error"]
        second, _ = make_wire_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert write_and_wait(writer, second)["status"] == "ok"
        assert writer.stats["restarts"] == 1 and writer.writer_pids() != [pid]
        assert ledger.held_bytes == 0
    finally:
        writer.close()


def test_a_writer_process_that_makes_no_progress_fails_its_job_is_killed_replaced_and_counted(tmp_path):
    import os
    import signal

    job, ledger = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="stuck")
    writer, pid = _one_writer(tmp_path, writer_stall_s=1.0)
    try:
        os.kill(pid, signal.SIGSTOP)  # as a process blocked on a hung mount: alive, silent
        t0 = time.monotonic()
        outcome = write_and_wait(writer, job, timeout=30)
        assert 1.0 <= time.monotonic() - t0 < 15
        assert outcome["status"] == "error" and outcome["error"] == (
            f"WriterStalled: writer process {pid} made no progress for 1 s (a hung disk or network mount?); "
            "it was killed and replaced")
        assert writer.stats["stalled"] == 1 and writer.stats["failed"] == 1 and writer.stats["restarts"] == 1
        assert ledger.held_bytes == 0
        deadline = time.monotonic() + 10
        while os.path.exists(f"/proc/{pid}"):  # killed, and reaped: no zombie left behind
            assert time.monotonic() < deadline, open(f"/proc/{pid}/stat").read()
            time.sleep(0.05)
        kept, _ = make_wire_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert write_and_wait(writer, kept)["status"] == "ok" and writer.writer_pids() not in ([], [pid])
        assert not os.path.exists(tmp_path / "stuck.capture.msgpack")
    finally:
        writer.close()


def test_a_writer_process_gone_before_it_took_the_job_is_replaced_and_the_job_written(tmp_path, monkeypatch):
    import os
    import signal

    from sglang_capture.writer import supervisor as writer_module

    job, ledger = make_wire_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="handed-on")
    writer, pid = _one_writer(tmp_path)
    deadline = time.monotonic() + 30
    try:
        # the process dies between the hand-off thread's liveness check and its send
        monkeypatch.setattr(writer_module.WriterChild, "alive", lambda self: True)
        os.kill(pid, signal.SIGKILL)
        while open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        outcome = write_and_wait(writer, job)
        assert outcome["status"] == "ok", outcome
        assert writer.stats["restarts"] == 1 and writer.writer_pids() != [pid] and ledger.held_bytes == 0
    finally:
        writer.close()


def test_an_abort_outcome_is_recorded_by_a_hand_off_thread_not_the_caller(tmp_path, monkeypatch):
    import json

    import sglang_capture.writer.supervisor as writer_module
    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.writer.supervisor import Supervisor

    recorded_on = []
    real = writer_module.record_outcome
    monkeypatch.setattr(writer_module, "record_outcome",
                        lambda *a: (recorded_on.append(threading.current_thread().name), real(*a)))
    writer = Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    writer.submit_outcome("gone", {"rid": "gone", "status": "aborted", "error": "client disconnected"})
    writer.close()
    assert json.load(open(index_path(str(tmp_path), "gone")))["status"] == "aborted"
    assert recorded_on == ["sglang-capture-handoff-0"]


# Installed in writer processes through their PYTHONPATH: os.fsync of a directory or a regular file
# (SLOW_FSYNC_OF) marks SLOW_FSYNC_MARK and then takes a minute, so the test can end the process
# exactly there.
_SLOW_FSYNC = '''
import os, stat, time
_fsync = os.fsync
def fsync(fd):
    if ("dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file") == os.environ["SLOW_FSYNC_OF"]:
        open(os.environ["SLOW_FSYNC_MARK"], "w").close()
        time.sleep(60)
    return _fsync(fd)
os.fsync = fsync
'''


@pytest.mark.parametrize("where,sig,flush_fails", [
    ("dir", "SIGKILL", False), ("dir", "SIGSTOP", False), ("dir", "SIGKILL", True), ("file", "SIGKILL", False)],
    ids=["killed-in-dir-flush", "stalled-in-dir-flush", "killed-in-dir-flush-and-flush-fails", "killed-in-file-flush"])
def test_a_writer_ended_while_flushing_leaves_an_outcome_that_matches_the_file(tmp_path, monkeypatch, where, sig,
                                                                                flush_fails):
    """Issue 34 item 4: ended in the directory's flush, after the file got its name, the file is
    whole and kept, and the outcome says ok with its size and checksum (the name's flush is done
    by the hand-off thread; if that fails the file is removed and the outcome says error). Ended
    in the file's own flush, before the name: error, and no file. The temp file goes either way."""
    import errno
    import json
    import signal

    from sglang_capture import load
    from sglang_capture.core import checksum
    from sglang_capture.core.capture_dir import index_path

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(_SLOW_FSYNC)
    mark = tmp_path / "in-fsync"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("SLOW_FSYNC_OF", where)
    monkeypatch.setenv("SLOW_FSYNC_MARK", str(mark))
    capture_dir = tmp_path / "captures"
    capture_dir.mkdir()
    job, ledger = make_wire_job(capture_dir, [(0, torch.randn(64, 4))], 64, name="flushing")
    writer, pid = _one_writer(capture_dir, writer_stall_s=5.0)  # a loaded machine must not stall it first
    if flush_fails:
        real_fsync = os.fsync

        def failing(fd):
            if os.path.isdir(f"/proc/self/fd/{fd}"):
                raise OSError(errno.EIO, "Input/output error")
            return real_fsync(fd)

        monkeypatch.setattr(os, "fsync", failing)
    try:
        writer.submit(job)
        deadline = time.monotonic() + 30
        while not mark.exists():
            assert time.monotonic() < deadline, "the writer never reached its flush"
            time.sleep(0.005)
        os.kill(pid, getattr(signal, sig))
        assert job.done.wait(30)
    finally:
        writer.close()
    outcome = json.load(open(index_path(str(capture_dir), "flushing")))
    path = capture_dir / "flushing.capture.msgpack"
    assert os.listdir(capture_dir / ".tmp") == []
    if where == "dir" and not flush_fails:
        assert outcome["status"] == "ok", outcome
        assert outcome["bytes"] == os.path.getsize(path) and outcome["checksum"] == checksum.of_file(str(path))
        assert load(str(path))["aux_hidden_states"].shape == (64, 2)
        assert writer.stats["published_by_handoff"] == 1 and writer.stats["written"] == 1
    else:
        assert outcome["status"] == "error" and not path.exists()
        if flush_fails:
            assert outcome["error"].endswith("then flushing its name failed (OSError: Input/output error), "
                                             "so the file was removed")


def test_a_writer_still_stuck_in_the_kernel_gets_an_error_outcome_and_its_file_goes_once_it_exits(tmp_path):
    """Killed while stuck in the kernel (a hung mount), a process that announced its file may still
    link it after the outcome was recorded: the outcome says error and whatever it names is removed
    once it is gone. A file under the name that is not the announced one is kept."""
    import threading
    import types

    from sglang_capture.writer.child import WriterStalled
    from sglang_capture.writer.supervisor import Supervisor

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=1)
    pool = Supervisor(cfg)
    job, _ = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="late")
    path = tmp_path / "late.capture.msgpack"
    path.write_bytes(b"a whole file, linked after the outcome")
    st = os.stat(path)
    job.publishing = {"op": "publishing", "dev": st.st_dev, "ino": st.st_ino, "bytes": 38, "checksum": "x"}
    child = types.SimpleNamespace(pid=1, proc=types.SimpleNamespace(returncode=None), exit_lock=threading.Lock(),
                                  temp=None, unlink_on_exit=None)
    outcome = pool._outcome_after_failure(job, WriterStalled("stalled"), child)
    assert outcome["status"] == "error" and outcome["error"].endswith("removed once the process ends")
    assert path.exists()  # not yet: the process is not gone
    child.proc.returncode = -9
    pool._child_exited(child)
    assert not path.exists()

    other, _ = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="taken")
    taken = tmp_path / "taken.capture.msgpack"
    taken.write_bytes(b"another request's file")
    other.publishing = {"op": "publishing", "dev": st.st_dev, "ino": st.st_ino + 1, "bytes": 1, "checksum": "x"}
    child.proc.returncode = None
    assert pool._outcome_after_failure(other, WriterStalled("stalled"), child)["status"] == "error"
    child.proc.returncode = -9
    pool._child_exited(child)
    assert taken.exists()


def test_a_name_flush_that_does_not_end_in_time_fails_the_capture_and_removes_the_file_when_it_ends(tmp_path):
    import threading

    from sglang_capture.writer.durability import Durability
    from sglang_capture.writer.supervisor import _flush_names_within

    release = threading.Event()

    class Hung(Durability):
        def sync_names(self, dir_fd: int) -> None:
            release.wait(30)

    path = tmp_path / "f.capture.msgpack"
    path.write_bytes(b"x")
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        t0 = time.monotonic()
        assert _flush_names_within(Hung(), fd, path.name, os.stat(path), 0.5) == "did not end within 0.5 s"
        assert time.monotonic() - t0 < 5 and path.exists()
        release.set()
        deadline = time.monotonic() + 10
        while path.exists():  # removed by the flush's own thread once the flush returned
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert _flush_names_within(Durability(), fd, path.name, os.stat(tmp_path), 5) is None
    finally:
        os.close(fd)


def test_a_frame_reader_returns_whole_messages_keeps_one_still_being_written_and_sees_eof():
    """The scheduler side reads the supervisor's pipe without waiting (server/writer_pool.py), one
    system call a read when the pipe holds less than a read's worth."""
    import struct

    import msgpack

    from sglang_capture.core.handoff import FrameReader

    r, w = os.pipe()
    os.set_blocking(r, False)
    reader = FrameReader(r)
    try:
        assert reader.read() == ([], False)  # nothing yet: no wait
        a, b = msgpack.packb({"op": "a"}), msgpack.packb({"op": "b", "rows": b"y" * 100})
        data = struct.pack(">Q", len(a)) + a + struct.pack(">Q", len(b)) + b
        os.write(w, data[:-10])
        assert reader.read() == ([{"op": "a"}], False)
        os.write(w, data[-10:])
        assert reader.read() == ([{"op": "b", "rows": b"y" * 100}], False)
        c = msgpack.packb({"op": "c"})
        os.write(w, struct.pack(">Q", len(c)) + c)
        os.close(w)  # the last frame and the close arrive together: the frame now, the EOF at the next read
        assert reader.read() == ([{"op": "c"}], False)
        assert reader.read() == ([], True)
    finally:
        os.close(r)


def _replies(fd, want, timeout=30.0):
    """Messages from the supervisor's side of the pipe (``many`` unpacked) until ``want`` of them are ``done``."""
    from sglang_capture.core.handoff import recv

    got, deadline = [], time.monotonic() + timeout
    while sum(m["op"] == "done" for m in got) < want:
        assert time.monotonic() < deadline, got
        message = recv(fd, timeout)
        assert message is not None, got
        got.extend(message["messages"] if message["op"] == "many" else [message])
    return got


def test_the_supervisor_takes_jobs_sent_together_and_answers_copied_then_done_for_each(tmp_path):
    """What the link sends as one message (``many``: what a pump found ready in the outbox) is taken
    job by job, and each job's ``copied`` comes before its ``done``, which carries the outcome."""
    from sglang_capture.core.handoff import send
    from sglang_capture.server.writer_pool import job_message
    from sglang_capture.writer.supervisor import SchedulerLink, Supervisor, serve
    from tests.jobs import make_job

    to_sup, from_link = os.pipe()
    from_sup, to_link = os.pipe()
    supervisor = Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=2))
    supervisor.start()
    link = SchedulerLink(to_link)
    server = threading.Thread(target=serve, args=(supervisor, link, to_sup), daemon=True)
    server.start()
    try:
        messages = []
        for i in range(2):
            job, _ = make_job(tmp_path, [(0, torch.full((2, 4), float(i)))], 2, name=f"together-{i}")
            job.id = i + 1
            messages.append(job_message(job, None))
        send(from_link, {"op": "many", "messages": messages})
        got = _replies(from_sup, 2)
        for i in (1, 2):
            ops = [m["op"] for m in got if m.get("id") == i]
            assert ops == ["copied", "done"], got
            [done] = [m for m in got if m.get("id") == i and m["op"] == "done"]
            assert done["outcome"]["status"] == "ok" and os.path.exists(done["outcome"]["path"])
    finally:
        os.close(from_link)  # EOF: the supervisor finishes and stops
        server.join(30)
        for fd in (to_sup, from_sup, to_link):
            os.close(fd)
    assert not server.is_alive()


def test_a_jobs_outcome_waits_until_its_blocks_message_is_on_the_pipe_to_the_scheduler(tmp_path):
    """``blocks`` returns (and the outcome record, which lets a chat's next turn in, is written) only
    once its message is on the pipe: the scheduler thread reads the pipe before it pulls that turn.
    Nothing answers it: with the pipe full, it waits for the scheduler side to read."""
    from sglang_capture.core.handoff import recv
    from sglang_capture.writer.supervisor import SchedulerLink

    from_sup, to_link = os.pipe()
    link = SchedulerLink(to_link)
    job, _ = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="shared")
    job.id = 7
    try:
        link.blocks(job, [["b" * 32, 0, 2]], [], True)  # room on the pipe: written at once
        assert recv(from_sup, 10) == {"op": "blocks", "id": 7, "stored": [["b" * 32, 0, 2]], "missing": [], "ok": True}
        os.set_blocking(to_link, False)
        filled = 0
        try:
            while True:
                filled += os.write(to_link, b"x" * 4096)
        except BlockingIOError:
            pass
        os.set_blocking(to_link, True)
        waiting = threading.Thread(target=link.blocks, args=(job, [], ["d" * 32], True))
        waiting.start()
        time.sleep(0.3)
        assert waiting.is_alive()  # not on the pipe yet: the outcome is not recorded
        got = 0
        while got < filled:
            got += len(os.read(from_sup, filled - got))
        waiting.join(10)
        assert not waiting.is_alive()
        assert recv(from_sup, 10) == {"op": "blocks", "id": 7, "stored": [], "missing": ["d" * 32], "ok": True}
    finally:
        link.flush()
        os.close(from_sup)
        os.close(to_link)


def test_the_stats_file_keeps_the_cuda_stats_sent_less_often_and_nothing_else_of_an_older_push(tmp_path):
    """The scheduler side sends its CUDA allocator's stats at most every STATS_PUSH_S, its counters
    with every batch of jobs: the file keeps the last CUDA stats between their sends, but no other key
    an older push had and a newer one did not (an error that has passed)."""
    import sglang_capture.core.capture_dir as capture_dir
    from sglang_capture.writer.supervisor import Supervisor

    writer = Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    try:
        writer.scheduler_stats({"held_bytes": 1, "pinned": {"n": 1}, "device_allocator": {"n": 2},
                                "extra_stats_error": "boom"})
        writer.scheduler_stats({"held_bytes": 2})
        writer.submit_outcome("s", {"rid": "s", "status": "aborted", "error": "client disconnected"})
    finally:
        writer.close()
    [stats] = capture_dir.writer_stats(str(tmp_path)).values()
    assert stats["held_bytes"] == 2 and stats["pinned"] == {"n": 1} and stats["device_allocator"] == {"n": 2}
    assert "extra_stats_error" not in stats


def test_a_file_that_reuses_rows_in_flight_is_written_only_once_the_job_storing_them_is_done(tmp_path, monkeypatch):
    """A capture may reuse rows whose blocks a queued job still stores (server/shared_rows.py): its
    share names that job (``after``), and the supervisor parks its file (or its job ahead, which
    checks the stored rows it references) until that job is done, so that it finds their blocks, or,
    when that job failed, fails naming them. Parked jobs then go in the order they came, each counted
    once; one naming a job no longer in hand goes at once, and other writers go on meanwhile. A
    parked job whose handling fails leaves nothing parked behind it."""
    from sglang_capture.writer.supervisor import Supervisor

    supervisor = Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=2))
    release, release6, written = threading.Event(), threading.Event(), []

    def write(slot, job):
        written.append(job.id)
        if job.id in (1, 6):
            assert (release if job.id == 1 else release6).wait(30)
        return {"rid": job.rid, "name": job.name, "path": supervisor._path(job), "status": "ok"}

    record = supervisor.record_outcome

    def record_outcome(rid, outcome):
        if rid == jobs[6].rid:
            raise RuntimeError("an outcome that cannot be recorded")
        record(rid, outcome)

    monkeypatch.setattr(supervisor, "_write", write)
    monkeypatch.setattr(supervisor, "record_outcome", record_outcome)
    jobs = {}
    for i, after in ((1, None), (2, [1]), (3, [1]), (4, [99]), (5, [1]), (6, None), (7, [6]), (8, None)):
        job, _ = make_wire_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name=f"job-{i}")
        job.id, job.share = i, ({"after": after} if after else None)
        jobs[i] = job
    jobs[3].ahead = True
    supervisor.start()
    try:
        supervisor.submit(jobs[1])
        deadline = time.monotonic() + 30
        while written != [1]:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for i in (2, 3, 4, 5):
            supervisor.submit(jobs[i])
        assert jobs[4].done.wait(30)  # its job is done already: on the other writer at once
        time.sleep(0.3)
        assert not any(jobs[i].done.is_set() or i in written for i in (2, 3, 5))
        assert supervisor.counters()["parked"] == 3 and supervisor.counters()["queue"] == 3
        release.set()
        for i in (1, 2, 3, 5):
            assert jobs[i].done.wait(30)
            assert jobs[i].outcome["status"] == "ok"
        assert written == [1, 4, 2, 3, 5]
        assert supervisor.counters()["queue"] == 0 and supervisor.counters()["parked"] == 3
        supervisor.submit(jobs[6])
        while 6 not in written:
            assert time.monotonic() < deadline + 30
            time.sleep(0.01)
        supervisor.submit(jobs[7])
        time.sleep(0.3)
        release6.set()  # job 6's handling then fails past its write: job 7 still goes, and the thread lives on
        assert jobs[7].done.wait(30) and jobs[7].outcome["status"] == "ok"
        supervisor.submit(jobs[8])
        assert jobs[8].done.wait(30)
    finally:
        release.set()
        release6.set()
        supervisor.close()


def test_a_frame_writer_never_waits_keeps_what_the_pipe_cannot_take_in_order_and_says_when_the_reader_is_gone():
    """The scheduler thread writes to the supervisor without waiting (server/writer_pool.py): a
    supervisor that stops reading never stops it."""
    from sglang_capture.core.handoff import FrameWriter, recv

    r, w = os.pipe()
    os.set_blocking(w, False)
    out = FrameWriter(w)
    try:
        big = {"op": "job", "rows": b"r" * (1 << 20)}  # more than the pipe holds
        t0 = time.monotonic()
        assert out.send_many([big]) and out.send_many([{"op": "a"}, {"op": "b"}])
        assert time.monotonic() - t0 < 0.5 and out.pending_bytes > 0
        got = []
        reader = threading.Thread(target=lambda: got.extend(recv(r, 10) for _ in range(2)))
        reader.start()
        out.flush(timeout=10)
        reader.join(10)
        assert out.pending_bytes == 0 and got == [big, {"op": "many", "messages": [{"op": "a"}, {"op": "b"}]}]
    finally:
        os.close(r)
    assert out.send_many([{"op": "c"}]) is False  # the reader is gone and nothing was pending: none of it went
    os.close(w)
