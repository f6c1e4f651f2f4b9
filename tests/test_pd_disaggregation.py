"""PD disaggregation (issue 16 item 3): capture on a prefill server, whose KV cache goes to a plain
decode server over Mooncake's transfer engine (its TCP transport: real transfers, on loopback).

A PD router sends each request to both servers with the same bootstrap fields; ``_via_router``
does what it does. Rows are compared with transformers in float32, as in test_deployment.py.
"""
from __future__ import annotations

import glob
import json
import os
import random
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Dict, Iterator, List, Tuple

import pytest
import requests
import torch

import sglang_capture
from sglang_capture.core.capture_dir import writer_stats
from sglang_capture.patches.version_gate import installed_sglang_version
from sglang_capture.testbed.server import Server, capture_cmd, free_port, plain_cmd
from sglang_capture.tools.client import ServerInfo, capture_prefill
from tests.conftest import server_factory
from tests.reference import max_abs_diff, min_block_cosines, min_row_cosine, reference_states
from tests.test_extract_tools import cli, extract, make_conversations

# 0.5.23's prefill server sends KV with pinned host memory and a CUDA event (_send_kv_chunk), which
# a CPU cannot give it: a routed request crashed the scheduler there, inside that SGLang function.
pytestmark = pytest.mark.skipif(installed_sglang_version() == "0.5.23",
                                reason="SGLang 0.5.23's PD prefill server does not run on a CPU")

LAYERS = [0, 2, 3]
TOL = 1e-4
CHUNK = 128
PD_ARGS = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--disaggregation-transfer-backend",
           "mooncake_tcp"]


@dataclass
class PD:
    prefill: Server
    decode: Server
    bootstrap_port: int
    model: str
    dp_ranks: int


# How the prefill server is parallel: one scheduler, or DP attention over two ranks (how DeepSeek-V3
# and Kimi-K2.5 prefill servers are deployed), where SGLang sends each request to the rank its
# bootstrap room names: ``admit_capture_request``'s random room for direct requests, the router's otherwise.
PREFILL_PARALLEL = {"tp1": (1, [], None),
                    "dp2-attention": (2, ["--tp", "2", "--dp", "2", "--enable-dp-attention"],
                                      {"SGLANG_CPU_OMP_THREADS_BIND": "0|1"})}


@pytest.fixture(scope="module")
def decode_server(make_server, tiny_models) -> Server:
    """One plain decode server for both prefill servers: each request names its prefill's bootstrap port."""
    return make_server(plain_cmd(tiny_models["tiny-dsv3"], *PD_ARGS, "--disaggregation-mode", "decode"))


@pytest.fixture(scope="module", params=list(PREFILL_PARALLEL))
def pd(request, decode_server, tiny_models, tmp_path_factory, env) -> Iterator[PD]:
    """A capture prefill server, stopped before the next param's starts (two cores run one at a time)."""
    model = tiny_models["tiny-dsv3"]
    capture_dir = str(tmp_path_factory.mktemp("pd-capture"))
    port = free_port()
    dp_ranks, parallel, extra_env = PREFILL_PARALLEL[request.param]
    servers = server_factory(tmp_path_factory, env)
    make = next(servers)
    try:
        prefill = make(capture_cmd(model, capture_dir, "--capture-layers", ",".join(map(str, LAYERS)), *PD_ARGS,
                                   *parallel, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port",
                                   str(port)), capture_dir, extra_env=extra_env)
        yield PD(prefill, decode_server, port, model, dp_ranks)
    finally:
        servers.close()


def _prompt(seed: int, n: int) -> List[int]:
    rng = random.Random(seed)
    return [rng.randrange(10, 1000) for _ in range(n)]


