"""Accounting of host memory held for pending writes, and the back-pressure that bounds it.

Captured rows are views into SGLang's per-batch host buffers (pinned on a GPU), so holding one
request's rows keeps its whole batch buffer alive. The ledger therefore counts each underlying
storage once, by its full size, for as long as any held view uses it.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List

import torch


class HostMemoryLedger:
    """Bytes of host memory held by captured rows, with a cap that producers wait on."""

    def __init__(self, cap_bytes: int) -> None:
        self.cap_bytes = cap_bytes
        self._cond = threading.Condition()
        self._storages: Dict[int, List[int]] = {}  # data_ptr -> [nbytes, refcount]
        self.held_bytes = 0
        self.peak_bytes = 0
        self.waits = 0

    def hold(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        with self._cond:
            entry = self._storages.get(key)
            if entry is None:
                self._storages[key] = [storage.nbytes(), 1]
                self.held_bytes += storage.nbytes()
                self.peak_bytes = max(self.peak_bytes, self.held_bytes)
            else:
                entry[1] += 1

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

    def wait_for_room(self, draining: Callable[[], bool]) -> None:
        """Block while over the cap and ``draining()`` says pending writes will free memory.

        Memory held by requests that are still running cannot be freed by waiting, so when no
        write is pending the caller goes on (the cap is then exceeded rather than deadlocked).
        """
        with self._cond:
            if self.held_bytes > self.cap_bytes and draining():
                self.waits += 1
            while self.held_bytes > self.cap_bytes and draining():
                self._cond.wait(0.05)
