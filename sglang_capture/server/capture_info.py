"""``GET /capture_info``: how a client tells a capture server from a plain SGLang server.

Clients (``sglang-capture extract``, ``doctor --server``) ask it before sending work: a plain
server answers 404, and a capture server says where its files go, what they hold and who makes
requests capture. It is a route like ``/generate``: with SGLang's ``--api-key`` it needs the key.
"""
from __future__ import annotations

from typing import Any, Dict, List

from sglang_capture.core.config import CaptureConfig

ROUTE = "/capture_info"


def capture_info_body(config: CaptureConfig, model_path: str, architecture: str, layers: List[int],
                      who_captures: str = "") -> Dict[str, Any]:
    """The JSON body of ``/capture_info`` (``who_captures``: what the start-up log said about it)."""
    from sglang_capture import __version__

    return {
        "sglang_capture": __version__,
        "capture_dir": config.capture_dir,
        "model_path": model_path,
        "architecture": architecture,
        "layers": layers,
        "keep_last_hidden": config.keep_last_hidden,
        "codec": config.codec,
        "capture_fraction": config.fraction,
        "capture_return_hidden_states": config.hidden_states_requests,
        "who_captures": who_captures,
    }


def add_route(body: Dict[str, Any]) -> None:
    """Register the route on SGLang's FastAPI app (HTTP process, before the server starts)."""
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return

    async def capture_info() -> Dict[str, Any]:
        return body

    app.add_api_route(ROUTE, capture_info, methods=["GET"])
