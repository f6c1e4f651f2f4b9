"""Prefix sharing on real CPU servers (tiny DeepSeek-V3, float32): capture requests keep radix-cache
hits where the rows are stored, every row is stored once, files read whole and exact; what happens
when stored rows are deleted, damaged or reused across servers, restarts and ``gc``."""
from __future__ import annotations

import glob
import json
import os
import threading
import time

import pytest
import requests
import torch
from transformers import AutoTokenizer

import sglang_capture
from sglang_capture.core.blocks import BLOCKS_DIR, block_relpath
from sglang_capture.core.capture_dir import index_path, read_stats
from sglang_capture.core.format import SCHEMA, SCHEMA_REFS, CaptureFileError, row_count
from sglang_capture.core.reader import load_records
from sglang_capture.testbed.server import capture_cmd, stop_server
from tests.chats import chat_turns, length_ended_last_row
from tests.reference import max_abs_diff, reference_states

TOL = 1e-4  # against transformers, as tests/test_e2e_deepseek.py
SAME = 1e-5  # a file read through shared blocks against a private capture of the same tokens
SYSTEM = "You answer questions about the hidden states of language models, briefly and exactly. " * 5


def _cmd(tiny_models, capture_dir, *extra):
    return capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", "0,2,3", "--dtype", "float32",
                       "--chunked-prefill-size", "64", *extra)


@pytest.fixture(scope="module")
def shared(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("shared"))
    return make_server(_cmd(tiny_models, capture_dir), capture_dir)


@pytest.fixture(scope="module")
def private(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("private"))
    return make_server(_cmd(tiny_models, capture_dir, "--capture-prefix-sharing", "off"), capture_dir)


@pytest.fixture
def operator(tiny_models, make_test_server, tmp_path_factory):
    """Every request captured by the operator's choice: answered without waiting for its file (one
    test uses it: stopped after it)."""
    capture_dir = str(tmp_path_factory.mktemp("operator"))
    return make_test_server(_cmd(tiny_models, capture_dir, "--capture-fraction", "1"), capture_dir)


@pytest.fixture(scope="module")
def tok(tiny_models):
    return AutoTokenizer.from_pretrained(tiny_models["tiny-dsv3"])


def capture(server, ids, name, max_new_tokens=4):
    r = server.generate({"input_ids": list(ids), "sampling_params": {
        "max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True,
        "custom_params": {"capture": True, "capture_name": name}}})
    assert r.status_code == 200, r.text
    return r.json()


def _exact(model, data):
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    aux, last = reference_states(model, torch.float32, ids, data["layers"])
    assert max_abs_diff(data["aux_hidden_states"], aux) <= TOL
    assert max_abs_diff(data["last_hidden_states"], last) <= TOL


def _conversation(server, tok, prefix, turns, name):
    """``turns`` turns, each re-sending the whole history; returns each turn's response."""
    history, outs = tok(SYSTEM + prefix)["input_ids"], []
    for t in range(turns):
        out = capture(server, history, f"{name}-{t}")
        outs.append(out)
        history = history + out["output_ids"] + tok(f" Then what about layer {t}?")["input_ids"]
    return outs


