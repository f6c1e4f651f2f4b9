"""Model seams: switch aux-layer capture on, and keep the final hidden states (post-norm, pre-norm) too."""
from __future__ import annotations

from typing import Any, Tuple

import torch

from sglang_capture.server.batch_rows import fail_batch_captures, gather_in_forward
from sglang_capture.server.peers import announce_and_check, needs_shared_dir
from sglang_capture.server.pre_norm import PreNormMissing
from sglang_capture.server.scheduler_capture import SchedulerCapture


def set_capture_layers(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Before ``ModelRunner.init_attention_backends``: weights are loaded, CUDA graphs not yet captured."""
    if instance.is_draft_worker:
        return wrapped(*args, **kwargs)
    # every rank, on every node, must run the patches (and DP groups on several nodes share one dir)
    announce_and_check(state.config.capture_dir, needs_shared_dir(instance.server_args))
    state.configure_model(instance)
    out = wrapped(*args, **kwargs)
    state.aux.check_served_layers()  # a server that speculates set its draft's layers in there
    return out


def _bind(hidden_states, hidden_states_before_norm, aux_hidden_states, pruned_states, pruned_states_before_norm,
          aux_pruned_states, sample_indices, logits_metadata):
    return hidden_states, hidden_states_before_norm, aux_hidden_states, logits_metadata


def append_final_hidden(state: SchedulerCapture, wrapped: Any, instance: Any, args: tuple, kwargs: dict) -> Any:
    """Around ``LogitsProcessor._get_hidden_states_to_store``: in full mode with aux capture, SGLang
    returns only the aux concat; append the final hidden states after it: the post-norm one, then
    with ``--capture-final pre-norm|both`` the pre-norm one (``ModelInfo.finals``).
    In an eager forward only the capture requests' rows are kept (batch_rows.gather_in_forward),
    except on a server that speculates: its draft reads every row (hooks/draft.py strips the final
    columns for it). (Also runs while CUDA graphs are captured: that path must stay a pure tensor op.)"""
    aux = wrapped(*args, **kwargs)  # the aux layers' columns, concatenated
    final, before_norm, aux_per_layer, meta = _bind(*args, **kwargs)
    if state.aux is not None and state.aux.speculative and instance is not state.aux.logits_processor:
        return aux  # the draft's own forward
    if aux is None or aux_per_layer is None or before_norm is not None or not meta.capture_hidden_mode.is_full():
        _forget_pre_norm(state)
        return aux
    if state.aux is not None and state.aux.speculative:
        rows = state.launching
        if (rows is None or not rows.captures) and not (final.is_cuda and torch.cuda.is_current_stream_capturing()):
            _forget_pre_norm(state)
            return aux  # an eager forward that captures nothing: the draft and SGLang's JSON read the aux as is
        return torch.cat([aux, *_finals(state, final, meta)], dim=-1)
    finals = _finals(state, final, meta)
    gathered = gather_in_forward(state.launching, aux, *finals)
    if gathered is not None:
        return gathered
    return torch.cat([aux, *finals], dim=-1)


def _finals(state: SchedulerCapture, final: torch.Tensor, meta: Any) -> Tuple[torch.Tensor, ...]:
    """The final states a row carries (``ModelInfo.finals``): post-norm, then pre-norm when kept.
    Without a pre-norm state for this forward its capture requests fail and the server goes on
    (while a CUDA graph is captured, the server stops instead)."""
    if state.pre_norm is None:
        return (final,)
    try:
        pre = state.pre_norm.take(final, idle=meta.forward_mode.is_idle())
    except PreNormMissing as e:
        if final.is_cuda and torch.cuda.is_current_stream_capturing():
            raise  # a graph would replay the NaN columns forever: refuse at start-up, loudly
        fail_batch_captures(state.launching, str(e))
        pre = torch.full_like(final, float("nan"))
    return final, pre


def _forget_pre_norm(state: SchedulerCapture) -> None:
    if state.pre_norm is not None:
        state.pre_norm.forget()
