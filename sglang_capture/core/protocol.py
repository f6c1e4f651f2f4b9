"""The HTTP capture contract, once: what a request says, what its response carries, ``/capture_info``.

A client asks for capture in SGLang's own ``sampling_params.custom_params`` (the one field SGLang
passes unchanged from the HTTP request to the scheduler's ``Req``), and gets back a reference to
the file, never the rows. Both ends of that contract live here, so that the hooks in the HTTP
process, the scheduler and the tools (``extract``, ``doctor``) read and write the same keys with
the same rules and the same one-line errors:

- the request keys (``capture``, ``capture_name``, ``capture_dtype``, ``capture_loss_mask``, and
  the server's own mark ``capture_by``);
- ``parse_request``: the one parser of a request's capture fields;
- the reference: built by the scheduler (``reference``), completed from the writer's outcome
  (``with_outcome``), found in a response (``reference_in``);
- ``ROUTE`` and the body of ``GET /capture_info``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.fp8 import CAPTURE_DTYPES, FP8_DTYPE
from sglang_capture.core.loss_mask import BadLossMask, parse_spans
from sglang_capture.core.names import BadCaptureName, check_capture_name, name_for_rid

# custom_params keys a client sets
CAPTURE = "capture"
CAPTURE_NAME = "capture_name"
CAPTURE_DTYPE = "capture_dtype"
CAPTURE_LOSS_MASK = "capture_loss_mask"
# the conversation a request belongs to, for --capture-fraction under prefix sharing: every turn of one
# session is chosen alike (a client sets it; on /v1/chat/completions the server derives one otherwise)
CAPTURE_SESSION = "capture_session"
MAX_SESSION_LEN = 256
# the mark the server sets on a request --capture-fraction selected: no client asked for its file, so
# its response is SGLang's plain one, sent without waiting for the file
CAPTURE_BY, OPERATOR, CLIENT = "capture_by", "operator", "client"

REFERENCE_TAG = "sglang_capture"  # a reference's marker key (its value: the reference format, 1)
RESPONSE_KEY = "capture"  # where a response's meta_info carries the reference
# what the writer's outcome record adds to a reference; with prefix sharing also the bytes of the blocks this
# capture wrote, and its rows written into them and reused from stored ones (core/blocks.py)
OUTCOME_KEYS = ("bytes", "checksum", "error", "block_bytes", "rows_stored", "rows_shared", "rows_for_next_turn")
ROUTE = "/capture_info"


class BadCaptureRequest(ValueError):
    """A request's capture fields that cannot be honoured; the message is the one line the client gets."""


@dataclass(frozen=True)
class CaptureRequest:
    """A request's capture fields, checked: its file's name, row dtype and loss-mask spans."""

    name: str
    dtype: str
    loss_spans: Optional[List[Tuple[int, int]]]


def custom_params(sampling_params: Any) -> Dict[str, Any]:
    """A request's ``custom_params`` from its sampling params, a dict or SGLang's object ({} when none)."""
    if isinstance(sampling_params, Mapping):
        custom = sampling_params.get("custom_params")
    else:
        custom = getattr(sampling_params, "custom_params", None)
    return custom if isinstance(custom, dict) else {}


def capture_mark(custom: Mapping[str, Any]) -> Optional[str]:
    """None for a request that does not capture, else who asked: ``CLIENT`` or ``OPERATOR``."""
    if custom.get(CAPTURE) is not True:
        return None
    return OPERATOR if custom.get(CAPTURE_BY) == OPERATOR else CLIENT


def says_capture(custom: Mapping[str, Any]) -> Optional[bool]:
    """What the client said about capture: True, False (also for a false-equal value such as 0),
    or None when it did not say. Any other value counts as asking: ``parse_request`` refuses it."""
    value = custom.get(CAPTURE)
    return None if value is None else value not in (False,)


def marked(custom: Mapping[str, Any], by: str) -> Dict[str, Any]:
    """A new custom_params dict asking for capture, for a request the server selected (``by``)."""
    out = {**custom, CAPTURE: True}
    if by == OPERATOR:
        out[CAPTURE_BY] = OPERATOR
    return out


def session_of(custom: Mapping[str, Any]) -> Optional[str]:
    """The client's ``capture_session``, None when it sent none; a BadCaptureRequest for one that is
    no string of 1 to ``MAX_SESSION_LEN`` characters."""
    value = custom.get(CAPTURE_SESSION)
    if value is None:
        return None
    if not isinstance(value, str) or not 0 < len(value) <= MAX_SESSION_LEN:
        raise BadCaptureRequest(f"custom_params.capture_session must be a string of 1 to {MAX_SESSION_LEN} characters "
                                f"naming the conversation, got {value!r:.60}")
    return value


def beam_width(sampling_params: Any) -> int:
    """A request's beam width (SGLang 0.5.19+'s ``sampling_params.beam_width``), 1 when it searches no beams."""
    if isinstance(sampling_params, Mapping):
        value = sampling_params.get("beam_width")
    else:
        value = getattr(sampling_params, "beam_width", None)
    width = value or 1
    try:  # as SGLang reads it (``(beam_width or 1) > 1``): 1.5 and 2.0 search beams
        if not width > 1:
            return 1
    except TypeError:
        return 1  # not a number: SGLang refuses the request itself
    try:
        return max(2, int(width))
    except (ValueError, OverflowError):
        return 2  # infinity: a beam search SGLang refuses itself; never captured



