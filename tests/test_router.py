"""Capture behind the real SGLang router (PyPI's sglang-router 0.3.2, its Rust binary), and capture the
operator chooses: ``--capture-fraction``, ``--capture-return-hidden-states``, SGLang's ``--api-key``.

Two launcher replicas of the tiny Llama sit behind one router (round robin, retries on); a third,
key-protected server captures half of all requests by request id without any client asking.
"""
from __future__ import annotations

import json
import os
import sys
import time

import pytest
import requests
import torch

import sglang_capture
from sglang_capture.core.selection import (
    chat_session,
    client_refusal,
    fraction_selects,
    rid_point,
    session_selects,
    who_captures,
)
from sglang_capture.testbed.server import Server, capture_cmd, free_port
from sglang_capture.tools.client import NO_REFERENCE, ServerError, ServerInfo, capture_prefill
from tests.test_extract_tools import cli, make_conversations

KEY = "test-key-3f9c"  # the operator server's SGLang --api-key
ADMIN = "admin-key-81d2"  # and its --admin-api-key: by default only its holders may ask for capture
PROMPT = "The quick brown fox jumps over the lazy dog."
SAMPLING = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def replicas(tiny_models, make_server, tmp_path_factory):
    out = []
    for name in ("a", "b"):
        capture_dir = str(tmp_path_factory.mktemp(f"replica-{name}"))
        out.append(make_server(capture_cmd(tiny_models["tiny-llama"], capture_dir, "--capture-return-hidden-states"),
                               capture_dir))
    return out


@pytest.fixture(scope="module")
def router(replicas, make_server) -> Server:
    server = make_server([sys.executable, "-m", "sglang_router.launch_router", "--worker-urls",
                          *(r.url for r in replicas), "--policy", "round_robin", "--retry-max-retries", "3",
                          "--log-level", "warn", "--prometheus-port", str(free_port())])
    deadline = time.monotonic() + 60
    while True:  # the router answers /health before its workers are registered
        workers = requests.get(server.url + "/workers", timeout=5).json()["workers"]
        if len(workers) == len(replicas) and all(w["is_healthy"] for w in workers):
            return server
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)


@pytest.fixture(scope="module")
def operator_server(tiny_models, make_server, tmp_path_factory) -> Server:
    capture_dir = str(tmp_path_factory.mktemp("operator"))
    return make_server(capture_cmd(tiny_models["tiny-llama"], capture_dir, "--capture-fraction", "0.5",
                                   "--api-key", KEY, "--admin-api-key", ADMIN), capture_dir)


def _replica_of(ref, replicas) -> Server:
    """The replica whose capture dir holds the referenced file (each replica has its own)."""
    [served] = [r for r in replicas if os.path.dirname(ref["path"]) == os.path.realpath(r.capture_dir)
                or os.path.dirname(ref["path"]) == r.capture_dir]
    return served


def _direct_capture(server: Server, name: str) -> dict:
    body = {"text": PROMPT, "sampling_params": {**SAMPLING, "custom_params": {"capture": True, "capture_name": name}}}
    ref = server.generate(body).json()["meta_info"]["capture"]
    assert ref["status"] == "ok", ref
    return sglang_capture.load(ref["path"])


