"""/v1/chat/completions' request body: messages, tools and the tool choice."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    Field,
)

from pdserve.protocol import tool_calls
from pdserve.protocol.common import INTEGRAL, LOGPROBS, OpenAIBaseModel
from pdserve.protocol.sampling import SamplingRequest
from pdserve.sampling_params import StructuredOutputsParams
from pdserve.structured_output import grammar


class ChatMessage(OpenAIBaseModel):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[dict[str, Any]] | None = None
    # An assistant's earlier calls, and a tool message's answer to one.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(
                part.get("text", "") for part in self.content if part.get("type") == "text"
            )
        return self.content or ""


class FunctionDefinition(OpenAIBaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(OpenAIBaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(OpenAIBaseModel):
    name: str


class NamedToolChoice(OpenAIBaseModel):
    type: Literal["function"]
    function: NamedFunction


def _template_call(call: dict[str, Any]) -> dict[str, Any]:
    function = call.get("function")
    if isinstance(function, dict) and isinstance(function.get("arguments"), str):
        try:
            arguments = json.loads(function["arguments"])
        except json.JSONDecodeError:
            return call
        return {**call, "function": {**function, "arguments": arguments}}
    return call


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    # None: up to the model's context length.
    max_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), INTEGRAL] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, json_schema_extra=LOGPROBS), INTEGRAL] | None = None
    add_generation_prompt: bool = True

    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None

    def asked_max_tokens(self) -> int | None:
        """max_completion_tokens, or its older name."""
        return (
            self.max_completion_tokens
            if self.max_completion_tokens is not None
            else self.max_tokens
        )

    def asked_logprobs(self) -> int | None:
        """The top logprobs per token, when logprobs are asked for."""
        return (self.top_logprobs or 0) if self.logprobs else None

    def conversation(self) -> list[dict[str, Any]]:
        """The messages as chat templates read them: an earlier call's arguments as a dict
        (what templates that print them expect), as vLLM passes them."""
        conversation = []
        for m in self.messages:
            message: dict[str, Any] = {"role": m.role, "content": m.text()}
            if m.tool_calls:
                message["tool_calls"] = [_template_call(c) for c in m.tool_calls]
            if m.tool_call_id is not None:
                message["tool_call_id"] = m.tool_call_id
            if m.name is not None:
                message["name"] = m.name
            conversation.append(message)
        return conversation

    def template_tools(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    def tool_mode(self) -> str:
        """ "none", "auto", "required" or "named": what the answer may hold (tool_calls.py)."""
        if not self.tools:
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "named"
        return self.tool_choice or "auto"  # OpenAI's default with tools

    def tool_constraint(self) -> StructuredOutputsParams | None:
        """Structured outputs for "required" and a named function; ValueError naming the
        field for a tool choice the tools do not allow."""
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError(f"tool_choice {self.tool_choice!r} needs tools: the request has none.")
        for i, tool in enumerate(self.tools or ()):
            if tool.function.parameters is not None:
                grammar.check(
                    StructuredOutputsParams(json=tool.function.parameters),
                    f"tools[{i}].function.parameters",
                )
        mode = self.tool_mode()
        if mode == "named":
            name = self.tool_choice.function.name  # type: ignore[union-attr]
            chosen = [t for t in self.tools or () if t.function.name == name]
            if not chosen:
                raise ValueError(f"tool_choice names function {name!r}, which tools lacks.")
            return StructuredOutputsParams(json=chosen[0].function.parameters or {"type": "object"})
        if mode == "required":
            return StructuredOutputsParams(json=tool_calls.required_schema(self.template_tools()))
        return None
