"""Who makes a request capture: the operator's ``--capture-fraction`` (a pure function of the
request id) and ``--capture-clients`` (which clients may ask), and what the log says about both.

Deciding by a hash of the rid, not by a random draw, gives the same answer in every process and on
every replica that sees the request (the HTTP process that waits for the file and the scheduler
that writes it), and again when a client retries with the same rid: a retried request is captured
exactly when its first attempt was. Routers and load balancers do not change the answer either.
"""
from __future__ import annotations

import hashlib
import ipaddress
import json
import secrets
from typing import Any, List, Optional, Sequence, Tuple

_SPAN = float(1 << 64)


def rid_point(rid: str) -> float:
    """The rid's fixed point in [0, 1): the first 8 bytes of its sha256, as a fraction of 2**64."""
    digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / _SPAN


def fraction_selects(rid: str, fraction: float) -> bool:
    """Whether ``--capture-fraction fraction`` captures the request ``rid`` (0 never, 1 always)."""
    return fraction > 0 and rid_point(rid) < fraction


def session_selects(session: str, fraction: float) -> bool:
    """Whether ``--capture-fraction fraction`` captures the requests of the conversation ``session``:
    all of its turns alike, by the same rule as a rid's (raising the fraction only adds sessions)."""
    return fraction_selects("session\x00" + session, fraction)


def _message_text(message: Any) -> Any:
    """A chat message's role and content as plain values (SGLang passes pydantic models or dicts)."""
    if hasattr(message, "model_dump"):
        message = message.model_dump()
    if not isinstance(message, dict):
        return str(message)
    return {"role": message.get("role"), "content": message.get("content")}


def chat_session(messages: Sequence[Any]) -> str:
    """A conversation's key, the same for each of its turns: a digest of its messages up to its
    first user message (the system prompt and the question that opened it), which every later
    turn re-sends unchanged."""
    opening: List[Any] = []
    for message in messages:
        item = _message_text(message)
        opening.append(item)
        if isinstance(item, dict) and item.get("role") == "user":
            break
    doc = json.dumps(opening, sort_keys=True, default=str, ensure_ascii=False)
    return hashlib.sha256(doc.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine


CLIENT_POLICIES = ("any", "admin", "none")
CAPTURE_REFUSED = "capture refused:"  # how every refusal starts: clients (tools/client.py) stop on it


def bearer_token(authorization: Optional[str]) -> Optional[str]:
    """The token of an ``Authorization: Bearer <token>`` header, as SGLang's auth reads it."""
    scheme, _, token = (authorization or "").partition(" ")
    return token if scheme.lower() == "bearer" and token else None


def effective_policy(clients: Optional[str], admin_key: Optional[str]) -> str:
    """``--capture-clients`` as applied: unset means admin when SGLang has an admin key, else any."""
    return clients if clients is not None else ("admin" if admin_key else "any")


def client_refusal(policy: str, authorization: Optional[str], admin_key: Optional[str]) -> Optional[str]:
    """Why ``--capture-clients policy`` refuses a client's request for hidden states (a capture, or
    SGLang's JSON lists) sent with this ``Authorization`` header (one line, naming no key), or None."""
    if policy == "none":
        return (f"{CAPTURE_REFUSED} this server gives clients no hidden states, as files or as lists "
                "(--capture-clients none); its operator chooses what is captured (--capture-fraction)")
    if policy == "admin":
        token = bearer_token(authorization)
        if admin_key and token is not None and secrets.compare_digest(token.encode(), admin_key.encode()):
            return None
        return (f"{CAPTURE_REFUSED} on this server only requests with its admin API key may ask for capture or "
                "hidden states (--capture-clients admin); send Authorization: Bearer <the server's --admin-api-key>")
    return None


def who_captures(fraction: float, hidden_states_requests: bool, host: str, api_key: bool,
                 clients: str = "any", by_session: bool = False) -> Tuple[str, Optional[str]]:
    """What the start-up log and ``doctor`` say about who makes requests capture (``by_session``: the
    fraction chooses conversations, under prefix sharing), and a warning when any client that can
    reach a server listening beyond loopback can fill its capture dir."""
    asks = "custom_params.capture" + (" or return_hidden_states" if hidden_states_requests else "")
    if clients == "none":
        said = "who captures: no client (--capture-clients none)"
    else:
        who = ("clients holding the server's --admin-api-key" if clients == "admin" else
               "clients holding the server's --api-key" if api_key else "any client that reaches the server")
        said = f"who captures: {who} ({asks})"
    by = ("by conversation (custom_params.capture_session, or a chat's opening messages), else by request id"
          if by_session else "by request id")
    said += f"; the operator: {fraction:.4g} of all requests, {by}" if fraction > 0 else ""
    warning = None
    if clients == "any" and not api_key and not _loopback(host):
        warning = (f"the server listens on {host} without --api-key: any client that reaches it can ask for capture "
                   f"and fill the capture dir; set SGLang's --api-key, or --admin-api-key (then only its holders "
                   f"may ask for capture)")
    return said, warning
