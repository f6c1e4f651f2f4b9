"""The writer pool: hand-off threads and writer processes (server/writer_pool.py)."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.server.ledger import HostMemoryLedger
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

    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=1)
    job, ledger = make_job(tmp_path, [(0, torch.zeros(1, 4))], 3, name="short")
    writer = WriterPool(cfg, ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "short")))
    assert outcome["status"] == "error" and "rows missing at positions 1-2" in outcome["error"]
    assert not os.path.exists(outcome["path"]) and os.listdir(tmp_path / ".tmp") == []
    assert ledger.held_bytes == 0 and writer.stats["failed"] == 1


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
        assert writer.stats["inline_bytes"] == 0  # only offsets crossed the pipe
        assert pool.free_segments() == [(0, 1 << 20)] and ledger.held_bytes == 0
        pids = writer.writer_pids()
        assert len(pids) == 2 and os.getpid() not in pids
        lowered = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        for pid in pids:  # the writer processes never load torch, yield the CPU to the server, keep to their CPUs
            assert "libtorch" not in open(f"/proc/{pid}/maps").read()
            deadline = time.monotonic() + 30  # the idle one lowers it when it reads its first message
            while os.getpriority(os.PRIO_PROCESS, pid) != lowered or os.sched_getaffinity(pid) != {cpu}:
                assert time.monotonic() < deadline, (f"writer process {pid} kept priority {os.getpriority(os.PRIO_PROCESS, pid)}"
                                                     f", CPUs {os.sched_getaffinity(pid)}")
                time.sleep(0.01)
    finally:
        writer.close()
    assert writer.writer_pids() == []


def _one_writer(tmp_path, ledger, **config):
    """A started writer with one writer process, and that process's pid."""
    from sglang_capture.server.writer_pool import WriterPool

    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1, **config), ledger)
    writer.start()
    deadline = time.monotonic() + 30
    while not writer.writer_pids():
        assert time.monotonic() < deadline, "no writer process started"
        time.sleep(0.01)
    return writer, writer.writer_pids()[0]


def test_a_writer_process_that_dies_fails_only_its_job_and_is_replaced(tmp_path):
    import os
    import signal

    first, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="lost")
    writer, pid = _one_writer(tmp_path, ledger)
    try:
        os.kill(pid, signal.SIGSTOP)  # the job waits in its pipe ...
        writer.submit(first)
        while writer.pending() and writer._busy == 0:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)  # ... and the process dies holding it
        assert first.done.wait(30)
        assert first.outcome["status"] == "error" and f"writer process {pid} exited" in first.outcome["error"]
        second, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert write_and_wait(writer, second)["status"] == "ok"
        assert writer.stats["restarts"] == 1 and writer.writer_pids() != [pid]
        assert ledger.held_bytes == 0
    finally:
        writer.close()


def test_a_writer_process_that_makes_no_progress_fails_its_job_is_killed_replaced_and_counted(tmp_path):
    import os
    import signal

    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="stuck")
    writer, pid = _one_writer(tmp_path, ledger, writer_stall_s=1.0)
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
        kept, _ = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert write_and_wait(writer, kept)["status"] == "ok" and writer.writer_pids() not in ([], [pid])
        assert not os.path.exists(tmp_path / "stuck.capture.msgpack")
    finally:
        writer.close()


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


def test_a_writer_process_gone_before_it_took_the_job_is_replaced_and_the_job_written(tmp_path, monkeypatch):
    import os
    import signal

    from sglang_capture.server import writer_pool as writer_module

    job, ledger = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="handed-on")
    writer, pid = _one_writer(tmp_path, ledger)
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

    import sglang_capture.server.writer_pool as writer_module
    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    recorded_on = []
    real = writer_module.record_outcome
    monkeypatch.setattr(writer_module, "record_outcome",
                        lambda *a: (recorded_on.append(threading.current_thread().name), real(*a)))
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
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
    job, ledger = make_job(capture_dir, [(0, torch.randn(64, 4))], 64, name="flushing")
    writer, pid = _one_writer(capture_dir, ledger, writer_stall_s=5.0)  # a loaded machine must not stall it first
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

    from sglang_capture.server.writer_child import WriterStalled
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=1)
    pool = WriterPool(cfg, HostMemoryLedger(1 << 20))
    job, _ = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="late")
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

    other, _ = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="taken")
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

    from sglang_capture.server.writer_pool import _flush_names_within
    from sglang_capture.writer.durability import Durability

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