def test_each_turn_reuses_the_stored_rows_of_the_turns_before_and_reads_as_a_private_capture(shared, private, tok,
                                                                                          tiny_models):
    outs = _conversation(shared, tok, "What is a residual stream?", 3, "conv")
    rows = 0
    for t, out in enumerate(outs):
        ref = out["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        # turn t+1 reuses every row of turn t, its answer's decode rows too (and its last token's, where
        # SGLang fed it after the answer: rows_for_next_turn), and computes only what is new
        assert ref["rows_shared"] == rows and ref["rows_stored"] == ref["rows"] - rows
        assert t == 0 or out["meta_info"]["cached_tokens"] == rows
        assert ref["rows_for_next_turn"] == length_ended_last_row()
        rows = ref["rows"] + ref["rows_for_next_turn"]
        data = sglang_capture.load(ref["path"])
        assert data["schema"] == SCHEMA_REFS
        _exact(tiny_models["tiny-dsv3"], data)
        alone = capture(private, data["input_ids"].tolist(), f"alone-{t}", max_new_tokens=len(out["output_ids"]))
        theirs = sglang_capture.load(alone["meta_info"]["capture"]["path"])
        assert theirs["schema"] == SCHEMA and theirs["output_ids"].tolist() == data["output_ids"].tolist()
        assert max_abs_diff(data["aux_hidden_states"], theirs["aux_hidden_states"]) <= SAME
        assert max_abs_diff(data["last_hidden_states"], theirs["last_hidden_states"]) <= SAME
    # every row of the conversation is stored once: the blocks hold exactly its last turn's rows
    stored = sum(r[3] - r[2] for f in glob.glob(os.path.join(shared.capture_dir, "conv-2.capture.msgpack"))
                 for r in load_records(f)[0]["blocks"])
    assert stored == outs[-1]["meta_info"]["capture"]["rows"]


def test_a_capturing_chats_next_turn_hits_the_radix_cache_as_a_plain_chats_does(shared, private, tiny_models):
    """Under SGLang's overlap schedule the step after an answer's last token feeds that token (an
    answer a stop token ends, as a chat's end-of-turn token does), and the radix cache keeps its KV.
    Its row is kept too (server/answer_tail.py), in the capture's blocks only: so a capturing turn's
    hit is a plain turn's, every token of the turn before (before, it stopped one short and computed
    that token again: on Hopper a second attention tile over the whole history). The row reads
    exact, through the next turn's file, against a private capture."""
    history, _, plain = chat_turns(shared, 60)
    assert plain["meta_info"]["cached_tokens"] == history  # plain SGLang's hit: the first turn's every token
    history, one, two = chat_turns(shared, 61, "answer-tail")
    assert two["meta_info"]["cached_tokens"] == history
    ref1, ref2 = one["meta_info"]["capture"], two["meta_info"]["capture"]
    assert ref1["status"] == "ok" and ref1["rows"] == history - 1 and ref1["rows_for_next_turn"] == 1, ref1
    assert sglang_capture.load(ref1["path"])["aux_hidden_states"].shape[0] == history - 1  # its file's rows as before
    assert ref2["status"] == "ok" and ref2["rows_shared"] == history, ref2
    data = sglang_capture.load(ref2["path"])
    _exact(tiny_models["tiny-dsv3"], data)
    alone = capture(private, data["input_ids"].tolist(), "answer-tail-alone", max_new_tokens=len(two["output_ids"]))
    theirs = sglang_capture.load(alone["meta_info"]["capture"]["path"])
    assert theirs["output_ids"].tolist() == data["output_ids"].tolist()
    for name in ("aux_hidden_states", "last_hidden_states"):
        assert max_abs_diff(data[name], theirs[name]) <= SAME
        assert max_abs_diff(data[name][history - 1], theirs[name][history - 1]) <= SAME  # the row kept after the answer


@pytest.fixture(scope="module")
def turn_dirs(shared, private, tok, tmp_path_factory):
    """A 3-turn conversation's files as ``extract`` leaves them: its shared-prefix files (blocks linked
    beside them) in one directory, private captures of the same tokens in another."""
    import shutil

    from sglang_capture.tools.extract import move_to_sample

    root = tmp_path_factory.mktemp("turns")
    dirs = {"shared": root / "shared", "private": root / "private"}
    for d in dirs.values():
        d.mkdir()
    for t, out in enumerate(_conversation(shared, tok, "What does the drafter train on?", 3, "export")):
        ref = out["meta_info"]["capture"]
        move_to_sample(ref["path"], str(dirs["shared"] / f"turn-{t}.capture.msgpack"), keep_source=True)
        prompt = sglang_capture.load(ref["path"], tensors=("input_ids",))["input_ids"].tolist()
        alone = capture(private, prompt, f"export-alone-{t}", max_new_tokens=len(out["output_ids"]))
        shutil.copy(alone["meta_info"]["capture"]["path"], dirs["private"] / f"turn-{t}.capture.msgpack")
    return dirs


def test_a_specforge_export_of_shared_files_equals_one_of_private_captures(turn_dirs, tmp_path):
    """What a drafter trains on is the same whether the files share rows or not: the SpecForge export of
    a conversation's shared-prefix files against that of private captures of the same tokens."""
    from sglang_capture.tools.export_specforge import export_specforge

    for name, d in turn_dirs.items():
        export_specforge(str(d), str(tmp_path / f"{name}-out"), all_tokens=True, progress=False)
    for t in range(3):
        a, b = (torch.load(tmp_path / f"{name}-out" / f"turn-{t}.ckpt", weights_only=False) for name in turn_dirs)
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"])
        for key in ("hidden_state", "aux_hidden_state"):  # bf16 there: rounding may move one value by an ulp
            torch.testing.assert_close(a[key].float(), b[key].float(), atol=SAME, rtol=2 ** -7)


def test_the_drafter_chains_count_sees_each_shared_row_once_and_every_private_row_again(turn_dirs):
    """bench/drafter_run.py's sharecap figures on real files: rows stored against the turns' unique rows
    (1 shared; each turn's history again when private), and the rows read through blocks against the
    private captures', per column."""
    from drafter_run import _compare_rows, stored_rows  # bench/ is on sys.path (tests/conftest.py)

    shared, private = (stored_rows(str(turn_dirs[k])) for k in ("shared", "private"))
    assert shared["unique_rows"] == private["unique_rows"] > 0
    # the blocks hold each row once; the first may also hold rows of another conversation opening alike
    # (SYSTEM), of which this one references only the shared part
    assert shared["rows_in_files"] == 0 and shared["unique_rows"] <= shared["rows_in_blocks"]
    assert shared["stored_per_unique"] <= 1.1
    metas = [sglang_capture.load(str(turn_dirs["private"] / f"turn-{t}.capture.msgpack"), tensors=())["meta"]
             for t in range(3)]
    turns = [row_count(int(m["num_prompt_tokens"]), int(m["num_output_tokens"])) for m in metas]
    assert private["rows_in_blocks"] == 0 and private["rows_in_files"] == sum(turns)
    assert turns[-1] == private["unique_rows"] and private["stored_per_unique"] > 1.5
    rows = _compare_rows(str(turn_dirs["shared"]), str(turn_dirs["private"]), [f"turn-{t}" for t in range(3)],
                         "shared", "private")
    assert rows["pass"] and rows["files"] == 3 and rows["rows"] == sum(turns)
    assert all(c["p0.1"] > 0.99999 for c in rows["columns"].values())


def test_the_writer_stats_count_each_block_once(shared, tok):
    _conversation(shared, tok, "Counting the blocks.", 2, "count")
    stats = read_stats(shared.capture_dir, settled=True)
    assert stats["blocks_written"] > 0 and stats["rows_shared"] > 0 and stats["missing_blocks"] == 0
    on_disk = sum(os.path.getsize(p) for p in glob.glob(os.path.join(shared.capture_dir, BLOCKS_DIR, "*", "*.msgpack")))
    assert on_disk == stats["block_bytes"]  # each block's bytes counted by the one writer that stored it


def test_a_turn_whose_history_left_the_radix_cache_stores_only_its_new_rows(shared, tok, tiny_models):
    """Dedup on write does not depend on radix hits: a history computed again (the cache emptied, as
    eviction or a restart leaves it) is referenced from the stored blocks, not stored a second time."""
    first = capture(shared, tok(SYSTEM + "Evicted history.")["input_ids"], "evicted-1")
    ref1 = first["meta_info"]["capture"]
    r = requests.post(shared.url + "/flush_cache", params={"timeout": 30}, timeout=60)
    assert r.status_code == 200, r.text
    data1 = sglang_capture.load(ref1["path"])
    history = data1["input_ids"].tolist() + data1["output_ids"].tolist()
    ref2 = capture(shared, history + tok(" And then?")["input_ids"], "evicted-2")["meta_info"]["capture"]
    assert ref1["rows_for_next_turn"] == length_ended_last_row()
    shared_rows = ref1["rows"] + ref1["rows_for_next_turn"]  # the first's rows (and its answer's last)
    assert ref2["status"] == "ok" and ref2["rows_shared"] == shared_rows
    assert ref2["rows_stored"] == ref2["rows"] - shared_rows
    data2 = sglang_capture.load(ref2["path"])
    _exact(tiny_models["tiny-dsv3"], data2)
    assert torch.equal(data2["aux_hidden_states"][:ref1["rows"]], data1["aux_hidden_states"])


def test_sharing_off_captures_as_before_every_file_whole(private, tok, tiny_models):
    ids = tok(SYSTEM + "Private capture.")["input_ids"]
    first = capture(private, ids, "off-1")["meta_info"]["capture"]
    again = capture(private, ids, "off-2")["meta_info"]["capture"]  # the same prompt: computed whole again
    for ref in (first, again):
        assert ref["status"] == "ok" and "rows_shared" not in ref and "block_bytes" not in ref
        data = sglang_capture.load(ref["path"])
        assert data["schema"] == SCHEMA and "blocks" not in data["meta"]
        _exact(tiny_models["tiny-dsv3"], data)
    assert glob.glob(os.path.join(private.capture_dir, BLOCKS_DIR, "*", "*")) == []
    assert "prefix sharing on" not in private.log()


def test_a_prefix_a_plain_request_cached_is_computed_again_for_a_capture(shared, private, tok, tiny_models):
    prefix = tok("Only plain requests have sent this prefix before. " * 4)["input_ids"]  # no stored block shares it
    body = {"input_ids": prefix, "sampling_params": {"max_new_tokens": 3, "temperature": 0}}
    plain = shared.generate(body).json()
    assert plain["output_ids"] == private.generate(body).json()["output_ids"]  # the same answer as plain SGLang's
    ref = capture(shared, prefix + tok(" And a question.")["input_ids"], "after-plain")["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["rows_shared"] == 0 and ref["rows_stored"] == ref["rows"]
    _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))
    again = shared.generate(body).json()  # a plain request after the capture cached the same prefix
    assert again["output_ids"] == plain["output_ids"] and "capture" not in again["meta_info"]


