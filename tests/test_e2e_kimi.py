"""Kimi-K2.5's own class on real SGLang (CPU): a tiny ``KimiK25ForConditionalGeneration``
checkpoint (MoonViT vision tower + DeepSeek-V3 language model, laid out like the real model,
processor as remote code) loads through the launcher and captures with the default layers."""
from __future__ import annotations

import json
import os

import pytest
import requests
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

import sglang_capture
from sglang_capture.core.layers import default_layers
from sglang_capture.testbed.server import capture_cmd
from sglang_capture.testbed.tiny_models import save_language_model_view
from tests.reference import max_abs_diff, reference_pre_norm, reference_states

ARCH = "KimiK25ForConditionalGeneration"


@pytest.fixture(scope="module")
def kimi(tiny_models, make_server, tmp_path_factory):
    capture_dir = str(tmp_path_factory.mktemp("capture"))
    cmd = capture_cmd(tiny_models["tiny-kimi-k25"], capture_dir, "--trust-remote-code", "--dtype", "float32",
                      "--capture-final", "pre-norm")
    return make_server(cmd, capture_dir)


@pytest.fixture(scope="module")
def language_model_view(tiny_models, tmp_path_factory) -> str:
    """The checkpoint's DeepSeek-V3 language model as a plain transformers checkpoint (the reference)."""
    return save_language_model_view(tiny_models["tiny-kimi-k25"], str(tmp_path_factory.mktemp("kimi-text")))


def test_checkpoint_is_laid_out_like_kimi_k25(tiny_models):
    path = tiny_models["tiny-kimi-k25"]
    cfg = json.load(open(os.path.join(path, "config.json")))
    assert cfg["architectures"] == [ARCH] and cfg["model_type"] == "kimi_k25"
    assert cfg["text_config"]["model_type"] == "deepseek_v3" and cfg["text_config"]["kv_lora_rank"] > 0
    names = load_file(os.path.join(path, "model.safetensors")).keys()
    assert any(n.startswith("vision_tower.encoder.blocks.0.wqkv") for n in names)
    assert any(n.startswith("mm_projector.proj.0") for n in names)
    assert any(n.startswith("language_model.model.layers.1.mlp.experts.") for n in names)


def test_kimi_class_captures_default_layers_equal_to_transformers(kimi, tiny_models, language_model_view):
    arch_layers = default_layers(8, ARCH)
    text = "Kimi K2.5 uses the DeepSeek V3 architecture with MLA and MoE layers."
    r = kimi.generate({"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True,
                                                        "custom_params": {"capture": True}}})
    assert r.status_code == 200, r.text
    ref = r.json()["meta_info"]["capture"]
    assert ref["status"] == "ok" and ref["layers"] == arch_layers == [3, 5, 6]
    data = sglang_capture.load(ref["path"])
    assert data["meta"]["architecture"] == ARCH and data["meta"]["model_class"] == ARCH and data["layers"] == arch_layers
    tok = AutoTokenizer.from_pretrained(tiny_models["tiny-kimi-k25"])
    assert data["input_ids"].tolist() == tok(text)["input_ids"]
    ids = data["input_ids"].tolist() + data["output_ids"].tolist()[:-1]
    aux, _ = reference_states(language_model_view, torch.float32, ids, arch_layers)
    pre = reference_pre_norm(language_model_view, torch.float32, ids)  # --capture-final pre-norm: the final norm's input
    assert data["final"] == "pre-norm" and "last_hidden_states" not in data
    assert data["aux_hidden_states"].shape == aux.shape and data["last_hidden_states_pre_norm"].shape == pre.shape
    assert max_abs_diff(data["aux_hidden_states"], aux) <= 1e-4
    assert max_abs_diff(data["last_hidden_states_pre_norm"], pre) <= 1e-4
    info = requests.get(kimi.url + "/capture_info", timeout=10).json()
    assert info["architecture"] == ARCH and info["layers"] == arch_layers and info["final"] == "pre-norm"
