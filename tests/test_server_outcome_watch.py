"""The HTTP process's outcome watch: a waiting capture response wakes on its record's rename, not on a poll."""
from __future__ import annotations

import asyncio
import json
import os
import time

import pytest

from sglang_capture.core.capture_dir import UNRECORDED_SUFFIX, DirFds, index_path, prepare_capture_dir, record_outcome
from sglang_capture.server import outcome_watch
from sglang_capture.server.outcome_watch import OutcomeWatch


def _ref(capture_dir: str, rid: str) -> dict:
    return {"sglang_capture": 1, "rid": rid, "path": os.path.join(capture_dir, rid + ".msgpack.zst"),
            "index": index_path(capture_dir, rid), "status": "pending"}


@pytest.fixture
def capture_dir(tmp_path, monkeypatch) -> str:
    prepare_capture_dir(str(tmp_path))
    monkeypatch.setattr(outcome_watch, "is_network_fs", lambda path: False)  # a CI temp dir on NFS would poll
    return str(tmp_path)


def _record(capture_dir: str, rid: str, outcome: dict) -> None:
    """As the writer records an outcome: through the dir's descriptors, renamed into place."""
    dirs = DirFds.open(capture_dir)
    try:
        record_outcome(dirs, rid, outcome)
    finally:
        for fd in (dirs.capture, dirs.tmp, dirs.index, dirs.blocks):
            os.close(fd)


def _record_later(loop: asyncio.AbstractEventLoop, capture_dir: str, rid: str, delay: float, outcome: dict) -> None:
    loop.call_later(delay, _record, capture_dir, rid, outcome)


def test_a_record_renamed_in_wakes_its_waiter_at_once_not_at_the_recheck(capture_dir, monkeypatch):
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)  # a poll would not come back within the test

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        assert watch.event_driven
        _record_later(loop, capture_dir, "r1", 0.2, {"status": "ok", "bytes": 123, "checksum": "x"})
        t0 = time.monotonic()
        ref = await watch.wait(_ref(capture_dir, "r1"), timeout_s=30)
        took = time.monotonic() - t0
        left = watch.waiting()
        watch.close()
        return ref, took, left

    ref, took, left = asyncio.run(run())
    assert ref["status"] == "ok" and ref["bytes"] == 123 and ref["rid"] == "r1"
    assert took < 10, took
    assert left == []  # nothing stays registered after the wait


def test_many_waiters_each_wake_for_their_own_record_only(capture_dir, monkeypatch):
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)  # no re-check within the test: only events wake a wait
    reads = []
    read = outcome_watch._read_outcome
    monkeypatch.setattr(outcome_watch, "_read_outcome", lambda path: reads.append(path) or read(path))
    wake_all = []
    monkeypatch.setattr(OutcomeWatch, "_wake_all", lambda self: wake_all.append(1))
    rids = [f"r{i}" for i in range(20)]

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        assert watch.event_driven

        async def timed(rid: str) -> tuple:
            t0 = time.monotonic()
            ref = await watch.wait(_ref(capture_dir, rid), timeout_s=3.0)
            return ref, time.monotonic() - t0

        for i, rid in enumerate(rids[:10]):
            _record_later(loop, capture_dir, rid, 0.05 + 0.01 * i, {"status": "ok", "bytes": i})
        done = await asyncio.gather(*(timed(rid) for rid in rids))
        woke_all = len(wake_all)  # before close(), which wakes whatever still waits
        watch.close()
        return done, watch.watch_failures, woke_all

    done, watch_failures, woke_all = asyncio.run(run())
    assert [d["status"] for d, _ in done] == ["ok"] * 10 + ["pending"] * 10
    assert [d["bytes"] for d, _ in done[:10]] == list(range(10))
    assert all("not written after 3 s" in d["error"] for d, _ in done[10:])
    # each record's rename woke its own wait, long before the time it would have been read at its timeout
    assert max(took for _, took in done[:10]) < 1.5, [round(took, 3) for _, took in done]
    assert woke_all == 0
    # each wait reads its record once on arrival and once when woken (or when its time is up), plus once
    # for each time the dir could not be watched (that pass polls): were a rename to wake other waits
    # too, they would read again
    assert sorted(set(reads)) == sorted(index_path(capture_dir, rid) for rid in rids)
    assert len(reads) == 40 + watch_failures, (len(reads), watch_failures)


