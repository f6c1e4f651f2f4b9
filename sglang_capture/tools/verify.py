"""``sglang-capture verify DIR``: is every sample there, complete, and sane?

Every file is decoded in full (zstd frame checksums, sizes), with every shared block it references
(schema v3: each one named when it is missing, corrupt or not the block referenced), its tensors
are checked against its own metadata (row counts, widths, dtypes, loss mask values, NaN/Inf), and, when the
directory has a manifest, the manifest is checked against the files: missing, extra, duplicate,
size and checksum. Problems are one line each; the caller turns "any problem" into exit 1.
"""
from __future__ import annotations

import os
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from sglang_capture.core.checksum import UnknownChecksum, matches
from sglang_capture.core.final_state import FINAL_CHOICES, kept_states
from sglang_capture.core.final_state import TENSOR as FINAL_TENSOR
from sglang_capture.core.format import SCHEMA_REFS, CaptureFileError, read_records, row_count
from sglang_capture.core.names import FILE_SUFFIX
from sglang_capture.core.reader import check_blocks, check_seal, loads
from sglang_capture.tools.manifest import MANIFEST, read_manifest


@dataclass
class VerifyReport:
    files: int = 0
    good_files: int = 0
    manifest_entries: Optional[int] = None
    problems: List[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_tensors(d: Dict) -> List[str]:
    """Shape/dtype/value problems of one loaded capture, judged against its own metadata."""
    problems = []
    missing = [k for k in ("input_ids", "output_ids", "hidden_size", "layers") if d.get(k) is None]
    if missing:  # a decodable file that is not a capture
        return [f"no {', '.join(missing)}: not a capture file of this package"]
    P, G = d["input_ids"].numel(), d["output_ids"].numel()
    N, H, L = row_count(P, G), d["hidden_size"], len(d["layers"])
    expect = {"aux_hidden_states": (N, L * H), **{name: (N, H) for name in FINAL_TENSOR.values()}}
    final = d.get("final")
    if final is not None and final not in FINAL_CHOICES:
        problems.append(f"metadata final is {final!r}, not one of {', '.join(FINAL_CHOICES)}")
        final = None
    kept = {"aux_hidden_states"} | {FINAL_TENSOR[kind] for kind in (kept_states(final) if final else ())}
    for name, shape in expect.items():
        t = d.get(name)
        if t is None:
            if name in kept:
                problems.append(f"no {name} tensor (the file says it holds it)")
            continue
        if tuple(t.shape) != shape:
            problems.append(f"{name} has shape {tuple(t.shape)}, expected {shape} from {P} prompt + {G} output tokens")
        elif t.dtype != getattr(torch, str(d["meta"].get("dtype", "")), None):
            problems.append(f"{name} is {t.dtype}, but the file says the model served {d['meta'].get('dtype')}")
        elif t.numel() and not bool(torch.isfinite(t).all()):
            problems.append(f"{name} has {int((~torch.isfinite(t)).sum())} NaN/Inf values")
    mask = d.get("loss_mask")
    if mask is not None and (tuple(mask.shape) != (P,) or bool(((mask != 0) & (mask != 1)).any())):
        problems.append(f"loss_mask must be 0/1 of length {P}, got shape {tuple(mask.shape)}")
    return problems


def check_file(path: str, checksum: Optional[str] = None) -> List[str]:
    """Problems of one file, each prefixed with its name; the file is read once, for the
    manifest's ``checksum`` (when given) and the decode alike."""
    name = os.path.basename(path)
    try:
        with open(path, "rb") as f:
            buf = f.read()
    except OSError as e:
        return [f"{name}: cannot read ({e.strerror})"]
    problems = []
    if checksum is not None:
        try:
            if not matches(buf, checksum):
                problems.append(f"{name}: checksum differs from the manifest (the file changed after it was written)")
        except UnknownChecksum as e:
            problems.append(f"{name}: the manifest's {e}")
    try:
        meta, recs = read_records(buf, path)
        if meta.get("schema") == SCHEMA_REFS:
            check_seal(meta, recs, path)
            broken = check_blocks(meta, path)
            if broken:
                return problems + [f"{name}: {p}" for p in broken]
        d = loads(buf, path)
    except CaptureFileError as e:
        return problems + [f"{name}: corrupt: {str(e).split(': ', 1)[-1]}"]
    return problems + [f"{name}: {p}" for p in check_tensors(d)]


def _check_manifest(directory: str, files: List[str], report: VerifyReport) -> Dict[str, str]:
    """Manifest-level problems; returns file -> checksum for the per-file pass to compare."""
    entries, problems = read_manifest(directory)
    report.manifest_entries = len(entries)
    report.problems += problems
    for key, what in (("id", "sample id"), ("file", "file")):
        for value, n in Counter(getattr(e, key) for e in entries).items():
            if n > 1:
                report.problems.append(f"{MANIFEST}: duplicate {what} {value!r} listed {n} times")
    listed = {e.file for e in entries}
    for e in entries:
        path = os.path.join(directory, e.file)
        if not os.path.isfile(path):
            report.problems.append(f"{e.file}: missing (sample {e.id!r} is in the manifest)")
        elif os.path.getsize(path) != e.bytes:
            report.problems.append(f"{e.file}: {os.path.getsize(path):,} bytes, the manifest says {e.bytes:,}")
    for f in files:
        if f not in listed:
            report.problems.append(f"{f}: extra (not in the manifest)")
    return {e.file: e.checksum for e in entries}


def verify_dir(directory: str, workers: int = 4, progress: bool = True) -> VerifyReport:
    """Check a capture or sample directory; see the module docstring."""
    from tqdm import tqdm

    if not os.path.isdir(directory):
        raise FileNotFoundError(f"{directory} is not a directory")
    files = sorted(f for f in os.listdir(directory) if f.endswith(FILE_SUFFIX) and not f.startswith("."))
    report = VerifyReport(files=len(files))
    checksums: Dict[str, str] = {}
    if os.path.exists(os.path.join(directory, MANIFEST)):
        checksums = _check_manifest(directory, files, report)
    with ThreadPoolExecutor(max(1, workers)) as pool:
        results = pool.map(lambda f: check_file(os.path.join(directory, f), checksums.get(f)), files)
        for problems in tqdm(results, total=len(files), unit="file", disable=None if progress else True):
            report.problems += problems
            report.good_files += not problems
    return report
