"""Assembly in a writer process: a request's ``(position, rows)`` chunks into one array per tensor.

The scheduler only hands over the chunks as they arrived (server/request_capture.py); ordering,
overlap resolution and the completeness check happen here, with numpy only.
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import numpy

from sglang_capture.core.format import HostTensor


class IncompleteCapture(RuntimeError):
    """Some positions of the request never received a row: the file would be wrong, so none is written."""


def _gaps(spans: List[Tuple[int, int]], n_rows: int, first: int = 0) -> List[Tuple[int, int]]:
    """The inclusive position ranges in ``[first, n_rows)`` that no ``[start, end)`` span covers."""
    gaps: List[Tuple[int, int]] = []
    reached = first
    for start, end in sorted(spans):
        if start > reached:
            gaps.append((reached, start - 1))
        reached = max(reached, end)
    if reached < n_rows:
        gaps.append((reached, n_rows - 1))
    return gaps


def assemble_rows(chunks: List[Tuple[int, HostTensor]], n_rows: int,
                  stored: Dict[str, Tuple[int, int]], first: int = 0) -> Dict[str, HostTensor]:
    """Place every ``(start, rows)`` chunk by position into fresh arrays, one per column range
    in ``stored``, for positions ``[first, n_rows)`` (``first``: the rows before it lie in shared
    blocks, writer/blocks.py).

    Later chunks overwrite earlier ones (re-prefill after retraction), rows past ``n_rows`` are
    dropped (the step that sampled the last token also computed rows nobody fed back), and a
    position left uncovered raises IncompleteCapture. One copy per chunk and column range; once
    this returns, nothing reads the chunks' memory any more.
    """
    if not chunks:
        if n_rows > first:
            raise IncompleteCapture(f"no rows were captured for {n_rows - first} positions")
        return {name: HostTensor("float32", numpy.empty((0, hi - lo), dtype=numpy.float32))
                for name, (lo, hi) in stored.items()}
    dtype = chunks[0][1].dtype
    out = {name: numpy.empty((n_rows - first, hi - lo), dtype=chunks[0][1].array.dtype)
           for name, (lo, hi) in stored.items()}
    spans: List[Tuple[int, int]] = []
    for start, rows in chunks:
        skip = max(first - start, 0)
        end = min(start + rows.array.shape[0], n_rows)
        if end <= start + skip:
            continue
        taken = rows.array[skip: end - start]
        for name, (lo, hi) in stored.items():
            out[name][start + skip - first:end - first] = taken[:, lo:hi]
        spans.append((start + skip, end))
    gaps = _gaps(spans, n_rows, first)
    if gaps:
        where = ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in gaps[:8])
        raise IncompleteCapture(f"rows missing at positions {where} of {n_rows}")
    return {name: HostTensor(dtype, arr) for name, arr in out.items()}


def relabel(tensors: Dict[str, HostTensor], dtypes: Dict[str, str]) -> Dict[str, HostTensor]:
    """Give assembled byte columns the dtype the file stores them as (``--capture-dtype fp8``: the
    rows arrive packed as uint8, core/fp8.py); tensors not named in ``dtypes`` are kept as they are."""
    out = dict(tensors)
    for name, dtype in dtypes.items():
        src = tensors[name].array
        raw = src if src.dtype == numpy.uint8 else numpy.empty(src.shape, dtype=numpy.uint8)  # empty: no rows came
        out[name] = HostTensor(dtype, raw.view(numpy.float32) if dtype == "float32" else raw)
    return out
