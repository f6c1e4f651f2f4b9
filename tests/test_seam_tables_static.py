"""Every supported SGLang release's seam table against that release's own source, read from its
wheel without installing it (patches/wheel_source.py). Needs PyPI: ``pip download --no-deps
sglang==X`` (about 27 MB a release, cached under ~/.cache/sglang-capture-tests/sglang-wheels)."""
from __future__ import annotations

import json
import os

import pytest

from sglang_capture.patches import load_table, supported_versions
from sglang_capture.patches.wheel_source import WheelSource, fetch_wheel


@pytest.mark.parametrize("version", supported_versions())
def test_every_patched_function_of_a_supported_release_matches_its_table(version):
    source = WheelSource(fetch_wheel(version))
    changed = [f"{s.module}.{s.target} changed in sglang {version} (seam {s.seam})" for s in load_table(version)
               if source.fingerprint(s.module, s.target) != s.fingerprint]
    assert not changed, "\n".join(changed)


def test_the_fingerprint_read_from_a_wheel_is_the_one_the_instrumentor_computes_installed():
    from sglang_capture.server.instrumentor import _resolve, fingerprint, installed_sglang_version

    version = installed_sglang_version()
    source = WheelSource(fetch_wheel(version))
    for seam in load_table(version):
        _, _, original = _resolve(seam)
        assert source.fingerprint(seam.module, seam.target) == fingerprint(original), seam.seam
    with pytest.raises(LookupError, match=r"^sglang.srt.managers.scheduler.Scheduler.no_such_method is not in sglang-"):
        source.fingerprint("sglang.srt.managers.scheduler", "Scheduler.no_such_method")


def test_refresh_writes_a_releases_table_and_names_each_hook_to_read_again(tmp_path, capsys):
    """0.5.17's own wheel reproduces its table; 0.5.20's changes functions under several hooks,
    each named, and the tool says the table is not ready (exit 3)."""
    from sglang_capture.patches.refresh import main

    out = tmp_path / "t.json"
    assert main(["--from-wheel", "0.5.17", "--out", str(out)]) == 0
    assert {s["seam"]: s["fingerprint"] for s in json.load(open(out))["seams"]} == \
        {s.seam: s.fingerprint for s in load_table("0.5.17")}
    capsys.readouterr()
    assert main(["--from-wheel", "0.5.20"]) == 3
    lines = capsys.readouterr().out.splitlines()
    assert "result_copy: same as 0.5.23" in lines and "final_hidden: same as 0.5.17, 0.5.23" in lines
    assert ("batch_run: CHANGED in sglang.srt.managers.scheduler.Scheduler.run_batch; read hook "
            "sglang_capture.server.hooks.batch:run_batch against it") in lines
    assert not os.path.exists(os.path.join(os.path.dirname(load_table.__code__.co_filename), "sglang_0_5_20.json"))
