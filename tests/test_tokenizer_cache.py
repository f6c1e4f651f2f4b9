"""The cached tokenizer (tools/tokenizer_cache.py): the same ids and masks as transformers' own,
a fast start that does not import transformers' auto classes, and a key that follows the files."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from sglang_capture.testbed.real_model import RealModelError, cached_dir, materialize_smollm2
from sglang_capture.tools import tokenizer_cache
from sglang_capture.tools.conversations import read_samples
from sglang_capture.tools.templating import ChatEncoder, TemplateError, _load_with_transformers, load_tokenizer
from tests.test_extract_tools import make_conversations


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SGLANG_CAPTURE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "tokenizers"


@pytest.fixture(scope="module")
def tokenizer_dirs(tiny_models):
    dirs = dict(tiny_models)
    try:
        dirs["smollm2"] = materialize_smollm2(cached_dir())  # the real ChatML tokenizer of the drafter chain
    except RealModelError as e:
        pytest.fail(str(e))
    return dirs


def _encodings(encoder, samples):
    out = []
    for s in samples:
        try:
            e = encoder.encode(s)
            out.append((e.input_ids, e.loss_mask))
        except TemplateError as err:
            out.append(("error", str(err)))
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-dsv3", "tiny-kimi-k25", "smollm2"])
def test_cached_tokenizer_gives_transformers_ids_and_masks(name, tokenizer_dirs, cache, tmp_path):
    path = tokenizer_dirs[name]
    make_conversations(tmp_path / "c.jsonl", n=60, seed=3)
    samples = read_samples(str(tmp_path / "c.jsonl")).samples
    first = load_tokenizer(path)
    assert not isinstance(first, tokenizer_cache.CachedTokenizer) and len(os.listdir(cache)) == 1
    second = load_tokenizer(path)
    assert isinstance(second, tokenizer_cache.CachedTokenizer)
    want = _encodings(ChatEncoder(first, path), samples)
    got = _encodings(ChatEncoder(second, path), samples)
    assert got == want
    assert sum(1 for w in want if w[0] != "error") >= 50  # the comparison covered real encodings
    assert second._full is None  # none of it needed transformers' tokenizer


def test_a_changed_tokenizer_file_misses_the_cache_and_a_damaged_entry_is_reloaded(tokenizer_dirs, cache, tmp_path):
    import shutil

    path = str(tmp_path / "tok")
    shutil.copytree(tokenizer_dirs["smollm2"], path, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    load_tokenizer(path)
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    cfg = os.path.join(path, "tokenizer_config.json")
    doc = json.load(open(cfg))
    doc["model_max_length"] = 12345
    json.dump(doc, open(cfg, "w"))
    assert not isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)  # a new key: loaded anew
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    for entry in os.listdir(cache):
        (cache / entry).write_text("{not json")
    assert not isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)


def test_an_unwritable_cache_only_costs_the_fast_start(tokenizer_dirs, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SGLANG_CAPTURE_CACHE", str(blocked))  # a file where the cache dir would be
    tok = load_tokenizer(tokenizer_dirs["tiny-llama"])
    assert not isinstance(tok, tokenizer_cache.CachedTokenizer) and tok("hello world")["input_ids"]


def test_a_cached_start_imports_neither_transformers_auto_classes_nor_torch(tokenizer_dirs, cache, tmp_path):
    """What made extract slow to start: AutoTokenizer pulls in the auto model classes (and torch)."""
    path = tokenizer_dirs["smollm2"]
    load_tokenizer(path)
    make_conversations(tmp_path / "c.jsonl", n=5)
    code = ("import sys\n"
            "from sglang_capture.tools.conversations import read_samples\n"
            "from sglang_capture.tools.templating import ChatEncoder, load_tokenizer\n"
            f"enc = ChatEncoder(load_tokenizer({path!r}), {path!r})\n"
            f"[enc.encode(s) for s in read_samples({str(tmp_path / 'c.jsonl')!r}).samples]\n"
            "print(type(enc.tok).__name__, 'transformers.models.auto' in sys.modules, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "SGLANG_CAPTURE_CACHE": str(cache.parent)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["CachedTokenizer", "False", "False"]


def test_generation_marker_templates_go_to_transformers(tokenizer_dirs, cache):
    path = tokenizer_dirs["tiny-llama"]
    load_tokenizer(path)
    cached = load_tokenizer(path)
    full = _load_with_transformers(path)
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"}]
    assert cached.apply_chat_template(messages, tokenize=True) == full.apply_chat_template(messages, tokenize=True)
    assert cached._full is not None


def test_text_samples_keep_the_post_processors_special_tokens(tokenizer_dirs, cache, tmp_path):
    """A tokenizer whose post-processor adds a BOS (Llama 3's does): text samples get it, chat
    renderings (add_special_tokens=False) do not, as with transformers."""
    import shutil

    path = str(tmp_path / "bos")
    shutil.copytree(tokenizer_dirs["tiny-llama"], path, ignore=shutil.ignore_patterns("*.safetensors"))
    tj = os.path.join(path, "tokenizer.json")
    doc = json.load(open(tj))
    doc["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}}
    json.dump(doc, open(tj, "w"))
    full = load_tokenizer(path)
    cached = load_tokenizer(path)
    assert isinstance(cached, tokenizer_cache.CachedTokenizer)
    text = "hello world, the quick brown fox"
    assert cached(text)["input_ids"] == full(text)["input_ids"] and cached(text)["input_ids"][0] == 0
    plain_full = full(text, add_special_tokens=False, return_offsets_mapping=True)
    plain_cached = cached(text, add_special_tokens=False, return_offsets_mapping=True)
    assert plain_cached["input_ids"] == plain_full["input_ids"] and plain_cached["input_ids"][0] != 0
    assert [tuple(o) for o in plain_cached["offset_mapping"]] == [tuple(o) for o in plain_full["offset_mapping"]]
