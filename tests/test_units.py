"""Names, layers, options, assembly and host-memory back-pressure, without a server."""
from __future__ import annotations

import threading
import types
import time

import pytest
import torch

from sglang_capture.assembler import IncompleteCapture, assemble_rows
from sglang_capture.format import host_tensor
from sglang_capture.config import CaptureConfig, ConfigError, check_writer_cpus, parse_cpu_list, parse_layers
from sglang_capture.layers import LayerError, default_layers, resolve_layers
from sglang_capture.ledger import HostMemoryLedger
from sglang_capture.naming import BadCaptureName, check_capture_name, name_for_rid


@pytest.mark.parametrize("name", ["../x", "/abs", "a/b", "a\x00b", "..", ".hidden", "x" * 129, "", "a..b", "é"])
def test_unsafe_capture_names_are_refused(name):
    with pytest.raises(BadCaptureName):
        check_capture_name(name)


def test_safe_capture_names_pass_and_unsafe_rids_become_digests():
    assert check_capture_name("sample-0001.v2_a") == "sample-0001.v2_a"
    assert name_for_rid("abc123") == "abc123"
    digest = name_for_rid("../../etc/passwd")
    assert digest.startswith("rid-") and "/" not in digest and digest == name_for_rid("../../etc/passwd")


def test_kimi_default_layers_are_3_31_59():
    assert default_layers(61, "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert default_layers(61, "KimiK25ForConditionalGeneration") == [3, 31, 59]
    assert default_layers(32, "LlamaForCausalLM") == [3, 17, 30]


def test_layer_ids_are_checked_against_the_model():
    assert resolve_layers([59, 3, 31], 61, "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert resolve_layers([0], 4, "DeepseekV3ForCausalLM") == [0]
    with pytest.raises(LayerError, match="out of range.*0..3"):
        resolve_layers([4], 4, "DeepseekV3ForCausalLM")
    with pytest.raises(LayerError, match="accepts ids 1..3"):
        resolve_layers([0], 4, "LlamaForCausalLM")  # no residual enters Llama's layer 0
    with pytest.raises(LayerError, match="no aux hidden-state capture"):
        resolve_layers(None, 12, "GPT2LMHeadModel")


@pytest.mark.parametrize("text,msg", [("3,x", "comma-separated integers"), (",", "empty")])
def test_layer_option_parsing(text, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_layers(text)


def test_config_round_trips_through_the_environment(tmp_path):
    cfg = CaptureConfig(capture_dir=str(tmp_path), layers=[31, 3, 59], level=3)
    assert cfg.layers == [3, 31, 59]
    assert CaptureConfig.from_env({"SGLANG_CAPTURE_CONFIG": cfg.to_env()}) == cfg
    assert CaptureConfig.from_env({}) is None
    with pytest.raises(ConfigError, match="duplicates"):
        CaptureConfig(capture_dir=str(tmp_path), layers=[3, 3])
    with pytest.raises(ConfigError, match="capture-writers"):
        CaptureConfig(capture_dir=str(tmp_path), writer_threads=-1)
    assert CaptureConfig(capture_dir=str(tmp_path), writer_threads=5).threads_for_writing() == 5
    with pytest.raises(ConfigError, match="capture-writer-nice must be 0 .* to 19"):
        CaptureConfig(capture_dir=str(tmp_path), writer_nice=20)
    assert parse_cpu_list("2,4-6,4") == [2, 4, 5, 6, 4]
    assert CaptureConfig(capture_dir=str(tmp_path), writer_cpus=[6, 2, 4, 5, 4]).writer_cpus == [2, 4, 5, 6]
    assert CaptureConfig(capture_dir=str(tmp_path), writer_cpus=[0, 1, 2, 3, 4]).threads_for_writing() == 3
    for bad in ("", "3-1", "-2", "a"):
        with pytest.raises(ConfigError, match="capture-writer-cpus must be a CPU list"):
            parse_cpu_list(bad)
    check_writer_cpus([1, 2], allowed={0, 1, 2})
    with pytest.raises(ConfigError, match=r"names CPUs 3-4,7 that this server may not use; it may use 0-2$"):
        check_writer_cpus([2, 3, 4, 7], allowed={0, 1, 2})
    assert 2 <= CaptureConfig(capture_dir=str(tmp_path)).threads_for_writing() <= 16


def test_rows_are_placed_by_position_later_rows_win():
    a = torch.arange(0, 12, dtype=torch.float32).view(4, 3)      # positions 0..3
    b = torch.full((3, 3), -1.0)                                    # positions 2..4 (re-prefill)
    c = torch.full((2, 3), 7.0)                                     # positions 5..6, one past the end
    out = {k: v.to_torch() for k, v in
           assemble_rows([(0, host_tensor(a)), (2, host_tensor(b)), (5, host_tensor(c))], 6, {"x": (0, 2), "y": (2, 3)}).items()}
    assert out["x"].shape == (6, 2) and out["y"].shape == (6, 1)
    assert torch.equal(out["x"][:2], a[:2, :2]) and (out["x"][2:5] == -1).all() and (out["x"][5] == 7).all()


def test_bf16_rows_keep_their_exact_bits_through_assembly():
    rows = torch.randn(5, 6).to(torch.bfloat16)
    out = assemble_rows([(0, host_tensor(rows))], 5, {"aux": (0, 4), "final": (4, 6)})
    assert out["aux"].dtype == "bfloat16" and out["aux"].to_torch().dtype == torch.bfloat16
    assert torch.equal(out["aux"].to_torch().view(torch.int16), rows[:, :4].view(torch.int16))
    assert torch.equal(out["final"].to_torch().view(torch.int16), rows[:, 4:].view(torch.int16))


def test_missing_rows_fail_the_capture():
    with pytest.raises(IncompleteCapture, match="positions 2-3"):
        assemble_rows([(0, host_tensor(torch.zeros(2, 3))), (4, host_tensor(torch.zeros(1, 3)))], 5, {"x": (0, 3)})


def test_ledger_counts_a_shared_batch_buffer_once():
    ledger = HostMemoryLedger(cap_bytes=1 << 30)
    batch = torch.zeros(10, 4)
    ledger.hold(batch[:3])
    ledger.hold(batch[3:])
    assert ledger.held_bytes == batch.untyped_storage().nbytes()
    ledger.release(batch[:3])
    assert ledger.held_bytes == batch.untyped_storage().nbytes()
    ledger.release(batch[3:])
    assert ledger.held_bytes == 0


def test_ledger_never_exceeds_the_cap_while_writes_are_pending():
    pending = threading.Event()
    pending.set()
    ledger = HostMemoryLedger(cap_bytes=500, draining=pending.is_set)
    first, second = torch.zeros(100), torch.zeros(100)  # 400 bytes each: both together exceed the cap

    def writer_finishes_first():
        time.sleep(0.2)
        ledger.release(first)
        pending.clear()

    ledger.hold(first)
    threading.Thread(target=writer_finishes_first).start()
    start = time.monotonic()
    ledger.hold(second)  # the scheduler waits here until the pending write frees memory
    assert time.monotonic() - start >= 0.15 and ledger.waits == 1
    assert ledger.peak_bytes == 400 <= ledger.cap_bytes


def test_ledger_goes_over_the_cap_rather_than_deadlock_when_nothing_is_pending():
    ledger = HostMemoryLedger(cap_bytes=100)  # draining() is False: no write will free anything
    big = torch.zeros(100)
    ledger.hold(big)  # one buffer larger than the cap
    ledger.hold(torch.zeros(10))
    assert ledger.held_bytes == 440 and ledger.waits == 0


def _job(tmp_path, chunks, n_rows, name="req-1"):
    from sglang_capture.assembler import RequestCapture
    from sglang_capture.writer import CaptureJob

    ledger = HostMemoryLedger(1 << 30)
    cap = RequestCapture(rid=name, name=name, ledger=ledger)
    for start, rows in chunks:
        cap.add(start, rows)
    meta = {"rid": name, "layers": [1], "layer_convention": "c", "hidden_size": 2, "model": "m",
            "sglang_version": "0.5.17", "schema": "sglang_capture/v1"}
    return CaptureJob(cap, n_rows, {"aux_hidden_states": (0, 2), "last_hidden_states": (2, 4)}, [1, 2], [3], meta), ledger


def test_writer_publishes_whole_files_and_records_the_outcome(tmp_path):
    import json
    import os

    from sglang_capture import load
    from sglang_capture.writer import CaptureWriter, index_path

    cfg = CaptureConfig(capture_dir=str(tmp_path), writer_threads=2)
    rows = torch.arange(8, dtype=torch.float32).view(2, 4)
    job, ledger = _job(tmp_path, [(0, rows)], 2)
    writer = CaptureWriter(cfg, ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "req-1")))
    assert outcome["status"] == "ok" and outcome["bytes"] == os.path.getsize(outcome["path"])
    data = load(outcome["path"])
    assert torch.equal(data["aux_hidden_states"], rows[:, :2]) and torch.equal(data["last_hidden_states"], rows[:, 2:])
    assert ledger.held_bytes == 0 and os.listdir(tmp_path / ".tmp") == []
    stats = json.load(open(tmp_path / ".index" / f"writer-{os.getpid()}.json"))
    assert stats["written"] == 1 and stats["queue"] == 0 and stats["peak_held_bytes"] == rows.numel() * 4
    assert stats["inline_bytes"] == rows.numel() * 4  # not in a host pool: the rows went down the pipe
    assert stats["cap_bytes"] == ledger.cap_bytes


@pytest.mark.parametrize("interval_ms", [1.0, 0.0])
def test_writer_shortens_the_gil_switch_interval_only_once_it_runs(tmp_path, interval_ms):
    import sys

    from sglang_capture.writer import CaptureWriter

    before = sys.getswitchinterval()
    try:
        cfg = CaptureConfig(capture_dir=str(tmp_path), writer_threads=1, switch_interval_ms=interval_ms)
        job, ledger = _job(tmp_path, [(0, torch.zeros(2, 4))], 2)
        writer = CaptureWriter(cfg, ledger)
        assert sys.getswitchinterval() == before  # an idle capture server keeps Python's interval
        writer.submit(job)
        writer.close()
        assert sys.getswitchinterval() == pytest.approx(interval_ms / 1000 if interval_ms else before)
    finally:
        sys.setswitchinterval(before)
    with pytest.raises(ConfigError, match="switch-interval"):
        CaptureConfig(capture_dir=str(tmp_path), switch_interval_ms=-1)


def test_writer_failure_leaves_no_file_and_an_error_outcome(tmp_path):
    import json
    import os

    from sglang_capture.writer import CaptureWriter, index_path

    cfg = CaptureConfig(capture_dir=str(tmp_path), writer_threads=1)
    job, ledger = _job(tmp_path, [(0, torch.zeros(1, 4))], 3, name="short")
    writer = CaptureWriter(cfg, ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "short")))
    assert outcome["status"] == "error" and "rows missing at positions 1-2" in outcome["error"]
    assert not os.path.exists(outcome["path"]) and os.listdir(tmp_path / ".tmp") == []
    assert ledger.held_bytes == 0 and writer.stats["failed"] == 1


