"""Durability policies: group commit covers every caller, failures reach every caller, and the
writer publishes readable files under each policy; a failed flush publishes nothing."""
from __future__ import annotations

import errno
import json
import os
import threading
import time

import pytest
import torch

from sglang_capture.config import CaptureConfig, ConfigError
from sglang_capture.durability import Durability, GroupSync, NoSync, durability_for
from tests.test_units import _job


class SlowFlush:
    """A flush that takes ``seconds`` and records when each one started and ended."""

    def __init__(self, seconds: float, fail_first: bool = False) -> None:
        self.seconds = seconds
        self.fail_first = fail_first
        self.spans = []
        self._lock = threading.Lock()

    def __call__(self, fd: int) -> None:
        start = time.monotonic()
        time.sleep(self.seconds)
        with self._lock:
            self.spans.append((start, time.monotonic()))
            fail = self.fail_first and len(self.spans) == 1
        if fail:
            raise OSError(errno.EIO, "Input/output error")


def _call_concurrently(sync: GroupSync, callers: int):
    """Start ``callers`` threads a few ms apart; return (arrival, return, error) per caller."""
    results = [None] * callers

    def call(i: int) -> None:
        arrived = time.monotonic()
        try:
            sync.sync_data(0)
            results[i] = (arrived, time.monotonic(), None)
        except OSError as e:
            results[i] = (arrived, time.monotonic(), e)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(callers)]
    for t in threads:
        t.start()
        time.sleep(0.004)
    for t in threads:
        t.join(10)
    return results


def test_group_sync_returns_only_after_a_flush_that_began_after_the_caller_arrived():
    flush = SlowFlush(0.05)
    sync = GroupSync(flush)
    results = _call_concurrently(sync, 12)
    assert all(r is not None and r[2] is None for r in results)
    for arrived, returned, _ in results:
        assert any(arrived <= start and end <= returned for start, end in flush.spans), (arrived, flush.spans)
    # 12 callers over ~48 ms with 50 ms flushes: batching must have shared flushes
    assert sync.flushes == len(flush.spans) < 12
    starts = sorted(s for s, _ in flush.spans)
    ends = sorted(e for _, e in flush.spans)
    assert all(starts[i + 1] >= ends[i] for i in range(len(starts) - 1)), "flushes must not overlap"


def test_a_failed_group_flush_fails_every_caller_of_that_batch_and_not_later_ones():
    flush = SlowFlush(0.05, fail_first=True)
    sync = GroupSync(flush)
    results = _call_concurrently(sync, 6)
    first_start, first_end = flush.spans[0]
    failed = [r for r in results if r[2] is not None]
    assert failed and all(r[2].errno == errno.EIO and "flushing the capture filesystem failed" in str(r[2]) for r in failed)
    # only callers that arrived before the failing flush began can have been served by it;
    # the first one was, and everyone arriving later got a flush of their own
    assert all(r[0] <= first_start for r in failed)
    assert min(results, key=lambda r: r[0])[2] is not None
    assert all(r[2] is None for r in results if r[0] > first_start)


def test_durability_policies_by_name_and_a_real_syncfs(tmp_path):
    assert isinstance(durability_for("none"), NoSync)
    assert type(durability_for("file")) is Durability
    group = durability_for("group")
    assert group.name in ("group", "file")  # "file" only where syncfs(2) cannot report errors
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        group.sync_data(fd)
        group.sync_names(fd)
    finally:
        os.close(fd)
    with pytest.raises(ConfigError, match="--capture-durability must be one of group, file, none"):
        CaptureConfig(capture_dir=str(tmp_path), durability="sometimes")


@pytest.mark.parametrize("mode", ["group", "file", "none"])
def test_writer_publishes_readable_files_under_each_policy(tmp_path, mode):
    from sglang_capture import load
    from sglang_capture.writer import CaptureWriter, index_path

    cfg = CaptureConfig(capture_dir=str(tmp_path), writer_threads=3, durability=mode)
    jobs = [_job(tmp_path, [(0, torch.full((2, 4), float(i)))], 2, name=f"req-{i}") for i in range(6)]
    writer = CaptureWriter(cfg, jobs[0][1])
    for job, _ in jobs:
        writer.submit(job)
    writer.close()
    for i in range(6):
        outcome = json.load(open(index_path(str(tmp_path), f"req-{i}")))
        assert outcome["status"] == "ok"
        assert torch.equal(load(outcome["path"])["aux_hidden_states"], torch.full((2, 2), float(i)))
    stats = json.load(open(tmp_path / ".index" / f"writer-{os.getpid()}.json"))
    assert stats["durability"] == mode
    if mode == "group":
        assert 1 <= stats["flushes"] <= 12  # at most one per file and per published name


def test_a_failed_flush_publishes_nothing(tmp_path):
    from sglang_capture.format import Codec, host_tensor
    from sglang_capture.publish import DirFds, publish

    dirs = DirFds.open(str(tmp_path))
    with pytest.raises(OSError, match="flushing the capture filesystem failed"):
        publish(dirs, "unflushed", {"rid": "unflushed"}, {"x": host_tensor(torch.zeros(2, 4))}, Codec("zstd"),
                GroupSync(SlowFlush(0.0, fail_first=True)))
    assert sorted(os.listdir(tmp_path)) == [".index", ".tmp"]
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
    from sglang_capture.format import Codec, host_tensor
    from sglang_capture.publish import DirFds, publish

    dirs = DirFds.open(str(tmp_path))
    rows = host_tensor(torch.randn(256, 1024))  # 1 MiB of incompressible floats
    publish(dirs, "paged", {"rid": "paged"}, {"x": rows}, Codec("none"), durability_for("file"), keep_page_cache=keep)
    resident = _resident_pages(tmp_path / "paged.capture.msgpack")
    if keep:
        assert resident > 200  # the written pages are still cached, as without the package
    else:
        assert resident == 0