def _blocks_of(ref):
    meta, _ = load_records(ref["path"])
    return [os.path.join(os.path.dirname(ref["path"]), BLOCKS_DIR, block_relpath(r[0])) for r in meta["blocks"]]


@pytest.mark.parametrize("damage", ["deleted", "truncated"])
def test_reused_rows_that_are_gone_fail_the_capture_loudly_and_its_retry_computes_them(shared, tok, tiny_models,
                                                                                      damage):
    first = capture(shared, tok(SYSTEM + f"Rows that get {damage}.")["input_ids"], f"{damage}-1")
    block = _blocks_of(first["meta_info"]["capture"])[0]
    if damage == "deleted":
        os.unlink(block)
    else:
        os.truncate(block, os.path.getsize(block) // 2)
    turn = first["meta_info"]["capture"]["rows"] + 1
    ids = tok(SYSTEM + f"Rows that get {damage}.")["input_ids"] + first["output_ids"] + tok(" More.")["input_ids"]
    failed = capture(shared, ids, f"{damage}-2")["meta_info"]["capture"]
    assert failed["status"] == "error" and "gone or changed" in failed["error"] and "retry" in failed["error"]
    assert not os.path.exists(failed["path"])
    retry = capture(shared, ids, f"{damage}-3")["meta_info"]["capture"]
    assert retry["status"] == "ok" and retry["rows_shared"] < turn  # the damaged block's rows computed again
    _exact(tiny_models["tiny-dsv3"], sglang_capture.load(retry["path"]))


def test_a_block_damaged_in_place_is_never_read_as_rows(shared, tok):
    ref = capture(shared, tok(SYSTEM + "A flipped byte.")["input_ids"], "flipped")["meta_info"]["capture"]
    block = _blocks_of(ref)[-1]
    with open(block, "r+b") as f:
        f.seek(os.path.getsize(block) - 40)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x55]))
    with pytest.raises(CaptureFileError, match=f"block {os.path.basename(block).split('.')[0]} .* is corrupt"):
        sglang_capture.load(ref["path"])


