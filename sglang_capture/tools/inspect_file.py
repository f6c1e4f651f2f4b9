"""``sglang-capture inspect FILE``: what one capture file holds, without decoding the tensors."""
from __future__ import annotations

import os
from typing import List

from sglang_capture.core.final_state import META_KEY as FINAL_META_KEY
from sglang_capture.core.final_state import file_final
from sglang_capture.core.format import CaptureFileError, record_stats
from sglang_capture.core.reader import load_records


def describe_file(path: str) -> List[str]:
    """Printable lines: metadata, then one line per tensor with its codec and compression ratio."""
    meta, recs = load_records(path)
    try:
        stats = {name: record_stats(rec) for name, rec in recs.items()}
    except (TypeError, AttributeError):
        raise CaptureFileError(f"{path}: a tensor record is malformed; the file is corrupted") from None
    size = os.path.getsize(path)
    raw = sum(int(s["raw_bytes"] or 0) for s in stats.values())
    lines = [f"file      {path}", f"size      {size:,} bytes ({raw:,} raw tensor bytes, ratio {raw / max(size, 1):.2f}x)"]
    for key in sorted(meta):
        lines.append(f"{key:<22} {meta[key]}")
    if FINAL_META_KEY not in meta:  # written before --capture-final: shown as load() reads it
        lines.append(f"{FINAL_META_KEY:<22} {file_final(meta, recs)}")
    lines.append("tensors:")
    lines.append(f"  {'name':<34} {'dtype':<13} {'shape':<16} {'codec':<6} {'shuffle':>7} {'frames':>6} "
                 f"{'raw bytes':>13} {'stored':>13} {'ratio':>6}")
    for name, s in stats.items():
        ratio = (s["raw_bytes"] or 0) / max(s["stored_bytes"], 1)
        lines.append(f"  {name:<34} {s['dtype']!s:<13} {str(s['shape']):<16} {s['codec']!s:<6} {s['shuffle']!s:>7} "
                     f"{s['frames']:>6} {s['raw_bytes'] or 0:>13,} {s['stored_bytes']:>13,} {ratio:>5.2f}x")
    return lines
