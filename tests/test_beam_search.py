"""Beam search (SGLang 0.5.19+, ``sampling_params.beam_width``): its decode steps return no hidden
states, so no file of one could be complete. A client's capture of one is refused with HTTP 400 and
one line when it arrives; the operator's ``--capture-fraction`` never selects one; the same request
without capture runs as plain SGLang runs it. The request-field rule is also checked on every release
(tests/test_core_protocol.py); on 0.5.17-0.5.18, which have no beam search, these tests skip
(``make test SGLANG_VERSION=0.5.23`` runs them)."""
from __future__ import annotations

import os
import time

import pytest
import requests

from sglang_capture.core.capture_dir import index_path
from sglang_capture.testbed.server import capture_cmd


def _release() -> tuple:
    import sglang

    return tuple(int(x) for x in sglang.__version__.split(".")[:3])


pytestmark = pytest.mark.skipif(_release() < (0, 5, 19), reason="SGLang before 0.5.19 has no beam search")


@pytest.fixture(scope="module")
def operator_server(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    return make_server(capture_cmd(tiny_models["tiny-llama"], capture_dir, "--capture-fraction", "1"), capture_dir)


def _generate(server, custom=None, beams=2):
    params = {"max_new_tokens": 4, "temperature": 0, "custom_params": custom or {}}
    if beams > 1:
        params["beam_width"] = beams
    return requests.post(server.url + "/generate", json={"text": "hello world", "sampling_params": params}, timeout=120)


def _files(server):
    return {f for f in os.listdir(server.capture_dir) if f.endswith(".capture.msgpack")}


def test_a_clients_capture_of_a_beam_search_is_refused_in_one_line(operator_server):
    r = _generate(operator_server, {"capture": True, "capture_name": "beams"})
    assert r.status_code == 400
    message = r.json()["error"]["message"]
    assert message.startswith("beam search (beam_width 2) cannot be captured") and "\n" not in message
    assert "beams.capture.msgpack" not in _files(operator_server)


def test_the_operator_never_selects_a_beam_search_and_it_runs_as_plain_sglang(operator_server):
    before = _files(operator_server)
    r = _generate(operator_server)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) == 4 and "capture" not in r.json()["meta_info"]
    control = _generate(operator_server, beams=1)  # the same request without beams: the operator captures it
    assert control.status_code == 200, control.text
    rid = control.json()["meta_info"]["id"]
    deadline = time.monotonic() + 60
    while not any(rid in f for f in _files(operator_server)) and time.monotonic() < deadline:
        time.sleep(0.2)
    new = _files(operator_server) - before
    beam_rid = r.json()["meta_info"]["id"]
    assert any(rid in f for f in new) and not any(beam_rid in f for f in new)
    # not captured at all: a capture of it would have recorded an outcome (an error: rows missing) before the control's
    assert not os.path.exists(index_path(operator_server.capture_dir, beam_rid))
    assert os.path.exists(index_path(operator_server.capture_dir, rid))
