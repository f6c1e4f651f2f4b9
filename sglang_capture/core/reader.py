"""Reading capture files: ``load(path)`` and nothing else.

Only msgpack and raw bytes are decoded: no pickle, so a file from an untrusted source can at
worst fail to load, never run code.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Tuple, Union

from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.final_state import file_final
from sglang_capture.core.format import CaptureFileError, decode_tensor, read_records
from sglang_capture.core.fp8 import FP8_DTYPE, SCALE_SUFFIX, dequantize

_ARRAY_NAMES = ("input_ids", "output_ids", "loss_mask", "aux_hidden_states", *FINAL_TENSOR.values())


def read_bytes(path: str) -> bytes:
    """A capture file's bytes, for ``loads`` (a one-line CaptureFileError when it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CaptureFileError(f"{path}: cannot read ({e.strerror})") from None


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


def loads(buf: bytes, path: str = "<capture>", tensors: Optional[Iterable[str]] = None,
          raw_fp8: bool = False) -> Dict[str, Any]:
    """``load`` for a file's bytes already in memory (``path`` only names it in errors)."""
    if tensors is not None:
        tensors = [n for name in tensors for n in (name, name + SCALE_SUFFIX)]
    meta, recs = read_records(buf, path)
    wanted = set(recs) if tensors is None else set(tensors) & set(recs)
    arrays = {k: decode_tensor(k, v, path) for k, v in recs.items() if k in wanted}
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
