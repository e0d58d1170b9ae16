"""Tool calling on chat completions (vLLM's behaviour, docs/serving.md "Tool calling").

`tool_choice` decides what the model may write:
- "none": text; the template still sees the tools.
- a named function: its arguments, held to the function's parameters schema by structured
  outputs; the answer is one call of it (finish_reason "stop", as OpenAI's).
- "required": a JSON array of one or more {"name", "parameters"} objects, each one of the
  tools, held so by structured outputs; each becomes a call (finish_reason "tool_calls").
- "auto": free text, which the server's `--tool-call-parser` reads calls from; it needs
  `--enable-auto-tool-choice`, as vLLM's does.

Parsers are registered by name. "hermes" reads `<tool_call>{"name": .., "arguments": {..}}
</tool_call>` blocks (Hermes, Qwen); "smollm2" the default model's `<tool_call>[{..}, ..]
</tool_call>` (a JSON list of calls in one block; examples/tool_chat_template_smollm2.jinja
puts the tools in its prompt). Text outside the blocks is the message's content.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any

from pdserve.registry import Registry

_OPEN, _CLOSE = "<tool_call>", "</tool_call>"


def call_id() -> str:
    return f"chatcmpl-tool-{secrets.token_hex(16)}"


def tool_call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {"id": call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def required_schema(tools: list[dict[str, Any]]) -> dict[str, Any]:
    """What tool_choice "required" lets the model write: calls of the request's tools."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "parameters": t["function"].get("parameters") or {"type": "object"},
                    },
                    "required": ["name", "parameters"],
                }
                for t in tools
            ]
        },
    }


def required_calls(text: str) -> list[dict[str, Any]]:
    return [tool_call(c["name"], c["parameters"]) for c in json.loads(text)]


class TaggedJsonToolParser:
    """Calls as JSON in <tool_call> blocks: one object per block, or a list of them."""

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, calls) of a whole answer; a block that is not valid JSON stays text."""
        calls: list[dict[str, Any]] = []
        content: list[str] = []
        rest = text
        while (start := rest.find(_OPEN)) >= 0:
            end = rest.find(_CLOSE, start)
            if end < 0:
                break
            found = _calls(rest[start + len(_OPEN) : end])
            if found is None:
                content.append(rest[: end + len(_CLOSE)])
            else:
                content.append(rest[:start])
                calls += found
            rest = rest[end + len(_CLOSE) :]
        content.append(rest)
        joined = "".join(content)
        return (joined if joined.strip() else None), calls


def _calls(block: str) -> list[dict[str, Any]] | None:
    try:
        parsed = json.loads(block)
    except json.JSONDecodeError:
        return None
    items = parsed if isinstance(parsed, list) else [parsed]
    if not all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in items):
        return None
    return [tool_call(c["name"], c.get("arguments", c.get("parameters", {}))) for c in items]


_TAGGED_JSON = f"{__name__}:TaggedJsonToolParser"
TOOL_PARSERS: Registry[type[TaggedJsonToolParser]] = Registry(
    "tool call parser", "--tool-call-parser", {"hermes": _TAGGED_JSON, "smollm2": _TAGGED_JSON}
)


@dataclass
class ToolCallStream:
    """Turns one choice's streamed text into OpenAI's deltas under `mode` ("auto", "named",
    "required"). A named call streams its arguments as they come; "auto" streams the text
    up to a <tool_call> block (holding back what may be its start) and each call once its
    block closes; "required" sends its calls when the array is complete, at the end."""

    mode: str
    name: str | None = None
    parser: TaggedJsonToolParser | None = None
    text: str = ""
    sent: int = 0  # characters of `text` sent as content (auto) or arguments (named)
    num_calls: int = 0
    _id: str = field(default_factory=call_id)

    def feed(self, delta: str) -> list[dict[str, Any]]:
        self.text += delta
        if self.mode == "named":
            return self._named(delta)
        if self.mode == "auto":
            return self._auto(final=False)
        return []

    def finish(self) -> list[dict[str, Any]]:
        if self.mode == "required":
            try:
                return [self._call_delta(c) for c in required_calls(self.text)]
            except (json.JSONDecodeError, KeyError, TypeError):
                return [{"content": self.text}] if self.text else []
        if self.mode == "auto":
            return self._auto(final=True)
        return []

    @property
    def called(self) -> bool:
        return self.num_calls > 0

    def _named(self, delta: str) -> list[dict[str, Any]]:
        if self.num_calls == 0:
            self.num_calls = 1
            head = {"index": 0, "id": self._id, "type": "function"}
            return [{"tool_calls": [{**head, "function": {"name": self.name, "arguments": delta}}]}]
        if not delta:
            return []
        return [{"tool_calls": [{"index": 0, "function": {"arguments": delta}}]}]

    def _auto(self, final: bool) -> list[dict[str, Any]]:
        deltas = []
        while True:
            pending = self.text[self.sent :]
            start = pending.find(_OPEN)
            if start < 0:
                # Hold back a tail that may be the start of a tag, unless the text ended.
                keep = 0 if final else _partial_tag(pending)
                if len(pending) > keep:
                    deltas.append({"content": pending[: len(pending) - keep]})
                    self.sent += len(pending) - keep
                return deltas
            if start:
                deltas.append({"content": pending[:start]})
                self.sent += start
                continue
            end = pending.find(_CLOSE)
            if end < 0:
                if final:  # an unclosed block is text
                    deltas.append({"content": pending})
                    self.sent += len(pending)
                return deltas
            calls = _calls(pending[len(_OPEN) : end])
            block_len = end + len(_CLOSE)
            if calls is None:
                deltas.append({"content": pending[:block_len]})
            else:
                deltas += [self._call_delta(c) for c in calls]
            self.sent += block_len

    def _call_delta(self, call: dict[str, Any]) -> dict[str, Any]:
        index = self.num_calls
        self.num_calls += 1
        return {"tool_calls": [{"index": index, **call}]}


def _partial_tag(text: str) -> int:
    """The length of the longest tail of `text` that starts <tool_call>."""
    for n in range(min(len(_OPEN) - 1, len(text)), 0, -1):
        if _OPEN.startswith(text[-n:]):
            return n
    return 0
