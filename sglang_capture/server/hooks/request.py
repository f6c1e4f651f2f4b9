"""Request seam: a request that asks for capture in ``custom_params`` is marked when it is created."""
from __future__ import annotations

from typing import Any

from sglang_capture.core import protocol
from sglang_capture.server.scheduler_capture import SchedulerCapture


def mark_capture_request(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After ``Req.__init__`` in the scheduler: parse and validate the capture options."""
    result = wrapped(*args, **kwargs)
    state.clock.timed("mark_request", protocol.asks_capture(protocol.custom_params(instance.sampling_params)),
                      lambda: state.begin(instance))
    return result
