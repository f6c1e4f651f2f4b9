"""Layer ids: defaults, checks, drafter config ids (core/layers.py)."""
from __future__ import annotations

import pytest

from sglang_capture.core.layers import LayerError, default_layers, resolve_layers


def test_kimi_default_layers_are_3_31_59():
    assert default_layers(61, "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert default_layers(61, "KimiK25ForConditionalGeneration") == [3, 31, 59]
    assert default_layers(32, "LlamaForCausalLM") == [3, 17, 30]


def test_layer_ids_are_checked_against_the_model():
    assert resolve_layers([59, 3, 31], 61, "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert resolve_layers([0], 4, "DeepseekV3ForCausalLM") == [0]
    with pytest.raises(LayerError, match="out of range.*0..3"):
        resolve_layers([4], 4, "DeepseekV3ForCausalLM")
    with pytest.raises(LayerError, match="accepts ids 1..3"):
        resolve_layers([0], 4, "LlamaForCausalLM")  # no residual enters Llama's layer 0
    with pytest.raises(LayerError, match="no aux hidden-state capture"):
        resolve_layers(None, 12, "GPT2LMHeadModel")


def test_drafter_config_layer_ids_follow_sglang_setters():
    from sglang_capture.core.layers import LayerError, eagle3_config_layer_ids

    assert eagle3_config_layer_ids([3, 31, 59], "KimiK25ForConditionalGeneration") == [3, 31, 59]
    assert eagle3_config_layer_ids([3, 31, 59], "DeepseekV3ForCausalLM") == [3, 31, 59]
    assert eagle3_config_layer_ids([3, 16, 30], "LlamaForCausalLM") == [2, 15, 29]
    # ids starting with 1 would be shifted by DeepSeek's setter: another layer goes first instead
    assert eagle3_config_layer_ids([1, 2, 3], "DeepseekV3ForCausalLM") == [2, 1, 3]
    with pytest.raises(LayerError, match="layer 1 alone"):
        eagle3_config_layer_ids([1], "DeepseekV3ForCausalLM")
    with pytest.raises(LayerError, match="cannot capture layer 0"):
        eagle3_config_layer_ids([0, 1, 2], "LlamaForCausalLM")
