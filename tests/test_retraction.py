"""Retraction under KV-cache pressure: a retracted capture request is prefilled again later,
and its file must still hold exactly its own rows (checked against transformers)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import sglang_capture
from sglang_capture.testbed.server import capture_cmd
from tests.test_e2e_deepseek import LAYERS, check_against_transformers


def test_retracted_requests_keep_exact_rows(tiny_models, make_server, tmp_path):
    capture_dir = str(tmp_path)
    cmd = capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", ",".join(map(str, LAYERS)),
                      "--dtype", "float32") + ["--max-total-tokens", "1024", "--schedule-conservativeness", "0.05"]  # last wins
    server = make_server(cmd, capture_dir)
    texts = [f"Request {i}: the quick brown fox jumps over the lazy dog. " * 4 for i in range(8)]

    def send(i):
        body = {"text": texts[i], "sampling_params": {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True,
                                                      "custom_params": {"capture": True, "capture_name": f"r{i}"}}}
        r = server.generate(body, timeout=600)
        assert r.status_code == 200, r.text
        return r.json()

    with ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(send, range(8)))
    assert "KV cache pool is full. Retract requests" in server.log(), "the KV pool was too large to force a retraction"
    for out in outs:
        ref = out["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        data = sglang_capture.load(ref["path"])
        assert data["output_ids"].tolist() == out["output_ids"] and len(out["output_ids"]) == 160
        check_against_transformers(tiny_models["tiny-dsv3"], data)
