"""Which step's row ``answer_tail`` keeps for an answer's last token, and where it keeps none
(server/answer_tail.py). The real-server side (the next turn's hit equals a plain turn's, the row
read exact) is in test_prefix_sharing.py, test_deployment.py, test_e2e_llama.py and test_speculative.py;
here every guard is met one at a time, on SGLang's own forward modes and speculative algorithms."""
from __future__ import annotations

import types

import pytest
import torch
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_capture.server.answer_tail import LaunchedStep, answer_tail
from sglang_capture.server.aux_capture import AUX_ATTR
from sglang_capture.server.batch_rows import BatchRows, ResultRows
from sglang_capture.server.ledger import HostMemoryLedger
from sglang_capture.server.request_capture import CAPTURE_ATTR, RequestCapture

PROMPT, ANSWER, WIDTH = 5, 3, 4


class _Event:
    def synchronize(self) -> None:
        pass


def _req(name, capture=True, max_new_tokens=16, committed=PROMPT + ANSWER, kv_record=False):
    req = types.SimpleNamespace(rid=name, origin_input_ids=list(range(PROMPT)), output_ids=[7] * ANSWER,
                                return_hidden_states=capture, sampling_params=types.SimpleNamespace(
                                    max_new_tokens=max_new_tokens))
    if kv_record:  # SGLang 0.5.19 on: the count is on the request's KV record
        req.kv = types.SimpleNamespace(kv_committed_len=committed)
    else:
        req.kv_committed_len = committed
    if capture:
        setattr(req, AUX_ATTR, True)
        setattr(req, CAPTURE_ATTR, RequestCapture(rid=name, name=name, ledger=HostMemoryLedger(1 << 30)))
    return req


def _step(reqs, mode=ForwardMode.DECODE, spec=SpeculativeAlgorithm.NONE, device="cpu", done=True):
    """A launched decode step of ``reqs`` whose copy to the host holds row i = float(i) for each
    capture request (only those rows, as the copy keeps them when some requests capture nothing)."""
    batch = types.SimpleNamespace(reqs=reqs, forward_mode=mode, spec_algorithm=spec)
    rows = BatchRows(batch, captures=True)
    selected = rows.selection(len(reqs))
    if selected is not None:
        rows.keep(selected, len(reqs), in_forward=False)
    kept = [i for i, r in enumerate(reqs) if getattr(r, CAPTURE_ATTR, None) is not None]
    hidden = torch.tensor([[float(i)] * WIDTH for i in kept]).to(device)
    result = types.SimpleNamespace(copy_done=_Event() if done else None,
                                   logits_output=types.SimpleNamespace(hidden_states=hidden))
    return LaunchedStep(rows, result)


def _processing():
    """The step whose result is being processed (not the launched one)."""
    return ResultRows(types.SimpleNamespace(reqs=[]), None)


def _tail(launched, req, processing=None, n_out=ANSWER):
    return answer_tail(launched, processing or _processing(), req, getattr(req, CAPTURE_ATTR), PROMPT, n_out)


@pytest.mark.parametrize("kv_record", [False, True])
def test_the_row_of_the_step_launched_after_the_answer_is_kept_at_the_answers_last_position(kv_record):
    reqs = [_req("a"), _req("plain", capture=False), _req("b", kv_record=kv_record)]
    launched = _step(reqs)
    tail = _tail(launched, reqs[2])
    assert tail.start == PROMPT + ANSWER - 1  # one past its file's rows
    assert torch.equal(tail.rows, torch.full((1, WIDTH), 2.0))  # its own row, past the plain request's
    assert tail.ready is launched.result.copy_done
    assert torch.equal(_tail(launched, reqs[0]).rows, torch.zeros(1, WIDTH))


@pytest.mark.parametrize("why", ["its own result", "a prefill", "a mixed batch", "a verify pass", "rows on the device",
                                 "no copy issued", "not in the batch", "the token not counted", "an answer cut short",
                                 "one-token request", "no answer", "fp8 rows not packed"])
def test_no_row_is_kept_where_the_launched_step_did_not_compute_it_for_this_capture(why):
    req = _req("a", max_new_tokens=1 if why == "one-token request" else 16,
               committed=PROMPT + ANSWER - 1 if why == "the token not counted" else PROMPT + ANSWER)
    step = {"a prefill": dict(mode=ForwardMode.EXTEND), "a mixed batch": dict(mode=ForwardMode.MIXED),
            "a verify pass": dict(spec=SpeculativeAlgorithm.EAGLE3), "rows on the device": dict(device="meta"),
            "no copy issued": dict(done=False)}.get(why, {})
    launched = _step([_req("other")] if why == "not in the batch" else [req], **step)
    if why == "fp8 rows not packed":
        getattr(req, CAPTURE_ATTR).fp8_block = WIDTH
    processing = ResultRows(launched.rows.batch, launched.rows) if why == "its own result" else None
    if why == "an answer cut short":
        req.output_ids.append(9)  # a stop found inside the last step's tokens: finished_len below them
    n_out = 0 if why == "no answer" else ANSWER
    assert _tail(launched, req, processing, n_out) is None
    assert answer_tail(None, _processing(), req, getattr(req, CAPTURE_ATTR), PROMPT, ANSWER) is None
