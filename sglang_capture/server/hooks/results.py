"""Result seams: take captured rows as tensors instead of SGLang's ``.tolist()``.

Capture requests hand views of the (already host-side) hidden states to their RequestCapture,
keyed by absolute position. Other requests go through SGLang's own code unchanged, except that
they see only the columns plain SGLang would return them (``_sglang_columns``).
"""
from __future__ import annotations

import copy
from typing import Any, Optional, Tuple

from sglang_capture.core.final_state import POST_NORM
from sglang_capture.server.aux_capture import batch_captures
from sglang_capture.server.batch_rows import ResultRows, RowsMismatch
from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, SchedulerCapture
from sglang_capture.server.shared_rows import SHARE_ATTR


def batch_result_context(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``Scheduler.process_batch_result``: while a batch's result is processed, the row
    seams read its snapshot (whose ``prefix_lens`` give each request's chunk start; the live Req
    may already be scheduled further) and its ``BatchRows`` (which rows were kept). Where SGLang
    gives the result a copy-done event (its overlap schedule, speculative workers), the wait for
    the batch's copy to the host is timed apart (``result_wait``) from the processing."""
    batch = args[0] if args else kwargs["batch"]
    result = args[1] if len(args) > 1 else kwargs["result"]
    mode = batch.forward_mode.name.lower()
    if state.gc_watch_pending:
        state.watch_gc()
    state.processing = ResultRows.of(batch, result)

    def process() -> Any:
        try:
            return wrapped(*args, **kwargs)
        finally:
            if state.decode_rows is not None:
                state.decode_rows.flush()  # the step's rows of requests that did not finish in it

    captures = batch_captures(batch)
    done = getattr(result, "copy_done", None)
    try:
        if done is not None:
            # SGLang's first step in processing a result: waited here, its own seam, so that
            # ``process_result`` counts the host's work alone, not the GPU's time to finish the batch
            state.clock.timed(f"result_wait/{mode}", captures, done.synchronize)
        return state.clock.timed(f"process_result/{mode}", captures, process)
    finally:
        if state.launched is not None and state.launched.rows is state.processing.rows:
            state.launched = None  # its own result is read: no later sealing can want its rows
        state.processing = None


def _rows_of(state: SchedulerCapture, req: Any, capture: Any, hidden: Any, offset: int, n: int) -> Optional[Tuple[int, ResultRows]]:
    """Where ``req``'s rows lie in ``hidden``, or None (its capture then fails, naming why)."""
    processing = state.processing
    if processing is None:
        capture.fail(f"rows of batch offset {offset} arrived outside a batch's result processing")
        return None
    try:
        return processing.row(hidden, offset, n), processing
    except RowsMismatch as e:
        capture.fail(str(e))
        return None


def _sglang_columns(state: SchedulerCapture, hidden: Any) -> Any:
    """The columns plain SGLang returns a ``return_hidden_states`` request: the post-norm final state,
    or on a server that speculates with EAGLE-3 the aux layers its draft reads."""
    model = state.model
    if model is None or hidden is None or hidden.shape[-1] != model.row_width:
        return hidden
    if state.aux is not None and state.aux.speculative:
        return hidden[..., :model.aux_width]
    lo, hi = model.final_columns(POST_NORM)
    return hidden[..., lo:hi]


def take_prefill_rows(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``_append_prefill_hidden_states`` (keyword-only): store every chunk, middle ones too."""
    req = kwargs["req"]
    capture = getattr(req, CAPTURE_ATTR, None)
    if capture is None:
        if req.return_hidden_states:
            out = copy.copy(kwargs["logits_output"])
            out.hidden_states = _sglang_columns(state, out.hidden_states)
            kwargs = {**kwargs, "logits_output": out}
        return wrapped(*args, **kwargs)
    start = kwargs["hidden_state_offset"]
    n = kwargs["extend_input_len"]
    if not kwargs["capture_hidden_mode"].is_full():
        raise RuntimeError("sglang_capture needs full hidden-state capture; start the server through sglang_capture.launch")
    if not req.finished() and not req.is_retracted:
        _store_chunk(state, req, capture, kwargs["logits_output"].hidden_states, start, n)
        if state.shared is not None and getattr(req, SHARE_ATTR, None) is not None:
            _prefill_done(state, req, capture, n)
    return start + n


def _prefill_done(state: SchedulerCapture, req: Any, capture: Any, n: int) -> None:
    """After a sharing capture request's chunk: when it was the prefill's last (every prompt row is
    in; output_ids gets this step's token only later), its prompt blocks are stored ahead of its file."""
    processing = state.processing
    if processing is None or state.pd_prefill:
        return
    end = processing.chunk_start(req) + n
    if end == len(req.origin_input_ids) + len(req.output_ids):
        if capture.failure is None:
            state.store_ahead(req, capture, end)
        else:
            getattr(req, SHARE_ATTR).ahead_asked = True  # no job ahead: the captures it holds go on


def _store_chunk(state: SchedulerCapture, req: Any, capture: Any, hidden: Any, offset: int, n: int) -> None:
    """Hand the ``n`` rows at batch offset ``offset`` to ``req``'s capture, at their prompt position."""
    if capture.failure is not None:
        return
    found = _rows_of(state, req, capture, hidden, offset, n)
    if found is not None:
        row, processing = found
        capture.add(processing.chunk_start(req), processing.source(hidden, capture)[row:row + n])


def take_pd_prefill_rows(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Before ``process_batch_result_disagg_prefill`` (a PD prefill server, ``--disaggregation-mode
    prefill``): SGLang's code there never reads the hidden states, so every chunk's rows are taken
    here, before it hands the request's KV to the decode server. The launcher requires
    ``--return-hidden-states-mode full``, so each request owns ``extend_input_len`` rows in turn."""
    batch = args[0] if args else kwargs["batch"]
    result = args[1] if len(args) > 1 else kwargs["result"]
    out = result.logits_output
    lens = result.extend_input_len_per_req
    if batch.return_hidden_states and out is not None and out.hidden_states is not None and lens is not None:
        if result.copy_done is not None:
            result.copy_done.synchronize()
        offset = 0
        for req, n in zip(batch.reqs, lens, strict=True):
            capture = getattr(req, CAPTURE_ATTR, None)
            if capture is not None and not req.finished() and not req.is_retracted:
                _store_chunk(state, req, capture, out.hidden_states, offset, n)
            offset += n
    return wrapped(*args, **kwargs)


def take_decode_rows(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Optional[Any]:
    """Around the static ``_append_decode_hidden_states``: one row per fed-back token."""
    req = kwargs["req"]
    capture = getattr(req, CAPTURE_ATTR, None)
    if capture is None:
        return wrapped(*args, **{**kwargs, "hidden_states": _sglang_columns(state, kwargs["hidden_states"])})
    accept = kwargs["accept_len"]
    if accept > 0:
        # output_ids already holds this step's tokens; the rows belong to the tokens fed in.
        position = len(req.origin_input_ids) + len(req.output_ids) - 1 - accept
        processing = state.processing
        if state.decode_rows is not None and processing is not None:  # placed with the step's other decode rows, at its flush
            state.decode_rows.note(capture, position, kwargs["hidden_states"], kwargs["start"], accept, processing)
            return None
        hidden = kwargs["hidden_states"]
        found = _rows_of(state, req, capture, hidden, kwargs["start"], accept)
        if found is not None:
            row, processing = found
            capture.add(position, processing.source(hidden, capture)[row:row + accept])
    return None