def test_two_servers_on_one_directory_and_a_restart_store_the_same_rows_once(shared, tok, tiny_models,
                                                                           make_test_server):
    ids = tok("Two servers on one directory store these rows once. " * 6)["input_ids"]  # no stored prefix
    one = capture(shared, ids, "two-a")["meta_info"]["capture"]
    assert one["rows_shared"] == 0 and one["rows_stored"] == one["rows"]
    assert one["rows_for_next_turn"] == length_ended_last_row()
    other = make_test_server(_cmd(tiny_models, shared.capture_dir), shared.capture_dir)
    two = capture(other, ids, "two-b")["meta_info"]["capture"]  # no radix hit there: computed, found stored
    assert two["status"] == "ok" and two["rows_shared"] == two["rows"] and two["block_bytes"] == two["rows_stored"] == 0
    assert _blocks_of(one) == _blocks_of(two)
    # a restarted server knows no stored block until a capture stores or finds it: no stale radix hit either
    stop_server(other)
    restarted = make_test_server(_cmd(tiny_models, shared.capture_dir), shared.capture_dir)
    again = capture(restarted, ids, "two-c")
    assert again["meta_info"]["capture"]["block_bytes"] == 0
    longer = ids + again["output_ids"] + tok(" And after the restart?")["input_ids"]
    turn = capture(restarted, longer, "two-d")["meta_info"]["capture"]
    assert turn["rows_shared"] == again["meta_info"]["capture"]["rows"] + one["rows_for_next_turn"]  # stored by "two-a"
    for ref in (one, two, turn):
        _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))


