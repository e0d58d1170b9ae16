"""The proxy's merge of the prefill hop's prompt logprobs into the decode instance's answer:
whole answers, and streams whose events arrive cut anywhere."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from pdserve.proxy.prompt_logprobs import PromptLogprobs

PROMPT_TABLE = [None, {"9": {"logprob": -1.0, "rank": 2, "decoded_token": "b"}}]


def hop_choice(index: int) -> dict:
    """A prefill hop's choice for a two-token prompt: echo + logprobs, one generated token."""
    return {
        "index": index,
        "text": "ab" + "c",
        "token_ids": [5],
        "logprobs": {
            "tokens": ["a", "b", "c"],
            "token_logprobs": [None, -1.0 - index, -0.5],
            "top_logprobs": [None, {"b": -1.0 - index}, {"c": -0.5}],
            "text_offset": [0, 1, 2],
        },
        "prompt_logprobs": PROMPT_TABLE,
    }


def decode_choice(index: int, first: bool) -> dict:
    """The decode instance's: the echoed prompt's entries without values (first chunk only)."""
    tokens = ["a", "b", "c", "d"] if first else ["e"]
    return {
        "index": index,
        "text": "".join(tokens),
        "token_ids": [5, 6] if first else [7],
        "logprobs": {
            "tokens": tokens,
            "token_logprobs": [None, None, -0.5, -0.25] if first else [-0.125],
            "top_logprobs": [None, None, {"c": -0.5}, {"d": -0.25}] if first else [{"e": -0.125}],
            "text_offset": [0, 1, 2, 3] if first else [4],
        },
    }


def test_from_hop_asks_only_what_the_client_asked() -> None:
    answer = {"choices": [hop_choice(0)]}
    assert PromptLogprobs.from_hop({"prompt": "ab"}, answer, "completions") is None
    assert PromptLogprobs.from_hop({"echo": True}, answer, "completions") is None
    echoed = PromptLogprobs.from_hop({"echo": True, "logprobs": 1}, answer, "completions")
    assert echoed is not None and echoed.echoed == {0: ([None, -1.0], [None, {"b": -1.0}])}
    assert not echoed.prompt_logprobs


def test_whole_answers() -> None:
    hop = {"choices": [hop_choice(0), hop_choice(1)]}  # two prompts
    body = {"n": 2, "echo": True, "logprobs": 1, "prompt_logprobs": 1}
    merge = PromptLogprobs.from_hop(body, hop, "completions")
    assert merge is not None
    answer = {"choices": [decode_choice(i, first=True) for i in range(4)]}
    merge.fill_answer(answer)
    for choice in answer["choices"]:
        prompt = choice["index"] // 2
        assert choice["prompt_logprobs"] == PROMPT_TABLE
        assert choice["logprobs"]["token_logprobs"] == [None, -1.0 - prompt, -0.5, -0.25]
        assert choice["logprobs"]["top_logprobs"][1] == {"b": -1.0 - prompt}
    chat = PromptLogprobs.from_hop(
        {"prompt_logprobs": 0}, {"prompt_logprobs": PROMPT_TABLE}, "chat/completions"
    )
    assert chat is not None
    chat_answer: dict = {"choices": []}
    chat.fill_answer(chat_answer)
    assert chat_answer["prompt_logprobs"] == PROMPT_TABLE


async def _cut(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]
        await asyncio.sleep(0)


@pytest.mark.parametrize("size", [1, 7, 10_000])
def test_stream_fills_each_choices_first_chunk(size: int) -> None:
    body = {"n": 2, "echo": True, "logprobs": 1, "stream": True}
    merge = PromptLogprobs.from_hop(body, {"choices": [hop_choice(0)]}, "completions")
    assert merge is not None
    events = [
        {"choices": [decode_choice(1, first=True)]},
        {"choices": [decode_choice(0, first=True)]},
        {"choices": [decode_choice(1, first=False)]},
        {"choices": [], "usage": {"prompt_tokens": 2}},
    ]
    raw = b"".join(f"data: {json.dumps(e)}\n\n".encode() for e in events) + b"data: [DONE]\n\n"

    async def relay() -> bytes:
        return b"".join([chunk async for chunk in merge.fill_stream(_cut(raw, size))])

    out = asyncio.run(relay()).decode()
    assert out.endswith("data: [DONE]\n\n")
    got = [json.loads(e.removeprefix("data: ")) for e in out.split("\n\n")[:-2]]
    assert len(got) == len(events)
    for event in got[:2]:
        (choice,) = event["choices"]
        assert choice["logprobs"]["token_logprobs"][:2] == [None, -1.0]
    assert got[2:] == events[2:]  # later chunks untouched