def _via_router(pd: PD, ids: List[int], params: Dict) -> Tuple[Dict, Dict]:
    """Both servers get the request with one bootstrap room, as SGLang's PD routers send it."""
    body = {"input_ids": ids, "sampling_params": params, "bootstrap_host": "127.0.0.1",
            "bootstrap_port": pd.bootstrap_port, "bootstrap_room": random.randrange(1 << 62)}
    with ThreadPoolExecutor(2) as ex:
        outs = [ex.submit(server.generate, body, 600) for server in (pd.prefill, pd.decode)]
        prefill, decode = (f.result() for f in outs)
    assert prefill.status_code == 200 and decode.status_code == 200, (prefill.text, decode.text)
    return prefill.json(), decode.json()


def _check_rows(pd: PD, ref: Dict, ids: List[int]) -> None:
    data = sglang_capture.load(ref["path"])
    assert data["input_ids"].tolist() == ids and len(data["output_ids"]) == 1
    aux, last = reference_states(pd.model, torch.float32, ids, LAYERS)
    assert data["aux_hidden_states"].shape == aux.shape == (len(ids), aux.shape[1])
    assert max_abs_diff(data["aux_hidden_states"], aux) <= TOL
    assert max_abs_diff(data["last_hidden_states"], last) <= TOL


def test_capture_requests_sent_straight_to_a_prefill_server_store_every_prompt_row_beside_routed_plain_requests(pd):
    """What ``sglang-capture extract`` sends (no bootstrap fields): prefilled on the prefill server,
    the KV handed to no one; plain requests decode through the decode server at the same time,
    so capture and plain requests share prefill batches. Prompts span one to three chunks."""
    server = ServerInfo(pd.prefill.url, pd.prefill.capture_dir, pd.model, LAYERS)
    prompts = {f"pd-direct-{n}": _prompt(n, n) for n in (17, 150, 330)}
    with ThreadPoolExecutor(6) as ex:
        plain = [ex.submit(_via_router, pd, _prompt(1000 + n, n), {"max_new_tokens": 5, "temperature": 0,
                                                                 "ignore_eos": True}) for n in (40, 200, 300)]
        refs = {name: ex.submit(capture_prefill, server, ids, name, [], 600) for name, ids in prompts.items()}
        plain_outs = [f.result() for f in plain]
        refs = {name: f.result() for name, f in refs.items()}
    for prefill_out, decode_out in plain_outs:
        assert "capture" not in prefill_out["meta_info"] and len(decode_out["output_ids"]) == 5
    for name, ids in prompts.items():
        assert refs[name]["status"] == "ok" and refs[name]["rows"] == len(ids)
        _check_rows(pd, refs[name], ids)


def test_a_longer_prompt_reuses_the_stored_prompt_rows_of_an_earlier_capture_on_the_prefill_server(pd):
    """Prefix sharing on a PD prefill server: the radix-cache hit is the prefill server's own, capped where
    the earlier capture's blocks end; the file reads whole and exact."""
    server = ServerInfo(pd.prefill.url, pd.prefill.capture_dir, pd.model, LAYERS)
    ids = _prompt(31, 140)
    first = capture_prefill(server, ids, "pd-turn-1", [], 600)
    longer = ids + _prompt(32, 60)
    second = capture_prefill(server, longer, "pd-turn-2", [], 600)
    assert first["status"] == second["status"] == "ok"
    # each DP rank has its own radix cache: on one rank the hit covers the first prompt's rows, on the other none
    assert second["rows_shared"] == len(ids) if pd.dp_ranks == 1 else second["rows_shared"] in (0, len(ids))
    assert second["rows_stored"] == len(longer) - second["rows_shared"]
    _check_rows(pd, second, longer)


