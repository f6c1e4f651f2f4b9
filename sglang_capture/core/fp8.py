"""FP8 storage (``--capture-dtype fp8``): e4m3 values with one float32 scale per token per block.

A block is one hidden-state vector of width H: each aux layer's slice of a row, and the final
hidden state. Its scale is its largest magnitude over e4m3's largest finite value (448), so the
largest element is stored exactly at the top of the range and every element with a relative
error of at most 2**-4 (three mantissa bits, round to nearest), plus at most ``scale * 2**-10``
for values that land among e4m3's subnormals. Half the bytes of bf16 before compression.

On the server the rows are quantized on the device before they are copied to the host, so the
device-to-host bytes halve too. They then travel *packed*: one uint8 row per token holding the
e4m3 bytes of every block followed by the blocks' float32 scales, so that a batch's captured rows
remain one tensor whose rows are tokens (the pool, the row seams and the writer's assembly handle
it like any other). ``packed_splits`` says where each stored tensor lies in such a row.
torch is imported only where a tensor is quantized or restored: the writer processes never load it.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, Tuple

if TYPE_CHECKING:
    import torch

FP8_DTYPE = "float8_e4m3fn"
E4M3_MAX = 448.0
SCALE_SUFFIX = "_scale"
CAPTURE_DTYPES = ("model", "fp8")  # --capture-dtype: the model's serving dtype, or FP8


def quantize(x: "torch.Tensor", block: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``x`` [rows, k * block] as (e4m3 [rows, k * block], float32 scales [rows, k])."""
    import torch

    rows, width = x.shape
    if width % block:
        raise ValueError(f"row width {width} is not a multiple of the block {block}")
    blocks = x.reshape(rows, width // block, block).float()
    scales = blocks.abs().amax(dim=-1) / E4M3_MAX
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))  # an all-zero block stays zero
    q = (blocks / scales.unsqueeze(-1)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q.reshape(rows, width), scales


def dequantize(q: "torch.Tensor", scales: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The inverse of ``quantize``, in ``dtype``."""
    rows, width = q.shape
    k = scales.shape[-1]
    blocks = q.float().reshape(rows, k, width // k if k else 0) * scales.float().unsqueeze(-1)
    return blocks.reshape(rows, width).to(dtype)


def pack(x: "torch.Tensor", block: int) -> "torch.Tensor":
    """``x`` quantized and packed into uint8 rows: e4m3 bytes of every block, then their scales."""
    import torch

    q, scales = quantize(x, block)
    return torch.cat([q.view(torch.uint8), scales.contiguous().view(torch.uint8)], dim=-1)


def packed_splits(splits: Dict[str, Tuple[int, int]], block: int, width: int
                  ) -> Tuple[Dict[str, Tuple[int, int]], Dict[str, str]]:
    """Where each stored tensor lies in a packed row of a ``width``-element row, and the dtype the
    file stores it as. ``splits`` are element column ranges of the unpacked row (multiples of
    ``block``); each becomes its e4m3 byte range plus a ``<name>_scale`` range of float32 bytes."""
    out: Dict[str, Tuple[int, int]] = {}
    dtypes: Dict[str, str] = {}
    for name, (lo, hi) in splits.items():
        out[name] = (lo, hi)
        out[name + SCALE_SUFFIX] = (width + 4 * (lo // block), width + 4 * (hi // block))
        dtypes[name], dtypes[name + SCALE_SUFFIX] = FP8_DTYPE, "float32"
    return out, dtypes
