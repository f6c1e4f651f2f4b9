"""``sglang-capture inspect FILE``: what one capture file holds, without decoding the tensors (for a
file whose rows lie in shared blocks, schema v3: each block, and the row tensors they hold for it)."""
from __future__ import annotations

import os
from typing import Dict, List, Tuple

from sglang_capture.core.blocks import BLOCKS_KEY
from sglang_capture.core.final_state import META_KEY as FINAL_META_KEY
from sglang_capture.core.final_state import file_final
from sglang_capture.core.format import SCHEMA_REFS, CaptureFileError, record_stats
from sglang_capture.core.reader import block_refs, load_records, read_block


def _blocks(meta: dict, path: str) -> Tuple[List[str], Dict[str, Dict]]:
    """The shared blocks a v3 file's rows lie in, one line each (rows, and which block holds them),
    and the stats of the row tensors they hold for it (``record_stats``' keys, over its rows: stored
    bytes are of the blocks' files, each counted once)."""
    refs = block_refs(meta, path)
    lines = [f"{BLOCKS_KEY:<22} {len(refs)} shared blocks in {os.path.join(os.path.dirname(path) or '.', '.blocks')}:"]
    stats: Dict[str, Dict] = {}
    for ref in refs:
        _, _, recs = read_block(path, ref)
        lines.append(f"  rows {ref.first:>7}-{ref.last - 1:<7} block {ref.name} (its rows {ref.first - ref.start}-"
                     f"{ref.last - ref.start - 1})")
        for name, rec in recs.items():
            if name == "tokens":
                continue
            s, rows = record_stats(rec), ref.last - ref.first
            row_bytes = (s["raw_bytes"] or 0) // max(s["shape"][0], 1)
            total = stats.setdefault(name, {**s, "shape": [0, *s["shape"][1:]], "frames": 0, "raw_bytes": 0,
                                            "stored_bytes": 0})
            total["shape"][0] += rows
            total["frames"] += s["frames"]
            total["raw_bytes"] += rows * row_bytes
            total["stored_bytes"] += s["stored_bytes"]
    return lines, stats


def describe_file(path: str) -> List[str]:
    """Printable lines: metadata, then one line per tensor with its codec and compression ratio."""
    meta, recs = load_records(path)
    try:
        stats = {name: record_stats(rec) for name, rec in recs.items()}
    except (TypeError, AttributeError):
        raise CaptureFileError(f"{path}: a tensor record is malformed; the file is corrupted") from None
    block_lines: List[str] = []
    if meta.get("schema") == SCHEMA_REFS:
        block_lines, in_blocks = _blocks(meta, path)
        stats.update(in_blocks)
    size = os.path.getsize(path)
    stored = size + sum(s["stored_bytes"] for name, s in stats.items() if name not in recs)
    raw = sum(int(s["raw_bytes"] or 0) for s in stats.values())
    lines = [f"file      {path}", f"size      {size:,} bytes" + (f", {stored:,} with its blocks" if block_lines else "")
             + f" ({raw:,} raw tensor bytes, ratio {raw / max(stored, 1):.2f}x)"]
    for key in sorted(meta):
        if key == BLOCKS_KEY and isinstance(meta[key], list):
            continue
        lines.append(f"{key:<22} {meta[key]}")
    lines += block_lines
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
