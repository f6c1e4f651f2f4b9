"""The process boundaries the README promises: what each part of the tree may import, and the
README's map of the tree naming every module that exists (and nothing that does not)."""
from __future__ import annotations

import json
import os
import pkgutil
import re
import subprocess
import sys

import pytest

import sglang_capture

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.dirname(sglang_capture.__file__)


def _modules(subpackage: str):
    return [m.name for m in pkgutil.walk_packages([os.path.join(PACKAGE, subpackage)], f"sglang_capture.{subpackage}.")]


def _imported_after(modules) -> set:
    """Top-level packages in sys.modules after importing ``modules`` in a fresh interpreter."""
    code = ("import importlib, json, sys\n"
            f"for m in {list(modules)!r}: importlib.import_module(m)\n"
            "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return set(json.loads(out.stdout.strip().splitlines()[-1]))


# doctor checks the installed SGLang's functions against the seam table, so it must import them.
@pytest.mark.parametrize("part", ["tools", "core"])
def test_offline_tools_and_the_shared_core_never_import_sglang(part):
    modules = [m for m in _modules(part) if m != "sglang_capture.tools.doctor"]
    assert modules
    assert "sglang" not in _imported_after(modules)


def test_a_writer_process_imports_neither_torch_nor_sglang():
    loaded = _imported_after(_modules("writer"))
    assert not {"torch", "sglang"} & loaded


def test_the_readme_map_names_every_module_and_only_existing_ones():
    readme = open(os.path.join(ROOT, "README.md")).read()
    table = readme[readme.index("## What exactly happens"):readme.index("Choices worth knowing:")]
    named = set(re.findall(r"`(sglang_capture/[\w/]+\.py|patches/[\w.]+\.json)`", table))
    assert all(os.path.exists(os.path.join(ROOT, p)) for p in named), sorted(p for p in named if not os.path.exists(p))
    modules = {os.path.relpath(os.path.join(d, f), ROOT)
               for d, _, files in os.walk(PACKAGE) if "testbed" not in d and "__pycache__" not in d
               for f in files if f.endswith(".py") and f not in ("__init__.py", "__main__.py")}
    assert modules - named == set()


def test_the_readme_documents_every_launcher_option_and_no_other():
    from dataclasses import fields

    from sglang_capture.core.config import CaptureConfig

    readme = open(os.path.join(ROOT, "README.md")).read()
    flags = {flag for f in fields(CaptureConfig) for flag in f.metadata["option"]["flag"].split("/")}
    documented = set(re.findall(r"--capture-[a-z-]+", readme))
    assert flags - documented == set() and documented - flags == set(), (flags - documented, documented - flags)


def test_only_the_capture_plugin_is_an_sglang_entry_point_of_this_install():
    """The test bed's CPU patches reach its own servers through their PYTHONPATH, never through an
    entry point that every SGLang server of a user's install would load."""
    from importlib.metadata import entry_points

    ours = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins") if ep.value.startswith("sglang_capture")}
    assert ours == {"sglang_capture": "sglang_capture.server.plugin:register"}
