"""Response seam (HTTP process): answer only once the capture file is published.

The scheduler's reference says ``pending`` while a writer process is still at work. Wrapping the
tokenizer manager's per-request response generator, this waits (asynchronously, without
blocking other requests, woken by the record's rename: outcome_watch.py) for the writer's outcome
record, then moves the completed reference
from ``meta_info["hidden_states"]`` to ``meta_info["capture"]``. OpenAI endpoints go through
the same generator, so their responses, too, arrive after the file is complete, and
``openai_reference`` puts the reference where an OpenAI response carries hidden states: each
choice's ``hidden_states``. A streamed OpenAI response gets them in one data chunk after the
choices' own, before the usage chunk (``chat_stream_reference``: each choice's ``delta.hidden_states``;
``completion_stream_reference``: each choice's ``hidden_states``), as SGLang streams hidden states;
a streamed ``/generate`` carries the reference in its last chunk's ``meta_info.capture``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Dict, List, Optional

from sglang_capture.core import protocol
from sglang_capture.core.config import CaptureConfig
from sglang_capture.server.outcome_watch import OutcomeWatch

OUTCOME_WATCH_ATTR = "_sglang_capture_outcomes"  # on the TokenizerManager: its OutcomeWatch per event loop
STREAM_OUTPUTS_ATTR = "sglang_capture_outputs"  # on a streaming HTTP request's state: its outputs with a reference
DONE = "data: [DONE]"  # how SGLang's OpenAI streams end (0.5.17-0.5.23)
RESPONSE_LEVEL = '"choices":[]'  # in a chunk of the whole response (usage, sglext), as pydantic writes it


def _outcome_watch(tokenizer_manager: Any) -> OutcomeWatch:
    """The outcome watch of the running event loop, kept on the tokenizer manager (made on first use;
    SGLang answers requests in one loop per HTTP process, a test harness may use several)."""
    loop = asyncio.get_running_loop()
    watches: Optional[Dict[Any, OutcomeWatch]] = getattr(tokenizer_manager, OUTCOME_WATCH_ATTR, None)
    if watches is None:
        watches = {}
        setattr(tokenizer_manager, OUTCOME_WATCH_ATTR, watches)
    watch = watches.get(loop)
    if watch is None:
        for old in [w for w in watches.values() if w.loop.is_closed()]:
            old.close()  # its descriptor
            del watches[old.loop]
        watch = watches[loop] = OutcomeWatch(loop)
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
    request = args[1] if len(args) > 1 else kwargs.get("request")
    stream_outputs = _stream_outputs(request) if getattr(obj, "stream", False) else None
    return _with_capture_refs(responses, config.wait_timeout_s, instance, stream_outputs)


async def _without_refs(responses: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """An operator-selected capture's responses as plain SGLang sends them: no reference, no wait."""
    async for out in responses:
        if isinstance(out, dict):
            _take_ref(out)
        yield out


async def _with_capture_refs(responses: AsyncIterator[Any], timeout_s: float, tokenizer_manager: Any,
                             stream_outputs: Optional[List[Dict[str, Any]]]) -> AsyncIterator[Any]:
    async for out in responses:
        if isinstance(out, dict):
            ref = _take_ref(out)
            if ref is not None:
                if ref.get("status") == "pending":
                    ref = await _outcome_watch(tokenizer_manager).wait(ref, timeout_s)
                out["meta_info"][protocol.RESPONSE_KEY] = ref
                if stream_outputs is not None:
                    stream_outputs.append(out)  # SGLang sets its choice "index" on this dict after we yield it
        yield out


def _stream_outputs(raw_request: Any) -> Optional[List[Dict[str, Any]]]:
    """A streaming HTTP request's list of the outputs that carried a reference, kept on the request's
    own ``state`` (shared by all its choices, gone with it); None for a call without an HTTP request."""
    state = getattr(raw_request, "state", None)
    if state is None:
        return None
    outputs = getattr(state, STREAM_OUTPUTS_ATTR, None)
    if outputs is None:
        outputs = []
        setattr(state, STREAM_OUTPUTS_ATTR, outputs)
    return outputs


def chat_stream_reference(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``OpenAIServingChat._generate_chat_stream``: a streamed chat completion's references
    go out in one chunk after the choices' own, each choice's in its ``delta.hidden_states`` (where SGLang streams
    a choice's hidden states)."""
    from sglang.srt.entrypoints.openai.protocol import ChatCompletionResponseStreamChoice, ChatCompletionStreamResponse, DeltaMessage

    def chunk(outs: List[Dict[str, Any]], model: str) -> Any:
        choices = [ChatCompletionResponseStreamChoice(index=out.get("index", 0), finish_reason=None,
                                                      delta=DeltaMessage(hidden_states=out["meta_info"][protocol.RESPONSE_KEY]))
                   for out in outs]
        return ChatCompletionStreamResponse(id=outs[0]["meta_info"]["id"], created=int(time.time()), choices=choices,
                                            model=model)

    return _stream_with_references(wrapped(*args, **kwargs), args, kwargs, chunk)


def completion_stream_reference(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``OpenAIServingCompletion._generate_completion_stream``: a streamed completion's
    references go out in one chunk after the choices' own, in each choice's ``hidden_states``."""
    from sglang.srt.entrypoints.openai.protocol import CompletionResponseStreamChoice, CompletionStreamResponse

    def chunk(outs: List[Dict[str, Any]], model: str) -> Any:
        choices = [CompletionResponseStreamChoice(index=out.get("index", 0), text="", finish_reason=None,
                                                  hidden_states=out["meta_info"][protocol.RESPONSE_KEY])
                   for out in outs]
        return CompletionStreamResponse(id=outs[0]["meta_info"]["id"], created=int(time.time()), object="text_completion",
                                        choices=choices, model=model)

    return _stream_with_references(wrapped(*args, **kwargs), args, kwargs, chunk)


async def _stream_with_references(chunks: AsyncIterator[str], args: tuple, kwargs: dict, build: Any) -> AsyncIterator[str]:
    """SGLang's SSE chunks, with one more after the choices' own: every choice that carried a reference
    (the chunk's id is the first one's, as SGLang's chunks of a choice carry that choice's). It goes
    before the response-level chunks (no choices: the usage chunk, which OpenAI's clients expect
    last, and SGLang's sglext one), else before ``data: [DONE]``."""
    request = args[1] if len(args) > 1 else kwargs["request"]
    raw_request = args[2] if len(args) > 2 else kwargs.get("raw_request")
    sent = False
    try:
        async for sse in chunks:
            # after every choice's own chunks: before the response-level ones (usage, SGLang's sglext), or [DONE]
            if not sent and (sse.startswith(DONE) or RESPONSE_LEVEL in sse):
                outs = sorted(_stream_outputs(raw_request) or (), key=lambda o: o.get("index", 0))
                if outs:
                    sent = True
                    yield f"data: {build(outs, request.model).model_dump_json()}\n\n"
            yield sse
    finally:
        await chunks.aclose()


def openai_reference(config: CaptureConfig, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``process_hidden_states_from_ret`` (SGLang's OpenAI chat and completion responses):
    a captured choice's ``hidden_states`` is its capture reference, whether or not the request
    also set ``return_hidden_states``."""
    ret_item = args[0] if args else kwargs["ret_item"]
    ref = protocol.reference_in(ret_item.get("meta_info") if isinstance(ret_item, dict) else None)
    return ref if ref is not None else wrapped(*args, **kwargs)
