"""Loss-mask spans (core/loss_mask.py)."""
from __future__ import annotations

import pytest


def test_loss_mask_spans_round_trip_and_reject_bad_spans():
    from sglang_capture.core.loss_mask import BadLossMask, mask_from_spans, parse_spans, spans_from_mask

    mask = [0, 1, 1, 0, 0, 1, 0, 1]
    spans = spans_from_mask(mask)
    assert spans == [(1, 3), (5, 6), (7, 8)]
    assert mask_from_spans(parse_spans([list(s) for s in spans], 8), 8).tolist() == mask
    for bad in ([[3, 1]], [[0, 9]], [[2, 4], [3, 5]], [[1, 1]], "0-3", [[0, 1.5]], [[True, 2]]):
        with pytest.raises(BadLossMask):
            parse_spans(bad, 8)
