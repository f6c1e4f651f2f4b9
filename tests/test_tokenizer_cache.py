"""The cached tokenizer (tools/tokenizer_cache.py): the same ids and masks as transformers' own,
a fast start that does not import transformers, and a key that follows the files."""
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


def _edit_json(directory, name, edit):
    doc = json.load(open(os.path.join(directory, name)))
    edit(doc)
    json.dump(doc, open(os.path.join(directory, name), "w"))


def _copy(src, dst, tokenizer_json=None, config=None):
    """A copy of a tokenizer directory (no weights), its tokenizer.json / tokenizer_config.json edited."""
    import shutil

    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", "*.gguf"))
    for name, edit in (("tokenizer.json", tokenizer_json), ("tokenizer_config.json", config)):
        if edit is not None:
            _edit_json(dst, name, edit)
    return str(dst)


TRICKY = [  # special-token strings inside content, non-ASCII, long enough to pass a saved truncation
    [{"role": "user", "content": "say <|im_end|> and <|im_start|> literally, then déjà vu — 東京 🙂"},
     {"role": "assistant", "content": "ok: <|im_end|> is the end marker; naïve café " * 3}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "the quick brown fox " * 20},
     {"role": "assistant", "content": "jumps over the lazy dog " * 20}],
]


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
    assert second.renders_here  # nor transformers' renderer


def test_a_changed_tokenizer_file_misses_the_cache_and_a_damaged_entry_is_reloaded(tokenizer_dirs, cache, tmp_path):
    path = _copy(tokenizer_dirs["smollm2"], tmp_path / "tok")
    load_tokenizer(path)
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    _edit_json(path, "tokenizer_config.json", lambda c: c.__setitem__("model_max_length", 12345))
    assert not isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)  # a new key: loaded anew
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    for entry in os.listdir(cache):
        (cache / entry).write_text("{not json")
    assert not isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)  # the damaged entry was rewritten


def test_an_unwritable_cache_only_costs_the_fast_start(tokenizer_dirs, tmp_path, monkeypatch):
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("SGLANG_CAPTURE_CACHE", str(blocked))  # a file where the cache dir would be
    tok = load_tokenizer(tokenizer_dirs["tiny-llama"])
    assert not isinstance(tok, tokenizer_cache.CachedTokenizer) and tok("hello world")["input_ids"]


