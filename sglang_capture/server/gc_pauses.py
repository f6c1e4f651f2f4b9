"""Pauses of Python's cyclic garbage collector in a scheduler process, per generation.

A collection stops every thread of the process, the scheduler's too, for as long as it walks
the objects of its generations: a full one walks everything SGLang keeps alive (on the H200, full
collections of up to 0.89 s under decode-heavy capture, bench/RESULTS.md r63). Capture keeps
objects alive for a while (rows waiting for a writer), so it can make the collector run, and pause
the scheduler, more often; ``gc_pauses`` in the writer stats shows whether it does.

``--capture-gc-freeze`` shortens the full collections: ``freeze`` moves every object alive after
the first batch (the model, SGLang's bookkeeping, the CUDA graphs') out of the collector's
generations for good, as SGLang's ``/freeze_gc`` endpoint does, so a full collection walks only
what was created since. Python has one frozen set per process: SGLang's own unfreeze (after
recapturing CUDA graphs on ``update_weights_from_disk``) gives those objects back to the collector
(``frozen_objects`` still says how many were frozen), and ``uninstall`` gives back whatever is
frozen then, SGLang's ``/freeze_gc`` included.
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
        # not grow the dict while a hand-off thread reads it for the stats file
        self._totals: Dict[str, List[float]] = {g: [0, 0.0, 0.0] for g in GENERATIONS}
        self.frozen = 0  # objects moved out of the collector's reach by ``freeze``

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
        """Stop counting, and give frozen objects back to the collector (idempotent)."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)
        if self.frozen:
            gc.unfreeze()
            self.frozen = 0

    def freeze(self) -> int:
        """Move every object alive now out of the collector's generations (``gc.freeze``, O(1));
        returns how many the collector no longer walks."""
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        return self.frozen

    def stats(self) -> Dict[str, Any]:
        """Per generation: collections, total seconds, the longest in ms; and the objects frozen."""
        out: Dict[str, Any] = {k: {"calls": int(n), "s": round(s, 4), "max_ms": round(1e3 * m, 2)}
                               for k, (n, s, m) in ((g, tuple(self._totals[g])) for g in GENERATIONS)}
        out["frozen_objects"] = self.frozen
        return out
