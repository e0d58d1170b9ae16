"""The proxy's server-sent events: answers it turns into streams, and the decode instance's
streams it edits on the way (their first events only; the rest pass as bytes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.entrypoints.openai.errors import OpenAIError


def as_stream(answer: dict[str, Any], endpoint: str, include_usage: bool) -> list[str]:
    """A whole answer as the SSE events a stream of it would have been."""
    head = {k: answer[k] for k in ("id", "created", "model") if k in answer}
    events = []
    if endpoint == "completions":
        events.append({**head, "object": "text_completion", "choices": answer["choices"]})
    else:
        head["object"] = "chat.completion.chunk"
        for c in answer["choices"]:
            role = {"index": c["index"], "delta": {"role": "assistant", "content": ""}}
            events.append({**head, "choices": [{**role, "finish_reason": None}]})
            delta = {"content": (c.get("message") or {}).get("content") or ""}
            rest = {k: v for k, v in c.items() if k not in ("message", "index")}
            events.append({**head, "choices": [{"index": c["index"], "delta": delta, **rest}]})
    if include_usage and "usage" in answer:
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def first_token_events(hop_answer: dict[str, Any], endpoint: str) -> bytes:
    """The prefill instance's one-token answer (one choice) as the events that open the decode
    instance's stream of the request: the same chunks, the request not finished."""
    (choice,) = hop_answer["choices"]
    if endpoint == "completions":
        choice = {**choice, "finish_reason": None, "stop_reason": None}
    else:
        choice = {
            "index": choice["index"],
            "message": choice["message"],
            "token_ids": choice.get("token_ids"),
            "logprobs": choice.get("logprobs"),
            "finish_reason": None,
        }
    events = as_stream({**hop_answer, "choices": [choice]}, endpoint, include_usage=False)
    return "".join(events[:-1]).encode()  # not [DONE]: the decode instance's stream goes on


def error_event(error: OpenAIError) -> bytes:
    """How a stream that has begun tells its client that it failed."""
    return f"data: {json.dumps(error.body())}\n\n".encode()


async def edit_first_events(
    chunks: AsyncIterator[bytes],
    edit: Callable[[bytes], bytes | None],
    done: Callable[[], bool],
) -> AsyncIterator[bytes]:
    """A stream's events, cut anywhere into chunks, each through `edit` (its result replaces the
    event; None drops it) until `done()`; from then on the bytes as they come."""
    buffer = b""
    async for chunk in chunks:
        if done():
            yield chunk
            continue
        buffer += chunk
        *events, buffer = buffer.split(b"\n\n")
        out = b""
        for event in events:
            edited = event if done() else edit(event)
            if edited is not None:
                out += edited + b"\n\n"
        if done():
            out, buffer = out + buffer, b""
        if out:
            yield out
    if buffer:
        yield buffer


def without_first_token(chunks: AsyncIterator[bytes], endpoint: str) -> AsyncIterator[bytes]:
    """A decode instance's stream without the events of the token the prefill instance sampled
    (the proxy sent them already): its first chunk, and for chat the role chunk before it. An
    event that is not a chunk (an error) ends the dropping: it and all after it pass."""
    left = 1 if endpoint == "completions" else 2

    def edit(event: bytes) -> bytes | None:
        nonlocal left
        if not event.startswith(b"data: "):
            return event
        if event.startswith(b"data: {") and "choices" in json.loads(event[len(b"data: ") :]):
            left -= 1
            return None
        left = 0
        return event

    return edit_first_events(chunks, edit, lambda: left == 0)