def test_a_dir_inotify_will_not_watch_is_polled_and_the_log_says_why_once(capture_dir, caplog):
    """The per-user watch limit reached: waits on that dir poll (and ask for a watch again each pass)."""
    import ctypes
    import errno
    import logging

    class NoWatches:
        def inotify_add_watch(self, fd: int, path: bytes, mask: int) -> int:
            ctypes.set_errno(errno.ENOSPC)
            return -1

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        watch._libc = NoWatches()
        _record_later(loop, capture_dir, "r1", 0.1, {"status": "ok", "bytes": 7})
        refs = await asyncio.gather(*(watch.wait(_ref(capture_dir, "r1"), timeout_s=10) for _ in range(2)))
        watch.close()
        return refs, watch.watch_failures

    with caplog.at_level(logging.WARNING, logger=outcome_watch.__name__):
        refs, failures = asyncio.run(run())
    assert [r["status"] for r in refs] == ["ok", "ok"] and failures > 2
    said = [r.getMessage() for r in caplog.records if "cannot watch" in r.getMessage()]
    assert len(said) == 1 and "raise fs.inotify.max_user_watches" in said[0], said


def test_a_record_already_there_is_read_without_waiting(capture_dir):
    _record(capture_dir, "r0", {"status": "error", "error": "rows missing"})

    async def run() -> dict:
        watch = OutcomeWatch(asyncio.get_running_loop())
        try:
            return await watch.wait(_ref(capture_dir, "r0"), timeout_s=0.01)
        finally:
            watch.close()

    ref = asyncio.run(run())
    assert ref["status"] == "error" and ref["error"] == "rows missing"


def test_an_unrecorded_marker_ends_the_wait_with_an_error(capture_dir, monkeypatch):
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        marker = index_path(capture_dir, "r2") + UNRECORDED_SUFFIX
        loop.call_later(0.1, lambda: open(marker, "w").close())
        try:
            return await asyncio.wait_for(watch.wait(_ref(capture_dir, "r2"), timeout_s=30), 10)
        finally:
            watch.close()

    ref = asyncio.run(run())
    assert ref["status"] == "error" and "could not record" in ref["error"]


@pytest.mark.parametrize("how", ["no inotify", "closed"])
def test_without_inotify_the_wait_polls_and_still_finds_the_record(capture_dir, how):
    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop, use_inotify=how != "no inotify")
        if how == "closed":
            watch.close()
        _record_later(loop, capture_dir, "r3", 0.1, {"status": "ok"})
        return watch.event_driven, await watch.wait(_ref(capture_dir, "r3"), timeout_s=10)

    event_driven, ref = asyncio.run(run())
    assert not event_driven and ref["status"] == "ok"


def test_a_record_no_event_announces_is_found_by_the_recheck(capture_dir, monkeypatch):
    """A record inotify does not report (written from another host on a network filesystem, a lost
    event): the slow re-check reads it."""
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 0.2)
    monkeypatch.setattr(OutcomeWatch, "_on_events", lambda self: os.read(self._fd, 65536))  # events dropped

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        _record_later(loop, capture_dir, "r4", 0.05, {"status": "ok"})
        try:
            return await watch.wait(_ref(capture_dir, "r4"), timeout_s=10)
        finally:
            watch.close()

    assert asyncio.run(run())["status"] == "ok"


def test_a_torn_record_is_read_again_on_its_rename(capture_dir, monkeypatch):
    """A half-written file at the record's name (never made by record_outcome, which renames in) is
    not an outcome: the wait goes on."""
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)
    path = index_path(capture_dir, "r5")
    with open(path, "w") as f:
        f.write('{"status": "o')

    async def run() -> dict:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        _record_later(loop, capture_dir, "r5", 0.1, {"status": "ok", "bytes": 5})
        try:
            return await watch.wait(_ref(capture_dir, "r5"), timeout_s=30)
        finally:
            watch.close()

    ref = asyncio.run(run())
    assert ref["status"] == "ok" and ref["bytes"] == 5
    assert json.load(open(path))["bytes"] == 5


