"""A tokenizer that starts in a second: what transformers made of a model's tokenizer, cached.

``extract`` spent 6-15 s importing transformers' ``AutoTokenizer`` before its first request
(bench/RESULTS.md, issue 35): on a 2,000-sample run that is most of the run. Loading the
tokenizer through transformers once, this module stores exactly what the package uses of it:
the backend tokenizer as transformers configured it (``backend_tokenizer.to_str()``, so any
change transformers makes at load time is kept), the resolved chat template and the special
tokens the template sees. Later runs rebuild it with the ``tokenizers`` library and render in
transformers' template environment rebuilt (chat_render.py), which the cache trusts only where it
rendered exactly as transformers did when the entry was written: the same backend, the same
template, the same arguments, so the same ids and the same offsets, without importing transformers.

What transformers does on each call is redone here: it encodes with truncation and padding off
(it turns off whatever ``tokenizer.json`` saved) and sets the backend's ``encode_special_tokens``
from ``split_special_tokens``. Only the base ``TokenizersBackend`` class, or a subclass that
changes none of its encoding and templating methods, is cached: a class with its own encoding
(CodeLlama's infilling, mBART's language modes) is always loaded through transformers.

The cache key covers the tokenizer's files (every ``.json``, ``.jinja``, ``.txt``, ``.model`` and
``.tiktoken`` file of the directory and its ``additional_chat_templates/``, not the weights) and the
versions of transformers and tokenizers, and is taken before transformers reads the directory. A
``tokenizer_config.json`` that points at files elsewhere (``tokenizer_file``, ``vocab_file``,
``merges_file``) is not cached. Anything else (a generation-marker template, a tokenizer without a
``tokenizer.json``) is served by transformers itself, loaded on demand.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import threading
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional

from sglang_capture.core.durable import replace_atomic

FORMAT = 3
_KEY_FILES = ("*.json", "*.jinja", "*.txt", "*.model", "*.tiktoken")  # the tokenizer's own files, not the weights
_KEY_DIRS = ("", "additional_chat_templates")
_ELSEWHERE = ("tokenizer_file", "vocab_file", "merges_file")  # tokenizer_config keys naming files to read instead
# What TokenizersBackend does when encoding and templating: a subclass that changes any of it is not cached.
_METHODS = ("__call__", "_call_one", "encode", "_encode_plus", "_batch_encode_plus", "set_truncation_and_padding",
            "apply_chat_template", "get_chat_template", "_switch_to_input_mode", "_switch_to_target_mode")


def cache_dir() -> str:
    """``$SGLANG_CAPTURE_CACHE``, else ``$XDG_CACHE_HOME/sglang_capture``, else ``~/.cache/sglang_capture``."""
    root = os.environ.get("SGLANG_CAPTURE_CACHE")
    if root:
        return os.path.join(root, "tokenizers")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang_capture", "tokenizers")


def cache_key(path: str) -> Optional[str]:
    """A digest of the tokenizer's files and the library versions; None where there is no local
    directory with a ``tokenizer.json`` (a hub name, a slow tokenizer), where its config names files
    elsewhere, or where a file cannot be read (transformers then says what is wrong)."""
    try:
        if not os.path.isfile(os.path.join(path, "tokenizer.json")):
            return None
        config = os.path.join(path, "tokenizer_config.json")
        if os.path.isfile(config):
            with open(config, encoding="utf-8") as f:
                doc = json.load(f)
            if any(doc.get(k) for k in _ELSEWHERE):
                return None
        h = hashlib.sha256()
        for lib in ("transformers", "tokenizers"):
            h.update(f"{lib}={metadata.version(lib)}\n".encode())
        names = sorted({os.path.relpath(p, path) for sub in _KEY_DIRS for pattern in _KEY_FILES
                        for p in glob.glob(os.path.join(path, sub, pattern))})
        for name in names:
            h.update(f"{name}\n".encode())
            with open(os.path.join(path, name), "rb") as f:
                h.update(hashlib.sha256(f.read()).digest())
        return h.hexdigest()
    except (OSError, ValueError, metadata.PackageNotFoundError):
        return None


def _plain_backend(tokenizer: Any) -> bool:
    try:
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        return False
    cls = type(tokenizer)
    return issubclass(cls, TokenizersBackend) and all(
        getattr(cls, m, None) is getattr(TokenizersBackend, m, None) for m in _METHODS)


def save(key: Optional[str], tokenizer: Any) -> None:
    """Store what ``CachedTokenizer`` needs of a transformers fast tokenizer under ``key`` (taken
    before it was loaded); a cache that cannot be written (read-only home, full disk) only costs
    the next run its fast start."""
    if key is None or not _plain_backend(tokenizer):
        return
    try:
        from sglang_capture.tools import chat_render

        template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
        special_tokens = dict(tokenizer.special_tokens_map)
        doc = {"format": FORMAT, "backend": tokenizer.backend_tokenizer.to_str(), "chat_template": template,
               "special_tokens_map": special_tokens,
               "split_special_tokens": bool(getattr(tokenizer, "split_special_tokens", False)),
               "renderer": chat_render.VERSION,
               "renders_here": template is not None and chat_render.agrees_with_transformers(template, special_tokens)}
        text = json.dumps(doc)
    except Exception:  # noqa: BLE001 - a component tokenizers cannot serialize, a map that is not JSON: not cached
        return
    directory = cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
        # readers see the old entry or the new one; a crash mid-write only costs a reload
        replace_atomic(os.path.join(directory, key + ".json"), lambda f: f.write(text.encode("utf-8")), sync=False)
    except OSError:
        pass


def load(key: Optional[str], full: Callable[[], Any]) -> Optional["CachedTokenizer"]:
    """The cached tokenizer under ``key``, or None when there is none (or it cannot be read);
    ``full`` loads transformers' own, for what the cached one does not do."""
    if key is None:
        return None
    try:
        with open(os.path.join(cache_dir(), key + ".json"), encoding="utf-8") as f:
            doc = json.load(f)
        from sglang_capture.tools import chat_render

        if doc.get("format") != FORMAT or doc.get("renderer") != chat_render.VERSION:  # written by another version: anew
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(doc["backend"])
        backend.no_truncation()  # transformers turns off what tokenizer.json saved, on every call
        backend.no_padding()
        backend.encode_special_tokens = bool(doc["split_special_tokens"])
        return CachedTokenizer(backend, doc.get("chat_template"), doc.get("special_tokens_map") or {}, full,
                               renders_here=bool(doc.get("renders_here")))
    except Exception:  # noqa: BLE001 - a damaged or foreign entry: load the tokenizer anew
        return None


