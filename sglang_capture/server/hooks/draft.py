"""Draft seam (a server that speculates with EAGLE-3): the draft reads the aux columns only.

The target's hidden states carry the final hidden state as their last columns
(``append_final_hidden``), while the draft's ``fc`` takes exactly the aux layers' columns. Every
draft-extend pass (after the target's prefill and after each verify) gets the target's rows
through an ``EagleDraftExtendInput``, so that is the one place where the draft is handed a view
without the final columns; the full rows stay on the batch's result for the copy to the host.
"""
from __future__ import annotations

from typing import Any

from sglang_capture.server.scheduler_capture import SchedulerCapture


def aux_for_draft(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Before ``EagleDraftExtendInput.__post_init__``: its ``hidden_states`` become the aux columns."""
    model = state.model
    hidden = instance.hidden_states
    if model is not None and hidden is not None and hidden.shape[-1] == model.row_width:
        instance.hidden_states = hidden[..., :model.aux_width]
    return wrapped(*args, **kwargs)
