"""Durable files (core/durable.py) and the durability policies (writer/durability.py): files
appear whole or not at all, flushes happen where promised, a failed flush publishes nothing."""
from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.writer.durability import Durability, NoSync, durability_for
from tests.jobs import make_job


class FailingFlush(Durability):
    """The ``file`` policy on a disk whose flush fails (EIO), recording what it was asked to flush."""

    def __init__(self) -> None:
        self.calls = []

    def sync_data(self, fd: int) -> None:
        self.calls.append("data")
        raise OSError(errno.EIO, "Input/output error")


def test_durability_policies_by_name(tmp_path):
    assert isinstance(durability_for("none"), NoSync)
    assert type(durability_for("file")) is Durability
    with pytest.raises(ValueError, match="unknown durability"):
        durability_for("group")
    with pytest.raises(ConfigError, match="--capture-durability must be one of file, none"):
        CaptureConfig(capture_dir=str(tmp_path), durability="sometimes")


def test_publish_new_never_replaces_a_file_and_leaves_nothing_when_it_fails(tmp_path, monkeypatch):
    from sglang_capture.core.durable import publish_new

    dst = tmp_path / "sample.bin"
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.isdir(f"/proc/self/fd/{fd}")))
    assert publish_new(str(dst), lambda f: f.write(b"first")) == 5
    assert dst.read_bytes() == b"first" and synced == [False, True]  # the file, then its directory
    with pytest.raises(FileExistsError, match="already exists"):
        publish_new(str(dst), lambda f: f.write(b"second"))
    assert dst.read_bytes() == b"first"

    def broken(f):
        f.write(b"half")
        raise RuntimeError("encoder failed")

    with pytest.raises(RuntimeError):
        publish_new(str(tmp_path / "other.bin"), broken)
    assert sorted(os.listdir(tmp_path)) == ["sample.bin"]


def test_replace_atomic_swaps_the_whole_file_and_flushes_file_and_directory(tmp_path, monkeypatch):
    from sglang_capture.core.durable import replace_atomic

    dst = tmp_path / "manifest.jsonl"
    dst.write_text("old\n")
    synced = []
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.path.isdir(f"/proc/self/fd/{fd}")))
    replace_atomic(str(dst), lambda f: f.write(b"new\n"))
    assert dst.read_text() == "new\n" and synced == [False, True]
    synced.clear()
    replace_atomic(str(dst), lambda f: f.write(b"newer\n"), sync=False)  # outcome records and stats
    assert dst.read_text() == "newer\n" and synced == []
    with pytest.raises(ZeroDivisionError):
        replace_atomic(str(dst), lambda f: f.write(b"torn") and 1 / 0)
    assert dst.read_text() == "newer\n" and os.listdir(tmp_path) == ["manifest.jsonl"]


@pytest.mark.parametrize("mode", ["file", "none"])
def test_writer_publishes_readable_files_under_each_policy(tmp_path, mode):
    from sglang_capture import load
    from sglang_capture.core.capture_dir import index_path, writer_stats
    from sglang_capture.server.writer_pool import WriterPool

    cfg = CaptureConfig(capture_dir=str(tmp_path), writers=3, durability=mode)
    jobs = [make_job(tmp_path, [(0, torch.full((2, 4), float(i)))], 2, name=f"req-{i}") for i in range(6)]
    writer = WriterPool(cfg, jobs[0][1])
    for job, _ in jobs:
        writer.submit(job)
    writer.close()
    for i in range(6):
        outcome = json.load(open(index_path(str(tmp_path), f"req-{i}")))
        assert outcome["status"] == "ok"
        assert torch.equal(load(outcome["path"])["aux_hidden_states"], torch.full((2, 2), float(i)))
    [stats] = writer_stats(str(tmp_path)).values()
    assert stats["durability"] == mode


def test_a_failed_flush_publishes_nothing(tmp_path):
    from sglang_capture.core.capture_dir import DirFds
    from sglang_capture.core.format import Codec, host_tensor
    from sglang_capture.writer.capture_file import write_capture_file

    dirs = DirFds.open(str(tmp_path))
    flush = FailingFlush()
    with pytest.raises(OSError, match="Input/output error"):
        write_capture_file(dirs, "unflushed", {"rid": "unflushed"}, {"x": host_tensor(torch.zeros(2, 4))}, Codec("zstd"),
                           flush)
    assert flush.calls == ["data"]
    assert sorted(os.listdir(tmp_path)) == [".blocks", ".index", ".tmp"]
    assert os.listdir(tmp_path / ".tmp") == []


