"""End to end on a tiny bf16 Llama: default layers, OpenAI endpoints, and a plain SGLang server beside it."""
from __future__ import annotations

import os
import time

import pytest
import torch

import sglang_capture
from sglang_capture.core.capture_dir import read_stats
from sglang_capture.core.layers import default_layers
from sglang_capture.testbed.server import capture_cmd
from tests.reference import min_row_cosine, reference_states

PROMPTS = ["hello world, this is a tiny tokenizer", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def llama(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    return make_server(capture_cmd(tiny_models["tiny-llama"], capture_dir), capture_dir)


@pytest.fixture(scope="module")
def plain(plain_llama):
    return plain_llama


def _body(text, **extra):
    return {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, **extra}


def test_bf16_capture_with_default_layers_matches_transformers(llama, tiny_models):
    body = _body(PROMPTS[1])
    body["sampling_params"]["custom_params"] = {"capture": True}
    out = llama.generate(body).json()
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    assert data["layers"] == default_layers(4, "LlamaForCausalLM") == [2, 3]
    assert data["aux_hidden_states"].dtype == torch.bfloat16
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    assert data["output_ids"].tolist() == out["output_ids"]
    aux, last = reference_states(tiny_models["tiny-llama"], torch.bfloat16, ids, data["layers"])
    assert data["aux_hidden_states"].shape == aux.shape == (len(ids), 2 * 256)
    for k in range(len(data["layers"])):
        block = slice(k * 256, (k + 1) * 256)
        assert min_row_cosine(data["aux_hidden_states"][:, block], aux[:, block]) >= 0.999
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.999


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
def test_openai_endpoints_capture_by_custom_params(llama, endpoint):
    import requests

    body = {"model": "tiny", "max_tokens": 3, "temperature": 0,
            "custom_params": {"capture": True, "capture_name": f"oai{endpoint.count('chat')}"}}
    if "chat" in endpoint:
        body["messages"] = [{"role": "user", "content": "hello world"}]
    else:
        body["prompt"] = "hello world"
    r = requests.post(llama.url + endpoint, json=body, timeout=120)
    assert r.status_code == 200, r.text
    path = os.path.join(llama.capture_dir, f"oai{endpoint.count('chat')}.capture.msgpack")
    data = sglang_capture.load(path)  # complete by the time the response arrived
    assert data["rid"] == r.json()["id"]
    assert data["aux_hidden_states"].shape[0] == len(data["input_ids"]) + len(data["output_ids"]) - 1


def test_requests_without_capture_are_answered_like_plain_sglang(llama, plain):
    for text in PROMPTS:
        for extra in ({}, {"return_hidden_states": True}):
            ours, theirs = llama.generate(_body(text, **extra)).json(), plain.generate(_body(text, **extra)).json()
            assert ours["output_ids"] == theirs["output_ids"]
            assert ours["text"] == theirs["text"]
            assert "capture" not in ours["meta_info"]
            if extra:
                a, b = ours["meta_info"]["hidden_states"], theirs["meta_info"]["hidden_states"]
                assert len(a) == len(b) and torch.allclose(torch.tensor(a[0]), torch.tensor(b[0]))
                assert torch.allclose(torch.tensor(a[1:]), torch.tensor(b[1:]))


def test_plain_launch_server_stays_unpatched(plain, tmp_path):
    body = _body(PROMPTS[0])
    body["sampling_params"]["custom_params"] = {"capture": True}
    out = plain.generate(body).json()
    assert "capture" not in out["meta_info"] and "hidden_states" not in out["meta_info"]
    assert "sglang_capture: capturing" not in plain.log()


def _host_pool_stats(server) -> dict:
    return read_stats(server.capture_dir).get("host_pool") or {}


def test_hidden_states_go_through_the_host_pool_and_stay_exact(llama, tiny_models):
    body = _body(" ".join(PROMPTS) * 3)
    body["sampling_params"]["custom_params"] = {"capture": True, "capture_name": "through-the-pool"}
    before = _host_pool_stats(llama).get("blocks", 0)
    out = llama.generate(body).json()
    assert out["meta_info"]["capture"]["status"] == "ok"
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    # one block for the prefill and one per decode step fed back (the stats file follows the outcome)
    deadline = time.monotonic() + 10
    while (pool := _host_pool_stats(llama))["blocks"] - before < body["sampling_params"]["max_new_tokens"]:
        assert time.monotonic() < deadline, f"host pool counters did not move: {pool}"
        time.sleep(0.05)
    assert pool["fallbacks"] == 0 and pool["size_bytes"] == 8192 << 20 and not pool["pinned"]
    assert read_stats(llama.capture_dir)["inline_bytes"] == 0  # writer processes read the rows in the pool, by offset
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    aux, last = reference_states(tiny_models["tiny-llama"], torch.bfloat16, ids, data["layers"])
    for k in range(len(data["layers"])):
        block = slice(k * 256, (k + 1) * 256)
        assert min_row_cosine(data["aux_hidden_states"][:, block], aux[:, block]) >= 0.999
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.999
