"""Capture on a server that speculates with EAGLE-3 (SGLang's own worker, on the CPU test bed).

The test bed's target and one-layer draft (testbed/tiny_models.py: ``build_eagle3_pair``) make
the draft right often but not always, so verify passes both accept and reject draft tokens. A
captured request must hold the rows of its prompt and of every accepted output token, no row
of a rejected draft token, and equal transformers on the whole token sequence, as on a server
that does not speculate. Two servers: chain drafting (top-k 1, with small prefill chunks) and
tree drafting (top-k 2, with SGLang's own forced retraction every few steps)."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from functools import lru_cache

import pytest
import torch

import sglang_capture
from sglang_capture.testbed.server import capture_cmd
from sglang_capture.testbed.spec_kernels import eagle3_server_args
from sglang_capture.testbed.tiny_models import EAGLE3_AUX_LAYER_IDS
from tests.reference import min_block_cosines, min_row_cosine, reference_pre_norm, reference_states

PROMPTS = ["hello world, this is a tiny tokenizer", "The quick brown fox jumps over the lazy dog. " * 3,
           "one two three four five six seven eight nine ten"]
CHUNK = 32  # the chain server's --chunked-prefill-size: the long prompt is prefilled in pieces
STEPS = 3
LAYERS = [i + 1 for i in EAGLE3_AUX_LAYER_IDS]  # the draft's ids are layer outputs: Llama's rule adds 1


@pytest.fixture(scope="module")
def pair(tiny_models):
    return tiny_models["tiny-llama-eagle3-target"], tiny_models["tiny-llama-eagle3-draft"]


@pytest.fixture(scope="module")
def chain(pair, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    target, draft = pair
    cmd = capture_cmd(target, capture_dir) + eagle3_server_args(draft, 1, STEPS) + \
        ["--chunked-prefill-size", str(CHUNK)]
    return make_server(cmd, capture_dir)


@pytest.fixture(scope="module")
def tree(pair, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    target, draft = pair
    cmd = capture_cmd(target, capture_dir, "--capture-final", "both") + eagle3_server_args(draft, 2, STEPS, 6)
    return make_server(cmd, capture_dir, {"SGLANG_TEST_RETRACT": "1", "SGLANG_TEST_RETRACT_INTERVAL": "7"})


def _body(text: str, tokens: int = 24, **custom) -> dict:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    if custom:
        params["custom_params"] = {"capture": True, **custom}
    return {"text": text, "sampling_params": params}


def _generate(server, body: dict) -> dict:
    r = server.generate(body, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _greedy(path: str, ids: list, n: int) -> list:
    """The target's own greedy continuation, by transformers (float32, the servers' dtype)."""
    from tests.reference import _model

    model = _model(path, torch.float32)
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n)
    return out[0, len(ids):].tolist()


@lru_cache(maxsize=None)
def _tokenizer(path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _tokens(path: str, text: str) -> list:
    return _tokenizer(path)(text).input_ids


def _check_exact(target: str, out: dict) -> dict:
    """The file of a finished capture: one row per token fed to the target (the prompt and every
    accepted output token but the last), equal to transformers on that whole sequence."""
    ref = out["meta_info"]["capture"]
    assert ref["status"] == "ok", ref
    data = sglang_capture.load(ref["path"])
    assert data["output_ids"].tolist() == out["output_ids"]
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    assert data["aux_hidden_states"].shape[0] == data["last_hidden_states"].shape[0] == len(ids)
    aux, last = reference_states(target, torch.float32, ids, data["layers"])
    assert min(min_block_cosines(data["aux_hidden_states"], aux, data["hidden_size"])) >= 0.9999
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.9999
    if data["final"] == "both":  # the tree server: wider rows, the draft still reads its aux columns alone
        pre = reference_pre_norm(target, torch.float32, ids)
        assert min_row_cosine(data["last_hidden_states_pre_norm"], pre) >= 0.9999
    return data


def _accepted_per_verify(out: dict) -> float:
    meta = out["meta_info"]
    return meta["completion_tokens"] / meta["spec_verify_ct"]


@pytest.mark.parametrize("server_name", ["chain", "tree"])
def test_greedy_tokens_equal_the_target_and_drafts_are_accepted_and_rejected(server_name, pair, request):
    """The test bed's EAGLE-3 (SGLang's worker, testbed/spec_kernels.py for its CPU kernels) is
    sound: greedy tokens are the target's own, and verify passes both accept and reject drafts."""
    server = request.getfixturevalue(server_name)
    target, _ = pair
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        outs = list(pool.map(lambda text: _generate(server, _body(text)), PROMPTS))
    histogram = [0] * (STEPS + 1)
    for text, out in zip(PROMPTS, outs, strict=True):
        assert out["output_ids"] == _greedy(target, _tokens(target, text), len(out["output_ids"])), text
        for correct, count in enumerate(out["meta_info"]["spec_correct_drafts_histogram"]):
            histogram[correct] += count
    assert histogram[0] > 0 and sum(histogram[1:]) > histogram[0], histogram  # rejections, and more accepts


