"""Result-copy seams: only capture requests' rows go to the host, into the package's host pool.

SGLang's ``copy_to_cpu`` copies a batch's hidden states whole into a fresh pinned buffer
(``host_pool`` says why that stalls the scheduler under capture). In full-capture mode that is
every token of the batch, including those of requests that capture nothing: beside live traffic
a capture request shares its prefill batch with several others, and the copy then moved ~8x the
captured bytes while the scheduler thread waited for it (bench/RESULTS.md, "Design choices"). Here the
rows of the batch's capture requests are gathered on the device and queued into a pool block on
the same stream; SGLang then copies the rest of the result (token ids, logprobs) as usual. The
batch's ``BatchRows`` records the map from each request's row offset in the batch to its offset
among the kept rows, which the row seams (results.py) read. When no compaction is safe (another
request wants SGLang's own hidden states) the whole batch is copied; when the pool is full, or
in a process without one, SGLang's copy runs (of the kept rows). FP8 captures are packed here,
on the device, before the copy: the whole copy when every reader is one, else a packed copy of
the same rows beside the model-dtype one (``BatchRows.packed``), so that no FP8 row is packed on
the host, on the scheduler thread (``result_copy`` counts both ways).

In an eager forward the rows are gathered earlier, where the final hidden state joins the aux
layers (``gather_in_forward``, called by hooks/model.py): then only the captured rows are ever
concatenated, instead of a [batch tokens, (layers + 1) x hidden] tensor (940 MB for a
16,384-token batch at Kimi width) built on the forward stream and gathered from afterwards.
"""
from __future__ import annotations

from typing import Any, Optional, Tuple

import torch

from sglang_capture.core.fp8 import pack
from sglang_capture.server.batch_rows import RESULT_ATTR, BatchRows
from sglang_capture.server.host_pool import read_on_current_stream
from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, SchedulerCapture


def gather_in_forward(state: SchedulerCapture, stored: torch.Tensor, final: torch.Tensor) -> Optional[torch.Tensor]:
    """The captured rows of ``stored`` (aux columns) and ``final`` side by side, or None when the
    whole batch must be kept (CUDA graph capture, no running batch, no compaction possible).

    Runs inside the forward, on the forward stream, so the result is ready when SGLang's copy
    stream (which waits for the forward) reads it. What was kept is recorded in the running
    batch's ``BatchRows``, not on the tensor (batch_rows.py says why)."""
    rows = state.launching
    n_rows = final.shape[0]
    if rows is None or stored.shape[0] != n_rows or (final.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    selected = rows.selection(n_rows)
    if selected is None:
        return None
    runs, _ = selected
    width = stored.shape[-1]
    out = stored.new_empty((sum(b - a for a, b in runs), width + final.shape[-1]))
    at = 0
    for a, b in runs:
        out[at:at + b - a, :width].copy_(stored[a:b])
        out[at:at + b - a, width:].copy_(final[a:b])
        at += b - a
    rows.keep(selected, n_rows, in_forward=True)
    return out


def _fp8_readers(batch: Any) -> Tuple[bool, bool]:
    """(any FP8 capture reads this batch's hidden states, every reader is one). When all are, the
    whole copy is packed; when some are, a packed copy goes beside the model-dtype one (an SGLang
    JSON request or a capture in the model's dtype needs the rows as they are)."""
    if batch is None:
        return False, False
    readers = [getattr(req, CAPTURE_ATTR, None) if req.return_hidden_states else False for req in batch.reqs]
    fp8 = [c is not None and c is not False and c.fp8_block is not None for c in readers]
    return any(fp8), any(fp8) and all(f or c is False for f, c in zip(fp8, readers, strict=True))


def _bind(return_logprob: bool, return_hidden_states: bool = True) -> tuple:
    return return_logprob, return_hidden_states


def copy_hidden_to_pool(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``GenerationBatchResult.copy_to_cpu`` (scheduler thread, on the stream SGLang copies
    results on: its copy stream, or with 0.5.17's delayed sampling the forward stream itself).

    Usually called inside ``run_batch``; with delayed sampling (grammars) after it, which is why
    the batch's state is looked up on the result first."""
    return_logprob, return_hidden = _bind(*args, **kwargs)
    out = instance.logits_output
    if not return_hidden or out is None or out.hidden_states is None:
        return wrapped(*args, **kwargs)
    rows = getattr(instance, RESULT_ATTR, None) or state.launching
    if rows is None:
        return wrapped(*args, **kwargs)
    rows.attach(instance)
    return state.clock.timed("copy_to_cpu", True, lambda: _copy_hidden(state, wrapped, out, rows, return_logprob, args, kwargs))


def _copy_hidden(state: SchedulerCapture, wrapped: Any, out: Any, rows: BatchRows, return_logprob: bool, args: tuple, kwargs: dict) -> Any:
    pool = state.pool
    hidden = out.hidden_states
    read_on_current_stream(hidden)  # the gather and the FP8 pack below read it here, then drop it
    if rows.row_map is None:  # not gathered in the forward: keep only the capture rows now, if that is safe
        batch_rows = hidden.shape[0]
        selected = rows.selection(batch_rows)
        if selected is not None:
            runs, _ = selected
            parts = [hidden[a:b] for a, b in runs]
            out.hidden_states = hidden = parts[0] if len(parts) == 1 else torch.cat(parts)
            rows.keep(selected, batch_rows, in_forward=False)
    any_fp8, all_fp8 = _fp8_readers(rows.batch) if state.model is not None else (False, False)
    if all_fp8:
        # Quantized before the copy: half the device-to-host bytes (core/fp8.py says how rows are packed).
        out.hidden_states = hidden = pack(hidden, state.model.hidden_size)
    elif any_fp8 and pool is not None:
        # Packed on the device too, never on the scheduler thread; copied beside the rows as they are.
        rows.packed = pool.take(pack(hidden, state.model.hidden_size))
    host = pool.take(hidden) if pool is not None else None
    if host is None:  # no pool, or the pool is full: SGLang's own copy, of the kept rows
        return wrapped(*args, **kwargs)
    state.count_copy(rows.batch_rows or hidden.shape[0], hidden.shape[0], in_forward=rows.gathered_in_forward)
    if all_fp8 or rows.packed is not None:
        state.copies["fp8_packed_before_copy_rows"] += hidden.shape[0]
    out.hidden_states = host
    return wrapped(return_logprob, return_hidden_states=False)
