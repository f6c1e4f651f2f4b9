"""The capture dir: private folders, permissions, orphan clean-up (core/capture_dir.py)."""
from __future__ import annotations

import pytest
import torch

from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.server.ledger import HostMemoryLedger
from tests.jobs import make_job


def test_a_symlink_planted_at_the_file_name_is_never_written_through(tmp_path):
    import json
    import os

    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    capture_dir, outside = tmp_path / "caps", tmp_path / "outside.txt"
    capture_dir.mkdir()
    outside.write_text("precious")
    os.symlink(outside, capture_dir / "req-1.capture.msgpack")
    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = WriterPool(CaptureConfig(capture_dir=str(capture_dir), writers=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(capture_dir), "req-1")))
    assert outcome["status"] == "error" and "already exists" in outcome["error"]
    assert outside.read_text() == "precious" and os.path.islink(capture_dir / "req-1.capture.msgpack")


def test_a_symlinked_private_folder_is_refused_at_start(tmp_path):
    import os

    from sglang_capture.server.launch import check_capture_dir

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".tmp")
    with pytest.raises(ConfigError, match="must be a real directory"):
        check_capture_dir(str(tmp_path))


def test_files_are_created_owner_and_group_only(tmp_path):
    import json
    import os
    import stat

    from sglang_capture.core.capture_dir import index_path
    from sglang_capture.server.writer_pool import WriterPool

    job, ledger = make_job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "req-1")))
    assert stat.S_IMODE(os.stat(outcome["path"]).st_mode) & 0o007 == 0
    assert stat.S_IMODE(os.stat(tmp_path / ".tmp").st_mode) == 0o700


def _aged(path, seconds=3600):
    import os
    import time

    os.utime(path, (time.time() - seconds, time.time() - seconds))


def test_temp_files_of_a_killed_server_are_removed_at_start_and_live_ones_kept(tmp_path):
    import fcntl
    import os

    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.core.durable import host_tag
    from sglang_capture.server.writer_pool import WriterPool

    prepare_capture_dir(str(tmp_path))
    here = host_tag()
    orphans = [tmp_path / ".tmp" / f"req.7.{here}.{os.getpid()}.{'a' * 32}.part",  # a pid proves nothing
               tmp_path / ".index" / f"x.json.{here}.99999999.{'b' * 32}.part"]
    held = tmp_path / ".tmp" / f"live.{here}.1.{'c' * 32}.part"
    kept = [held, tmp_path / ".tmp" / "notes.part",
            tmp_path / ".tmp" / f"fresh.{here}.2.{'e' * 32}.part",  # unlocked for a moment after its creation
            # another host sharing the directory: its locks may not reach this one, its files stay
            tmp_path / ".tmp" / f"req.8.h0badc0de.3.{'d' * 32}.part"]
    for path in orphans + kept:
        path.write_bytes(b"half a file")
        if "fresh" not in path.name:
            _aged(path)
    holder = os.open(held, os.O_RDONLY)
    fcntl.flock(holder, fcntl.LOCK_EX)  # its writer runs
    writer = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
    try:
        writer.start()
        assert not any(p.exists() for p in orphans) and all(p.exists() for p in kept)
    finally:
        writer.close()
        os.close(holder)


