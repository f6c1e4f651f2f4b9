"""Reading capture files: ``load(path)`` and nothing else.

Only msgpack and raw bytes are decoded: no pickle, so a file from an untrusted source can at
worst fail to load, never run code.

A file of schema v3 (``--capture-prefix-sharing on``) keeps its rows in shared blocks beside it,
under ``<its directory>/.blocks/`` (core/blocks.py): ``load`` reads the blocks it references,
checks each against the checksum sealed into it and the tokens the file holds, and returns
whole tensors, as for any other file. A directory of capture files and its ``.blocks/`` travel
together (``sglang-capture extract`` moves both).
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, List, Optional, Set, Tuple, Union

import numpy

from sglang_capture.core.blocks import (
    BLOCK_KIND,
    BLOCK_TENSORS_KEY,
    BLOCK_TOKENS,
    BLOCKS_DIR,
    BLOCKS_KEY,
    BlockRef,
    block_key,
    block_relpath,
    check_coverage,
    slot_hashes,
    slot_start,
)
from sglang_capture.core.checksum import UnknownChecksum
from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.final_state import file_final
from sglang_capture.core.format import (
    SCHEMA_REFS,
    SCHEMAS,
    CaptureFileError,
    check_schemas_agree,
    decode_tensor,
    read_records,
    row_count,
    seal_intact,
)
from sglang_capture.core.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize

_ARRAY_NAMES = ("input_ids", "output_ids", "loss_mask", "aux_hidden_states", *FINAL_TENSOR.values())


def read_bytes(path: str) -> bytes:
    """A capture file's bytes, for ``loads`` (a one-line CaptureFileError when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CaptureFileError(f"{path}: cannot read ({e.strerror})") from None


def read_meta(path: Union[str, os.PathLike]) -> Dict[str, Any]:
    """A file's metadata alone, reading only the head of the file (the writer puts ``schema`` and
    ``meta`` before the tensors): for tools that judge many files (``gc``, ``extract``)."""
    import msgpack

    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=True, read_size=1 << 16)
            head = {}
            for _ in range(min(unpacker.read_map_header(), 2)):
                key = unpacker.unpack()
                head[key] = unpacker.unpack()
    except FileNotFoundError:
        raise  # gone: a caller listing a directory beside a server skips it
    except OSError as e:
        raise CaptureFileError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:  # msgpack raises several unrelated types for bad input
        raise CaptureFileError(f"{path}: not a complete msgpack document ({type(e).__name__}); truncated or "
                               "corrupted") from None
    meta = head.get("meta")
    if head.get("schema") not in SCHEMAS or not isinstance(meta, dict):
        raise CaptureFileError(f"{path}: not a {' or '.join(SCHEMAS)} capture file")
    check_schemas_agree(head["schema"], meta, path)
    return meta


def block_names(meta: Dict[str, Any], path: str) -> List[str]:
    """The blocks a file references (none unless it is of schema v3)."""
    return [ref.name for ref in block_refs(meta, path)] if meta.get("schema") == SCHEMA_REFS else []


