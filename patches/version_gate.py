"""The version gate: the installed SGLang against its seam table.

Here, beside the tables, because the gate is the table's own rule: a release without a table is
refused, and a function whose source no longer matches the table's fingerprint is refused. The
launcher, the instrumentor, ``doctor`` and ``refresh.py`` all ask this module, and nothing here
patches anything (server/instrumentor.py does, once the gate has passed).
"""
from __future__ import annotations

import hashlib
import importlib
import inspect
import textwrap
from importlib.metadata import PackageNotFoundError, version
from typing import Callable, List, Optional, Tuple

import wrapt

from sglang_capture.patches import Record, Seam, load_table, supported_versions


class UnsupportedSGLang(RuntimeError):
    """The installed SGLang is not one the seam table covers, or its code changed under a seam."""


def installed_sglang_version() -> str:
    """The installed SGLang's release, or a one-line UnsupportedSGLang when there is none."""
    try:
        return version("sglang")
    except PackageNotFoundError:
        raise UnsupportedSGLang("SGLang is not installed; install one of: " + ", ".join(supported_versions())) from None


def seams_for_installed() -> List[Seam]:
    """The seam table of the installed SGLang, or a one-line UnsupportedSGLang."""
    ver = installed_sglang_version()
    try:
        return load_table(ver)
    except KeyError:
        raise UnsupportedSGLang(
            f"sglang_capture supports SGLang {', '.join(supported_versions())}; found {ver}. "
            f"Install a supported release (pip install sglang=={supported_versions()[-1]})"
        ) from None


def checksum_tag(digest: "hashlib._Hash") -> str:
    """``<name>:<hex>`` of a hashlib digest: how the table writes a fingerprint (file checksums:
    core/checksum.py)."""
    return f"{digest.name}:{digest.hexdigest()}"


def fingerprint(func: Callable) -> str:
    """sha256 of a function's dedented source: what the seam table pins per SGLang release."""
    func = inspect.unwrap(getattr(func, "__func__", func))
    src = textwrap.dedent(inspect.getsource(func))
    return checksum_tag(hashlib.sha256(src.encode()))


def resolve(record: Record) -> Tuple[object, str, object]:
    """(parent, attribute, function) of a record's SGLang function, importing its module."""
    module = importlib.import_module(record.module)
    return wrapt.resolve_path(module, record.target)


def check_seam(seam: Seam) -> Optional[str]:
    """None when the installed function matches the table, else a one-line reason."""
    try:
        _, _, original = resolve(seam)
    except (ImportError, AttributeError) as e:
        return f"{seam.module}.{seam.target} is missing ({e})"
    found = fingerprint(getattr(original, "__wrapped__", original))
    if found != seam.fingerprint:
        return f"{seam.module}.{seam.target} changed (fingerprint {found[:19]}, expected {seam.fingerprint[:19]})"
    return None
