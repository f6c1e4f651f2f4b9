"""The writer pool: hand-off threads and writer processes (server/writer_pool.py)."""
from __future__ import annotations

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


def test_a_writer_shows_progress_after_every_write_and_flush_of_a_file(tmp_path, monkeypatch):
    from sglang_capture.core import format as fmt
    from sglang_capture.core.capture_dir import DirFds
    from sglang_capture.core.format import host_tensor
    from sglang_capture.writer.capture_file import write_capture_file
    from sglang_capture.writer.durability import durability_for

    monkeypatch.setattr(fmt, "FRAME_BYTES", 4096)  # 16 frames of 4 KiB rows
    calls = []
    rows = host_tensor(torch.randn(16, 1024))
    write_capture_file(DirFds.open(str(tmp_path)), "moving", {"rid": "moving"}, {"rows": rows},
                       CaptureConfig(capture_dir=str(tmp_path)).codec_spec(), durability_for("file"),
                       progress=lambda: calls.append(1))
    assert len(calls) >= 16 + 2  # each frame's write, then the file's and the name's flush


def test_a_writer_process_gone_before_it_took_the_job_is_replaced_and_the_job_written(tmp_path, monkeypatch):
    import os
    import signal

    from sglang_capture.server import writer_pool as writer_module

    job, ledger = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="handed-on")
    writer, pid = _one_writer(tmp_path, ledger)
    deadline = time.monotonic() + 30
    try:
        # the process dies between the hand-off thread's liveness check and its send
        monkeypatch.setattr(writer_module._Child, "alive", lambda self: True)
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
