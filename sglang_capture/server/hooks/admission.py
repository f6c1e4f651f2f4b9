"""Admission seams (HTTP process): who may ask for capture (``--capture-clients``).

``refuse_unallowed_capture`` (``TokenizerManager.generate_request``, the entry of every generation request, with
the HTTP request beside it) refuses a client's request for hidden states (a capture, or SGLang's
JSON lists) the policy does not allow, before anything is tokenized or scheduled: SGLang answers
its ValueError with HTTP 400 and the message (a streaming ``/generate`` with its error event).

``admit_admin_key`` (``sglang.srt.utils.auth.decide_request_auth``): SGLang accepts only ``--api-key`` on
routes like ``/generate`` when both keys are set, so under ``--capture-clients admin`` no request
could carry the admin key to them; the admin key is let through those routes as well (it already
opens every admin route, which the plain key does not).
"""
from __future__ import annotations

import secrets
from typing import Any, AsyncIterator, List

from sglang_capture.core import protocol
from sglang_capture.core.config import CaptureConfig
from sglang_capture.core.selection import bearer_token, client_refusal, effective_policy


def _as_list(value: Any) -> List[Any]:
    return value if isinstance(value, list) else [value]


def asks_hidden_states(obj: Any) -> bool:
    """Whether the generation request ``obj`` (one, or a batch) asks for hidden states: a capture
    (``custom_params.capture``, or ``return_hidden_states`` under ``--capture-return-hidden-states``)
    or SGLang's JSON lists (``return_hidden_states``), which the launcher always enables."""
    return (any(protocol.says_capture(protocol.custom_params(params)) for params in _as_list(obj.sampling_params))
            or any(_as_list(obj.return_hidden_states)))


async def _refused(obj: Any, message: str) -> AsyncIterator[Any]:
    try:  # SGLang's stream handler reads the request's normalized fields when it ends
        obj.normalize_batch_and_arguments()
    except Exception:  # noqa: BLE001 - a request SGLang would refuse anyway: the refusal is the answer
        pass
    raise ValueError(message)
    yield  # an async generator, as the wrapped method is


def refuse_unallowed_capture(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``TokenizerManager.generate_request(obj, request=None)``."""
    obj = args[0] if args else kwargs["obj"]
    request = args[1] if len(args) > 1 else kwargs.get("request")
    admin_key = instance.server_args.admin_api_key
    policy = effective_policy(config.clients, admin_key)
    if policy != "any" and hasattr(obj, "return_hidden_states") and asks_hidden_states(obj):
        authorization = request.headers.get("authorization") if request is not None else None
        why = client_refusal(policy, authorization, admin_key)
        if why is not None:
            return _refused(obj, why)
    return wrapped(*args, **kwargs)


def admit_admin_key(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``decide_request_auth(*, method, path, authorization_header, api_key, admin_api_key, auth_level)``."""
    decision = wrapped(*args, **kwargs)
    admin_key = kwargs.get("admin_api_key")
    if (decision.allowed or not admin_key or effective_policy(config.clients, admin_key) != "admin"
            or kwargs.get("auth_level") != "normal"):
        return decision
    token = bearer_token(kwargs.get("authorization_header"))
    if token is not None and secrets.compare_digest(token.encode(), admin_key.encode()):
        return type(decision)(allowed=True)
    return decision