def test_direct_capture_requests_are_captured_on_whichever_dp_rank_serves_them(pd):
    """Each DP rank of a prefill server captures the direct requests SGLang sends it (here routed
    to each rank by ``routed_dp_rank``; without it, by ``admit_capture_request``'s random bootstrap room)."""
    bodies = [{"input_ids": _prompt(500 + k, 40 + 70 * k), "routed_dp_rank": k % pd.dp_ranks,
               "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": {
                   "capture": True, "capture_name": f"pd-rank-{k}"}}} for k in range(2 * pd.dp_ranks)]
    before = _written_per_writer_rank(pd, settled=True)  # the previous test's last file counted before, not here
    with ThreadPoolExecutor(len(bodies)) as ex:
        outs = list(ex.map(lambda body: pd.prefill.generate(body, 600), bodies))
    for body, out in zip(bodies, outs, strict=True):
        assert out.status_code == 200, out.text
        ref = out.json()["meta_info"]["capture"]
        assert ref["status"] == "ok" and ref["rows"] == len(body["input_ids"])
        _check_rows(pd, ref, body["input_ids"])

    def added_since_before() -> Dict[str, int]:
        return {path: n - before.get(path, 0) for path, n in _written_per_writer_rank(pd).items()}

    want = [2] * pd.dp_ranks
    deadline = time.monotonic() + 30  # a writer's stats file follows its last outcome by a moment (more on a loaded CI machine)
    while sorted((added := added_since_before()).values()) != want and time.monotonic() < deadline:
        time.sleep(0.2)
    assert sorted(added.values()) == want, added


def _written_per_writer_rank(pd: PD, settled: bool = False) -> Dict[str, int]:
    """Files written so far by each writer rank, from its stats file."""
    return {path: s["written"] for path, s in writer_stats(pd.prefill.capture_dir, settled).items()}


