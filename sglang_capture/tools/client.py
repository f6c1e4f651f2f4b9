"""Talking to capture servers over HTTP: discovery and one prefill-only capture request.

Every failure becomes a ``ServerError`` whose message says which server and what to do, so
the CLI never shows a traceback for a server that is down, plain, or refusing a request.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import requests

from sglang_capture.core import protocol
from sglang_capture.core.selection import CAPTURE_REFUSED


class ServerError(RuntimeError):
    """A server that cannot take capture work; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, retryable: bool = True, fatal: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable and not fatal
        self.fatal = fatal  # every request to this server would fail alike: a missing key, a refused client


API_KEY_ENV = "SGLANG_API_KEY"  # where the tools' --api-key is read from when not given


class NotCaptureServer(ServerError):
    """``url`` answers, but has no ``/capture_info``: a plain SGLang server, or a router in front of some."""


@dataclass(frozen=True)
class ServerInfo:
    url: str
    capture_dir: str
    model_path: str
    layers: List[int]
    api_key: Optional[str] = field(default=None, repr=False)  # sent as a bearer token, never shown
    info: Dict[str, Any] = field(default_factory=dict, repr=False, compare=False)  # its whole /capture_info

    def headers(self) -> Dict[str, str]:
        return auth_headers(self.api_key)


