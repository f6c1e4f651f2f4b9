"""Chat templates rendered the way transformers renders them, without importing transformers.

``extract``'s first render imported transformers' ``render_jinja_template``, and with it the
transformers package: ~2 s on an H100 host while the other 255 workers waited on the import lock
(bench/RESULTS.md, r106). The template environment transformers builds is small: a sandboxed
jinja2 environment with ``trim_blocks`` and ``lstrip_blocks``, the ``loopcontrols`` extension, a
``{% generation %}`` tag, its own ``tojson`` filter and the ``raise_exception`` and
``strftime_now`` globals (``transformers.utils.chat_template_utils``, the same in 5.12 and 5.19).
It is rebuilt here. Whether it renders exactly as transformers does is checked against
transformers itself when the tokenizer cache is written (``agrees_with_transformers``: the same
environment, by its options, filters, tests, globals and tags, and the same text for every probe);
where it does not, the cache keeps rendering with transformers. ``VERSION`` names this renderer in
the cache, so that an entry checked against an older one is checked again.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Callable, Dict, List

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

VERSION = 1

# Conversations the cache renders both ways before it trusts this renderer: every role, a
# generation prompt or not, JSON-ish and non-ASCII content. Templates may refuse some (a
# raise_exception on an order they do not allow); both renderers must then refuse it alike.
PROBES: List[List[Dict[str, str]]] = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2? {\"a\": [1, 2]} <b>déjà</b> 東京"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "  spaced\n\nlines  "}],
    [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}, {"role": "tool", "content": "t"}],
    [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}],
]
_OPTIONS = ("block_start_string", "block_end_string", "variable_start_string", "variable_end_string",
            "comment_start_string", "comment_end_string", "line_statement_prefix", "line_comment_prefix",
            "trim_blocks", "lstrip_blocks", "newline_sequence", "keep_trailing_newline", "autoescape", "optimized",
            "undefined", "finalize", "is_async")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: transformers' tracker outside a mask request
    renders the body unchanged, so this one does only that."""

    tags = {"generation"}

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters; transformers' does not
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def compile_template(source: str) -> jinja2.Template:
    """The template compiled in transformers' environment; jinja2's errors pass through as they would there."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def render(template: jinja2.Template, conversation: List[dict], add_generation_prompt: bool,
           special_tokens: Dict[str, Any]) -> str:
    """What ``render_jinja_template`` renders for one conversation without tools, documents or masks."""
    return template.render(messages=conversation, tools=None, documents=None,
                           add_generation_prompt=add_generation_prompt, **special_tokens)


def _shape(env: Any) -> tuple:
    """What a template can see of an environment: its options, the names of its filters, tests and
    globals, and its extensions' tags (a global or tag transformers adds later, used only in a
    branch no probe reaches, would show here)."""
    return (tuple(repr(getattr(env, o, None)) for o in _OPTIONS), type(env).__name__, sorted(env.filters),
            sorted(env.tests), sorted(env.globals), sorted(tag for ext in env.extensions.values() for tag in ext.tags))


def agrees_with_transformers(source: str, special_tokens: Dict[str, Any]) -> bool:
    """Whether this renderer's environment is transformers' and it gives transformers' text (or
    refuses alike) on every probe, both ways of the generation prompt, at least one of them rendered.
    Called where transformers is loaded anyway: when the cache is written."""
    from transformers.utils.chat_template_utils import _compile_jinja_template, render_jinja_template

    try:
        ours = compile_template(source)
        if _shape(ours.environment) != _shape(_compile_jinja_template(source).environment):
            return False
    except Exception:  # noqa: BLE001 - a template either environment cannot compile: leave it to transformers
        return False
    rendered = False
    for conversation in PROBES:
        for prompt in (False, True):
            results = []
            for fn in (lambda: render(ours, conversation, prompt, special_tokens),
                       lambda: render_jinja_template(conversations=[conversation], chat_template=source,
                                                     add_generation_prompt=prompt, **special_tokens)[0][0]):
                try:
                    results.append(("text", fn()))
                except Exception as e:  # noqa: BLE001 - the template's own refusal must match, whatever it is
                    results.append(("error", type(e).__name__, str(e)))
            if results[0] != results[1]:
                return False
            rendered |= results[0][0] == "text"
    return rendered
