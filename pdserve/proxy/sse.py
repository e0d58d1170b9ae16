"""The proxy's server-sent events: answers it turns into streams, and the decode instance's
streams it edits on the way (their first events only; the rest pass as bytes)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from pdserve.protocol.errors import OpenAIError


def as_stream(answer: dict[str, Any], endpoint: str, include_usage: bool) -> list[str]:
    """A whole answer as the SSE events a stream of it would have been."""
    events = _chunks(answer, endpoint)
    if include_usage and "usage" in answer:
        head = {k: v for k, v in events[0].items() if k != "choices"}
        events.append({**head, "choices": [], "usage": answer["usage"]})
    return [f"data: {json.dumps(e)}\n\n" for e in events] + ["data: [DONE]\n\n"]


def _chunks(answer: dict[str, Any], endpoint: str) -> list[dict[str, Any]]:
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
    return events


def first_token_events(
    hop_answer: dict[str, Any], endpoint: str, stream_options: dict[str, Any] | None
) -> bytes:
    """The prefill instance's one-token answer (one choice) as the events that open the decode
    instance's stream of the request: the same chunks, the request not finished; with vLLM's
    continuous_usage_stats, each with the usage so far."""
    options = stream_options or {}
    continuous_usage = options.get("include_usage") and options.get("continuous_usage_stats")
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
    events = _chunks({**hop_answer, "choices": [choice]}, endpoint)
    usage = hop_answer.get("usage")
    if continuous_usage and usage is not None:
        prompt = usage["prompt_tokens"]
        # Chat's role chunk comes before any token, as a single instance counts it.
        before_token = {
            "prompt_tokens": prompt,
            "completion_tokens": 0,
            "total_tokens": prompt,
            "prompt_tokens_details": {"cached_tokens": 0},
        }
        for event in events:
            delta = event["choices"][0].get("delta") or {}
            event["usage"] = before_token if "role" in delta else usage
    # Not [DONE]: the decode instance's stream goes on.
    return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode()


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
