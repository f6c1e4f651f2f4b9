"""Pauses of Python's cyclic garbage collector in a scheduler process, per generation.

A collection stops every thread of the process, the scheduler's too, for as long as it walks
the objects of its generations: a full one walks everything SGLang keeps alive (on the H200, full
collections of several seconds at start-up). Capture keeps objects alive for a while (rows waiting
for a writer), so it could make the collector run, and pause the scheduler, more often; ``gc_pauses``
in the writer stats shows whether it does. Counting starts with the first batch result
(scheduler_capture.py: ``watch_gc``): the full collections SGLang itself runs around CUDA-graph
capture at start-up are not traffic's (on the H200, none ran under traffic: bench/RESULTS.md, r69-r72).
"""
from __future__ import annotations

import gc
import time
from typing import Any, Dict, List

GENERATIONS = ("gen0", "gen1", "gen2")


class GcPauses:
    """Collections, seconds and the longest pause per generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self._t0 = 0.0
        # every key exists from the start: the callback runs in whichever thread collects, and must
        # not grow the dict while the writer link reads it for the stats file
        self._totals: Dict[str, List[float]] = {g: [0, 0.0, 0.0] for g in GENERATIONS}

    def __call__(self, phase: str, info: Dict[str, Any]) -> None:
        """The ``gc.callbacks`` hook: ``start`` and ``stop`` of one collection."""
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        acc = self._totals.get(f"gen{info.get('generation')}")
        if acc is None:
            return
        took = time.perf_counter() - self._t0
        acc[0] += 1
        acc[1] += took
        acc[2] = max(acc[2], took)

    def install(self) -> None:
        """Start counting (idempotent)."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def uninstall(self) -> None:
        """Stop counting (idempotent)."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def stats(self) -> Dict[str, Any]:
        """Per generation: collections, total seconds, the longest in ms."""
        return {k: {"calls": int(n), "s": round(s, 4), "max_ms": round(1e3 * m, 2)}
                for k, (n, s, m) in ((g, tuple(self._totals[g])) for g in GENERATIONS)}
