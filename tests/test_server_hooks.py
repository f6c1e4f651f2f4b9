"""The hooks, called the way SGLang calls them (server/hooks/)."""
from __future__ import annotations

import types

import pytest
import torch


def _fake_req(capture=False, json_hidden=False):
    import types

    from sglang_capture.server.scheduler_capture import CAPTURE_ATTR

    r = types.SimpleNamespace(return_hidden_states=json_hidden or capture, extend_range=None)
    if capture:
        setattr(r, CAPTURE_ATTR, object())
    return r


def _fake_batch(mode, reqs, lens=None):
    import types

    modes = {"decode": (True, False, False), "extend": (False, True, False), "mixed": (False, True, True)}
    dec, ext, mix = modes[mode]
    fm = types.SimpleNamespace(is_decode=lambda: dec, is_extend=lambda: ext, is_mixed=lambda: mix)
    for r, n in zip(reqs, lens or [], strict=False):
        r.extend_range = types.SimpleNamespace(length=n)
    return types.SimpleNamespace(reqs=reqs, forward_mode=fm, extend_lens=lens)


def test_only_capture_requests_rows_are_selected_from_a_shared_batch():
    from sglang_capture.server.batch_rows import capture_rows

    req, batch = _fake_req, _fake_batch
    # prefill: plain (5 rows), capture (3), capture (2), plain (4), capture (1)
    b = batch("extend", [req(), req(True), req(True), req(), req(True)], [5, 3, 2, 4, 1])
    assert capture_rows(b, 15) == ([(5, 10), (14, 15)], {5: 0, 8: 3, 14: 5})
    assert capture_rows(batch("decode", [req(True), req(), req(True)]), 3) == ([(0, 1), (2, 3)], {0: 0, 2: 1})
    assert capture_rows(b, 16) is None  # rows that do not add up: copy everything
    assert capture_rows(batch("extend", [req(True), req(True)], [2, 2]), 4) is None  # all captured
    assert capture_rows(batch("decode", [req(True), req(True)]), 2) is None
    assert capture_rows(batch("extend", [req(True), req(json_hidden=True)], [2, 2]), 4) is None  # SGLang's JSON too
    assert capture_rows(batch("mixed", [req(True), req()], [2, 1]), 3) is None
    assert capture_rows(None, 3) is None


def test_a_verify_pass_keeps_each_capture_requests_block_of_draft_rows():
    """EAGLE-3: a verify pass has num_draft_tokens rows per request; the worker's draft extend has
    changed the batch's mode by the time the copy selects rows, so the mode at launch decides."""
    from sglang_capture.server.batch_rows import BatchRows

    req, batch = _fake_req, _fake_batch
    b = batch("decode", [req(True), req(), req(True)])
    b.spec_algorithm = types.SimpleNamespace(is_none=lambda: False)
    rows = BatchRows(b, captures=True)
    b.forward_mode = types.SimpleNamespace(is_decode=lambda: False, is_extend=lambda: False, is_mixed=lambda: False)
    assert rows.selection(12) == ([(0, 4), (8, 12)], {0: 0, 8: 4})  # 4 draft tokens per request
    assert BatchRows(batch("decode", [req(True), req(), req(True)]), captures=True).selection(12) is None  # no spec


def test_captured_rows_are_gathered_in_the_forward_beside_their_final_hidden_state():
    from sglang_capture.server.batch_rows import BatchRows, gather_in_forward

    req, batch = _fake_req, _fake_batch
    state = types.SimpleNamespace(launching=None)  # the scheduler's state, as the instrumentor binds it
    aux = torch.arange(15 * 6, dtype=torch.float32).view(15, 6)  # 3 layers x hidden 2
    final = -torch.arange(15 * 2, dtype=torch.float32).view(15, 2)
    state.launching = rows = BatchRows(batch("extend", [req(), req(True), req(True), req(), req(True)], [5, 3, 2, 4, 1]),
                                       captures=True)
    assert gather_in_forward(state.launching, aux[:14], final) is None  # aux and final disagree: keep the whole batch
    out = gather_in_forward(state.launching, aux, final)
    kept = [5, 6, 7, 8, 9, 14]
    assert torch.equal(out, torch.cat([aux[kept], final[kept]], dim=-1))
    assert (rows.row_map, rows.kept_rows, rows.batch_rows, rows.gathered_in_forward) == ({5: 0, 8: 3, 14: 5}, 6, 15, True)
    pre = final * 10  # --capture-final both: the pre-norm state after the post-norm one, gathered without a whole-batch concat
    assert torch.equal(gather_in_forward(rows, aux, final, pre), torch.cat([aux[kept], final[kept], pre[kept]], dim=-1))
    state.launching = None
    assert gather_in_forward(state.launching, aux, final) is None  # no batch running (CUDA graph capture, warm-up)
    state.launching = BatchRows(batch("extend", [req(True), req(json_hidden=True)], [5, 10]), captures=True)
    assert gather_in_forward(state.launching, aux, final) is None  # SGLang's JSON request needs every row