def auth_headers(api_key: Optional[str]) -> Dict[str, str]:
    """The ``Authorization`` header SGLang's ``--api-key`` (and ``--admin-api-key``) checks."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _refused(url: str, r: requests.Response, api_key: Optional[str]) -> Optional[ServerError]:
    """A one-line error for a key the server wants or refuses (never showing the key)."""
    if r.status_code not in (401, 403):
        return None
    if api_key:
        return ServerError(f"{url} refused the API key given (HTTP {r.status_code}); check --api-key or "
                           f"${API_KEY_ENV}", fatal=True)
    return ServerError(f"{url} needs an API key (HTTP {r.status_code}); pass --api-key or set ${API_KEY_ENV}",
                       fatal=True)


def _url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


def discover(url: str, timeout: float = 10.0, api_key: Optional[str] = None) -> ServerInfo:
    """Ask ``url`` whether it is a capture server; raises ServerError with the reason if not."""
    url = _url(url)
    r = _get(url, protocol.ROUTE, timeout, api_key)
    refused = _refused(url, r, api_key)
    if refused is not None:
        raise refused
    if r.status_code == 404:
        raise NotCaptureServer(f"{url} is not a capture server (no {protocol.ROUTE}); start it with "
                               "python -m sglang_capture.launch --capture-dir DIR ...", retryable=False)
    try:
        r.raise_for_status()
        body = r.json()
        return ServerInfo(url, str(body["capture_dir"]), str(body["model_path"]), [int(i) for i in body["layers"]],
                          api_key, body)
    except (requests.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServerError(f"{url}{protocol.ROUTE} gave an unexpected answer (HTTP {r.status_code}: {e})", retryable=False) from None


def _get(url: str, route: str, timeout: float, api_key: Optional[str]) -> requests.Response:
    try:
        return requests.get(url + route, timeout=timeout, headers=auth_headers(api_key))
    except requests.RequestException as e:
        raise ServerError(f"cannot reach {url} ({type(e).__name__}); is the server running and the URL right?",
                          retryable=False) from None


ROUTER_WORKERS = "/workers"  # the SGLang router's (sglang-router, 0.3) list of the workers it routes to


def router_workers(url: str, timeout: float = 10.0, api_key: Optional[str] = None) -> Optional[List[str]]:
    """The URLs of the workers an SGLang router at ``url`` routes to, or None when ``url`` is no router."""
    url = _url(url)
    r = _get(url, ROUTER_WORKERS, timeout, api_key)
    try:
        workers = r.json()["workers"] if r.status_code == 200 else None
        return None if workers is None else [_url(str(w["url"])) for w in workers]
    except (ValueError, KeyError, TypeError):
        return None


def discover_servers(urls: Sequence[str], timeout: float = 10.0, api_key: Optional[str] = None,
                     say: Optional[Callable[[str], None]] = None) -> List[ServerInfo]:
    """The capture servers behind ``urls``: each URL is a capture server, or an SGLang router whose
    capture workers (its ``/workers``) are then used directly. A router forwards neither
    ``/capture_info`` nor ``custom_params`` on ``/generate`` (docs/deployment.md: behind the SGLang router), and
    a capture request shares no radix cache with others, so the router's cache-aware routing would
    gain it nothing; going to the workers also keeps each retry in extract's hands, not the router's,
    where a retried request could leave a second file."""
    servers: List[ServerInfo] = []
    for url in urls:
        try:
            servers.append(discover(url, timeout, api_key))
            continue
        except NotCaptureServer:
            workers = router_workers(url, timeout, api_key)
            if workers is None:
                raise
        if not workers:
            raise ServerError(f"{_url(url)} is an SGLang router with no workers; add capture servers to it", retryable=False)
        found, plain = [], []
        for worker in workers:
            try:
                found.append(discover(worker, timeout, api_key))
            except ServerError as e:
                plain.append(f"{worker} ({e})")
        if say is not None:
            say(f"{_url(url)} is an SGLang router: capturing on its {len(found)} capture workers "
                f"{', '.join(s.url for s in found) or '(none)'} directly"
                + (f"; skipped {'; '.join(plain)}" if plain else ""))
        if not found:
            raise ServerError(f"{_url(url)} is an SGLang router, and none of its workers is a reachable capture server: "
                              f"{'; '.join(plain)}", retryable=False)
        servers.extend(found)
    return servers


def capture_prefill(server: ServerInfo, input_ids: Sequence[int], name: str,
                    loss_spans: Sequence[Tuple[int, int]], timeout: float,
                    capture_dtype: Optional[str] = None,
                    session: Optional[requests.Session] = None) -> Dict[str, Any]:
    """One capture request that only prefills (one sampled token, no decode step); returns the
    reference from ``meta_info["capture"]`` once its file is complete. ``capture_dtype`` overrides
    the server's ``--capture-dtype`` for this request. A ``session`` keeps the connection open
    between requests: without one, each request opens a TCP connection and leaves a socket in
    TIME_WAIT, which at hundreds of requests a second for hours runs out of local ports."""
    body: Dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": {
            "max_new_tokens": 1, "temperature": 0.0,
            "custom_params": protocol.request_fields(name, loss_spans, capture_dtype),
        },
    }
    try:
        r = (session or requests).post(server.url + "/generate", json=body, timeout=timeout, headers=server.headers())
    except requests.RequestException as e:
        raise ServerError(f"{server.url}: request failed ({type(e).__name__})") from None
    refused = _refused(server.url, r, server.api_key)
    if refused is not None:
        raise refused
    if r.status_code != 200:
        detail = _error_text(r)
        raise ServerError(f"{server.url} answered HTTP {r.status_code}: {detail}", retryable=r.status_code >= 500,
                          fatal=CAPTURE_REFUSED in detail)
    try:
        meta_info = r.json()["meta_info"]
    except (ValueError, KeyError, TypeError):
        meta_info = None
    if not isinstance(meta_info, dict):
        raise ServerError(f"{server.url}: the response is not SGLang's /generate JSON")
    ref = protocol.reference_in(meta_info)
    if ref is None:
        raise ServerError(NO_REFERENCE.format(url=server.url), retryable=False)
    if ref.get("status") != "ok":
        raise ServerError(f"{server.url}: capture {ref.get('status')}: {ref.get('error', 'no reason given')}")
    return ref


NO_REFERENCE = ("{url} answered a capture request without a capture reference (no meta_info.capture): a proxy on "
                "the way most likely dropped custom_params (the SGLang router does on /generate and "
                "/v1/chat/completions); send capture requests to the capture servers themselves, or through "
                "/v1/completions, or set return_hidden_states on a server started with --capture-return-hidden-states")


def _error_text(r: requests.Response) -> str:
    try:
        body = r.json()
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        return str(msg or body)[:300]
    except ValueError:
        return r.text[:300]
