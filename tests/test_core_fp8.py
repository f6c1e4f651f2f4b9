"""FP8 storage (core/fp8.py, schema v2 in core/format.py, restoring in core/reader.py): the error
bound, the packed row layout the writer assembles, the file round trip, and refusals."""
from __future__ import annotations

import io

import numpy
import pytest
import torch

from sglang_capture.core import format as fmt
from sglang_capture.core.config import CaptureConfig, ConfigError
from sglang_capture.core.fp8 import dequantize, pack, packed_layout, quantize
from sglang_capture.core.reader import loads
from sglang_capture.testbed.fp8_reference import whole_batch_pack
from sglang_capture.writer.assemble import assemble_rows, relabel
from tests.jobs import as_torch

H = 64


def _activations(rows: int, blocks: int) -> torch.Tensor:
    """Activation-like rows: normal values, a few large outliers per block, one all-zero block."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, blocks * H, generator=g)
    x[:, ::17] *= 30.0
    x[0, :H] = 0.0
    return x.to(torch.bfloat16)


def test_fp8_rows_stay_within_the_e4m3_error_bound_and_cosine_0_999():
    x = _activations(257, 4)
    q, scales = quantize(x, H)
    assert q.dtype == torch.float8_e4m3fn and scales.shape == (257, 4) and scales.dtype == torch.float32
    back = dequantize(q, scales, torch.float32)
    err = (back - x.float()).abs()
    bound = 2.0 ** -4 * x.float().abs() + scales.repeat_interleave(H, dim=1) * 2.0 ** -10
    assert bool((err <= bound * (1 + 1e-6)).all())
    assert torch.equal(back[0, :H], torch.zeros(H))  # an all-zero block comes back as zeros
    cos = torch.nn.functional.cosine_similarity(back[1:], x[1:].float(), dim=-1)
    assert cos.min().item() >= 0.999
    assert (q.float().abs().amax(dim=-1) > 0).all()


def test_packed_rows_are_assembled_by_the_writer_into_e4m3_tensors_and_their_scales():
    layers = 3
    x = _activations(10, layers + 1)
    packed = pack(x, H)
    assert packed.dtype == torch.uint8 and packed.shape == (10, (layers + 1) * H + 4 * (layers + 1))
    splits = {"aux_hidden_states": (0, layers * H), "last_hidden_states": (layers * H, (layers + 1) * H)}
    stored, dtypes = packed_layout(splits, H, (layers + 1) * H)
    # rows arrive in two chunks, out of order, as chunked prefill delivers them
    pieces = [(6, fmt.host_tensor(packed[6:])), (0, fmt.host_tensor(packed[:6]))]
    out = relabel(assemble_rows(pieces, 10, stored), dtypes)
    q, scales = quantize(x, H)
    aux = as_torch(out["aux_hidden_states"])
    assert aux.dtype == torch.float8_e4m3fn and torch.equal(aux.view(torch.uint8), q[:, :layers * H].view(torch.uint8))
    assert torch.equal(as_torch(out["aux_hidden_states_scale"]), scales[:, :layers])
    assert torch.equal(as_torch(out["last_hidden_states_scale"]), scales[:, layers:])
    empty = relabel(assemble_rows([], 0, stored), dtypes)  # a capture with no rows
    assert empty["aux_hidden_states_scale"].array.shape == (0, layers)


def _file(tensors) -> bytes:
    buf = io.BytesIO()
    meta = {"rid": "r", "layers": [1, 2, 3], "layer_convention": "c", "hidden_size": H, "model": "m",
            "sglang_version": "0.5.17", "schema": "x", "dtype": "bfloat16"}
    fmt.write_capture(buf, meta, tensors, fmt.Codec("zstd"))
    return buf.getvalue()


def test_fp8_files_say_schema_v2_load_restored_by_default_and_raw_on_request():
    x = _activations(33, 4)
    q, scales = quantize(x, H)
    ids = torch.arange(33)
    buf = _file({"input_ids": ids, "output_ids": ids[:1], "aux_hidden_states": q[:, :3 * H],
                 "aux_hidden_states_scale": scales[:, :3], "last_hidden_states": q[:, 3 * H:],
                 "last_hidden_states_scale": scales[:, 3:]})
    restored = loads(buf)
    assert restored["aux_hidden_states"].dtype == torch.bfloat16  # the model's dtype, from the metadata
    assert torch.equal(restored["aux_hidden_states"], dequantize(q[:, :3 * H], scales[:, :3], torch.bfloat16))
    assert "aux_hidden_states_scale" not in restored
    raw = loads(buf, raw_fp8=True)
    assert raw["last_hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(raw["last_hidden_states_scale"], scales[:, 3:])
    only = loads(buf, tensors=["last_hidden_states"])
    assert set(k for k in only if k.endswith("states")) == {"last_hidden_states"}
    assert b"sglang_capture/v2" in buf[:64]
    bf16 = _file({"input_ids": ids, "aux_hidden_states": x[:, :3 * H]})
    assert b"sglang_capture/v1" in bf16[:64] and loads(bf16)["aux_hidden_states"].dtype == torch.bfloat16


def test_an_fp8_tensor_without_its_scales_and_a_bad_dtype_option_are_refused(tmp_path):
    q, _ = quantize(_activations(4, 1), H)
    buf = _file({"input_ids": torch.arange(4), "aux_hidden_states": q})
    with pytest.raises(fmt.CaptureFileError, match="has no matching 'aux_hidden_states_scale' tensor"):
        loads(buf)
    assert loads(buf, raw_fp8=True)["aux_hidden_states"].dtype == torch.float8_e4m3fn
    with pytest.raises(ConfigError, match="--capture-dtype must be one of model, fp8, got 'fp16'"):
        CaptureConfig(capture_dir=str(tmp_path), capture_dtype="fp16")
    with pytest.raises(ValueError, match="not a multiple of the block"):
        quantize(torch.zeros(2, H + 1), H)
    assert numpy.dtype("uint8").name in fmt.DTYPES


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packing_in_row_chunks_gives_the_bytes_of_packing_the_whole_batch_at_once(dtype):
    x = _activations(101, 4).to(dtype)
    x[7, H:2 * H] = -x[7, H:2 * H].abs()  # a block whose largest magnitude is negative
    x[9, 3] = float("nan")  # a NaN block keeps its finite values (scale 1), an infinity is clamped
    x[10, 2 * H + 5] = float("inf")
    original, want = x.clone(), whole_batch_pack(x, H)
    row_bytes = 4 * 4 * H
    for chunk_bytes in (1, row_bytes, 3 * row_bytes, 64 * row_bytes, 1 << 30):  # 1 row, 1, 3, 64 rows, all
        got = pack(x, H, chunk_bytes=chunk_bytes)
        assert got.dtype == torch.uint8 and torch.equal(got, want), chunk_bytes
        assert torch.equal(x.nan_to_num(), original.nan_to_num())  # the input is never scaled in place
    assert pack(x[:0], H).shape == (0, 4 * H + 16)
