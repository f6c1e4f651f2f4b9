"""Scheduler-thread time spent in the patched seams, per seam, for batches that capture or not.

SGLang's scheduler thread is the one thread whose time every request pays for: on a model whose
forward is short it is the server's bottleneck (bench/RESULTS.md, "Writer ceiling and serialization", r14-r26: the GPU was
under 60% busy). These counters say how much of that thread a capture batch takes compared with
a batch that captures nothing, in the writer stats (``scheduler_thread``). Each call's wall time
and the thread's own CPU time are both counted: where the wall time is much the longer, the thread
waited inside the seam (for the GIL, which the process's other threads hold, or for the GPU),
rather than worked. Four clock reads a call (~1.5 us: the thread's CPU clock is a system call).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List


class SeamClock:
    """Cumulative calls, wall seconds and thread CPU seconds per (seam, captured or not)."""

    def __init__(self) -> None:
        self._totals: Dict[str, List[float]] = {}

    def timed(self, seam: str, captured: bool, call: Callable[[], Any]) -> Any:
        """``call()``, its wall and CPU time added to ``seam``'s captured or plain account."""
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return call()
        finally:
            acc = self._totals.setdefault(f"{seam}/{'capture' if captured else 'plain'}", [0, 0.0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t0
            acc[2] += time.thread_time() - c0

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per account: calls, total seconds, microseconds per call, and the thread's CPU seconds."""
        out = {}  # a plain loop, in the order the accounts were opened: this runs ahead of every batch of jobs sent
        for k, (n, s, cpu) in tuple(self._totals.items()):  # the idle pump may read while the scheduler thread adds
            out[k] = {"calls": int(n), "s": round(s, 6), "us_per_call": round(1e6 * s / n, 1) if n else 0.0,
                      "cpu_s": round(cpu, 6)}
        return out