@pytest.mark.parametrize("server_name", ["chain", "tree"])
def test_a_capture_holds_prompt_rows_and_accepted_output_rows_exactly(server_name, pair, request):
    server = request.getfixturevalue(server_name)
    target, _ = pair
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # in one batch: verify passes of several requests
        outs = list(pool.map(lambda i: _generate(server, _body(PROMPTS[i], capture_name=f"{server_name}-{i}")),
                             range(len(PROMPTS))))
    rates = []
    for out in outs:
        data = _check_exact(target, out)
        assert data["layers"] == LAYERS
        rates.append(_accepted_per_verify(out))
    # both accepted and rejected draft tokens: more than one token per verify pass, fewer than all
    assert 1.3 < sum(rates) / len(rates) < STEPS + 1, rates


def test_capture_changes_neither_the_tokens_nor_the_acceptance(chain):
    for i, text in enumerate(PROMPTS):
        plain = _generate(chain, _body(text, tokens=32))
        captured = _generate(chain, _body(text, tokens=32, capture_name=f"same-{i}"))
        assert captured["output_ids"] == plain["output_ids"]
        assert captured["meta_info"]["spec_verify_ct"] == plain["meta_info"]["spec_verify_ct"]
        assert "capture" not in plain["meta_info"]


def test_sglang_json_hidden_states_stay_the_drafts_aux_layers_as_on_a_plain_server(chain, pair):
    """A ``return_hidden_states`` request that does not capture gets what plain SGLang gives it on a
    server that speculates: per token, the layers the draft reads (not the final hidden state)."""
    target, _ = pair
    text = "Zebra mixture of a prompt no other test sends"
    out = _generate(chain, {**_body(text, tokens=8), "return_hidden_states": True})
    ids = _tokens(target, text)
    entries = out["meta_info"]["hidden_states"]
    rows = torch.cat([torch.tensor(entries[0]), torch.tensor(entries[1:])])
    aux, _ = reference_states(target, torch.float32, ids + out["output_ids"][:-1], LAYERS)
    assert len(entries) == 8 and rows.shape == aux.shape
    torch.testing.assert_close(rows, aux, atol=1e-4, rtol=1e-4)


def test_a_capture_after_a_plain_request_with_the_same_prefix_is_exact(chain, pair):
    text = PROMPTS[1]
    _generate(chain, _body(text, tokens=4))  # leaves the prompt in the radix cache
    _check_exact(pair[0], _generate(chain, _body(text + " and more", capture_name="after-cache")))


def test_a_conversations_next_turn_reuses_the_stored_rows_of_the_turn_before(chain, pair):
    """Prefix sharing on a server that speculates: the second turn keeps its radix hit over the first
    turn's rows (its prompt and accepted answer), computes the rest, and reads whole and exact."""
    target, text = pair[0], "A server that speculates shares stored rows too. " * 3
    first = _generate(chain, {"input_ids": _tokens(target, text), "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "custom_params": {"capture": True}}})
    rows = _check_exact(target, first)["aux_hidden_states"].shape[0]
    ids = _tokens(target, text) + first["output_ids"] + _tokens(target, " and then")
    second = _generate(chain, {"input_ids": ids, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0, "ignore_eos": True, "custom_params": {"capture": True}}})
    ref = second["meta_info"]["capture"]
    # the radix cache holds the first turn's KV but for its last few accepted tokens: those rows come again
    assert rows - STEPS <= ref["rows_shared"] <= rows and ref["rows_stored"] == ref["rows"] - ref["rows_shared"]
    # a verify pass after the answer is the draft's: no last row kept for the next turn (server/answer_tail.py)
    assert first["meta_info"]["capture"]["rows_for_next_turn"] == 0
    _check_exact(target, second)


def test_retracted_captures_stay_exact(tree, pair):
    with ThreadPoolExecutor(4) as pool:
        outs = list(pool.map(lambda i: _generate(tree, _body(f"Request {i}: " + PROMPTS[1], tokens=48,
                                                              capture_name=f"retract-{i}")), range(4)))
    assert "Testing retraction" in tree.log(), "no request was retracted"
    for out in outs:
        _check_exact(pair[0], out)


def test_an_aborted_capture_leaves_no_file(chain):
    from tests.test_e2e_deepseek import hang_up_and_expect_abort

    hang_up_and_expect_abort(chain, "hello world", "spec-disconnect", "disconnected")


def test_extract_verify_and_doctor_work_unchanged_on_a_server_that_speculates(chain, pair, tmp_path, env):
    from tests.test_extract_tools import cli, extract, make_conversations

    inp = tmp_path / "conversations.jsonl"
    make_conversations(inp, n=6)
    out = tmp_path / "out"
    r = extract(chain, inp, out, "--concurrency", "3", env=env)
    assert r.returncode == 0 and "6 samples: 6 written" in r.stdout, r.stdout + r.stderr
    files = sorted(f for f in os.listdir(out) if f.endswith(".capture.msgpack"))
    assert len(files) == 6
    data = sglang_capture.load(out / files[0])  # prefill only: one row per prompt token, exact
    aux, last = reference_states(pair[0], torch.float32, data["input_ids"].tolist(), LAYERS)
    assert min(min_block_cosines(data["aux_hidden_states"], aux, data["hidden_size"])) >= 0.9999
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.9999
    r = cli("verify", out, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    r = cli("doctor", "--server", chain.url, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"speculates with EAGLE3 (draft {pair[1]}): its draft fixes the layers captured, {LAYERS}" in r.stdout
