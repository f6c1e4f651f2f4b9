"""End to end on a tiny bf16 Llama: OpenAI endpoints, the host pool, FP8, and a plain SGLang server beside it.

Fidelity with the default layers against transformers is checked on real weights
(SmolLM2-135M-Instruct, tests/test_e2e_real_model.py).
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import requests
import torch

import sglang_capture
from sglang_capture.core.capture_dir import read_stats
from sglang_capture.testbed.server import capture_cmd
from tests.chats import chat_turns
from tests.reference import min_block_cosines, min_row_cosine, reference_pre_norm, reference_states

PROMPTS = ["hello world, this is a tiny tokenizer", "The quick brown fox jumps over the lazy dog."]


@pytest.fixture(scope="module")
def llama(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    return make_server(capture_cmd(tiny_models["tiny-llama"], capture_dir, "--capture-final", "both"), capture_dir)


@pytest.fixture(scope="module")
def plain(plain_llama):
    return plain_llama


def _body(text, **extra):
    return {"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}, **extra}


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
    ref = r.json()["choices"][0]["hidden_states"]  # where an OpenAI response carries hidden states
    assert ref["status"] == "ok" and ref["path"] == path and ref["rid"] == data["rid"]
    assert data["aux_hidden_states"].shape[0] == len(data["input_ids"]) + len(data["output_ids"]) - 1


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_openai_responses_carry_each_choices_reference_in_one_chunk_before_the_usage_chunk(llama, endpoint):
    """With the real ``openai`` client's streaming API: one chunk after the choices' own holds one choice
    per captured choice, its reference where SGLang streams hidden states (``delta.hidden_states`` for a
    chat, the choice's ``hidden_states`` for a completion), before the usage chunk, which stays last as
    OpenAI's clients expect; the file is complete when it arrives."""
    import openai

    client = openai.OpenAI(base_url=llama.url + "/v1", api_key="none")
    common = dict(model="tiny", max_tokens=3, temperature=0.8, n=2, stream=True,
                  stream_options={"include_usage": True}, extra_body={"custom_params": {"capture": True}})
    if endpoint == "chat":
        chunks = list(client.chat.completions.create(messages=[{"role": "user", "content": "hello world"}], **common))
        refs = {c.index: (c.delta.model_extra or {}).get("hidden_states") for c in chunks[-2].choices}
    else:
        chunks = list(client.completions.create(prompt="hello world", **common))
        refs = {c.index: (c.model_extra or {}).get("hidden_states") for c in chunks[-2].choices}
    # each choice's generation, through its finish, came before the references (its sampled tokens may
    # decode to no text at all: the tiny model's vocabulary has byte tokens)
    finished = {ch.index for c in chunks[:-2] for ch in c.choices if ch.finish_reason}
    assert finished == {0, 1}, "the stream carried each choice's generation before its references"
    assert chunks[-1].usage is not None and not chunks[-1].choices  # SGLang's usage chunk, still last
    assert sorted(refs) == [0, 1]
    paths = set()
    for ref in refs.values():
        assert ref["status"] == "ok", ref
        data = sglang_capture.load(ref["path"])  # complete when the reference arrived
        assert data["rid"] == ref["rid"] and len(data["output_ids"]) == 3
        paths.add(ref["path"])
    assert len(paths) == 2  # each choice its own file


def test_a_streamed_openai_response_without_capture_gets_no_reference_chunk(llama):
    import openai

    client = openai.OpenAI(base_url=llama.url + "/v1", api_key="none")
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=2, temperature=0, stream=True))
    assert chunks and not any("hidden_states" in (c.delta.model_extra or {}) for ch in chunks for c in ch.choices)


def test_requests_without_capture_are_answered_like_plain_sglang(llama, plain):
    # from the same (empty) radix cache: a prefix cached by an earlier test's capture would make this server
    # compute fewer positions than plain SGLang, and bf16 rows differ by an ulp where the cached prefix ends
    for server in (llama, plain):
        r = requests.post(server.url + "/flush_cache", params={"timeout": 30}, timeout=60)
        assert r.status_code == 200, r.text
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