def test_gc_beside_a_capturing_server_never_leaves_a_file_without_its_rows(shared, tok, tiny_models):
    from sglang_capture.tools.gc import collect

    stop, runs = threading.Event(), []

    def collector():
        while not stop.is_set():
            runs.append(collect(shared.capture_dir, min_age_s=0))
            time.sleep(0.05)

    thread = threading.Thread(target=collector)
    thread.start()
    try:
        outs = [out for i in range(3) for out in _conversation(shared, tok, f"Collected while capturing {i}.", 3,
                                                                f"gc-{i}")]
    finally:
        stop.set()
        thread.join()
    assert len(runs) > 3
    # gc takes no block a published file references, and a capture whose own new blocks it took meanwhile
    # writes them again: every turn is captured whole
    for out in outs:
        ref = out["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))
    final = collect(shared.capture_dir, min_age_s=0)
    assert final.problems == [] and final.referenced == final.blocks


def _ahead_jobs(capture_dir):
    try:
        return read_stats(capture_dir).get("ahead_jobs", 0)
    except OSError:  # the stats file being replaced
        return -1


def test_a_prompt_is_stored_once_its_prefill_is_done_and_a_capture_sharing_it_reuses_it_before_the_first_is_answered(
        shared, tok, tiny_models):
    """Chats that open together with one long system prompt (issue 50's first round): the whole slots
    of a capture's prompt are stored as soon as its prefill is done, by a job ahead of its file, so a
    capture sharing the prompt keeps its radix hit while the first is still decoding (before, a
    capture could reuse only rows stored by a finished request: it computed the prompt again). The
    first's file references those blocks, each is stored once, and both files read exact."""
    import random
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(50)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]  # two whole slots of 256 and a tail
    whole = 512
    before = read_stats(shared.capture_dir, settled=True)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(capture, shared, prompt, "ahead-first", 400)
        deadline = time.monotonic() + 60
        while _ahead_jobs(shared.capture_dir) <= before.get("ahead_jobs", 0):
            assert not first.done() and time.monotonic() < deadline, "its prompt was not stored ahead of its answer"
            time.sleep(0.1)
        time.sleep(1.0)  # the stats file may count the job a few ms before the scheduler has its blocks
        second = capture(shared, prompt + [7], "ahead-second", max_new_tokens=20)  # long enough to store ahead
        still_decoding = not first.done()
        answer = first.result(timeout=300)
    assert still_decoding  # else the test proves nothing: the first's answer too short for this machine
    assert second["meta_info"]["cached_tokens"] == whole  # the stored whole slots, not the tail the first's KV holds
    ref = second["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["rows_shared"] == whole and ref["rows_stored"] == ref["rows"] - whole
    _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))
    mine = answer["meta_info"]["capture"]
    # its prompt's slots were stored ahead of its file, by its own job: its rows, none shared
    assert mine["status"] == "ok" and mine["rows_stored"] == mine["rows"] and mine["rows_shared"] == 0
    _exact(tiny_models["tiny-dsv3"], sglang_capture.load(mine["path"]))
    assert [r[0] for r in load_records(mine["path"])[0]["blocks"][:2]] == \
        [r[0] for r in load_records(ref["path"])[0]["blocks"][:2]]  # the same two blocks in both files
    after = read_stats(shared.capture_dir, settled=True)
    assert after["ahead_jobs"] - before.get("ahead_jobs", 0) == 1  # the second's whole slots were stored: none ahead
    # the two whole slots stored once, by the ahead job; each request's rows after them by itself
    assert after["rows_stored"] - before.get("rows_stored", 0) == whole + (mine["rows"] - whole) + (ref["rows"] - whole)
    assert after["blocks_reused"] - before.get("blocks_reused", 0) == 0  # the first's file took them as stored ahead