def test_capture_through_the_router_on_every_endpoint_lands_on_the_replica_that_served_it(router, replicas):
    """/generate and /v1/chat/completions carry return_hidden_states (the router drops their custom_params),
    /v1/completions keeps custom_params; every reference names a file on the replica that served the
    request, whose rows equal a direct capture of the same prompt there."""
    refs = []
    for i in range(2):
        r = requests.post(router.url + "/generate", timeout=120, json={
            "text": PROMPT, "sampling_params": SAMPLING, "return_hidden_states": True, "rid": f"routed-gen-{i}"})
        assert r.status_code == 200, r.text
        assert "hidden_states" not in r.json()["meta_info"]  # the file replaces SGLang's JSON lists
        refs.append(("generate", r.json()["meta_info"]["capture"]))
        r = requests.post(router.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": PROMPT, **_oai(), "custom_params": {"capture": True, "capture_name": f"cmpl-{i}"}})
        assert r.status_code == 200, r.text
        refs.append(("completions", r.json()["choices"][0]["hidden_states"]))
        r = requests.post(router.url + "/v1/chat/completions", timeout=120, json={
            "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **_oai(), "return_hidden_states": True})
        assert r.status_code == 200, r.text
        ref = r.json()["choices"][0]["hidden_states"]
        assert ref["rid"] == r.json()["id"] and os.path.basename(ref["path"]).startswith(ref["rid"])
        refs.append(("chat", ref))
    served = {id(_replica_of(ref, replicas)) for _, ref in refs}
    assert len(served) == 2  # round robin: both replicas captured
    for endpoint, ref in refs:
        assert ref["status"] == "ok" and ref["sglang_capture"] == 1, (endpoint, ref)
        data = sglang_capture.load(ref["path"])
        assert data["aux_hidden_states"].shape[0] == ref["rows"], endpoint
        if endpoint == "generate":  # the same prompt and tokens captured directly on that replica
            direct = _direct_capture(_replica_of(ref, replicas), f"direct-{ref['rid']}")
            assert data["input_ids"].tolist() == direct["input_ids"].tolist()
            assert data["output_ids"].tolist() == direct["output_ids"].tolist()
            assert torch.allclose(data["aux_hidden_states"].float(), direct["aux_hidden_states"].float(), atol=1e-3)


def _oai() -> dict:
    return {"max_tokens": 3, "temperature": 0}


def test_a_custom_params_capture_request_through_the_router_is_a_named_failure_not_silence(router, replicas):
    server = ServerInfo(router.url, replicas[0].capture_dir, "tiny", [1])
    with pytest.raises(ServerError) as e:
        capture_prefill(server, [11, 12, 13, 14], "lost-1", [(0, 4)], timeout=120)
    assert str(e.value) == NO_REFERENCE.format(url=router.url)
    assert not e.value.retryable
    assert not any("lost-1" in f for r in replicas for f in os.listdir(r.capture_dir))


def test_plain_requests_through_the_router_are_answered_like_plain_sglang(router, plain_llama):
    for text in (PROMPT, "hello world, this is a tiny tokenizer"):
        body = {"text": text, "sampling_params": SAMPLING}
        routed = requests.post(router.url + "/generate", json=body, timeout=120).json()
        plain = plain_llama.generate(body).json()
        assert routed["output_ids"] == plain["output_ids"] and routed["text"] == plain["text"]
        assert "capture" not in routed["meta_info"]
        # a client that wants SGLang's JSON lists from such a server opts out of capture
        routed = requests.post(router.url + "/v1/completions", timeout=120, json={
            "model": "tiny", "prompt": text, **_oai(), "return_hidden_states": True,
            "custom_params": {"capture": False}}).json()
        assert isinstance(routed["choices"][0]["hidden_states"], list)


def test_extract_given_the_router_captures_every_sample_once_on_its_workers(router, replicas, env, tmp_path):
    inp = tmp_path / "in.jsonl"
    make_conversations(inp, n=8)
    out = tmp_path / "out"
    r = cli("extract", inp, "--server", router.url, "--out", out, "--no-progress", "--concurrency", "4", env=env)
    assert r.returncode == 0, r.stderr
    assert f"{router.url} is an SGLang router: capturing on its 2 capture workers" in r.stderr
    assert all(rep.url in r.stderr for rep in replicas)
    assert "8 samples: 8 written" in r.stdout
    files = sorted(p for p in os.listdir(out) if p.endswith(".capture.msgpack"))
    manifest = [json.loads(line) for line in open(out / "manifest.jsonl")]
    assert len(files) == 8 and len({m["id"] for m in manifest}) == len(manifest) == 8


def test_the_operators_fraction_captures_the_requests_its_rid_hash_selects_on_every_endpoint(operator_server):
    """No client asks: the selected requests' files appear named by rid, their responses are the plain
    ones (no reference, no wait for the writer), and /health's own request is never selected."""
    auth = {"Authorization": f"Bearer {KEY}"}
    rids = [f"op-{i}" for i in range(10)]
    # /generate by rid; every chat here is one conversation (the same opening message): chosen as a whole
    chat = session_selects(chat_session([{"role": "user", "content": PROMPT}]), 0.5)
    chosen = [rid for i, rid in enumerate(rids) if (fraction_selects(rid, 0.5) if i % 2 else chat)]
    assert 0 < len(chosen) < len(rids)
    for i, rid in enumerate(rids):
        if i % 2:
            r = requests.post(operator_server.url + "/generate", headers=auth, timeout=120,
                              json={"text": PROMPT, "sampling_params": SAMPLING, "rid": rid})
            assert set(r.json()["meta_info"]).isdisjoint({"capture", "hidden_states"})
        else:
            r = requests.post(operator_server.url + "/v1/chat/completions", headers=auth, timeout=120, json={
                "model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **_oai(), "rid": rid})
            assert "hidden_states" not in r.json()["choices"][0]
        assert r.status_code == 200, r.text
    for _ in range(6):
        assert requests.get(operator_server.url + "/health_generate", timeout=60).status_code == 200
    deadline = time.monotonic() + 60
    for rid in chosen:
        path = os.path.join(operator_server.capture_dir, rid + ".capture.msgpack")
        while not os.path.exists(path):
            assert time.monotonic() < deadline, f"{path} never appeared"
            time.sleep(0.2)
        assert sglang_capture.load(path)["rid"] == rid
    time.sleep(1)  # any file of a request not selected would have appeared by now too
    files = {f for f in os.listdir(operator_server.capture_dir) if f.endswith(".capture.msgpack")}
    assert files == {rid + ".capture.msgpack" for rid in chosen}


def test_the_operators_fraction_chooses_every_turn_of_a_conversation_alike(operator_server):
    """Under prefix sharing the fraction picks conversations: a chat's turns by its opening messages,
    /generate's by custom_params.capture_session, each the same way for every turn (else sharing gains
    nothing); a request without either is chosen by its rid. A bad capture_session is refused in one line."""
    auth = {"Authorization": f"Bearer {KEY}"}
    chats = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"Question {i}?"}]
             for i in range(8)]
    expected = {i: session_selects(chat_session(c), 0.5) for i, c in enumerate(chats)}
    assert set(expected.values()) == {True, False}
    rids = {}
    for turn in range(3):
        for i, messages in enumerate(chats):
            r = requests.post(operator_server.url + "/v1/chat/completions", headers=auth, timeout=120, json={
                "model": "tiny", "messages": messages, **_oai(), "rid": f"chat-{i}-{turn}"})
            assert r.status_code == 200, r.text
            rids[f"chat-{i}-{turn}"] = expected[i]
            messages += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                         {"role": "user", "content": f"And then, turn {turn}?"}]
    sessions = {s: session_selects(s, 0.5) for s in (f"user-{k}" for k in range(8))}
    assert set(sessions.values()) == {True, False}
    for k, (session, chosen) in enumerate(sessions.items()):
        for turn in range(2):
            rid = f"gen-{k}-{turn}"
            r = requests.post(operator_server.url + "/generate", headers=auth, timeout=120, json={
                "text": PROMPT + " " * turn, "rid": rid,
                "sampling_params": {**SAMPLING, "custom_params": {"capture_session": session}}})
            assert r.status_code == 200 and "capture" not in r.json()["meta_info"], r.text
            rids[rid] = chosen
    deadline = time.monotonic() + 60
    for rid in (rid for rid, chosen in rids.items() if chosen):
        while not os.path.exists(os.path.join(operator_server.capture_dir, rid + ".capture.msgpack")):
            assert time.monotonic() < deadline, f"{rid} never captured"
            time.sleep(0.2)
    time.sleep(1)
    for rid, chosen in rids.items():
        assert os.path.exists(os.path.join(operator_server.capture_dir, rid + ".capture.msgpack")) == chosen, rid
    # a capture_session that names no session is no session: the operator's choice never turns a request away,
    # the rid decides; a client's own capture request with one is refused in one line
    r = requests.post(operator_server.url + "/generate", headers=auth, timeout=120, json={
        "text": PROMPT, "rid": "bad-session", "sampling_params": {**SAMPLING, "custom_params": {"capture_session": 7}}})
    assert r.status_code == 200, r.text
    r = requests.post(operator_server.url + "/generate", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120,
                      json={"text": PROMPT, "sampling_params": {**SAMPLING, "custom_params": {"capture": True,
                                                                                              "capture_session": 7}}})
    assert r.status_code == 400 and ("custom_params.capture_session must be a string of 1 to 256 characters naming "
                                     "the conversation, got 7") in r.text


def test_a_client_without_the_admin_key_is_refused_capture_in_one_line_and_the_admin_key_captures(operator_server):
    body = {"text": PROMPT, "sampling_params": {**SAMPLING, "custom_params": {"capture": True, "capture_name": "asked"}}}
    r = requests.post(operator_server.url + "/generate", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        "capture refused: on this server only requests with its admin API key may ask for capture or hidden "
        "states (--capture-clients admin); send Authorization: Bearer <the server's --admin-api-key>")
    assert not os.path.exists(os.path.join(operator_server.capture_dir, "asked.capture.msgpack"))
    r = requests.post(operator_server.url + "/v1/chat/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "messages": [{"role": "user", "content": PROMPT}], **_oai(),
                            "custom_params": {"capture": True}})
    assert r.status_code == 400 and "capture refused:" in r.text
    r = requests.post(operator_server.url + "/v1/completions", timeout=120, headers={"Authorization": f"Bearer {KEY}"},
                      json={"model": "tiny", "prompt": PROMPT, **_oai(), "custom_params": {"capture": True}})
    assert r.status_code == 400 and "capture refused:" in r.text
    # SGLang's JSON lists are hidden states too: refused to the plain key, given to the admin key
    lists = {"text": PROMPT, "sampling_params": SAMPLING, "return_hidden_states": True}
    r = requests.post(operator_server.url + "/generate", json=lists, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400 and "capture refused:" in r.text
    r = requests.post(operator_server.url + "/generate", json=lists, timeout=120,
                      headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and isinstance(r.json()["meta_info"]["hidden_states"], list)
    # a streaming /generate gets SGLang's error event, and nothing is captured
    r = requests.post(operator_server.url + "/generate", json={**body, "stream": True}, timeout=120,
                      headers={"Authorization": f"Bearer {KEY}"})
    assert "capture refused: on this server only requests with its admin API key" in r.text
    assert not os.path.exists(os.path.join(operator_server.capture_dir, "asked.capture.msgpack"))
    # the admin key opens /generate too (SGLang alone accepts only --api-key there when both are set)
    r = requests.post(operator_server.url + "/generate", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {ADMIN}"})
    assert r.status_code == 200 and r.json()["meta_info"]["capture"]["status"] == "ok"
    assert requests.post(operator_server.url + "/generate", json=body, timeout=120).status_code == 401


def test_a_key_protected_server_needs_the_key_and_extract_and_doctor_take_it_without_showing_it(
        operator_server, env, tmp_path):
    assert requests.get(operator_server.url + "/capture_info", timeout=10).status_code == 401
    inp = tmp_path / "in.jsonl"
    make_conversations(inp, n=4)
    r = cli("extract", inp, "--server", operator_server.url, "--out", tmp_path / "o", "--no-progress", env=env)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert f"{operator_server.url} needs an API key (HTTP 401); pass --api-key or set $SGLANG_API_KEY" in r.stderr
    # the plain key reaches the server, which refuses capture to it: the run stops at once, in one line
    r = cli("extract", inp, "--server", operator_server.url, "--out", tmp_path / "o", "--no-progress", "--retries", "5",
            env={**env, "SGLANG_API_KEY": KEY})
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "capture refused: on this server only requests with its admin API key" in r.stderr
    assert "samples not captured; re-run once that is fixed" in r.stderr and KEY not in r.stdout + r.stderr
    keyed = {**env, "SGLANG_API_KEY": ADMIN}
    r = cli("extract", inp, "--server", operator_server.url, "--out", tmp_path / "o", "--no-progress", env=keyed)
    assert r.returncode == 0, r.stderr
    assert "4 samples: 4 written" in r.stdout and ADMIN not in r.stdout + r.stderr
    r = cli("doctor", "--server", operator_server.url, env=keyed)
    assert ("who captures: clients holding the server's --admin-api-key (custom_params.capture); the operator: "
            "0.5 of all requests, by conversation (custom_params.capture_session, or a chat's opening messages), "
            "else by request id") in r.stdout
    assert ADMIN not in r.stdout + r.stderr
    assert "sglang_capture: who captures: clients holding the server's --admin-api-key" in operator_server.log()


def test_who_captures_warns_when_a_server_beyond_loopback_lets_any_client_capture_without_a_key():
    said, warning = who_captures(0.0, True, "0.0.0.0", api_key=False)
    assert said == "who captures: any client that reaches the server (custom_params.capture or return_hidden_states)"
    assert warning.startswith("the server listens on 0.0.0.0 without --api-key: any client that reaches it can ask "
                              "for capture and fill the capture dir")
    assert who_captures(0.25, False, "127.0.0.2", api_key=False)[1] is None
    assert who_captures(0.25, False, "10.0.0.5", api_key=True)[1] is None
    assert who_captures(0.25, False, "10.0.0.5", api_key=False, clients="none") == (
        "who captures: no client (--capture-clients none); the operator: 0.25 of all requests, by request id", None)


def test_client_policies_refuse_by_the_bearer_token_alone():
    assert client_refusal("any", None, None) is None
    assert client_refusal("admin", "Bearer adm", "adm") is None and client_refusal("admin", "bearer adm", "adm") is None
    for header in (None, "Bearer other", "adm", "Basic adm", "Bearer "):
        assert client_refusal("admin", header, "adm").startswith("capture refused: on this server only requests")
    assert client_refusal("none", "Bearer adm", "adm").startswith("capture refused: this server gives clients no hidden")
    assert client_refusal("admin", "Bearer \u00e9t\u00e9", "adm").startswith("capture refused:")  # not a TypeError


def test_a_request_asks_for_hidden_states_by_capture_or_return_hidden_states_alone_or_in_a_batch():
    from types import SimpleNamespace as NS

    from sglang_capture.server.hooks.admission import asks_hidden_states

    def req(params, rhs=False):
        return NS(sampling_params=params, return_hidden_states=rhs)

    assert not asks_hidden_states(req(None)) and not asks_hidden_states(req({"max_new_tokens": 1}))
    assert asks_hidden_states(req({"custom_params": {"capture": True}}))
    assert asks_hidden_states(req({"custom_params": {"capture": 1}}))  # refused, not captured, by the scheduler
    assert not asks_hidden_states(req({"custom_params": {"capture": False}}))
    assert asks_hidden_states(req({"custom_params": {"capture": False}}, rhs=True))  # SGLang's lists
    assert asks_hidden_states(req({}, rhs="last"))
    assert asks_hidden_states(req([{}, {"custom_params": {"capture": True}}]))
    assert asks_hidden_states(req([{}, {}], rhs=[False, True])) and not asks_hidden_states(req([{}, {}], [False, False]))


@pytest.mark.parametrize("level", ["normal", "admin_optional", "admin_force"])
def test_under_admin_the_admin_key_opens_normal_routes_and_nothing_else_changes(level):
    from functools import partial

    from sglang.srt.utils.auth import AuthLevel, decide_request_auth

    from sglang_capture.core.config import CaptureConfig
    from sglang_capture.server.hooks.admission import admit_admin_key

    for clients in ("admin", "any", None):
        hook = partial(admit_admin_key, CaptureConfig(capture_dir="/tmp", clients=clients))
        for header in ("Bearer adm", "Bearer key", "Bearer nope", None, "Basic adm"):
            kw = dict(method="POST", path="/generate", authorization_header=header, api_key="key",
                      admin_api_key="adm", auth_level=AuthLevel(level))
            plain, ours = decide_request_auth(**kw), hook(decide_request_auth, None, (), kw)
            opened = clients in ("admin", None) and level == "normal" and header == "Bearer adm"
            assert ours.allowed == (plain.allowed or opened), (clients, header)


def test_capture_clients_admin_without_an_admin_key_is_refused_at_start_in_one_line(tiny_models, tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", str(tmp_path),
                        "--capture-clients", "admin", "--model-path", tiny_models["tiny-llama"], "--device", "cpu"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert ("--capture-clients admin lets only requests with SGLang's admin API key ask for capture, and none is "
            "set: add --admin-api-key KEY") in r.stderr


def test_fraction_selection_is_a_fixed_share_of_rids():
    rids = [f"r{i}" for i in range(4000)]
    share = sum(fraction_selects(r, 0.25) for r in rids) / len(rids)
    assert 0.22 < share < 0.28
    assert not any(fraction_selects(r, 0.0) for r in rids) and all(fraction_selects(r, 1.0) for r in rids)
    # the first 8 bytes of the rid's sha256 over 2**64: the same on every host, process and release
    assert rid_point("r0") == 0.863664066158315 and fraction_selects("r0", 0.87) and not fraction_selects("r0", 0.86)
    # a smaller share picks a subset of a larger one: raising the fraction only adds requests
    assert all(fraction_selects(r, 0.5) for r in rids if fraction_selects(r, 0.1))


def test_a_capture_fraction_outside_zero_to_one_is_refused_in_one_line(tmp_path):
    import subprocess

    r = subprocess.run([sys.executable, "-m", "sglang_capture.launch", "--capture-dir", str(tmp_path),
                        "--capture-fraction", "1.5", "--model-path", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--capture-fraction must be between 0 and 1 (a share of requests), got 1.5" in r.stderr