def test_the_row_seams_find_kept_rows_through_the_batch_state_whatever_tensor_object_arrives():
    """Under DP attention SGLang re-slices the result tensor (a new object): the map must not live on it."""
    from sglang_capture.server.batch_rows import BatchRows, ResultRows, RowsMismatch

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


def test_a_decode_batch_copies_no_hidden_states_when_its_only_capture_requests_end_after_one_token():
    import types

    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    import sglang_capture.server.hooks.batch as batch_hook
    from sglang_capture.server.aux_capture import AUX_ATTR
    from sglang_capture.server.batch_rows import RESULT_ATTR
    from sglang_capture.server.seam_clock import SeamClock

    state = types.SimpleNamespace(aux=None, clock=SeamClock(), launching=None)

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
        assert batch_hook.run_batch(state, lambda batch: seen.append(batch.return_hidden_states) or result, None, (b,), {}) is result
        assert getattr(result, RESULT_ATTR).batch is b  # the batch's capture state rides on its result
        return b.return_hidden_states, b.return_hidden_states_mode, seen

    # a finished-at-prefill capture request beside a plain one: nothing of the batch goes to the host
    assert run("decode", [req(1), req(16, capture=False)]) == (False, CaptureHiddenMode.NULL, [False])
    assert state.clock.stats()["run_batch/decode/plain"]["calls"] == 1
    # a capture request that decodes, an SGLang JSON request, or a prefill keep their rows
    assert run("decode", [req(1), req(2)])[0] is True
    assert run("decode", [req(1), req(4, capture=False, json_hidden=True)])[0] is True
    assert run("extend", [req(1)])[0] is True
    assert state.clock.stats()["run_batch/decode/capture"]["calls"] == 2


def test_fp8_rows_are_packed_before_the_copy_whole_when_every_reader_is_an_fp8_capture_else_beside_it():
    """An SGLang JSON request or a capture in the model's dtype needs the rows as the model made
    them: then the copy hook packs a second copy for the FP8 captures (never the row seams on the
    host); rows that still arrive unpacked (the pool was full) are packed by the request, and counted."""
    from sglang_capture.core.fp8 import pack
    from sglang_capture.server.batch_rows import fp8_readers as _fp8_readers
    from sglang_capture.server.copy_counts import CopyCounts
    from sglang_capture.server.ledger import HostMemoryLedger
    from sglang_capture.server.request_capture import RequestCapture
    from sglang_capture.server.scheduler_capture import CAPTURE_ATTR

    ledger = HostMemoryLedger(1 << 20)
    counts = CopyCounts()

    def req(reads: bool, fp8=None):
        r = types.SimpleNamespace(return_hidden_states=reads)
        if fp8 is not None:
            setattr(r, CAPTURE_ATTR, RequestCapture(rid="r", name="r", ledger=ledger, fp8_block=4 if fp8 else None,
                                                    counts=counts))
        return r

    def batch(*reqs):
        return types.SimpleNamespace(reqs=list(reqs))

    assert _fp8_readers(batch(req(True, fp8=True), req(False))) == (True, True)  # plain requests read nothing
    assert _fp8_readers(batch(req(True, fp8=True), req(True))) == (True, False)  # an SGLang JSON request
    assert _fp8_readers(batch(req(True, fp8=True), req(True, fp8=False))) == (True, False)  # model-dtype capture
    assert _fp8_readers(batch(req(True, fp8=False))) == (False, False)
    assert _fp8_readers(batch(req(False))) == (False, False) and _fp8_readers(None) == (False, False)
    capture = getattr(req(True, fp8=True), CAPTURE_ATTR)
    rows = torch.randn(3, 8).to(torch.bfloat16)
    capture.add(5, rows)  # arrived unpacked: packed here, and counted
    capture.add(8, pack(rows, 4))  # arrived packed: kept as it is
    assert [c.rows.dtype for c in capture.chunks] == [torch.uint8, torch.uint8]
    assert torch.equal(capture.chunks[0].rows, capture.chunks[1].rows) and capture.chunks[0].start == 5
    assert counts.fp8_packed_per_request_rows == 3
    capture.release()


