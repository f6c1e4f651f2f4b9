"""Row selection: which rows of a batch's hidden states are captured, and where each request's lie.

In a shared batch only the capture requests' rows are kept, so a request's rows no longer start
at its batch offset. Everything that decides or reads that lives here:

- ``capture_rows``: the kept row runs of a batch and each capture request's offset among them;
- ``gather_in_forward``: in an eager forward, the kept rows with the final hidden state beside
  them (called by ``append_final_hidden``, on the forward stream);
- ``BatchRows.keep_for_copy``: the same selection before the copy to the host, when the forward
  did not make it (CUDA graphs); ``fp8_readers``: whether that copy is packed as FP8;
- ``ResultRows``: where the row seams find a request's rows while the batch's result is processed;
- ``wants_decode_row``: whether a decode step's row of a request is used at all;
- ``fail_batch_captures``: a forward that could not give its rows fails the batch's captures.

The map from batch offsets to kept rows lives in a ``BatchRows`` object, never on the tensor:
SGLang does not keep tensor objects (under DP attention it re-slices the result into a new one).
A ``BatchRows`` is created when ``Scheduler.run_batch`` launches the batch, filled by the forward
or the copy, attached to the batch's result object (which SGLang passes unchanged from
``run_batch`` to ``process_batch_result``), and read through the ``ResultRows`` that the result
seam builds for the batch being processed.
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang_capture.server.aux_capture import AUX_ATTR
from sglang_capture.server.request_capture import CAPTURE_ATTR

Selection = Tuple[List[Tuple[int, int]], Dict[int, int]]  # kept row runs, batch offset -> kept offset
RESULT_ATTR = "_sglang_capture_batch"  # on a GenerationBatchResult: its BatchRows


class BatchRows:
    """What the capture path did to one launched batch's hidden states (scheduler thread)."""

    def __init__(self, batch: Any, captures: bool) -> None:
        self.batch = batch
        self.captures = captures
        # at launch: an EAGLE-3 worker's draft extend changes the batch's mode before the copy
        self.mode = batch.forward_mode if batch is not None else None
        self._selection: Optional[Tuple[int, Optional[Selection]]] = None
        self.row_map: Optional[Dict[int, int]] = None  # set once only capture rows are kept
        self.kept_rows: Optional[int] = None
        self.batch_rows: Optional[int] = None
        self.gathered_in_forward = False
        # FP8 captures in a batch that also needs the rows in the model's dtype: the same rows,
        # packed on the device before the copy, on the host (same row order as the hidden states)
        self.packed: Optional[Any] = None

    def selection(self, n_rows: int) -> Optional[Selection]:
        """The capture rows to keep out of ``n_rows`` (computed once; the forward and the copy ask)."""
        if self._selection is None or self._selection[0] != n_rows:
            self._selection = (n_rows, capture_rows(self.batch, n_rows, self.mode) if self.captures else None)
        return self._selection[1]

    def keep(self, selection: Selection, batch_rows: int, in_forward: bool) -> None:
        """Record that only ``selection``'s rows of the ``batch_rows`` rows are kept from now on."""
        runs, offsets = selection
        self.row_map = offsets
        self.kept_rows = sum(b - a for a, b in runs)
        self.batch_rows = batch_rows
        self.gathered_in_forward = in_forward

    def keep_for_copy(self, hidden: torch.Tensor) -> torch.Tensor:
        """The rows of ``hidden`` the copy to the host takes: only the capture rows when the forward
        did not select them already and that is safe, else ``hidden`` as it is."""
        if self.row_map is not None:
            return hidden
        n_rows = hidden.shape[0]
        selected = self.selection(n_rows)
        if selected is None:
            return hidden
        runs, _ = selected
        parts = [hidden[a:b] for a, b in runs]
        self.keep(selected, n_rows, in_forward=False)
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def attach(self, result: Any) -> None:
        """Hang this on the batch's result object, where ``batch_result_context`` finds it."""
        if result is not None:
            setattr(result, RESULT_ATTR, self)


class RowsMismatch(RuntimeError):
    """The hidden states handed to a row seam are not the rows this batch's state describes."""


class ResultRows:
    """The batch whose result is being processed: its snapshot and its row map."""

    def __init__(self, batch: Any, rows: Optional[BatchRows]) -> None:
        self.batch = batch  # the snapshot SGLang took at launch (its prefix_lens are each chunk's start)
        self.rows = rows
        self.reqs = getattr(batch, "reqs", ())  # the list as made now: SGLang rebinds a batch's list, never edits it
        self._index: Optional[Dict[int, int]] = None

    @classmethod
    def of(cls, batch: Any, result: Any) -> ResultRows:
        return cls(batch, getattr(result, RESULT_ATTR, None))

    def index_of(self, req: Any) -> Optional[int]:
        """``req``'s place in the batch (a decode step's row offset), or None when it is not in it."""
        if self._index is None:
            self._index = {id(r): i for i, r in enumerate(self.reqs)}
        return self._index.get(id(req))

    def chunk_start(self, req: Any) -> int:
        """Absolute position of ``req``'s first row in this prefill batch."""
        return self.batch.prefix_lens[self.index_of(req)]

    def source(self, hidden: Any, capture: Any) -> Any:
        """The host rows ``capture`` takes: the packed copy for an FP8 capture where there is one."""
        if capture.fp8_block is not None and self.rows is not None and self.rows.packed is not None:  # is_fp8, on the hot path
            return self.rows.packed
        return hidden

    def row(self, hidden: Any, offset: int, n: int) -> int:
        """Where the ``n`` rows at batch offset ``offset`` lie in ``hidden``; checks that they are there."""
        kept = self.rows is not None and self.rows.row_map is not None
        if kept:
            if offset not in self.rows.row_map or hidden.shape[0] != self.rows.kept_rows:
                raise RowsMismatch(f"kept rows do not match: offset {offset}, {hidden.shape[0]} rows handed, "
                                   f"{self.rows.kept_rows} kept")
            offset = self.rows.row_map[offset]
        if offset + n > hidden.shape[0]:
            raise RowsMismatch(f"rows {offset}-{offset + n - 1} asked of {hidden.shape[0]}")
        return offset