def test_loss_mask_spans_round_trip_and_reject_bad_spans():
    from sglang_capture.loss_mask import BadLossMask, mask_from_spans, parse_spans, spans_from_mask

    mask = [0, 1, 1, 0, 0, 1, 0, 1]
    spans = spans_from_mask(mask)
    assert spans == [(1, 3), (5, 6), (7, 8)]
    assert mask_from_spans(parse_spans([list(s) for s in spans], 8), 8).tolist() == mask
    for bad in ([[3, 1]], [[0, 9]], [[2, 4], [3, 5]], [[1, 1]], "0-3", [[0, 1.5]], [[True, 2]]):
        with pytest.raises(BadLossMask):
            parse_spans(bad, 8)


def test_conversation_lines_are_parsed_or_rejected_with_a_reason():
    from sglang_capture.conversations import BadLine, Sample, parse_line

    s = parse_line('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}', 3)
    assert isinstance(s, Sample) and s.id == "line-00000003"
    assert s.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert parse_line('{"id": "x1", "text": "t"}', 1) == Sample("x1", 1, text="t")
    for text, reason in (("[1]", "not a JSON object"), ("{", "not valid JSON"), ('{"text": ""}', "needs"),
                         ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant turn"),
                         ('{"id": "/etc/passwd", "text": "t"}', "cannot name a file"),
                         ('{"id": "' + "a" * 100 + '", "text": "t"}', "limit is 96")):
        bad = parse_line(text, 7)
        assert isinstance(bad, BadLine) and reason in str(bad) and str(bad).startswith("line 7:")