def asks_capture(custom: Mapping[str, Any]) -> bool:
    """Whether the scheduler treats the request as a capture request (then ``parse_request`` either
    accepts its fields or refuses them): any ``capture`` value but absent or ``false``."""
    return custom.get(CAPTURE, False) is not False


def parse_request(custom: Mapping[str, Any], *, rid: str, prompt_len: int, samples: int,
                  default_dtype: str, prefix_pass: bool = False, beams: int = 1) -> Optional[CaptureRequest]:
    """The checked capture fields of a request, None when it does not capture, or a one-line
    BadCaptureRequest naming the field and what to send instead. ``prefix_pass``: SGLang's
    prefix-caching request before n > 1 samples, which gets no file (its samples are checked).
    ``beams``: the request's ``beam_width``; a beam search cannot be captured (its decode steps
    return no hidden states), so a client's capture of one is refused and the operator's dropped."""
    if not asks_capture(custom):
        return None
    if custom[CAPTURE] is not True:
        raise BadCaptureRequest(f"custom_params.capture must be true or false, got {custom[CAPTURE]!r}")
    if beams > 1:
        if custom.get(CAPTURE_BY) == OPERATOR:
            return None
        raise BadCaptureRequest(f"beam search (beam_width {beams}) cannot be captured: SGLang returns no hidden states "
                                "for its decode steps; send beam_width 1 to capture it, or send it without capture")
    if samples > 1 and CAPTURE_NAME in custom:
        raise BadCaptureRequest("custom_params.capture_name names one file but n > 1 asks for several samples; "
                                "leave capture_name out and each sample's file is named by its request id")
    if prefix_pass:
        return None
    if custom.get(CAPTURE_BY) != OPERATOR:  # the operator's choice never turns a request away (hooks/tokenize.py)
        session_of(custom)  # checked for a client's capture, though only --capture-fraction reads it
    dtype = custom.get(CAPTURE_DTYPE, default_dtype)
    if dtype not in CAPTURE_DTYPES:
        raise BadCaptureRequest(f"custom_params.capture_dtype must be one of {', '.join(CAPTURE_DTYPES)}, got {dtype!r}")
    try:
        name = check_capture_name(custom[CAPTURE_NAME]) if CAPTURE_NAME in custom else name_for_rid(rid)
        spans = parse_spans(custom[CAPTURE_LOSS_MASK], prompt_len) if CAPTURE_LOSS_MASK in custom else None
    except (BadCaptureName, BadLossMask) as e:
        raise BadCaptureRequest(str(e)) from None
    return CaptureRequest(name=name, dtype=dtype, loss_spans=spans)


def request_fields(name: str, loss_spans: Sequence[Tuple[int, int]], dtype: Optional[str] = None) -> Dict[str, Any]:
    """The custom_params of a named capture with a loss mask (what ``extract`` sends)."""
    out: Dict[str, Any] = {CAPTURE: True, CAPTURE_NAME: name, CAPTURE_LOSS_MASK: [list(s) for s in loss_spans]}
    if dtype is not None:
        out[CAPTURE_DTYPE] = dtype
    return out


def reference(*, rid: str, path: str, index: str, rows: int, layers: Sequence[int], dtype: str,
              shapes: Mapping[str, Sequence[int]], fp8: bool) -> Dict[str, Any]:
    """A response's reference to its capture file, before the writer's outcome (no ``status`` yet)."""
    ref: Dict[str, Any] = {REFERENCE_TAG: 1, "rid": rid, "path": path, "index": index, "rows": rows,
                           "layers": list(layers), "dtype": dtype, "shapes": {k: list(v) for k, v in shapes.items()}}
    if fp8:
        ref["storage_dtype"] = FP8_DTYPE
    return ref


def is_reference(value: Any) -> bool:
    """Whether ``value`` is a capture reference (and not, say, SGLang's hidden-state lists)."""
    return isinstance(value, dict) and bool(value.get(REFERENCE_TAG))


def with_outcome(ref: Mapping[str, Any], outcome: Mapping[str, Any]) -> Dict[str, Any]:
    """The reference completed by the writer's outcome record: its status, bytes, checksum or error."""
    done = {**ref, "status": outcome.get("status", "error")}
    done.update({k: outcome[k] for k in OUTCOME_KEYS if k in outcome})
    return done


def reference_in(meta_info: Any) -> Optional[Dict[str, Any]]:
    """The capture reference of a response's ``meta_info``, None when it carries none."""
    ref = meta_info.get(RESPONSE_KEY) if isinstance(meta_info, dict) else None
    return ref if isinstance(ref, dict) else None


def capture_info_body(config: CaptureConfig, model_path: str, architecture: str, layers: List[int],
                      who_captures: str = "", speculative: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """The JSON body of ``/capture_info`` (``who_captures``: what the start-up log said about it;
    ``speculative``: the algorithm and draft of a server that speculates, whose draft fixes ``layers``)."""
    from sglang_capture import __version__

    return {
        "sglang_capture": __version__,
        "capture_dir": config.capture_dir,
        "model_path": model_path,
        "architecture": architecture,
        "layers": layers,
        "keep_last_hidden": config.keep_last_hidden,
        "final": config.final if config.keep_last_hidden else None,
        "codec": config.codec,
        "capture_fraction": config.fraction,
        "capture_return_hidden_states": config.hidden_states_requests,
        "prefix_sharing": config.prefix_sharing,
        "who_captures": who_captures,
        "speculative": speculative,
    }