def load_records(path: Union[str, os.PathLike]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A file's metadata and its raw tensor records, nothing decompressed (for ``inspect``)."""
    path = os.fspath(path)
    return read_records(read_bytes(path), path)


def load(path: Union[str, os.PathLike], tensors: Optional[Iterable[str]] = None, raw_fp8: bool = False) -> Dict[str, Any]:
    """Load one capture file into a dict of tensors (serving dtype kept) and metadata.

    Keys: ``rid``, ``input_ids`` int64 [P], ``output_ids`` int64 [G], ``aux_hidden_states``
    [N, len(layers)*H], ``last_hidden_states`` [N, H] (the post-norm final state, when kept),
    ``last_hidden_states_pre_norm`` [N, H] (the final state before the model's final norm, with
    ``--capture-final pre-norm|both``), ``final`` (which of the two the file holds: ``post-norm``,
    ``pre-norm``, ``both``, or None), ``loss_mask`` int64 [P] (when the request sent
    ``capture_loss_mask``, e.g. from ``sglang-capture extract``), ``layers``,
    ``layer_convention``, ``hidden_size``, ``model``, ``sglang_version``, ``schema`` and the
    rest of the file's metadata under ``meta``. ``tensors`` limits which tensors are decoded.

    Files captured with ``--capture-dtype fp8`` (schema v2) load the same way, their hidden states
    restored to the model's serving dtype (bf16 for Kimi-K2.5); ``raw_fp8=True`` returns the stored
    e4m3 tensors instead, each with its float32 ``<name>_scale`` [N, blocks] beside it.
    """
    path = os.fspath(path)
    return loads(read_bytes(path), path, tensors, raw_fp8)


def _restore_fp8(arrays: Dict[str, Any], meta: Dict[str, Any], path: str) -> None:
    """Replace each FP8 tensor and its scales by the tensor in the model's dtype (in place)."""
    import torch

    dtype = getattr(torch, str(meta.get("dtype", "bfloat16")), None)
    if not isinstance(dtype, torch.dtype):
        raise CaptureFileError(f"{path}: metadata names an unknown model dtype {meta.get('dtype')!r}")
    for name in [k for k, t in arrays.items() if str(t.dtype).replace("torch.", "") == FP8_DTYPE]:
        scales = arrays.pop(name + SCALE_SUFFIX, None)
        if scales is None or scales.ndim != 2 or scales.shape[0] != arrays[name].shape[0] or not scales.shape[1] \
                or arrays[name].shape[1] % scales.shape[1]:
            raise CaptureFileError(f"{path}: FP8 tensor {name!r} has no matching {name + SCALE_SUFFIX!r} tensor")
        arrays[name] = dequantize(arrays[name], scales, dtype)


def blocks_dir(path: str) -> str:
    """Where the blocks of a v3 file at ``path`` lie."""
    return os.path.join(os.path.dirname(os.path.abspath(path)), BLOCKS_DIR)


def block_refs(meta: Dict[str, Any], path: str) -> List[BlockRef]:
    """The blocks a v3 file's rows lie in, checked to cover its rows once, in order."""
    try:
        refs = [BlockRef.from_list(v) for v in meta[BLOCKS_KEY]]
        n_rows = row_count(int(meta["num_prompt_tokens"]), int(meta["num_output_tokens"]))
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureFileError(f"{path}: its list of blocks is malformed ({e})") from None
    gap = check_coverage(refs, n_rows)
    if gap is not None:
        raise CaptureFileError(f"{path}: its blocks do not cover its rows: {gap}")
    return refs


def read_block(path: str, ref: BlockRef) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    """A block the v3 file at ``path`` references: its path, metadata and tensor records, checked to be
    that block and whole (the checksum sealed into it, core/format.seal_intact), nothing decompressed."""
    return _block(blocks_dir(path), ref, path)


def _block(directory: str, ref: BlockRef, path: str) -> Tuple[str, Dict[str, Any], Dict[str, Any]]:
    rows = f"rows {ref.first}-{ref.last - 1}"
    block_path = os.path.join(directory, block_relpath(ref.name))
    try:
        with open(block_path, "rb") as f:
            buf = f.read()
    except FileNotFoundError:
        raise CaptureFileError(f"{path}: block {ref.name} ({rows}) is missing from {directory}") from None
    except OSError as e:
        raise CaptureFileError(f"{path}: block {ref.name} ({rows}) cannot be read ({e.strerror})") from None
    try:
        meta, recs = read_records(buf, block_path)
        intact = seal_intact(meta, recs)
    except (CaptureFileError, UnknownChecksum) as e:
        raise CaptureFileError(f"{path}: block {ref.name} ({rows}) is corrupt ({str(e).split(': ', 1)[-1]})") from None
    if not intact:
        raise CaptureFileError(f"{path}: block {ref.name} ({rows}) is corrupt: its content differs from the "
                               "checksum sealed into it")
    if meta.get("kind") != BLOCK_KIND or meta.get("key") != ref.name or meta.get("start") != ref.start \
            or "tokens" not in recs:
        raise CaptureFileError(f"{path}: block {ref.name} ({rows}) is not the block the file references")
    return block_path, meta, recs


def check_seal(meta: Dict[str, Any], recs: Dict[str, Any], path: str) -> None:
    """A one-line CaptureFileError unless a v3 file's content has the checksum sealed into it."""
    try:
        intact = seal_intact(meta, recs)
    except UnknownChecksum as e:
        raise CaptureFileError(f"{path}: {e}") from None
    if not intact:
        raise CaptureFileError(f"{path}: its content differs from the checksum sealed into it; the file is corrupted")


def check_blocks(meta: Dict[str, Any], path: str) -> List[str]:
    """Every referenced block of a v3 file that is missing or corrupt, one line each (``verify``)."""
    try:
        refs = block_refs(meta, path)
    except CaptureFileError as e:
        return [str(e).split(": ", 1)[-1]]
    problems = []
    for ref in refs:
        try:
            _block(blocks_dir(path), ref, path)
        except CaptureFileError as e:
            problems.append(str(e).split(": ", 1)[-1])
    return problems


def _rows_from_blocks(meta: Dict[str, Any], path: str, wanted: Set[str], tokens: numpy.ndarray) -> Dict[str, Any]:
    """The ``wanted`` tensors of a v3 file, put together from its blocks' rows. Each block must be the
    one its name says for this file: its key recomputed from the file's own tokens before its slot and
    the file's layout, its tokens the file's where the file uses its rows, its tensors of its rows."""
    import torch

    if meta.get("block_tokens") != BLOCK_TOKENS:
        raise CaptureFileError(f"{path}: its blocks are cut every {meta.get('block_tokens')!r} tokens; this version "
                               f"reads blocks of {BLOCK_TOKENS}")
    layout = meta.get("block_layout")
    try:
        root = bytes.fromhex(layout)
    except (TypeError, ValueError):
        raise CaptureFileError(f"{path}: its metadata has no valid block_layout") from None
    refs = block_refs(meta, path)
    hashes = slot_hashes(tokens, root, refs[-1].start // BLOCK_TOKENS + 1) if refs else []
    parts: Dict[str, List[Any]] = {name: [] for name in wanted}
    for ref in refs:
        block_path, bmeta, recs = _block(blocks_dir(path), ref, path)
        slot, end = slot_start(ref.start), bmeta.get("end")
        held = decode_tensor("tokens", recs["tokens"], block_path).numpy()
        if not isinstance(end, int) or len(held) != end - slot or bmeta.get("layout") != layout \
                or block_key(hashes[ref.start // BLOCK_TOKENS], ref.start - slot, end - slot, held).hex() != ref.name \
                or ref.last > end or not numpy.array_equal(held[:ref.last - slot], tokens[slot:ref.last]):
            raise CaptureFileError(f"{path}: block {ref.name} is not this file's: it holds the rows of other tokens "
                                   "or another layout")
        lo, hi = ref.first - ref.start, ref.last - ref.start
        for name in wanted:
            if name not in recs:
                raise CaptureFileError(f"{path}: block {ref.name} has no {name!r} tensor")
            rows = decode_tensor(name, recs[name], block_path)
            if rows.ndim != 2 or rows.shape[0] != end - ref.start:
                raise CaptureFileError(f"{path}: block {ref.name}'s {name!r} has {tuple(rows.shape)} rows, not "
                                       f"{end - ref.start}")
            parts[name].append(rows[lo:hi])
    out = {}
    for name, ts in parts.items():
        if len({(tuple(t.shape[1:]), t.dtype) for t in ts}) > 1:
            raise CaptureFileError(f"{path}: its blocks hold {name!r} of different widths or dtypes")
        out[name] = torch.cat(ts) if len(ts) != 1 else ts[0].clone()
    return out


def loads(buf: bytes, path: str = "<capture>", tensors: Optional[Iterable[str]] = None,
          raw_fp8: bool = False) -> Dict[str, Any]:
    """``load`` for a file's bytes already in memory (``path`` names it in errors and, for a v3 file,
    says where its blocks are)."""
    if tensors is not None:
        tensors = [n for name in tensors for n in (name, name + SCALE_SUFFIX)]
    meta, recs = read_records(buf, path)
    wanted = set(recs) if tensors is None else set(tensors) & set(recs)
    arrays = {k: decode_tensor(k, v, path) for k, v in recs.items() if k in wanted}
    if meta.get("schema") == SCHEMA_REFS:
        check_seal(meta, recs, path)
        in_blocks = meta.get(BLOCK_TENSORS_KEY)
        if not isinstance(in_blocks, list) or not all(isinstance(k, str) for k in in_blocks):
            raise CaptureFileError(f"{path}: its metadata does not say which tensors its blocks hold")
        from_blocks = set(in_blocks) if tensors is None else set(tensors) & set(in_blocks)
        if from_blocks:
            if "input_ids" not in recs or "output_ids" not in recs:
                raise CaptureFileError(f"{path}: a file whose rows lie in blocks needs its input_ids and output_ids")
            ids = numpy.concatenate([arrays["input_ids"].numpy() if "input_ids" in arrays else
                                     decode_tensor("input_ids", recs["input_ids"], path).numpy(),
                                     arrays["output_ids"].numpy() if "output_ids" in arrays else
                                     decode_tensor("output_ids", recs["output_ids"], path).numpy()])
            arrays.update(_rows_from_blocks(meta, path, from_blocks, ids))
        recs = {**recs, **dict.fromkeys(in_blocks)}  # what the file holds, for file_final
    if not raw_fp8:
        _restore_fp8(arrays, meta, path)
    try:
        out: Dict[str, Any] = {
            "rid": str(meta["rid"]),
            "layers": [int(i) for i in meta["layers"]],
            "layer_convention": str(meta["layer_convention"]),
            "hidden_size": int(meta["hidden_size"]),
            "model": str(meta["model"]),
            "sglang_version": str(meta["sglang_version"]),
            "schema": str(meta["schema"]),
            "final": file_final(meta, recs),
            "meta": meta,
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureFileError(f"{path}: metadata is incomplete ({e!r})") from None
    out.update({k: arrays[k] for k in _ARRAY_NAMES if k in arrays})
    if raw_fp8:
        out.update({k + SCALE_SUFFIX: arrays[k + SCALE_SUFFIX] for k in _ARRAY_NAMES if k + SCALE_SUFFIX in arrays})
    return out
