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
it like any other). ``packed_layout`` says where each stored tensor lies in such a row.
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


# Float32 working memory of one row chunk in ``pack``: a whole batch at once took three float32
# copies of it (a [16384, 28672] bf16 batch: 4.81 GiB more device memory, bench/RESULTS.md r47).
PACK_CHUNK_BYTES = 128 << 20


def quantize(x: "torch.Tensor", block: int) -> Tuple["torch.Tensor", "torch.Tensor"]:
    """``x`` [rows, k * block] as (e4m3 [rows, k * block], float32 scales [rows, k])."""
    import torch

    width = x.shape[1]
    packed = pack(x, block)
    return packed[:, :width].contiguous().view(torch.float8_e4m3fn), packed[:, width:].contiguous().view(torch.float32)


def dequantize(q: "torch.Tensor", scales: "torch.Tensor", dtype: "torch.dtype") -> "torch.Tensor":
    """The inverse of ``quantize``, in ``dtype``."""
    rows, width = q.shape
    k = scales.shape[-1]
    blocks = q.float().reshape(rows, k, width // k if k else 0) * scales.float().unsqueeze(-1)
    return blocks.reshape(rows, width).to(dtype)


def pack(x: "torch.Tensor", block: int, chunk_bytes: int = PACK_CHUNK_BYTES) -> "torch.Tensor":
    """``x`` quantized and packed into uint8 rows: e4m3 bytes of every block, then their scales.

    Runs over row chunks written straight into the packed output, so the memory it needs beyond
    its output is one chunk's float32 rows (``chunk_bytes``) whatever the batch size. The caller
    owns stream safety: ``x`` is read on the current stream.
    """
    import torch

    rows, width = x.shape
    if width % block:
        raise ValueError(f"row width {width} is not a multiple of the block {block}")
    k = width // block
    out = torch.empty((rows, width + 4 * k), dtype=torch.uint8, device=x.device)
    codes, scale_bytes = out[:, :width].view(torch.float8_e4m3fn), out[:, width:]
    step = max(1, chunk_bytes // (4 * max(width, 1)))
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        blocks = x[lo:hi].reshape(hi - lo, k, block)
        # max |x| per block from two reductions in x's own dtype (exact), without an |x| copy
        scales = torch.maximum(blocks.amax(dim=-1), blocks.amin(dim=-1).neg()).float().div_(E4M3_MAX)
        scales.masked_fill_(~(scales > 0), 1.0)  # an all-zero block stays zero (and a NaN one keeps its finite values)
        # a float32 copy, never x itself (float32 rows were once scaled in place)
        scaled = blocks.to(torch.float32, copy=True).div_(scales.unsqueeze(-1)).clamp_(-E4M3_MAX, E4M3_MAX)
        codes[lo:hi].copy_(scaled.view(hi - lo, width))  # the cast to e4m3 happens in the copy
        scale_bytes[lo:hi].copy_(scales.view(torch.uint8))
        del scaled  # else the next chunk's float32 rows are allocated while these are still held
    return out


def packed_layout(columns: Dict[str, Tuple[int, int]], block: int, width: int
                  ) -> Tuple[Dict[str, Tuple[int, int]], Dict[str, str]]:
    """Where each stored tensor lies in a packed row of a ``width``-element row, and the dtype the
    file stores it as. ``columns`` are element column ranges of the unpacked row (multiples of
    ``block``); each becomes its e4m3 byte range plus a ``<name>_scale`` range of float32 bytes."""
    out: Dict[str, Tuple[int, int]] = {}
    dtypes: Dict[str, str] = {}
    for name, (lo, hi) in columns.items():
        out[name] = (lo, hi)
        out[name + SCALE_SUFFIX] = (width + 4 * (lo // block), width + 4 * (hi // block))
        dtypes[name], dtypes[name + SCALE_SUFFIX] = FP8_DTYPE, "float32"
    return out, dtypes
