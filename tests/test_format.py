"""Format v1: round trips keep dtype and bytes; damaged files fail with one clear error."""
from __future__ import annotations

import io

import msgpack
import pytest
import torch

import sglang_capture.core.format as fmt
from sglang_capture import CaptureFileError, load


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.arange(7, dtype=torch.int64),
        "aux_hidden_states": torch.randn(37, 24, generator=g).to(torch.bfloat16),
        "last_hidden_states": torch.randn(37, 8, generator=g),
        "empty": torch.empty(0, 8, dtype=torch.bfloat16),
    }


META = {"rid": "r1", "layers": [1, 2], "layer_convention": "x", "hidden_size": 8, "model": "m",
        "sglang_version": "0.5.17", "schema": fmt.SCHEMA}


def _encode(codec, tensors=None):
    buf = io.BytesIO()
    nbytes, checksum = fmt.write_capture(buf, META, tensors or _tensors(), codec)
    assert nbytes == len(buf.getvalue())
    return buf.getvalue(), checksum


@pytest.mark.parametrize("codec", [fmt.Codec(), fmt.Codec(shuffle=False), fmt.Codec(name="none"), fmt.Codec(level=5, threads=2),
                                   fmt.Codec(threads=2), fmt.Codec(level=1, threads=-1)])
def test_round_trip_keeps_values_dtypes_and_shapes(codec, monkeypatch):
    monkeypatch.setattr(fmt, "FRAME_BYTES", 200)  # several frames per tensor
    buf, _ = _encode(codec)
    meta, out = fmt.parse_capture(buf)
    assert meta == META
    for name, t in _tensors().items():
        assert out[name].dtype == t.dtype and out[name].shape == t.shape and torch.equal(out[name], t)


def test_any_msgpack_reader_parses_the_streamed_file():
    doc = msgpack.unpackb(_encode(fmt.Codec())[0], raw=False)
    assert doc["schema"] == fmt.SCHEMA and set(doc["tensors"]) == set(_tensors())


def test_checksum_names_its_algorithm_and_is_that_hash_of_the_file_bytes():
    import hashlib

    import xxhash

    buf, checksum = _encode(fmt.Codec())
    assert checksum == "xxh3_128:" + xxhash.xxh3_128(buf).hexdigest()  # the default
    out = io.BytesIO()
    _, sha = fmt.write_capture(out, META, _tensors(), fmt.Codec(), checksum="sha256")
    assert out.getvalue() == buf and sha == "sha256:" + hashlib.sha256(buf).hexdigest()


def test_files_are_verified_with_the_algorithm_their_checksum_names(tmp_path):
    """A manifest written before xxh3_128 became the default (sha256) still verifies; a changed
    byte fails under either; an unknown algorithm is one line, not a crash."""
    from sglang_capture.core.checksum import of_bytes
    from sglang_capture.tools.verify import check_file

    buf, _ = _encode(fmt.Codec())
    path = tmp_path / "s.capture.msgpack"
    path.write_bytes(buf)
    about_checksum = lambda checksum: [p for p in check_file(str(path), checksum) if "manifest" in p]
    for algorithm in ("sha256", "xxh3_128"):
        assert about_checksum(of_bytes(buf, algorithm)) == []
        assert about_checksum(of_bytes(buf[:-1] + bytes([buf[-1] ^ 1]), algorithm)) == [
            "s.capture.msgpack: checksum differs from the manifest (the file changed after it was written)"]
    assert about_checksum("md5:0123") == [
        "s.capture.msgpack: the manifest's checksum 'md5:0123' names no known algorithm (xxh3_128, sha256)"]
    # a decodable msgpack file that is no capture is one line too (it raised KeyError before)
    assert check_file(str(path)) == ["s.capture.msgpack: no output_ids: not a capture file of this package"]


def test_shuffle_compresses_bf16_activations_better():
    t = {"x": (torch.randn(4096, 256) * 0.5).to(torch.bfloat16)}
    assert len(_encode(fmt.Codec(), t)[0]) < len(_encode(fmt.Codec(shuffle=False), t)[0])


def test_activation_preset_writes_standard_zstd_frames_as_small_as_level_1():
    import zstandard

    g = torch.Generator().manual_seed(1)
    t = {"x": (torch.randn(2048, 512, generator=g) * 0.6).to(torch.bfloat16)}
    preset, level1 = _encode(fmt.Codec(), t)[0], _encode(fmt.Codec(level=1), t)[0]
    assert len(preset) <= len(level1) * 1.01
    frame = msgpack.unpackb(preset, raw=False)["tensors"]["x"]["data"][0]
    assert len(zstandard.ZstdDecompressor().decompress(frame)) == t["x"].numel() * 2


@pytest.mark.parametrize("codec", [fmt.Codec(), fmt.Codec(name="none")])
def test_strided_host_views_encode_to_the_same_bytes_as_contiguous_tensors(codec, monkeypatch):
    monkeypatch.setattr(fmt, "FRAME_BYTES", 300)
    rows = torch.randn(29, 40).to(torch.bfloat16)
    view = fmt.host_tensor(rows)  # shares memory: a column slice of it is strided
    strided = {"aux": fmt.HostTensor("bfloat16", view.array[:, 8:32]), "ids": torch.arange(5)}
    contiguous = {"aux": rows[:, 8:32].contiguous(), "ids": torch.arange(5)}
    assert _encode(codec, strided)[0] == _encode(codec, contiguous)[0]
    assert torch.equal(fmt.parse_capture(_encode(codec, strided)[0])[1]["aux"], contiguous["aux"])


def test_bf16_byte_planes_are_low_bytes_then_high_bytes():
    t = torch.tensor([0x1234, 0x5678, 0x0A0B], dtype=torch.int16).view(torch.bfloat16)
    planes = bytes(fmt.byte_planes(fmt.host_tensor(t).array.reshape(3, 1), 2))
    assert planes == bytes([0x34, 0x78, 0x0B, 0x12, 0x56, 0x0A])


def test_flipped_byte_in_payload_is_detected(tmp_path):
    buf = bytearray(_encode(fmt.Codec())[0])
    buf[-40] ^= 0xFF
    path = tmp_path / "bad.capture.msgpack"
    path.write_bytes(bytes(buf))
    with pytest.raises(CaptureFileError, match="corrupted"):
        load(path)


def test_truncated_file_is_detected(tmp_path):
    path = tmp_path / "cut.capture.msgpack"
    path.write_bytes(_encode(fmt.Codec())[0][:-100])
    with pytest.raises(CaptureFileError, match="truncated or corrupted"):
        load(path)


def test_not_a_capture_file(tmp_path):
    path = tmp_path / "other.capture.msgpack"
    path.write_bytes(msgpack.packb({"schema": "something else"}))
    with pytest.raises(CaptureFileError, match="not a sglang_capture/v1 or sglang_capture/v2 or sglang_capture/v3 capture file"):
        load(path)


def test_missing_file_is_one_line_error(tmp_path):
    with pytest.raises(CaptureFileError, match="cannot read"):
        load(tmp_path / "nope")


def test_header_lying_about_size_is_rejected():
    doc = msgpack.unpackb(_encode(fmt.Codec())[0], raw=False)
    doc["tensors"]["aux_hidden_states"]["shape"] = [38, 24]
    with pytest.raises(CaptureFileError, match="header sizes disagree"):
        fmt.parse_capture(msgpack.packb(doc, use_bin_type=True))


def test_bad_codec_settings_are_refused():
    with pytest.raises(ValueError, match="unknown codec"):
        fmt.Codec(name="gzip")
    with pytest.raises(ValueError, match="zstd level"):
        fmt.Codec(level=99)
