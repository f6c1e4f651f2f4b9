"""Host memory for the hidden states of capture batches: one region, pinned once at start-up.

Without it, SGLang copies each such batch into a fresh pinned buffer from torch's caching host
allocator, and captured rows keep that buffer until a writer has read them. Under capture the
allocator therefore keeps pinning more memory, on the scheduler thread (on the H200:
76 ``cudaHostAlloc`` calls taking 9.9 s in one 14 s window, bench/RESULTS.md), and never gives it
back (13 GB pinned against an 8 GiB cap). Each writer rank's pool pins its share of
``--capture-max-pending-mb`` (the node's budget split among its writer ranks, node_budget.py) once,
before the server takes requests, and hands out blocks of it (large ones first-fit from the
bottom, small ones from the top: see ``_alloc_locked``).

The region is a shared-memory file (``memfd``): the writer processes map it read-only and read
each request's rows where they lie, so a job crossing to a writer process carries block offsets,
not bytes (writer_pool.py, core/handoff.py). Its pages are only backed once touched (or pinned).

A block goes back to the pool only when the last tensor that can read it is gone: its tensor is
built on a numpy view of the block, and a ``weakref.finalize`` on that view fires when torch
frees the storage that holds it. So a block can never be handed out again while anything (a
job whose writer process has not read its rows yet, SGLang's result buffers) still uses it. When
no block fits, the caller falls back to SGLang's own copy and nothing is lost.
"""
from __future__ import annotations

import bisect
import collections
import math
import mmap
import os
import threading
import time
import weakref
from typing import Any, Deque, Dict, List, Optional, Tuple

import numpy
import torch

ALIGN = 4096  # block starts on a page boundary
SMALL_BLOCK = 16 << 20  # decode steps' blocks (one row per capture request) are far below this


def read_on_current_stream(t: torch.Tensor) -> None:
    """Mark a device tensor made on another stream (the forward's) as read by the current one
    (SGLang's copy stream). Without it, dropping the last reference hands its memory back to the
    caching allocator for its own stream at once, and the next forward can overwrite the rows
    before the kernels queued here have read them: on the H200, an FP8 pack read the next
    tensor's values in 9 of 10 trials without this and 0 of 10 with it (bench/RESULTS.md, r47)."""
    if t.is_cuda:
        t.record_stream(torch.cuda.current_stream(t.device))


