"""The seam table: which SGLang functions sglang_capture patches, per supported SGLang version.

Each supported release has one JSON file here (``sglang_<version>.json``) listing, per seam, the
SGLang module and qualified name that is wrapped, the hook in ``sglang_capture.server.hooks`` that wraps
it, the process it matters in, and a fingerprint (sha256 of the function's source). The
instrumentor refuses to patch a function whose source no longer matches its fingerprint, so an
SGLang upgrade fails loudly at start instead of writing misaligned rows. Installed as the
``sglang_capture.patches`` package (see setup.cfg's ``package_dir``).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from typing import List, Tuple


@dataclass(frozen=True)
class Seam:
    """One patched SGLang function."""

    seam: str
    process: str  # "scheduler" or "main"
    module: str
    target: str  # qualified name inside ``module``, e.g. "Req.__init__"
    hook: str  # "sglang_capture.server.hooks.<module>:<function>"
    fingerprint: str  # "sha256:<hex>" of inspect.getsource(target)


def _table_files() -> List[str]:
    return sorted(p.name for p in resources.files(__name__).iterdir() if p.name.startswith("sglang_") and p.name.endswith(".json"))


def supported_versions() -> Tuple[str, ...]:
    """SGLang releases that have a seam table."""
    return tuple(name[len("sglang_"):-len(".json")].replace("_", ".") for name in _table_files())


def load_table(version: str) -> List[Seam]:
    """The seams for one SGLang release; KeyError when the release is not supported."""
    name = "sglang_" + version.replace(".", "_") + ".json"
    if name not in _table_files():
        raise KeyError(version)
    doc = json.loads(resources.files(__name__).joinpath(name).read_text())
    return [Seam(**entry) for entry in doc["seams"]]
