"""Finish seam: a finished capture request is sealed and its response carries a reference."""
from __future__ import annotations

from typing import Any

from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, SchedulerCapture


def seal_finished(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Before ``_stream_output_generation``: the last point where every row of a request is in."""
    reqs = args[0] if args else kwargs["reqs"]
    skip_req = args[2] if len(args) > 2 else kwargs.get("skip_req")
    sealing = [req for req in reqs if getattr(req, CAPTURE_ATTR, None) is not None and req is not skip_req
               and req.finished() and not req.finished_output]

    def seal_and_stream() -> Any:
        if sealing and state.decode_rows is not None:
            state.decode_rows.flush()  # this step's decode rows, into the runs about to be sealed
        for req in sealing:
            capture = getattr(req, CAPTURE_ATTR)
            delattr(req, CAPTURE_ATTR)
            req.hidden_states = [state.finish(req, capture)]
        return wrapped(*args, **kwargs)

    return state.clock.timed("stream_output", bool(sealing), seal_and_stream)
