"""The row of an answer's last token, which SGLang's overlap schedule computes after the answer ends.

Under the overlap schedule the scheduler launches step k+1 before it processes step k's result.
When nothing waits to be prefilled (the end of every wave of chat turns), step k+1 is a decode step
holding every running request, including one that step k's token ends: step k+1 feeds it that last
token (``prepare_for_decode`` counts it in the committed KV length), so when step k's result ends the
request, the radix cache takes that token's KV (``cache_finished_req``; ``insert_req`` in 0.5.21,
``checkpoint`` from 0.5.22). Step k+1's result then skips the finished request
(``process_batch_result_decode``), so the row never reaches the row seams. From 0.5.22 SGLang leaves
a request its length ends out of step k+1 (``_reqs_finishing_inflight``): there only an answer a
stop or end-of-turn token ends, which it cannot foresee, is fed again, as every answer is before.

A capture file has no row for that token (core/format.row_count: the last token is never fed
back). But the next turn of the chat re-sends it, and the radix cache holds its KV: with prefix
sharing, a capture whose stored rows end one token before the radix match has its hit capped there
and computes that token again. That one token costs far more than one token's work: it is a radix
node split, a freed duplicate KV slot, and on Hopper a whole extra 128-row tile of triton's extend
attention, which reads the turn's whole history again (a 128-token turn became 129: docs/performance.md).

So at sealing, where step k+1 is a plain decode step that holds the request and copied its row to
the host, that row is kept as the capture's last chunk, a view of step k+1's host block that is
ready once that step's copy is (``copy_done``). It goes into the capture's shared blocks only
(``share["blocks_end"]`` = rows + 1), never its file: the next turn's prefix then matches every
token the radix cache holds. Anywhere else (no overlap, a speculative or mixed step, a copy not
issued yet) there is no such row, and none is needed where SGLang did not count the token either.

What it costs: the view keeps that step's whole host block (one row per capture request of the
step) until the job's writer has read it, counted by the ledger as any prompt chunk's block is;
and the hand-off waits for that step's copy, so a capture's job leaves about one decode step later
(a client's capture, whose answer waits for its file, answers that much later).
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

from sglang_capture.server.batch_rows import BatchRows, ResultRows, RowsMismatch, wants_decode_row
from sglang_capture.server.request_capture import RequestCapture, RowChunk


class LaunchedStep:
    """The batch ``Scheduler.run_batch`` launched last and its result object (hooks/batch.py keeps
    it on the ``SchedulerCapture``), with where its requests' rows lie (``ResultRows``, over the
    request list as launched)."""

    __slots__ = ("rows", "result", "at")

    def __init__(self, rows: BatchRows, result: Any) -> None:
        self.rows = rows
        self.result = result
        self.at = ResultRows(rows.batch, rows)


KEPT = "kept"
# Why no row was kept, as ``answer_tail`` says it (counted in the stats' ``answer_tail``): no step was
# launched after the one being processed (overlap off, or an idle loop); the step launched was a
# prefill, a mixed batch or copies no rows; a verify pass; the step did not feed the last token (a
# prefill ran instead, the answer was cut short, a one-token request, no answer); the step holds
# no such request; its rows are not on the host yet (delayed sampling); FP8 rows not packed
WHY_NOT = ("no_later_step", "not_a_decode_step", "speculative", "token_not_fed", "not_in_step", "rows_not_on_host",
           "rows_mismatch", "fp8_not_packed")


def answer_tail(launched: Optional[LaunchedStep], processing: Optional[ResultRows], req: Any,
                capture: RequestCapture, n_prompt: int, n_out: int) -> Tuple[Optional[RowChunk], str]:
    """The row of ``req``'s last answer token (position ``n_prompt + n_out - 1``, one past its file's
    rows) in the step launched after the one whose result is being processed, and ``KEPT``; or None
    and which of ``WHY_NOT`` kept that step from computing it for a capture to take."""
    if launched is None or processing is None or launched.rows is processing.rows:
        return None, "no_later_step"
    rows = launched.rows
    mode = rows.mode
    if not rows.captures or mode is None or not mode.is_decode():
        return None, "not_a_decode_step"
    batch = rows.batch
    spec = getattr(batch, "spec_algorithm", None)
    if spec is not None and not spec.is_none():
        return None, "speculative"  # a verify pass: its rows are the draft's, and its radix keys are bigrams
    position = n_prompt + n_out - 1
    # the step counted the last token (and the radix cache took its KV); the answer was not cut short
    if n_out == 0 or n_out != len(req.output_ids) or _kv_committed(req) != position + 1 or not wants_decode_row(req):
        return None, "token_not_fed"
    offset = launched.at.index_of(req)
    if offset is None:
        return None, "not_in_step"
    result = launched.result
    done = getattr(result, "copy_done", None)
    out = getattr(result, "logits_output", None)
    hidden = getattr(out, "hidden_states", None)
    if done is None or hidden is None or hidden.device.type != "cpu":
        return None, "rows_not_on_host"  # no copy to the host was issued with the launch: none to wait on
    try:
        row = launched.at.row(hidden, offset, 1)
    except RowsMismatch:
        return None, "rows_mismatch"
    source = rows.packed if capture.is_fp8 and rows.packed is not None else hidden
    if capture.is_fp8 and source.element_size() != 1:
        return None, "fp8_not_packed"  # FP8 rows are packed on the device; this step's copy has them unpacked
    return RowChunk(position, source[row:row + 1], done), KEPT


def _kv_committed(req: Any) -> Optional[int]:
    """How many of ``req``'s tokens have their KV committed: a ``Req`` field in SGLang 0.5.17 and
    0.5.18, its ``kv`` record's from 0.5.19 (``alloc_for_decode`` counts a decode step's token there)."""
    committed = getattr(getattr(req, "kv", None), "kv_committed_len", None)
    return committed if committed is not None else getattr(req, "kv_committed_len", None)
