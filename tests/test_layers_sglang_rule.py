"""The drafter-config rule of core/layers.py against SGLang's own ``set_eagle3_layers_to_capture``.

SGLang's real methods are called on bare instances of the real model classes (``object.__new__``
plus ``nn.Module.__init__``) carrying only what the method reads: ``pp_group.is_last_rank``,
``config.num_hidden_layers`` and a ``model`` whose ``layers_to_capture`` it writes (Kimi-K2.5:
a ``language_model`` that is such a DeepSeek-V3). No weights, no server.
"""
from __future__ import annotations

import json
import types
import warnings

import pytest

from sglang_capture.core.layers import (
    LayerError,
    default_layers,
    draft_capture_layers,
    eagle3_config_layer_ids,
    layers_from_eagle3_ids,
    read_draft_eagle3_ids,
    sglang_layers_to_capture,
)

ID_LISTS = [[1, 29, 57], [2, 15, 27], [0, 1, 2], [29, 1, 57], [3, 31, 59], [1, 2, 3], None]
ARCHS = ["LlamaForCausalLM", "Qwen3ForCausalLM", "DeepseekV3ForCausalLM", "KimiK25ForConditionalGeneration"]


@pytest.fixture(scope="module")
def sglang_setter():
    """``setter(architecture, num_layers, ids)`` -> the ``layers_to_capture`` SGLang's own method stores."""
    import torch

    with warnings.catch_warnings():  # importing SGLang's model modules on a CPU warns about kernels
        warnings.simplefilter("ignore")
        from sglang.srt.models.deepseek_v2 import DeepseekV3ForCausalLM
        from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
        from sglang.srt.models.llama import LlamaForCausalLM
        from sglang.srt.models.qwen3 import Qwen3ForCausalLM

    def bare(cls, num_layers):
        m = object.__new__(cls)
        torch.nn.Module.__init__(m)
        m.pp_group = types.SimpleNamespace(is_last_rank=True)
        m.config = types.SimpleNamespace(num_hidden_layers=num_layers)
        m.model = types.SimpleNamespace(layers_to_capture=[])
        return m

    classes = {"LlamaForCausalLM": LlamaForCausalLM, "Qwen3ForCausalLM": Qwen3ForCausalLM,
               "DeepseekV3ForCausalLM": DeepseekV3ForCausalLM}

    def setter(architecture, num_layers, ids):
        if architecture == "KimiK25ForConditionalGeneration":
            outer = object.__new__(KimiK25ForConditionalGeneration)
            torch.nn.Module.__init__(outer)
            outer.language_model = inner = bare(DeepseekV3ForCausalLM, num_layers)
        else:
            outer = inner = bare(classes[architecture], num_layers)
        outer.set_eagle3_layers_to_capture(None if ids is None else list(ids))
        assert inner.capture_aux_hidden_states is True
        return list(inner.model.layers_to_capture)

    return setter


@pytest.mark.parametrize("arch", ARCHS)
def test_ids_to_layers_equals_what_sglangs_own_setter_stores(sglang_setter, arch):
    lo = 1 if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else 0
    for num_layers in (61, 32):
        for ids in ID_LISTS:
            stored = sglang_setter(arch, num_layers, ids)
            assert sglang_layers_to_capture(ids, num_layers, arch) == stored, (ids, num_layers)
            # one captured row block per id, each a layer the decoder loop reaches (Llama: one with a residual)
            capturable = len(set(stored)) == len(stored) and all(lo <= i < num_layers for i in stored)
            if capturable:
                assert layers_from_eagle3_ids(ids, num_layers, arch) == sorted(stored), (ids, num_layers)
            else:
                with pytest.raises(LayerError):
                    layers_from_eagle3_ids(ids, num_layers, arch)


@pytest.mark.parametrize("arch", ARCHS)
def test_layers_to_ids_to_layers_round_trips_through_sglangs_setter(sglang_setter, arch):
    lo = 1 if arch in ("LlamaForCausalLM", "Qwen3ForCausalLM") else 0
    for layers in ([3, 31, 59], [2, 30, 58], [1, 30, 58], [1, 2, 3], [lo, 5, 60], [10, 20, 40], [1, 60]):
        ids = eagle3_config_layer_ids(layers, arch)
        assert sorted(sglang_setter(arch, 61, ids)) == sorted(layers), (layers, ids)
        assert layers_from_eagle3_ids(ids, 61, arch) == sorted(layers)


