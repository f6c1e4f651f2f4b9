"""A scheduler process's capture state (server/scheduler_capture.py)."""
from __future__ import annotations

import types

import torch

from sglang_capture.core.config import CaptureConfig
from tests.jobs import write_and_wait


def test_rows_survive_the_finished_req_being_freed_before_the_writer_runs(tmp_path):
    """Under load the scheduler frees a finished Req long before a writer thread reaches its job
    (seen on the H200: 'no rows were captured'); the job must own the rows by then."""
    import gc

    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, ModelInfo, SchedulerCapture

    prepare_capture_dir(str(tmp_path))
    state = SchedulerCapture(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    state._is_writer = True
    state.model = ModelInfo("m", "LlamaForCausalLM", "LlamaForCausalLM", 2, 4, (1,), "float32")
    jobs = []
    state.writer.submit = jobs.append  # hold the job back, as a busy writer queue does

    class FakeReq(types.SimpleNamespace):
        def set_finish_with_abort(self, msg):  # pragma: no cover - not reached
            raise AssertionError(msg)

    req = FakeReq(rid="r1", origin_input_ids=[5, 6, 7], output_ids=[8], finished_len=None, extra_key=None,
                  finished_reason=None, sampling_params=types.SimpleNamespace(custom_params={"capture": True}))
    state.begin(req)
    capture = getattr(req, CAPTURE_ATTR)
    rows = torch.arange(12, dtype=torch.float32).view(3, 4)
    capture.add(0, rows)
    state.finish(req, capture)
    del req, capture
    gc.collect()
    del state.writer.submit  # the writer gets to the job now
    outcome = write_and_wait(state.writer, jobs[0])
    assert outcome["status"] == "ok", outcome
    data = __import__("sglang_capture").load(outcome["path"])
    assert torch.equal(data["aux_hidden_states"], rows[:, :2]) and torch.equal(data["last_hidden_states"], rows[:, 2:])


def test_without_memory_for_the_pool_capture_goes_on_and_says_how_to_get_one(tmp_path, caplog):
    from sglang_capture.server.scheduler_capture import SchedulerCapture

    config = CaptureConfig(capture_dir=str(tmp_path), max_pending_mb=1 << 32)  # 4 PiB
    state = SchedulerCapture(config)
    with caplog.at_level("WARNING", logger="sglang_capture.server.scheduler_capture"):
        state._make_pool(config.max_pending_bytes, pin=False)
    assert state.pool is None
    assert "Lower --capture-max-pending-mb" in caplog.text
    state.writer.close()


def test_stop_ends_the_gc_watch_and_the_row_copier_and_later_rows_are_copied_on_the_scheduler_thread(tmp_path):
    """``uninstrument`` calls ``stop``: nothing of the capture may keep running in a process
    that goes on serving without it (a callback in ``gc.callbacks``, the copy thread)."""
    import gc

    from sglang_capture.server.batch_rows import ResultRows
    from sglang_capture.server.request_capture import RequestCapture
    from sglang_capture.server.scheduler_capture import SchedulerCapture

    state = SchedulerCapture(CaptureConfig(capture_dir=str(tmp_path)))
    state._make_pool(1 << 20, pin=False)
    assert state.copier is not None and state.copier._thread.is_alive()
    state.watch_gc()
    assert state.gc_pauses in gc.callbacks and not state.gc_watch_pending
    state.stop()
    state.stop()  # idempotent
    assert state.gc_pauses not in gc.callbacks and not state.copier._thread.is_alive()
    capture = RequestCapture(rid="r", name="r", ledger=state.ledger, pool=state.pool)
    step = torch.randn(2, 8)
    state.decode_rows.note(capture, 0, step, 1, 1, ResultRows(None, None))
    state.decode_rows.flush()  # the copier is closed: copied here, at once
    capture.seal()
    assert not capture.chunks[0].ready.seqs and torch.equal(capture.chunks[0].rows, step[1:2])
    state.writer.close()


def test_marking_a_capture_request_fires_no_audit_event(tmp_path):
    """Every audit event runs every audit hook in the process: on Python 3.12+ that includes filelock's
    fork-safety hook (``_audit_fork_safety``), seen under ``Req.__init__`` in py-spy of the H200's
    scheduler thread. Those events are SGLang's own (its ``Req.__init__`` makes three arrays: three
    ``array.__new__`` events, capture or not); marking a capture request adds none."""
    import sys

    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.server.scheduler_capture import ModelInfo, SchedulerCapture

    prepare_capture_dir(str(tmp_path))
    state = SchedulerCapture(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    state._is_writer = True
    state.model = ModelInfo("m", "LlamaForCausalLM", "LlamaForCausalLM", 2, 4, (1,), "float32")
    state.writer.submit = lambda job: None
    events = []
    listening = [False]
    sys.addaudithook(lambda event, args: events.append(event) if listening[0] else None)

    class Req(types.SimpleNamespace):  # weakly referable, as SGLang's Req
        pass

    def req(i):
        return Req(rid=f"r{i}", origin_input_ids=[5, 6, 7], output_ids=[], finished_len=None,
                                     extra_key=None, finished_reason=None,
                                     sampling_params=types.SimpleNamespace(custom_params={"capture": True}))

    try:
        state.begin(req(0))  # the first one imports what marking needs
        listening[0] = True
        for i in range(1, 4):
            state.begin(req(i))
        listening[0] = False
    finally:
        listening[0] = False
        state.stop()
    assert events == []


def test_an_answered_capture_that_fails_to_seal_fails_alone_with_its_outcome_recorded(tmp_path):
    """An operator's capture is sealed after its answer is sent (hooks/finish.py): nothing can carry
    an error to its client then, so a failure sealing it must neither stop the scheduler nor pass
    silently: its rows are freed and its outcome says why."""
    from sglang_capture.core.capture_dir import prepare_capture_dir
    from sglang_capture.server.scheduler_capture import CAPTURE_ATTR, ModelInfo, SchedulerCapture

    prepare_capture_dir(str(tmp_path))
    state = SchedulerCapture(CaptureConfig(capture_dir=str(tmp_path), writers=1))
    state._is_writer = True
    state.model = ModelInfo("m", "LlamaForCausalLM", "LlamaForCausalLM", 2, 4, (1,), "float32")
    outcomes = []

    def broken(job):
        raise OSError("the writer link is gone")

    state.writer.submit, state.writer.submit_outcome = broken, lambda rid, outcome: outcomes.append((rid, outcome))

    class Req(types.SimpleNamespace):  # weakly referable, as SGLang's Req
        pass

    req = Req(rid="r1", origin_input_ids=[5, 6, 7], output_ids=[8], finished_len=None, extra_key=None,
              finished_reason=None, sampling_params=types.SimpleNamespace(custom_params={"capture": True, "capture_by": "operator"}))
    try:
        state.begin(req)
        capture = getattr(req, CAPTURE_ATTR)
        capture.add(0, torch.arange(12, dtype=torch.float32).view(3, 4))
        assert state.ledger.held_bytes > 0
        state.finish_answered(req, capture)  # does not raise
        assert state.ledger.held_bytes == 0  # its rows are free
        assert [rid for rid, _ in outcomes] == ["r1"]
        outcome = outcomes[0][1]
        assert outcome["status"] == "error" and outcome["error"] == "capture could not be sealed: OSError: the writer link is gone"
    finally:
        state.stop()
