"""File names inside the capture directory: never anything that could leave it.

A request may name its file (``capture_name``); otherwise the SGLang request id is used. Names
are accepted only from a small safe alphabet. A rid that is not safe (SGLang does not restrict
client-supplied rids) is replaced by a digest, so no client input ever becomes a path component.
"""
from __future__ import annotations

import hashlib
import re

FILE_SUFFIX = ".capture.msgpack"
MAX_NAME_LEN = 128
_SAFE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,%d}" % (MAX_NAME_LEN - 1))


class BadCaptureName(ValueError):
    """A client-supplied ``capture_name`` that cannot be used as a file name."""


def check_capture_name(name: object) -> str:
    """Return ``name`` if it is a safe file stem, else raise BadCaptureName with a one-line reason."""
    if not isinstance(name, str):
        raise BadCaptureName(f"capture_name must be a string, got {type(name).__name__}")
    if len(name) > MAX_NAME_LEN:
        raise BadCaptureName(f"capture_name is {len(name)} characters long; the limit is {MAX_NAME_LEN}")
    if not _SAFE.fullmatch(name) or ".." in name:
        raise BadCaptureName(
            "capture_name may only use letters, digits, '.', '_' and '-', must start with a letter or digit "
            f"and must not contain '..'; got {name[:40]!r}"
        )
    return name


def name_for_rid(rid: str) -> str:
    """A file stem for a request id: the rid itself when safe, else a digest of it."""
    if len(rid) <= MAX_NAME_LEN and _SAFE.fullmatch(rid) and ".." not in rid:
        return rid
    return "rid-" + hashlib.sha256(rid.encode("utf-8", "surrogatepass")).hexdigest()[:32]