def test_a_cached_start_imports_neither_transformers_nor_torch(tokenizer_dirs, cache, tmp_path):
    """What made extract slow to start: AutoTokenizer pulls in the auto model classes (and torch);
    then its first render imported transformers' renderer, and with it the package (r106: ~2 s while
    the other workers waited on the import lock)."""
    path = tokenizer_dirs["smollm2"]
    load_tokenizer(path)
    make_conversations(tmp_path / "c.jsonl", n=5)
    code = ("import sys\n"
            "from sglang_capture.tools.conversations import read_samples\n"
            "from sglang_capture.tools.templating import ChatEncoder, load_tokenizer\n"
            f"enc = ChatEncoder(load_tokenizer({path!r}), {path!r})\n"
            f"[enc.encode(s) for s in read_samples({str(tmp_path / 'c.jsonl')!r}).samples]\n"
            "print(type(enc.tok).__name__, 'transformers' in sys.modules, 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "SGLANG_CAPTURE_CACHE": str(cache.parent)}, timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["CachedTokenizer", "False", "False"]


def _with_template(tokenizer_dirs, tmp_path, template):
    path = _copy(tokenizer_dirs["smollm2"], tmp_path / "tok")
    with open(os.path.join(path, "chat_template.jinja"), "w") as f:
        f.write(template)
    return path


@pytest.mark.parametrize("template", [
    # reads the clock to the microsecond: its two renders of a probe differ
    "{{ strftime_now('%f') }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}",
    # refuses every probe alike: nothing rendered, so nothing compared
    "{% if messages[0]['role'] != 'narrator' %}{{ raise_exception('narrators only') }}{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
], ids=["clock", "refuses-every-probe"])
def test_a_template_the_probes_cannot_vouch_for_is_rendered_by_transformers(template, tokenizer_dirs, cache, tmp_path,
                                                                          monkeypatch):
    """The rebuilt environment is trusted only where it rendered at least one probe, and every probe
    as transformers did, when the entry was written; otherwise transformers renders."""
    from sglang_capture.tools import chat_render

    path = _with_template(tokenizer_dirs, tmp_path, template)
    load_tokenizer(path)
    cached = load_tokenizer(path)
    assert isinstance(cached, tokenizer_cache.CachedTokenizer) and not cached.renders_here
    monkeypatch.setattr(chat_render, "render", None)  # rendering here would fail
    conversation = [{"role": "narrator", "content": "hi"}]
    text = cached.apply_chat_template(conversation, tokenize=False)
    assert text in ("hi",) or (text.endswith("<narrator>hi") and text[:-12].isdigit())


def test_an_entry_written_by_another_renderer_version_is_written_anew(tokenizer_dirs, cache, monkeypatch):
    """A fix to the rebuilt renderer changes its VERSION: entries checked against the old one are not
    trusted, but loaded through transformers and checked again."""
    from sglang_capture.tools import chat_render

    path = tokenizer_dirs["smollm2"]
    load_tokenizer(path)
    assert isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    monkeypatch.setattr(chat_render, "VERSION", chat_render.VERSION + 1)
    assert not isinstance(load_tokenizer(path), tokenizer_cache.CachedTokenizer)
    again = load_tokenizer(path)
    assert isinstance(again, tokenizer_cache.CachedTokenizer) and again.renders_here


def test_an_environment_unlike_transformers_is_not_trusted_whatever_the_probes_render(monkeypatch):
    """A global transformers' environment has and this one lacks (as a later transformers might add),
    used only in a branch no probe reaches, is caught by comparing the environments themselves."""
    from sglang_capture.tools import chat_render

    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    assert chat_render.agrees_with_transformers(template, {})
    compile_here = chat_render.compile_template

    def lacking(source):
        t = compile_here(source)
        t.environment.globals.pop("strftime_now")
        return t

    monkeypatch.setattr(chat_render, "compile_template", lacking)
    assert not chat_render.agrees_with_transformers(template, {})


def test_the_rebuilt_environment_matches_transformers_filters_globals_and_refusals(tokenizer_dirs, cache, tmp_path):
    """tojson without HTML escaping and with its options, raise_exception, loop controls, whitespace
    control, {% generation %} and a template's refusal of a conversation: rendered here, alike."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools: ' + m['content']) }}"
                "{% endif %}{% if loop.index > 3 %}{% break %}{% endif %}\n  {{ m | tojson(indent=1, sort_keys=true) }}"
                "{% if m['role'] == 'assistant' %}{% generation %}[{{ m['content'] }}]{% endgeneration %}{% endif %}"
                "{% endfor %}{% if add_generation_prompt %}{{ eos_token }}{{ strftime_now('%Y') }}{% endif %}")
    path = _with_template(tokenizer_dirs, tmp_path, template)
    load_tokenizer(path)
    cached = load_tokenizer(path)
    assert cached.renders_here
    for conversation in [TRICKY[0] + TRICKY[1], [{"role": "user", "content": "<a href='x'>&</a>"}]]:
        for prompt in (False, True):
            want = render_jinja_template(conversations=[conversation], chat_template=template,
                                         add_generation_prompt=prompt, **cached.special_tokens_map)[0][0]
            assert cached.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt) == want
    assert "<a href='x'>&</a>" in want and "<|im_end|>" in want
    with pytest.raises(Exception, match="no tools: t"):
        cached.apply_chat_template([{"role": "tool", "content": "t"}], tokenize=False)
    encoder = ChatEncoder(cached, path)
    from sglang_capture.tools.conversations import Sample

    with pytest.raises(TemplateError, match="the chat template failed on this conversation: no tools: t"):
        encoder.encode(Sample(id="s", line=1, messages=[{"role": "tool", "content": "t"}], text=None))


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
    bos = {"type": "TemplateProcessing",
           "single": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
           "pair": [{"SpecialToken": {"id": "<|bos|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                    {"Sequence": {"id": "B", "type_id": 1}}],
           "special_tokens": {"<|bos|>": {"id": "<|bos|>", "ids": [0], "tokens": ["<|bos|>"]}}}
    path = _copy(tokenizer_dirs["tiny-llama"], tmp_path / "bos", tokenizer_json=lambda d: d.__setitem__("post_processor", bos))
    full = load_tokenizer(path)
    cached = load_tokenizer(path)
    assert isinstance(cached, tokenizer_cache.CachedTokenizer)
    text = "hello world, the quick brown fox"
    assert cached(text)["input_ids"] == full(text)["input_ids"] and cached(text)["input_ids"][0] == 0
    plain_full = full(text, add_special_tokens=False, return_offsets_mapping=True)
    plain_cached = cached(text, add_special_tokens=False, return_offsets_mapping=True)
    assert plain_cached["input_ids"] == plain_full["input_ids"] and plain_cached["input_ids"][0] != 0
    assert [tuple(o) for o in plain_cached["offset_mapping"]] == [tuple(o) for o in plain_full["offset_mapping"]]


@pytest.mark.parametrize("variant", ["plain", "truncation", "padding", "split_special_tokens"])
def test_settings_transformers_applies_per_call_are_applied_alike(variant, tokenizer_dirs, cache, tmp_path):
    """A tokenizer.json that saved truncation or padding (transformers turns both off on each call),
    and split_special_tokens (transformers sets the backend's flag on each call)."""
    from sglang_capture.tools.conversations import Sample

    edits = {"plain": (None, None),
             "truncation": (lambda d: d.__setitem__("truncation", {"direction": "Right", "max_length": 16,
                                                                   "strategy": "LongestFirst", "stride": 0}), None),
             "padding": (lambda d: d.__setitem__("padding", {"strategy": "BatchLongest", "direction": "Right",
                                                             "pad_to_multiple_of": 8, "pad_id": 2, "pad_type_id": 0,
                                                             "pad_token": "<|im_end|>"}), None),
             "split_special_tokens": (None, lambda c: c.__setitem__("split_special_tokens", True))}[variant]
    path = _copy(tokenizer_dirs["smollm2"], tmp_path / "tok", *edits)
    full = load_tokenizer(path)
    cached = load_tokenizer(path)
    assert isinstance(cached, tokenizer_cache.CachedTokenizer)
    samples = [Sample(id=f"t{i}", line=i, messages=m, text=None) for i, m in enumerate(TRICKY)]
    samples.append(Sample(id="text", line=9, messages=None, text="plain <|im_end|> text, déjà vu " * 8))
    want = _encodings(ChatEncoder(full, path), samples)
    assert _encodings(ChatEncoder(cached, path), samples) == want
    assert all(w[0] != "error" and len(w[0]) > 16 for w in want)


def test_the_key_covers_additional_templates_and_configs_naming_files_elsewhere_are_not_cached(
        tokenizer_dirs, cache, tmp_path):
    path = _copy(tokenizer_dirs["smollm2"], tmp_path / "tok")
    os.makedirs(os.path.join(path, "additional_chat_templates"))
    extra = os.path.join(path, "additional_chat_templates", "tools.jinja")
    open(extra, "w").write("{{ messages[0]['content'] }}")
    key = tokenizer_cache.cache_key(path)
    open(extra, "w").write("v2 {{ messages[0]['content'] }}")
    assert tokenizer_cache.cache_key(path) != key
    elsewhere = _copy(tokenizer_dirs["smollm2"], tmp_path / "elsewhere",
                      config=lambda c: c.__setitem__("tokenizer_file", os.path.join(path, "tokenizer.json")))
    assert tokenizer_cache.cache_key(elsewhere) is None
    load_tokenizer(elsewhere)
    assert not isinstance(load_tokenizer(elsewhere), tokenizer_cache.CachedTokenizer)


def test_a_class_with_its_own_encoding_is_never_cached(tokenizer_dirs, cache, tmp_path):
    """CodeLlama's infilling and mBART's language modes live in their classes' own methods, which a
    rebuilt backend would skip: such classes always load through transformers."""
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    path = tokenizer_dirs["smollm2"]
    tok = _load_with_transformers(path)
    assert type(tok) is TokenizersBackend and tokenizer_cache._plain_backend(tok)
    infilling = type("Infilling", (TokenizersBackend,),
                     {"_encode_plus": lambda self, *a, **k: TokenizersBackend._encode_plus(self, *a, **k)})
    modes = type("Modes", (TokenizersBackend,), {"_switch_to_input_mode": lambda self: None})
    defaults = type("Defaults", (TokenizersBackend,), {"padding_side": "left"})  # no method changed: cached
    assert not tokenizer_cache._plain_backend(object.__new__(infilling))
    assert not tokenizer_cache._plain_backend(object.__new__(modes))
    assert tokenizer_cache._plain_backend(object.__new__(defaults))
    tok.__class__ = infilling
    tokenizer_cache.save(tokenizer_cache.cache_key(path), tok)
    assert not cache.exists() or not os.listdir(cache)


def test_the_token_mask_by_bisection_is_the_token_by_token_overlap():
    """``token_mask`` finds each span's run of tokens by bisection over forward-running offsets; it must
    give what checking every token against every span gives, zero-length tokens (special tokens at a
    span's edge or inside it) and offsets out of order included."""
    import random

    from sglang_capture.tools.templating import token_mask

    def brute(offsets, spans):
        return [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]

    rng = random.Random(7)
    for trial in range(2000):
        offsets, pos = [], 0
        for _ in range(rng.randrange(0, 40)):
            width = rng.choice([0, 0, 1, 2, 3, 5])
            offsets.append((pos, pos + width))
            pos += width + rng.choice([0, 0, 0, 1])  # gaps: characters no token covers (stripped spaces)
        if trial % 5 == 0 and len(offsets) > 2:  # out of order: the token-by-token path
            i = rng.randrange(len(offsets) - 1)
            offsets[i], offsets[i + 1] = offsets[i + 1], offsets[i]
        spans, at = [], 0
        if trial % 7 == 0 and offsets:  # a token inside the one before it: starts forward, ends not
            offsets.insert(1, (offsets[0][0], offsets[0][0]))
            offsets[0] = (offsets[0][0], offsets[0][1] + 2)
        while at < pos and len(spans) < 4:
            a = rng.randrange(at, pos + 1)
            b = rng.randrange(a, pos + 2)
            spans.append((a, b))
            at = b + 1
        assert token_mask(offsets, spans) == brute(offsets, spans), (offsets, spans)