def test_captures_opening_together_with_one_new_prompt_wait_until_the_first_has_stored_it_and_compute_it_once(
        shared, tiny_models):
    """Chats opening together with one new system prompt (issue 50's first round, r87): the first
    capture admitted computes the prompt and owns its whole slots; captures sharing them wait in
    SGLang's queue until its job ahead has stored them, then reuse them. Before, each was admitted
    as soon as SGLang could fit it and, the blocks not stored yet, computed the prompt again. One
    batch request makes them arrive together; every file reads exact."""
    import random

    rng = random.Random(51)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]  # two whole slots of 256 and a tail
    whole = 512
    before = read_stats(shared.capture_dir, settled=True)
    params = [{"max_new_tokens": 24, "temperature": 0, "ignore_eos": True,  # > 16: stored ahead
               "custom_params": {"capture": True, "capture_name": f"together-{i}"}} for i in range(3)]
    r = shared.generate({"input_ids": [prompt + [11 + i] for i in range(3)], "sampling_params": params})
    assert r.status_code == 200, r.text
    outs = r.json()
    assert sorted(o["meta_info"]["cached_tokens"] for o in outs) == [0, whole, whole]  # computed once
    for o in outs:
        ref = o["meta_info"]["capture"]
        assert ref["status"] == "ok", ref
        _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))
    after = read_stats(shared.capture_dir, settled=True)
    assert after["ahead_jobs"] - before.get("ahead_jobs", 0) == 1
    assert after["rows_stored"] - before.get("rows_stored", 0) == sum(o["meta_info"]["capture"]["rows"] for o in outs) \
        - 2 * whole  # the prompt's whole slots stored once
    held, was = after["prompt_holds"], before.get("prompt_holds") or {"owners": 0, "held": 0, "timed_out": 0}
    assert held["held"] - was["held"] == 2 and held["timed_out"] == was["timed_out"]