def test_closing_the_watch_while_responses_wait_turns_them_to_polling(capture_dir, monkeypatch):
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        wait = asyncio.create_task(watch.wait(_ref(capture_dir, "r6"), timeout_s=30))
        await asyncio.sleep(0.05)
        assert watch.waiting() == ["r6.json"]
        watch.close()
        _record_later(loop, capture_dir, "r6", 0.1, {"status": "ok"})
        t0 = time.monotonic()
        ref = await wait
        return ref, time.monotonic() - t0

    ref, took = asyncio.run(run())
    assert ref["status"] == "ok" and took < 10, took  # polled: not left for the 60 s re-check


def test_on_a_network_filesystem_the_wait_also_polls(capture_dir, monkeypatch):
    """A capture dir shared by DP groups on several nodes: another node's writer renames the record
    in, which inotify here never reports; the wait polls with the old backoff (at most 50 ms)."""
    monkeypatch.setattr(outcome_watch, "RECHECK_S", 60.0)
    monkeypatch.setattr(outcome_watch, "is_network_fs", lambda path: True)
    monkeypatch.setattr(OutcomeWatch, "_on_events", lambda self: os.read(self._fd, 65536))  # no event seen

    async def run() -> tuple:
        loop = asyncio.get_running_loop()
        watch = OutcomeWatch(loop)
        _record_later(loop, capture_dir, "r7", 0.1, {"status": "ok"})
        t0 = time.monotonic()
        try:
            return await watch.wait(_ref(capture_dir, "r7"), timeout_s=30), time.monotonic() - t0
        finally:
            watch.close()

    ref, took = asyncio.run(run())
    assert ref["status"] == "ok" and took < 10, took


def test_the_filesystem_of_a_path_is_read_from_the_mount_table(tmp_path):
    """/proc/self/mountinfo: optional fields before '-', octal escapes in mount points, the longest
    mount point above the path (a later mount stacked on the same point wins)."""
    mountinfo = tmp_path / "mountinfo"
    mountinfo.write_text(
        "22 1 253:1 / / rw,relatime shared:1 - ext4 /dev/vda rw\n"
        "40 22 0:40 / /mnt/shared rw,relatime shared:20 master:3 - autofs systemd-1 rw\n"
        "41 40 0:41 / /mnt/shared rw,relatime - nfs4 srv:/export rw\n"
        "42 22 0:42 / /mnt/a\\040b\\134c rw - cifs //srv/x rw\n"
        "43 22 0:43 / /mnt/sshfs rw - fuse.sshfs me@host: rw\n")

    def fs(path):
        return outcome_watch.filesystem_type(path, str(mountinfo))

    assert fs("/mnt/shared/captures/.index") == "nfs4"
    assert fs("/mnt/a b\\c/captures") == "cifs"
    assert fs("/mnt/sharedother") == "ext4" and fs("/") == "ext4"
    assert fs("/mnt/sshfs/x") == "fuse.sshfs"
    assert outcome_watch.filesystem_type("/proc/self") == "proc"  # the real table
    assert not outcome_watch.is_network_fs("/proc/self")
    assert outcome_watch.filesystem_type("/x", str(tmp_path / "missing")) == ""


def test_each_event_loop_gets_its_own_watch_and_a_closed_loops_descriptor_is_closed():
    from types import SimpleNamespace

    from sglang_capture.server.hooks.response import _outcome_watch

    manager = SimpleNamespace()

    async def get() -> OutcomeWatch:
        return _outcome_watch(manager)

    async def twice() -> bool:
        return _outcome_watch(manager) is _outcome_watch(manager)

    first = asyncio.run(get())
    assert first.event_driven and asyncio.run(twice())  # one watch per loop, kept
    second = asyncio.run(get())  # the earlier loops are closed by now: their descriptors are closed
    assert second is not first and not first.event_driven and second.event_driven
    assert len(vars(manager)["_sglang_capture_outcomes"]) == 1
