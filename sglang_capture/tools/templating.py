"""From a sample to what the server is sent: chat-templated token ids and the loss mask.

The model's own chat template renders the conversation; the tokens trained on are exactly the
assistant turns: for each assistant message, the text the template adds after the generation
prompt (its content and its end-of-turn marker). Spans are found by rendering growing prefixes
of the conversation, then mapped to tokens through the fast tokenizer's character offsets, so
no template-specific parsing is needed. Templates that rewrite earlier turns (not
prefix-stable) fall back to the template's own ``{% generation %}`` markers, or are refused.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from sglang_capture.tools import tokenizer_cache
from sglang_capture.tools.conversations import Sample


class TemplateError(ValueError):
    """The tokenizer cannot turn this sample into ids and a mask; one actionable line."""


@dataclass(frozen=True)
class Encoded:
    input_ids: List[int]
    loss_mask: List[int]


def load_tokenizer(path: str) -> Any:
    """The model's tokenizer (must be a fast one: the mask needs character offsets). After the
    first load of a local tokenizer, from the package's cache in about a second
    (tokenizer_cache.py says why and what makes it exact)."""
    key = tokenizer_cache.cache_key(path)  # before transformers reads the files, so an entry never outdates them
    cached = tokenizer_cache.load(key, lambda: _load_with_transformers(path))
    if cached is not None:
        return cached
    tok = _load_with_transformers(path)
    tokenizer_cache.save(key, tok)
    return tok


def _load_with_transformers(path: str) -> Any:
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except Exception as e:  # transformers raises OSError, ValueError, ... for a bad path
        raise TemplateError(f"cannot load a tokenizer from {path!r}: {str(e).splitlines()[0]}") from None
    if not getattr(tok, "is_fast", False):
        raise TemplateError(f"the tokenizer at {path!r} is not a fast tokenizer; the loss mask needs character offsets")
    return tok


def token_mask(offsets: Sequence[Tuple[int, int]], spans: Sequence[Tuple[int, int]]) -> List[int]:
    """1 for each token whose characters ``[s, e)`` overlap a span ``[a, b)`` (``s < b and e > a``),
    else 0. A fast tokenizer's offsets for one text run forward, so each span's tokens are one run,
    found by bisection (extract's client renders and masks every sample on one GIL: checking each
    token against each span was a third of its time per sample); offsets in any other order are
    checked token by token."""
    if not offsets:
        return []
    starts, ends = (list(x) for x in zip(*offsets))
    if starts != sorted(starts) or ends != sorted(ends):
        return [int(any(s < b and e > a for a, b in spans)) for s, e in offsets]
    mask = [0] * len(offsets)
    for a, b in spans:
        lo, hi = bisect.bisect_right(ends, a), bisect.bisect_left(starts, b)
        if lo < hi:
            mask[lo:hi] = [1] * (hi - lo)
    return mask


class ChatEncoder:
    """Encodes samples with one tokenizer's chat template."""

    def __init__(self, tokenizer: Any, source: str) -> None:
        self.tok = tokenizer
        self.source = source

    def _render(self, messages: List[dict], add_generation_prompt: bool) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def _assistant_spans(self, messages: List[dict], text: str) -> List[Tuple[int, int]]:
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            head = self._render(messages[:k], True)
            upto = self._render(messages[:k + 1], False)
            if not (text.startswith(head) and text.startswith(upto) and len(upto) > len(head)):
                raise _NotPrefixStable
            spans.append((len(head), len(upto)))
        return spans

    def encode(self, sample: Sample) -> Encoded:
        """Ids and 0/1 loss mask for one sample; raises TemplateError."""
        if sample.text is not None:
            ids = self.tok(sample.text)["input_ids"]
            return Encoded(ids, [1] * len(ids))
        if not getattr(self.tok, "chat_template", None):
            raise TemplateError(f"the tokenizer at {self.source!r} has no chat template; pass --tokenizer with one, "
                                "or give samples as {\"text\": ...}")
        try:
            text = self._render(sample.messages, False)
            try:
                spans = self._assistant_spans(sample.messages, text)
            except _NotPrefixStable:
                return self._encode_with_generation_markers(sample.messages)
        except TemplateError:
            raise
        except Exception as e:  # jinja2 errors from the template itself (e.g. raise_exception)
            raise TemplateError(f"the chat template failed on this conversation: {str(e).splitlines()[0]}") from None
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        return Encoded(list(enc["input_ids"]), token_mask(enc["offset_mapping"], spans))

    def _encode_with_generation_markers(self, messages: List[dict]) -> Encoded:
        if "{% generation %}" not in self.tok.get_chat_template().replace("{%- generation %}", "{% generation %}"):
            raise TemplateError("the chat template rewrites earlier turns and has no {% generation %} markers, so "
                                "assistant tokens cannot be located; pass --tokenizer with a prefix-stable template")
        out = self.tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        return Encoded(list(out["input_ids"]), [int(x) for x in out["assistant_masks"]])


class _NotPrefixStable(Exception):
    pass
