"""Reading capture files: ``load(path)`` and nothing else.

Only msgpack and raw bytes are decoded: no pickle, so a file from an untrusted source can at
worst fail to load, never run code.
"""
from __future__ import annotations

import os
from typing import Any, Dict, Iterable, Optional, Union

from sglang_capture.format import CaptureFileError, parse_capture

_TENSOR_KEYS = ("input_ids", "output_ids", "aux_hidden_states", "last_hidden_states")


def load(path: Union[str, os.PathLike], tensors: Optional[Iterable[str]] = None) -> Dict[str, Any]:
    """Load one capture file into a dict of tensors (serving dtype kept) and metadata.

    Keys: ``rid``, ``input_ids`` int64 [P], ``output_ids`` int64 [G], ``aux_hidden_states``
    [N, len(layers)*H], ``last_hidden_states`` [N, H] (when kept), ``layers``,
    ``layer_convention``, ``hidden_size``, ``model``, ``sglang_version``, ``schema`` and the
    rest of the file's metadata under ``meta``. ``tensors`` limits which tensors are decoded.
    """
    path = os.fspath(path)
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        raise CaptureFileError(f"{path}: cannot read ({e.strerror})") from None
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
    out.update({k: arrays[k] for k in _TENSOR_KEYS if k in arrays})
    return out
