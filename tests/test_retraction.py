"""Retraction under KV-cache pressure: a retracted capture request is prefilled again later,
and its file must still hold exactly its own rows (checked against transformers).

A small KV pool makes SGLang 0.5.17 retract on its own ("KV cache pool is full"); 0.5.23 admits
more conservatively and skips a decode step instead when requests are about to finish, so a
second variant turns on SGLang's own retraction test mode (``SGLANG_TEST_RETRACT``: the same
``retract_decode`` path every N forward steps). Both require that some request was retracted."""
from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import pytest

import sglang_capture
from sglang_capture.patches.version_gate import installed_sglang_version
from sglang_capture.testbed.server import capture_cmd
from tests.test_e2e_deepseek import LAYERS, check_against_transformers

# natural: retraction because the small KV pool is full (SGLang 0.5.17 does this here);
# test_mode: SGLang's own SGLANG_TEST_RETRACT forces the same retract_decode path (both releases)
MODES = {"natural": ("KV cache pool is full. Retract requests", {}),
         "test_mode": ("Testing retraction", {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "40"})}


@pytest.mark.parametrize("mode", sorted(MODES))
def test_retracted_requests_keep_exact_rows(tiny_models, make_test_server, tmp_path, mode):
    message, extra_env = MODES[mode]
    if mode == "natural" and installed_sglang_version() != "0.5.17":
        pytest.skip("this KV pressure makes only SGLang 0.5.17 retract; 0.5.23 skips a decode step instead")
    capture_dir = str(tmp_path)
    cmd = capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", ",".join(map(str, LAYERS)),
                      "--dtype", "float32") + ["--max-total-tokens", "1024", "--schedule-conservativeness", "0.05"]  # last wins
    server = make_test_server(cmd, capture_dir, extra_env)
    texts = [f"Request {i}: the quick brown fox jumps over the lazy dog. " * 4 for i in range(8)]

    def send(i):
        body = {"text": texts[i], "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True,
                                                      "custom_params": {"capture": True, "capture_name": f"r{i}"}}}
        r = server.generate(body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(send, range(8)))
    retracted = re.findall(re.escape(message) + r"\. #retracted_reqs: (\d+)", server.log())
    assert any(int(n) > 0 for n in retracted), f"no request was retracted ({message!r} not in the log)"
    for out in outs:
        ref = out["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        data = sglang_capture.load(ref["path"])
        assert data["output_ids"].tolist() == out["output_ids"] and len(out["output_ids"]) == 160
        check_against_transformers(tiny_models["tiny-dsv3"], data)
