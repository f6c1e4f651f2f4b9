"""The seam table: which SGLang functions sglang_capture patches, per supported SGLang version.

Each supported release has one JSON file here (``sglang_<version>.json``) listing, per seam, the
SGLang module and qualified name that is wrapped, the hook in ``sglang_capture.server.hooks`` that wraps
it, the process it matters in, and a fingerprint (sha256 of the function's source). The
instrumentor refuses to patch a function whose source no longer matches its fingerprint, so an
SGLang upgrade fails loudly at start instead of writing misaligned rows. Installed as the
``sglang_capture.patches`` package (see setup.cfg's ``package_dir``).

The hooks were written against ``BASE_RELEASES``. In any other release's table, a seam whose
function differs from both base releases' says in ``differs`` what changed there and why its hook
still holds: the record of someone having read the hook against that source
(tests/test_seam_tables_static.py refuses a table without it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class Seam:
    """One patched SGLang function."""

    seam: str
    process: str  # "scheduler" or "main"
    module: str
    target: str  # qualified name inside ``module``, e.g. "Req.__init__"
    hook: str  # "sglang_capture.server.hooks.<module>:<function>"
    fingerprint: str  # "sha256:<hex>" of inspect.getsource(target)
    differs: str = ""  # outside BASE_RELEASES, for a function unlike both of theirs: what changed, why the hook holds


BASE_RELEASES = ("0.5.17", "0.5.23")


def _table_files() -> List[str]:
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.startswith("sglang_") and p.name.endswith(".json"))


def supported_versions() -> Tuple[str, ...]:
    """SGLang releases that have a seam table."""
    versions = (name[len("sglang_"):-len(".json")].replace("_", ".") for name in _table_files())
    return tuple(sorted(versions, key=lambda v: tuple(int(x) for x in v.split("."))))


def table_path(version: str) -> str:
    """Where one release's table is installed; KeyError when the release is not supported."""
    name = "sglang_" + version.replace(".", "_") + ".json"
    if name not in _table_files():
        raise KeyError(version)
    return str(resources.files(__name__).joinpath(name))


def load_table(version: str) -> List[Seam]:
    """The seams for one SGLang release; KeyError when the release is not supported."""
    with open(table_path(version)) as f:
        doc = json.load(f)
    return [Seam(**entry) for entry in doc["seams"]]


def unexplained(seams: Sequence[Seam]) -> List[str]:
    """One line per seam whose function differs from both ``BASE_RELEASES``' and whose record does
    not say how (empty ``differs``): a hook nobody has read against that source yet."""
    bases = [{s.seam: s.fingerprint for s in load_table(v)} for v in BASE_RELEASES]
    return [f"{s.seam}: {s.module}.{s.target} differs from SGLang {' and '.join(BASE_RELEASES)}'s and its record "
            f"does not say how; read hook {s.hook} against it and write its differs"
            for s in seams if not s.differs and all(b.get(s.seam) != s.fingerprint for b in bases)]
