"""Tiny random-weight checkpoints (Llama, DeepSeek-V3) with an offline byte-level BPE tokenizer.

No hub access: the tokenizer is trained on a few bundled sentences, weights are seeded random.
The DeepSeek-V3 checkpoint is written by hand in the per-expert layout real DeepSeek-V3 /
Kimi-K2.5 checkpoints use, with their YaRN rope settings (SGLang's CPU rope needs them).
"""
from __future__ import annotations

import json
import os
from typing import Dict

import torch

VOCAB = 1024
_CORPUS = [
    "hello world, this is a tiny tokenizer for sglang cpu tests.",
    "The quick brown fox jumps over the lazy dog.",
    "Hidden states are captured from every decoder layer of the model.",
    "Kimi K2.5 uses the DeepSeek V3 architecture with MLA and MoE layers.",
    "user: assistant: system: 0123456789 !?.,;:'\"()[]{}<>+-*/=_ abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ",
] * 20
# ChatML-like, with transformers' {% generation %} markers around what an assistant turn adds,
# so tests can check extract's loss mask against transformers' own assistant mask.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>\n{% endgeneration %}"
    "{% else %}{{ m['content'] }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
BUILD_VERSION = 2  # bump when the models or tokenizer change, so cached copies are rebuilt


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|bos|>", "<|eos|>", "<|pad|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>",
                                   additional_special_tokens=["<|im_start|>", "<|im_end|>"])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def save_llama(path: str, tokenizer, layers: int = 4, hidden: int = 256) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_deepseek_v3(path: str, tokenizer, layers: int = 4, hidden: int = 256, experts: int = 8) -> str:
    """A DeepSeek-V3 (MLA + MoE, noaux_tc sigmoid router, one shared expert, first layer dense)."""
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    heads, q_lora, kv_lora, nope, rope, vdim, inter, moe_inter = 4, 64, 64, 32, 16, 32, 2 * hidden, hidden // 2
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_shared_experts": 1, "n_routed_experts": experts, "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 2.5, "kv_lora_rank": kv_lora, "q_lora_rank": q_lora, "qk_rope_head_dim": rope,
        "qk_nope_head_dim": nope, "v_head_dim": vdim, "first_k_dense_replace": 1, "norm_topk_prob": True,
        "topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1, "hidden_act": "silu",
        "rms_norm_eps": 1e-6, "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
        "num_nextn_predict_layers": 0, "ep_size": 1, "use_cache": True,
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id, "tie_word_embeddings": False,
        "rope_theta": 50000.0, "max_position_embeddings": 131072,
        "rope_scaling": {"type": "yarn", "factor": 32.0, "original_max_position_embeddings": 4096,
                         "beta_fast": 1.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0},
    }
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    gen = torch.Generator().manual_seed(0)

    def r(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    w: Dict[str, torch.Tensor] = {"model.embed_tokens.weight": r(VOCAB, hidden), "model.norm.weight": ones(hidden),
                                  "lm_head.weight": r(VOCAB, hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = ones(hidden)
        w[p + "post_attention_layernorm.weight"] = ones(hidden)
        a = p + "self_attn."
        w[a + "q_a_proj.weight"] = r(q_lora, hidden)
        w[a + "q_a_layernorm.weight"] = ones(q_lora)
        w[a + "q_b_proj.weight"] = r(heads * (nope + rope), q_lora)
        w[a + "kv_a_proj_with_mqa.weight"] = r(kv_lora + rope, hidden)
        w[a + "kv_a_layernorm.weight"] = ones(kv_lora)
        w[a + "kv_b_proj.weight"] = r(heads * (nope + vdim), kv_lora)
        w[a + "o_proj.weight"] = r(hidden, heads * vdim)
        m = p + "mlp."
        mlps = {"": inter} if i < config["first_k_dense_replace"] else {
            **{f"experts.{e}.": moe_inter for e in range(experts)}, "shared_experts.": moe_inter}
        for prefix, width in mlps.items():
            w[m + prefix + "gate_proj.weight"] = r(width, hidden)
            w[m + prefix + "up_proj.weight"] = r(width, hidden)
            w[m + prefix + "down_proj.weight"] = r(hidden, width)
        if i >= config["first_k_dense_replace"]:
            w[m + "gate.weight"] = r(experts, hidden)
            w[m + "gate.e_score_correction_bias"] = torch.zeros(experts, dtype=torch.float32)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}, f)
    tokenizer.save_pretrained(path)
    return path


def build_all(out_dir: str) -> Dict[str, str]:
    """Build (once) every tiny model under ``out_dir``; returns name -> path."""
    paths = {"tiny-llama": os.path.join(out_dir, "tiny-llama"), "tiny-dsv3": os.path.join(out_dir, "tiny-dsv3")}
    stamp = os.path.join(out_dir, "build.json")
    try:
        with open(stamp) as f:
            if json.load(f) == {"version": BUILD_VERSION}:
                return paths
    except (OSError, ValueError):
        pass
    tok = build_tokenizer()
    save_llama(paths["tiny-llama"], tok)
    save_deepseek_v3(paths["tiny-dsv3"], tok)
    with open(stamp, "w") as f:
        json.dump({"version": BUILD_VERSION}, f)
    return paths


if __name__ == "__main__":
    import sys

    print(build_all(sys.argv[1] if len(sys.argv) > 1 else "tiny-models"))