class _WritersWait:
    """Hold ``.blocks/.gc.lock`` exclusively, as ``gc`` does while it judges blocks: every writer
    waits before it stores a block or publishes a file of references, so nothing is stored meanwhile."""

    def __init__(self, capture_dir):
        import fcntl

        self.fd = os.open(os.path.join(capture_dir, BLOCKS_DIR, ".gc.lock"), os.O_RDWR | os.O_CREAT, 0o640)
        fcntl.flock(self.fd, fcntl.LOCK_EX)

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _stats_reach(capture_dir, what, timeout=60):
    """Wait until the stats file's counters satisfy ``what`` (the scheduler's counters travel ahead
    of each batch of jobs; an idle hand-off thread rewrites the file within a second or two)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            stats = read_stats(capture_dir)
        except OSError:
            stats = {}
        if stats and what(stats):
            return stats
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def _flight(stats, key):
    return (stats.get("in_flight") or {}).get(key, 0)


def _next_turn_before_the_last_file(shared, seed, kill_writers=False):
    """A chat's first turn captured while every writer waits (``_WritersWait``), its next turn sent
    as soon as the first is done: the second reuses the first's rows while they are still in flight.
    ``kill_writers``: the writer processes are killed while the first's job is in one of them."""
    import random
    import signal
    from concurrent.futures import ThreadPoolExecutor

    rng = random.Random(seed)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]
    # the first's answer, computed by a plain request (greedy, the same batch shapes): its tokens are in
    # the next turn, which is sent before the first's capture is answered (its file is not written yet)
    plain = shared.generate({"input_ids": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0,
                                                                      "ignore_eos": True}}).json()
    nxt = prompt + plain["output_ids"] + [rng.randrange(10, 1000) for _ in range(40)]
    before = read_stats(shared.capture_dir, settled=True)
    wait = _WritersWait(shared.capture_dir)
    try:
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(capture, shared, prompt, f"flight-{seed}-1", 12)  # <= 16 tokens: no job ahead
            _stats_reach(shared.capture_dir, lambda s: _flight(s, "jobs") > _flight(before, "jobs"))
            second = pool.submit(capture, shared, nxt, f"flight-{seed}-2", 8)
            # its job queued (after the first's), parked behind the first's, which a writer holds
            stats = _stats_reach(shared.capture_dir, lambda s: s.get("parked", 0) > before.get("parked", 0))
            assert not first.done() and not second.done()  # nothing was stored
            if kill_writers:
                for pid in stats["writer_pids"]:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(1.0)  # the first's writer is gone; the second's job now waits for the lock
            wait.release()
            answers = first.result(timeout=120), second.result(timeout=120)
    finally:
        wait.release()
    assert answers[0]["output_ids"] == plain["output_ids"]
    return prompt, nxt, before, answers


def test_a_chats_next_turn_sent_before_the_last_answers_file_is_written_reuses_its_rows_in_flight(shared, tiny_models):
    """Closed-loop chat traffic (issue 50's load with no think time): the next turn arrives while the
    last turn's file is still queued. The rows its job will store are in flight: the next turn's radix
    hit is capped at their end, not at what is stored (before, it computed them again, r90), its file
    references them and is written only after that job (the supervisor parks it), and both read exact."""
    prompt, nxt, before, (one, two) = _next_turn_before_the_last_file(shared, 53)
    rows1 = len(prompt) + 12 - 1
    ref1, ref2 = one["meta_info"]["capture"], two["meta_info"]["capture"]
    last = ref1["rows_for_next_turn"]  # its answer's last token's row, where SGLang fed it after the answer
    assert last == length_ended_last_row()
    assert two["meta_info"]["cached_tokens"] == rows1 + last  # the first turn's prompt and answer rows, in flight
    assert ref1["status"] == "ok" and ref1["rows_stored"] == rows1, ref1
    assert ref2["status"] == "ok" and ref2["rows_shared"] == rows1 + last, ref2
    assert ref2["rows_stored"] == ref2["rows"] - rows1 - last, ref2
    for ref in (ref1, ref2):
        _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))
    assert [r[0] for r in load_records(ref1["path"])[0]["blocks"]] == \
        [r[0] for r in load_records(ref2["path"])[0]["blocks"][:3]]  # the first's three blocks, in both files
    after = read_stats(shared.capture_dir, settled=True)
    assert _flight(after, "reused") - _flight(before, "reused") == 1
    assert after["parked"] - before["parked"] == 1
    # every row once (the prompt: by the first), and each answer's last where it was fed
    assert after["rows_stored"] - before["rows_stored"] == ref2["rows"] - last
    assert after["rows_for_next_turn"] - before["rows_for_next_turn"] == last + ref2["rows_for_next_turn"]