def test_an_fp8_capture_on_a_prefill_server_keeps_every_row_within_cos_0_999(pd):
    """``capture_dtype`` fp8 per request, in a prefill batch shared with a plain routed request: the
    rows are quantized before the copy on a prefill server as on any server."""
    ids = _prompt(9, 200)
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 1, "temperature": 0, "custom_params": {
        "capture": True, "capture_name": "pd-fp8", "capture_dtype": "fp8"}}}
    with ThreadPoolExecutor(2) as ex:
        plain = ex.submit(_via_router, pd, _prompt(10, 120), {"max_new_tokens": 3, "temperature": 0,
                                                              "ignore_eos": True})
        out = pd.prefill.generate(body, 600)
        assert len(plain.result()[1]["output_ids"]) == 3
    ref = out.json()["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["storage_dtype"] == "float8_e4m3fn" and ref["rows"] == len(ids)
    data = sglang_capture.load(ref["path"])
    assert data["meta"]["storage_dtype"] == "float8_e4m3fn"
    aux, last = reference_states(pd.model, torch.float32, ids, LAYERS)
    assert min(min_block_cosines(data["aux_hidden_states"], aux, last.shape[-1])) >= 0.999
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.999


def test_a_routed_capture_request_is_captured_on_the_prefill_server_and_decoded_on_the_decode_server(pd):
    ids = _prompt(7, 260)
    prefill_out, decode_out = _via_router(pd, ids, {"max_new_tokens": 1, "temperature": 0, "custom_params": {
        "capture": True, "capture_name": "pd-routed"}})
    ref = prefill_out["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["path"].endswith("pd-routed.capture.msgpack")
    _check_rows(pd, ref, ids)
    # the decode server continued from the transferred KV: its one token is the prefill's
    assert decode_out["output_ids"] == prefill_out["output_ids"] == sglang_capture.load(ref["path"])["output_ids"].tolist()


def test_a_capture_request_that_needs_decode_rows_gets_an_error_and_still_decodes(pd):
    ids = _prompt(8, 90)
    prefill_out, decode_out = _via_router(pd, ids, {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True,
                                                    "custom_params": {"capture": True, "capture_name": "pd-decode"}})
    ref = prefill_out["meta_info"]["capture"]
    assert ref["status"] == "error"
    assert ref["error"].endswith("this request asks for 6 new tokens, whose rows the decode server computes; send "
                                 "capture requests with max_new_tokens 1")
    assert len(decode_out["output_ids"]) == 6  # the request itself is served
    assert not os.path.exists(ref["path"])
    assert not glob.glob(os.path.join(pd.prefill.capture_dir, ".tmp", "*"))
    with open(ref["index"]) as f:
        assert json.load(f)["status"] == "error"


def test_extract_against_a_prefill_server_writes_every_sample_and_verifies(pd, tmp_path, env):
    inp, out = tmp_path / "conversations.jsonl", tmp_path / "out"
    make_conversations(inp, n=6, seed=3)
    r = extract(pd.prefill, inp, out, "--concurrency", "3", env=env)
    assert r.returncode == 0 and "6 samples: 6 written" in r.stdout, r.stdout + r.stderr
    assert cli("verify", out, "--no-progress", env=env).returncode == 0
    for name in sorted(os.listdir(out)):
        if name.endswith(".capture.msgpack"):
            d = sglang_capture.load(out / name)
            assert d["aux_hidden_states"].shape[0] == d["last_hidden_states"].shape[0] == len(d["input_ids"])


@pytest.fixture(scope="module")
def pd_router(pd, make_server) -> Server:
    """sglang-router 0.3.2 in PD mode in front of the TP1 prefill server (with its bootstrap port) and the decode
    server: what a user deploys (issue 52 item 4)."""
    if pd.dp_ranks != 1:
        pytest.skip("the PD router is run in front of the TP1 prefill server")
    server = make_server([sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
                          "--prefill", pd.prefill.url, str(pd.bootstrap_port), "--decode", pd.decode.url,
                          "--policy", "round_robin", "--log-level", "warn", "--prometheus-port", str(free_port())])
    deadline = time.monotonic() + 60
    while True:  # the router answers /health before its workers are registered
        workers = requests.get(server.url + "/workers", timeout=5).json()["workers"]
        if len(workers) == 2 and all(w["is_healthy"] for w in workers):
            return server
        assert time.monotonic() < deadline, workers
        time.sleep(0.5)


def test_behind_the_pd_router_a_capture_is_written_on_the_prefill_server_and_its_reference_does_not_reach_the_client(
        pd, pd_router):
    """The PD router answers with the decode server's response: the client gets its completion and no reference;
    the file, whole and exact, and its outcome record are in the prefill server's capture dir under the name the
    client gave (docs/deployment.md, PD disaggregation)."""
    r = requests.post(pd_router.url + "/v1/completions", timeout=600, json={
        "model": "tiny", "prompt": "The capital of France is a city of many", "max_tokens": 1, "temperature": 0,
        "custom_params": {"capture": True, "capture_name": "via-pd-router"}})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["choices"][0]["finish_reason"] == "length" and "via-pd-router" not in r.text  # no reference
    path = os.path.join(pd.prefill.capture_dir, "via-pd-router.capture.msgpack")
    deadline = time.monotonic() + 60
    while not os.path.exists(path):  # the prefill server's response (which waited for it) went to the router
        assert time.monotonic() < deadline, "the prefill server wrote no file"
        time.sleep(0.2)
    data = sglang_capture.load(path)
    _check_rows(pd, {"path": path}, data["input_ids"].tolist())
    records = [json.load(open(p)) for p in glob.glob(os.path.join(pd.prefill.capture_dir, ".index", "*.json"))
               if not os.path.basename(p).startswith("_")]
    assert [rec["status"] for rec in records if rec.get("name") == "via-pd-router"] == ["ok"]


def test_extract_against_the_pd_router_captures_on_its_prefill_server_directly(pd, pd_router, tmp_path, env):
    """extract given the PD router finds its capture worker (the prefill server; the decode server is plain and
    skipped, said once) and sends its requests there directly, as to a prefill server."""
    inp, out = tmp_path / "conversations.jsonl", tmp_path / "out"
    make_conversations(inp, n=4, seed=5)
    r = extract(pd_router, inp, out, "--concurrency", "2", env=env)
    assert r.returncode == 0 and "4 samples: 4 written" in r.stdout, r.stdout + r.stderr
    said = r.stdout + r.stderr
    assert f"{pd_router.url} is an SGLang router: capturing on its 1 capture workers {pd.prefill.url} directly" in said
    assert f"skipped {pd.decode.url}" in said
    assert cli("verify", out, "--no-progress", env=env).returncode == 0
