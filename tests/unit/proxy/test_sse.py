"""The proxy's own stream events: the prefill instance's first token as the chunks that open a
stream, and the decode instance's stream without its copy of them, cut anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from pdserve.protocol.errors import OpenAIError
from pdserve.proxy.sse import error_event, first_token_events, without_first_token

HEAD = {"id": "cmpl-r", "created": 1, "model": "m"}
LOGPROBS = {"tokens": ["a"], "token_logprobs": [-0.5], "top_logprobs": [{"a": -0.5}]}


def _hop(endpoint: str) -> dict:
    """A prefill instance's one-token answer."""
    if endpoint == "completions":
        choice = {"index": 0, "text": "a", "logprobs": LOGPROBS, "token_ids": [5]}
        choice |= {"finish_reason": "length", "stop_reason": None}
    else:
        choice = {"index": 0, "message": {"role": "assistant", "content": "a"}, "token_ids": [5]}
        choice |= {"logprobs": None, "finish_reason": "length", "stop_reason": None}
    return {**HEAD, "choices": [choice], "usage": {}, "kv_transfer_params": {}}


def _events(raw: bytes) -> list[dict | str]:
    return [
        json.loads(e.removeprefix("data: ")) if e.startswith("data: {") else e
        for e in raw.decode().split("\n\n")
        if e
    ]


def test_first_token_events_are_the_chunks_a_stream_opens_with() -> None:
    completion = _events(first_token_events(_hop("completions"), "completions", None))
    choice = {"index": 0, "text": "a", "logprobs": LOGPROBS, "token_ids": [5]}
    choice |= {"finish_reason": None, "stop_reason": None}
    assert completion == [{**HEAD, "object": "text_completion", "choices": [choice]}]
    chat = _events(first_token_events(_hop("chat/completions"), "chat/completions", None))
    head = {**HEAD, "object": "chat.completion.chunk"}
    role = {"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}
    token = {"index": 0, "delta": {"content": "a"}, "token_ids": [5], "logprobs": None}
    assert chat == [
        {**head, "choices": [role]},
        {**head, "choices": [{**token, "finish_reason": None}]},
    ]


def _decode_stream(endpoint: str) -> bytes:
    chunk = lambda text: {**HEAD, "choices": [{"index": 0, "text": text}]}  # noqa: E731
    events = [chunk("a"), chunk("b"), chunk("c")]
    if endpoint == "chat/completions":
        events.insert(0, {**HEAD, "choices": [{"index": 0, "delta": {"role": "assistant"}}]})
    return b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"


async def _cut(raw: bytes, size: int) -> AsyncIterator[bytes]:
    for i in range(0, len(raw), size):
        yield raw[i : i + size]


def _relayed(raw: bytes, size: int, endpoint: str) -> bytes:
    async def run() -> bytes:
        return b"".join([c async for c in without_first_token(_cut(raw, size), endpoint)])

    return asyncio.run(run())


@pytest.mark.parametrize("endpoint", ["completions", "chat/completions"])
@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_the_decode_stream_goes_on_without_its_first_token(endpoint: str, size: int) -> None:
    relayed = _events(_relayed(_decode_stream(endpoint), size, endpoint))
    assert [e["choices"][0]["text"] for e in relayed[:-1]] == ["b", "c"]
    assert relayed[-1] == "data: [DONE]"


@pytest.mark.parametrize("size", [1, 10_000])
def test_an_error_before_the_first_token_ends_the_dropping(size: int) -> None:
    """A decode instance whose load failed answers an error event: the client must see it, and
    whatever follows."""
    error = error_event(OpenAIError(500, "KV load failed"))
    raw = error + b"data: [DONE]\n\n"
    assert _relayed(raw, size, "chat/completions") == raw
    assert _events(error)[0]["error"]["message"] == "KV load failed"
