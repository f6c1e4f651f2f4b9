"""Reading capture files: ``load(path)`` and nothing else.

Only msgpack and raw bytes are decoded: no pickle, so a file from an untrusted source can at
worst fail to load, never run code.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Tuple, Union

from sglang_capture.core.format import CaptureFileError, parse_capture, read_records

_ARRAY_NAMES = ("input_ids", "output_ids", "loss_mask", "aux_hidden_states", "last_hidden_states")


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as e:
        raise CaptureFileError(f"{path}: cannot read ({e.strerror})") from None


def load_records(path: Union[str, os.PathLike]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """A file's metadata and its raw tensor records, nothing decompressed (for ``inspect``)."""
    path = os.fspath(path)
    return read_records(_read(path), path)


def load(path: Union[str, os.PathLike], tensors: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Load one capture file into a dict of tensors (serving dtype kept) and metadata.

    Keys: ``rid``, ``input_ids`` int64 [P], ``output_ids`` int64 [G], ``aux_hidden_states``
    [N, len(layers)*H], ``last_hidden_states`` [N, H] (when kept), ``loss_mask`` int64 [P]
    (when the request sent ``capture_loss_mask``, e.g. from ``sglang-capture extract``), ``layers``,
    ``layer_convention``, ``hidden_size``, ``model``, ``sglang_version``, ``schema`` and the
    rest of the file's metadata under ``meta``. ``tensors`` limits which tensors are decoded.
    """
    path = os.fspath(path)
    return loads(_read(path), path, tensors)


def loads(buf: bytes, path: str = "<capture>", tensors: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """``load`` for a file's bytes already in memory (``path`` only names it in errors)."""
    meta, arrays = parse_capture(buf, path, tensors)
    try:
        out: Dict[str, Any] = {
            "rid": str(meta["rid"]),
            "layers": [int(i) for i in meta["layers"]],
            "layer_convention": str(meta["layer_convention"]),
            "hidden_size": int(meta["hidden_size"]),
            "model": str(meta["model"]),
            "sglang_version": str(meta["sglang_version"]),
            "schema": str(meta["schema"]),
            "meta": meta,
        }
    except (KeyError, TypeError, ValueError) as e:
        raise CaptureFileError(f"{path}: metadata is incomplete ({e!r})") from None
    out.update({k: arrays[k] for k in _ARRAY_NAMES if k in arrays})
    return out
