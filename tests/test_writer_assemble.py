"""Assembly of rows by position in a writer process (writer/assemble.py)."""
from __future__ import annotations

import pytest
import torch

from sglang_capture.core.format import host_tensor
from sglang_capture.writer.assemble import IncompleteCapture, assemble_rows
from tests.jobs import as_torch


def test_rows_are_placed_by_position_later_rows_win():
    a = torch.arange(0, 12, dtype=torch.float32).view(4, 3)      # positions 0..3
    b = torch.full((3, 3), -1.0)                                    # positions 2..4 (re-prefill)
    c = torch.full((2, 3), 7.0)                                     # positions 5..6, one past the end
    out = {k: as_torch(v) for k, v in
           assemble_rows([(0, host_tensor(a)), (2, host_tensor(b)), (5, host_tensor(c))], 6, {"x": (0, 2), "y": (2, 3)}).items()}
    assert out["x"].shape == (6, 2) and out["y"].shape == (6, 1)
    assert torch.equal(out["x"][:2], a[:2, :2]) and (out["x"][2:5] == -1).all() and (out["x"][5] == 7).all()


def test_bf16_rows_keep_their_exact_bits_through_assembly():
    rows = torch.randn(5, 6).to(torch.bfloat16)
    out = assemble_rows([(0, host_tensor(rows))], 5, {"aux": (0, 4), "final": (4, 6)})
    assert out["aux"].dtype == "bfloat16" and as_torch(out["aux"]).dtype == torch.bfloat16
    assert torch.equal(as_torch(out["aux"]).view(torch.int16), rows[:, :4].view(torch.int16))
    assert torch.equal(as_torch(out["final"]).view(torch.int16), rows[:, 4:].view(torch.int16))


def test_missing_rows_fail_the_capture():
    with pytest.raises(IncompleteCapture, match="positions 2-3"):
        assemble_rows([(0, host_tensor(torch.zeros(2, 3))), (4, host_tensor(torch.zeros(1, 3)))], 5, {"x": (0, 3)})