def _resident_pages(path) -> int:
    """Pages of ``path`` in the page cache (mincore(2) on a mapping that touches none of them)."""
    import ctypes
    import mmap

    size = os.path.getsize(path)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, flags=mmap.MAP_PRIVATE,
                                          prot=mmap.PROT_READ | mmap.PROT_WRITE) as m:
        page = mmap.PAGESIZE
        vec = (ctypes.c_ubyte * ((size + page - 1) // page))()
        addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
        assert libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) == 0, os.strerror(ctypes.get_errno())
        return sum(b & 1 for b in vec)


@pytest.mark.parametrize("keep", [False, True], ids=["dropped", "kept"])
def test_flushed_files_leave_the_page_cache_unless_asked_to_stay(tmp_path, keep):
    from sglang_capture.core.capture_dir import DirFds
    from sglang_capture.core.format import Codec, host_tensor
    from sglang_capture.writer.capture_file import write_capture_file

    dirs = DirFds.open(str(tmp_path))
    rows = host_tensor(torch.randn(256, 1024))  # 1 MiB of incompressible floats
    write_capture_file(dirs, "paged", {"rid": "paged"}, {"x": rows}, Codec("none"), durability_for("file"), keep_page_cache=keep)
    resident = _resident_pages(tmp_path / "paged.capture.msgpack")
    if keep:
        assert resident > 200  # the written pages are still cached, as without the package
    else:
        assert resident == 0


def test_no_lock_in_the_package_waits_without_a_bound():
    """Every ``flock`` in the package asks not to block (LOCK_NB): waits go through
    ``durable.lock_within``, which has a bound and says what it waits for (issue 34 item 1)."""
    import re

    import sglang_capture

    root = os.path.dirname(sglang_capture.__file__)
    calls = []
    for d, _, files in os.walk(root):
        for name in files:
            if name.endswith(".py"):
                text = open(os.path.join(d, name)).read()
                calls += [(name, m.group(0)) for m in re.finditer(r"\bflock\([^)]*\)", text)]
    assert calls and [c for c in calls if "LOCK_NB" not in c[1]] == []


def test_a_lock_wait_says_what_it_waits_for_and_ends_at_its_bound(tmp_path, caplog):
    import fcntl
    import time

    from sglang_capture.core.durable import LockTimeout, lock_within

    path = tmp_path / "held.lock"
    holder = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    fd = os.open(path, os.O_RDWR)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout, match=r"waited 1\.5 s for the lock on the test's file, which another process holds") as e:
            lock_within(fd, "the test's file", timeout_s=1.5)
        assert str(e.value).startswith("waited")  # one line for a user: no "[Errno 110]"
        assert 1.5 <= time.monotonic() - t0 < 5
        assert [r.getMessage() for r in caplog.records] == [
            "sglang_capture: waiting for the lock on the test's file (held by another process; at most 1.5 s)"]
        os.close(holder)
        holder = -1
        lock_within(fd, "the test's file", timeout_s=1.5)  # free: taken at once
    finally:
        os.close(fd)
        if holder >= 0:
            os.close(holder)


def test_a_failed_flush_of_the_name_removes_the_file_it_named(tmp_path):
    """The name appeared, then its directory's flush failed: the caller reports an error, so no
    file may stay under the name (an outcome of error never beside a published file)."""
    from sglang_capture.core.capture_dir import DirFds
    from sglang_capture.core.format import Codec, host_tensor
    from sglang_capture.writer.capture_file import write_capture_file

    class NameFlushFails(Durability):
        def sync_names(self, dir_fd: int) -> None:
            raise OSError(errno.EIO, "Input/output error")

    dirs = DirFds.open(str(tmp_path))
    with pytest.raises(OSError, match="Input/output error"):
        write_capture_file(dirs, "named", {"rid": "named"}, {"x": host_tensor(torch.zeros(2, 4))}, Codec("zstd"),
                           NameFlushFails())
    assert sorted(os.listdir(tmp_path)) == [".blocks", ".index", ".tmp"] and os.listdir(tmp_path / ".tmp") == []


def test_one_large_write_goes_to_the_disk_a_step_at_a_time(tmp_path, monkeypatch):
    """A 64 MiB frame is one write: it is handed to writeback and waited for in steps, with progress
    after each, so no more than two steps are ever dirty and a slow disk never silences the writer."""
    from sglang_capture.writer import durability
    from sglang_capture.writer.durability import WriteBehind

    events = []
    real = durability.sync_file_range
    monkeypatch.setattr(durability, "sync_file_range",
                        lambda fd, off, n, wait: (events.append(("wait" if wait else "start", off, n)), real(fd, off, n, wait)))
    step = 16384
    with open(tmp_path / "big", "wb", buffering=1 << 20) as f:
        behind = WriteBehind(f, lambda: events.append(("progress", behind.written)), step=step)
        behind.write(memoryview(os.urandom(10 * step + 100)))
        behind.finish()
    progress = [e[1] for e in events if e[0] == "progress"]
    assert sorted(set(progress)) == [step * (i + 1) for i in range(10)] + [10 * step + 100]  # after every step written
    waits = [e for e in events if e[0] == "wait"]
    for i, e in enumerate(events):  # never more than two steps handed and not yet waited for
        if e[0] == "start":
            waited = sum(w[2] for w in events[:i] if w[0] == "wait")
            assert e[1] + e[2] - waited <= 2 * step
    assert max(w[2] for w in waits) <= step
    assert sum(w[2] for w in waits) == os.path.getsize(tmp_path / "big") == 10 * step + 100
