"""Structured outputs over HTTP with the official client, on the default model: one instance,
and through the split (the prefill instance samples the first token under the grammar, the
decode instance continues its grammar from it). Outputs parse and match their constraint, the
split's equal the single instance's token for token, and bad constraints are 400s naming the
field, from the server and through the proxy."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import openai
import pytest

from pdserve.models.loader import default_model_path
from tests.utils.pd import start_instance
from tests.utils.server import RemoteServer

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


@pytest.fixture(scope="module")
def servers() -> Iterator[dict[str, Any]]:
    model = str(default_model_path())
    with (
        RemoteServer(["serve", model, "--dtype", "float32"]) as plain,
        start_instance(model, "kv_producer") as p,
        start_instance(model, "kv_consumer") as d,
        RemoteServer(
            [
                "proxy",
                "--prefill",
                p.url.removeprefix("http://"),
                "--decode",
                d.url.removeprefix("http://"),
                "--pd-min-uncached-tokens",
                "0",
            ]
        ) as proxy,
    ):
        yield {"model": model, "plain": plain, "proxy": proxy, "decode": d}


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


BAD = [
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
        "non-empty",
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
@pytest.mark.parametrize("case", range(len(BAD)))
def test_bad_constraints_are_400_naming_the_field(servers, where, case) -> None:
    kwargs, param, message = BAD[case]
    with pytest.raises(openai.BadRequestError) as e:
        servers[where].client().chat.completions.create(
            model=servers["model"], messages=PERSON, max_tokens=5, **kwargs
        )
    error = e.value.body
    assert error["param"] == param and message in error["message"], error
