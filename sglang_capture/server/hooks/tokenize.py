"""Tokenize seam (HTTP process): a capture request sent straight to a PD prefill server.

pd_prefill.py says why such a request is given SGLang's no-decode-server bootstrap fields; this
is where the tokenized request, about to go to the scheduler, still has room for them.
"""
from __future__ import annotations

from typing import Any

from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.pd_prefill import is_pd_prefill, prefill_only_without_router


def route_direct_capture_requests(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """After ``TokenizerManager._create_tokenized_object``, on a prefill server only."""
    tokenized = wrapped(*args, **kwargs)
    if is_pd_prefill(instance.server_args) and hasattr(tokenized, "bootstrap_room"):
        custom = getattr(tokenized.sampling_params, "custom_params", None)
        if isinstance(custom, dict) and custom.get("capture") is True:
            prefill_only_without_router(tokenized)
    return tokenized
