"""Prefix seams (``--capture-prefix-sharing on``): a capture request's radix-cache hit is capped
where its rows stored (or in flight to the store) end, and the index that says so changes alike on
every rank.

- ``cap_shared_prefix`` (``Req._compute_max_prefix_len``): SGLang matches a request's prefix in
  the radix cache up to the limit this returns; for a capture request whose rows are shared it is
  also capped at what the blocks stored or in flight cover (server/shared_rows.py). Every rank computes it.
- ``hold_shared_prompt`` (``PrefillAdder.add_one_req``): a sharing capture request whose next
  prompt slot another capture admitted earlier computes now waits in SGLang's queue until that
  capture's blocks are queued to be stored (in flight); a capture admitted becomes such an owner
  (server/prompt_holds.py). Every rank decides alike.
- ``post_block_events`` (``SchedulerRequestReceiver._pull_raw_reqs``): on the rank that receives
  the requests (the writer rank), the link to the writers is pumped first (writer_pool.py: the
  supervisor's answers read, the blocks it stored indexed, finished jobs sent), then the index's
  events join the requests, first, and SGLang's own broadcast carries them to the group's other
  ranks. So a chat's next turn, let in by an outcome recorded after its blocks were written to
  the pipe, is pulled after they are indexed. With sharing off the pump still runs here.
- ``keep_block_events_with_work`` (``SchedulerRequestReceiver._split_work_and_control_reqs``):
  under DP attention those events go with the requests, to the ranks of their own DP group.
- ``apply_block_events`` (``Scheduler.process_input_requests``): every rank applies the events,
  before the requests that came with them, and SGLang never sees them.
"""
from __future__ import annotations

from typing import Any

from sglang_capture.server.block_index import BlockEvent
from sglang_capture.server.scheduler_capture import EXTRA_KEY_TAG, SchedulerCapture
from sglang_capture.server.shared_rows import SHARE_ATTR


def cap_shared_prefix(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After ``Req._compute_max_prefix_len``: a sharing capture request reuses only rows stored or in flight."""
    limit = wrapped(*args, **kwargs)
    if state.shared is None or getattr(instance, SHARE_ATTR, None) is None:
        return limit
    capped = state.clock.timed("prefix_cap", True, lambda: state.shared.limit(instance, limit))
    if capped is None:  # it needs private capture after all (its images arrived after it was made)
        instance.extra_key = (instance.extra_key or "") + EXTRA_KEY_TAG + instance.rid
        return limit
    return capped


def _holds_mamba_slot(req: Any) -> bool:
    """Whether the prefix match gave ``req`` a Mamba slot, which SGLang frees only for a request it refused itself."""
    kv = getattr(req, "kv", None)  # 0.5.19 on
    return getattr(req, "mamba_pool_idx", None) is not None or bool(getattr(kv, "holds_mamba", False))


def hold_shared_prompt(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``PrefillAdder.add_one_req(req, has_chunked_req, truncation_align_size)``: a held request
    is passed over as SGLang passes over one it cannot schedule yet (``CONTINUE``, not added: it stays
    in the waiting queue and the scheduler tries the next); one admitted is in ``can_run_list``."""
    shared = state.shared
    if shared is None:
        return wrapped(*args, **kwargs)
    req = args[0] if args else kwargs["req"]

    def add() -> Any:
        if not _holds_mamba_slot(req) and shared.held(req):
            from sglang.srt.managers.schedule_policy import AddReqResult

            return AddReqResult.CONTINUE
        out = wrapped(*args, **kwargs)
        if not state.pd_prefill and instance.can_run_list and instance.can_run_list[-1] is req:
            shared.admitted(req)
        return out

    return state.clock.timed("add_one_req", getattr(req, SHARE_ATTR, None) is not None, add)


def post_block_events(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``_pull_raw_reqs``, on the writer rank: the link is pumped before the requests are
    pulled, and the block events go first among them."""
    if not state.is_writer:
        return wrapped(*args, **kwargs)
    state.writer.pump()
    reqs = wrapped(*args, **kwargs)
    if reqs is None or state.shared is None:
        return reqs
    events = state.shared.take_events()
    return events + list(reqs) if events else reqs


def keep_block_events_with_work(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple,
                                kwargs: dict) -> Any:
    """Around ``_split_work_and_control_reqs`` (DP attention): block events travel with the work."""
    work, control = wrapped(*args, **kwargs)
    events = [r for r in control if isinstance(r, BlockEvent)]
    if not events:
        return work, control
    return events + list(work), [r for r in control if not isinstance(r, BlockEvent)]


def apply_block_events(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``Scheduler.process_input_requests``: apply block events, pass SGLang the rest."""
    reqs = args[0] if args else kwargs["recv_reqs"]
    events = [r for r in reqs if isinstance(r, BlockEvent)]
    if not events:
        return wrapped(*args, **kwargs)
    if state.shared is not None:
        state.clock.timed("block_events", True, lambda: state.shared.apply(events))
    rest = [r for r in reqs if not isinstance(r, BlockEvent)]
    return wrapped(rest, *args[1:], **kwargs) if args else wrapped(*args, **{**kwargs, "recv_reqs": rest})
