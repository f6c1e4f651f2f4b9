"""Scheduler-thread time spent in the patched seams, per seam, for batches that capture or not.

SGLang's scheduler thread is the one thread whose time every request pays for: on a model whose
forward is short it is the server's bottleneck (bench/RESULTS.md, "Writer ceiling and serialization", r14-r26: the GPU was
under 60% busy). These counters say how much of that thread a capture batch takes compared with
a batch that captures nothing, in the writer stats (``scheduler_thread``). Two clock reads a call.
"""
from __future__ import annotations

import gc
import time
from typing import Any, Callable, Dict, List


class SeamClock:
    """Cumulative seconds and calls per (seam, captured or not)."""

    def __init__(self) -> None:
        self._totals: Dict[str, List[float]] = {}

    def timed(self, seam: str, captured: bool, call: Callable[[], Any]) -> Any:
        """``call()``, its wall time added to ``seam``'s captured or plain account."""
        t0 = time.perf_counter()
        try:
            return call()
        finally:
            acc = self._totals.setdefault(f"{seam}/{'capture' if captured else 'plain'}", [0, 0.0])
            acc[0] += 1
            acc[1] += time.perf_counter() - t0

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per account: calls, total seconds and microseconds per call."""
        return {k: {"calls": int(n), "s": round(s, 4), "us_per_call": round(1e6 * s / n, 1) if n else 0.0}
                for k, (n, s) in sorted(self._totals.items())}


class GcPauses:
    """Pauses of Python's cyclic garbage collector in this process, per generation.

    A collection stops every thread of the process, the scheduler's too, for as long as it walks
    the objects of its generations: a full one walks everything SGLang keeps alive. Capture adds
    objects that live a while (rows waiting for a writer), so it can make the collector run, and
    pause the scheduler, more often; this shows whether it does (``gc_pauses`` in the stats).
    Installed with ``gc.callbacks`` by the scheduler's capture state, removed with ``uninstall``.
    """

    def __init__(self) -> None:
        self._t0 = 0.0
        self._totals: Dict[str, List[float]] = {}

    def __call__(self, phase: str, info: Dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        acc = self._totals.setdefault(f"gen{info.get('generation', '?')}", [0, 0.0, 0.0])
        acc[0] += 1
        took = time.perf_counter() - self._t0
        acc[1] += took
        acc[2] = max(acc[2], took)

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def stats(self) -> Dict[str, Dict[str, float]]:
        """Per generation: collections, total seconds, the longest in ms."""
        return {k: {"calls": int(n), "s": round(s, 4), "max_ms": round(1e3 * m, 2)}
                for k, (n, s, m) in sorted(self._totals.items())}
