"""Finish seam: a finished capture request is sealed and its response carries a reference.

A client's capture (``--capture-return-hidden-states`` marks a request as one) is sealed before
SGLang streams the request's last output, which carries the reference. An operator's capture
(``--capture-fraction``) gets no reference in its response, so it is sealed right after that output
is sent: its answer leaves without waiting for the batch's sealing (~0.15 ms a capture; a wave of 40
chats finishing in one step waited ~5 ms on an H100, bench/RESULTS.md), and the sealing overlaps the
answer's way to the client and the next turn's way back. The rows it will store are still in flight
before the client can send that turn: the scheduler reads new requests only after this call returns.
A capture that fails to seal then fails alone (``SchedulerCapture.finish_answered``).
"""
from __future__ import annotations

from typing import Any

from sglang_capture.core import protocol
from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, SchedulerCapture


def _operator(req: Any) -> bool:
    return protocol.capture_mark(protocol.custom_params(req.sampling_params)) == protocol.OPERATOR


def seal_finished(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Before and after ``_stream_output_generation``: the last point where every row of a request is in."""
    reqs = args[0] if args else kwargs["reqs"]
    skip_req = args[2] if len(args) > 2 else kwargs.get("skip_req")
    sealing = [req for req in reqs if getattr(req, CAPTURE_ATTR, None) is not None and req is not skip_req
               and req.finished() and not req.finished_output]

    def seal_and_stream() -> Any:
        if sealing and state.decode_rows is not None:
            state.decode_rows.flush()  # this step's decode rows, into the runs about to be sealed
        after = []
        for req in sealing:
            capture = getattr(req, CAPTURE_ATTR)
            delattr(req, CAPTURE_ATTR)
            if _operator(req):
                after.append((req, capture))
            else:
                req.hidden_states = [state.finish(req, capture)]  # the reference its response carries
        try:
            return wrapped(*args, **kwargs)
        finally:
            for req, capture in after:
                state.finish_answered(req, capture)

    return state.clock.timed("stream_output", bool(sealing), seal_and_stream)
