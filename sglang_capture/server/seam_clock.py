"""Scheduler-thread time spent in the patched seams, per seam, for batches that capture or not.

SGLang's scheduler thread is the one thread whose time every request pays for: on a model whose
forward is short it is the server's bottleneck (bench/RESULTS.md, "Writer ceiling and serialization", r14-r26: the GPU was
under 60% busy). These counters say how much of that thread a capture batch takes compared with
a batch that captures nothing, in the writer stats (``scheduler_thread``). Two clock reads a call.
"""
from __future__ import annotations

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
        return {k: {"calls": int(n), "s": round(s, 6), "us_per_call": round(1e6 * s / n, 1) if n else 0.0}
                for k, (n, s) in sorted(self._totals.items())}
