"""Tiny random-weight checkpoints (Llama, DeepSeek-V3, Kimi-K2.5, an EAGLE-3 target and draft) with
an offline byte-level BPE tokenizer.

No hub access: the tokenizer is trained on a few bundled sentences, weights are seeded random.
The DeepSeek-V3 checkpoint is written by hand in the per-expert layout real DeepSeek-V3 /
Kimi-K2.5 checkpoints use, with their YaRN rope settings (SGLang's CPU rope needs them).
"""
from __future__ import annotations

import json
import os
from typing import Dict

import torch

from sglang_capture.testbed.once import build_once

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
BUILD_VERSION = 4  # bump when the models or tokenizer change, so cached copies are rebuilt


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


def save_llama(path: str, tokenizer, layers: int = 4, hidden: int = 256, out_scale: float = 1.0,
               random_final_norm: bool = False) -> str:
    """A random Llama. ``out_scale`` < 1 shrinks every layer's output projections (attention
    ``o_proj``, MLP ``down_proj``), so each layer adds little to the residual stream and the next
    token depends mostly on the current one (the EAGLE-3 test target, see ``save_eagle3_draft``).
    ``random_final_norm``: the final norm's weights drawn from [0.5, 1.5] instead of ones, so that
    normalizing a post-norm state again (what a trainer does that expects the pre-norm one) changes it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=max(4, hidden // 128), num_key_value_heads=max(2, hidden // 512), max_position_embeddings=4096,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(cfg)
    if out_scale != 1.0:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.mul_(out_scale)
                layer.mlp.down_proj.weight.mul_(out_scale)
    if random_final_norm:
        with torch.no_grad():
            model.model.norm.weight.copy_(0.5 + torch.rand(hidden, generator=torch.Generator().manual_seed(7)))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


# The EAGLE-3 test pair: a Llama whose layers add little (output projections x 0.03), so its
# greedy next token is nearly a function of the current token, and a one-layer draft for it.
EAGLE3_TARGET_OUT_SCALE = 0.03
EAGLE3_AUX_LAYER_IDS = (0, 1, 2)


def save_eagle3_draft(path: str, target_path: str, aux_layer_ids=EAGLE3_AUX_LAYER_IDS, seed: int = 1) -> str:
    """A one-layer EAGLE-3 draft (``LlamaForCausalLMEagle3``, SGLang's weight names) for the Llama
    at ``target_path``, built so that it guesses right often but not always.

    The draft sees, at position i, the target's residual stream after layers ``aux_layer_ids``
    (concatenated) and the embedding of token i+1, and must guess token i+2. Here ``fc`` keeps the
    last captured block (identity there, zeros elsewhere); the midlayer's ``o_proj`` and MLP
    ``down_proj`` are zero, so that block passes through to the draft's norm and ``lm_head``
    (copies of the target's). Its argmax j is then the target's own guess from that depth, about
    token i+1 when the target's remaining layers add little (``save_llama(out_scale=...)``).
    ``d2t`` (draft id -> target id, stored as the difference, as EAGLE-3 checkpoints do) maps j to
    the target's bigram successor B(j) = argmax lm_head(norm(embed(j))), about token i+2. Later draft
    steps feed the draft's own (unchanged) hidden state back, so they repeat that guess: the first
    draft token is mostly accepted, later ones mostly rejected unless the text repeats.
    """
    from safetensors.torch import load_file, save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(target_path, "config.json")) as f:
        target_cfg = json.load(f)
    tw = {k: v.float() for k, v in load_file(os.path.join(target_path, "model.safetensors")).items()}
    hidden, vocab, eps = target_cfg["hidden_size"], target_cfg["vocab_size"], target_cfg["rms_norm_eps"]
    heads, kv_heads = target_cfg["num_attention_heads"], target_cfg["num_key_value_heads"]
    head_dim, inter = target_cfg.get("head_dim") or hidden // heads, target_cfg["intermediate_size"]
    n_aux = len(aux_layer_ids)

    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w

    embed, head, norm = tw["model.embed_tokens.weight"], tw["lm_head.weight"], tw["model.norm.weight"]
    successor = (rms_norm(embed, norm) @ head.T).argmax(-1)  # B(j), the target's bigram guess
    gen = torch.Generator().manual_seed(seed)

    def r(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    bf = torch.bfloat16
    fc = torch.zeros(hidden, hidden * n_aux)
    fc[:, (n_aux - 1) * hidden:] = torch.eye(hidden)
    m = "midlayer."
    w = {
        "fc.weight": fc, "norm.weight": norm, "lm_head.weight": head,
        m + "input_layernorm.weight": torch.ones(hidden), m + "hidden_norm.weight": torch.ones(hidden),
        m + "post_attention_layernorm.weight": torch.ones(hidden),
        m + "self_attn.q_proj.weight": r(heads * head_dim, 2 * hidden),
        m + "self_attn.k_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.v_proj.weight": r(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.o_proj.weight": torch.zeros(hidden, heads * head_dim),
        m + "mlp.gate_proj.weight": r(inter, hidden), m + "mlp.up_proj.weight": r(inter, hidden),
        m + "mlp.down_proj.weight": torch.zeros(hidden, inter),
    }
    w = {k: v.to(bf).contiguous() for k, v in w.items()}
    w["d2t"] = (successor - torch.arange(vocab)).to(torch.int64)
    w["t2d"] = torch.ones(vocab, dtype=torch.bool)
    config = {k: v for k, v in target_cfg.items() if k not in ("transformers_version",)}
    config.update(
        architectures=["LlamaForCausalLMEagle3"], num_hidden_layers=1, draft_vocab_size=vocab,
        tie_word_embeddings=False, torch_dtype="bfloat16",
        eagle_config={"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids), "use_aux_hidden_state": True},
    )
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(w, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    return path


def build_eagle3_pair(out_dir: str) -> Dict[str, str]:
    """Build (once) the EAGLE-3 test target and its draft under ``out_dir``; returns
    {"tiny-llama-eagle3-target": path, "tiny-llama-eagle3-draft": path}."""
    def build(tmp: str) -> None:
        target = save_llama(os.path.join(tmp, "target"), build_tokenizer(), out_scale=EAGLE3_TARGET_OUT_SCALE)
        save_eagle3_draft(os.path.join(tmp, "draft"), target)

    build_once(out_dir, build, stamp=f"eagle3 pair v1 scale {EAGLE3_TARGET_OUT_SCALE} aux {EAGLE3_AUX_LAYER_IDS}")
    return {"tiny-llama-eagle3-target": os.path.join(out_dir, "target"),
            "tiny-llama-eagle3-draft": os.path.join(out_dir, "draft")}


# Shapes of the DeepSeek-V3 family. "cpu": everything shrunk (the CPU test bed's MLA path takes any
# head dims). "gpu": MLA head dims as in DeepSeek-V3 / Kimi-K2.5, which SGLang's GPU attention
# kernels require, the rest shrunk (4 heads, MoE of 8 experts of 256, top-2). "kimi": Kimi-K2.5's
# per-token compute (64 MLA heads, q_lora 1536, dense layer 0 of 18,432, routed experts of 2,048,
# top-8, one shared), for ``--load-format dummy`` servers: config only, no weights.
SHAPES = {
    "cpu": dict(heads=4, q_lora=64, kv_lora=64, nope=32, rope=16, vdim=32, inter=None, moe_inter=None, top_k=2),
    "gpu": dict(heads=4, q_lora=256, kv_lora=512, nope=128, rope=64, vdim=128, inter=1024, moe_inter=256, top_k=2),
    "kimi": dict(heads=64, q_lora=1536, kv_lora=512, nope=128, rope=64, vdim=128, inter=18432, moe_inter=2048, top_k=8),
}


def deepseek_v3_config(tokenizer, layers: int = 4, hidden: int = 256, experts: int = 8, shape: str = "cpu") -> Dict:
    """A DeepSeek-V3 config (MLA + MoE, noaux_tc sigmoid router, one shared expert, first layer dense)."""
    sh = SHAPES[shape]
    heads, q_lora, kv_lora, nope, rope, vdim = (sh[k] for k in ("heads", "q_lora", "kv_lora", "nope", "rope", "vdim"))
    inter, moe_inter = sh["inter"] or 2 * hidden, sh["moe_inter"] or hidden // 2
    config = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "torch_dtype": "bfloat16",
        "vocab_size": VOCAB, "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": heads,
        "n_shared_experts": 1, "n_routed_experts": experts, "num_experts_per_tok": sh["top_k"], "n_group": 1,
        "topk_group": 1,
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
    if shape == "gpu":  # "kimi" keeps YaRN, as Kimi-K2.5 has it (and SGLang's CPU rope needs it for a dry run)
        # Routing fixed per layer (see deepseek_v3_weights): in bf16 a random router's top-k flips
        # on 2-4% of rows between any two implementations (SGLang against transformers, TP2
        # against TP1), which hid real differences behind a 98% bar (bench/RESULTS.md, r36).
        config.update(rope_scaling=None, max_position_embeddings=4096, testbed_routing="fixed")
    return config


class _Random:
    """Seeded bf16 weights: small normal matrices, unit norms."""

    def __init__(self, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)

    def r(self, *shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=self.gen) * 0.02).to(torch.bfloat16)

    @staticmethod
    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    @staticmethod
    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=torch.bfloat16)


def deepseek_v3_weights(config: Dict, rnd: _Random, prefix: str = "") -> Dict[str, torch.Tensor]:
    """Weights of ``config`` in the per-expert layout of real DeepSeek-V3 checkpoints, names under ``prefix``."""
    hidden, layers, experts = config["hidden_size"], config["num_hidden_layers"], config["n_routed_experts"]
    heads, q_lora, kv_lora = config["num_attention_heads"], config["q_lora_rank"], config["kv_lora_rank"]
    nope, rope, vdim = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    inter, moe_inter = config["intermediate_size"], config["moe_intermediate_size"]
    r, ones = rnd.r, rnd.ones
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
        for name, width in mlps.items():
            w[m + name + "gate_proj.weight"] = r(width, hidden)
            w[m + name + "up_proj.weight"] = r(width, hidden)
            w[m + name + "down_proj.weight"] = r(hidden, width)
        if i >= config["first_k_dense_replace"]:
            w[m + "gate.weight"] = r(experts, hidden)
            # "fixed": the selection bias (added to the sigmoid scores, which lie in (0, 1), for the
            # choice only) is a permutation of 0..E-1 per layer, so every token picks the same experts
            # of that layer whatever the rounding; their weights still follow each token's scores.
            fixed = config.get("testbed_routing") == "fixed"
            w[m + "gate.e_score_correction_bias"] = (torch.randperm(experts, generator=rnd.gen).float() if fixed
                                                     else torch.zeros(experts, dtype=torch.float32))
    return {prefix + k: v for k, v in w.items()}


def _finish_checkpoint(path: str, config: Dict, weights: Dict[str, torch.Tensor], tokenizer) -> str:
    from safetensors.torch import save_file

    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    save_file(weights, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id}, f)
    tokenizer.save_pretrained(path)
    return path


def save_deepseek_v3(path: str, tokenizer, layers: int = 4, hidden: int = 256, experts: int = 8,
                     shape: str = "cpu") -> str:
    """A DeepSeek-V3 checkpoint (see ``deepseek_v3_config``); for shape "kimi" the config and
    tokenizer only, for servers started with ``--load-format dummy``."""
    os.makedirs(path, exist_ok=True)
    config = deepseek_v3_config(tokenizer, layers, hidden, experts, shape)
    if shape == "kimi":
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        tokenizer.save_pretrained(path)
        return path
    return _finish_checkpoint(path, config, deepseek_v3_weights(config, _Random(0)), tokenizer)


# Real Kimi-K2.5 checkpoints ship their processor as remote code (``--trust-remote-code``); SGLang's
# Kimi-K2.5 multimodal processor reads ``processor.media_processor.media_proc_cfg`` and the
# tokenizer from it. This stand-in has the same surface for text requests (no image pipeline).
KIMI_PROCESSOR_CODE = '''"""Text-only stand-in for Kimi-K2.5's remote-code processor (tiny test checkpoint)."""
import json
import os

from transformers import AutoTokenizer


class KimiK25MediaProcessor:
    def __init__(self, media_proc_cfg):
        self.media_proc_cfg = media_proc_cfg


class KimiK25Processor:
    @classmethod
    def register_for_auto_class(cls, auto_class="AutoProcessor"):
        pass

    def __init__(self, tokenizer, media_proc_cfg):
        self.tokenizer = tokenizer
        self.media_processor = KimiK25MediaProcessor(media_proc_cfg)
        self.image_processor = self.media_processor

    @classmethod
    def from_pretrained(cls, path, *args, **kwargs):
        with open(os.path.join(path, "preprocessor_config.json")) as f:
            cfg = json.load(f)["media_proc_cfg"]
        return cls(AutoTokenizer.from_pretrained(path), cfg)

    def __call__(self, *args, **kwargs):
        return self.tokenizer(*args, **kwargs)

    def __getattr__(self, name):
        if name in ("tokenizer", "media_processor", "image_processor"):
            raise AttributeError(name)
        return getattr(self.tokenizer, name)
'''


def save_kimi_k25(path: str, tokenizer, layers: int = 8, hidden: int = 256, experts: int = 8,
                  shape: str = "cpu") -> str:
    """A Kimi-K2.5 checkpoint (``KimiK25ForConditionalGeneration``): a MoonViT vision tower and
    patch-merger projector with small dims plus a DeepSeek-V3 language model, laid out like the
    real model (config ``text_config`` / ``vision_config``, weights ``language_model.*``,
    ``vision_tower.*`` with ``wqkv``/``wo``, ``mm_projector.proj.{0,2}``). The vision config
    carries both the real checkpoint's ``vt_*`` keys and the plain names SGLang's
    ``KimiK25VisionConfig`` reads, so SGLang builds the small tower. ``shape`` is the language
    model's (``SHAPES``; "gpu" for SGLang's GPU MLA kernels); "kimi" (no weights) is refused.
    """
    if shape not in ("cpu", "gpu"):
        raise ValueError(f"save_kimi_k25 builds weights; shape {shape!r} is config-only, use cpu or gpu")
    os.makedirs(path, exist_ok=True)
    text = deepseek_v3_config(tokenizer, layers, hidden, experts, shape)
    vh, vinter, vheads, vlayers, patch, pos = 64, 128, 2, 2, 14, 8
    vision = {
        "patch_size": patch, "init_pos_emb_height": pos, "init_pos_emb_width": pos, "init_pos_emb_time": 4,
        "pos_emb_type": "divided_fixed", "merge_kernel_size": [2, 2], "video_attn_type": "spatial_temporal",
        "merge_type": "sd2_tpool", "mm_projector_type": "patchmerger", "mm_hidden_size": vh,
        "projector_hidden_act": "gelu", "projector_ln_eps": 1e-5, "text_hidden_size": hidden,
        "vt_hidden_size": vh, "vt_intermediate_size": vinter, "vt_num_attention_heads": vheads,
        "vt_num_hidden_layers": vlayers,
        "hidden_size": vh, "intermediate_size": vinter, "num_attention_heads": vheads, "num_hidden_layers": vlayers,
    }
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25", "torch_dtype": "bfloat16",
        "text_config": text, "vision_config": vision, "ignore_index": -100,
        "media_placeholder_token_id": tokenizer.pad_token_id, "pad_token_id": tokenizer.pad_token_id,
        "use_unified_vision_chunk": False, "tie_word_embeddings": False,
        "auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
        "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
    }
    rnd = _Random(0)
    w = deepseek_v3_weights(text, rnd, prefix="language_model.")
    v = "vision_tower."
    w[v + "patch_embed.proj.weight"] = rnd.r(vh, 3, patch, patch)
    w[v + "patch_embed.proj.bias"] = rnd.zeros(vh)
    w[v + "patch_embed.pos_emb.weight"] = rnd.r(pos, pos, vh)
    for i in range(vlayers):
        b = f"{v}encoder.blocks.{i}."
        for norm in ("norm0", "norm1"):
            w[b + norm + ".weight"], w[b + norm + ".bias"] = rnd.ones(vh), rnd.zeros(vh)
        w[b + "wqkv.weight"], w[b + "wqkv.bias"] = rnd.r(3 * vh, vh), rnd.zeros(3 * vh)
        w[b + "wo.weight"], w[b + "wo.bias"] = rnd.r(vh, vh), rnd.zeros(vh)
        w[b + "mlp.fc0.weight"], w[b + "mlp.fc0.bias"] = rnd.r(vinter, vh), rnd.zeros(vinter)
        w[b + "mlp.fc1.weight"], w[b + "mlp.fc1.bias"] = rnd.r(vh, vinter), rnd.zeros(vh)
    w[v + "encoder.final_layernorm.weight"], w[v + "encoder.final_layernorm.bias"] = rnd.ones(vh), rnd.zeros(vh)
    merged = 4 * vh
    w["mm_projector.pre_norm.weight"], w["mm_projector.pre_norm.bias"] = rnd.ones(vh), rnd.zeros(vh)
    w["mm_projector.proj.0.weight"], w["mm_projector.proj.0.bias"] = rnd.r(merged, merged), rnd.zeros(merged)
    w["mm_projector.proj.2.weight"], w["mm_projector.proj.2.bias"] = rnd.r(hidden, merged), rnd.zeros(hidden)
    with open(os.path.join(path, "kimi_k25_processor.py"), "w") as f:
        f.write(KIMI_PROCESSOR_CODE)
    media = {"patch_size": patch, "merge_kernel_size": 2, "in_patch_limit": 1024, "patch_limit_on_one_side": 64,
             "image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5]}
    with open(os.path.join(path, "preprocessor_config.json"), "w") as f:
        json.dump({"auto_map": {"AutoProcessor": "kimi_k25_processor.KimiK25Processor"},
                   "processor_class": "KimiK25Processor", "media_proc_cfg": media}, f, indent=2)
    return _finish_checkpoint(path, config, w, tokenizer)


def save_language_model_view(kimi_path: str, out: str) -> str:
    """The DeepSeek-V3 language model inside a Kimi-K2.5 checkpoint as a plain transformers
    checkpoint at ``out``: transformers has no Kimi-K2.5 class, so this is the reference that
    Kimi rows are compared with."""
    from safetensors.torch import load_file, save_file

    os.makedirs(out, exist_ok=True)
    with open(os.path.join(kimi_path, "config.json")) as f:
        text_config = json.load(f)["text_config"]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(text_config, f)
    weights = load_file(os.path.join(kimi_path, "model.safetensors"))
    prefix = "language_model."
    save_file({k[len(prefix):]: v for k, v in weights.items() if k.startswith(prefix)},
              os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    return out


def build_all(out_dir: str) -> Dict[str, str]:
    """Build (once, safe when several processes ask at once) every tiny model under ``out_dir``;
    returns name -> path."""
    names = ("tiny-llama", "tiny-dsv3", "tiny-kimi-k25")

    def build(tmp: str) -> None:
        tok = build_tokenizer()
        save_llama(os.path.join(tmp, "tiny-llama"), tok, random_final_norm=True)
        save_deepseek_v3(os.path.join(tmp, "tiny-dsv3"), tok)
        save_kimi_k25(os.path.join(tmp, "tiny-kimi-k25"), tok)

    build_once(out_dir, build, stamp=f"tiny models v{BUILD_VERSION}")
    paths = {name: os.path.join(out_dir, name) for name in names}
    paths.update(build_eagle3_pair(os.path.join(out_dir, "tiny-llama-eagle3")))  # its own stamp: the others stay
    return paths


def main(argv=None) -> None:
    """``python -m sglang_capture.testbed.tiny_models OUT [--arch ...]``: the test suite's models
    (no --arch), or one model, as the GPU scripts in bench/ build theirs."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m sglang_capture.testbed.tiny_models")
    p.add_argument("out")
    p.add_argument("--arch", choices=("llama", "llama_eagle3", "deepseek_v3", "kimi_k25"), default=None,
                   help="one model at OUT instead of the suite's set under OUT (kimi_k25 also writes its "
                        "language model as a transformers checkpoint at OUT-text, the reference; llama_eagle3 "
                        "the EAGLE-3 test pair, OUT/target and OUT/draft, the draft reading layers 2, L/2, L-3)")
    p.add_argument("--shape", choices=tuple(SHAPES), default="gpu", help="DeepSeek-V3 shape (see SHAPES)")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--out-scale", type=float, default=EAGLE3_TARGET_OUT_SCALE,
                   help="llama_eagle3: the target's output projections' scale (deeper targets need less for the "
                        "draft to guess right: about 0.8 of first guesses at 24 x 2048 with 0.001)")
    a = p.parse_args(argv)
    if a.arch is None:
        print(build_all(a.out))
    elif a.arch == "llama":
        print(save_llama(a.out, build_tokenizer(), a.layers, a.hidden))
    elif a.arch == "llama_eagle3":
        target = save_llama(os.path.join(a.out, "target"), build_tokenizer(), a.layers, a.hidden,
                            out_scale=a.out_scale)
        ids = EAGLE3_AUX_LAYER_IDS if a.layers <= 4 else (2, a.layers // 2, a.layers - 3)
        print(target, save_eagle3_draft(os.path.join(a.out, "draft"), target, ids))
    elif a.arch == "kimi_k25":
        if a.shape == "kimi":
            p.error("--arch kimi_k25 builds weights: --shape cpu or gpu")
        print(save_kimi_k25(a.out, build_tokenizer(), a.layers, a.hidden, a.experts, a.shape))
        print(save_language_model_view(a.out, a.out.rstrip("/") + "-text"))
    else:
        print(save_deepseek_v3(a.out, build_tokenizer(), a.layers, a.hidden, a.experts, a.shape))


if __name__ == "__main__":
    main()
