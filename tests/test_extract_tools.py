"""The data tools on a real CPU capture server: extract, resume, verify, inspect, export, Dataset, errors."""
from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from transformers import AutoTokenizer

import sglang_capture
from sglang_capture.testbed.server import capture_cmd, free_port
from sglang_capture.tools.dataset import CaptureDataset
from sglang_capture.tools.manifest import MANIFEST, read_manifest

LAYERS = [0, 2, 3]
N_SAMPLES = 50
WORDS = ("the quick brown fox jumps over lazy dog hidden states are captured from every decoder layer "
         "Kimi uses DeepSeek architecture with MLA and MoE layers hello world tiny tokenizer").split()
TENSORS = ("input_ids", "loss_mask", "aux_hidden_states", "last_hidden_states")


def _sentence(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12))).capitalize() + "."


def make_conversations(path, n=N_SAMPLES, seed=0):
    """ShareGPT, OpenAI and plain-text lines, 1-3 exchanges each, some with explicit ids."""
    rng = random.Random(seed)
    records = []
    for i in range(n):
        turns = []
        if i % 5 == 0:
            turns.append(("system", _sentence(rng)))
        for _ in range(1 + i % 3):
            turns += [("user", _sentence(rng)), ("assistant", _sentence(rng))]
        if i % 10 == 9:
            rec = {"text": _sentence(rng) + " " + _sentence(rng)}
        elif i % 2:
            rec = {"messages": [{"role": r, "content": c} for r, c in turns]}
        else:
            sharegpt = {"system": "system", "user": "human", "assistant": "gpt"}
            rec = {"conversations": [{"from": sharegpt[r], "value": c} for r, c in turns]}
        if i % 4 == 0:
            rec["id"] = f"conv-{i:03d}"
        records.append(rec)
    with open(path, "w") as f:
        for rec in records:
            f.write(json.dumps(rec) + "\n")
    return records


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "sglang_capture", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout)


def extract(server, inp, out, *extra, env=None):
    return cli("extract", inp, "--server", server.url, "--out", out, "--no-progress", *extra, env=env)