def test_published_kimi_draft_ids_capture_2_30_58_which_is_not_our_default_3_31_59():
    for arch in ("KimiK25ForConditionalGeneration", "DeepseekV3ForCausalLM"):
        assert layers_from_eagle3_ids([1, 29, 57], 61, arch) == [2, 30, 58]
        assert layers_from_eagle3_ids(None, 61, arch) == [2, 30, 58]  # SGLang's default without ids
        assert default_layers(61, arch) == [3, 31, 59]
        assert eagle3_config_layer_ids([3, 31, 59], arch) == [3, 31, 59]
    assert layers_from_eagle3_ids([1, 29, 57], 61, "LlamaForCausalLM") == [2, 30, 58]
    assert eagle3_config_layer_ids([3, 31, 59], "LlamaForCausalLM") == [2, 30, 58]


def test_layers_sglang_cannot_capture_for_a_drafter_are_refused_in_one_line():
    with pytest.raises(LayerError, match="cannot capture layer 0") as e:
        eagle3_config_layer_ids([0, 4, 8], "LlamaForCausalLM")
    assert "\n" not in str(e.value)
    with pytest.raises(LayerError, match="layer 1 alone"):
        eagle3_config_layer_ids([1], "DeepseekV3ForCausalLM")


def test_drafter_ids_outside_the_target_or_duplicated_are_refused_in_one_line():
    with pytest.raises(LayerError, match=r"capture layers \[2, 30, 60\].*only 1..59 exist") as e:
        layers_from_eagle3_ids([1, 29, 59], 60, "LlamaForCausalLM")  # layer 60 is never reached
    assert "\n" not in str(e.value)
    with pytest.raises(LayerError, match=r"capture layers \[0, 4, 8\].*only 1..60 exist"):
        layers_from_eagle3_ids([-1, 3, 7], 61, "LlamaForCausalLM")  # no residual enters Llama's layer 0
    with pytest.raises(LayerError, match="duplicate"):
        layers_from_eagle3_ids([5, 5, 9], 61, "DeepseekV3ForCausalLM")
    with pytest.raises(LayerError, match="no aux hidden-state capture"):
        layers_from_eagle3_ids([1, 2, 3], 12, "GPT2LMHeadModel")


def test_drafter_config_is_read_where_sglang_reads_it(tmp_path):
    def draft(doc, name="config.json"):
        p = tmp_path / name
        p.write_text(json.dumps(doc) if not isinstance(doc, str) else doc)
        return str(p)

    d = read_draft_eagle3_ids(draft({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 29, 57]}}))
    assert d.ids == [1, 29, 57] and d.use_aux_hidden_state
    assert read_draft_eagle3_ids(str(tmp_path)).ids == [1, 29, 57]  # the drafter's directory works too
    # SGLang (0.5.17) ignores a top-level key for the capture layers: absent -> its default
    top = {"architectures": ["LlamaForCausalLMEagle3"], "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    assert read_draft_eagle3_ids(draft(top, "top.json")).ids is None
    assert read_draft_eagle3_ids(draft({"eagle_config": {}}, "empty.json")).ids is None
    off = read_draft_eagle3_ids(draft({"eagle_config": {"use_aux_hidden_state": False}}, "off.json"))
    with pytest.raises(LayerError, match="use_aux_hidden_state false"):
        draft_capture_layers(off, 61, "DeepseekV3ForCausalLM")
    for doc, why in ((r"{not json", "not a readable JSON config"), ([1, 2], "not a JSON object"),
                     ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": "1,29,57"}}, "list of integers"),
                     ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": []}}, "non-empty list"),
                     ({"architectures": ["DeepseekV3ForCausalLM"], "num_hidden_layers": 61},
                      r"not an EAGLE-3 drafter config \(no eagle_config")):
        with pytest.raises(LayerError, match=why) as e:
            read_draft_eagle3_ids(draft(doc, "bad.json"))
        assert "\n" not in str(e.value)
    with pytest.raises(LayerError, match="does not exist; give the drafter's config.json"):
        read_draft_eagle3_ids(str(tmp_path / "nope.json"))
