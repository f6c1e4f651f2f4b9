"""The seam table: which SGLang functions sglang_capture patches, per supported SGLang version.

Each supported release has one JSON file here (``sglang_<version>.json``) listing, per seam, the
SGLang module and qualified name that is wrapped, the hook in ``sglang_capture.server.hooks`` that wraps
it, the process it matters in, and a fingerprint (sha256 of the function's source). The
instrumentor refuses to patch a function whose source no longer matches its fingerprint, so an
SGLang upgrade fails loudly at start instead of writing misaligned rows. Installed as the
``sglang_capture.patches`` package (see setup.cfg's ``package_dir``).

The hooks also rely on SGLang functions they do not wrap: each model's EAGLE-3 layer setter and
decoder loop (the layer convention, core/layers.py), the decode result loop's order, where a
batch's ``prefix_lens`` and row counts come from, the result copy's wrapper. Those are the table's
``watched`` records, fingerprinted the same way but only checked statically (CI reads each
release's wheel): a release that changes a layer rule fails CI until someone reads it, instead
of exported draft configs silently naming layers SGLang does not capture.

The hooks were written against ``BASE_RELEASES``. In any other release's table, a record whose
function differs from both base releases' says in ``differs`` what changed there and why what
relies on it still holds, starting with ``read <what relies on it>: ``: the record of someone
having read that code against that source (tests/test_seam_tables_static.py refuses a table
without it).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import List, Sequence, Tuple, Union


@dataclass(frozen=True)
class Seam:
    """One patched SGLang function."""

    seam: str
    process: str  # "scheduler" or "http"
    module: str
    target: str  # qualified name inside ``module``, e.g. "Req.__init__"
    hook: str  # "sglang_capture.server.hooks.<module>:<function>"
    fingerprint: str  # "sha256:<hex>" of inspect.getsource(target)
    differs: str = ""  # outside BASE_RELEASES, for a function unlike both of theirs: what changed, why the hook holds


@dataclass(frozen=True)
class Watched:
    """An SGLang function the package relies on without wrapping it (checked statically only)."""

    name: str
    module: str
    target: str
    relied_on_by: str  # "sglang_capture.<module>:<function>": the code whose assumption this is
    assumes: str  # what that code assumes of the function
    fingerprint: str
    differs: str = ""


Record = Union[Seam, Watched]
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


def _load(version: str) -> dict:
    with open(table_path(version)) as f:
        return json.load(f)


def load_table(version: str) -> List[Seam]:
    """The seams for one SGLang release; KeyError when the release is not supported."""
    return [Seam(**entry) for entry in _load(version)["seams"]]


def load_watched(version: str) -> List[Watched]:
    """The functions one SGLang release's hooks rely on without wrapping them."""
    return [Watched(**entry) for entry in _load(version).get("watched", [])]


def key(record: Record) -> str:
    """The record's name within its table."""
    return record.seam if isinstance(record, Seam) else record.name


def reader(record: Record) -> str:
    """The code that was written against the record's function: its hook, or what relies on it."""
    return record.hook if isinstance(record, Seam) else record.relied_on_by


def note_prefix(record: Record) -> str:
    """How a ``differs`` note begins: naming the code its writer read against the new source."""
    return f"read {reader(record).removeprefix('sglang_capture.')}: "


def unexplained(records: Sequence[Record]) -> List[str]:
    """One line per record whose function differs from both ``BASE_RELEASES``' and whose note does
    not say how (empty ``differs``), or does not name the code read against it: a hook, or code
    relying on SGLang, that nobody has read against that source yet."""
    bases = [{(type(r), key(r)): r.fingerprint for r in [*load_table(v), *load_watched(v)]} for v in BASE_RELEASES]
    lines = []
    for r in records:
        if any(b.get((type(r), key(r))) == r.fingerprint for b in bases):
            continue
        what = f"{key(r)}: {r.module}.{r.target} differs from SGLang {' and '.join(BASE_RELEASES)}'s"
        if not r.differs:
            lines.append(f"{what} and its record does not say how; read {'hook ' if isinstance(r, Seam) else ''}"
                         f"{reader(r)} against it and write its differs")
        elif not r.differs.startswith(note_prefix(r)):
            lines.append(f"{what} and its note does not name the code read against it; start it with "
                         f"{note_prefix(r)!r}")
    return lines
