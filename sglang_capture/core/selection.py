"""Which requests the operator's ``--capture-fraction`` captures: a pure function of the request id.

Deciding by a hash of the rid, not by a random draw, gives the same answer in every process and on
every replica that sees the request (the HTTP process that waits for the file and the scheduler
that writes it), and again when a client retries with the same rid: a retried request is captured
exactly when its first attempt was. Routers and load balancers do not change the answer either.
"""
from __future__ import annotations

import hashlib
import ipaddress
from typing import Optional, Tuple

_SPAN = float(1 << 64)


def rid_point(rid: str) -> float:
    """The rid's fixed point in [0, 1): the first 8 bytes of its sha256, as a fraction of 2**64."""
    digest = hashlib.sha256(rid.encode("utf-8", "surrogatepass")).digest()
    return int.from_bytes(digest[:8], "big") / _SPAN


def fraction_selects(rid: str, fraction: float) -> bool:
    """Whether ``--capture-fraction fraction`` captures the request ``rid`` (0 never, 1 always)."""
    return fraction > 0 and rid_point(rid) < fraction



def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # a host name: it may resolve beyond this machine


def who_captures(fraction: float, hidden_states_requests: bool, host: str, api_key: bool) -> Tuple[str, Optional[str]]:
    """What the start-up log and ``doctor`` say about who makes requests capture, and a warning when
    any client that can reach a server listening beyond loopback can fill its capture dir."""
    asks = "custom_params.capture" + (" or return_hidden_states" if hidden_states_requests else "")
    clients = "clients holding the server's --api-key" if api_key else "any client that reaches the server"
    said = f"who captures: {clients} ({asks})"
    said += f"; the operator: {fraction:.4g} of all requests, by request id" if fraction > 0 else ""
    warning = None
    if not api_key and not _loopback(host):
        warning = (f"the server listens on {host} without --api-key: any client that reaches it can ask for capture "
                   f"and fill the capture dir; set SGLang's --api-key")
    return said, warning
