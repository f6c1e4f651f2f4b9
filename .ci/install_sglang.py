"""Install one SGLang release into the running interpreter's environment, from PyPI alone.

    python .ci/install_sglang.py 0.5.20      (run with the venv's python; `make install` does)

SGLang 0.5.18 to 0.5.22 pin ``cuda-tile==1.6.0rc5``, whose PyPI file is a stub that downloads the
real wheel from pypi.nvidia.com at install time: unreachable here (only PyPI is), so a plain
``pip install sglang==0.5.20`` fails. This installs the release's own requirements (from its
wheel's metadata, extras left out) with each such pin replaced by the nearest release PyPI
serves, then SGLang itself without dependencies, and writes the replacement into the installed
SGLang's metadata: later pip runs (the package's own editable install) then see a consistent
environment instead of trying the stub again. Any other release installs as pip would.

Those releases' packages come from the package index (PyPI), not from a local wheel directory in
PIP_FIND_LINKS or pip's config files (left out for them):
this machine's holds a ``+cpu`` build of torch 2.13.0 (the pin of 0.5.18-0.5.21) that pip prefers,
and PyPI's torchvision, built for PyPI's torch, does not load beside it ("operator
torchvision::nms does not exist" on ``import sglang``).
"""
from __future__ import annotations

import email.parser
import glob
import importlib.metadata
import os
import re
import subprocess
import sys
import tempfile
import zipfile

# pins whose PyPI file cannot install without another index (names normalized), and the PyPI release used instead
REPLACED = {"cuda-tile==1.6.0rc5": "cuda-tile==1.6.0"}


def _normal(requirement: str) -> str:
    """A requirement without spaces, its name lower-case with - for any run of -_. (PEP 503)."""
    req = requirement.replace(" ", "")
    name = re.match(r"[A-Za-z0-9._-]+", req).group(0)
    return re.sub(r"[-_.]+", "-", name).lower() + req[len(name):]


def pip(*args: str, index_only: bool = False) -> None:
    env = dict(os.environ)
    if index_only:  # an empty PIP_FIND_LINKS would not clear it, nor the config files' find-links
        env.pop("PIP_FIND_LINKS", None)
        env["PIP_CONFIG_FILE"] = os.devnull
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *args], check=True, env=env)


def requirements(version: str) -> list:
    """The release's requirements as its wheel declares them, extras left out."""
    with tempfile.TemporaryDirectory() as d:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        f"sglang=={version}", "-d", d], check=True)
        with zipfile.ZipFile(glob.glob(f"{d}/sglang-*.whl")[0]) as whl:
            meta = whl.read(f"sglang-{version}.dist-info/METADATA").decode()
    reqs = email.parser.Parser().parsestr(meta).get_all("Requires-Dist") or []
    return [r for r in reqs if "extra ==" not in r]


def main(version: str) -> int:
    reqs = requirements(version)
    if not any(_normal(r.split(";")[0]) in REPLACED for r in reqs):
        pip(f"sglang=={version}")
        return 0
    kept = []
    for r in reqs:
        name, sep, marker = r.partition(";")
        new = REPLACED.get(_normal(name))
        if new:
            print(f"install_sglang: {name.strip()} -> {new} (its PyPI file needs pypi.nvidia.com)", file=sys.stderr)
        kept.append((new or name.strip()) + (sep + marker if sep else ""))
    pip(*kept, index_only=True)
    pip("--no-deps", f"sglang=={version}", index_only=True)
    importlib.invalidate_caches()
    dist = importlib.metadata.distribution("sglang")
    meta = str(dist.locate_file(next(f for f in dist.files if f.name == "METADATA" and f.parent.name.endswith(".dist-info"))))
    with open(meta) as f:
        text = f.read()
    for old, new in REPLACED.items():
        text = text.replace(f"Requires-Dist: {old}\n", f"Requires-Dist: {new}\n")
    with open(meta, "w") as f:
        f.write(text)
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: python .ci/install_sglang.py SGLANG_VERSION   (with the target venv's python)")
    try:
        sys.exit(main(sys.argv[1]))
    except subprocess.CalledProcessError as e:
        sys.exit(f"install_sglang: {' '.join(e.cmd[3:])} failed (exit {e.returncode}); pip's output is above")