def test_drafter_config_layer_ids_follow_sglang_setters():
    from sglang_capture.layers import LayerError, eagle3_config_layer_ids

    assert eagle3_config_layer_ids([3, 31, 59], "KimiK25ForConditionalGeneration") == [3, 31, 59]
    assert eagle3_config_layer_ids([3, 31, 59], "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert eagle3_config_layer_ids([3, 16, 30], "LlamaForCausalLM") == [2, 15, 29]
    with pytest.raises(LayerError):
        eagle3_config_layer_ids([1, 2, 3], "DeepseekV3ForCausalLM")


def test_rows_survive_the_finished_req_being_freed_before_the_writer_runs(tmp_path):
    """Under load the scheduler frees a finished Req long before a writer thread reaches its job
    (seen on the H200: 'no rows were captured'); the job must own the rows by then."""
    import gc
    import types

    from sglang_capture.sidecar import CAPTURE_ATTR, ModelInfo, Sidecar
    from sglang_capture.publish import prepare_capture_dir

    prepare_capture_dir(str(tmp_path))
    sidecar = Sidecar(CaptureConfig(capture_dir=str(tmp_path), writer_threads=1))
    sidecar._is_writer = True
    sidecar.model = ModelInfo("m", "LlamaForCausalLM", "LlamaForCausalLM", 2, 4, (1,), "float32")
    jobs = []
    sidecar.writer.submit = jobs.append  # hold the job back, as a busy writer queue does

    class FakeReq(types.SimpleNamespace):
        def set_finish_with_abort(self, msg):  # pragma: no cover - not reached
            raise AssertionError(msg)

    req = FakeReq(rid="r1", origin_input_ids=[5, 6, 7], output_ids=[8], finished_len=None, extra_key=None,
                  finished_reason=None, sampling_params=types.SimpleNamespace(custom_params={"capture": True}))
    sidecar.begin(req)
    capture = getattr(req, CAPTURE_ATTR)
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    capture.add(0, rows)
    sidecar.finish(req, capture)
    del req, capture
    gc.collect()
    del sidecar.writer.submit  # the writer gets to the job now
    outcome = sidecar.writer.write(jobs[0], timeout=60)
    assert outcome["status"] == "ok", outcome
    data = __import__("sglang_capture").load(outcome["path"])
    assert torch.equal(data["aux_hidden_states"], rows[:, :2]) and torch.equal(data["last_hidden_states"], rows[:, 2:])


def test_a_symlink_planted_at_the_file_name_is_never_written_through(tmp_path):
    import json
    import os

    from sglang_capture.writer import CaptureWriter, index_path

    capture_dir, outside = tmp_path / "caps", tmp_path / "outside.txt"
    capture_dir.mkdir()
    outside.write_text("precious")
    os.symlink(outside, capture_dir / "req-1.capture.msgpack")
    job, ledger = _job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = CaptureWriter(CaptureConfig(capture_dir=str(capture_dir), writer_threads=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(capture_dir), "req-1")))
    assert outcome["status"] == "error" and "already exists" in outcome["error"]
    assert outside.read_text() == "precious" and os.path.islink(capture_dir / "req-1.capture.msgpack")


