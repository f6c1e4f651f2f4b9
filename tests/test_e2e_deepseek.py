"""End to end on a tiny DeepSeek-V3 (MLA + MoE, Kimi-K2.5's architecture), float32, real SGLang on CPU."""
from __future__ import annotations

import glob
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import AutoTokenizer

import sglang_capture
from sglang_capture.core.capture_dir import read_stats
from sglang_capture.patches.version_gate import installed_sglang_version
from sglang_capture.testbed.server import capture_cmd
from tests.reference import max_abs_diff, reference_pre_norm, reference_states

LAYERS = [0, 2, 3]
CHUNK = 64
TOL = 1e-4


@pytest.fixture(scope="module")
def dsv3(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    cmd = capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", ",".join(map(str, LAYERS)),
                      "--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--capture-final", "both")
    return make_server(cmd, capture_dir)


@pytest.fixture(scope="module")
def tokenizer(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["tiny-dsv3"])


def capture(server, text, max_new_tokens=4, **custom):
    r = server.generate({"text": text, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                           "ignore_eos": True, "custom_params": {"capture": True, **custom}}})
    assert r.status_code == 200, r.text
    return r.json()


def check_against_transformers(path_model, data, tol=TOL):
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    aux, last = reference_states(path_model, torch.float32, ids, data["layers"])
    assert data["aux_hidden_states"].shape == aux.shape
    assert data["last_hidden_states"].shape == last.shape
    assert max_abs_diff(data["aux_hidden_states"], aux) <= tol
    assert max_abs_diff(data["last_hidden_states"], last) <= tol
    if data["final"] == "both":  # this module's server (--capture-final both); other modules' keep the default
        pre = reference_pre_norm(path_model, torch.float32, ids)
        assert data["last_hidden_states_pre_norm"].shape == pre.shape
        assert max_abs_diff(data["last_hidden_states_pre_norm"], pre) <= tol