def expected_encoding(tok, rec):
    if "text" in rec:
        ids = tok(rec["text"])["input_ids"]
        return ids, [1] * len(ids)
    if "messages" in rec:
        msgs = rec["messages"]
    else:
        role = {"system": "system", "human": "user", "gpt": "assistant"}
        msgs = [{"role": role[t["from"]], "content": t["value"]} for t in rec["conversations"]]
    # the test tokenizer's template marks assistant turns with {% generation %}: transformers'
    # own assistant mask is the reference
    enc = tok.apply_chat_template(msgs, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(enc["input_ids"]), list(enc["assistant_masks"])


def sample_id(rec, line):
    return rec.get("id", f"line-{line:08d}")


@pytest.fixture(scope="module")
def server(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("server-captures"))
    cmd = capture_cmd(tiny_models["tiny-dsv3"], capture_dir, "--capture-layers", ",".join(map(str, LAYERS)))
    return make_server(cmd, capture_dir)


@pytest.fixture(scope="module")
def conversations(tmp_path_factory):
    path = tmp_path_factory.mktemp("input") / "conversations.jsonl"
    return str(path), make_conversations(path)


@pytest.fixture(scope="module")
def reference_run(server, conversations, tmp_path_factory, env):
    """One uninterrupted extract, one request at a time (batch composition fixed, so re-runs are bit-exact)."""
    out = str(tmp_path_factory.mktemp("reference"))
    r = extract(server, conversations[0], out, "--concurrency", "1", env=env)
    assert r.returncode == 0, r.stderr
    return out


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _files(d):
    return sorted(f for f in os.listdir(d) if f.endswith(".capture.msgpack"))


def test_extract_writes_one_file_per_conversation_with_template_ids_and_assistant_mask(
        server, conversations, tiny_models, tmp_path, env):
    inp, records = conversations
    out = tmp_path / "out"
    r = extract(server, inp, out, "--concurrency", "4", env=env)
    assert r.returncode == 0, r.stderr
    assert f"{N_SAMPLES} samples: {N_SAMPLES} written" in r.stdout
    tok = AutoTokenizer.from_pretrained(tiny_models["tiny-dsv3"])
    assert len(_files(out)) == N_SAMPLES
    entries, problems = read_manifest(str(out))
    assert not problems and len(entries) == N_SAMPLES and len({e.id for e in entries}) == N_SAMPLES
    for line, rec in enumerate(records, start=1):
        d = sglang_capture.load(out / f"{sample_id(rec, line)}.capture.msgpack")
        ids, mask = expected_encoding(tok, rec)
        assert d["input_ids"].tolist() == ids
        assert d["loss_mask"].tolist() == mask and d["loss_mask"].dtype == torch.int64
        assert 0 < sum(mask) < len(mask) or "text" in rec
        # prefill only: one row per prompt token, no decode rows
        assert d["aux_hidden_states"].shape == (len(ids), len(LAYERS) * d["hidden_size"])
        assert d["last_hidden_states"].shape == (len(ids), d["hidden_size"])
    assert not any(".try-" in f for f in os.listdir(out)), "attempt files must not remain"
    assert not any(".try-" in f for f in os.listdir(server.capture_dir))


def test_killed_extract_resumes_to_the_same_files_without_duplicates(server, conversations, reference_run, tmp_path, env):
    inp, _ = conversations
    out = tmp_path / "resumed"
    cmd = [sys.executable, "-m", "sglang_capture", "extract", inp, "--server", server.url, "--out", str(out),
           "--no-progress", "--concurrency", "1"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        entries, _ = read_manifest(str(out)) if out.exists() else ([], [])
        if len(entries) >= 15:
            break
        assert proc.poll() is None, "extract finished before it could be killed"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    done_before = len(read_manifest(str(out))[0])
    assert 15 <= done_before < N_SAMPLES
    r = extract(server, inp, out, "--concurrency", "1", env=env)
    assert r.returncode == 0, r.stderr
    assert "already done" in r.stdout
    entries, problems = read_manifest(str(out))
    assert not problems and len(entries) == N_SAMPLES and len({e.id for e in entries}) == N_SAMPLES
    assert _files(out) == _files(reference_run)
    for name in _files(out):
        a = sglang_capture.load(out / name)
        b = sglang_capture.load(os.path.join(reference_run, name))
        for key in TENSORS:
            assert a[key].dtype == b[key].dtype and torch.equal(_bits(a[key]), _bits(b[key])), (name, key)
    assert cli("verify", out, "--no-progress").returncode == 0
    # the killed run's attempts and run lock are gone from the server's dir, as are the second run's
    assert not [n for n in os.listdir(server.capture_dir) if ".try-" in n]
    assert os.listdir(os.path.join(server.capture_dir, ".extract-runs")) == []


def test_rerun_of_a_finished_extract_sends_nothing(server, conversations, reference_run, env):
    before = {f: os.path.getmtime(os.path.join(reference_run, f)) for f in _files(reference_run)}
    r = extract(server, conversations[0], reference_run, env=env)
    assert r.returncode == 0, r.stderr
    assert f"0 written, {N_SAMPLES} already done" in r.stdout
    assert {f: os.path.getmtime(os.path.join(reference_run, f)) for f in _files(reference_run)} == before


@pytest.fixture
def damaged(reference_run, tmp_path):
    d = tmp_path / "copy"
    shutil.copytree(reference_run, d)
    return d


def _verify(d):
    r = cli("verify", d, "--no-progress")
    assert "Traceback" not in r.stdout + r.stderr
    return r


def test_verify_passes_on_a_clean_directory(damaged):
    r = _verify(damaged)
    assert r.returncode == 0 and f"{N_SAMPLES} decoded and consistent, 0 problems" in r.stdout


def test_verify_catches_a_flipped_byte(damaged):
    victim = damaged / _files(damaged)[3]
    data = bytearray(victim.read_bytes())
    data[len(data) * 2 // 3] ^= 0x40
    victim.write_bytes(bytes(data))
    r = _verify(damaged)
    assert r.returncode == 1
    assert any(line.startswith(victim.name) for line in r.stdout.splitlines())


def test_verify_catches_a_flipped_byte_without_a_manifest(damaged):
    os.unlink(damaged / MANIFEST)
    victim = damaged / _files(damaged)[5]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    r = _verify(damaged)
    assert r.returncode == 1 and f"{victim.name}: corrupt" in r.stdout


def test_verify_catches_a_truncated_file(damaged):
    victim = damaged / _files(damaged)[7]
    victim.write_bytes(victim.read_bytes()[:-100])
    r = _verify(damaged)
    assert r.returncode == 1 and f"{victim.name}: corrupt" in r.stdout


def test_verify_catches_a_missing_file(damaged):
    victim = _files(damaged)[11]
    os.unlink(damaged / victim)
    r = _verify(damaged)
    assert r.returncode == 1 and f"{victim}: missing" in r.stdout


def test_verify_catches_an_extra_file(damaged):
    shutil.copy(damaged / _files(damaged)[0], damaged / "stray.capture.msgpack")
    r = _verify(damaged)
    assert r.returncode == 1 and "stray.capture.msgpack: extra" in r.stdout


def test_inspect_shows_metadata_tensors_and_ratio(reference_run):
    name = _files(reference_run)[0]
    r = cli("inspect", os.path.join(reference_run, name))
    assert r.returncode == 0, r.stderr
    for text in ("aux_hidden_states", "last_hidden_states", "loss_mask", "bfloat16", "zstd", "ratio", "layers"):
        assert text in r.stdout


def test_export_specforge_files_load_with_the_exact_contract(reference_run, tmp_path):
    out = tmp_path / "specforge"
    r = cli("export", "--format", "specforge", reference_run, out, "--no-progress")
    assert r.returncode == 0, r.stderr
    assert '"eagle_aux_hidden_state_layer_ids": [0, 2, 3]' in r.stdout  # DeepSeek: SGLang keeps ids as given
    fragment = json.load(open(out / "eagle3_draft_config_fragment.json"))
    assert fragment == {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 2, 3]}}
    assert set(os.listdir(out)) - {"eagle3_draft_config_fragment.json"} == {c for c in os.listdir(out) if c.endswith(".ckpt")}
    ckpts = sorted(c for c in os.listdir(out) if c.endswith(".ckpt"))
    assert len(ckpts) == N_SAMPLES
    for ckpt in ckpts:
        s = torch.load(out / ckpt, weights_only=False, mmap=True)
        d = sglang_capture.load(os.path.join(reference_run, ckpt[:-len(".ckpt")] + ".capture.msgpack"))
        T, H = d["input_ids"].numel(), d["hidden_size"]
        assert set(s) == {"input_ids", "loss_mask", "hidden_state", "aux_hidden_state"}
        assert s["input_ids"].dtype == s["loss_mask"].dtype == torch.int64
        assert s["hidden_state"].dtype == s["aux_hidden_state"].dtype == torch.bfloat16
        assert s["input_ids"].shape == s["loss_mask"].shape == (T,)
        assert s["hidden_state"].shape == (1, T, H) and s["aux_hidden_state"].shape == (1, T, 3 * H)
        assert torch.equal(s["input_ids"], d["input_ids"]) and torch.equal(s["loss_mask"], d["loss_mask"])
        assert torch.equal(s["hidden_state"][0], d["last_hidden_states"])
        assert torch.equal(s["aux_hidden_state"][0], d["aux_hidden_states"])


def test_dataset_gives_random_access_in_manifest_order(reference_run):
    ds = CaptureDataset(reference_run)
    entries, _ = read_manifest(reference_run)
    assert len(ds) == N_SAMPLES
    for i in (0, 17, N_SAMPLES - 1, -1):
        item = ds[i]
        ref = sglang_capture.load(os.path.join(reference_run, entries[i].file))
        assert item["rid"] == ref["rid"] and item["aux_hidden_states"].dtype == torch.bfloat16
        assert torch.equal(item["aux_hidden_states"], ref["aux_hidden_states"])
    with pytest.raises(IndexError):
        ds[N_SAMPLES]
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    assert sum(1 for _ in loader) == N_SAMPLES


def test_bad_input_lines_are_reported_with_their_number_and_skipped(server, tmp_path, env):
    inp = tmp_path / "mixed.jsonl"
    inp.write_text("\n".join([
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
        '{"messages": [oops',
        json.dumps({"conversations": [{"from": "alien", "value": "x"}, {"from": "gpt", "value": "y"}]}),
        json.dumps({"text": "plain text sample"}),
        json.dumps({"id": "../evil", "text": "x"}),
        json.dumps({"messages": [{"role": "user", "content": "only a question"}]}),
    ]) + "\n")
    out = tmp_path / "out"
    r = extract(server, inp, out, env=env)
    assert r.returncode == 0, r.stderr
    assert "line 2: not valid JSON" in r.stderr
    assert "line 3: turn 0 has an unknown role 'alien'" in r.stderr
    assert "line 5: id '../evil' cannot name a file" in r.stderr
    assert "line 6: no assistant turn" in r.stderr
    assert "Traceback" not in r.stderr
    assert _files(out) == ["line-00000001.capture.msgpack", "line-00000004.capture.msgpack"]


def test_unreachable_server_is_one_clear_line(tmp_path, conversations, env):
    r = cli("extract", conversations[0], "--server", f"http://127.0.0.1:{free_port()}", "--out", tmp_path / "o", env=env)
    assert r.returncode == 1 and "cannot reach http://127.0.0.1" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_server_without_capture_is_one_clear_line(plain_llama, tmp_path, conversations, env):
    r = cli("extract", conversations[0], "--server", plain_llama.url, "--out", tmp_path / "o", env=env)
    assert r.returncode == 1 and "is not a capture server" in r.stderr and "sglang_capture.launch" in r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_tokenizer_without_chat_template_is_refused_before_any_request(server, conversations, tiny_models, tmp_path, env):
    tok = AutoTokenizer.from_pretrained(tiny_models["tiny-dsv3"])
    tok.chat_template = None
    tok.save_pretrained(tmp_path / "tok")
    for f in ("chat_template.jinja", "chat_template.json"):
        if (tmp_path / "tok" / f).exists():
            os.unlink(tmp_path / "tok" / f)
    r = cli("extract", conversations[0], "--server", server.url, "--out", tmp_path / "o", "--tokenizer",
            tmp_path / "tok", env=env)
    assert r.returncode == 1 and "has no chat template" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "o").exists() or not _files(tmp_path / "o")


