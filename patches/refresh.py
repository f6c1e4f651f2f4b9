"""Maintainer tool: a release's seam table, and which hooks need a look before it is supported.

    python -m sglang_capture.patches.refresh --from-wheel 0.5.20 [--out patches/sglang_0_5_20.json]
    python -m sglang_capture.patches.refresh patches/sglang_0_5_17.json      (from the installed SGLang)

``--from-wheel`` reads the release's patched functions from its wheel (patches/wheel_source.py,
downloaded from PyPI without dependencies), starting from the newest supported table, and says
per seam whether its function is the same as in a supported release (``--against`` narrows the
comparison) or changed. A changed one needs its hook read against the new source, and the
record's ``differs`` written (what changed, why the hook holds) before the table goes into
``patches/``: a table there is what makes the launcher accept a release, and CI refuses one with a
changed seam left unexplained. Then run the whole suite on that release's venv
(``make test SGLANG_VERSION=X``).
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_capture.patches import BASE_RELEASES, Seam, Watched, key, load_table, load_watched, reader, supported_versions


def _from_installed(path: str) -> None:
    from sglang_capture.patches.version_gate import fingerprint, resolve

    with open(path) as f:
        doc = json.load(f)
    for entry in doc["seams"] + doc.get("watched", []):
        _, _, original = resolve(Seam(**entry) if "seam" in entry else Watched(**entry))
        found = fingerprint(original)
        if found != entry["fingerprint"]:
            entry["differs"] = ""  # a note about other source: read the hook again
        entry["fingerprint"] = found
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


def _release_key(version: str) -> Tuple[int, ...]:
    return tuple(int(x) for x in version.split("."))


def _nearest_at_or_below(version: str) -> Optional[str]:
    """The newest supported release that is not newer than ``version`` (None when all are)."""
    older = [v for v in supported_versions() if _release_key(v) <= _release_key(version)]
    return max(older, key=_release_key) if older else None


def compare_release(version: str, cache: str = "", against: Sequence[str] = ()) -> Tuple[Dict, List[str]]:
    """The table ``version`` would have (seams and watched functions of the newest supported
    table, fingerprints read from its wheel) and one line per record saying whether it needs a
    look. A function equal to one in a table of ``against`` (default: every supported release)
    takes that record's ``differs``; one unlike both base releases' and every table's is left with
    an empty ``differs`` for the maintainer to fill in after reading the code that relies on it
    (the static test refuses the table until then)."""
    from sglang_capture.patches.wheel_source import WheelSource, fetch_wheel

    against = tuple(against) or supported_versions()
    known = {v: {(type(r), key(r)): r for r in [*load_table(v), *load_watched(v)]} for v in against}
    newest = supported_versions()[-1]
    watched: Dict[str, Watched] = {}  # every watched function of any table (some exist in a few releases only)
    for v in reversed(supported_versions()):
        for w in load_watched(v):
            watched.setdefault(w.name, w)
    # a watched function may come or go between releases, but one that the nearest supported
    # release at or below this one has is a change to read
    nearest = _nearest_at_or_below(version)
    nearest_watched = {w.name for w in load_watched(nearest)} if nearest else set()
    source = WheelSource(fetch_wheel(version, cache or None))
    out: Dict[str, List[Dict]] = {"seams": [], "watched": []}
    lines = []
    for record in [*load_table(newest), *(watched[n] for n in sorted(watched))]:
        name = key(record) if isinstance(record, Seam) else f"watched {key(record)}"
        what = f"hook {reader(record)}" if isinstance(record, Seam) else reader(record)
        k = (type(record), key(record))
        try:
            fp = source.fingerprint(record.module, record.target)
        except LookupError as e:
            if isinstance(record, Watched) and nearest and record.name not in nearest_watched:
                lines.append(f"{name}: absent, as in {nearest}")
            else:
                lines.append(f"{name}: MISSING ({e}); {what} needs a new target")
            continue
        same = [v for v, table in known.items() if k in table and table[k].fingerprint == fp]
        differs = next((known[v][k].differs for v in same), "")
        if any(v in BASE_RELEASES for v in same):
            differs = ""
        lines.append(f"{name}: same as {', '.join(same)}" if same else
                     f"{name}: CHANGED in {record.module}.{record.target}; read {what} against it, "
                     f"then say in its differs what changed and why "
                     f"{'the hook holds' if isinstance(record, Seam) else 'its assumption holds'}")
        out["seams" if isinstance(record, Seam) else "watched"].append({**asdict(record), "fingerprint": fp,
                                                                         "differs": differs})
    return {"sglang": version, **out}, lines


def main(argv: List[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("table", nargs="?", help="refresh this table from the installed SGLang")
    ap.add_argument("--from-wheel", metavar="VERSION", help="compare SGLang VERSION's wheel with the supported tables")
    ap.add_argument("--out", help="with --from-wheel: write the release's table here")
    ap.add_argument("--against", default="", help="with --from-wheel: ','-separated supported releases to compare "
                    "with (default: all of them)")
    a = ap.parse_args(argv)
    if a.from_wheel:
        from sglang_capture.patches.wheel_source import WheelUnavailable

        against = [v for v in a.against.split(",") if v]
        unknown = [v for v in against if v not in supported_versions()]
        if unknown:
            ap.error(f"--against {','.join(unknown)}: not a supported release ({', '.join(supported_versions())})")
        try:
            table, lines = compare_release(a.from_wheel, against=against)
        except WheelUnavailable as e:
            print(f"refresh: {e}", file=sys.stderr)
            return 1
        print("\n".join(lines))
        if a.out:
            with open(a.out, "w") as f:
                json.dump(table, f, indent=2)
                f.write("\n")
        return 0 if all(": same as" in line or ": absent, as in" in line for line in lines) else 3
    if not a.table:
        ap.error("give a table to refresh from the installed SGLang, or --from-wheel VERSION")
    _from_installed(a.table)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
