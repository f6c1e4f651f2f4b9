"""Conversation lines for extract (tools/conversations.py)."""
from __future__ import annotations


def test_conversation_lines_are_parsed_or_rejected_with_a_reason():
    from sglang_capture.tools.conversations import BadLine, Sample, parse_line

    s = parse_line('{"conversations": [{"from": "human", "value": "a"}, {"from": "gpt", "value": "b"}]}', 3)
    assert isinstance(s, Sample) and s.id == "line-00000003"
    assert s.messages == [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    assert parse_line('{"id": "x1", "text": "t"}', 1) == Sample("x1", 1, text="t")
    for text, reason in (("[1]", "not a JSON object"), ("{", "not valid JSON"), ('{"text": ""}', "needs"),
                         ('{"messages": [{"role": "user", "content": "q"}]}', "no assistant turn"),
                         ('{"id": "/etc/passwd", "text": "t"}', "cannot name a file"),
                         ('{"id": "' + "a" * 100 + '", "text": "t"}', "limit is 96")):
        bad = parse_line(text, 7)
        assert isinstance(bad, BadLine) and reason in str(bad) and str(bad).startswith("line 7:")
