"""The HTTP capture contract (core/protocol.py): one parser of a request's capture fields, and the
reference built by the scheduler, completed from the writer's outcome and found by clients."""
from __future__ import annotations

import pytest

from sglang_capture.core import protocol
from sglang_capture.core.protocol import BadCaptureRequest, CaptureRequest, parse_request


def _parse(custom, samples=1, prompt_len=10):
    return parse_request(custom, rid="rid-1", prompt_len=prompt_len, samples=samples, default_dtype="model")


def test_a_request_without_capture_is_none_and_a_capture_request_gets_its_defaults():
    assert _parse({}) is None and _parse({"capture": False}) is None
    assert _parse({"capture": True}) == CaptureRequest(name="rid-1", dtype="model", loss_spans=None)
    assert _parse({"capture": True, "capture_name": "s1", "capture_dtype": "fp8", "capture_loss_mask": [[2, 5]]}) \
        == CaptureRequest(name="s1", dtype="fp8", loss_spans=[(2, 5)])


def test_the_prefix_caching_pass_before_n_samples_gets_no_file_and_leaves_field_checks_to_its_samples():
    def parse(custom):
        return parse_request(custom, rid="r", prompt_len=10, samples=2, default_dtype="model", prefix_pass=True)

    assert parse({"capture": True, "capture_dtype": "int4"}) is None
    with pytest.raises(BadCaptureRequest, match="capture_name names one file"):
        parse({"capture": True, "capture_name": "a"})


@pytest.mark.parametrize("custom, samples, message", [
    ({"capture": "yes"}, 1, "custom_params.capture must be true or false, got 'yes'"),
    ({"capture": True, "capture_name": "a"}, 2, "custom_params.capture_name names one file but n > 1"),
    ({"capture": True, "capture_dtype": "int4"}, 1, "custom_params.capture_dtype must be one of"),
    ({"capture": True, "capture_name": "../x"}, 1, "capture_name may only use letters"),
    ({"capture": True, "capture_loss_mask": [[5, 50]]}, 1, "custom_params.capture_loss_mask span [5, 50)"),
    ({"capture": True, "capture_session": 7}, 1, "custom_params.capture_session must be a string of 1 to 256"),
])
def test_each_bad_field_is_refused_in_one_line_naming_it(custom, samples, message):
    with pytest.raises(BadCaptureRequest) as e:
        _parse(custom, samples=samples)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_what_the_server_reads_from_a_request_it_marked_and_what_a_client_said():
    marked = protocol.marked({"other": 1}, protocol.OPERATOR)
    assert marked == {"other": 1, "capture": True, "capture_by": "operator"}
    assert protocol.capture_mark(marked) == protocol.OPERATOR
    assert protocol.capture_mark(protocol.marked({}, protocol.CLIENT)) == protocol.CLIENT
    assert protocol.capture_mark({"capture": 1}) is None  # only true captures; 1 is refused by parse_request
    assert [protocol.says_capture(c) for c in ({}, {"capture": False}, {"capture": 0}, {"capture": True},
                                              {"capture": "x"})] \
        == [None, False, False, True, True]
    # the scheduler refuses 0 in one line rather than ignoring it
    assert [protocol.asks_capture(c) for c in ({}, {"capture": False}, {"capture": 0})] == [False, False, True]
    assert protocol.custom_params({"custom_params": {"capture": True}}) == {"capture": True}
    assert protocol.custom_params(None) == {} and protocol.custom_params({"custom_params": [1]}) == {}
    # a capture_session that names nothing is the client's mistake, never a reason to refuse what the operator chose
    assert _parse(protocol.marked({"capture_session": 7}, protocol.OPERATOR)) == \
        CaptureRequest(name="rid-1", dtype="model", loss_spans=None)


def test_the_reference_is_built_completed_and_found_by_the_same_keys():
    ref = protocol.reference(rid="r", path="/d/r.capture.msgpack", index="/d/.index/r.json", rows=3, layers=(1, 2),
                             dtype="bfloat16", shapes={"aux_hidden_states": (3, 8)}, fp8=True)
    assert protocol.is_reference(ref) and not protocol.is_reference([[0.1]]) and ref["storage_dtype"] == "float8_e4m3fn"
    done = protocol.with_outcome(ref, {"status": "ok", "bytes": 10, "checksum": "xxh3:ab", "other": 1})
    assert done == {**ref, "status": "ok", "bytes": 10, "checksum": "xxh3:ab"}
    assert protocol.reference_in({protocol.RESPONSE_KEY: done}) == done and protocol.reference_in({}) is None
    assert protocol.request_fields("s", [(1, 2)], "fp8") == {"capture": True, "capture_name": "s",
                                                             "capture_loss_mask": [[1, 2]], "capture_dtype": "fp8"}


def test_a_beam_search_is_refused_for_a_client_in_one_line_and_dropped_for_the_operator():
    """SGLang 0.5.19+'s beam search returns no hidden states for its decode steps: a file of it would
    miss rows. A client's capture of one is refused when it arrives; the operator's choice never
    turns a request away, so the operator's mark on one captures nothing."""
    def parse(custom, beams):
        return parse_request(custom, rid="r", prompt_len=10, samples=1, default_dtype="model", beams=beams)

    with pytest.raises(BadCaptureRequest) as e:
        parse({"capture": True}, 4)
    assert str(e.value).startswith("beam search (beam_width 4) cannot be captured") and "\n" not in str(e.value)
    assert parse(protocol.marked({}, protocol.OPERATOR), 4) is None
    assert parse({"capture": True}, 1) == CaptureRequest(name="r", dtype="model", loss_spans=None)
    assert [protocol.beam_width(p) for p in ({}, {"beam_width": None}, {"beam_width": 1}, {"beam_width": 3}, None,
                                             [{"beam_width": 3}], {"beam_width": 2.0}, {"beam_width": "x"},
                                             {"beam_width": 1.5}, {"beam_width": float("inf")})] \
        == [1, 1, 1, 3, 1, 1, 2, 1, 2, 2]  # as SGLang reads it ((beam_width or 1) > 1): 1.5 and inf search beams

    class Params:  # SGLang's SamplingParams: an attribute
        beam_width = 2
    assert protocol.beam_width(Params()) == 2