def test_a_server_in_another_pid_namespace_keeps_its_temp_files_until_it_dies(tmp_path):
    """Two servers on one capture dir and one host name, not one pid namespace (containers of one
    host): the temp file of a live writer in the other namespace names a pid that means nothing
    here, yet this server's start-up clean-up keeps it; once that writer is killed, it goes."""
    import fcntl
    import os
    import shutil
    import signal
    import subprocess
    import sys
    import time

    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.server.writer_pool import WriterPool

    if shutil.which("unshare") is None or subprocess.run(["unshare", "--pid", "--fork", "true"]).returncode != 0:
        pytest.skip("needs unshare --pid (util-linux, root or user namespaces)")
    prepare_capture_dir(str(tmp_path))
    # the writer's pid in its namespace is chosen to be no process here: a pid check would call it dead
    target = next(p for p in range(60, 5000) if not os.path.exists(f"/proc/{p}"))
    writer_code = (
        "import os, sys, time\n"
        "from sglang_capture.core.capture_dir import DirFds\n"
        "from sglang_capture.core.durable import publish_new\n"
        "dirs = DirFds.open(sys.argv[1])\n"
        "def write(f):\n"
        "    f.write(b'half a file'); f.flush(); print(os.getpid(), flush=True); time.sleep(600)\n"
        "publish_new('req.capture.msgpack', write, dir_fd=dirs.capture, tmp_dir_fd=dirs.tmp)\n")
    script = f'i=0; while [ $i -lt {target - 2} ]; do /bin/true; i=$((i+1)); done; "$0" -c "$1" "$2"; exit $?'
    other = subprocess.Popen(["unshare", "--pid", "--fork", "sh", "-c", script, sys.executable, writer_code, str(tmp_path)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        inner_pid = int(other.stdout.readline())
        (temp,) = os.listdir(tmp_path / ".tmp")
        assert temp.split(".")[-3] == str(inner_pid) == str(target) and not os.path.exists(f"/proc/{inner_pid}")
        _aged(tmp_path / ".tmp" / temp)
        for _ in range(2):  # this server starting, and starting again while the other still writes
            pool = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
            pool.start()
            pool.close()
            assert os.listdir(tmp_path / ".tmp") == [temp]
        os.killpg(other.pid, signal.SIGKILL)  # the other server dies mid-write
        other.wait(30)
        fd = os.open(tmp_path / ".tmp" / temp, os.O_RDONLY)
        try:  # its lock goes with its last descriptor, once the kernel has finished the process
            deadline = time.monotonic() + 30
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    assert time.monotonic() < deadline, "the killed writer's lock was never released"
                    time.sleep(0.05)
        finally:
            os.close(fd)
        pool = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
        pool.start()
        pool.close()
        assert os.listdir(tmp_path / ".tmp") == [] and not (tmp_path / "req.capture.msgpack").exists()
    finally:
        if other.poll() is None:
            os.killpg(other.pid, signal.SIGKILL)
            other.wait(30)


def test_outcome_records_older_than_the_retention_are_swept_by_a_writer_process(tmp_path):
    """Three days of one record every ten minutes: a sweep leaves only the last retention's worth
    (what .index/ holds however long a server runs); stats files, fresh records stay."""
    import os
    import time

    from sglang_capture.core.capture_dir import DirFds, record_outcome, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    dirs = DirFds.open(str(tmp_path))
    now = time.time()
    for i in range(3 * 24 * 6):
        record_outcome(dirs, f"req-{i}", {"status": "ok"})
        os.utime(tmp_path / ".index" / f"req-{i}.json", (now - 600 * i, now - 600 * i))
    old_marker = tmp_path / ".index" / "lost.json.unrecorded"
    old_marker.write_bytes(b"")
    _aged(old_marker, 7200)
    job, ledger = make_job(tmp_path, [(0, torch.ones(2, 4))], 2, name="fresh")
    pool = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1, index_retention_s=3600 + 300,
                                    wait_timeout_s=60), ledger)
    try:
        pool.submit(job)
        assert job.done.wait(30) and job.outcome["status"] == "ok"
        sweep = pool.sweep()
        assert sweep.done.wait(30)
        left = sorted(n for n in os.listdir(tmp_path / ".index") if n.startswith("req-"))
        assert left == sorted(f"req-{i}.json" for i in range(7))  # up to 65 minutes old
        assert sweep.removed == 3 * 24 * 6 - 7 + 1 and not old_marker.exists()
        assert (tmp_path / ".index" / "fresh.json").exists()
        deadline = time.monotonic() + 10
        while next(iter(writer_stats(str(tmp_path)).values()))["records_swept"] != sweep.removed:
            assert time.monotonic() < deadline, "the sweep's count never reached the stats file"
            time.sleep(0.05)
    finally:
        pool.close()