def test_a_symlinked_private_folder_is_refused_at_start(tmp_path):
    import os

    from sglang_capture.config import ConfigError
    from sglang_capture.launch import check_capture_dir

    (tmp_path / "elsewhere").mkdir()
    os.symlink(tmp_path / "elsewhere", tmp_path / ".tmp")
    with pytest.raises(ConfigError, match="must be a real directory"):
        check_capture_dir(str(tmp_path))


def test_files_are_created_owner_and_group_only(tmp_path):
    import json
    import os
    import stat

    from sglang_capture.writer import CaptureWriter, index_path

    job, ledger = _job(tmp_path, [(0, torch.zeros(2, 4))], 2)
    writer = CaptureWriter(CaptureConfig(capture_dir=str(tmp_path), writer_threads=1), ledger)
    writer.submit(job)
    writer.close()
    outcome = json.load(open(index_path(str(tmp_path), "req-1")))
    assert stat.S_IMODE(os.stat(outcome["path"]).st_mode) & 0o007 == 0
    assert stat.S_IMODE(os.stat(tmp_path / ".tmp").st_mode) == 0o700


def test_the_pool_copies_rows_into_a_block_and_takes_it_back_only_when_nothing_uses_it():
    from sglang_capture.host_pool import ALIGN, HostPool

    pool = HostPool(1 << 20, pin=False)
    src = torch.randn(100, 64).to(torch.bfloat16)
    block = pool.take(src)
    assert torch.equal(block, src) and block.untyped_storage().data_ptr() != src.untyped_storage().data_ptr()
    rows = block[10:20]
    as_numpy = rows.view(torch.int16).numpy()  # how the writer reads bf16 rows
    del block, rows
    assert pool.free_segments() == [(0, (1 << 20) - ALIGN * 4)]  # 12,800 bytes round up to 4 pages, at the top
    assert pool.stats()["used_bytes"] == ALIGN * 4
    del as_numpy
    assert pool.free_segments() == [(0, 1 << 20)] and pool.stats()["used_bytes"] == 0


