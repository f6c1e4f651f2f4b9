"""``GET /capture_info`` on SGLang's app: how a client tells a capture server from a plain SGLang server.

Clients (``sglang-capture extract``, ``doctor --server``) ask it before sending work: a plain
server answers 404, and a capture server says where its files go, what they hold and who makes
requests capture (the body: core/protocol.py). It is a route like ``/generate``: with SGLang's
``--api-key`` it needs the key.
"""
from __future__ import annotations

from typing import Any, Dict

from sglang_capture.core.protocol import ROUTE


def add_route(body: Dict[str, Any]) -> None:
    """Register the route on SGLang's FastAPI app (HTTP process, before the server starts)."""
    from sglang.srt.entrypoints.http_server import app

    if any(getattr(r, "path", None) == ROUTE for r in app.routes):
        return

    async def capture_info() -> Dict[str, Any]:
        return body

    app.add_api_route(ROUTE, capture_info, methods=["GET"])
