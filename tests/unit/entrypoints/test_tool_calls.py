"""The tool-call parsers and the streamed deltas: a stream cut anywhere joins to what the
whole answer parses to."""

from __future__ import annotations

import json

import pytest

from pdserve.protocol.tool_calls import (
    TOOL_PARSERS,
    ToolCallStream,
    required_calls,
)

HERMES = 'Let me look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
SMOLLM2 = '<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": [1, 2]}}]</tool_call>'
TEXTS = [
    HERMES,
    SMOLLM2,
    HERMES + " and " + SMOLLM2,
    "no calls at all, but a < sign and <tool",
    "<tool_call>not json</tool_call> after",
    '<tool_call>{"name": "f", "arguments": {}}',  # never closed: text
]


def _calls(calls: list[dict]) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def test_whole_answers() -> None:
    parser = TOOL_PARSERS.get("hermes")()
    content, calls = parser.parse(HERMES)
    assert content == "Let me look. " and _calls(calls) == [("get_weather", {"city": "Paris"})]
    content, calls = TOOL_PARSERS.get("smollm2")().parse(SMOLLM2)
    assert content is None and _calls(calls) == [("a", {}), ("b", {"x": [1, 2]})]
    assert len({c["id"] for c in calls}) == 2
    assert parser.parse("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>",
        [],
    )


def _join(deltas: list[dict]) -> tuple[str | None, list[tuple[str, dict]]]:
    content, parts = "", {}
    for delta in deltas:
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            part = parts.setdefault(call["index"], {"name": None, "arguments": ""})
            part["name"] = call.get("function", {}).get("name") or part["name"]
            part["arguments"] += call.get("function", {}).get("arguments", "")
    calls = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    return (content if content.strip() else None), calls


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_auto_stream_joins_to_the_whole_answer(text: str, step: int) -> None:
    parser = TOOL_PARSERS.get("hermes")()
    stream = ToolCallStream("auto", parser=parser)
    deltas = []
    for i in range(0, len(text), step):
        deltas += stream.feed(text[i : i + step])
    deltas += stream.finish()
    content, calls = parser.parse(text)
    assert _join(deltas) == (content, _calls(calls))
    assert stream.called == bool(calls)


@pytest.mark.parametrize("step", [1, 5])
def test_named_and_required_streams(step: int) -> None:
    arguments = '{"city": "Rome"}'
    stream = ToolCallStream("named", name="get_weather")
    deltas = [
        d for i in range(0, len(arguments), step) for d in stream.feed(arguments[i : i + step])
    ]
    assert _join(deltas + stream.finish()) == (None, [("get_weather", {"city": "Rome"})])
    assert deltas[0]["tool_calls"][0]["id"].startswith("chatcmpl-tool-")
    array = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    stream = ToolCallStream("required")
    deltas = [d for i in range(0, len(array), step) for d in stream.feed(array[i : i + step])]
    assert deltas == []
    assert _join(stream.finish()) == (None, [("a", {"x": 1}), ("b", {})])
    assert _calls(required_calls(array)) == [("a", {"x": 1}), ("b", {})]
