"""Build a cached artifact once, even when several processes or threads ask for it at once.

The test bed caches a stub ``libcuda.so.1`` and the tiny models under ``~/.cache``. On a fresh
machine the first builds race: two servers started together (``bench/e2e.py``), or pytest and the
demo side by side. Each artifact is built into a private temporary folder under an exclusive
``flock`` and renamed into place, so a reader sees either nothing or the whole artifact, and a
process that waited on the lock finds the finished one instead of building it again.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

from sglang_capture.core.durable import lock_within

# A model conversion or wheel download another process is doing: long, but not forever.
BUILD_TIMEOUT_S = 1800.0

DEFAULT_CACHE = os.path.join("~", ".cache", "sglang-capture-tests")


def cache_dir() -> str:
    """The test bed's cache folder: ``$SGLANG_CAPTURE_TEST_CACHE`` or ``~/.cache/sglang-capture-tests``."""
    return os.path.abspath(os.path.expanduser(os.environ.get("SGLANG_CAPTURE_TEST_CACHE", DEFAULT_CACHE)))


def build_once(path: str, build: Callable[[str], None], stamp: str = "") -> str:
    """Return the folder ``path``, calling ``build(tmp)`` to fill a fresh folder first if ``path``
    is missing or its stamp differs from ``stamp`` (a rebuild replaces the old folder whole).

    ``flock`` locks belong to an open file description, so this excludes threads of one process
    as well as other processes; the lock file is left behind, empty, beside ``path``.
    """
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    stamp_file = os.path.join(path, ".built")
    with open(path + ".lock", "a") as lock:
        lock_within(lock.fileno(), f"{path}.lock (another process is building {os.path.basename(path)})",
                    timeout_s=BUILD_TIMEOUT_S)
        if read_text(stamp_file) == stamp:
            return path
        tmp = tempfile.mkdtemp(prefix=os.path.basename(path) + ".", dir=parent)
        try:
            build(tmp)
            with open(os.path.join(tmp, ".built"), "w") as f:
                f.write(stamp)
            if os.path.lexists(path):
                old = tempfile.mkdtemp(prefix=os.path.basename(path) + ".old.", dir=parent)
                os.replace(path, os.path.join(old, "x"))
                shutil.rmtree(old, ignore_errors=True)
            os.replace(tmp, path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def read_text(path: str) -> object:
    """The file's text, or None when it cannot be read (a stamp not written yet)."""
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None
