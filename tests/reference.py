"""transformers as the reference: hidden states of the same weights for the same tokens."""
from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

import torch


@lru_cache(maxsize=4)
def _model(path: str, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()


def reference_states(path: str, dtype: torch.dtype, ids: List[int], layers: List[int]) -> Tuple[torch.Tensor, torch.Tensor]:
    """(aux [N, len(layers)*H], final post-norm [N, H]) for the token ids, as transformers computes them."""
    model = _model(path, dtype)
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    hs = out.hidden_states
    aux = torch.cat([hs[i][0] for i in layers], dim=-1)
    return aux, hs[-1][0]


def reference_pre_norm(path: str, dtype: torch.dtype, ids: List[int]) -> torch.Tensor:
    """The final hidden state before the model's final norm [N, H] (the norm's input), as transformers computes it."""
    model = _model(path, dtype)
    seen = []
    handle = model.model.norm.register_forward_pre_hook(lambda module, args: seen.append(args[0][0].clone()))
    try:
        with torch.no_grad():
            model(torch.tensor([ids]))
    finally:
        handle.remove()
    return seen[-1]


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


def min_row_cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1).min().item()


def min_block_cosines(stored_aux: torch.Tensor, aux: torch.Tensor, width: int) -> List[float]:
    """The lowest row cosine of each aux layer's block (``width`` columns each): an FP8 file scales
    every block on its own, so each is held to the bar, not only their concatenation."""
    return [min_row_cosine(stored_aux[:, k:k + width], aux[:, k:k + width]) for k in range(0, aux.shape[1], width)]
