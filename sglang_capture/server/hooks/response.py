"""Response seam (HTTP process): answer only once the capture file is published.

The scheduler's reference says ``pending`` while a writer process is still at work. Wrapping the
tokenizer manager's per-request response generator, this waits (asynchronously, without
blocking other requests, woken by the record's rename: outcome_watch.py) for the writer's outcome
record, then moves the completed reference
from ``meta_info["hidden_states"]`` to ``meta_info["capture"]``. OpenAI endpoints go through
the same generator, so their responses, too, arrive after the file is complete, and
``openai_reference`` puts the reference where an OpenAI response carries hidden states: each
choice's ``hidden_states`` (non-streaming responses).
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Dict, Optional

from sglang_capture.core import protocol
from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.outcome_watch import OutcomeWatch

OUTCOME_WATCH_ATTR = "_sglang_capture_outcomes"  # the HTTP process's OutcomeWatch, on its TokenizerManager


def _outcome_watch(tokenizer_manager: Any) -> OutcomeWatch:
    """The HTTP process's outcome watch, kept on its tokenizer manager (made on first use, in the
    event loop that answers requests)."""
    loop = asyncio.get_running_loop()
    watch = getattr(tokenizer_manager, OUTCOME_WATCH_ATTR, None)
    if watch is None or watch.loop is not loop:
        if watch is not None and not watch.loop.is_closed():
            watch.close()
        watch = OutcomeWatch(loop)
        setattr(tokenizer_manager, OUTCOME_WATCH_ATTR, watch)
    return watch


def _take_ref(out: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    meta = out.get("meta_info")
    if not isinstance(meta, dict):
        return None
    hidden = meta.pop("hidden_states", None)
    if isinstance(hidden, list) and hidden and protocol.is_reference(hidden[0]):
        return hidden[0]
    return None


def await_capture_file(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``TokenizerManager._wait_one_response``, which returns an async generator.

    SGLang 0.5.23 looks the request state up when the generator is *created* (a batch builds every
    waiter before advancing any), so the original is called right away and only its output is
    wrapped; requests that do not capture get SGLang's generator untouched.
    """
    obj = args[0] if args else kwargs.get("obj")
    responses = wrapped(*args, **kwargs)
    mark = protocol.capture_mark(protocol.custom_params(getattr(obj, "sampling_params", None)))
    if mark is None:
        return responses
    if mark == protocol.OPERATOR:
        return _without_refs(responses)
    return _with_capture_refs(responses, config.wait_timeout_s, instance)


async def _without_refs(responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """An operator-selected capture's responses as plain SGLang sends them: no reference, no wait."""
    async for out in responses:
        if isinstance(out, dict):
            _take_ref(out)
        yield out


async def _with_capture_refs(responses: AsyncIterator[Any], timeout_s: float, tokenizer_manager: Any) -> AsyncIterator[Any]:
    async for out in responses:
        if isinstance(out, dict):
            ref = _take_ref(out)
            if ref is not None:
                if ref.get("status") == "pending":
                    ref = await _outcome_watch(tokenizer_manager).wait(ref, timeout_s)
                out["meta_info"][protocol.RESPONSE_KEY] = ref
        yield out


def openai_reference(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``process_hidden_states_from_ret`` (SGLang's OpenAI chat and completion responses):
    a captured choice's ``hidden_states`` is its capture reference, whether or not the request
    also set ``return_hidden_states``."""
    ret_item = args[0] if args else kwargs["ret_item"]
    ref = protocol.reference_in(ret_item.get("meta_info") if isinstance(ret_item, dict) else None)
    return ref if ref is not None else wrapped(*args, **kwargs)
