"""The scheduler thread's clock (server/seam_clock.py)."""
from __future__ import annotations

import time

import pytest


def test_seam_clock_accounts_calls_wall_and_cpu_time_per_seam_and_kind():
    from sglang_capture.server.seam_clock import SeamClock

    clock = SeamClock()
    assert clock.timed("run_batch", True, lambda: 7) == 7
    clock.timed("run_batch", False, lambda: time.sleep(0.01))
    with pytest.raises(ZeroDivisionError):
        clock.timed("run_batch", False, lambda: 1 / 0)  # a raising call is still accounted
    stats = clock.stats()
    assert set(stats) == {"run_batch/capture", "run_batch/plain"}
    assert stats["run_batch/capture"]["calls"] == 1 and stats["run_batch/plain"]["calls"] == 2
    assert stats["run_batch/plain"]["s"] >= 0.01 and stats["run_batch/plain"]["us_per_call"] >= 5000
    # a sleep is waiting, not work: the thread's CPU time stays far below the wall time
    assert 0 <= stats["run_batch/plain"]["cpu_s"] < 0.005


def test_seam_clock_counts_cpu_time_of_work_done_inside_a_seam():
    from sglang_capture.server.seam_clock import SeamClock

    clock = SeamClock()
    end = time.thread_time() + 0.02
    clock.timed("prefix_cap", True, lambda: [None for _ in iter(lambda: time.thread_time() < end, False)])
    stats = clock.stats()["prefix_cap/capture"]
    assert stats["cpu_s"] >= 0.019 and stats["s"] >= stats["cpu_s"] * 0.9


def test_gc_pauses_are_counted_per_generation_while_installed_and_not_after():
    import gc

    from sglang_capture.server.gc_pauses import GcPauses

    pauses = GcPauses()
    pauses.install()
    pauses.install()  # idempotent: one callback, one count per collection
    try:
        gc.collect(2)
        gc.collect(0)
        stats = pauses.stats()
        assert set(stats) == {"gen0", "gen1", "gen2"}
        assert stats["gen2"]["calls"] == 1 and stats["gen0"]["calls"] >= 1
        assert stats["gen2"]["s"] >= 0 and stats["gen2"]["max_ms"] >= 0
    finally:
        pauses.uninstall()
    assert pauses not in gc.callbacks
    gc.collect(2)
    assert pauses.stats()["gen2"]["calls"] == 1
