"""Capture names and request-id names (core/names.py)."""
from __future__ import annotations

import pytest

from sglang_capture.core.names import BadCaptureName, check_capture_name, name_for_rid


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "a\x00b", "..", ".hidden", "x" * 129, "", "a..b", "é"])
def test_unsafe_capture_names_are_refused(name):
    with pytest.raises(BadCaptureName):
        check_capture_name(name)


def test_safe_capture_names_pass_and_unsafe_rids_become_digests():
    assert check_capture_name("sample-0001.v2_a") == "sample-0001.v2_a"
    assert name_for_rid("abc123") == "abc123"
    digest = name_for_rid("../../etc/passwd")
    assert digest.startswith("rid-") and "/" not in digest and digest == name_for_rid("../../etc/passwd")
