"""Loss masks: which prompt tokens a drafter is trained on, carried as spans.

A request names its trained positions as half-open ``[start, end)`` spans over the prompt
(``custom_params.capture_loss_mask``); spans are small on the wire whatever the prompt length,
and the file stores the expanded int64 mask next to ``input_ids``.
"""
from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import numpy

Span = Tuple[int, int]


class BadLossMask(ValueError):
    """A ``capture_loss_mask`` that cannot apply to the prompt; the message is one line."""


def parse_spans(value: Any, n_tokens: int) -> List[Span]:
    """Validate spans from a request: sorted, non-overlapping, inside ``[0, n_tokens)``."""
    if not isinstance(value, list) or not all(
            isinstance(s, (list, tuple)) and len(s) == 2 and all(type(x) is int for x in s) for s in value):
        raise BadLossMask("custom_params.capture_loss_mask must be a list of [start, end) integer pairs")
    spans: List[Span] = [(int(a), int(b)) for a, b in value]
    prev_end = 0
    for a, b in spans:
        if not (prev_end <= a < b <= n_tokens):
            raise BadLossMask(
                f"custom_params.capture_loss_mask span [{a}, {b}) is empty, unsorted, overlapping or outside "
                f"the {n_tokens}-token prompt")
        prev_end = b
    return spans


def mask_from_spans(spans: Sequence[Span], n_tokens: int) -> numpy.ndarray:
    """The int64 0/1 mask of length ``n_tokens`` (SpecForge's ``loss_mask`` dtype)."""
    mask = numpy.zeros(n_tokens, dtype=numpy.int64)
    for a, b in spans:
        mask[a:b] = 1
    return mask


def spans_from_mask(mask: Sequence[int]) -> List[Span]:
    """The shortest span list of a 0/1 mask (inverse of ``mask_from_spans``)."""
    spans: List[Span] = []
    start = None
    for i, m in enumerate(list(mask) + [0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans
