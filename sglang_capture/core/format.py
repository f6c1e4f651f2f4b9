"""How capture files are laid out on disk (schema v1, v2 for FP8, v3 for files whose rows lie in shared
blocks): encoding and decoding, nothing else.

A file is one msgpack map::

    {"schema": "sglang_capture/v1",
     "meta":    {...plain msgpack values...},
     "tensors": {name: {"dtype": str, "shape": [int, ...], "byteorder": "little",
                        "codec": "zstd" | "none", "shuffle": int, "nbytes": int,
                        "frame_rows": int, "data": [bin, ...]}}}

``data`` holds the tensor's raw little-endian bytes; with ``shuffle = k > 0`` the bytes of
each k-byte element are first split into k planes (all first bytes, then all second bytes,
...), which lets zstd find the low-entropy exponent bytes of bf16 activations. ``data`` is a
list of frames of ``frame_rows`` rows each (at most 64 MiB raw, so neither side holds a whole
tensor's temporaries); ``zstd`` frames are ordinary zstd frames with the content size and a
content checksum. Files holding FP8 tensors say v2 (below). The writer streams the map
(headers first, then each payload) so a multi-GB tensor is never copied into a msgpack
buffer; any msgpack reader can still parse the whole file. A v3 file holds no hidden-state
tensors of its own: its metadata lists the blocks that hold its rows (core/blocks.py), each of
which is itself a v1 or v2 file; readers older than v3 refuse it instead of reading it short. See
docs/format.md.
"""
from __future__ import annotations

import math
import os
import struct
import sys
import threading
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Dict, Iterable, Iterator, List, Mapping, Optional, Tuple, Union

import msgpack
import numpy
import zstandard

from sglang_capture.core.checksum import DEFAULT_CHECKSUM, algorithm_of, new_hasher, tag

if TYPE_CHECKING:
    import torch

SCHEMA = "sglang_capture/v1"
# v2 = v1 plus FP8 tensors (dtype float8_e4m3fn) with their float32 ``<name>_scale`` tensors
# (core/fp8.py). Only files that hold FP8 say v2: every other file is byte for byte a v1 file.
SCHEMA_FP8 = "sglang_capture/v2"
# v3: the file's rows lie in shared blocks (--capture-prefix-sharing on); ``meta["blocks"]`` lists them.
SCHEMA_REFS = "sglang_capture/v3"
SCHEMAS = (SCHEMA, SCHEMA_FP8, SCHEMA_REFS)
CODECS = ("zstd", "none")

# Stored dtype names, which are also torch's attribute names. torch itself is imported only where a
# torch tensor is made or read: the writer processes encode numpy arrays and never load it.
DTYPES = ("bfloat16", "float16", "float32", "int64", "int32", "uint8", "float8_e4m3fn")
_BYTE_DTYPES = {"float8_e4m3fn"}  # numpy has no such type: their bytes travel as uint8
_RECORD_FIELDS = {"dtype", "shape", "byteorder", "codec", "shuffle", "nbytes", "frame_rows", "data"}

if sys.byteorder != "little":  # pragma: no cover - every platform SGLang runs on is little-endian
    raise ImportError("sglang_capture writes little-endian tensors and needs a little-endian host")


def row_count(num_prompt_tokens: int, num_output_tokens: int) -> int:
    """Rows a file holds: one per prompt token and one per output token fed back into the model
    (the last output token was sampled, never fed back, so it has no row)."""
    return num_prompt_tokens + max(num_output_tokens - 1, 0)


class CaptureFileError(ValueError):
    """A capture file that cannot be trusted: truncated, corrupted, or of an unknown schema."""


@dataclass(frozen=True)
class Codec:
    """How tensors are compressed: ``name`` zstd or none, zstd ``level``, byte ``shuffle``, ``threads``.

    ``level=None`` selects ACTIVATION_PARAMS instead of a numbered zstd level.
    """

    name: str = "zstd"
    level: Optional[int] = None
    shuffle: bool = True
    threads: int = 0

    def __post_init__(self) -> None:
        if self.name not in CODECS:
            raise ValueError(f"unknown codec {self.name!r}; choose one of {', '.join(CODECS)}")
        if self.name == "zstd" and self.level is not None and not -7 <= self.level <= 22:
            raise ValueError(f"zstd level must be between -7 and 22, got {self.level}")


# Byte-shuffled bf16 activations compress through entropy coding of the exponent plane; zstd's
# match search finds almost nothing there and is most of level 1's time. Tiny match tables and
# a long minimum match keep the entropy coding and drop the search: on activation-like bf16 this
# ran 2-3x faster than level 1 with a slightly better ratio (1.485 vs 1.459; bench/RESULTS.md).
# The frames are ordinary zstd frames: any zstd decoder reads them.
ACTIVATION_PARAMS = dict(strategy=zstandard.STRATEGY_FAST, window_log=20, hash_log=6, chain_log=6,
                         search_log=1, min_match=7, target_length=0)

_local = threading.local()


def compressor_for(codec: Codec) -> zstandard.ZstdCompressor:
    """One compressor per thread and setting: ZstdCompressor objects are not thread-safe."""
    key = (codec.level, codec.threads)
    cache = getattr(_local, "compressors", None)
    if cache is None:
        cache = _local.compressors = {}
    if key not in cache:
        threads = (os.cpu_count() or 1) if codec.threads < 0 else codec.threads
        if codec.level is None:
            params = zstandard.ZstdCompressionParameters(
                **ACTIVATION_PARAMS, threads=threads, write_checksum=1, write_content_size=1)
            cache[key] = zstandard.ZstdCompressor(compression_params=params)
        else:
            cache[key] = zstandard.ZstdCompressor(
                level=codec.level, threads=threads, write_checksum=True, write_content_size=True)
    return cache[key]


FRAME_BYTES = 64 << 20  # raw bytes per zstd frame: bounds temp memory, keeps bins under 4 GiB

@dataclass(frozen=True)
class HostTensor:
    """A host array plus the dtype name the file stores for it.

    The writer works on numpy arrays rather than torch tensors: writer processes never load torch
    (its import costs seconds and hundreds of MB per process), and numpy views can map the shared
    host pool in place.
    """

    dtype: str
    array: numpy.ndarray

    @property
    def nbytes(self) -> int:
        return int(self.array.nbytes)


def host_tensor(t: Union[torch.Tensor, HostTensor, numpy.ndarray]) -> HostTensor:
    """A HostTensor sharing ``t``'s memory (no copy; strides kept)."""
    if isinstance(t, HostTensor):
        return t
    if isinstance(t, numpy.ndarray):
        # numpy's dtype names are the file's; numpy has no native bfloat16 (bf16 travels as uint16)
        if t.dtype.name not in DTYPES or t.dtype.name in ("bfloat16", *_BYTE_DTYPES) or not t.dtype.isnative:
            raise ValueError(f"unsupported array dtype {t.dtype}")
        return HostTensor(t.dtype.name, t)
    if t.device.type != "cpu":
        raise ValueError("encode_tensor takes host tensors; copy to the CPU first")
    name = str(t.dtype).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unsupported tensor dtype {t.dtype}")
    t = t.detach()
    if name == "bfloat16":
        import torch

        return HostTensor(name, t.view(torch.int16).numpy().view(numpy.uint16))
    if name in _BYTE_DTYPES:
        import torch

        return HostTensor(name, t.view(torch.uint8).numpy())
    return HostTensor(name, t.numpy())


def byte_planes(block: numpy.ndarray, shuffle: int) -> memoryview:
    """The block's bytes in row-major order, split into ``shuffle`` byte planes when > 1."""
    if shuffle == 2:  # one vectorised pass per plane, reading strided rows directly
        u = block.view(numpy.uint16)
        planes = numpy.empty((2,) + block.shape, dtype=numpy.uint8)
        numpy.bitwise_and(u, 0xFF, out=planes[0], casting="unsafe")
        numpy.right_shift(u, 8, out=planes[1], casting="unsafe")
        return memoryview(planes.reshape(-1))
    flat = numpy.ascontiguousarray(block).reshape(-1).view(numpy.uint8)
    if shuffle > 1 and flat.size:
        elements = flat.reshape(-1, shuffle)
        planes = numpy.empty((shuffle, elements.shape[0]), dtype=numpy.uint8)
        for k in range(shuffle):
            planes[k] = elements[:, k]
        flat = planes.reshape(-1)
    return memoryview(flat)


def encode_tensor(tensor: Union[torch.Tensor, HostTensor], codec: Codec
                  ) -> Tuple[Dict[str, Any], Iterator[memoryview], int]:
    """Return the tensor's header fields, a lazy iterator over its frames' payloads, and their count.

    The tensor is cut into blocks of whole rows (first dimension) of about FRAME_BYTES each;
    every block is shuffled and compressed on its own, so the writer never holds more than one
    block's worth of temporary bytes and no payload reaches msgpack's 4 GiB bin limit.
    """
    ht = host_tensor(tensor)
    a = ht.array
    itemsize = a.itemsize
    shuffle = itemsize if (codec.shuffle and codec.name == "zstd" and itemsize > 1) else 0
    rows = a.shape[0] if a.ndim else 1
    row_bytes = a.nbytes // rows if rows else 0
    frame_rows = max(1, FRAME_BYTES // max(row_bytes, 1))
    n_frames = max(1, math.ceil(rows / frame_rows))
    header = {
        "dtype": ht.dtype,
        "shape": list(a.shape),
        "byteorder": "little",
        "codec": codec.name,
        "shuffle": shuffle,
        "nbytes": int(a.nbytes),
        "frame_rows": frame_rows,
    }
    flat = a.reshape(rows, -1) if a.size else a.reshape(-1)

    def frames() -> Iterator[memoryview]:
        for i in range(n_frames):
            raw = byte_planes(flat[i * frame_rows:(i + 1) * frame_rows], shuffle)
            yield memoryview(compressor_for(codec).compress(raw)) if codec.name == "zstd" else raw

    return header, frames(), n_frames


def _bin_header(n: int) -> bytes:
    """msgpack bin8/16/32 header, so a payload can be written after it without a copy."""
    if n < 1 << 8:
        return struct.pack(">BB", 0xC4, n)
    if n < 1 << 16:
        return struct.pack(">BH", 0xC5, n)
    if n < 1 << 32:
        return struct.pack(">BI", 0xC6, n)
    raise ValueError(f"a tensor of {n} bytes exceeds msgpack's 4 GiB bin limit; capture fewer tokens per request")


class _HashingWriter:
    """File wrapper that counts and hashes every byte written, so the checksum costs no re-read."""

    def __init__(self, f: IO[bytes], algorithm: str) -> None:
        self._f = f
        self.algorithm = algorithm
        self.hasher = new_hasher(algorithm)
        self.nbytes = 0

    def write(self, data: Any) -> None:
        self._f.write(data)
        self.hasher.update(data)
        self.nbytes += memoryview(data).nbytes


# A sealed file's metadata holds the checksum of its own content: of its metadata without this key (as
# msgpack packs it) and of every tensor's name, header (dtype, shape, shuffle, ...) and frames, in file
# order. Shared blocks are sealed (core/blocks.py): files referencing one accept any block of its name
# (two servers compute the same rows within rounding), so they cannot hold its checksum. Files of references (v3) are sealed too: nearly all
# of their bytes are metadata, which no zstd frame checksum covers.
SEAL = "seal"


def write_capture(
    f: IO[bytes], meta: Mapping[str, Any], tensors: Mapping[str, Union[torch.Tensor, HostTensor]], codec: Codec,
    checksum: str = DEFAULT_CHECKSUM, schema: Optional[str] = None, seal_payload: bool = False,
) -> Tuple[int, str]:
    """Stream one file into ``f``; returns (bytes written, its ``checksum`` as ``<algorithm>:<hex>``).
    ``schema`` defaults to what the tensors need (v2 when any is FP8, else v1). ``seal_payload``
    puts the checksum of the metadata and the tensor frames into the metadata (``SEAL``): the frames
    are then compressed before anything is written, so use it for small files only."""
    out = _HashingWriter(f, checksum)
    packer = msgpack.Packer(use_bin_type=True)
    out.write(packer.pack_map_header(3))
    if schema is None:
        schema = SCHEMA_FP8 if any(host_tensor(t).dtype in _BYTE_DTYPES for t in tensors.values()) else SCHEMA
    encoded = [(name, *encode_tensor(tensor, codec)) for name, tensor in tensors.items()]
    if seal_payload:
        encoded = [(name, header, list(frames), n) for name, header, frames, n in encoded]
        h = new_hasher(checksum)
        h.update(packer.pack(dict(meta)))
        for name, header, frames, _ in encoded:
            h.update(packer.pack(name) + packer.pack(dict(header)))
            for payload in frames:
                h.update(payload)
        meta = {**meta, SEAL: tag(checksum, h)}
    out.write(packer.pack("schema") + packer.pack(schema))
    out.write(packer.pack("meta") + packer.pack(dict(meta)))
    out.write(packer.pack("tensors") + packer.pack_map_header(len(tensors)))
    for name, header, frames, n_frames in encoded:
        out.write(packer.pack(name) + packer.pack_map_header(len(header) + 1))
        for key, value in header.items():
            out.write(packer.pack(key) + packer.pack(value))
        out.write(packer.pack("data") + packer.pack_array_header(n_frames))
        for payload in frames:
            out.write(_bin_header(payload.nbytes))
            out.write(payload)
    return out.nbytes, tag(out.algorithm, out.hasher)


def seal_intact(meta: Mapping[str, Any], recs: Mapping[str, Any]) -> bool:
    """Whether a sealed file's metadata and tensor frames still have the checksum its metadata holds
    (raises UnknownChecksum; False when it holds none)."""
    sealed = meta.get(SEAL)
    if not isinstance(sealed, str):
        return False
    h = new_hasher(algorithm_of(sealed))
    h.update(msgpack.packb({k: v for k, v in meta.items() if k != SEAL}, use_bin_type=True))
    for name, rec in recs.items():
        if not isinstance(rec, dict):
            return False
        h.update(msgpack.packb(name, use_bin_type=True)
                 + msgpack.packb({k: v for k, v in rec.items() if k != "data"}, use_bin_type=True))
        for frame in rec.get("data", ()):
            h.update(frame)
    return tag(algorithm_of(sealed), h) == sealed


def _fail(path: str, why: str) -> CaptureFileError:
    return CaptureFileError(f"{path}: {why}")


# bytes per element of each stored dtype, and the numpy type a writer process reads it as (bf16: its bits)
_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "int64": 8, "int32": 4, "uint8": 1, "float8_e4m3fn": 1}
_NUMPY = {"bfloat16": "uint16", "float8_e4m3fn": "uint8"}


def _decode_bytes(name: str, rec: Any, path: str) -> Tuple[bytearray, str, List[int]]:
    """Validate one tensor record and return its raw little-endian bytes, dtype name and shape."""
    if not isinstance(rec, dict) or set(rec) != _RECORD_FIELDS:
        raise _fail(path, f"tensor {name!r} is not a tensor record")
    shape = rec["shape"]
    if rec["dtype"] not in DTYPES:
        raise _fail(path, f"tensor {name!r} has unknown dtype {rec['dtype']!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise _fail(path, f"tensor {name!r} has an invalid shape {shape!r}")
    frames = rec["data"]
    if rec["byteorder"] != "little" or rec["codec"] not in CODECS or not isinstance(frames, list) \
            or not all(isinstance(fr, bytes) for fr in frames):
        raise _fail(path, f"tensor {name!r} has an unsupported byteorder, codec or data layout")
    itemsize = _ITEMSIZE[rec["dtype"]]
    nbytes = math.prod(shape) * itemsize
    rows = shape[0] if shape else 1
    frame_rows = rec["frame_rows"]
    if rec["nbytes"] != nbytes or rec["shuffle"] not in (0, itemsize) or not isinstance(frame_rows, int) \
            or frame_rows < 1 or len(frames) != max(1, math.ceil(rows / frame_rows)):
        raise _fail(path, f"tensor {name!r}: header sizes disagree with its shape and dtype")
    row_bytes = nbytes // rows if rows else 0
    out = bytearray(nbytes)
    view = memoryview(out)
    pos = 0
    for i, frame in enumerate(frames):
        want = min(frame_rows, rows - i * frame_rows) * row_bytes
        if rec["codec"] == "zstd":
            try:
                frame = zstandard.ZstdDecompressor().decompress(frame, max_output_size=max(want, 1))
            except zstandard.ZstdError as e:
                raise _fail(path, f"tensor {name!r} failed to decompress ({e}); the file is corrupted") from None
        if len(frame) != want:
            raise _fail(path, f"tensor {name!r} frame {i} holds {len(frame)} bytes, expected {want}; the file is corrupted")
        if rec["shuffle"] > 1 and want:
            planes = numpy.frombuffer(frame, dtype=numpy.uint8).reshape(rec["shuffle"], -1)
            numpy.frombuffer(view[pos:pos + want], dtype=numpy.uint8).reshape(-1, rec["shuffle"])[:] = planes.T
        else:
            view[pos:pos + want] = frame
        pos += want
    return out, rec["dtype"], shape


def decode_tensor(name: str, rec: Any, path: str = "<capture>") -> torch.Tensor:
    """Validate one tensor record and rebuild the tensor (dtype kept as stored)."""
    import torch

    out, dtype_name, shape = _decode_bytes(name, rec, path)
    dtype = getattr(torch, dtype_name)
    if not out:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(out, dtype=torch.uint8).view(dtype).reshape(shape)


def decode_array(name: str, rec: Any, path: str = "<capture>") -> numpy.ndarray:
    """``decode_tensor`` without torch (writer processes): a numpy array, bf16 and FP8 as their bits."""
    out, dtype_name, shape = _decode_bytes(name, rec, path)
    return numpy.frombuffer(out, dtype=_NUMPY.get(dtype_name, dtype_name)).reshape(shape)


def read_records(buf: bytes, path: str = "<capture>") -> Tuple[dict, dict]:
    """Parse a whole file's bytes into (meta, raw tensor records) without decompressing anything."""
    try:
        doc = msgpack.unpackb(buf, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise _fail(path, f"not a complete msgpack document ({type(e).__name__}); truncated or corrupted") from None
    if not isinstance(doc, dict) or doc.get("schema") not in SCHEMAS:
        raise _fail(path, f"not a {' or '.join(SCHEMAS)} capture file")
    meta, recs = doc.get("meta"), doc.get("tensors")
    if not isinstance(meta, dict) or not isinstance(recs, dict):
        raise _fail(path, "missing 'meta' or 'tensors' section")
    check_schemas_agree(doc["schema"], meta, path)
    return meta, recs


def check_schemas_agree(header_schema: str, meta: Dict[str, Any], path: str) -> None:
    """Readers go by the metadata's schema: a file of references (v3) must never pass for a
    self-contained one, or the reverse (``gc`` would then take its blocks)."""
    if SCHEMA_REFS in (header_schema, meta.get("schema")) and meta.get("schema") != header_schema:
        raise _fail(path, f"its header says {header_schema} and its metadata {meta.get('schema')!r}; the file is corrupted")


def record_stats(rec: Dict[str, Any]) -> Dict[str, Any]:
    """Sizes of one raw tensor record (for ``inspect``): raw bytes, stored bytes, frame count."""
    stored = sum(len(fr) for fr in rec.get("data", []))
    return {"dtype": rec.get("dtype"), "shape": rec.get("shape"), "codec": rec.get("codec"),
            "shuffle": rec.get("shuffle"), "frames": len(rec.get("data", [])), "raw_bytes": rec.get("nbytes"),
            "stored_bytes": stored}


def parse_capture(buf: bytes, path: str = "<capture>", names: Optional[Iterable[str]] = None) -> Tuple[dict, dict]:
    """Parse a whole file's bytes into (meta, tensors); ``names`` limits which tensors are decoded."""
    meta, recs = read_records(buf, path)
    wanted = set(recs) if names is None else set(names) & set(recs)
    return meta, {k: decode_tensor(k, v, path) for k, v in recs.items() if k in wanted}
