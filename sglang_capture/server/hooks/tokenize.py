"""``admit_capture_request`` (HTTP process): which requests capture, decided once, before the scheduler sees them.

Three things make a request capture, and here each becomes the one flag the rest of the path reads
(``sampling_params.custom_params.capture``: the scheduler's ``begin``, ``await_capture_file``, PD):

- the client asks, in ``custom_params`` (sent as is, never changed here);
- with ``--capture-return-hidden-states``, the client sets SGLang's own ``return_hidden_states``,
  the one capture flag the SGLang router forwards on every endpoint (custom_params.capture=false
  still asks for SGLang's JSON lists);
- the operator's ``--capture-fraction`` selects the request by its rid (core/selection.py), or with
  prefix sharing on by its conversation, so that all of a chat's turns are captured or none: the
  client's ``custom_params.capture_session``, or on ``/v1/chat/completions`` a digest of the chat's
  opening messages (``derive_capture_session``). Its response is the plain one, sent without waiting
  for the file (the client did not ask; the file is named by the rid): ``custom_params.capture_by``
  says so to ``await_capture_file``.

A capture request sent straight to a PD prefill server then gets SGLang's no-decode-server
bootstrap: pd_prefill.py says why, and the tokenized request is where its fields are.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

from sglang_capture.core import protocol
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.selection import chat_session, fraction_selects, session_selects
from sglang_capture.server.pd_prefill import is_pd_prefill, prefill_only_without_router

HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # sglang.srt.constants' (0.5.17-0.5.23), without importing SGLang
SESSION_ATTR = "_sglang_capture_session"  # a chat request's derived session, on its GenerateReqInput


def selects(config: CaptureConfig, obj: Any) -> Optional[str]:
    """Who, other than ``custom_params``, makes the request ``obj`` capture: ``protocol.CLIENT`` (its
    ``return_hidden_states``, under ``--capture-return-hidden-states``), ``protocol.OPERATOR``
    (``--capture-fraction``), or None."""
    if protocol.says_capture(protocol.custom_params(obj.sampling_params)) is not None:
        return None  # the client said, either way
    if obj.return_hidden_states:
        # a client that wants SGLang's JSON lists keeps them unless the server turns them into files
        return protocol.CLIENT if config.hidden_states_requests else None
    rid = str(obj.rid)
    if not config.fraction or rid.startswith(HEALTH_CHECK_RID_PREFIX) or protocol.beam_width(obj.sampling_params) > 1:
        return None  # no fraction; /health's own generate request, which needs no API key; a beam search (no rows)
    session = session_key(config, obj)
    chosen = session_selects(session, config.fraction) if session is not None else fraction_selects(rid, config.fraction)
    return protocol.OPERATOR if chosen else None


def session_key(config: CaptureConfig, obj: Any) -> Optional[str]:
    """The conversation ``obj`` belongs to, when prefix sharing wants its turns chosen together: the
    client's ``custom_params.capture_session``, else the one derived from an OpenAI chat's opening
    messages (``derive_capture_session``); None otherwise (then the rid decides, turn by turn). A
    ``capture_session`` that is no session name is not one: the operator's choice never turns a
    request away (a client's own capture request with it is refused, ``protocol.parse_request``)."""
    if not config.sharing:
        return None
    try:
        given = protocol.session_of(protocol.custom_params(obj.sampling_params))
    except protocol.BadCaptureRequest:
        given = None
    return given if given is not None else getattr(obj, SESSION_ATTR, None)


def derive_capture_session(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After ``OpenAIServingChat._convert_to_internal_request``: a chat request without a
    ``capture_session`` gets one from its opening messages, for ``--capture-fraction``."""
    result = wrapped(*args, **kwargs)
    if config.fraction and config.sharing:
        request = args[0] if args else kwargs["request"]
        setattr(result[0], SESSION_ATTR, chat_session(request.messages))
    return result


def _with_capture(params: Any, by: str) -> Dict[str, Any]:
    """A new sampling-params dict asking for capture: a batch's requests can share one dict."""
    return {**(params or {}), "custom_params": protocol.marked(protocol.custom_params(params), by)}


def admit_capture_request(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``TokenizerManager._create_tokenized_object``: mark the requests the server selects,
    then route a capture request sent straight to a prefill server."""
    obj = args[0] if args else kwargs["obj"]
    by = selects(config, obj) if hasattr(obj, "return_hidden_states") else None  # generation requests only
    if by is not None:
        obj.sampling_params = _with_capture(obj.sampling_params, by)
    tokenized = wrapped(*args, **kwargs)
    if is_pd_prefill(instance.server_args) and hasattr(tokenized, "bootstrap_room"):
        if protocol.capture_mark(protocol.custom_params(tokenized.sampling_params)) is not None:
            prefill_only_without_router(tokenized)
    return tokenized
