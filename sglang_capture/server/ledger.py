"""Accounting of host memory held for pending writes, and the back-pressure that bounds it.

Captured prompt rows are views into their batch's host buffer (a block of ``host_pool``, or
SGLang's own pinned buffer when the pool was full), so holding one request's rows keeps the whole
buffer alive; decode rows are copied into runs of their own request (request_capture.py), so a
long generation does not keep its neighbours' steps alive. The ledger counts each underlying
storage once, by its full size, for as long as any held view uses it.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Dict, List, Optional

if TYPE_CHECKING:
    import torch


class HostMemoryLedger:
    """Bytes of host memory held by captured rows, with a cap that producers wait on.

    ``hold`` is called on the scheduler thread as rows arrive. When holding a new batch buffer
    would go over the cap, it waits (back-pressure: the scheduler schedules nothing meanwhile)
    until writers free enough, as long as ``draining()`` says writes are pending. When
    nothing is pending, waiting cannot free memory (it is held by requests still running), so it
    goes on over the cap instead of deadlocking; so does a single buffer larger than the cap.
    """

    def __init__(self, cap_bytes: int, draining: Callable[[], bool] = lambda: False,
                 block_bytes: Optional[Callable[[torch.Tensor], int]] = None) -> None:
        self.cap_bytes = cap_bytes
        self.draining = draining  # set by the writer: "are writes pending that will free memory?"
        # what holding a tensor's storage costs: set to the host pool's ``block_bytes`` once there
        # is one (its blocks are page-rounded), so the cap bounds what the pool really holds
        self.block_bytes = block_bytes or (lambda t: t.untyped_storage().nbytes())
        self._cond = threading.Condition()
        self._storages: Dict[int, List[int]] = {}  # data_ptr -> [nbytes, refcount]
        self.held_bytes = 0
        self.peak_bytes = 0
        self.waits = 0
        self.waiting = False  # a producer waits now (the writer link then reads its answers at once)
        self.on_wait: Callable[[], None] = lambda: None  # told as a wait begins

    def hold(self, t: torch.Tensor) -> None:
        key, nbytes = t.untyped_storage().data_ptr(), self.block_bytes(t)
        with self._cond:
            entry = self._storages.get(key)
            if entry is not None:
                entry[1] += 1
                return
            self._wait_locked(nbytes)
            self._storages[key] = [nbytes, 1]
            self.held_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.held_bytes)

    def release(self, t: torch.Tensor) -> None:
        key = t.untyped_storage().data_ptr()
        with self._cond:
            entry = self._storages.get(key)
            if entry is None:
                return
            entry[1] -= 1
            if entry[1] == 0:
                del self._storages[key]
                self.held_bytes -= entry[0]
                self._cond.notify_all()

    def _wait_locked(self, incoming: int) -> None:
        if self.held_bytes + incoming <= self.cap_bytes:  # the common case, on the scheduler thread
            return

        def over() -> bool:
            return self.held_bytes > 0 and self.held_bytes + incoming > self.cap_bytes and self.draining()

        if not over():
            return
        self.waits += 1
        self.waiting = True
        self.on_wait()
        try:
            while over():
                self._cond.wait(0.05)
        finally:
            self.waiting = False
