"""Maintainer tool: write the installed SGLang's fingerprints into a seam table.

    python -m sglang_capture.patches.refresh patches/sglang_0_5_17.json

Run it only after reading each seam's new source and checking the hook still fits it: the
fingerprints are what stops an unreviewed SGLang release from being patched.
"""
from __future__ import annotations

import json
import sys

from sglang_capture.patches import Seam
from sglang_capture.server.instrumentor import _resolve, fingerprint


def refresh(path: str) -> None:
    with open(path) as f:
        doc = json.load(f)
    for entry in doc["seams"]:
        _, _, original = _resolve(Seam(**entry))
        entry["fingerprint"] = fingerprint(original)
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)
        f.write("\n")


if __name__ == "__main__":
    refresh(sys.argv[1])