def _host_pool_stats(server, settled: bool = False) -> dict:
    return read_stats(server.capture_dir, settled).get("host_pool") or {}


def test_hidden_states_go_through_the_host_pool_and_stay_exact(llama, tiny_models):
    body = _body(" ".join(PROMPTS) * 3)
    body["sampling_params"]["custom_params"] = {"capture": True, "capture_name": "through-the-pool"}
    before = _host_pool_stats(llama, settled=True).get("blocks", 0)
    out = llama.generate(body).json()
    assert out["meta_info"]["capture"]["status"] == "ok"
    data = sglang_capture.load(out["meta_info"]["capture"]["path"])
    # one block for the prefill and one per decode step fed back (the stats file follows the outcome)
    deadline = time.monotonic() + 10
    while (pool := _host_pool_stats(llama))["blocks"] - before < body["sampling_params"]["max_new_tokens"]:
        assert time.monotonic() < deadline, f"host pool counters did not move: {pool}"
        time.sleep(0.05)
    assert pool["fallbacks"] == 0 and pool["size_bytes"] == 8192 << 20 and not pool["pinned"]
    stats = read_stats(llama.capture_dir, settled=True)
    assert stats["inline_bytes"] == 0  # writer processes read the rows in the pool, by offset
    assert stats["result_copy"]["decode_rows_scattered"] >= body["sampling_params"]["max_new_tokens"] - 1  # by the row copier
    deadline = time.monotonic() + 60  # the collector is watched from the first batch result on (watch_gc)
    while stats["gc_pauses"]["gen0"]["calls"] == 0:  # as the server's first request, maybe none ran yet: make some
        assert time.monotonic() < deadline, stats["gc_pauses"]
        # SGLang 0.5.23's scheduler makes few Python objects per request (6 collections in 748 requests): a burst
        with ThreadPoolExecutor(8) as burst:
            list(burst.map(lambda i: llama.generate(_body(PROMPTS[i % 2])), range(32)))
        _capture(llama, PROMPTS[0], f"gc-{time.monotonic_ns()}")  # a file: the stats file is rewritten after it
        stats = read_stats(llama.capture_dir, settled=True)
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    aux, last = reference_states(tiny_models["tiny-llama"], torch.bfloat16, ids, data["layers"])
    assert min(min_block_cosines(data["aux_hidden_states"], aux, 256)) >= 0.999
    assert data["final"] == data["meta"]["final"] == "both"  # --capture-final both: post-norm and pre-norm
    assert min_row_cosine(data["last_hidden_states"], last) >= 0.999
    pre = reference_pre_norm(tiny_models["tiny-llama"], torch.bfloat16, ids)
    assert min_row_cosine(data["last_hidden_states_pre_norm"], pre) >= 0.999
    assert min_row_cosine(data["last_hidden_states_pre_norm"], last) < 0.99  # the final norm's weights are not ones


