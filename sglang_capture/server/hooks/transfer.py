"""``copy_hidden_to_pool``: only capture requests' rows go to the host, into the package's host pool.

SGLang's ``copy_to_cpu`` copies a batch's hidden states whole into a fresh pinned buffer
(``host_pool`` says why that stalls the scheduler under capture). In full-capture mode that is
every token of the batch, including those of requests that capture nothing: beside live traffic
a capture request shares its prefill batch with several others, and the copy then moved ~8x the
captured bytes while the scheduler thread waited for it (bench/RESULTS.md). Here the rows the
batch's ``BatchRows`` selects (batch_rows.py, unless the forward selected them already) are
queued into a pool block on the same stream; SGLang then copies the rest of the result (token
ids, logprobs) as usual. When the pool is full, or in a process without one, SGLang's copy runs
(of the kept rows). FP8 captures are packed here, on the device, before the copy: the whole copy
when every reader is one, else a packed copy of the same rows beside the model-dtype one
(``BatchRows.packed``), so that no FP8 row is packed on the host, on the scheduler thread
(``result_copy`` counts both ways).
"""
from __future__ import annotations

from typing import Any

from sglang_capture.core.fp8 import pack
from sglang_capture.server.batch_rows import RESULT_ATTR, BatchRows, fp8_readers
from sglang_capture.server.host_pool import read_on_current_stream
from sglang_capture.server.scheduler_capture import SchedulerCapture


def _bind(return_logprob: bool, return_hidden_states: bool = True) -> tuple:
    return return_logprob, return_hidden_states


def copy_hidden_to_pool(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``GenerationBatchResult.copy_to_cpu`` (scheduler thread, on the stream SGLang copies
    results on: its copy stream, or with 0.5.17's delayed sampling the forward stream itself).

    Usually called inside ``run_batch``; with delayed sampling (grammars) after it, which is why
    the batch's rows are looked up on the result first."""
    return_logprob, return_hidden = _bind(*args, **kwargs)
    out = instance.logits_output
    rows = getattr(instance, RESULT_ATTR, None) or state.launching
    if not return_hidden or out is None or out.hidden_states is None or rows is None:
        # timed too: a capture batch's account holds SGLang's own copies of the rest of the result
        return state.clock.timed("copy_to_cpu", False, lambda: wrapped(*args, **kwargs))
    rows.attach(instance)
    return state.clock.timed("copy_to_cpu", True, lambda: _copy_hidden(state, wrapped, out, rows, return_logprob, args, kwargs))


def _copy_hidden(state: SchedulerCapture, wrapped: Any, out: Any, rows: BatchRows, return_logprob: bool, args: tuple, kwargs: dict) -> Any:
    pool = state.pool
    hidden = out.hidden_states
    read_on_current_stream(hidden)  # the gather and the FP8 pack below read it here, then drop it
    out.hidden_states = hidden = rows.keep_for_copy(hidden)
    any_fp8, all_fp8 = fp8_readers(rows.batch) if state.model is not None else (False, False)
    if all_fp8:
        # Quantized before the copy: half the device-to-host bytes (core/fp8.py says how rows are packed).
        out.hidden_states = hidden = pack(hidden, state.model.hidden_size)
    elif any_fp8 and pool is not None:
        # Packed on the device too, never on the scheduler thread; copied beside the rows as they are.
        rows.packed = pool.take(pack(hidden, state.model.hidden_size))
    host = pool.take(hidden) if pool is not None else None
    if host is None:  # no pool, or the pool is full: SGLang's own copy, of the kept rows
        return wrapped(*args, **kwargs)
    state.copies.count_copy(rows.batch_rows or hidden.shape[0], hidden.shape[0], in_forward=rows.gathered_in_forward)
    if all_fp8 or rows.packed is not None:
        state.copies.fp8_packed_before_copy_rows += hidden.shape[0]
    out.hidden_states = host
    return wrapped(return_logprob, return_hidden_states=False)