def test_bad_loss_mask_spans_are_rejected_by_the_server(server):
    body = {"text": "hello world", "sampling_params": {"max_new_tokens": 1, "custom_params": {
        "capture": True, "capture_loss_mask": [[3, 1]]}}}
    r = server.generate(body)
    assert r.status_code == 400 and "capture_loss_mask" in r.text


def test_demo_command_captures_and_verifies(tmp_path, env):
    r = cli("demo", "--out", tmp_path / "demo", env=env, timeout=900)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "5 of 5 conversations captured and verified" in r.stdout


def test_extract_spreads_work_over_several_servers(server, tiny_models, make_server, tmp_path_factory, tmp_path, env):
    second_dir = str(tmp_path_factory.mktemp("second-server"))
    second = make_server(capture_cmd(tiny_models["tiny-dsv3"], second_dir, "--capture-layers",
                                     ",".join(map(str, LAYERS))), second_dir)
    inp = tmp_path / "ten.jsonl"
    make_conversations(inp, n=10, seed=1)
    out = tmp_path / "out"
    r = cli("extract", inp, "--server", server.url, "--server", second.url, "--out", out, "--no-progress",
            "--concurrency", "4", env=env)
    assert r.returncode == 0, r.stderr
    assert len(_files(out)) == 10 and cli("verify", out, "--no-progress").returncode == 0
    from sglang_capture.core.capture_dir import index_path

    per_server = {d: 0 for d in (server.capture_dir, second_dir)}
    for name in _files(out):  # the server that captured a sample recorded its outcome under the rid
        rid = sglang_capture.load(out / name, tensors=())["rid"]
        for d in per_server:
            per_server[d] += os.path.exists(index_path(d, rid))
    assert sum(per_server.values()) == 10 and all(per_server.values()), per_server


