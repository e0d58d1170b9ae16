"""Structured outputs and tool calling over HTTP with the official client, on the default
model served with vLLM's tool flags (--chat-template examples/tool_chat_template_smollm2.jinja
--enable-auto-tool-choice --tool-call-parser smollm2; without tools the template renders what
the model's own does): one instance, and through the split (the prefill instance samples the
first token under the grammar, the decode instance continues its grammar from it).

Structured outputs parse and match their constraint, and the split's equal the single
instance's token for token. Tools: a named function and "required" (held to the tools by
structured outputs), "auto" (calls read from the text), "none"; streamed deltas join to the
whole answer. Bad constraints, tool definitions and choices are 400s naming the field, from
the server and through the proxy."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from pdserve.models.loader import default_model_path
from tests.utils.pd import split_proxy, start_instance
from tests.utils.server import RemoteServer, start_together

# Four default-model servers and 49 requests of up to 120 tokens: 2+ minutes on 2 cores. The
# default stage keeps the engine-level tests (tests/unit/engine/test_structured_outputs.py,
# tests/unit/entrypoints/test_tool_calls.py).
pytestmark = pytest.mark.slow

TEMPLATE = str(Path(__file__).parents[2] / "examples" / "tool_chat_template_smollm2.jinja")
TOOL_FLAGS = [
    "--chat-template",
    TEMPLATE,
    "--enable-auto-tool-choice",
    "--tool-call-parser",
    "smollm2",
]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "The local time in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 20}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, TIME]
ASK = [{"role": "user", "content": "What is the weather in Paris, in celsius?"}]
# What "auto" reads, forced by a grammar: the 135M model rarely calls on its own.
FORCED_CALL = (
    r'<tool_call>\[\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{1,10}", '
    r'"unit": "celsius"\}\}\]</tool_call>'
)


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    model = str(default_model_path())
    plain, p, d = start_together(
        lambda: RemoteServer(["serve", model, "--dtype", "float32", *TOOL_FLAGS]),
        lambda: start_instance(model, "kv_producer", extra_args=TOOL_FLAGS),
        lambda: start_instance(model, "kv_consumer", extra_args=TOOL_FLAGS),
    )
    with (
        plain,
        p,
        d,
        split_proxy(p, d) as proxy,
    ):
        yield {"model": model, "plain": plain, "proxy": proxy, "decode": d}


def _ask(server: RemoteServer, model: str, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """The answer as {content, calls: [(name, arguments)], finish_reason}, streamed or not."""
    client = server.client()
    args = {"model": model, "messages": ASK, "max_tokens": 60, "temperature": 0, "tools": TOOLS}
    args.update(kwargs)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        calls = choice.message.tool_calls or []
        for call in calls:
            assert call.id.startswith("chatcmpl-tool-") and call.type == "function"
        return {
            "content": choice.message.content,
            "calls": [(c.function.name, json.loads(c.function.arguments)) for c in calls],
            "finish_reason": choice.finish_reason,
        }
    content, finish, parts = "", None, {}
    for chunk in client.chat.completions.create(**args, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            part = parts.setdefault(call.index, {"name": None, "arguments": "", "id": None})
            if call.id:
                assert part["id"] is None and call.id.startswith("chatcmpl-tool-")
                part["id"] = call.id
            if call.function and call.function.name:
                part["name"] = call.function.name
            if call.function and call.function.arguments:
                part["arguments"] += call.function.arguments
        finish = chunk.choices[0].finish_reason or finish
    calls = [(p["name"], json.loads(p["arguments"])) for _, p in sorted(parts.items())]
    return {"content": content or None, "calls": calls, "finish_reason": finish}


def _check_weather(arguments: dict) -> None:
    assert set(arguments) == {"city", "unit"} and arguments["unit"] in ("celsius", "fahrenheit")
    assert isinstance(arguments["city"], str) and len(arguments["city"]) <= 20


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_named_function(servers, stream) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    answer = _ask(servers["plain"], servers["model"], stream, tool_choice=choice)
    assert answer["finish_reason"] == "stop" and not answer["content"]
    [(name, arguments)] = answer["calls"]
    assert name == "get_weather"
    _check_weather(arguments)
    split = _ask(servers["proxy"], servers["model"], stream, tool_choice=choice)
    assert split == answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_required(servers, stream) -> None:
    answer = _ask(
        servers["plain"], servers["model"], stream, tool_choice="required", max_tokens=120
    )
    assert answer["finish_reason"] == "tool_calls" and not answer["content"]
    assert answer["calls"]
    for name, arguments in answer["calls"]:
        assert name in ("get_weather", "get_time")
        if name == "get_weather":
            _check_weather(arguments)
    split = _ask(servers["proxy"], servers["model"], stream, tool_choice="required", max_tokens=120)
    assert split == answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_auto_reads_calls_from_the_text(servers, stream) -> None:
    answer = _ask(
        servers["plain"],
        servers["model"],
        stream,
        tool_choice="auto",
        extra_body={"structured_outputs": {"regex": FORCED_CALL}},
    )
    assert answer["finish_reason"] == "tool_calls" and not (answer["content"] or "").strip()
    [(name, arguments)] = answer["calls"]
    assert name == "get_weather" and arguments["unit"] == "celsius"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("tool_choice", ["auto", "none"])
def test_text_without_calls(servers, stream, tool_choice) -> None:
    answer = _ask(
        servers["plain"],
        servers["model"],
        stream,
        tool_choice=tool_choice,
        extra_body={"structured_outputs": {"choice": ["It is sunny in Paris."]}},
    )
    assert answer == {"content": "It is sunny in Paris.", "calls": [], "finish_reason": "stop"}


def test_a_conversation_with_calls_and_their_results(servers) -> None:
    client = servers["plain"].client()
    call = {
        "id": "chatcmpl-tool-1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'},
    }
    messages = [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "chatcmpl-tool-1", "content": "21 degrees, sunny"},
    ]
    answer = client.chat.completions.create(
        model=servers["model"], messages=messages, tools=TOOLS, tool_choice="none", max_tokens=20
    )
    assert answer.choices[0].message.content


BAD_TOOLS = [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "lacks"),
    (
        {
            "tools": [
                {
                    "type": "function",
                    "function": {"name": "f", "parameters": {"type": "object", "properties": 3}},
                }
            ]
        },
        "tools[0].function.parameters",
        "properties must be an object",
    ),
    ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools.0.function.name", ""),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools.0.type", ""),
    ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
    (
        {"tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
        "second structured-outputs constraint",
    ),
]


@pytest.mark.parametrize("where", ["plain", "proxy"])
@pytest.mark.parametrize("case", range(len(BAD_TOOLS)))
def test_bad_tools_are_400_naming_the_field(servers, where, case) -> None:
    kwargs, param, message = BAD_TOOLS[case]
    args = {"tools": TOOLS, **kwargs}
    if args["tools"] is None:
        del args["tools"]
    with pytest.raises(openai.BadRequestError) as e:
        servers[where].client().chat.completions.create(
            model=servers["model"], messages=ASK, max_tokens=5, **args
        )
    error = e.value.body
    assert error["param"] == param and message in error["message"], error


# ---- structured outputs ---------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "enum": ["Paris", "Rome", "Madrid"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
PERSON = [{"role": "user", "content": "Describe Ann, 31, who lives in Rome, as JSON."}]


def _check_person(text: str) -> bool:
    person = json.loads(text)
    assert set(person) == {"name", "age", "city"}
    assert isinstance(person["name"], str) and len(person["name"]) <= 12
    assert isinstance(person["age"], int) and 0 <= person["age"] <= 150
    assert person["city"] in ("Paris", "Rome", "Madrid")
    return True


CASES = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": SCHEMA},
            }
        },
        _check_person,
    ),
    (
        {"response_format": {"type": "json_object"}},
        lambda t: json.loads(t) == {"ok": True},
        'Reply with a JSON object with one key "ok" set to true.',
    ),
    (
        {"extra_body": {"structured_outputs": {"choice": ["yes", "no"]}}},
        lambda t: t in ("yes", "no"),
    ),
    (
        {"extra_body": {"structured_outputs": {"regex": r"[A-Z][a-z]{1,8}, [0-9]{1,3}"}}},
        lambda t: re.fullmatch(r"[A-Z][a-z]{1,8}, [0-9]{1,3}", t),
    ),
    (
        {"extra_body": {"structured_outputs": {"grammar": 'root ::= "age=" [0-9] [0-9]?'}}},
        lambda t: re.fullmatch(r"age=[0-9]{1,2}", t),
    ),
]


def _chat(
    server: RemoteServer, model: str, kwargs: dict, stream: bool, messages: list = PERSON
) -> tuple[str, str]:
    client = server.client()
    args = dict(model=model, messages=messages, max_tokens=80, temperature=0, **kwargs)
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**args, stream=True):
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
            finish = chunk.choices[0].finish_reason or finish
    return text, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_chat_output_obeys_its_constraint_alone_and_split(servers, case, stream) -> None:
    kwargs, check, *prompt = CASES[case]
    messages = [{"role": "user", "content": prompt[0]}] if prompt else PERSON
    plain, finish = _chat(servers["plain"], servers["model"], kwargs, stream, messages)
    assert finish == "stop", plain
    assert check(plain), plain
    split, finish = _chat(servers["proxy"], servers["model"], kwargs, stream, messages)
    assert (split, finish) == (plain, "stop")


def test_completions_take_response_format_too(servers) -> None:
    client = servers["plain"].client()
    completion = client.completions.create(
        model=servers["model"],
        prompt="Ann is 31 and lives in Rome. As JSON:",
        max_tokens=80,
        temperature=0,
        extra_body={
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": SCHEMA},
            }
        },
    )
    assert completion.choices[0].finish_reason == "stop"
    _check_person(completion.choices[0].text)


def test_the_decode_instance_continues_the_prefill_instances_grammar(servers) -> None:
    """The KV and the first token came from the prefill instance: the split really ran."""
    decode = servers["decode"]
    before = decode.metric("kv_transfers_total")
    raw = (
        servers["proxy"]
        .client()
        .chat.completions.with_raw_response.create(
            model=servers["model"],
            messages=PERSON,
            max_tokens=80,
            temperature=0,
            response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
        )
    )
    assert raw.headers["X-PD-Path"].startswith("remote")
    _check_person(raw.parse().choices[0].message.content)
    assert decode.metric("kv_transfers_total") == before + 1


BAD_CONSTRAINTS = [
    (
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": {"type": "object", "properties": 5}},
            }
        },
        "response_format.json_schema.schema",
        "properties must be an object",
    ),
    (
        {"response_format": {"type": "json_schema"}},
        "response_format.json_schema.schema",
        "required",
    ),
    (
        {"extra_body": {"structured_outputs": {"regex": "[a-"}}},
        "structured_outputs.regex",
        "Unclosed '['",
    ),
    (
        {"extra_body": {"structured_outputs": {"grammar": "root ::= b"}}},
        "structured_outputs.grammar",
        'Rule "b" is not defined',
    ),
    (
        {"extra_body": {"structured_outputs": {"choice": []}}},
        "structured_outputs.choice",
        "at least 1 item",
    ),
    (
        {"extra_body": {"structured_outputs": {"regex": "a", "choice": ["a"]}}},
        "structured_outputs",
        "exactly one",
    ),
    (
        {"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a+"}},
        "guided_regex",
        "a second structured-outputs constraint",
    ),
]


@pytest.mark.parametrize("where", ["plain", "proxy"])
@pytest.mark.parametrize("case", range(len(BAD_CONSTRAINTS)))
def test_bad_constraints_are_400_naming_the_field(servers, where, case) -> None:
    kwargs, param, message = BAD_CONSTRAINTS[case]
    with pytest.raises(openai.BadRequestError) as e:
        servers[where].client().chat.completions.create(
            model=servers["model"], messages=PERSON, max_tokens=5, **kwargs
        )
    error = e.value.body
    assert error["param"] == param and message in error["message"], error
