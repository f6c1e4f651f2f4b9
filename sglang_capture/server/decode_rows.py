"""Decode rows of one batch result, copied into their requests' runs together.

A decode step hands every capture request of the batch a few rows (one, or an EAGLE-3 verify
pass's accepted ones). Copying each request's rows into its run as they arrive
(``RequestCapture.add``) costs the scheduler thread a few tensor operations per request and
step: 2.7 ms per 64-request step in isolation, against 0.7 ms this way (the scheduler's whole
result seam and the H200's throughput did not change measurably: bench/results/
gpu_spec-eagle3-h200-2026-12-03-r63.md). Here the result seam only reserves each request's place in its run
(``RequestCapture.place``, plain Python); ``flush`` then copies all of the step's rows with one
``HostPool.scatter_rows`` per source tensor, before any of the requests is sealed.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Tuple

from sglang_capture.server.request_capture import RUN_ROWS

if TYPE_CHECKING:
    import torch

    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.host_pool import HostPool
    from sglang_capture.server.request_capture import RequestCapture


@dataclass
class _Source:
    """One host tensor of the step's rows, and where its reserved rows go."""

    tensor: Any
    row_shape: Tuple[int, ...]
    row_bytes: int
    batchable: bool  # a contiguous host tensor: scatter_rows can read it
    rows: List[int] = field(default_factory=list)
    offsets: List[int] = field(default_factory=list)
    buffers: List[Any] = field(default_factory=list)  # the runs written to, kept until the copy


class DecodeRows:
    """Rows placed but not yet copied, per source tensor (scheduler thread)."""

    def __init__(self, pool: HostPool, counts: CopyCounts) -> None:
        self.pool = pool
        self.counts = counts
        self._pending: Dict[int, _Source] = {}

    def take(self, capture: RequestCapture, start: int, source: torch.Tensor, row: int, n: int) -> bool:
        """Reserve ``n`` rows of ``source`` from ``row`` on for ``capture``'s positions from ``start``;
        False when they cannot be batched (the caller then adds them itself)."""
        src = self._pending.get(id(source))
        if src is None:
            batchable = source.device.type == "cpu" and source.dim() > 1 and source.is_contiguous()
            row_shape = tuple(source.shape[1:])
            row_bytes = math.prod(row_shape) * source.element_size()
            src = self._pending[id(source)] = _Source(source, row_shape, row_bytes, batchable)
        if not src.batchable or n > RUN_ROWS or (capture.is_fp8 and source.element_size() != 1):
            return False
        placed = capture.place(start, n, source.dtype, src.row_shape)
        if placed is None:  # no room in the pool for a run (counted there): the view of the step's block
            capture.keep(start, source[row:row + n])
            return True
        buffer, at = placed
        src.rows.extend(range(row, row + n))
        src.offsets.extend(range(at, at + n * src.row_bytes, src.row_bytes))
        src.buffers.append(buffer)
        return True

    def flush(self) -> None:
        """Copy every reserved row to its place (before the requests are sealed, and at the step's end)."""
        pending, self._pending = self._pending, {}
        for src in pending.values():
            if src.rows:
                self.pool.scatter_rows(src.tensor, src.rows, src.offsets)
                self.counts.decode_rows_scattered += len(src.rows)
                self.counts.decode_scatters += 1