def test_one_extract_per_directory_and_the_lock_is_released(server, conversations, reference_run, env):
    import fcntl

    from sglang_capture.tools.extract import LOCK_FILE, Extractor

    for _ in range(2):  # in one process, twice: the first run must give the lock back
        report = Extractor(conversations[0], [server.url], reference_run, progress=False).run()
        assert report.written == 0 and report.skipped == N_SAMPLES
    with open(os.path.join(reference_run, LOCK_FILE), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as a running extract holds it
        r = extract(server, conversations[0], reference_run, env=env)
    assert r.returncode == 1 and "another extract is writing to" in r.stderr and "Traceback" not in r.stderr


def test_extract_can_store_fp8_on_a_server_whose_default_is_the_model_dtype(server, conversations, reference_run, tmp_path, env):
    inp = tmp_path / "five.jsonl"
    inp.write_text("".join(open(conversations[0]).readlines()[:5]))
    out = tmp_path / "fp8"
    r = extract(server, inp, out, "--capture-dtype", "fp8", env=env)
    assert r.returncode == 0, r.stderr
    names = _files(out)
    assert len(names) == 5
    for name in names:
        raw = sglang_capture.load(out / name, raw_fp8=True)
        assert raw["aux_hidden_states"].dtype == torch.float8_e4m3fn and raw["meta"]["storage_dtype"] == "float8_e4m3fn"
        fp8, bf16 = sglang_capture.load(out / name), sglang_capture.load(os.path.join(reference_run, name))
        assert torch.equal(fp8["input_ids"], bf16["input_ids"]) and torch.equal(fp8["loss_mask"], bf16["loss_mask"])
        cos = torch.nn.functional.cosine_similarity(fp8["aux_hidden_states"].float(), bf16["aux_hidden_states"].float(), dim=-1)
        assert cos.min().item() >= 0.999
    bad = extract(server, inp, tmp_path / "bad", "--capture-dtype", "fp16", env=env)
    assert bad.returncode == 2 and "Invalid value for '--capture-dtype'" in bad.stderr and "Traceback" not in bad.stderr


def test_extract_runs_sharing_a_capture_dir_remove_only_the_attempts_of_runs_that_are_gone(tmp_path):
    """Another extract still running against the same server keeps its attempts; a run killed
    with -9 loses them (and its lock file); attempts named before runs were tagged go too."""
    from sglang_capture.core.names import FILE_SUFFIX
    from sglang_capture.tools.attempts import RUNS_DIR, RunLocks

    cap = tmp_path / "capture-dir"
    cap.mkdir()
    code = ("import sys, time\nfrom sglang_capture.tools.attempts import RunLocks\nr = RunLocks()\n"
            "r.acquire(sys.argv[1])\nopen(sys.argv[1] + '/' + r.attempt_name('s1') + sys.argv[2], 'w').close()\n"
            "print(r.run, flush=True)\ntime.sleep(600)\n")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(cap), FILE_SUFFIX], stdout=subprocess.PIPE, text=True)
            for _ in range(2)]
    live, dead = runs
    try:
        tags = [p.stdout.readline().strip() for p in runs]
        dead.kill()
        dead.wait(30)
        (cap / f"s2.try-0123abcd{FILE_SUFFIX}").write_bytes(b"")  # an untagged attempt of an older version
        (cap / f"s3{FILE_SUFFIX}").write_bytes(b"")  # a plain capture file: never an attempt
        me = RunLocks()
        me.acquire(str(cap))
        (cap / (me.attempt_name("s4") + FILE_SUFFIX)).write_bytes(b"")
        assert me.remove_leftovers([str(cap)]) == 2
        left = sorted(os.listdir(cap))
        attempts = {n.split(".try-")[1].split("-")[0] for n in left if ".try-" in n}
        assert attempts == {tags[0], me.run} and f"s3{FILE_SUFFIX}" in left
        assert sorted(os.listdir(cap / RUNS_DIR)) == sorted([f"{tags[0]}.lock", f"{me.run}.lock"])
        live.kill()
        live.wait(30)
        assert me.remove_leftovers([str(cap)], own=True) == 2  # the end of this run: its own, and the now dead one's
        me.release()
        assert sorted(os.listdir(cap)) == [RUNS_DIR, f"s3{FILE_SUFFIX}"] and os.listdir(cap / RUNS_DIR) == []
    finally:
        for p in runs:
            if p.poll() is None:
                p.kill()
                p.wait(30)