def test_stats_files_of_servers_that_are_gone_are_added_to_the_history_once(tmp_path):
    import json
    import os
    import subprocess
    import sys

    from sglang_capture.core.capture_dir import DirFds, StatsFile, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    dirs = DirFds.open(str(tmp_path))
    code = ("import sys, time\nfrom sglang_capture.core.capture_dir import DirFds, StatsFile\n"
            "s = StatsFile(DirFds.open(sys.argv[1]))\n"
            "s.write({'written': 5, 'failed': 1, 'bytes': 500, 'max_queue': 3, 'time': 1000.0})\n"
            "print('ready', flush=True)\ntime.sleep(600)\n")
    killed = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert killed.stdout.readline().strip() == "ready"
        killed.kill()  # a server killed with -9: its stats file stays, its lock goes
        killed.wait(30)
    finally:
        if killed.poll() is None:
            killed.kill()
    from sglang_capture.core.capture_dir import record_outcome

    record_outcome(dirs, "writer-4242", {"status": "ok", "bytes": 20})  # a request may be called that: a record
    other_host = tmp_path / ".index" / "_writer-h0badc0de.7.abcdef12.json"
    other_host.write_text(json.dumps({"written": 100}))
    live = StatsFile(dirs)  # a server running beside
    live.write({"written": 7})
    index = tmp_path / ".index"

    def age_this_hosts_stats():
        for name in os.listdir(index):
            if name.startswith("_writer-h") and name.endswith(".json") and name != other_host.name:
                _aged(index / name)

    try:
        age_this_hosts_stats()  # the killed server stopped an hour ago (the live one is as old: its lock keeps it)
        for _ in range(2):  # two start-ups: nothing is counted twice
            pool = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
            pool.start()
            pool.close()
        history = json.load(open(index / "_stats-history.json"))
        assert history["processes"] == 1  # the killed one; the first start-up's pool stopped just now
        assert history["totals"]["written"] == 5 and history["totals"]["bytes"] == 500
        assert history["totals"]["failed"] == 1 and history["peaks"]["max_queue"] == 3
        assert history["first_time"] == 1000.0
        age_this_hosts_stats()
        pool = WriterPool(CaptureConfig(capture_dir=str(tmp_path), writers=1), HostMemoryLedger(1 << 20))
        pool.start()
        pool.close()
        history = json.load(open(index / "_stats-history.json"))
        assert history["processes"] == 3 and history["totals"]["written"] == 5  # + the two stopped pools
        names = sorted(os.listdir(index))
        assert other_host.name in names and live.name + ".json" in names and "writer-4242.json" in names
        # the live one, the other host's, and the third start-up's (added by a later start-up)
        assert len(writer_stats(str(tmp_path))) == 3
    finally:
        live.close()


def test_stats_rewritten_lately_are_kept_even_when_their_lock_can_be_taken(tmp_path, monkeypatch):
    """On a mount whose locks stay on each machine, a server on another machine of the same host
    name holds a lock this one can take: its stats file is kept while it is rewritten, and an idle
    server rewrites its own every STATS_REFRESH_S (issue 34 item 9)."""
    import json
    import os
    import time

    from sglang_capture.core.capture_dir import STATS_STALE_S, DirFds, retire_stale_stats
    from sglang_capture.core.durable import host_tag
    from sglang_capture.writer import supervisor as writer_module

    dirs = DirFds.open(str(tmp_path))
    twin = tmp_path / ".index" / f"_writer-{host_tag()}.77.abcdef12.json"  # its lock is on the other machine
    twin.write_text(json.dumps({"written": 9}))
    _aged(twin, STATS_STALE_S - 60)
    assert retire_stale_stats(dirs) == 0 and twin.exists()
    _aged(twin, STATS_STALE_S + 60)
    assert retire_stale_stats(dirs) == 1 and not twin.exists()

    monkeypatch.setattr(writer_module, "STATS_REFRESH_S", 0.5)
    pool = writer_module.Supervisor(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    pool.start()
    try:
        path = tmp_path / ".index" / (pool._stats_file.name + ".json")
        _aged(path)
        deadline = time.monotonic() + 10
        while time.time() - os.stat(path).st_mtime > 60:  # idle, and rewritten all the same
            assert time.monotonic() < deadline, "an idle server never rewrote its stats file"
            time.sleep(0.1)
    finally:
        pool.close()


def test_stats_files_named_before_the_prefix_are_retired_as_stats_never_swept_as_records(tmp_path):
    import json
    import os

    from sglang_capture.core.capture_dir import DirFds, is_record, retire_stale_stats, sweep_records
    from sglang_capture.core.durable import host_tag

    dirs = DirFds.open(str(tmp_path))
    legacy = tmp_path / ".index" / f"writer-{host_tag()}.4242.0123abcd.json"
    legacy.write_text(json.dumps({"written": 11, "bytes": 1100}))
    _aged(legacy, 3 * 24 * 3600)
    assert not is_record(legacy.name) and is_record("writer-4242.json")
    assert sweep_records(dirs, 3600) == 0 and legacy.exists()
    assert retire_stale_stats(dirs) == 1 and not legacy.exists()
    history = json.load(open(tmp_path / ".index" / "_stats-history.json"))
    assert history["totals"]["written"] == 11 and history["totals"]["bytes"] == 1100
    assert sorted(os.listdir(tmp_path / ".index")) == ["_stats-history.json", "_stats-history.json.lock"]