def test_the_operators_fraction_never_selects_a_beam_search():
    """A beam search (SGLang 0.5.19+) cannot be captured whole; --capture-fraction 1 leaves it alone
    (the request runs as plain SGLang's), and selects the same request without beams."""
    from types import SimpleNamespace

    from sglang_capture.core import protocol
    from sglang_capture.core.config import CaptureConfig
    from sglang_capture.server.hooks.tokenize import selects

    config = CaptureConfig(capture_dir="/nonexistent", fraction=1.0)

    def request(**params):
        return SimpleNamespace(rid="r1", return_hidden_states=False, sampling_params={"max_new_tokens": 4, **params})

    assert selects(config, request()) == protocol.OPERATOR
    assert selects(config, request(beam_width=1)) == protocol.OPERATOR
    assert selects(config, request(beam_width=4)) is None


def test_an_operators_capture_is_sealed_after_its_answer_is_sent_and_a_clients_before_it():
    """A client's capture is sealed before SGLang streams the request's last output (its reference
    rides in it); an operator's gets no reference, so its answer goes first and it is sealed right
    after, in the same call (before the scheduler reads the next turn), even when streaming fails; a
    failure sealing it then fails it alone (``finish_answered``: test_server_scheduler_capture.py)."""
    from types import SimpleNamespace

    from sglang_capture.core import protocol
    from sglang_capture.server.hooks.finish import seal_finished
    from sglang_capture.server.scheduler_capture import CAPTURE_ATTR
    from sglang_capture.server.seam_clock import SeamClock

    events = []

    def req(name, by):
        custom = {protocol.CAPTURE: True, **({protocol.CAPTURE_BY: by} if by else {})}
        r = SimpleNamespace(name=name, sampling_params=SimpleNamespace(custom_params=custom), hidden_states=[],
                            finished=lambda: True, finished_output=False)
        setattr(r, CAPTURE_ATTR, object())
        return r

    def finish(r, capture):
        events.append(f"seal {r.name}")
        return {"ref": r.name}

    state = SimpleNamespace(decode_rows=None, clock=SeamClock(), finish=finish,
                            finish_answered=lambda r, capture: events.append(f"seal {r.name} answered"))
    client, operator = req("client", None), req("operator", protocol.OPERATOR)

    def stream(reqs, return_logprob, skip_req=None):
        events.append("stream " + ",".join(str(r.hidden_states) for r in reqs))

    seal_finished(state, stream, None, ([client, operator], False), {})
    assert events == ["seal client", "stream [{'ref': 'client'}],[]", "seal operator answered"]
    assert not hasattr(operator, CAPTURE_ATTR) and not hasattr(client, CAPTURE_ATTR)

    def broken(reqs, return_logprob, skip_req=None):
        raise RuntimeError("detokenizer gone")

    events.clear()
    again = req("again", protocol.OPERATOR)
    with pytest.raises(RuntimeError):
        seal_finished(state, broken, None, ([again], False), {})
    assert events == ["seal again answered"]  # its rows still go to a writer


def test_the_writer_rank_pumps_its_link_before_pulling_requests_and_its_block_events_go_first():
    """Issue 51: the link's answers (blocks a writer stored among them) are read on the scheduler
    thread before it pulls new requests, so a chat's next turn, let in by an outcome recorded after
    its blocks were written, comes after their events; a rank that does not write pumps nothing."""
    from types import SimpleNamespace

    from sglang_capture.server.hooks.prefix import post_block_events

    order = []
    events = []

    def pump():
        order.append("pump")
        events.append("blocks of turn 1")  # what the answers read make: the index's events

    def take_events():
        out = list(events)
        events.clear()
        return out

    def pull():
        order.append("pull")
        return ["turn 2"]

    writer_rank = SimpleNamespace(is_writer=True, writer=SimpleNamespace(pump=pump),
                                  shared=SimpleNamespace(take_events=take_events))
    assert post_block_events(writer_rank, pull, None, (), {}) == ["blocks of turn 1", "turn 2"]
    assert order == ["pump", "pull"]
    order.clear()
    other_rank = SimpleNamespace(is_writer=False, writer=SimpleNamespace(pump=pump), shared=None)
    assert post_block_events(other_rank, pull, None, (), {}) == ["turn 2"] and order == ["pull"]
    order.clear()
    sharing_off = SimpleNamespace(is_writer=True, writer=SimpleNamespace(pump=pump), shared=None)
    assert post_block_events(sharing_off, pull, None, (), {}) == ["turn 2"] and order == ["pump", "pull"]