def test_a_run_lock_taken_twice_under_two_names_of_one_dir_returns_at_once(tmp_path):
    """``/x/cap``, ``/x/cap/`` and a symlink to it are one directory: the second acquire must not open
    the lock file again and wait on its own lock (issue 34 item 1: it hung forever)."""
    import threading

    from sglang_capture.tools.attempts import RUNS_DIR, RunLocks

    cap = tmp_path / "cap"
    cap.mkdir()
    (tmp_path / "link").symlink_to(cap)
    runs = RunLocks(lock_timeout_s=60)
    done = threading.Event()

    def acquire_all():
        for name in (str(cap), str(cap) + "/", str(tmp_path / "link")):
            runs.acquire(name)
        done.set()

    threading.Thread(target=acquire_all, daemon=True).start()
    assert done.wait(10), "acquire under a second name of one directory blocked"
    assert os.listdir(cap / RUNS_DIR) == [f"{runs.run}.lock"]
    runs.release()
    assert os.listdir(cap / RUNS_DIR) == []


def test_a_run_lock_held_elsewhere_fails_within_its_bound_naming_the_lock(tmp_path):
    """No lock waits without a bound: one held by another open file description (another run
    judging this one, stuck) ends in a one-line error naming the lock file, and extract says it."""
    import fcntl

    from sglang_capture.core.durable import LockTimeout
    from sglang_capture.tools.attempts import RUNS_DIR, RunLocks

    cap = tmp_path / "cap"
    (cap / RUNS_DIR).mkdir(parents=True)
    runs = RunLocks(lock_timeout_s=0.5)
    holder = os.open(cap / RUNS_DIR / f"{runs.run}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(holder, fcntl.LOCK_EX)
    try:
        t0 = time.monotonic()
        with pytest.raises(LockTimeout) as e:
            runs.acquire(str(cap))
        assert 0.5 <= time.monotonic() - t0 < 5
        assert e.value.strerror == (f"waited 0.5 s for the lock on {cap / RUNS_DIR / runs.run}.lock, "
                                    "which another process holds")
    finally:
        os.close(holder)
    runs.acquire(str(cap))  # free now: taken
    runs.release()


def test_manifest_appenders_never_wait_for_the_disk_share_fsyncs_and_close_returns_once_every_line_is_on_it(
        tmp_path, monkeypatch):
    """32 threads append at once while the disk takes no fsync at all, and a write to the manifest
    waits for the fsync running on it (as a file system's inode lock makes it): every append returns
    (extract's workers go on with their next sample); once the disk moves again far fewer than 32
    fsyncs are made, and ``close`` returns only after an fsync that began once the last line was written."""
    import threading

    from sglang_capture.tools.manifest import Entry, ManifestWriter

    writer = ManifestWriter(str(tmp_path))
    real_fsync, fsyncs, disk = os.fsync, [], threading.Event()  # (lines in the file when it began, when it ended)
    syncing = threading.Event()

    class InodeLocked:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            if syncing.is_set():
                disk.wait(30)
            return self.f.write(text)

        def __getattr__(self, name):
            return getattr(self.f, name)

    writer._f = InodeLocked(writer._f)

    def stuck_fsync(fd):
        syncing.set()
        lines = open(tmp_path / MANIFEST).read().count("\n")
        disk.wait(30)
        real_fsync(fd)
        fsyncs.append((lines, time.monotonic()))

    monkeypatch.setattr(os, "fsync", stuck_fsync)
    writer.append(Entry("first", "first.capture.msgpack", 1, 1, "xxh3_128:0", 0))
    assert syncing.wait(10)  # its fsync runs, and holds the manifest's writes
    start, errors = threading.Barrier(32), []

    def append(i):
        try:
            start.wait()
            writer.append(Entry(f"s{i}", f"s{i}.capture.msgpack", i, i, "xxh3_128:0", i))
        except Exception as e:  # noqa: BLE001 - reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=append, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not errors and not any(t.is_alive() for t in threads) and not fsyncs  # all returned, none on disk yet
    disk.set()
    writer.close()
    closed = time.monotonic()
    entries, problems = read_manifest(str(tmp_path))
    assert not problems and sorted(e.id for e in entries) == sorted(["first"] + [f"s{i}" for i in range(32)])
    assert any(lines == 33 and ended <= closed for lines, ended in fsyncs), fsyncs
    assert len(fsyncs) <= 3


def test_a_manifest_fsync_that_fails_is_raised_by_close_and_by_the_next_append(tmp_path, monkeypatch):
    """The committer's failure reaches the workers: their next append raises it, and so does ``close``."""
    from sglang_capture.tools.manifest import Entry, ManifestWriter

    writer = ManifestWriter(str(tmp_path))

    def failing_fsync(fd):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    writer.append(Entry("a", "a.capture.msgpack", 1, 1, "xxh3_128:0", 1))
    deadline = time.monotonic() + 10
    while True:  # the committer's fsync fails in its own time
        try:
            writer.append(Entry("b", "b.capture.msgpack", 1, 1, "xxh3_128:0", 2))
        except OSError as e:
            assert "the manifest could not be put on disk: Input/output error" in str(e)
            break
        assert time.monotonic() < deadline, "the failed fsync never reached an appender"
        time.sleep(0.01)
    with pytest.raises(OSError, match="the manifest could not be put on disk"):
        writer.close()


@pytest.mark.parametrize("failure", [OSError(28, "No space left on device"), MemoryError("injected")])
def test_a_manifest_write_that_fails_is_raised_by_close_and_no_line_goes_after_it(tmp_path, failure):
    """Whatever stops the committer (a full disk, or an error that is not an OSError) reaches
    ``close``; an append after ``close`` is refused rather than lost."""
    from sglang_capture.tools.manifest import Entry, ManifestWriter

    writer = ManifestWriter(str(tmp_path))

    class Failing:
        def __init__(self, f):
            self.f = f

        def write(self, text):
            raise failure

        def __getattr__(self, name):
            return getattr(self.f, name)

    writer._f = Failing(writer._f)
    writer.append(Entry("a", "a.capture.msgpack", 1, 1, "xxh3_128:0", 1))
    with pytest.raises(OSError, match="the manifest could not be put on disk: " + str(failure.args[-1])):
        writer.close()
    with pytest.raises(ValueError, match="the manifest is closed"):
        writer._error = None  # the closed state alone refuses it
        writer.append(Entry("b", "b.capture.msgpack", 1, 1, "xxh3_128:0", 2))


def test_extract_keeps_one_connection_per_worker_thread(server, conversations, tmp_path, env):
    """Without kept-alive connections every sample opens a TCP connection and leaves a socket in
    TIME_WAIT (a long run exhausts local ports): 20 samples at concurrency 2 close at most
    2 connections (plus discovery's)."""
    import psutil

    port = int(server.url.rsplit(":", 1)[1])

    def closed():
        return {(c.laddr, c.raddr) for c in psutil.net_connections("tcp")
                if c.status == psutil.CONN_TIME_WAIT and port in (c.laddr.port, getattr(c.raddr, "port", None))}

    inp = tmp_path / "twenty.jsonl"
    inp.write_text("".join(open(conversations[0]).readlines()[:20]))
    before = closed()
    r = extract(server, inp, tmp_path / "out", "--concurrency", "2", env=env)
    assert r.returncode == 0, r.stderr
    assert len(_files(tmp_path / "out")) == 20
    assert 1 <= len(closed() - before) <= 3  # discovery's connection closes too: the count is seen


def test_concurrency_counts_requests_in_flight_while_other_workers_publish(server, conversations, tmp_path,
                                                                          monkeypatch):
    """--concurrency N keeps N requests at the server while earlier samples' files are published
    (links and directory fsyncs took about as long as the request in r106's SmolLM2 run, so N
    workers kept about N/2 requests in flight). Publishing is slowed here so that the overlap is
    certain; the count of requests never passes N."""
    from sglang_capture.tools import extract as extract_module

    monkeypatch.setenv("SGLANG_CAPTURE_CACHE", str(tmp_path / "cache"))
    lock = threading.Lock()
    state = {"requests": 0, "publishing": 0, "max_requests": 0, "full_while_publishing": 0}
    send, publish = extract_module.capture_prefill, extract_module.move_to_sample

    def counted(key, fn):
        def run(*a, **k):
            with lock:
                state[key] += 1
                state["max_requests"] = max(state["max_requests"], state["requests"])
                state["full_while_publishing"] += state["requests"] == 2 and state["publishing"] > 0
            try:
                if key == "publishing":
                    time.sleep(0.4)
                return fn(*a, **k)
            finally:
                with lock:
                    state[key] -= 1
        return run

    monkeypatch.setattr(extract_module, "capture_prefill", counted("requests", send))
    monkeypatch.setattr(extract_module, "move_to_sample", counted("publishing", publish))
    inp = tmp_path / "twelve.jsonl"
    inp.write_text("".join(open(conversations[0]).readlines()[:12]))
    report = extract_module.Extractor(str(inp), [server.url], str(tmp_path / "out"), concurrency=2,
                                      progress=False).run()
    assert report.written == 12 and not report.failures
    assert len(_files(tmp_path / "out")) == 12
    assert state["max_requests"] == 2
    assert state["full_while_publishing"] >= 3


def test_a_fatal_answer_stops_the_workers_waiting_for_a_request_slot(server, conversations, tmp_path, monkeypatch):
    """Workers waiting for one of the --concurrency slots when a server's answer stops the run (a
    refused key, say) send nothing: only the requests already in flight went out."""
    from sglang_capture.tools import extract as extract_module
    from sglang_capture.tools.client import ServerError

    monkeypatch.setenv("SGLANG_CAPTURE_CACHE", str(tmp_path / "cache"))
    sent = []
    send = extract_module.capture_prefill

    def refused_first(*a, **k):
        sent.append(1)
        first = len(sent) == 1
        time.sleep(0.5)  # the other workers have reached the slots meanwhile
        if first:
            raise ServerError("this server refuses capture requests from this client", fatal=True)
        return send(*a, **k)

    monkeypatch.setattr(extract_module, "capture_prefill", refused_first)
    inp = tmp_path / "twelve.jsonl"
    inp.write_text("".join(open(conversations[0]).readlines()[:12]))
    with pytest.raises(extract_module.ExtractError, match="refuses capture requests"):
        extract_module.Extractor(str(inp), [server.url], str(tmp_path / "out"), concurrency=2, progress=False).run()
    assert len(sent) == 2