@pytest.fixture(scope="module")
def llama_fp8(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture-fp8"))
    cmd = capture_cmd(tiny_models["tiny-llama"], capture_dir, "--capture-dtype", "fp8", "--capture-layers", "1,2,3",
                      "--capture-max-pending-mb", str(SMALL_CAP_MB), "--capture-final", "both")
    return make_server(cmd, capture_dir)


SMALL_CAP_MB = 4  # the fp8 server's host memory for pending writes: what a decode-heavy load must stay under


def test_a_long_generation_beside_a_stream_of_short_ones_stays_under_the_host_memory_cap(llama_fp8):
    """One capture decoding 600 tokens while eight clients keep sending short captures: every
    decode step's batch shares one host block, which would stay alive (views of it) until the
    long request is written: about 600 x 9 rows of 2 KB, three times the cap. Decode rows move
    to runs of their own request, so the server's held memory never passes the cap (over its
    whole life) and the pool never has to fall back to SGLang's own pinned copies."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    long_done = threading.Event()
    written_before = read_stats(llama_fp8.capture_dir, settled=True).get("written", 0)

    def short_stream(i: int) -> int:
        n = 0
        while not long_done.is_set():
            body = _body(f"{PROMPTS[i % 2]} short {i} {n}")
            body["sampling_params"].update(max_new_tokens=30)
            body["sampling_params"]["custom_params"] = {"capture": True, "capture_dtype": "model"}
            assert llama_fp8.generate(body).json()["meta_info"]["capture"]["status"] == "ok"
            n += 1
        return n

    with ThreadPoolExecutor(8) as pool:
        shorts = [pool.submit(short_stream, i) for i in range(8)]
        try:
            body = _body(PROMPTS[1])
            body["sampling_params"].update(max_new_tokens=600)
            body["sampling_params"]["custom_params"] = {"capture": True, "capture_dtype": "model", "capture_name": "long"}
            ref = llama_fp8.generate(body, timeout=900).json()["meta_info"]["capture"]
        finally:
            long_done.set()
        served = sum(f.result() for f in shorts)
    assert ref["status"] == "ok" and ref["rows"] == ref["shapes"]["last_hidden_states_pre_norm"][0] >= 600
    assert served >= 8 * 2  # the short ones really ran beside it
    deadline = time.monotonic() + 30
    while (stats := read_stats(llama_fp8.capture_dir)).get("written", 0) < written_before + served + 1:
        assert time.monotonic() < deadline, f"the writer stats did not catch up: {stats}"
        time.sleep(0.1)
    assert stats["cap_bytes"] == SMALL_CAP_MB << 20
    assert stats["peak_held_bytes"] <= stats["cap_bytes"], stats
    assert stats["host_pool"]["fallbacks"] == 0, stats["host_pool"]


def _capture(server, text, name, **params):
    body = _body(text)
    body["sampling_params"]["custom_params"] = {"capture": True, "capture_name": name, **params}
    ref = server.generate(body).json()["meta_info"]["capture"]
    assert ref["status"] == "ok", ref
    return ref


def test_fp8_capture_halves_the_bytes_and_keeps_every_row_within_cos_0_999_of_the_bf16_capture(llama, llama_fp8, tmp_path,
                                                                                              tiny_models):
    """Both final states of the FP8 server (--capture-final both) are packed and restored like the aux layers."""
    from sglang_capture.tools.export_specforge import export_specforge
    from sglang_capture.tools.inspect_file import describe_file
    from sglang_capture.tools.verify import check_file

    text = " ".join(PROMPTS) * 2
    bf16, fp8 = _capture(llama, text, "bf16-ref"), _capture(llama_fp8, text, "fp8-row")
    assert fp8["storage_dtype"] == "float8_e4m3fn" and fp8["dtype"] == "bfloat16"
    a, b = sglang_capture.load(bf16["path"]), sglang_capture.load(fp8["path"])
    assert b["meta"]["storage_dtype"] == "float8_e4m3fn" and b["aux_hidden_states"].dtype == torch.bfloat16  # restored
    assert sglang_capture.load(fp8["path"], raw_fp8=True)["aux_hidden_states"].dtype == torch.float8_e4m3fn
    assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["output_ids"], b["output_ids"])
    # the bf16 server captures layers 2,3 (defaults), the fp8 one 1,2,3: compare layers 2 and 3
    assert min_row_cosine(b["aux_hidden_states"][:, 256:], a["aux_hidden_states"]) >= 0.999
    assert b["final"] == "both" and set(fp8["shapes"]) == {"aux_hidden_states", "last_hidden_states",
                                                           "last_hidden_states_pre_norm"}
    assert min_row_cosine(b["last_hidden_states"], a["last_hidden_states"]) >= 0.999
    assert min_row_cosine(b["last_hidden_states_pre_norm"], a["last_hidden_states_pre_norm"]) >= 0.999
    ids = b["input_ids"].tolist() + b["output_ids"].tolist()[:-1]  # and against transformers itself
    assert min_row_cosine(b["last_hidden_states_pre_norm"], reference_pre_norm(tiny_models["tiny-llama"],
                                                                               torch.bfloat16, ids)) >= 0.999
    raw = sglang_capture.load(fp8["path"], raw_fp8=True)
    n = raw["aux_hidden_states"].shape[0]
    assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and raw["aux_hidden_states_scale"].shape == (n, 3)
    assert raw["last_hidden_states_scale"].shape == raw["last_hidden_states_pre_norm_scale"].shape == (n, 1)
    assert check_file(fp8["path"], fp8["checksum"]) == []
    lines = describe_file(fp8["path"])
    assert any("float8_e4m3fn" in line and "aux_hidden_states " in line for line in lines)
    assert any(line.split() == ["final", "both"] for line in lines)
    report = export_specforge(llama_fp8.capture_dir, str(tmp_path / "sf"), all_tokens=True, progress=False)
    assert report.written >= 1 and "stored as FP8" in report.note
    sample = torch.load(tmp_path / "sf" / "fp8-row.ckpt")
    assert sample["aux_hidden_state"].dtype == torch.bfloat16
    assert min_row_cosine(sample["hidden_state"][0], b["last_hidden_states"]) >= 0.999  # the post-norm state, for SpecForge


def test_fp8_captures_beside_sglang_json_requests_in_one_batch_stay_exact_for_both(llama, llama_fp8):
    """A batch with an SGLang JSON request keeps its hidden states in bf16 for that request; the
    FP8 captures' rows are packed into a second copy before the copy (never per request after it)."""
    from concurrent.futures import ThreadPoolExecutor

    before = read_stats(llama_fp8.capture_dir, settled=True)["result_copy"]
    texts = [f"{PROMPTS[i % 2]} {i}" for i in range(6)]
    with ThreadPoolExecutor(12) as pool:
        caps = [pool.submit(_capture, llama_fp8, t, f"beside-json-{i}") for i, t in enumerate(texts)]
        jsons = [pool.submit(lambda t: llama_fp8.generate(_body(t, return_hidden_states=True)).json(), t) for t in texts]
        refs = [pool.submit(_capture, llama, t, f"beside-json-ref-{i}") for i, t in enumerate(texts)]
        plain = [pool.submit(lambda t: llama.generate(_body(t, return_hidden_states=True)).json(), t) for t in texts]
    for cap, ref, ours, theirs in zip(caps, refs, jsons, plain, strict=True):
        got, want = sglang_capture.load(cap.result()["path"]), sglang_capture.load(ref.result()["path"])
        assert min_row_cosine(got["aux_hidden_states"][:, 256:], want["aux_hidden_states"]) >= 0.999
        h_ours, h_theirs = ours.result()["meta_info"]["hidden_states"], theirs.result()["meta_info"]["hidden_states"]
        assert len(h_ours) == len(h_theirs) and len(h_ours[0][0]) == 256  # the final state only, in full precision
        # SGLang's JSON path returns only the rows it computed (a radix hit skips the cached prefix),
        # so compare the prompt's last row and the decode rows
        assert min_row_cosine(torch.tensor(h_ours[0][-1:]), torch.tensor(h_theirs[0][-1:])) >= 0.999
        assert min_row_cosine(torch.tensor(h_ours[1:]), torch.tensor(h_theirs[1:])) >= 0.999
    # every FP8 row was packed once per batch before the copy (on a GPU: on the device), none
    # per request in the row seams (on the host: the scheduler thread)
    deadline = time.monotonic() + 10  # the stats file follows the last outcome by a moment
    while (after := read_stats(llama_fp8.capture_dir)["result_copy"])["fp8_packed_before_copy_rows"] \
            <= before["fp8_packed_before_copy_rows"]:
        assert time.monotonic() < deadline, after
        time.sleep(0.05)
    assert after["fp8_packed_per_request_rows"] == before["fp8_packed_per_request_rows"] == 0


def test_fp8_rows_are_shared_with_fp8_captures_only(llama_fp8):
    """Under prefix sharing an FP8 capture reuses the FP8 blocks of a shorter one, never the bf16 blocks
    of the same tokens (another layout), and the other way round; every file reads within the bar."""
    text = "Shared prefixes, stored once per storage dtype. " * 5
    first = _capture(llama_fp8, text, "fp8-turn-1")
    as_bf16 = _capture(llama_fp8, text + " More.", "bf16-turn-2", capture_dtype="model")
    as_fp8 = _capture(llama_fp8, text + " More.", "fp8-turn-2")
    assert first["rows_shared"] == 0 and as_bf16["rows_shared"] == 0 and as_fp8["rows_shared"] > 0
    a, b = sglang_capture.load(as_bf16["path"]), sglang_capture.load(as_fp8["path"])
    assert b["meta"]["storage_dtype"] == "float8_e4m3fn" and "storage_dtype" not in a["meta"]
    assert min(min_block_cosines(b["aux_hidden_states"], a["aux_hidden_states"], 256)) >= 0.999


def test_an_fp8_chats_next_turn_reuses_its_answers_last_row_packed_as_fp8(llama_fp8):
    """The row the overlap step computed after an FP8 capture's answer ended (server/answer_tail.py) is
    kept as the step's copy packed it: the next turn's hit reaches every token of the turn before, as a
    plain turn's does, and its file reads within the FP8 bar of a capture in the model's dtype."""
    history, one, two = chat_turns(llama_fp8, 86, "fp8-chat")  # a seed whose answer a stop token ends
    assert two["meta_info"]["cached_tokens"] == history
    assert one["meta_info"]["capture"]["rows_for_next_turn"] == 1
    ref = two["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["rows_shared"] == history, ref
    b = sglang_capture.load(ref["path"])
    body = {"input_ids": b["input_ids"].tolist(), "sampling_params": {
        "max_new_tokens": len(two["output_ids"]), "temperature": 0, "ignore_eos": True,
        "custom_params": {"capture": True, "capture_name": "fp8-chat-model", "capture_dtype": "model"}}}
    a = sglang_capture.load(llama_fp8.generate(body).json()["meta_info"]["capture"]["path"])
    assert b["meta"]["storage_dtype"] == "float8_e4m3fn" and a["output_ids"].tolist() == b["output_ids"].tolist()
    assert min(min_block_cosines(b["aux_hidden_states"], a["aux_hidden_states"], 256)) >= 0.999
    assert min_row_cosine(b["last_hidden_states"], a["last_hidden_states"]) >= 0.999
    kept = slice(history - 1, history)  # the first turn's answer's last row, read from its blocks
    assert min_row_cosine(b["last_hidden_states"][kept], a["last_hidden_states"][kept]) >= 0.999


def test_the_storage_dtype_can_be_chosen_per_request_and_a_bad_one_is_refused(llama, llama_fp8):
    text = PROMPTS[0] + " per request"
    as_fp8 = _capture(llama, text, "per-request-fp8", capture_dtype="fp8")
    as_model = _capture(llama_fp8, text, "per-request-model", capture_dtype="model")
    assert as_fp8["storage_dtype"] == "float8_e4m3fn" and "storage_dtype" not in as_model
    a, b = sglang_capture.load(as_fp8["path"]), sglang_capture.load(as_model["path"])
    assert (a["meta"].get("storage_dtype"), b["meta"].get("storage_dtype")) == ("float8_e4m3fn", None)
    assert min_row_cosine(a["aux_hidden_states"], b["aux_hidden_states"][:, 256:]) >= 0.999
    body = _body(text)
    body["sampling_params"]["custom_params"] = {"capture": True, "capture_dtype": "fp16"}
    r = llama.generate(body)
    assert r.status_code == 400 and "custom_params.capture_dtype must be one of model, fp8, got 'fp16'" in r.text


def test_speculators_trains_on_the_export_of_pre_norm_captures_and_refuses_broken_ones(llama_fp8, tiny_models, tmp_path):
    """``export --format speculators`` of pre-norm captures (the FP8 server, bf16 and FP8 files
    alike) passes speculators' own check (tests/speculators_check.py): its dataset and dataloader
    load it, its targets equal transformers' logits, and one training step runs. The same data
    with the post-norm final state, or with one layer missing, fails that check; post-norm files
    are refused by the export in one line."""
    import shutil

    from safetensors.torch import load_file, save_file

    from sglang_capture.tools.export_speculators import export_speculators
    from sglang_capture.tools.extract import move_to_sample
    from tests.reference import _model
    from tests.speculators_check import train_one_step

    target = tiny_models["tiny-llama"]
    src = tmp_path / "captures"
    src.mkdir()
    for i in range(4):
        ids = [10 + (7 * i + 3 * k) % 200 for k in range(40 + 15 * i)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                      "custom_params": {"capture": True, "capture_name": f"spec-{i}",
                                                                        "capture_dtype": "fp8" if i == 0 else "model",
                                                                        "capture_loss_mask": [[5, 30]]}}}
        ref = llama_fp8.generate(body).json()["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        move_to_sample(ref["path"], str(src / os.path.basename(ref["path"])), keep_source=True)  # its blocks too
    out = tmp_path / "spec"
    report = export_speculators(str(src), str(out), progress=False)
    assert (report.samples, report.written, report.layers) == (4, 4, [1, 2, 3]) and "stored as FP8" in report.note
    hs = load_file(str(out / "hidden_states" / "hs_1.safetensors"))
    d = sglang_capture.load(str(src / "spec-1.capture.msgpack"))
    assert hs["hidden_states"].shape == (58, 4, 256) and hs["token_ids"].tolist() == d["input_ids"].tolist() + \
        d["output_ids"].tolist()[:3]
    assert torch.equal(hs["hidden_states"][:, 3], d["last_hidden_states_pre_norm"])
    assert torch.equal(hs["hidden_states"][:, :3].flatten(1), d["aux_hidden_states"])
    freq = torch.load(out / "token_freq.pt")  # the trained tokens: the prompt span [5, 30) and 3 fed-back answers, x4
    assert sum(freq.values()) == 4 * (25 + 3) and set(hs["token_ids"][5:30].tolist()) <= set(freq)
    result = train_one_step(str(out), target, report.layers, min_target_cos=0.995)  # sample 0 stored as FP8
    assert min(result["target_cos"][k] for k in (1, 2, 3)) >= 0.999 and result["target_cos"][0] >= 0.995
    assert export_speculators(str(src), str(out), progress=False).skipped == 4  # a second run rewrites nothing

    def broken(name, change):
        bad = tmp_path / name
        shutil.copytree(out, bad)
        for f in (bad / "hidden_states").iterdir():
            t = load_file(str(f))
            save_file({"token_ids": t["token_ids"], "hidden_states": change(t["hidden_states"]).contiguous()}, str(f))
        return str(bad)

    norm = _model(target, torch.float32).model.norm  # what the post-norm state is: the model's final norm applied
    post = broken("post-norm", lambda h: torch.cat([h[:, :3], norm(h[:, 3:].float()).to(h.dtype)], 1))
    with pytest.raises(AssertionError, match="targets differ from the target model's logits"):
        train_one_step(post, target, report.layers, min_target_cos=0.995)
    two_layers = broken("two-layers", lambda h: h[:, 1:])
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied"):  # its fc layer takes 3 layers' columns
        train_one_step(two_layers, target, report.layers)
