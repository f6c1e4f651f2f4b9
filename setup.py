"""Build shim: metadata lives in setup.cfg; only the package list is computed here.

setup.cfg cannot say "every package under sglang_capture, plus patches/ installed as
sglang_capture.patches" (``find:`` would pick up ``patches`` as a top-level package of its own),
and a hand-written list went stale once already: a wheel then lacked sglang_capture.core.
"""
from setuptools import find_packages, setup

setup(packages=find_packages(include=["sglang_capture", "sglang_capture.*"]) + ["sglang_capture.patches"])
