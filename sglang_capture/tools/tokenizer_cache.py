"""A tokenizer that starts in a second: what transformers made of a model's tokenizer, cached.

``extract`` spent 6-15 s importing transformers' ``AutoTokenizer`` before its first request
(bench/RESULTS.md, issue 35): on a 2,000-sample run that is most of the run. Loading the
tokenizer through transformers once, this module stores exactly what the package uses of it:
the backend tokenizer as transformers configured it (``backend_tokenizer.to_str()``, so any
change transformers makes at load time is kept), the resolved chat template and the special
tokens the template sees. Later runs rebuild it with the ``tokenizers`` library and render with
transformers' own ``render_jinja_template``: the same backend, the same template, the same
renderer and arguments, so the same ids and the same offsets, without the auto classes.

The cache key covers every small file of the tokenizer's directory (not the weights) and the
versions of transformers and tokenizers; anything else (a generation-marker template, a
tokenizer without a ``tokenizer.json``) is served by transformers itself, loaded on demand.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import tempfile
from importlib import metadata
from typing import Any, Callable, Dict, List, Optional

FORMAT = 1
_KEY_FILES = ("*.json", "*.jinja", "*.txt", "*.model")  # the tokenizer's own files; weights are not read
_MAX_KEY_FILE = 64 << 20  # a larger .json is not a tokenizer file (a weight index is small, shards are not json)


def cache_dir() -> str:
    """``$SGLANG_CAPTURE_CACHE``, else ``$XDG_CACHE_HOME/sglang_capture``, else ``~/.cache/sglang_capture``."""
    root = os.environ.get("SGLANG_CAPTURE_CACHE")
    if root:
        return os.path.join(root, "tokenizers")
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "sglang_capture", "tokenizers")


def cache_key(path: str) -> Optional[str]:
    """A digest of the tokenizer's files and the library versions; None where there is no local
    directory with a ``tokenizer.json`` (a hub name, a slow tokenizer)."""
    if not os.path.isfile(os.path.join(path, "tokenizer.json")):
        return None
    h = hashlib.sha256()
    for lib in ("transformers", "tokenizers"):
        try:
            h.update(f"{lib}={metadata.version(lib)}\n".encode())
        except metadata.PackageNotFoundError:
            return None
    names = sorted({os.path.basename(p) for pattern in _KEY_FILES for p in glob.glob(os.path.join(path, pattern))})
    for name in names:
        full = os.path.join(path, name)
        if os.path.getsize(full) > _MAX_KEY_FILE:
            continue
        h.update(f"{name}\n".encode())
        with open(full, "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def save(path: str, tokenizer: Any) -> None:
    """Store what ``CachedTokenizer`` needs of a transformers fast tokenizer; a cache that cannot
    be written (read-only home, full disk) only costs the next run its fast start."""
    key = cache_key(path)
    if key is None:
        return
    try:
        template = tokenizer.get_chat_template() if getattr(tokenizer, "chat_template", None) else None
        doc = {"format": FORMAT, "backend": tokenizer.backend_tokenizer.to_str(), "chat_template": template,
               "special_tokens_map": dict(tokenizer.special_tokens_map)}
        text = json.dumps(doc)
    except (AttributeError, TypeError, ValueError):  # not a fast tokenizer, or a map that is not JSON
        return
    directory = cache_dir()
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=".tmp-")
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
            os.replace(tmp, os.path.join(directory, key + ".json"))
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError:
        pass


def load(path: str, full: Callable[[], Any]) -> Optional["CachedTokenizer"]:
    """The cached tokenizer of ``path``, or None when there is none (or it cannot be read);
    ``full`` loads transformers' own, for what the cached one does not do."""
    key = cache_key(path)
    if key is None:
        return None
    try:
        with open(os.path.join(cache_dir(), key + ".json"), encoding="utf-8") as f:
            doc = json.load(f)
        if doc.get("format") != FORMAT:
            return None
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(doc["backend"])
    except Exception:  # noqa: BLE001 - a damaged or foreign entry: load the tokenizer anew
        return None
    return CachedTokenizer(backend, doc.get("chat_template"), doc.get("special_tokens_map") or {}, full)


class CachedTokenizer:
    """The parts of a transformers fast tokenizer that ``ChatEncoder`` uses, rebuilt from the
    cache: calling it, and ``apply_chat_template`` without tokenizing. The rest goes to
    transformers' own tokenizer (loaded the first time it is needed)."""

    is_fast = True

    def __init__(self, backend: Any, chat_template: Optional[str], special_tokens_map: Dict[str, Any],
                 full: Callable[[], Any]) -> None:
        self.backend_tokenizer = backend
        self.chat_template = chat_template
        self.special_tokens_map = special_tokens_map
        self._full_loader = full
        self._full: Any = None

    def full(self) -> Any:
        if self._full is None:
            self._full = self._full_loader()
        return self._full

    def __call__(self, text: str, add_special_tokens: bool = True,
                 return_offsets_mapping: bool = False) -> Dict[str, List[Any]]:
        enc = self.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens)
        out: Dict[str, List[Any]] = {"input_ids": list(enc.ids)}
        if return_offsets_mapping:
            out["offset_mapping"] = [tuple(o) for o in enc.offsets]
        return out

    def apply_chat_template(self, conversation: List[dict], tokenize: bool = True,
                            add_generation_prompt: bool = False, **kwargs: Any) -> Any:
        if tokenize or kwargs or self.chat_template is None:
            return self.full().apply_chat_template(conversation, tokenize=tokenize,
                                                   add_generation_prompt=add_generation_prompt, **kwargs)
        conversation[0]  # noqa: B018 - transformers indexes it too: an empty conversation fails alike
        from transformers.utils.chat_template_utils import render_jinja_template

        rendered, _ = render_jinja_template(conversations=[conversation], chat_template=self.chat_template,
                                            add_generation_prompt=add_generation_prompt, **self.special_tokens_map)
        return rendered[0]
