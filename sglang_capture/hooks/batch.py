"""Batch seam: the batch ``Scheduler.run_batch`` is about to run on the device.

Two steps depend on it: whether the model computes the aux layers for it (aux_capture.py), and
which of its result rows the copy to the host takes (transfer.py).
"""
from __future__ import annotations

import contextlib
from typing import Any

from sglang_capture.aux_capture import batch_captures
from sglang_capture.hooks.transfer import running
from sglang_capture.sidecar import get_sidecar


def run_batch(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``Scheduler.run_batch`` (scheduler thread; the forward is launched inside it)."""
    batch = args[0] if args else kwargs["batch"]
    sidecar = get_sidecar()
    aux = sidecar.aux
    captures = batch_captures(batch)

    def run() -> Any:
        with aux.for_batch(batch, captures) if aux is not None else contextlib.nullcontext(), running(batch):
            return wrapped(*args, **kwargs)

    return sidecar.clock.timed(f"run_batch/{batch.forward_mode.name.lower()}", captures, run)