def _round_up(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class HostPool:
    """A fixed host region handing out blocks that return when nothing references them.

    ``take`` runs on the scheduler thread; blocks are freed on whichever thread drops the last
    reference (often the link to the writers, once a writer process has read the rows). A free only
    queues the block (``_returned``, an atomic deque append: a finalizer may run inside any
    allocation, even one made while the lock is held); the next ``take`` folds the queue into
    the free list.
    """

    def __init__(self, nbytes: int, pin: bool, small_block: int = SMALL_BLOCK) -> None:
        self.size_bytes = _round_up(max(nbytes, ALIGN))
        self.small_block = small_block
        t0 = time.monotonic()
        self.fd = os.memfd_create("sglang-capture-pool", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size_bytes)
            self._map = mmap.mmap(self.fd, self.size_bytes, flags=mmap.MAP_SHARED,
                                  prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            os.close(self.fd)
            raise MemoryError(f"cannot map {self.size_bytes >> 20} MiB of shared memory: {e.strerror}") from None
        self._array = numpy.frombuffer(self._map, dtype=numpy.uint8)
        self._base = torch.from_numpy(self._array)
        self.base_ptr = self._base.data_ptr()
        self.pinned = False
        if pin:
            cudart = torch.cuda.cudart()
            rc = cudart.cudaHostRegister(self._base.data_ptr(), self.size_bytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of {self.size_bytes >> 20} MiB failed: {cudart.cudaGetErrorString(rc)}")
            self.pinned = True
        self.setup_s = time.monotonic() - t0
        self._free: List[List[int]] = [[0, self.size_bytes]]  # sorted, disjoint [start, end)
        self._returned: Deque[Tuple[int, int, Any]] = collections.deque()
        self._waiting: List[Tuple[int, int, Any]] = []  # freed, but a device copy into it may still run
        self._lock = threading.Lock()
        self.used_bytes = 0
        self.peak_used_bytes = 0
        self.blocks = 0
        self.fallbacks = 0

    def take(self, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """A copy of ``rows`` in a block of the pool, or None when no block fits.

        A device tensor is copied asynchronously on the current stream, as SGLang's own
        ``_async_d2h`` does (the caller waits on its copy-done event before reading), and the
        rows are kept alive for that stream.
        """
        found = self._block(tuple(rows.shape), rows.dtype)
        if found is None:
            return None
        out, view, start, size = found
        event = None
        if rows.is_cuda:
            out.copy_(rows, non_blocking=True)
            read_on_current_stream(rows)
            event = torch.cuda.Event()
            event.record()
        else:
            out.copy_(rows)
        weakref.finalize(view, self._returned.append, (start, size, event)).atexit = False
        return out

    def alloc(self, shape: Tuple[int, ...], dtype: torch.dtype, last_try: bool = True) -> Optional[torch.Tensor]:
        """An uninitialized host tensor in a block of the pool, or None when no block fits (the
        block returns, as ``take``'s do, once nothing references the tensor). ``last_try=False``:
        the caller tries a smaller block next, so a miss is not counted as a fallback."""
        found = self._block(shape, dtype, count_miss=last_try)
        if found is None:
            return None
        out, view, start, size = found
        weakref.finalize(view, self._returned.append, (start, size, None)).atexit = False
        return out

    def _block(self, shape: Tuple[int, ...], dtype: torch.dtype, count_miss: bool = True
               ) -> Optional[Tuple[torch.Tensor, Any, int, int]]:
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes == 0:
            return None
        size = _round_up(nbytes)
        with self._lock:
            self._reclaim_locked()
            start = self._alloc_locked(size)
            if start is None:
                self.fallbacks += count_miss
                return None
            self.blocks += 1
            self.used_bytes += size
            self.peak_used_bytes = max(self.peak_used_bytes, self.used_bytes)
        view = self._array[start:start + nbytes]
        return torch.from_numpy(view).view(dtype).view(shape), view, start, size

    def scatter_rows(self, source: torch.Tensor, rows: List[int], offsets: List[int]) -> None:
        """Copy row ``rows[k]`` of the contiguous host tensor ``source`` to byte offset ``offsets[k]``
        of the region, for every k, in one numpy call: rows bound for blocks all over the pool
        (a decode step's rows, each into its own request's run) cost one memcpy each and no
        Python per row. The caller owns the blocks the offsets point into."""
        src = source.view(torch.uint8).numpy() if source.dtype != torch.uint8 else source.numpy()
        src = src.reshape(source.shape[0], -1)
        row_bytes = src.shape[1]
        if max(offsets) + row_bytes > self.size_bytes or min(offsets) < 0:
            raise ValueError(f"rows of {row_bytes} bytes at offsets {min(offsets)}..{max(offsets)} lie outside "
                             f"the pool's {self.size_bytes} bytes")
        # every byte offset of the region as the start of a row: rows land wherever their block lies
        region_rows = numpy.lib.stride_tricks.as_strided(self._array, shape=(self.size_bytes - row_bytes + 1, row_bytes),
                                                         strides=(1, 1))
        region_rows[offsets] = src if len(rows) == src.shape[0] and rows == list(range(len(rows))) else src[rows]

    def offset_of(self, t: torch.Tensor) -> Optional[int]:
        """Where a contiguous host tensor lies in the region, or None when it is not in it."""
        off = t.data_ptr() - self.base_ptr
        if t.device.type != "cpu" or not t.is_contiguous() or off < 0 \
                or off + t.numel() * t.element_size() > self.size_bytes:
            return None
        return off

    def block_bytes(self, t: torch.Tensor) -> int:
        """Host bytes held for the storage ``t`` views: its pool block's page-rounded size when it
        lies in the pool (what the pool holds until it is freed), else the storage's own size."""
        storage = t.untyped_storage()
        off = storage.data_ptr() - self.base_ptr
        if t.device.type == "cpu" and 0 <= off < self.size_bytes:
            return _round_up(storage.nbytes())
        return storage.nbytes()

    def stats(self) -> Dict[str, Any]:
        """Counters for the writer's stats file; the free list's length and largest segment show
        fragmentation (a pool with room in total that cannot fit a batch falls back to SGLang's copy)."""
        with self._lock:
            self._reclaim_locked()
            segments, largest = len(self._free), max((b - a for a, b in self._free), default=0)
        return {"size_bytes": self.size_bytes, "pinned": self.pinned, "setup_s": round(self.setup_s, 3),
                "used_bytes": self.used_bytes, "peak_used_bytes": self.peak_used_bytes,
                "blocks": self.blocks, "fallbacks": self.fallbacks, "free_segments": segments,
                "largest_free_bytes": largest}

    def _reclaim_locked(self) -> None:
        while self._returned:
            self._waiting.append(self._returned.popleft())
        still = []
        for start, size, event in self._waiting:
            if event is not None and not event.query():
                still.append((start, size, event))
                continue
            self._insert_locked(start, start + size)
            self.used_bytes -= size
        self._waiting = still

    def _alloc_locked(self, size: int) -> Optional[int]:
        """First fit from the bottom for large blocks (prefill), from the top for small ones.

        Small blocks (a decode step's rows, a request's run of decode rows) come and go at a
        different pace than prefill blocks; placed among them, they would cut the freed space
        into holes too small for the next large batch.
        """
        small = size <= self.small_block
        for seg in reversed(self._free) if small else self._free:
            if seg[1] - seg[0] >= size:
                if small:
                    seg[1] -= size
                    start = seg[1]
                else:
                    start = seg[0]
                    seg[0] += size
                if seg[0] == seg[1]:
                    self._free.remove(seg)
                return start
        return None

    def _insert_locked(self, start: int, end: int) -> None:
        i = bisect.bisect_left(self._free, [start, end])
        if i > 0 and self._free[i - 1][1] == start:  # joins the segment before
            i -= 1
            self._free[i][1] = end
        else:
            self._free.insert(i, [start, end])
        if i + 1 < len(self._free) and self._free[i + 1][0] == self._free[i][1]:  # and the one after
            self._free[i][1] = self._free.pop(i + 1)[1]

    def free_segments(self) -> List[Tuple[int, int]]:
        """The free list, as (start, end) byte offsets, after folding in returned blocks."""
        with self._lock:
            self._reclaim_locked()
            return [tuple(seg) for seg in self._free]

    def close(self) -> None:
        """Unpin the region (a large registered region left to the kernel slows process exit)."""
        if self.pinned:
            self.pinned = False
            torch.cuda.cudart().cudaHostUnregister(self._base.data_ptr())