class CachedTokenizer:
    """The parts of a transformers fast tokenizer that ``ChatEncoder`` uses, rebuilt from the
    cache: calling it, and ``apply_chat_template`` without tokenizing. The rest goes to
    transformers' own tokenizer (loaded the first time it is needed). ``renders_here``: the
    template renders in chat_render's environment (it agreed with transformers' on the probes),
    else in transformers' own."""

    is_fast = True

    def __init__(self, backend: Any, chat_template: Optional[str], special_tokens_map: Dict[str, Any],
                 full: Callable[[], Any], renders_here: bool = False) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens_map
        self.renders_here = renders_here and chat_template is not None
        self._full_loader = full
        self._full: Any = None
        self._full_lock = threading.Lock()  # extract's worker threads: one load, not one each
        self._compiled: Any = None
        self._compile_lock = threading.Lock()

    def full(self) -> Any:
        with self._full_lock:
            if self._full is None:
                self._full = self._full_loader()
            return self._full

    def get_chat_template(self) -> str:
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat template")
        return self.chat_template

    def __call__(self, text: str, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> Dict[str, List[Any]]:
        enc = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: Dict[str, List[Any]] = {"input_ids": list(enc.ids)}
        if return_offsets_mapping:
            out["offset_mapping"] = enc.offsets  # (start, end) tuples already, as transformers gives them
        return out

    def apply_chat_template(self, conversation: List[dict], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        if tokenize or kwargs or self.chat_template is None:
            return self.full().apply_chat_template(conversation, tokenize=tokenize,
                                                   add_generation_prompt=add_generation_prompt, **kwargs)
        conversation[0]  # noqa: B018 - transformers indexes it too: an empty conversation fails alike
        if self.renders_here:
            from sglang_capture.tools import chat_render

            if self._compiled is None:
                with self._compile_lock:
                    if self._compiled is None:
                        self._compiled = chat_render.compile_template(self.chat_template)
            return chat_render.render(self._compiled, conversation, add_generation_prompt, self.special_tokens_map)
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[conversation], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return rendered[0]