def test_a_turn_that_reused_rows_whose_store_then_failed_fails_naming_them_and_its_retry_computes_them(
        shared, tiny_models):
    """The writer storing the rows a next turn reused in flight dies (killed): that turn's file would
    hold no rows for them, so it fails loudly, naming the blocks (never a wrong row); the index
    forgets them on the failure, and the turn sent again computes them and reads exact."""
    _, nxt, _, (one, two) = _next_turn_before_the_last_file(shared, 54, kill_writers=True)
    ref1, ref2 = one["meta_info"]["capture"], two["meta_info"]["capture"]
    assert ref1["status"] == "error", ref1
    assert ref2["status"] == "error" and "the stored rows it reuses are gone" in ref2["error"], ref2
    assert not os.path.exists(ref2["path"])
    again = capture(shared, nxt, "flight-54-again", 8)
    assert again["meta_info"]["cached_tokens"] == 0  # nothing of it is stored or in flight any more
    ref = again["meta_info"]["capture"]
    assert ref["status"] == "ok", ref
    _exact(tiny_models["tiny-dsv3"], sglang_capture.load(ref["path"]))


def _file_written(path, timeout=120):
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was not written"
        time.sleep(0.1)
    return path


def test_an_operators_chat_turn_answered_before_its_file_is_written_is_reused_in_flight_by_the_next_turn(
        operator, tiny_models):
    """Production chat traffic as the operator captures it: a turn is answered without waiting for its
    file, and sealed only after its answer is sent (the order: test_server_hooks.py); the rows its
    job will store are still in flight before the chat's next turn is read, so that turn reuses them
    (every writer waits meanwhile: nothing is stored yet) and both files read exact."""
    import random

    rng = random.Random(55)
    prompt = [rng.randrange(10, 1000) for _ in range(600)]

    def turn(ids, rid, n):
        r = operator.generate({"input_ids": list(ids), "rid": rid, "sampling_params": {
            "max_new_tokens": n, "temperature": 0, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        assert "capture" not in r.json()["meta_info"]  # the operator's choice: a plain answer
        return r.json()

    files = [os.path.join(operator.capture_dir, f"op-chat-{t}.capture.msgpack") for t in (1, 2)]
    wait = _WritersWait(operator.capture_dir)
    try:
        one = turn(prompt, "op-chat-1", 12)  # <= 16 tokens: no job ahead
        two = turn(prompt + one["output_ids"] + [rng.randrange(10, 1000) for _ in range(40)], "op-chat-2", 8)
        assert not any(os.path.exists(f) for f in files)  # answered while every writer waits
    finally:
        wait.release()
    for path in files:
        _exact(tiny_models["tiny-dsv3"], sglang_capture.load(_file_written(path)))
    with open(index_path(operator.capture_dir, "op-chat-1")) as f:  # its outcome record
        last = json.load(f)["rows_for_next_turn"]  # its answer's last row, where SGLang fed it after the answer
    assert last == length_ended_last_row()
    # the first turn's prompt and answer rows, in flight: a plain turn's hit
    assert two["meta_info"]["cached_tokens"] == len(prompt) + 12 - 1 + last
    first = [r[0] for r in load_records(files[0])[0]["blocks"]]
    assert len(first) == 3 and [r[0] for r in load_records(files[1])[0]["blocks"][:3]] == first
