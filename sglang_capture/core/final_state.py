"""The final hidden state a capture keeps: after the model's final norm, before it, or both.

SpecForge trains on the post-norm state (the input of the lm_head); vLLM's speculators trains on
the pre-norm one and applies the verifier's norm itself (``verifier_norm``). RMSNorm cannot be
undone without each row's scale, so which one a file holds is chosen at capture
(``--capture-final``) and recorded in the file's metadata under ``final``.
"""
from __future__ import annotations

from typing import Any, Dict, Iterable, Optional, Tuple

POST_NORM = "post-norm"
PRE_NORM = "pre-norm"
BOTH = "both"
FINAL_CHOICES = (POST_NORM, PRE_NORM, BOTH)
META_KEY = "final"
# the file's tensor for each state; the post-norm one keeps the name it always had
TENSOR = {POST_NORM: "last_hidden_states", PRE_NORM: "last_hidden_states_pre_norm"}


def kept_states(final: str) -> Tuple[str, ...]:
    """The final states a file captured with ``--capture-final final`` holds, in row order."""
    return (POST_NORM, PRE_NORM) if final == BOTH else (final,)


def carried_states(final: str) -> Tuple[str, ...]:
    """The final states a captured row carries on the device, in column order after the aux
    layers: always the post-norm one (SGLang's own ``return_hidden_states`` requests read it),
    then the pre-norm one when it is kept."""
    return (POST_NORM, PRE_NORM) if PRE_NORM in kept_states(final) else (POST_NORM,)


def file_final(meta: Dict[str, Any], tensors: Iterable[str]) -> Optional[str]:
    """Which final state a file holds (``FINAL_CHOICES``), None without one. Files written before
    ``--capture-final`` existed have no ``final`` key: theirs is post-norm when stored."""
    if META_KEY in meta:
        return meta[META_KEY]
    return POST_NORM if TENSOR[POST_NORM] in set(tensors) else None