def capture_rows(batch: Any, n_rows: int, mode: Any = None) -> Optional[Selection]:
    """The row ranges of the batch's capture requests and each one's offset among them, or None
    when the whole batch must be copied: every row is captured, another request wants SGLang's
    hidden states, or the batch's row layout is not the one the result processor assumes.
    ``mode``: the batch's forward mode when it was launched (default: its mode now)."""
    if batch is None:
        return None
    reqs, mode = batch.reqs, mode if mode is not None else batch.forward_mode
    if all(getattr(req, CAPTURE_ATTR, None) is not None for req in reqs):
        return None  # every row is captured (every request capturing: a pass over the batch, not a map of it)
    if mode.is_decode():
        # one row per request; under EAGLE-3, one per draft token of each request's verify pass
        spec = getattr(batch, "spec_algorithm", None)
        per = n_rows // len(reqs) if spec is not None and not spec.is_none() and reqs and n_rows % len(reqs) == 0 else 1
        lens: List[int] = [per] * len(reqs)
    elif mode.is_extend() and not mode.is_mixed():
        lens = _extend_lens(batch)
    else:
        return None
    if len(lens) != len(reqs) or sum(lens) != n_rows:
        return None
    runs: List[Tuple[int, int]] = []
    offsets: Dict[int, int] = {}
    pos = kept = 0
    for req, n in zip(reqs, lens, strict=False):
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


def wants_decode_row(req: Any) -> bool:
    """Whether ``req`` uses the hidden state a decode step computes for it.

    A capture request limited to one new token (``sglang_capture extract`` sends only those)
    never does: its file holds the prompt's rows, and its one token is sampled by the prefill.
    SGLang 0.5.17's overlap scheduler still puts it into the next decode batch, launched before
    the prefill's result says the request finished (0.5.23 does not); that batch would copy its
    row to the host and hand it to the result seams for nothing (+0.5 ms of the scheduler thread
    per capture on the H200, bench/RESULTS.md). Nor is that row kept for a next turn
    (answer_tail.py): such a request has none.
    """
    if not req.return_hidden_states:
        return False
    return not (getattr(req, AUX_ATTR, False) and req.sampling_params.max_new_tokens == 1)


def fail_batch_captures(rows: Optional[BatchRows], why: str) -> None:
    """Fail every capture request of the batch being launched (on the writer rank; other ranks' marks are unused)."""
    for req in getattr(getattr(rows, "batch", None), "reqs", None) or ():
        capture = getattr(req, CAPTURE_ATTR, None)
        if capture is not None:
            capture.fail(why)


def gather_in_forward(rows: Optional[BatchRows], aux: torch.Tensor, *finals: torch.Tensor) -> Optional[torch.Tensor]:
    """The captured rows of ``aux`` (aux columns) and of each of ``finals`` (the final states)
    side by side, or None when the whole batch must be kept (CUDA graph capture, no running batch,
    no compaction possible).

    Runs inside the forward, on the forward stream, so the result is ready when SGLang's copy
    stream (which waits for the forward) reads it: only the captured rows are ever concatenated,
    instead of a [batch tokens, (layers + 1) x hidden] tensor (940 MB for a 16,384-token batch at
    Kimi width) built and gathered from afterwards. What was kept is recorded in ``rows``."""
    n_rows = finals[0].shape[0]
    if rows is None or any(t.shape[0] != n_rows for t in (aux, *finals)) or \
            (aux.is_cuda and torch.cuda.is_current_stream_capturing()):
        return None
    selected = rows.selection(n_rows)
    if selected is None:
        return None
    runs, _ = selected
    sources = (aux, *finals)
    out = aux.new_empty((sum(b - a for a, b in runs), sum(t.shape[-1] for t in sources)))
    at = 0
    for a, b in runs:
        col = 0
        for t in sources:
            out[at:at + b - a, col:col + t.shape[-1]].copy_(t[a:b])
            col += t.shape[-1]
        at += b - a
    rows.keep(selected, n_rows, in_forward=True)
    return out


def fp8_readers(batch: Any) -> Tuple[bool, bool]:
    """(any FP8 capture reads this batch's hidden states, every reader is one). When all are, the
    whole copy is packed; when some are, a packed copy goes beside the model-dtype one (an SGLang
    JSON request or a capture in the model's dtype needs the rows as they are)."""
    if batch is None:
        return False, False
    any_fp8, every_fp8 = False, True
    for req in batch.reqs:  # once per launched batch: one pass, no lists
        if req.return_hidden_states:
            capture = getattr(req, CAPTURE_ATTR, None)
            if capture is not None and capture.is_fp8:
                any_fp8 = True
            else:
                every_fp8 = False
    return any_fp8, any_fp8 and every_fp8
