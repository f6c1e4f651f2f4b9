"""The FP8 packing formula applied to a whole batch at once, as ``core/fp8.pack`` did before it
worked in row chunks: the reference that the tests (bytes) and the GPU check of r47 (device memory;
bench/RESULTS.md) compare ``pack`` against."""
from __future__ import annotations

import torch

from sglang_capture.core.fp8 import E4M3_MAX


def whole_batch_pack(x: torch.Tensor, block: int) -> torch.Tensor:
    """``x`` packed as ``core/fp8.pack`` packs it, with three float32 copies of the batch alive."""
    rows, width = x.shape
    blocks = x.reshape(rows, width // block, block).float()
    scales = blocks.abs().amax(dim=-1) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return torch.cat([q.reshape(rows, width).view(torch.uint8), scales.view(torch.uint8)], dim=-1)