def test_pool_blocks_freed_out_of_order_coalesce_and_a_full_pool_says_so():
    from sglang_capture.host_pool import ALIGN, HostPool

    pool = HostPool(8 * ALIGN, pin=False, small_block=ALIGN)
    page = torch.zeros(ALIGN // 4)  # one page of float32: a small block, taken from the top
    a, b, c = pool.take(page), pool.take(page), pool.take(page)
    big = pool.take(torch.zeros(5 * ALIGN // 4))  # a large one, from the bottom
    assert big is not None and pool.take(page) is None and pool.stats()["fallbacks"] == 1
    del b
    assert pool.free_segments() == [(6 * ALIGN, 7 * ALIGN)]
    del a, c
    assert pool.free_segments() == [(5 * ALIGN, 8 * ALIGN)]
    assert pool.take(torch.zeros(3 * ALIGN // 4)) is not None  # the three freed pages join into one
    assert pool.take(torch.zeros(0)) is None  # nothing to copy: left to SGLang


def test_small_blocks_that_stay_long_do_not_cut_up_the_room_for_large_ones():
    from sglang_capture.host_pool import ALIGN, HostPool

    pool = HostPool(64 * ALIGN, pin=False, small_block=ALIGN)
    prefill, decode = torch.zeros(16 * ALIGN // 4), torch.zeros(ALIGN // 4)
    a, s1, b, s2 = pool.take(prefill), pool.take(decode), pool.take(prefill), pool.take(decode)
    del a, b  # the prefill blocks are written; the decode steps' blocks stay with their requests
    assert pool.take(torch.zeros(32 * ALIGN // 4)) is not None  # first fit alone leaves 16-page holes
    assert s1 is not None and s2 is not None


def test_pool_blocks_freed_on_other_threads_while_the_scheduler_takes_more():
    import threading
    import time

    from sglang_capture.host_pool import HostPool

    pool = HostPool(64 << 10, pin=False)
    src = torch.arange(1024, dtype=torch.float32)  # 4 KiB
    held, overwritten = [], []
    stop = threading.Event()

    def writer():
        while not stop.is_set() or held:
            if not held:
                time.sleep(0.0005)
                continue
            t = held.pop(0)
            overwritten.append(not torch.equal(t, src))  # a block still in use was handed out again
            del t

    thread = threading.Thread(target=writer)
    thread.start()
    taken, deadline = 0, time.monotonic() + 30
    while taken < 200:  # 16 blocks fit at once: only blocks the other thread gave back make 200
        assert time.monotonic() < deadline, f"only {taken} blocks in 30 s"
        block = pool.take(src)
        if block is None:
            time.sleep(0.001)  # full: let the writer thread run
            continue
        taken += 1
        held.append(block)
        del block
    stop.set()
    thread.join()
    assert len(overwritten) == 200 and not any(overwritten)
    assert pool.free_segments() == [(0, 64 << 10)]


def test_the_ledger_counts_each_pool_block_once_by_its_size():
    from sglang_capture.assembler import RequestCapture
    from sglang_capture.host_pool import HostPool

    ledger, pool = HostMemoryLedger(1 << 30), HostPool(1 << 20, pin=False)
    batch = pool.take(torch.zeros(64, 8))
    a, b = (RequestCapture(rid=r, name=r, ledger=ledger) for r in "ab")
    a.add(0, batch[:32])
    b.add(0, batch[32:])
    assert ledger.held_bytes == 64 * 8 * 4
    a.release()
    assert ledger.held_bytes == 64 * 8 * 4
    b.release()
    assert ledger.held_bytes == 0


def test_without_memory_for_the_pool_capture_goes_on_and_says_how_to_get_one(tmp_path, caplog):
    from sglang_capture.sidecar import Sidecar

    config = CaptureConfig(capture_dir=str(tmp_path), max_pending_mb=1 << 32)  # 4 PiB
    sidecar = Sidecar(config)
    with caplog.at_level("WARNING", logger="sglang_capture.sidecar"):
        sidecar._make_pool(config.max_pending_bytes, pin=False)
    assert sidecar.pool is None
    assert "Lower --capture-max-pending-mb" in caplog.text
    sidecar.writer.close()


def test_writer_processes_read_pool_rows_in_place_at_lower_priority_on_their_cpus_and_free_the_block_once_read(tmp_path):
    import os

    from sglang_capture import load
    from sglang_capture.host_pool import HostPool
    from sglang_capture.writer import CaptureWriter

    pool = HostPool(1 << 20, pin=False)
    rows = torch.randn(6, 4).to(torch.bfloat16)
    block = pool.take(rows)
    job, ledger = _job(tmp_path, [(0, block[:4]), (4, block[4:])], 6)  # two chunks of one batch block
    del block
    cpu = min(os.sched_getaffinity(0))
    writer = CaptureWriter(CaptureConfig(capture_dir=str(tmp_path), writer_threads=2, writer_nice=7, writer_cpus=[cpu]),
                           ledger, pool)
    try:
        outcome = writer.write(job, timeout=60)
        assert outcome["status"] == "ok", outcome
        data = load(outcome["path"])
        assert torch.equal(data["aux_hidden_states"].view(torch.int16), rows[:, :2].view(torch.int16))
        assert torch.equal(data["last_hidden_states"].view(torch.int16), rows[:, 2:].view(torch.int16))
        assert writer.stats["inline_bytes"] == 0  # only offsets crossed the pipe
        assert pool.free_segments() == [(0, 1 << 20)] and ledger.held_bytes == 0
        pids = writer.writer_pids()
        assert len(pids) == 2 and os.getpid() not in pids
        lowered = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 7)
        for pid in pids:  # the writer processes never load torch, yield the CPU to the server, keep to their CPUs
            assert "libtorch" not in open(f"/proc/{pid}/maps").read()
            deadline = time.monotonic() + 30  # the idle one lowers it when it reads its first message
            while os.getpriority(os.PRIO_PROCESS, pid) != lowered or os.sched_getaffinity(pid) != {cpu}:
                assert time.monotonic() < deadline, (f"writer process {pid} kept priority {os.getpriority(os.PRIO_PROCESS, pid)}"
                                                     f", CPUs {os.sched_getaffinity(pid)}")
                time.sleep(0.01)
    finally:
        writer.close()
    assert writer.writer_pids() == []


def _one_writer(tmp_path, ledger):
    """A started writer with one writer process, and that process's pid."""
    from sglang_capture.writer import CaptureWriter

    writer = CaptureWriter(CaptureConfig(capture_dir=str(tmp_path), writer_threads=1), ledger)
    writer.start()
    deadline = time.monotonic() + 30
    while not writer.writer_pids():
        assert time.monotonic() < deadline, "no writer process started"
        time.sleep(0.01)
    return writer, writer.writer_pids()[0]


def test_a_writer_process_that_dies_fails_only_its_job_and_is_replaced(tmp_path):
    import os
    import signal

    first, ledger = _job(tmp_path, [(0, torch.zeros(2, 4))], 2, name="lost")
    writer, pid = _one_writer(tmp_path, ledger)
    try:
        os.kill(pid, signal.SIGSTOP)  # the job waits in its pipe ...
        writer.submit(first)
        while writer.pending() and writer._busy == 0:
            time.sleep(0.01)
        os.kill(pid, signal.SIGKILL)  # ... and the process dies holding it
        assert first.done.wait(30)
        assert first.outcome["status"] == "error" and f"writer process {pid} exited" in first.outcome["error"]
        second, _ = _job(tmp_path, [(0, torch.ones(2, 4))], 2, name="kept")
        assert writer.write(second, timeout=60)["status"] == "ok"
        assert writer.stats["restarts"] == 1 and writer.writer_pids() != [pid]
        assert ledger.held_bytes == 0
    finally:
        writer.close()


def _fake_req(capture=False, json_hidden=False):
    import types

    from sglang_capture.sidecar import CAPTURE_ATTR

    r = types.SimpleNamespace(return_hidden_states=json_hidden or capture, extend_range=None)
    if capture:
        setattr(r, CAPTURE_ATTR, object())
    return r


def _fake_batch(mode, reqs, lens=None):
    import types

    modes = {"decode": (True, False, False), "extend": (False, True, False), "mixed": (False, True, True)}
    dec, ext, mix = modes[mode]
    fm = types.SimpleNamespace(is_decode=lambda: dec, is_extend=lambda: ext, is_mixed=lambda: mix)
    for r, n in zip(reqs, lens or []):
        r.extend_range = types.SimpleNamespace(length=n)
    return types.SimpleNamespace(reqs=reqs, forward_mode=fm, extend_lens=lens)


def test_only_capture_requests_rows_are_selected_from_a_shared_batch():
    from sglang_capture.hooks.transfer import capture_rows

    req, batch = _fake_req, _fake_batch
    # prefill: plain (5 rows), capture (3), capture (2), plain (4), capture (1)
    b = batch("extend", [req(), req(True), req(True), req(), req(True)], [5, 3, 2, 4, 1])
    assert capture_rows(b, 15) == ([(5, 10), (14, 15)], {5: 0, 8: 3, 14: 5})
    assert capture_rows(batch("decode", [req(True), req(), req(True)]), 3) == ([(0, 1), (2, 3)], {0: 0, 2: 1})
    assert capture_rows(b, 16) is None  # rows that do not add up: copy everything
    assert capture_rows(batch("extend", [req(True), req(True)], [2, 2]), 4) is None  # all captured
    assert capture_rows(batch("extend", [req(True), req(json_hidden=True)], [2, 2]), 4) is None  # SGLang's JSON too
    assert capture_rows(batch("mixed", [req(True), req()], [2, 1]), 3) is None
    assert capture_rows(None, 3) is None


def test_captured_rows_are_gathered_in_the_forward_beside_their_final_hidden_state(monkeypatch):
    from sglang_capture import sidecar as sidecar_module
    from sglang_capture.batch_rows import BatchRows
    from sglang_capture.hooks.transfer import gather_in_forward

    req, batch = _fake_req, _fake_batch
    state = types.SimpleNamespace(launching=None)
    monkeypatch.setattr(sidecar_module, "_SIDECAR", state)
    aux = torch.arange(15 * 6, dtype=torch.float32).view(15, 6)  # 3 layers x hidden 2
    final = -torch.arange(15 * 2, dtype=torch.float32).view(15, 2)
    state.launching = rows = BatchRows(batch("extend", [req(), req(True), req(True), req(), req(True)], [5, 3, 2, 4, 1]),
                                       captures=True)
    assert gather_in_forward(aux[:14], final) is None  # aux and final disagree: keep the whole batch
    out = gather_in_forward(aux, final)
    kept = [5, 6, 7, 8, 9, 14]
    assert torch.equal(out, torch.cat([aux[kept], final[kept]], dim=-1))
    assert (rows.row_map, rows.kept_rows, rows.batch_rows, rows.gathered_in_forward) == ({5: 0, 8: 3, 14: 5}, 6, 15, True)
    state.launching = None
    assert gather_in_forward(aux, final) is None  # no batch running (CUDA graph capture, warm-up)
    state.launching = BatchRows(batch("extend", [req(True), req(json_hidden=True)], [5, 10]), captures=True)
    assert gather_in_forward(aux, final) is None  # SGLang's JSON request needs every row


def test_the_row_seams_find_kept_rows_through_the_batch_state_whatever_tensor_object_arrives():
    """Under DP attention SGLang re-slices the result tensor (a new object): the map must not live on it."""
    from sglang_capture.batch_rows import BatchRows, ResultRows, RowsMismatch

    req, batch = _fake_req, _fake_batch
    b = batch("extend", [req(), req(True), req(True), req(), req(True)], [5, 3, 2, 4, 1])
    b.prefix_lens = [0, 7, 0, 0, 2]
    rows = BatchRows(b, captures=True)
    rows.keep(rows.selection(15), 15, in_forward=True)
    result = types.SimpleNamespace()
    rows.attach(result)
    kept = torch.arange(6 * 3).view(6, 3)[:6]  # a fresh object, as SGLang's un-padding slice makes
    processing = ResultRows.of(b, result)
    assert [processing.row(kept, off, n) for off, n in ((5, 3), (8, 2), (14, 1))] == [0, 3, 5]
    assert [processing.chunk_start(r) for r in (b.reqs[1], b.reqs[4])] == [7, 2]
    with pytest.raises(RowsMismatch):
        processing.row(kept[:5], 14, 1)  # fewer rows than were kept: never read another request's rows
    with pytest.raises(RowsMismatch):
        processing.row(kept, 0, 5)  # a request whose rows were not kept
    whole = ResultRows.of(b, types.SimpleNamespace())  # nothing kept: batch offsets, checked against the end
    assert whole.row(torch.zeros(15, 3), 14, 1) == 14
    with pytest.raises(RowsMismatch):
        whole.row(torch.zeros(14, 3), 14, 1)


def test_temp_files_of_a_killed_server_are_removed_at_start_and_live_ones_kept(tmp_path):
    import os
    import subprocess
    import sys

    from sglang_capture.publish import host_tag, prepare_capture_dir
    from sglang_capture.writer import CaptureWriter

    prepare_capture_dir(str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(gone.stdout)  # a process that has exited
    here = host_tag()
    orphans = [tmp_path / ".tmp" / f"req.7.{here}.{dead_pid}.{'a' * 32}.part",
               tmp_path / ".index" / f"x.json.{here}.{dead_pid}.{'b' * 32}.part"]
    live = [tmp_path / ".tmp" / f"other.{here}.{os.getpid()}.{'c' * 32}.part", tmp_path / ".tmp" / "notes.part",
            # another host sharing the directory: its pids mean nothing here, its files stay
            tmp_path / ".tmp" / f"req.8.h0badc0de.{dead_pid}.{'d' * 32}.part"]
    for path in orphans + live:
        path.write_bytes(b"half a file")
    writer = CaptureWriter(CaptureConfig(capture_dir=str(tmp_path), writer_threads=1), HostMemoryLedger(1 << 20))
    try:
        writer.start()
        assert not any(p.exists() for p in orphans) and all(p.exists() for p in live)
    finally:
        writer.close()


def test_a_writer_process_gone_before_it_took_the_job_is_replaced_and_the_job_written(tmp_path, monkeypatch):
    import os
    import signal

    from sglang_capture import writer as writer_module

    job, ledger = _job(tmp_path, [(0, torch.ones(2, 4))], 2, name="handed-on")
    writer, pid = _one_writer(tmp_path, ledger)
    deadline = time.monotonic() + 30
    try:
        # the process dies between the hand-off thread's liveness check and its send
        monkeypatch.setattr(writer_module._Child, "alive", lambda self: True)
        os.kill(pid, signal.SIGKILL)
        while open(f"/proc/{pid}/stat").read().split(") ")[1][0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        outcome = writer.write(job, timeout=60)
        assert outcome["status"] == "ok", outcome
        assert writer.stats["restarts"] == 1 and writer.writer_pids() != [pid] and ledger.held_bytes == 0
    finally:
        writer.close()


def test_aux_layers_are_switched_off_only_for_eager_prefill_batches_that_capture_nothing():
    import enum
    import types

    from sglang_capture.aux_capture import AUX_ATTR, AuxCapture

    Mode = enum.Enum("ForwardMode", "EXTEND MIXED DECODE IDLE")

    class Inner:  # a model keeping its captured layers in layers_to_capture (Llama, DeepSeek)
        layers_to_capture: list = []

    class InnerWithSetter(Inner):  # Qwen-MoE also flags each layer
        def set_eagle3_layers_to_capture(self, ids):
            self.layers_to_capture = ids

    def runner(inner=None, prefill_graphs=None, dp_attention=False):
        lm = types.SimpleNamespace(model=inner or Inner(), capture_aux_hidden_states=False)
        return types.SimpleNamespace(model=lm, prefill_cuda_graph_runner=prefill_graphs,
                                     server_args=types.SimpleNamespace(enable_dp_attention=dp_attention))

    def batch(mode, *capturing):
        reqs = [types.SimpleNamespace() for _ in capturing]
        for r, c in zip(reqs, capturing):
            if c:
                setattr(r, AUX_ATTR, True)
        return types.SimpleNamespace(forward_mode=Mode[mode], reqs=reqs)

    def during(aux, b):
        with aux.for_batch(b):
            return aux.lm.capture_aux_hidden_states, list(aux.inner.layers_to_capture)

    on, off = (True, [1, 3]), (False, [])
    aux = AuxCapture(runner(), [1, 3])
    aux.enable()
    assert (aux.lm.capture_aux_hidden_states, aux.inner.layers_to_capture) == on
    assert during(aux, batch("EXTEND", False, False)) == off
    assert during(aux, batch("MIXED", False)) == off
    assert during(aux, batch("EXTEND", False, True)) == on  # one capture request: the whole batch computes them
    assert during(aux, batch("DECODE", False)) == on  # decode CUDA graphs were captured with aux on
    assert during(aux, batch("IDLE")) == on
    with pytest.raises(RuntimeError):
        with aux.for_batch(batch("EXTEND", False)):
            raise RuntimeError("forward failed")
    assert (aux.lm.capture_aux_hidden_states, aux.inner.layers_to_capture) == on  # restored all the same
    assert aux.stats() == {"per_batch": True, "extend_batches_with_aux": 1, "extend_batches_without_aux": 3}

    for r, why in [(runner(prefill_graphs=object()), "prefill CUDA graphs are in use"),
                   (runner(inner=InnerWithSetter()), "flags each captured layer"),
                   (runner(dp_attention=True), "DP attention")]:
        aux = AuxCapture(r, [1, 3])
        aux.enable()
        assert why in aux.why_not_per_batch()
        assert during(aux, batch("EXTEND", False)) == on
        assert aux.stats()["per_batch"] is False


def test_an_abort_outcome_is_recorded_by_a_hand_off_thread_not_the_caller(tmp_path, monkeypatch):
    import json
    import threading

    import sglang_capture.writer as writer_module
    from sglang_capture.writer import CaptureWriter, index_path

    recorded_on = []
    real = writer_module.record_outcome
    monkeypatch.setattr(writer_module, "record_outcome",
                        lambda *a: (recorded_on.append(threading.current_thread().name), real(*a)))
    writer = CaptureWriter(CaptureConfig(capture_dir=str(tmp_path), writer_threads=1), HostMemoryLedger(1 << 20))
    writer.submit_outcome("gone", {"rid": "gone", "status": "aborted", "error": "client disconnected"})
    writer.close()
    assert json.load(open(index_path(str(tmp_path), "gone")))["status"] == "aborted"
    assert recorded_on == ["sglang-capture-handoff-0"]


def test_seam_clock_accounts_calls_and_time_per_seam_and_kind():
    from sglang_capture.seam_clock import SeamClock

    clock = SeamClock()
    assert clock.timed("run_batch", True, lambda: 7) == 7
    clock.timed("run_batch", False, lambda: time.sleep(0.01))
    with pytest.raises(ZeroDivisionError):
        clock.timed("run_batch", False, lambda: 1 / 0)  # a raising call is still accounted
    stats = clock.stats()
    assert set(stats) == {"run_batch/capture", "run_batch/plain"}
    assert stats["run_batch/capture"]["calls"] == 1 and stats["run_batch/plain"]["calls"] == 2
    assert stats["run_batch/plain"]["s"] >= 0.01 and stats["run_batch/plain"]["us_per_call"] >= 5000


def test_a_decode_batch_copies_no_hidden_states_when_its_only_capture_requests_end_after_one_token(monkeypatch):
    import types

    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    import sglang_capture.hooks.batch as batch_hook
    from sglang_capture.aux_capture import AUX_ATTR
    from sglang_capture.batch_rows import RESULT_ATTR
    from sglang_capture.seam_clock import SeamClock

    clock = SeamClock()
    monkeypatch.setattr(batch_hook, "get_sidecar", lambda: types.SimpleNamespace(aux=None, clock=clock, launching=None))

    def req(max_new, capture=True, json_hidden=False):
        r = types.SimpleNamespace(return_hidden_states=capture or json_hidden,
                                  sampling_params=types.SimpleNamespace(max_new_tokens=max_new))
        if capture:
            setattr(r, AUX_ATTR, True)
        return r

    def run(mode, reqs):
        fm = types.SimpleNamespace(name=mode.upper(), is_decode=lambda: mode == "decode")
        b = types.SimpleNamespace(reqs=reqs, forward_mode=fm, return_hidden_states=True,
                                  return_hidden_states_mode=CaptureHiddenMode.FULL)
        seen, result = [], types.SimpleNamespace()
        assert batch_hook.run_batch(lambda batch: seen.append(batch.return_hidden_states) or result, None, (b,), {}) is result
        assert getattr(result, RESULT_ATTR).batch is b  # the batch's capture state rides on its result
        return b.return_hidden_states, b.return_hidden_states_mode, seen

    # a finished-at-prefill capture request beside a plain one: nothing of the batch goes to the host
    assert run("decode", [req(1), req(16, capture=False)]) == (False, CaptureHiddenMode.NULL, [False])
    assert clock.stats()["run_batch/decode/plain"]["calls"] == 1
    # a capture request that decodes, an SGLang JSON request, or a prefill keep their rows
    assert run("decode", [req(1), req(2)])[0] is True
    assert run("decode", [req(1), req(4, capture=False, json_hidden=True)])[0] is True
    assert run("extend", [req(1)])[0] is True
    assert clock.stats()["run_batch/decode/capture"]["calls"] == 2
