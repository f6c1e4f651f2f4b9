"""Result-copy seams: only capture requests' rows go to the host, into the package's host pool.

SGLang's ``copy_to_cpu`` copies a batch's hidden states whole into a fresh pinned buffer
(``host_pool`` says why that stalls the scheduler under capture). In full-capture mode that is
every token of the batch, including those of requests that capture nothing: beside live traffic
a capture request shares its prefill batch with several others, and the copy then moved ~8x the
captured bytes while the scheduler thread waited for it (bench/RESULTS.md, fifth round). Here the
rows of the batch's capture requests are gathered on the device and queued into a pool block on
the same stream; SGLang then copies the rest of the result (token ids, logprobs) as usual. The
block's tensor carries the map from each request's row offset in the batch to its offset in the
block, which the row seams (results.py) read. When no compaction is safe (another request wants
SGLang's own hidden states) the whole batch is copied; when the pool is full, or in a process
without one, SGLang's copy runs.

In an eager forward the rows are gathered earlier, where the final hidden state joins the aux
layers (``gather_in_forward``, called by hooks/model.py): then only the captured rows are ever
concatenated, instead of a [batch tokens, (layers + 1) x hidden] tensor (940 MB for a
16,384-token batch at Kimi width) built on the forward stream and gathered from afterwards.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from sglang_capture.sidecar import CAPTURE_ATTR, get_sidecar

ROW_MAP_ATTR = "_sglang_capture_rows"  # on a host tensor: batch row offset -> row offset in it
GATHERED_ATTR = "_sglang_capture_gathered"  # on a device tensor gathered in the forward: (batch rows, ROW_MAP)

Selection = Tuple[List[Tuple[int, int]], Dict[int, int]]
_running: Dict[str, Any] = {"batch": None, "selection": None}


@contextlib.contextmanager
def running(batch: Any) -> Iterator[None]:
    """While ``Scheduler.run_batch`` runs ``batch``: the batch whose result ``copy_to_cpu`` copies."""
    _running["batch"], _running["selection"] = batch, None
    try:
        yield
    finally:
        _running["batch"], _running["selection"] = None, None


def _selection(n_rows: int) -> Optional[Selection]:
    """``capture_rows`` of the running batch, computed once per batch (the forward and the copy ask)."""
    cached = _running["selection"]
    if cached is None or cached[0] != n_rows:
        cached = (n_rows, capture_rows(_running["batch"], n_rows))
        _running["selection"] = cached
    return cached[1]


def gather_in_forward(stored: torch.Tensor, final: torch.Tensor) -> Optional[torch.Tensor]:
    """The captured rows of ``stored`` (aux columns) and ``final`` side by side, or None when the
    whole batch must be kept (CUDA graph capture, no running batch, no compaction possible).

    Runs inside the forward, on the forward stream, so the result is ready when SGLang's copy
    stream (which waits for the forward) reads it."""
    n_rows = final.shape[0]
    if stored.shape[0] != n_rows or (final.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    selected = _selection(n_rows)
    if selected is None:
        return None
    runs, offsets = selected
    width = stored.shape[-1]
    out = stored.new_empty((sum(b - a for a, b in runs), width + final.shape[-1]))
    at = 0
    for a, b in runs:
        out[at:at + b - a, :width].copy_(stored[a:b])
        out[at:at + b - a, width:].copy_(final[a:b])
        at += b - a
    setattr(out, GATHERED_ATTR, (n_rows, offsets))
    return out


def capture_rows(batch: Any, n_rows: int) -> Optional[Selection]:
    """The row ranges of the batch's capture requests and each one's offset among them, or None
    when the whole batch must be copied: every row is captured, another request wants SGLang's
    hidden states, or the batch's row layout is not the one the result processor assumes."""
    if batch is None:
        return None
    reqs, mode = batch.reqs, batch.forward_mode
    if mode.is_decode():
        lens: List[int] = [1] * len(reqs)
    elif mode.is_extend() and not mode.is_mixed():
        lens = _extend_lens(batch)
    else:
        return None
    if len(lens) != len(reqs) or sum(lens) != n_rows:
        return None
    runs: List[Tuple[int, int]] = []
    offsets: Dict[int, int] = {}
    pos = kept = 0
    for req, n in zip(reqs, lens):
        if getattr(req, CAPTURE_ATTR, None) is not None:
            offsets[pos] = kept
            kept += n
            if runs and runs[-1][1] == pos:
                runs[-1] = (runs[-1][0], pos + n)
            else:
                runs.append((pos, pos + n))
        elif req.return_hidden_states:
            return None
        pos += n
    if kept == n_rows or not runs:
        return None
    return runs, offsets


def _extend_lens(batch: Any) -> List[int]:
    """Rows per request of an extend batch, computed as SGLang computes the offsets it later
    hands to the row seams (0.5.17 from each Req's extend range, 0.5.23 from the batch)."""
    if batch.reqs and hasattr(batch.reqs[0], "extend_range"):
        return [r.extend_range.length if r.extend_range is not None else 0 for r in batch.reqs]
    return list(batch.extend_lens)


def _bind(return_logprob: bool, return_hidden_states: bool = True) -> tuple:
    return return_logprob, return_hidden_states


def copy_hidden_to_pool(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``GenerationBatchResult.copy_to_cpu`` (scheduler thread, on SGLang's copy stream)."""
    return_logprob, return_hidden = _bind(*args, **kwargs)
    out = instance.logits_output
    if not return_hidden or out is None or out.hidden_states is None:
        return wrapped(*args, **kwargs)
    return get_sidecar().clock.timed("copy_to_cpu", True, lambda: _copy_hidden(wrapped, out, return_logprob, args, kwargs))


def _copy_hidden(wrapped: Any, out: Any, return_logprob: bool, args: tuple, kwargs: dict) -> Any:
    sidecar = get_sidecar()
    pool = sidecar.pool
    hidden = out.hidden_states
    gathered = getattr(hidden, GATHERED_ATTR, None)
    if pool is None and gathered is None:
        return wrapped(*args, **kwargs)
    if gathered is not None:
        batch_rows, offsets = gathered
        src = hidden
    else:
        batch_rows, offsets, src = hidden.shape[0], None, hidden
        selected = _selection(batch_rows)
        if selected is not None:
            runs, offsets = selected
            parts = [hidden[a:b] for a, b in runs]
            src = parts[0] if len(parts) == 1 else torch.cat(parts)
    host = pool.take(src) if pool is not None else None
    if host is None:
        result = wrapped(*args, **kwargs)
        if gathered is not None:  # SGLang's copy of the gathered rows: the row seams need the map
            setattr(out.hidden_states, ROW_MAP_ATTR, offsets)
        return result
    if offsets is not None:
        setattr(host, ROW_MAP_ATTR, offsets)
    sidecar.count_copy(batch_rows, src.shape[0], in_forward=gathered is not None)
    out.hidden_states = host
    return wrapped(return_logprob, return_hidden_states=False)


def block_row(hidden: Any, offset: int) -> int:
    """Where the rows at batch offset ``offset`` lie in ``hidden`` (a compacted block, or not)."""
    rows = getattr(hidden, ROW_MAP_ATTR, None)
    return offset if rows is None else rows[offset]
