"""Talking to capture servers over HTTP: discovery and one prefill-only capture request.

Every failure becomes a ``ServerError`` whose message says which server and what to do, so
the CLI never shows a traceback for a server that is down, plain, or refusing a request.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import requests

from sglang_capture.server.capture_info import ROUTE


class ServerError(RuntimeError):
    """A server that cannot take capture work; ``retryable`` says whether trying again may help."""

    def __init__(self, message: str, retryable: bool = True) -> None:
        super().__init__(message)
        self.retryable = retryable


@dataclass(frozen=True)
class ServerInfo:
    url: str
    capture_dir: str
    model_path: str
    layers: List[int]


def _url(url: str) -> str:
    url = url.strip().rstrip("/")
    return url if "://" in url else "http://" + url


def discover(url: str, timeout: float = 10.0) -> ServerInfo:
    """Ask ``url`` whether it is a capture server; raises ServerError with the reason if not."""
    url = _url(url)
    try:
        r = requests.get(url + ROUTE, timeout=timeout)
    except requests.RequestException as e:
        raise ServerError(f"cannot reach {url} ({type(e).__name__}); is the server running and the URL right?",
                          retryable=False) from None
    if r.status_code == 404:
        raise ServerError(f"{url} is not a capture server (no {ROUTE}); start it with "
                          "python -m sglang_capture.launch --capture-dir DIR ...", retryable=False)
    try:
        r.raise_for_status()
        body = r.json()
        return ServerInfo(url, str(body["capture_dir"]), str(body["model_path"]), [int(i) for i in body["layers"]])
    except (requests.HTTPError, ValueError, KeyError, TypeError) as e:
        raise ServerError(f"{url}{ROUTE} gave an unexpected answer (HTTP {r.status_code}: {e})", retryable=False) from None


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
            "custom_params": {"capture": True, "capture_name": name,
                              "capture_loss_mask": [list(s) for s in loss_spans]},
        },
    }
    if capture_dtype is not None:
        body["sampling_params"]["custom_params"]["capture_dtype"] = capture_dtype
    try:
        r = (session or requests).post(server.url + "/generate", json=body, timeout=timeout)
    except requests.RequestException as e:
        raise ServerError(f"{server.url}: request failed ({type(e).__name__})") from None
    if r.status_code != 200:
        detail = _error_text(r)
        raise ServerError(f"{server.url} answered HTTP {r.status_code}: {detail}", retryable=r.status_code >= 500)
    try:
        ref: Optional[Dict[str, Any]] = r.json()["meta_info"].get("capture")
    except (ValueError, KeyError, TypeError, AttributeError):
        raise ServerError(f"{server.url}: the response is not SGLang's /generate JSON") from None
    if ref is None:
        raise ServerError(f"{server.url} did not capture (no meta_info.capture); is it a capture server?",
                          retryable=False)
    if ref.get("status") != "ok":
        raise ServerError(f"{server.url}: capture {ref.get('status')}: {ref.get('error', 'no reason given')}")
    return ref


def _error_text(r: requests.Response) -> str:
    try:
        body = r.json()
        msg = body.get("error", {}).get("message") if isinstance(body.get("error"), dict) else body.get("message")
        return str(msg or body)[:300]
    except ValueError:
        return r.text[:300]
