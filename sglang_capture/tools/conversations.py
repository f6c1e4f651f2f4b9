"""Reading the input of ``extract``: a JSONL file of conversations, one sample per line.

Accepted line shapes (anything else is a bad line, reported with its number and skipped):

- ShareGPT: ``{"conversations": [{"from": "human"|"gpt"|"system"|..., "value": str}, ...]}``
- OpenAI:   ``{"messages": [{"role": "user"|"assistant"|"system"|..., "content": str}, ...]}``
- text:     ``{"text": str}`` (no chat template; every token is trained on)

An optional ``"id"`` names the sample (and its file); it must be a valid capture name and
unique in the file. Without one, the sample is ``line-<number>``, stable across re-runs.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, Iterator, List, Optional, Union

from sglang_capture.core.names import BadCaptureName, check_capture_name

SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                  "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "system": "system",
                  "tool": "tool", "function": "tool", "observation": "tool"}
OPENAI_ROLES = {"system", "user", "assistant", "tool", "developer"}
MAX_ID_LEN = 96  # leaves room for the attempt suffix inside a 128-character capture name


@dataclass(frozen=True)
class Sample:
    """One conversation (``messages`` in OpenAI form) or one plain ``text``."""

    id: str
    line: int
    messages: Optional[List[Dict[str, str]]] = None
    text: Optional[str] = None


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


@dataclass
class ReadResult:
    samples: List[Sample] = field(default_factory=list)
    bad: List[BadLine] = field(default_factory=list)


def _messages(doc: dict) -> List[Dict[str, str]]:
    if "conversations" in doc:
        turns, role_key, text_key = doc["conversations"], "from", "value"
    else:
        turns, role_key, text_key = doc["messages"], "role", "content"
    if not isinstance(turns, list) or not turns:
        raise ValueError("the conversation is empty or not a list")
    out = []
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get(role_key), str) or not isinstance(turn.get(text_key), str):
            raise ValueError(f"turn {k} needs string fields {role_key!r} and {text_key!r}")
        role = turn[role_key].lower()
        role = SHAREGPT_ROLES.get(role) if role_key == "from" else (role if role in OPENAI_ROLES else None)
        if role is None:
            raise ValueError(f"turn {k} has an unknown role {turn[role_key]!r}")
        out.append({"role": role, "content": turn[text_key]})
    if not any(m["role"] == "assistant" for m in out):
        raise ValueError("no assistant turn, so nothing to train on")
    return out


def parse_line(text: str, line: int) -> Union[Sample, BadLine]:
    """One JSONL line as a Sample, or the reason it is not one."""
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        return BadLine(line, f"not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(doc, dict):
        return BadLine(line, "not a JSON object")
    sample_id = f"line-{line:08d}"
    if "id" in doc:
        try:
            sample_id = check_capture_name(str(doc["id"]))
        except BadCaptureName as e:
            return BadLine(line, f"id {doc['id']!r} cannot name a file: {e}")
        if len(sample_id) > MAX_ID_LEN:
            return BadLine(line, f"id is {len(sample_id)} characters long; the limit is {MAX_ID_LEN}")
    try:
        if "conversations" in doc or "messages" in doc:
            return Sample(sample_id, line, messages=_messages(doc))
        if isinstance(doc.get("text"), str) and doc["text"]:
            return Sample(sample_id, line, text=doc["text"])
    except ValueError as e:
        return BadLine(line, str(e))
    return BadLine(line, "needs 'conversations' (ShareGPT), 'messages' (OpenAI) or a non-empty 'text'")


def iter_lines(path: str) -> Iterator[Union[Sample, BadLine]]:
    with open(path, encoding="utf-8", errors="strict") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield parse_line(raw, number)


def read_samples(path: str) -> ReadResult:
    """All samples of a JSONL file; bad lines and duplicate ids are collected, not raised."""
    result = ReadResult()
    seen: Dict[str, int] = {}
    try:
        for item in iter_lines(path):
            if isinstance(item, BadLine):
                result.bad.append(item)
            elif item.id in seen:
                result.bad.append(BadLine(item.line, f"id {item.id!r} already used on line {seen[item.id]}"))
            else:
                seen[item.id] = item.line
                result.samples.append(item)
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    return result
