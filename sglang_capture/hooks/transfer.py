"""Result-copy seam: a capture batch's hidden states go to the package's host pool.

SGLang's ``copy_to_cpu`` would copy them into a fresh pinned buffer per batch (``host_pool``
says why that stalls the scheduler under capture). Here the hidden states are queued into a pool
block on the same stream instead, and SGLang copies the rest of the result (token ids,
logprobs) as usual. When the pool is full, or in a process without one, SGLang's copy runs.
"""
from __future__ import annotations

from typing import Any

from sglang_capture.sidecar import get_sidecar


def _bind(return_logprob: bool, return_hidden_states: bool = True) -> tuple:
    return return_logprob, return_hidden_states


def copy_hidden_to_pool(wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``GenerationBatchResult.copy_to_cpu`` (scheduler thread, on SGLang's copy stream)."""
    return_logprob, return_hidden = _bind(*args, **kwargs)
    out = instance.logits_output
    pool = get_sidecar().pool
    if not return_hidden or pool is None or out is None or out.hidden_states is None:
        return wrapped(*args, **kwargs)
    host = pool.take(out.hidden_states)
    if host is None:
        return wrapped(*args, **kwargs)
    out.hidden_states = host
    return wrapped(return_logprob, return_hidden_states=False)
