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

from sglang_capture.server.answer_tail import KEPT, WHY_NOT, LaunchedStep, answer_tail
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


def _packed_step(reqs):
    """A decode step whose FP8 readers share it with a model-dtype one: the copy packed beside the rows."""
    launched = _step(reqs)
    launched.rows.packed = torch.tensor([[i] * WIDTH for i in range(len(reqs))], dtype=torch.uint8)
    return launched


@pytest.mark.parametrize("kv_record", [False, True])
def test_the_row_of_the_step_launched_after_the_answer_is_kept_at_the_answers_last_position(kv_record):
    reqs = [_req("a"), _req("plain", capture=False), _req("b", kv_record=kv_record)]
    launched = _step(reqs)
    tail, why = _tail(launched, reqs[2])
    assert why == KEPT and tail.start == PROMPT + ANSWER - 1  # one past its file's rows
    assert torch.equal(tail.rows, torch.full((1, WIDTH), 2.0))  # its own row, past the plain request's
    assert tail.ready is launched.result.copy_done
    assert torch.equal(_tail(launched, reqs[0])[0].rows, torch.zeros(1, WIDTH))


def test_an_fp8_capture_keeps_the_row_its_steps_copy_packed():
    reqs = [_req("fp8"), _req("model")]
    getattr(reqs[0], CAPTURE_ATTR).fp8_block = WIDTH
    tail, why = _tail(_packed_step(reqs), reqs[0])
    assert why == KEPT and tail.rows.dtype == torch.uint8 and torch.equal(tail.rows, torch.zeros(1, WIDTH, dtype=torch.uint8))


CASES = {  # what the launched step or the request is like, and the reason answer_tail gives
    "its own result": "no_later_step", "no step launched": "no_later_step", "a prefill": "not_a_decode_step",
    "a mixed batch": "not_a_decode_step", "a step copying no rows": "not_a_decode_step",
    "a verify pass": "speculative", "the token not counted": "token_not_fed", "an answer cut short": "token_not_fed",
    "a one-token request": "token_not_fed", "no answer": "token_not_fed", "not in the batch": "not_in_step",
    "rows on the device": "rows_not_on_host", "no copy issued": "rows_not_on_host",
    "rows not the step's kept ones": "rows_mismatch", "fp8 rows not packed": "fp8_not_packed"}


@pytest.mark.parametrize("case", sorted(CASES))
def test_no_row_is_kept_where_the_launched_step_did_not_compute_it_for_this_capture(case):
    answer = 0 if case == "no answer" else ANSWER
    req = _req("a", max_new_tokens=1 if case == "a one-token request" else 16,
               committed=PROMPT + answer - (1 if case == "the token not counted" else 0))
    if case == "no answer":
        req.output_ids = []
    step = {"a prefill": dict(mode=ForwardMode.EXTEND), "a mixed batch": dict(mode=ForwardMode.MIXED),
            "a verify pass": dict(spec=SpeculativeAlgorithm.EAGLE3), "rows on the device": dict(device="meta"),
            "no copy issued": dict(done=False)}.get(case, {})
    others = {"not in the batch": [_req("other")], "rows not the step's kept ones": [req, _req("plain", capture=False)]}
    launched = _step(others.get(case, [req]), **step)
    if case == "rows not the step's kept ones":  # the whole batch's rows, where only the capture's were kept
        launched.result.logits_output.hidden_states = torch.zeros(2, WIDTH)
    if case == "a step copying no rows":
        launched.rows.captures = False
    if case == "no step launched":
        launched = None
    if case == "fp8 rows not packed":
        getattr(req, CAPTURE_ATTR).fp8_block = WIDTH
    processing = ResultRows(launched.rows.batch, launched.rows) if case == "its own result" else None
    if case == "an answer cut short":
        req.output_ids.append(9)  # a stop found inside the last step's tokens: finished_len below them
    tail, why = _tail(launched, req, processing, answer)
    assert tail is None and why == CASES[case]
    assert set(CASES.values()) | {KEPT} == {KEPT, *WHY_NOT}  # every reason the stats count is met here
