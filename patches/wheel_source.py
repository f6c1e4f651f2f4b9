"""The patched functions of an SGLang release, read from its wheel without installing it.

A seam's fingerprint is the sha256 of its function's dedented source, decorators included, as
``inspect.getsource`` gives it for the installed function (version_gate.fingerprint). The
same lines can be found statically: the wheel is a zip, the module's source is in it, and
``ast`` gives the function's first decorator line and its last line. So every release can be
checked against its table in CI from a download of a few tens of MB, without its dependencies
(``pip download --no-deps sglang==X``, from PyPI; the wheels are cached).
"""
from __future__ import annotations

import ast
import glob
import hashlib
import os
import subprocess
import sys
import textwrap
import zipfile
from typing import Dict, List, Optional

from sglang_capture.patches.version_gate import checksum_tag


class WheelUnavailable(RuntimeError):
    """The release's wheel could not be downloaded (no network, or no such release)."""


def default_cache() -> str:
    return os.path.join(os.path.expanduser("~"), ".cache", "sglang-capture-tests", "sglang-wheels")


def fetch_wheel(version: str, cache: Optional[str] = None) -> str:
    """The path of ``sglang==version``'s wheel in ``cache``, downloaded once (needs PyPI)."""
    cache = cache or default_cache()
    found = glob.glob(os.path.join(cache, f"sglang-{version}-*.whl"))
    if found:
        return found[0]
    os.makedirs(cache, exist_ok=True)
    r = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"sglang=={version}", "-d", cache], capture_output=True, text=True)
    found = glob.glob(os.path.join(cache, f"sglang-{version}-*.whl"))
    if r.returncode != 0 or not found:
        why = (r.stderr.strip().splitlines() or ["no wheel"])[-1]
        raise WheelUnavailable(f"cannot download sglang=={version} from PyPI: {why}")
    return found[0]


class WheelSource:
    """One release's Python sources, read from its wheel."""

    def __init__(self, wheel: str) -> None:
        self.wheel = wheel
        self._zip = zipfile.ZipFile(wheel)
        self._trees: Dict[str, ast.Module] = {}
        self._lines: Dict[str, List[str]] = {}

    def _module(self, module: str) -> ast.Module:
        if module not in self._trees:
            path = module.replace(".", "/") + ".py"
            try:
                text = self._zip.read(path).decode("utf-8")
            except KeyError:
                raise LookupError(f"{module} is not in {os.path.basename(self.wheel)}") from None
            self._lines[module] = text.splitlines(keepends=True)
            self._trees[module] = ast.parse(text)
        return self._trees[module]

    def source(self, module: str, target: str) -> str:
        """The dedented source of ``module``'s ``target`` ("Class.method" or "function"), from its
        first decorator to its last line: what ``inspect.getsource`` gives for it installed."""
        node: ast.AST = self._module(module)
        for part in target.split("."):
            body = getattr(node, "body", [])
            matches = [n for n in body if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
                       and n.name == part]
            if not matches:
                raise LookupError(f"{module}.{target} is not in {os.path.basename(self.wheel)}")
            node = matches[-1]  # a later definition wins, as at import
        first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
        lines = self._lines[module][first - 1:node.end_lineno]
        return textwrap.dedent("".join(lines))

    def fingerprint(self, module: str, target: str) -> str:
        """The seam table's fingerprint of ``module.target`` in this release."""
        return checksum_tag(hashlib.sha256(self.source(module, target).encode()))
