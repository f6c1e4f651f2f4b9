"""Which layers are captured, in the one convention this package uses everywhere.

Convention: layer id i is the residual stream *entering* decoder layer i, which is
transformers' ``output_hidden_states[i]`` (0 = the embeddings). It is exactly SGLang's
``layers_to_capture`` value. SGLang's own ``set_eagle3_layers_to_capture`` setters disagree
(Llama/Qwen add 1 to every id, DeepSeek adds 1 only when the first id is 1), so this package
never calls them with user ids; it writes ``layers_to_capture`` itself.
"""
from __future__ import annotations

from typing import List, Optional, Sequence

LAYER_CONVENTION = (
    "id i = residual stream entering decoder layer i = transformers output_hidden_states[i] "
    "(0 = embeddings); columns in ascending id order"
)

# Architectures whose SGLang model class supports aux hidden-state capture, by family.
_DEEPSEEK = {"DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"}
_LLAMA_LIKE = {"LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"}
SUPPORTED_ARCHITECTURES = tuple(sorted(_DEEPSEEK | _LLAMA_LIKE))


class LayerError(ValueError):
    """Layer ids that the model cannot capture; the message is one actionable line."""


def min_layer(architecture: str) -> int:
    """Llama-family models have no residual entering layer 0 (SGLang's capture would crash)."""
    return 0 if architecture in _DEEPSEEK else 1


def default_layers(num_layers: int, architecture: str) -> List[int]:
    """EAGLE-3's default aux layers (outputs of layers 2, L//2, L-3) in this package's convention.

    For a 61-layer DeepSeek-V3 / Kimi-K2.5 that is [3, 31, 59]. Shallow test models that cannot
    hold three distinct ids get the distinct ones that fit.
    """
    lo, hi = min_layer(architecture), num_layers - 1
    ids = [min(max(i, lo), hi) for i in (3, num_layers // 2 + 1, num_layers - 2)]
    return sorted(set(ids))


def resolve_layers(requested: Optional[Sequence[int]], num_layers: int, architecture: str) -> List[int]:
    """Validate user layer ids (or pick the default) for a model; raises LayerError."""
    if architecture not in SUPPORTED_ARCHITECTURES:
        raise LayerError(
            f"model architecture {architecture} has no aux hidden-state capture in SGLang; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    if requested is None:
        return default_layers(num_layers, architecture)
    lo, hi = min_layer(architecture), num_layers - 1
    bad = [i for i in requested if not lo <= i <= hi]
    if bad:
        raise LayerError(
            f"--capture-layers {','.join(map(str, bad))} out of range: {architecture} with {num_layers} layers "
            f"accepts ids {lo}..{hi} (id i = input of decoder layer i)"
        )
    return sorted(set(requested))


def eagle3_config_layer_ids(layers: Sequence[int], architecture: str) -> List[int]:
    """The ``eagle_aux_hidden_state_layer_ids`` a drafter config needs so that SGLang (0.5.17)
    serving it captures exactly ``layers`` (this package's convention).

    SGLang hands those ids to the target's ``set_eagle3_layers_to_capture``: Llama/Qwen store
    ``id + 1``; DeepSeek-V2/V3 and Kimi-K2.5 store the ids unchanged unless the first is 1, in
    which case they add 1 to all of them.
    """
    layers = sorted(layers)
    if architecture in _DEEPSEEK:
        if layers and layers[0] == 1:
            raise LayerError("SGLang's DeepSeek drafter setter cannot capture layer 1 first (ids starting at 1 "
                             "are shifted by one); capture with a first layer other than 1")
        return list(layers)
    return [i - 1 for i in layers]