def test_capture_file_matches_transformers_and_response(dsv3, tiny_models, tokenizer):
    out = capture(dsv3, "Kimi K2.5 uses the DeepSeek V3 architecture.", max_new_tokens=5)
    ref = out["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["checksum"].startswith("xxh3_128:") and ref["bytes"] > 0
    assert os.path.dirname(ref["path"]) == dsv3.capture_dir
    assert "hidden_states" not in out["meta_info"]
    data = sglang_capture.load(ref["path"])
    assert data["rid"] == out["meta_info"]["id"]
    assert data["input_ids"].tolist() == tokenizer("Kimi K2.5 uses the DeepSeek V3 architecture.")["input_ids"]
    assert data["output_ids"].tolist() == out["output_ids"]
    assert data["input_ids"].dtype == data["output_ids"].dtype == torch.int64
    assert data["layers"] == LAYERS and data["hidden_size"] == 256
    assert data["meta"]["architecture"] == "DeepseekV3ForCausalLM"
    assert data["aux_hidden_states"].dtype == torch.float32  # the serving dtype, never converted
    assert data["final"] == "both"  # so check_against_transformers checks the pre-norm state on every file here
    assert data["aux_hidden_states"].shape[0] == ref["rows"] == len(data["input_ids"]) + 4
    check_against_transformers(tiny_models["tiny-dsv3"], data)


def test_prompt_longer_than_chunked_prefill_is_captured_whole(dsv3, tiny_models, tokenizer):
    text = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    assert len(tokenizer(text)["input_ids"]) > 2 * CHUNK
    out = capture(dsv3, text, max_new_tokens=3)
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    assert data["aux_hidden_states"].shape[0] == len(data["input_ids"]) + 2
    check_against_transformers(tiny_models["tiny-dsv3"], data)


def test_concurrent_mixed_requests_keep_their_own_rows(dsv3, tiny_models, tokenizer):
    words = "hello world this is a tiny tokenizer for sglang cpu tests".split()
    prompts = [" ".join(words[: 2 + (i * 3) % 11] * (1 + i % 5)) for i in range(16)]

    def payload(i):
        p = {"text": prompts[i], "sampling_params": {"max_new_tokens": 2 + i % 4, "temperature": 0, "ignore_eos": True}}
        if i % 2 == 0:
            p["sampling_params"]["custom_params"] = {"capture": True, "capture_name": f"mixed-{i}"}
        elif i % 4 == 1:
            p["return_hidden_states"] = True
        return p

    solo = {i: dsv3.generate(payload(i)).json() for i in range(16) if i % 2}
    with ThreadPoolExecutor(16) as pool:
        results = list(pool.map(lambda i: dsv3.generate(payload(i)), range(16)))
    for i, r in enumerate(results):
        assert r.status_code == 200, r.text
        out = r.json()
        if i % 2 == 0:
            ref = out["meta_info"]["capture"]
            assert ref["status"] == "ok" and ref["path"].endswith(f"mixed-{i}.capture.msgpack")
            data = sglang_capture.load(ref["path"])
            assert data["input_ids"].tolist() == tokenizer(prompts[i])["input_ids"]
            assert data["output_ids"].tolist() == out["output_ids"]
            check_against_transformers(tiny_models["tiny-dsv3"], data)
        else:
            assert "capture" not in out["meta_info"]
            assert out["output_ids"] == solo[i]["output_ids"]
            if i % 4 == 1:  # SGLang's own JSON path still returns the final hidden state, as lists
                hs = out["meta_info"]["hidden_states"]
                ids = tokenizer(prompts[i])["input_ids"] + out["output_ids"][:-1]
                _, last = reference_states(tiny_models["tiny-dsv3"], torch.float32, ids, LAYERS)
                rows = torch.tensor(hs[0] + hs[1:])
                # plain SGLang returns rows only for tokens it computed (the solo run cached the prompt)
                assert rows.shape[1] == last.shape[1] and 0 < rows.shape[0] <= last.shape[0]
                assert max_abs_diff(rows, last[-rows.shape[0]:]) <= TOL
            else:
                assert "hidden_states" not in out["meta_info"] or not out["meta_info"]["hidden_states"]


def _result_copy(server):
    return read_stats(server.capture_dir, settled=True).get("result_copy", {"batch_rows": 0, "copied_rows": 0, "gathered_in_forward": 0})


def test_batches_shared_with_plain_requests_copy_only_the_captured_rows(dsv3, tiny_models):
    before = _result_copy(dsv3)
    text = "Only the rows of requests that capture leave the GPU, even in shared batches. " * 2
    with ThreadPoolExecutor(8) as pool:
        # plain requests far longer than the capture: still decoding whenever the capture runs,
        # however the scheduler happens to order the arrivals
        plain = [pool.submit(dsv3.generate, {"text": f"{i} {text}", "sampling_params": {
            "max_new_tokens": 96, "temperature": 0, "ignore_eos": True}}) for i in range(6)]
        out = pool.submit(capture, dsv3, text, 8, capture_name="shared-batches").result()
        assert all(f.result().status_code == 200 for f in plain)
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    check_against_transformers(tiny_models["tiny-dsv3"], data)
    after = _result_copy(dsv3)
    assert after["copied_rows"] - before["copied_rows"] < after["batch_rows"] - before["batch_rows"]
    # eager prefill on this server: the rows were picked out in the forward, no whole-batch concat
    assert after["gathered_in_forward"] > before["gathered_in_forward"]
    clock = read_stats(dsv3.capture_dir, settled=True)["scheduler_thread"]  # the scheduler thread's time, per seam and kind
    assert {"run_batch/extend/capture", "run_batch/extend/plain", "process_result/extend/capture", "copy_to_cpu/capture",
            "stream_output/capture", "result_wait/extend/capture", "result_wait/decode/capture"} <= set(clock)
    # a copy already done is waited for in about a microsecond, which the stats may round to 0 s
    assert all(v["calls"] > 0 and (v["s"] > 0 or k.startswith("result_wait/")) for k, v in clock.items())


def test_a_capture_of_one_new_token_sends_no_decode_batch_through_the_capture_path(dsv3, tiny_models):
    """Overlap scheduling launches a decode batch holding the request before its prefill result
    says it finished; with one new token its file needs no row from it (what extract sends)."""
    def clock():
        return read_stats(dsv3.capture_dir, settled=True)["scheduler_thread"]

    calls = lambda c, seam: c.get(seam, {}).get("calls", 0)
    capture(dsv3, "One new token: the prompt's rows only.", max_new_tokens=1, capture_name="one-token-first")
    before = clock()
    out = capture(dsv3, "Kimi K2.5 uses the DeepSeek V3 architecture.", max_new_tokens=1, capture_name="one-token")
    after = clock()  # settled: the decode batch overlap launched beside its prefill, if any, ran before it finished
    assert calls(after, "run_batch/extend/capture") >= calls(before, "run_batch/extend/capture") + 1
    assert calls(after, "run_batch/decode/capture") == calls(before, "run_batch/decode/capture")
    # 0.5.17's and 0.5.20's overlap schedulers do launch that decode batch (it took the capture path
    # before this change); 0.5.23 launches none for a request that ends in its prefill; the releases
    # between were not run (patches/README.md)
    decode_batches = calls(after, "run_batch/decode/plain") - calls(before, "run_batch/decode/plain")
    launches = {"0.5.17": True, "0.5.20": True, "0.5.23": False}.get(installed_sglang_version())
    if launches is not None:
        assert (decode_batches > 0) == launches
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    assert data["aux_hidden_states"].shape[0] == len(data["input_ids"]) and len(data["output_ids"]) == 1
    check_against_transformers(tiny_models["tiny-dsv3"], data)


def _aux_counts(server, at_least_with_aux=0):
    """The aux-capture counters, once the stats file (written after each outcome) has caught up."""
    deadline = time.monotonic() + 10
    while (aux := read_stats(server.capture_dir).get("aux_capture") or {}).get("extend_batches_with_aux", 0) < at_least_with_aux:
        assert time.monotonic() < deadline, f"aux capture counters did not move: {aux}"
        time.sleep(0.05)
    return aux


def test_prefill_batches_that_capture_nothing_skip_the_aux_layers(dsv3, tiny_models):
    capture(dsv3, "A capture first, so that the stats file exists.", capture_name="aux-first")
    before = _aux_counts(dsv3, 1)
    assert before["per_batch"] is True
    assert "aux layers computed only for prefill batches with a capture request" in dsv3.log()
    plain = ["Requests that capture nothing need no aux layers.", "So the model skips them for those batches."]
    for text in plain:
        r = dsv3.generate({"text": text, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
        assert r.status_code == 200, r.text
    out = capture(dsv3, "The next capture gets them back, exact.", capture_name="aux-after")
    check_against_transformers(tiny_models["tiny-dsv3"], sglang_capture.load(out["meta_info"]["capture"]["path"]))
    after = _aux_counts(dsv3, before["extend_batches_with_aux"] + 1)
    assert after["extend_batches_without_aux"] - before["extend_batches_without_aux"] >= len(plain)


BAD_NAMES = ["../escape", "/etc/passwd", "a\x00b", "x" * 300, ".hidden", "a/b", 7]


@pytest.mark.parametrize("name", BAD_NAMES, ids=["dotdot", "absolute", "nul", "huge", "hidden", "slash", "int"])
def test_bad_capture_name_is_refused_and_never_escapes(dsv3, name):
    before = set(os.listdir(os.path.dirname(dsv3.capture_dir)))
    r = dsv3.generate({"text": "hello", "sampling_params": {"max_new_tokens": 2,
                                                            "custom_params": {"capture": True, "capture_name": name}}})
    assert r.status_code == 400
    assert "capture_name" in r.text
    assert set(os.listdir(os.path.dirname(dsv3.capture_dir))) == before
    assert not os.path.exists("/etc/passwd.capture.msgpack")
    ok = capture(dsv3, "hello again", max_new_tokens=2)  # the server keeps serving
    assert ok["meta_info"]["capture"]["status"] == "ok"


def test_capture_flag_must_be_boolean(dsv3):
    r = dsv3.generate({"text": "hello", "sampling_params": {"max_new_tokens": 2, "custom_params": {"capture": "yes"}}})
    assert r.status_code == 400 and "custom_params.capture must be true or false" in r.text


def test_malicious_rid_becomes_a_digest_inside_the_capture_dir(dsv3):
    r = dsv3.generate({"text": "hello", "rid": "../../evil-rid", "sampling_params": {
        "max_new_tokens": 2, "custom_params": {"capture": True}}})
    assert r.status_code == 200, r.text
    ref = r.json()["meta_info"]["capture"]
    assert ref["status"] == "ok"
    assert os.path.dirname(ref["path"]) == dsv3.capture_dir
    assert os.path.basename(ref["path"]).startswith("rid-")
    assert sglang_capture.load(ref["path"])["rid"] == "../../evil-rid"


def test_same_capture_name_twice_never_overwrites(dsv3):
    first = capture(dsv3, "hello world", max_new_tokens=2, capture_name="twice")
    second = capture(dsv3, "The quick brown fox", max_new_tokens=2, capture_name="twice")
    assert first["meta_info"]["capture"]["status"] == "ok"
    assert second["meta_info"]["capture"]["status"] == "error"
    assert "already exists" in second["meta_info"]["capture"]["error"]
    assert sglang_capture.load(first["meta_info"]["capture"]["path"])["rid"] == first["meta_info"]["id"]


def test_prefix_cached_by_an_earlier_request_is_still_captured_whole(dsv3, tiny_models, tokenizer):
    prefix = "Hidden states are captured from every decoder layer of the model. " * 3
    plain = dsv3.generate({"text": prefix, "sampling_params": {"max_new_tokens": 2, "temperature": 0}})
    assert plain.status_code == 200  # the prefix is now in the radix cache
    for _ in range(2):  # and a second capture of the same prompt must not reuse the first one's cache either
        out = capture(dsv3, prefix + "The quick brown fox.", max_new_tokens=3)
        data = sglang_capture.load(out["meta_info"]["capture"]["path"])
        assert data["input_ids"].tolist() == tokenizer(prefix + "The quick brown fox.")["input_ids"]
        check_against_transformers(tiny_models["tiny-dsv3"], data)


def test_streaming_request_gets_its_reference_in_the_last_chunk(dsv3, tiny_models):
    import json

    import requests

    body = {"text": "Kimi K2.5 uses MLA.", "stream": True,
            "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                "custom_params": {"capture": True, "capture_name": "streamed"}}}
    chunks = []
    with requests.post(dsv3.url + "/generate", json=body, stream=True, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                chunks.append(json.loads(line[len(b"data: "):]))
    assert len(chunks) >= 2
    ref = chunks[-1]["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["path"].endswith("streamed.capture.msgpack")
    data = sglang_capture.load(ref["path"])
    assert data["output_ids"].tolist() == chunks[-1]["output_ids"]
    check_against_transformers(tiny_models["tiny-dsv3"], data)


def test_parallel_samples_each_get_their_own_file(dsv3, tiny_models):
    body = {"text": "The quick brown fox", "sampling_params": {
        "n": 2, "max_new_tokens": 4, "temperature": 1.0, "ignore_eos": True, "custom_params": {"capture": True}}}
    before = set(glob.glob(os.path.join(dsv3.capture_dir, "*.capture.msgpack")))
    r = dsv3.generate(body)
    assert r.status_code == 200, r.text
    outs = r.json()
    assert isinstance(outs, list) and len(outs) == 2
    paths = set()
    for out in outs:
        ref = out["meta_info"]["capture"]
        assert ref["status"] == "ok"
        paths.add(ref["path"])
        data = sglang_capture.load(ref["path"])
        assert data["output_ids"].tolist() == out["output_ids"]
        check_against_transformers(tiny_models["tiny-dsv3"], data)
    assert len(paths) == 2
    # SGLang's prefix-caching pass (max_new_tokens 0) before the samples leaves no third file
    assert set(glob.glob(os.path.join(dsv3.capture_dir, "*.capture.msgpack"))) - before == paths


def test_parallel_samples_with_one_capture_name_are_refused(dsv3):
    before = set(os.listdir(dsv3.capture_dir))
    r = dsv3.generate({"text": "The quick brown fox", "sampling_params": {
        "n": 2, "max_new_tokens": 2, "custom_params": {"capture": True, "capture_name": "shared"}}})
    assert r.status_code == 400 and "leave capture_name out" in r.text
    assert set(os.listdir(dsv3.capture_dir)) == before


def hang_up_and_expect_abort(server, text: str, rid: str, name: str) -> None:
    """A capture request whose client gives up and hangs up ends ``aborted`` in its outcome record,
    with no file (shared by the servers of other modules)."""
    import json

    import requests

    from sglang_capture.core.capture_dir import index_path

    body = {"text": text, "rid": rid, "sampling_params": {
        "max_new_tokens": 3900, "temperature": 0, "ignore_eos": True,
        "custom_params": {"capture": True, "capture_name": name}}}
    with pytest.raises(requests.Timeout):
        requests.post(server.url + "/generate", json=body, timeout=2)  # the client gives up and hangs up
    record = index_path(server.capture_dir, rid)
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not os.path.exists(record):
        time.sleep(0.2)
    assert json.load(open(record))["status"] == "aborted"
    assert not os.path.exists(os.path.join(server.capture_dir, f"{name}.capture.msgpack"))


def test_client_disconnect_aborts_without_a_file(dsv3):
    hang_up_and_expect_abort(dsv3, "hello world", "disconnect-me", "disconnected")
