"""The package as a user installs it: a wheel built from the tree, installed into an empty target
outside the checkout, imported and run from there (an editable install hides a stale package list:
a wheel once lacked ``sglang_capture.core`` and every import failed)."""
from __future__ import annotations

import glob
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from typing import Dict, List

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _modules(trees) -> List[str]:
    """Every module under ``trees`` ((folder, package name) pairs), under its installed name."""
    names = []
    for base, prefix in trees:
        for path in glob.glob(os.path.join(base, "**", "*.py"), recursive=True):
            rel = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
            if "site" in rel.split("."):  # testbed/site/sitecustomize.py is data for the test bed's servers
                continue
            parts = [p for p in rel.split(".") if p != "__init__"]
            names.append(".".join([prefix, *parts]))
    return sorted(names)


def _source_modules() -> List[str]:
    """Every module the tree holds, under the names it has once installed."""
    return _modules(((os.path.join(ROOT, "sglang_capture"), "sglang_capture"),
                     (os.path.join(ROOT, "patches"), "sglang_capture.patches")))


@dataclass
class Installed:
    target: str  # the pip --target directory the wheel went into
    cwd: str  # outside the checkout
    env: Dict[str, str]

    def run(self, argv: List[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, capture_output=True, text=True, timeout=300, cwd=self.cwd, env=self.env)


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    """The wheel built from this tree, installed with ``pip --target`` into an empty directory."""
    work = tmp_path_factory.mktemp("wheel")
    src, dist, target = work / "src", work / "dist", work / "site"
    # the tracked files only: a build/ or *.egg-info left in the checkout cannot leak into the wheel
    tracked = subprocess.run(["git", "-C", ROOT, "ls-files", "-z"], capture_output=True, check=True).stdout
    for rel in filter(None, tracked.decode().split("\0")):
        if os.path.isfile(os.path.join(ROOT, rel)):
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, rel), src / rel)
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                            "-w", str(dist), str(src)], capture_output=True, text=True, timeout=600, cwd=str(work))
    assert build.returncode == 0, build.stderr[-3000:]
    wheels = glob.glob(str(dist / "sglang_capture-*.whl"))
    assert len(wheels) == 1, os.listdir(dist)
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile",
                              "--target", str(target), wheels[0]], capture_output=True, text=True, timeout=600)
    assert install.returncode == 0, install.stderr[-3000:]
    return Installed(str(target), str(work), {**os.environ, "PYTHONPATH": str(target), "PYTHONNOUSERSITE": "1"})


_PROBE = r"""
import importlib, importlib.metadata as md, importlib.resources as res, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    module = importlib.import_module(name)
    out[name] = getattr(module, "__file__", None)
from sglang_capture import patches
dist = md.distribution("sglang-capture")
print(json.dumps({
    "files": out,
    "dist_at": str(dist.locate_file("")),
    "plugins": {e.name: e.value for e in dist.entry_points if e.group == "sglang.srt.plugins"},
    "scripts": {e.name: e.value for e in dist.entry_points if e.group == "console_scripts"},
    "versions": list(patches.supported_versions()),
    "seams": {v: len(patches.load_table(v)) for v in patches.supported_versions()},
    "demo_data": res.files("sglang_capture").joinpath("data/demo_conversations.jsonl").is_file(),
    "testbed_site": res.files("sglang_capture.testbed").joinpath("site/sitecustomize.py").is_file(),
}))
"""


def test_every_module_of_the_tree_imports_from_the_installed_wheel_outside_the_checkout(installed):
    shipped = _modules(((os.path.join(installed.target, "sglang_capture"), "sglang_capture"),))
    assert shipped == _source_modules()  # nothing missing, nothing left over from an old build
    modules = [m for m in _source_modules() if not m.endswith("__main__")]
    probe = installed.run([sys.executable, "-c", _PROBE, json.dumps(modules)])
    assert probe.returncode == 0, probe.stderr[-3000:]
    found = json.loads(probe.stdout.strip().splitlines()[-1])
    outside = {m: f for m, f in found["files"].items() if not f.startswith(installed.target + os.sep)}
    assert not outside, f"imported from elsewhere than the wheel's install: {outside}"
    assert found["dist_at"].rstrip(os.sep) == installed.target
    assert found["plugins"] == {"sglang_capture": "sglang_capture.server.plugin:register"}
    assert found["scripts"] == {"sglang-capture": "sglang_capture.tools.cli:main"}
    assert found["versions"] == [f"0.5.{n}" for n in range(17, 24)] and all(n == 24 for n in found["seams"].values())
    assert found["demo_data"] and found["testbed_site"]


def test_the_installed_commands_answer_help(installed):
    cli = installed.run([os.path.join(installed.target, "bin", "sglang-capture"), "--help"])
    assert cli.returncode == 0, cli.stderr[-3000:]
    assert all(cmd in cli.stdout for cmd in ("extract", "verify", "export", "doctor", "demo"))
    launch = installed.run([sys.executable, "-m", "sglang_capture.launch", "--help"])
    assert launch.returncode == 0, launch.stderr[-3000:]
    assert "--capture-dir" in launch.stdout and "--capture-dtype" in launch.stdout
