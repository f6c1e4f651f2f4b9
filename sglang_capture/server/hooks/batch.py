"""Batch seam: the batch ``Scheduler.run_batch`` is about to run on the device.

Three steps depend on it: whether the model computes the aux layers for it (aux_capture.py),
which of its result rows the copy to the host takes (transfer.py), and whether a decode batch
needs its hidden states copied at all (below). Its ``BatchRows`` (batch_rows.py) is the running
batch while the forward and the copy run, and rides on its result object afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Any

from sglang_capture.server.answer_tail import LaunchedStep
from sglang_capture.server.aux_capture import batch_captures
from sglang_capture.server.batch_rows import BatchRows, wants_decode_row
from sglang_capture.server.scheduler_capture import SchedulerCapture


def run_batch(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``Scheduler.run_batch`` (scheduler thread; the forward is launched inside it)."""
    batch = args[0] if args else kwargs["batch"]
    aux = state.aux
    captures = batch_captures(batch)
    if captures and batch.forward_mode.is_decode() and batch.return_hidden_states \
            and not any(wants_decode_row(req) for req in batch.reqs):
        # SGLang reads these two when it copies the result and processes it (on a copy of the
        # batch taken after this call); the forward itself captures at the server's mode anyway.
        from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

        batch.return_hidden_states, batch.return_hidden_states_mode = False, CaptureHiddenMode.NULL
        captures = False

    rows = BatchRows(batch, captures)

    def run() -> Any:
        state.launching = rows
        try:
            with aux.for_batch(batch, captures) if aux is not None else contextlib.nullcontext():
                result = wrapped(*args, **kwargs)
        finally:
            state.launching = None
        rows.attach(result)
        # a decode step launched before the last one's result is read may hold an answer's last row
        state.launched = LaunchedStep(rows, result) if captures and rows.mode.is_decode() else None
        return result

    return state.clock.timed(f"run_batch/{batch.forward_mode.name.lower()}", captures, run)
